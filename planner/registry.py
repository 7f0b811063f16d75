"""Every planning algorithm by name: what it plans, how it is run and which options it takes.

The planner has two kinds of algorithms:

* node placement (:data:`PLACEMENT`): a contiguous block range per node (Helix §4.1), scored on Helix's
  flow graph (§4.3) by :func:`planner.api.plan`: Helix's MILP (§4.4), LLaMPS' AHP-based OPA and GMA
  (Alg. 1-2), and the Petals and SWARM baselines of Helix §6;
* model replicas (:data:`REPLICAS`): groups of GPUs, each a pipeline of tensor-parallel stages (HexGen §3;
  HexGen-2 §3-4 also gives each group a role, prefill or decode), run by :func:`planner.api.plan_replicas`.

The command line (``plan``, ``simulate``, ``join``, ``coordinate``), the coordinator, the simulator's
scoring (:mod:`planner.simulator.scoring`) and the benchmarks read :data:`REGISTRY` and nothing else, so a new
algorithm is its module (:mod:`planner.algorithms`), its options type (:mod:`planner.options`) and one
:class:`Algorithm` line here. Callers build an algorithm's options with :meth:`Algorithm.options`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .algorithms.ahp import ahp
from .algorithms.gma import gma
from .algorithms.milp import milp
from .algorithms.petals import petals
from .algorithms.swarm_baseline import swarm
from .cluster.spec import Cluster
from .costs.roofline import CostModel
from .errors import PlannerError
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
from .placement import Placement

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
    "PlacementRunner",
    "ReplicaRunner",
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
    algorithm proved (named as in :mod:`planner.search.bounds`; empty for heuristics), details for
    :attr:`planner.api.PlanResult.details`, and for a solver the phases it ran
    (:attr:`planner.algorithms.milp.MilpResult.phases`, from which :func:`planner.algorithms.milp.model_size` says what it solved)."""

    placement: Placement
    bounds: Mapping[str, float] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)
    solver_phases: tuple[Mapping[str, Any], ...] | None = None


#: A node placement's runner: ``run(cluster, cost, options) -> Solved``, ``options`` of its options type.
PlacementRunner = Callable[[Cluster, CostModel, Any], "Solved"]
#: A replica algorithm's runner: ``run(cluster, options)``, a result with ``to_json()``.
ReplicaRunner = Callable[[Cluster, Any], Any]


@dataclass(frozen=True)
class Algorithm:
    """One planning algorithm.

    ``run``: for :data:`PLACEMENT`, ``run(cluster, cost, options) -> Solved``; for :data:`REPLICAS`,
    ``run(cluster, options)`` returning a result with ``to_json()``; call them through :meth:`place` and
    :meth:`replicate`. ``options_type``: the algorithm's frozen options dataclass (:mod:`planner.options`),
    built and checked by :meth:`options`; its fields are every option ``run`` takes, :attr:`tunable` those a
    user may tune (the CLI checks its flags against them). For replicas, ``lengths`` (a HexGen-2 workload
    name, ``(s_in, s_out)`` or None for the spec's averages) is the planning request. ``serving``
    (replicas only) builds the serving simulator's model of a result: ``serving(cluster, result, params)``;
    ``table`` renders a result as the text ``swarmnode plan`` prints: ``table(cluster, result)``.

    Capabilities: ``solver`` (a mathematical program whose size a plan reports, Helix Table 8);
    ``live_phases`` (a coordinator can plan a live swarm with it in two phases, prefill and decode, through
    :mod:`planner.live.sticky_phases`; the other live algorithms are the node placements, through
    :mod:`planner.live.sticky`).
    """

    name: str
    kind: str
    summary: str
    run: PlacementRunner | ReplicaRunner
    options_type: type[AlgorithmOptions]
    serving: Callable[..., Any] | None = None
    table: Callable[..., str] | None = None
    solver: bool = False
    live_phases: bool = False

    @property
    def accepts(self) -> frozenset[str]:
        """Every option ``run`` takes (the fields of :attr:`options_type`)."""
        return self.options_type.names()

    @property
    def tunable(self) -> frozenset[str]:
        """The options a user may tune (the fields of :attr:`options_type` not marked internal)."""
        return self.options_type.tunable()

    def applies(self, option: str) -> bool:
        """Whether a user-tunable ``option`` changes what this algorithm does."""
        return option in self.tunable or (self.kind == PLACEMENT and option in PLAN_OPTIONS)

    def options(self, **raw: Any) -> AlgorithmOptions:
        """This algorithm's options from keyword arguments, checked (:mod:`planner.options`). An option it
        does not take is a :class:`PlannerError` (code ``bad_option``) naming the algorithm and the options
        it takes: nothing is dropped silently."""
        unknown = sorted(set(raw) - self.accepts)
        if unknown:
            takes = f"takes {', '.join(sorted(self.accepts))}" if self.accepts else "takes no options"
            raise PlannerError(
                f"{self.name}: unknown option(s) {', '.join(unknown)}; {self.name} {takes}", code="bad_option"
            )
        return self.options_type(**raw)

    def checked(self, options: AlgorithmOptions | None) -> AlgorithmOptions:
        """``options`` when they are this algorithm's (None: its defaults); else a :class:`PlannerError`."""
        if options is None:
            return self.options_type()
        if type(options) is not self.options_type:
            raise PlannerError(
                f"{self.name} takes {self.options_type.__name__}, not {type(options).__name__}",
                code="bad_option",
            )
        return options

    def place(self, cluster: Cluster, cost: CostModel, options: AlgorithmOptions | None = None) -> Solved:
        """Run this node-placement algorithm with ``options`` (None: its defaults)."""
        if self.kind != PLACEMENT:
            raise PlannerError(f"{self.name} plans {self.kind}, not a node placement", code="unknown_algorithm")
        return cast(PlacementRunner, self.run)(cluster, cost, self.checked(options))

    def replicate(self, cluster: Cluster, options: AlgorithmOptions | None = None) -> Any:
        """Run this replica algorithm with ``options`` (None: its defaults)."""
        if self.kind != REPLICAS:
            raise PlannerError(f"{self.name} plans {self.kind}, not replicas", code="unknown_algorithm")
        return cast(ReplicaRunner, self.run)(cluster, self.checked(options))


# ---------------------------------------------------------------------------------------------------
# Runners: each algorithm's function called with the registry's uniform arguments
# ---------------------------------------------------------------------------------------------------


def _milp(cluster: Cluster, cost: CostModel, options: MilpOptions) -> Solved:
    result = milp(cluster, cost=cost, **options.kwargs())
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


def _ahp(cluster: Cluster, cost: CostModel, options: AhpOptions) -> Solved:
    return Solved(ahp(cluster, matrix=options.ahp_matrix, knee=options.knee, cost=cost))


def _gma(cluster: Cluster, cost: CostModel, options: GmaOptions) -> Solved:
    return Solved(gma(cluster))  # LLaMPS Alg. 2 sizes by memory alone: the cost model plays no part


def _petals(cluster: Cluster, cost: CostModel, options: PetalsOptions) -> Solved:
    placement = petals(cluster, cost=cost, **options.kwargs())
    seed = None if options.order is not None else options.seed
    return Solved(placement, details={"seed": seed, "rebalance": options.rebalance})


def _swarm(cluster: Cluster, cost: CostModel, options: SwarmOptions) -> Solved:
    return Solved(swarm(cluster, cost=cost, min_replicas=options.min_replicas))


def _hexgen(cluster: Cluster, options: HexGenOptions):
    from .algorithms.hexgen import plan_hexgen
    from .algorithms.hexgen2 import workload_task

    kwargs = options.kwargs()
    lengths = kwargs.pop("lengths")
    return plan_hexgen(cluster, task=None if lengths is None else workload_task(cluster, lengths), **kwargs)


def _hexgen2(cluster: Cluster, options: HexGen2Options):
    from .algorithms.hexgen2 import plan_hexgen2

    kwargs = options.kwargs()
    return plan_hexgen2(cluster, workload=kwargs.pop("lengths"), **kwargs)


def _hexgen_serving(cluster: Cluster, result, params):
    from .simulator.serving import serving_from_replicas

    return serving_from_replicas(cluster, result.replicas, params=params)


def _hexgen2_serving(cluster: Cluster, result, params):
    from .simulator.serving import serving_from_disaggregated

    return serving_from_disaggregated(
        cluster, result.prefill, result.decode, result.source_flow, result.kv_routing, params=params
    )


def _hexgen_table(cluster: Cluster, result) -> str:
    from .tables import hexgen_table

    return hexgen_table(cluster, result)


def _hexgen2_table(cluster: Cluster, result) -> str:
    from .tables import hexgen2_table

    return hexgen2_table(cluster, result)


#: The redundancy floor (:mod:`planner.search.redundancy`): every block on at least this many nodes where the
#: offers allow it. The algorithms that take it place for it; :func:`planner.api.plan` reports the blocks
#: below it whatever the algorithm.
MIN_REPLICAS = "min_replicas"
#: Every algorithm by name, in the order ``plan --algorithm all`` and the benchmarks list them.
REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("milp", PLACEMENT, "Helix's MILP (§4.4)", _milp, MilpOptions, solver=True),
        Algorithm("ahp", PLACEMENT, "LLaMPS' OPA with AHP scores (Alg. 1)", _ahp, AhpOptions),
        Algorithm("gma", PLACEMENT, "LLaMPS' greedy memory algorithm (Alg. 2)", _gma, GmaOptions),
        Algorithm("petals", PLACEMENT, "Petals' block selection (Helix §6.6)", _petals, PetalsOptions),
        Algorithm("swarm", PLACEMENT, "SWARM's equal stages (Helix §6)", _swarm, SwarmOptions),
        Algorithm("hexgen", REPLICAS, "genetic search over replica groups (HexGen §4)", _hexgen, HexGenOptions,
                  _hexgen_serving, _hexgen_table),
        Algorithm("hexgen2", REPLICAS, "partition and refinement of prefill/decode groups (HexGen-2 §4)",
                  _hexgen2, HexGen2Options, _hexgen2_serving, _hexgen2_table, live_phases=True),
    )
}

ALGORITHMS: tuple[str, ...] = tuple(REGISTRY)
PLACEMENT_ALGORITHMS: tuple[str, ...] = tuple(n for n, a in REGISTRY.items() if a.kind == PLACEMENT)
REPLICA_ALGORITHMS: tuple[str, ...] = tuple(n for n, a in REGISTRY.items() if a.kind == REPLICAS)
#: What a coordinator plans a live swarm with: every node placement, and HexGen-2's two phases adapted to swarm
#: nodes (:mod:`planner.algorithms.hexgen2_swarm`: one device per node, measured speeds; phases, ranges and KV links).
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
