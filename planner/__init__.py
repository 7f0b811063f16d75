"""The placement planner: where each node serves which blocks, and how requests are routed.

Pure and self-contained (no torch, no network): plain data in, plain data out. One subpackage per concept;
this top level is the facade and the types every part shares.

* :func:`plan`, :func:`plan_all`, :func:`plan_replicas`, :func:`score` (:mod:`planner.api`) — one call per kind
  of algorithm; :mod:`planner.registry` — every algorithm by name: its kind, how to run it, its options type;
  :mod:`planner.options` — each algorithm's options, one frozen dataclass each, checked when built.
* :mod:`planner.placement`, :mod:`planner.replicas` — the plan types; :mod:`planner.flow_graph` — Helix's flow
  graph, max flow and best-pipeline latency; :mod:`planner.routing` (with :mod:`planner.swrr`) — IWRR
  per-request pipelines with KV-cache high-water masking; :mod:`planner.errors` — :class:`PlannerError` and
  :class:`CannotPlaceError`; :mod:`planner.tables` — the text tables of ``swarmnode plan``.
* :mod:`planner.cluster` — the cluster: typed specs (``spec``, format in ``planner/clusters/README.md``), the
  specs shipped in ``planner/clusters/`` (``shipped``), synthetic swarms (``synthetic``), Helix's GPU profiles.
* :mod:`planner.costs` — cost models: ``roofline`` (HexGen Eqs. 4-7, Helix's ``T_j`` and link capacities),
  ``helix_profiled`` (Helix's measured profiles), ``factory`` (either by name), HexGen's per-GPU stage costs.
* :mod:`planner.algorithms` — one algorithm per module: Helix's MILP, LLaMPS' GMA and AHP-based OPA, the
  Petals and SWARM-paper baselines, HexGen and HexGen-2.
* :mod:`planner.search` — the MILP's search portfolio, coverage and flow beams, proven upper bounds, the
  redundancy floor, partitioning, the HiGHS model builder.
* :mod:`planner.simulator` — the discrete-event serving simulator and planning-then-scoring.
* :mod:`planner.live` — re-planning a live swarm (the coordinator's) while moving as few blocks as possible.
"""


from .algorithms.ahp import (
    DEFAULT_MATRIX,
    LLAMPS_MATRIX,
    AHPError,
    PairwiseMatrix,
    ahp,
    ahp_ranking,
    ahp_weights,
)
from .algorithms.gma import gma
from .algorithms.milp import MilpResult, Progress, milp
from .algorithms.petals import petals, petals_orders
from .algorithms.swarm_baseline import swarm
from .api import PlanResult, plan, plan_all, plan_replicas, score
from .cluster.shipped import list_shared_clusters, load_shared_cluster, resolve_cluster, shared_clusters_dir
from .cluster.spec import (
    COORDINATOR,
    Cluster,
    LinkSpec,
    ModelSpec,
    NetworkSpec,
    NodeSpec,
    SpecError,
    Workload,
    cluster_from_dict,
    cluster_to_dict,
    load_cluster,
)
from .cluster.synthetic import synthetic_cluster
from .costs.factory import COST_MODELS, make_cost_model
from .costs.helix_profiled import HelixCostModel
from .costs.roofline import CostModel, CostParams, block_capacity, link_capacity, node_throughput
from .errors import CannotPlaceError, PlannerError
from .flow_graph import SINK, SOURCE, Evaluation, Stage, build_flow_graph, evaluate
from .options import (
    AhpOptions,
    AlgorithmOptions,
    GmaOptions,
    HexGen2Options,
    HexGenOptions,
    MilpOptions,
    PetalsOptions,
    SwarmOptions,
)
from .placement import Placement, PlacementError, placement_problems, validate_placement
from .registry import ALGORITHMS, PLACEMENT_ALGORITHMS, REGISTRY, REPLICA_ALGORITHMS, Algorithm
from .routing import KVTracker, RouterState, RoutingTable, next_hop, route
from .search.bounds import coordinator_bound, coverage_bound

__all__ = [
    "ALGORITHMS",
    "COORDINATOR",
    "COST_MODELS",
    "DEFAULT_MATRIX",
    "LLAMPS_MATRIX",
    "PLACEMENT_ALGORITHMS",
    "REGISTRY",
    "REPLICA_ALGORITHMS",
    "SINK",
    "SOURCE",
    "AHPError",
    "AhpOptions",
    "Algorithm",
    "AlgorithmOptions",
    "CannotPlaceError",
    "Cluster",
    "CostModel",
    "CostParams",
    "Evaluation",
    "GmaOptions",
    "HelixCostModel",
    "HexGen2Options",
    "HexGenOptions",
    "KVTracker",
    "LinkSpec",
    "MilpOptions",
    "MilpResult",
    "ModelSpec",
    "NetworkSpec",
    "NodeSpec",
    "PairwiseMatrix",
    "PetalsOptions",
    "Placement",
    "PlacementError",
    "PlanResult",
    "PlannerError",
    "Progress",
    "RouterState",
    "RoutingTable",
    "SpecError",
    "Stage",
    "SwarmOptions",
    "Workload",
    "ahp",
    "ahp_ranking",
    "ahp_weights",
    "block_capacity",
    "build_flow_graph",
    "cluster_from_dict",
    "cluster_to_dict",
    "coordinator_bound",
    "coverage_bound",
    "evaluate",
    "gma",
    "link_capacity",
    "list_shared_clusters",
    "load_cluster",
    "load_shared_cluster",
    "make_cost_model",
    "milp",
    "next_hop",
    "node_throughput",
    "petals",
    "petals_orders",
    "placement_problems",
    "plan",
    "plan_all",
    "plan_replicas",
    "resolve_cluster",
    "route",
    "score",
    "shared_clusters_dir",
    "swarm",
    "synthetic_cluster",
    "validate_placement",
]
