"""The placement planner: where each node serves which blocks, and how requests are routed.

Pure and self-contained (no torch, no network): plain data in, plain data out.

* :mod:`planner.cluster` — cluster specs (``planner/clusters/README.md``) as typed objects.
* :mod:`planner.specs` — the specs shipped in ``planner/clusters/``; a spec by path or by name.
* :mod:`planner.registry` — every algorithm by name: its kind, how to run it, its options.
* :mod:`planner.cost_model` — the roofline cost model: HexGen Eqs. 4-7, Helix's ``T_j`` and link capacities.
* :mod:`planner.helix_cost_model`, :mod:`planner.helix_profiles` — Helix's cost model from its measured GPU
  profiles; :mod:`planner.cost_models` — either by name (``make_cost_model``).
* :mod:`planner.synthetic` — seeded synthetic clusters past the papers' scale.
* :mod:`planner.flow_graph` — Helix's flow graph, max flow and best-pipeline latency.
* :mod:`planner.gma`, :mod:`planner.ahp` — LLaMPS' greedy memory algorithm and AHP-based OPA.
* :mod:`planner.petals`, :mod:`planner.swarm` — the Petals and SWARM baselines.
* :mod:`planner.milp` — Helix's MILP on HiGHS; :mod:`planner.milp_formulations` — its per-node and typed
  formulations; :mod:`planner.placement_search` — the heuristic and local search around the solver.
* :mod:`planner.flow_beam` — a beam search building placements with a feasible flow (slow links).
* :mod:`planner.bounds` — proven upper bounds (Helix's, the coordinator cut, the coverage bound).
* :mod:`planner.sticky` — re-planning a live swarm while moving as few blocks as possible.
* :mod:`planner.routing` — IWRR per-request pipelines with KV-cache high-water masking.
* :mod:`planner.errors` — :class:`PlannerError` and :class:`CannotPlaceError`.
* :func:`plan`, :func:`plan_all`, :func:`plan_replicas` — one call per kind of algorithm.
"""

from .ahp import DEFAULT_MATRIX, LLAMPS_MATRIX, AHPError, PairwiseMatrix, ahp, ahp_ranking, ahp_weights
from .api import PlanResult, plan, plan_all, plan_replicas, score
from .bounds import coordinator_bound, coverage_bound
from .cluster import (
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
from .cost_model import CostModel, CostParams, block_capacity, link_capacity, node_throughput
from .cost_models import COST_MODELS, make_cost_model
from .errors import CannotPlaceError, PlannerError
from .flow_graph import SINK, SOURCE, Evaluation, Stage, build_flow_graph, evaluate
from .gma import gma
from .helix_cost_model import HelixCostModel
from .milp import MilpResult, Progress, milp
from .petals import petals, petals_orders
from .placement import Placement, PlacementError, placement_problems, validate_placement
from .registry import ALGORITHMS, PLACEMENT_ALGORITHMS, REGISTRY, REPLICA_ALGORITHMS, Algorithm
from .routing import KVTracker, RouterState, RoutingTable, next_hop, route
from .specs import list_shared_clusters, load_shared_cluster, resolve_cluster, shared_clusters_dir
from .swarm import swarm
from .synthetic import synthetic_cluster

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
    "Algorithm",
    "CannotPlaceError",
    "Cluster",
    "CostModel",
    "CostParams",
    "Evaluation",
    "HelixCostModel",
    "KVTracker",
    "LinkSpec",
    "MilpResult",
    "ModelSpec",
    "NetworkSpec",
    "NodeSpec",
    "PairwiseMatrix",
    "Placement",
    "PlacementError",
    "PlanResult",
    "PlannerError",
    "Progress",
    "RouterState",
    "RoutingTable",
    "SpecError",
    "Stage",
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
