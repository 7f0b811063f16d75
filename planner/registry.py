"""Every planning algorithm by name: what it plans, how it is run and which options it takes.

The planner has two kinds of algorithms:

* node placement (:data:`PLACEMENT`): a contiguous block range per node (Helix §4.1), scored on Helix's
  flow graph (§4.3) by :func:`planner.api.plan`: Helix's MILP (§4.4), LLaMPS' AHP-based OPA and GMA
  (Alg. 1-2), and the Petals and SWARM baselines of Helix §6;
* model replicas (:data:`REPLICAS`): groups of GPUs, each a pipeline of tensor-parallel stages (HexGen §3;
  HexGen-2 §3-4 also gives each group a role, prefill or decode), run by :func:`planner.api.plan_replicas`.

The command line (``plan``, ``simulate``, ``join``, ``coordinate``), the coordinator, the simulator's
scoring (:mod:`planner.scoring`) and the benchmarks read :data:`REGISTRY` and nothing else, so a new
algorithm is its module plus one :class:`Algorithm` line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .ahp import DEFAULT_KNEE, PairwiseMatrix, ahp
from .cluster import Cluster
from .cost_model import CostModel
from .errors import PlannerError
from .gma import gma
from .milp import milp
from .petals import petals
from .placement import Placement
from .swarm import swarm

__all__ = [
    "ALGORITHMS",
    "COORDINATOR_ALGORITHMS",
    "MIN_REPLICAS",
    "PLACEMENT",
    "PLACEMENT_ALGORITHMS",
    "PLAN_OPTIONS",
    "REGISTRY",
    "REPLICAS",
    "REPLICA_ALGORITHMS",
    "Algorithm",
    "Solved",
    "lookup",
]

PLACEMENT = "placement"
REPLICAS = "replicas"

#: Options :func:`planner.api.plan` itself applies to every node placement: its flow-graph scoring
#: connects a request into a node mid-range only with ``partial_inference`` (Helix §4.4).
PLAN_OPTIONS = frozenset({"partial_inference"})


@dataclass(frozen=True)
class Solved:
    """What a node-placement runner returns: the placement, the upper bounds on its max flow that the
    algorithm proved (named as in :mod:`planner.bounds`; empty for heuristics), details for
    :attr:`planner.api.PlanResult.details`, and for a solver the phases it ran
    (:attr:`planner.milp.MilpResult.phases`, from which :func:`planner.milp.model_size` says what it solved)."""

    placement: Placement
    bounds: Mapping[str, float] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)
    solver_phases: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class Algorithm:
    """One planning algorithm.

    ``run``: for :data:`PLACEMENT`, ``run(cluster, cost, **options) -> Solved``; for :data:`REPLICAS`,
    ``run(cluster, **options)`` returning a result with ``to_json()``, where ``lengths`` (a HexGen-2
    workload name, ``(s_in, s_out)`` or None for the spec's averages) is the planning request.
    ``options``: what a user may tune (the CLI checks its flags against them); ``internal``: options
    programs pass (warm starts, progress callbacks, cost parameters). ``serving`` (replicas only) builds
    the serving simulator's model of a result: ``serving(cluster, result, params)``; ``table`` renders
    a result as the text ``swarmnode plan`` prints: ``table(cluster, result)``.

    Capabilities: ``solver`` (a mathematical program whose size a plan reports, Helix Table 8);
    ``live_phases`` (a coordinator can plan a live swarm with it in two phases, prefill and decode, through
    :mod:`planner.sticky_phases`; the other live algorithms are the node placements, through
    :mod:`planner.sticky`).
    """

    name: str
    kind: str
    summary: str
    run: Callable[..., Any]
    options: frozenset[str] = frozenset()
    internal: frozenset[str] = frozenset()
    serving: Callable[..., Any] | None = None
    table: Callable[..., str] | None = None
    solver: bool = False
    live_phases: bool = False

    @property
    def accepts(self) -> frozenset[str]:
        """Every keyword option ``run`` takes."""
        return self.options | self.internal

    def applies(self, option: str) -> bool:
        """Whether a user-tunable ``option`` changes what this algorithm does."""
        return option in self.options or (self.kind == PLACEMENT and option in PLAN_OPTIONS)


# ---------------------------------------------------------------------------------------------------
# Runners: each algorithm's function called with the registry's uniform arguments
# ---------------------------------------------------------------------------------------------------


def _milp(cluster: Cluster, cost: CostModel, **options: Any) -> Solved:
    result = milp(cluster, cost=cost, **options)
    details: dict[str, object] = {
        "formulation": result.formulation,
        "status": result.status,
        "solver_bound": result.solver_bound,
        "start_algorithm": result.start_algorithm,
        "phases": list(result.phases),
    }
    if result.floor is not None and result.floor.min_replicas > 1:
        details["floor"] = result.floor.to_dict()
    return Solved(result.placement, dict(result.bounds), details, solver_phases=tuple(result.phases))


def _ahp(
    cluster: Cluster, cost: CostModel, *, ahp_matrix: PairwiseMatrix | None = None, knee: int = DEFAULT_KNEE
) -> Solved:
    return Solved(ahp(cluster, matrix=ahp_matrix, knee=knee, cost=cost))


def _gma(cluster: Cluster, cost: CostModel) -> Solved:
    return Solved(gma(cluster))  # LLaMPS Alg. 2 sizes by memory alone: the cost model plays no part


def _petals(
    cluster: Cluster, cost: CostModel, *, seed: int | None = 0, rebalance: bool = False,
    order: list[str] | None = None, min_replicas: int = 1,
) -> Solved:
    placement = petals(cluster, cost=cost, seed=seed, rebalance=rebalance, order=order, min_replicas=min_replicas)
    return Solved(placement, details={"seed": None if order is not None else seed, "rebalance": rebalance})


def _swarm(cluster: Cluster, cost: CostModel, *, min_replicas: int = 1) -> Solved:
    return Solved(swarm(cluster, cost=cost, min_replicas=min_replicas))


def _hexgen(cluster: Cluster, *, lengths: str | tuple[int, int] | None = None, **options: Any):
    from .hexgen import plan_hexgen
    from .hexgen2 import workload_task

    return plan_hexgen(cluster, task=None if lengths is None else workload_task(cluster, lengths), **options)


def _hexgen2(cluster: Cluster, *, lengths: str | tuple[int, int] | None = None, **options: Any):
    from .hexgen2 import plan_hexgen2

    return plan_hexgen2(cluster, workload=lengths, **options)


def _hexgen_serving(cluster: Cluster, result, params):
    from .sim_serving import serving_from_replicas

    return serving_from_replicas(cluster, result.replicas, params=params)


def _hexgen2_serving(cluster: Cluster, result, params):
    from .sim_serving import serving_from_disaggregated

    return serving_from_disaggregated(
        cluster, result.prefill, result.decode, result.source_flow, result.kv_routing, params=params
    )


def _hexgen_table(cluster: Cluster, result) -> str:
    from .tables import hexgen_table

    return hexgen_table(cluster, result)


def _hexgen2_table(cluster: Cluster, result) -> str:
    from .tables import hexgen2_table

    return hexgen2_table(cluster, result)


#: The redundancy floor (:mod:`planner.redundancy`): every block on at least this many nodes where the
#: offers allow it. The algorithms that take it place for it; :func:`planner.api.plan` reports the blocks
#: below it whatever the algorithm.
MIN_REPLICAS = "min_replicas"
_MILP_OPTIONS = frozenset({"time_limit", "gap", "formulation", "partial_inference", MIN_REPLICAS})
_MILP_INTERNAL = frozenset({"link_degree", "mip_rel_gap", "warm_start", "seed", "progress"})
#: Helix's Petals baseline: the seed of its join order and the rebalancing pass Helix's code lacks.
_PETALS_OPTIONS = frozenset({"seed", "rebalance", MIN_REPLICAS})
_HEXGEN_OPTIONS = frozenset(
    {"time_limit", "seed", "lengths", "generations", "population", "rate", "slo_scale", "sim_duration",
     "max_stages"}
)
_HEXGEN2_OPTIONS = frozenset({"time_limit", "seed", "lengths", "kv_batch", "max_iterations"})

#: Every algorithm by name, in the order ``plan --algorithm all`` and the benchmarks list them.
REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("milp", PLACEMENT, "Helix's MILP (§4.4)", _milp, _MILP_OPTIONS, _MILP_INTERNAL, solver=True),
        Algorithm("ahp", PLACEMENT, "LLaMPS' OPA with AHP scores (Alg. 1)", _ahp,
                  internal=frozenset({"ahp_matrix", "knee"})),
        Algorithm("gma", PLACEMENT, "LLaMPS' greedy memory algorithm (Alg. 2)", _gma),
        Algorithm("petals", PLACEMENT, "Petals' block selection (Helix §6.6)", _petals, _PETALS_OPTIONS,
                  frozenset({"order"})),
        Algorithm("swarm", PLACEMENT, "SWARM's equal stages (Helix §6)", _swarm, frozenset({MIN_REPLICAS})),
        Algorithm("hexgen", REPLICAS, "genetic search over replica groups (HexGen §4)", _hexgen,
                  _HEXGEN_OPTIONS, frozenset({"params", "offspring", "beam"}), _hexgen_serving,
                  _hexgen_table),
        Algorithm("hexgen2", REPLICAS, "partition and refinement of prefill/decode groups (HexGen-2 §4)",
                  _hexgen2, _HEXGEN2_OPTIONS, frozenset({"params", "lookahead"}), _hexgen2_serving,
                  _hexgen2_table, live_phases=True),
    )
}

ALGORITHMS: tuple[str, ...] = tuple(REGISTRY)
PLACEMENT_ALGORITHMS: tuple[str, ...] = tuple(n for n, a in REGISTRY.items() if a.kind == PLACEMENT)
REPLICA_ALGORITHMS: tuple[str, ...] = tuple(n for n, a in REGISTRY.items() if a.kind == REPLICAS)
#: What a coordinator plans a live swarm with: every node placement, and HexGen-2's two phases adapted to swarm
#: nodes (:mod:`planner.hexgen2_swarm`: one device per node, measured speeds; phases, ranges and KV links).
COORDINATOR_ALGORITHMS: tuple[str, ...] = (*PLACEMENT_ALGORITHMS,
                                           *(n for n, a in REGISTRY.items() if a.live_phases))


def lookup(name: str, kind: str | None = None) -> Algorithm:
    """The registry entry of ``name``; a :class:`PlannerError` (code ``unknown_algorithm``) names the
    choices when there is none (of ``kind``, when given)."""
    entry = REGISTRY.get(name)
    if entry is None or (kind is not None and entry.kind != kind):
        choices = [n for n, a in REGISTRY.items() if kind is None or a.kind == kind]
        what = "algorithm" if kind is None else f"{kind} algorithm"
        raise PlannerError(
            f"unknown {what} {name!r}; choose one of {', '.join(choices)}", code="unknown_algorithm"
        )
    return entry
