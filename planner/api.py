"""One entry point per kind of algorithm: :func:`plan` (node placement, returning a :class:`PlanResult`),
:func:`plan_all` (every node-placement algorithm, the MILP warm-started from the best heuristic) and
:func:`plan_replicas` (HexGen / HexGen-2 replica groups). The algorithms themselves are listed in
:mod:`planner.registry`. :func:`score` scores a placement given from elsewhere (an operator's, or one of
Helix's published layouts) exactly as a planned one, so the two compare on one cost model.

Every node placement is scored with one cost model (:mod:`planner.costs.factory`): ``cost=`` an instance,
or ``cost_model=`` a name (``roofline``, ``helix``), by default the spec's ``cost_model``.

The coordinator builds a :class:`~planner.cluster.spec.Cluster` (from a spec file, or from live measurements
with :func:`~planner.cluster.spec.cluster_from_dict`), calls :func:`plan`, deploys ``result.placement`` and
routes requests with ``result.routing_table()`` (:mod:`planner.routing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .algorithms.milp import DEFAULT_LINK_DEGREE, model_size
from .cluster.spec import Cluster
from .costs.factory import resolve_cost
from .costs.roofline import CostModel, CostParams
from .errors import PlannerError
from .flow_graph import evaluate
from .options import AlgorithmOptions
from .placement import Placement, PlacementError
from .registry import MIN_REPLICAS, PLACEMENT, PLACEMENT_ALGORITHMS, REPLICAS, Algorithm, lookup
from .routing import RoutingTable
from .search.bounds import coordinator_bound, tightest
from .search.redundancy import achievable_floor, check_min_replicas, single_points

__all__ = ["GIVEN", "PlanResult", "plan", "plan_all", "plan_replicas", "resolve_cost", "score"]

#: The ``algorithm`` of a :class:`PlanResult` that :func:`score` made: the placement was given, not solved.
GIVEN = "given"


class _Unset:
    """The default of a plan-wide setting not given (None is a value, and a wrong one)."""

    def __repr__(self) -> str:
        return "<not given>"


_UNSET: Any = _Unset()


@dataclass(frozen=True)
class PlanResult:
    """A placement with its max-flow throughput (tokens/s), the best proven upper bound and the gap
    ``1 - throughput / upper_bound``, Helix's bound (§4.5) and the gap to it, the wall time, the flows
    (``flows[u][v]``, ``u`` = ``source`` or a node, ``v`` = a node or ``sink``), the flow through each
    node, and the latency (s) of the fastest flow-carrying pipeline. ``details["bounds"]`` names every
    proven bound (:mod:`planner.search.bounds`) and ``details["bound_name"]`` the lowest; for the MILP
    ``details`` also holds its phases. ``cost_model`` names the cost model every figure comes from and
    ``cost_sources`` each node's source in it (:meth:`~planner.costs.roofline.CostModel.sources`);
    ``model_size`` is the MILP's size (:func:`planner.algorithms.milp.model_size`; None for the other algorithms).
    ``min_replicas`` is the redundancy floor asked for (:mod:`planner.search.redundancy`) and ``single_points``
    the half-open block ranges ``(start, end)`` held by fewer nodes than that (empty when the floor holds
    everywhere); with a floor above 1, ``details["floor"]`` says how many blocks the offers let reach it."""

    algorithm: str
    placement: Placement
    throughput: float
    upper_bound: float
    gap: float
    solve_seconds: float
    flows: dict[str, dict[str, float]]
    node_flows: dict[str, float]
    latency: float | None
    helix_bound: float
    num_blocks: int
    details: dict[str, Any] = field(default_factory=dict)
    cost_model: str = "roofline"
    cost_sources: dict[str, str] = field(default_factory=dict)
    model_size: dict[str, Any] | None = None
    min_replicas: int = 1
    single_points: tuple[tuple[int, int], ...] = ()

    @property
    def gap_to_helix_bound(self) -> float:
        """``1 - throughput / helix_bound`` (compute only; 0 when the bound is 0)."""
        return 0.0 if self.helix_bound <= 0 else max(0.0, 1.0 - self.throughput / self.helix_bound)

    def routing_table(self) -> RoutingTable:
        return RoutingTable.from_flows(self.placement, self.flows, self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``swarmnode plan --json``.

        ``algorithm`` (``given`` for a scored placement), ``cost_model`` (``roofline`` or ``helix``),
        ``cost_sources`` (``{node: source}``: ``roofline``, ``measured`` or a Helix profile such as
        ``helix:a100``), ``placement`` (``{node: [start, end]}``, half-open), ``throughput``,
        ``upper_bound``, ``helix_bound``, ``gap``, ``gap_to_helix_bound``, ``solve_seconds``, ``latency``,
        ``flows``, ``node_flows``, ``details``, and ``model_size``: null except for the MILP, where it is
        ``{"formulation": "per-node", "partial_inference", "link_degree", "unpruned": {"columns",
        "rows"}, "pruned": {"columns", "rows"}, "solved": [{"formulation", "models", "columns",
        "rows"}]}`` — Helix's per-node model (Tables 5-6) for this cluster built over the complete graph
        and after §4.5 link pruning, comparable with Helix Table 8 (whose runs had no partial
        inference: ``--no-partial-inference``), then the largest model each search phase solved
        (:func:`planner.algorithms.milp.model_size`); ``min_replicas`` (the redundancy floor asked for) and
        ``single_points`` (``[[start, end], ...]``, half-open block ranges held by fewer nodes than
        ``min_replicas``; empty when the floor holds)."""
        return {
            "algorithm": self.algorithm,
            "cost_model": self.cost_model,
            "cost_sources": dict(self.cost_sources),
            "placement": self.placement.to_dict(),
            "throughput": self.throughput,
            "upper_bound": self.upper_bound,
            "helix_bound": self.helix_bound,
            "gap": self.gap,
            "gap_to_helix_bound": self.gap_to_helix_bound,
            "solve_seconds": self.solve_seconds,
            "latency": self.latency,
            "flows": {u: dict(t) for u, t in self.flows.items()},
            "node_flows": dict(self.node_flows),
            "details": self.details,
            "model_size": self.model_size,
            "min_replicas": self.min_replicas,
            "single_points": [[s, e] for s, e in self.single_points],
        }


def _shared(entry: Algorithm, options: AlgorithmOptions | None, name: str, value: Any, default: Any) -> Any:
    """The plan-wide setting ``name`` (``partial_inference``, ``min_replicas``): ``value`` (``_UNSET``: not
    given) or the one in ``options`` when its type has it; the two must agree when both are given."""
    if options is None or name not in entry.accepts:
        return default if value is _UNSET else value
    own = getattr(options, name)
    if value is not _UNSET and value != own:
        raise PlannerError(
            f"{entry.name}: {name}={value!r} and {type(options).__name__}.{name}={own!r} disagree; set it once",
            code="bad_option",
        )
    return own


def _placement_options(
    entry: Algorithm, options: AlgorithmOptions | None, raw: dict[str, Any], partial_inference: bool,
    min_replicas: int,
) -> tuple[AlgorithmOptions, bool, int]:
    """``entry``'s options (``options``, or built from the keyword options ``raw`` with
    :meth:`~planner.registry.Algorithm.options`) and the plan-wide partial inference and floor."""
    if options is not None and raw:
        raise PlannerError(
            f"{entry.name}: pass options= or keyword options ({', '.join(sorted(raw))}), not both", code="bad_option"
        )
    if options is None:
        shared = {"partial_inference": partial_inference, MIN_REPLICAS: min_replicas}
        raw = {**raw, **{k: v for k, v in shared.items() if v is not _UNSET and k in entry.accepts}}
        options = entry.options(**raw)
    options = entry.checked(options)
    partial = _shared(entry, options, "partial_inference", partial_inference, True)
    floor = check_min_replicas(_shared(entry, options, MIN_REPLICAS, min_replicas, 1))
    return options, partial, floor


def _scored(
    cluster: Cluster,
    algorithm: str,
    placement: Placement,
    cost: CostModel,
    *,
    partial_inference: bool,
    seconds: float,
    bounds: dict[str, float] | None = None,
    details: dict[str, Any] | None = None,
    size: dict[str, Any] | None = None,
    min_replicas: int = 1,
) -> PlanResult:
    """``placement`` scored on Helix's flow graph (§4.3) with ``cost``, with every proven bound: Helix's
    (§4.5), the coordinator cut and those in ``bounds`` (:mod:`planner.search.bounds`), and the blocks below the
    redundancy floor ``min_replicas``."""
    ev = evaluate(cluster, placement, cost=cost, partial_inference=partial_inference)
    bounds = {"helix": cost.upper_bound(), "coordinator": coordinator_bound(cluster, cost), **(bounds or {})}
    bound_name, upper = tightest(bounds)
    details = {**(details or {}), "bounds": bounds, "bound_name": bound_name}
    num_blocks = cluster.model.num_blocks
    if min_replicas > 1 and "floor" not in details:
        capacities = (max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids)
        details["floor"] = achievable_floor(capacities, num_blocks, min_replicas).to_dict()
    upper = max(upper, ev.throughput)  # solver tolerances can leave a bound a hair below the flow
    return PlanResult(
        algorithm=algorithm,
        placement=placement,
        throughput=ev.throughput,
        upper_bound=upper,
        gap=0.0 if upper <= 0 else max(0.0, 1.0 - ev.throughput / upper),
        solve_seconds=seconds,
        flows=ev.flows,
        node_flows=ev.node_flows,
        latency=ev.latency,
        helix_bound=cost.upper_bound(),
        num_blocks=cluster.model.num_blocks,
        details=details,
        cost_model=cost.name,
        cost_sources=cost.sources(),
        model_size=size,
        min_replicas=min_replicas,
        single_points=tuple(single_points(placement, num_blocks, min_replicas)),
    )


def plan(
    cluster: Cluster,
    algorithm: str = "milp",
    *,
    partial_inference: bool = _UNSET,
    cost_params: CostParams | None = None,
    cost: CostModel | None = None,
    cost_model: str | None = None,
    min_replicas: int = _UNSET,
    options: AlgorithmOptions | None = None,
    **raw: Any,
) -> PlanResult:
    """Place ``cluster``'s model with the node-placement ``algorithm`` (:data:`planner.registry.REGISTRY`)
    and score it on Helix's flow graph (§4.3), entering nodes mid-range when ``partial_inference``
    (§4.4; default True). The algorithm's options: ``options`` (its options type, :mod:`planner.options`,
    e.g. :class:`~planner.options.MilpOptions`), or keyword options built into one with
    :meth:`~planner.registry.Algorithm.options` (``time_limit``, ``gap``, ``formulation``, ``link_degree``,
    ``mip_rel_gap``, ``warm_start``, ``seed``, ``progress`` for ``milp``; ``ahp_matrix`` and ``knee`` for
    ``ahp``; ...): an option the algorithm does not take is a :class:`PlannerError` (code ``bad_option``)
    naming the options it takes. The cost model: ``cost``, or the one ``cost_model`` names (default: the
    spec's), built with ``cost_params`` (:func:`resolve_cost`). A MILP plan also reports its size
    (:func:`planner.algorithms.milp.model_size`, Helix Table 8).

    ``min_replicas`` is the redundancy floor (:mod:`planner.search.redundancy`; an integer >= 1, default 1,
    else a :class:`PlannerError` with code ``bad_option``): the algorithms that take it (``milp``,
    ``petals``, ``swarm``) keep every block on that many nodes where the offers allow it; for every
    algorithm the result lists the blocks below it (``single_points``). ``partial_inference`` and
    ``min_replicas`` given here and in ``options`` must agree."""
    entry = lookup(algorithm, PLACEMENT)
    if min_replicas is not _UNSET:
        min_replicas = check_min_replicas(min_replicas)
    opts, partial_inference, min_replicas = _placement_options(entry, options, raw, partial_inference, min_replicas)
    cost = resolve_cost(cluster, cost, cost_model, cost_params)
    t0 = time.monotonic()
    solved = entry.place(cluster, cost, opts)
    seconds = time.monotonic() - t0
    size = None
    if entry.solver:  # Helix's model size (Table 8), and what the solver's phases solved
        size = model_size(
            cluster,
            cost,
            partial_inference=partial_inference,
            link_degree=getattr(opts, "link_degree", DEFAULT_LINK_DEGREE),
            phases=[dict(p) for p in solved.solver_phases or ()],
        )
    return _scored(
        cluster,
        algorithm,
        solved.placement,
        cost,
        partial_inference=partial_inference,
        seconds=seconds,
        bounds=dict(solved.bounds),
        details=dict(solved.details),
        size=size,
        min_replicas=min_replicas,
    )


def score(
    cluster: Cluster,
    placement: Mapping[str, Sequence[int]],
    *,
    cost_model: str | None = None,
    cost: CostModel | None = None,
    cost_params: CostParams | None = None,
    partial_inference: bool = True,
    min_replicas: int = 1,
) -> PlanResult:
    """Score a given ``placement`` (``{node_id: (start, end)}``, half-open block ranges) as :func:`plan`
    scores a planned one: max flow on Helix's flow graph (§4.3), upper bounds and gaps, flows, latency,
    with the cost model :func:`resolve_cost` picks; nothing is solved (``algorithm`` is :data:`GIVEN`).

    A node missing from ``placement`` serves nothing. Raises :class:`~planner.placement.PlacementError`
    naming every unknown node, range outside ``[0, num_blocks)``, empty range and range longer than the
    node can hold under the cost model. Blocks nobody serves are allowed (the throughput is then 0) and
    listed in ``details["unserved_blocks"]``; blocks held by fewer than ``min_replicas`` nodes are the
    result's ``single_points``."""
    min_replicas = check_min_replicas(min_replicas)
    cost = resolve_cost(cluster, cost, cost_model, cost_params)
    t0 = time.monotonic()
    given = _checked_placement(cluster, cost, placement)
    details: dict[str, Any] = {}
    unserved = _unserved(given, cluster.model.num_blocks)
    if unserved:
        details["unserved_blocks"] = unserved
    return _scored(
        cluster,
        GIVEN,
        given,
        cost,
        partial_inference=partial_inference,
        seconds=time.monotonic() - t0,
        details=details,
        min_replicas=min_replicas,
    )


def _checked_placement(
    cluster: Cluster, cost: CostModel, placement: Mapping[str, Sequence[int]]
) -> Placement:
    """``placement`` as a :class:`Placement`, or a :class:`PlacementError` listing every problem (one
    line)."""
    num_blocks = cluster.model.num_blocks
    problems: list[str] = []
    unknown = [str(n) for n in placement if not cluster.has_node(str(n))]
    if unknown:
        problems.append(
            f"node(s) {', '.join(map(repr, unknown))} not in cluster {cluster.name!r} "
            f"(its nodes: {', '.join(cluster.node_ids)})"
        )
    ranges: dict[str, tuple[int, int]] = {}
    for node_id, rng in placement.items():
        node_id = str(node_id)
        if node_id in unknown:
            continue
        if (
            isinstance(rng, str | bytes)
            or not isinstance(rng, Sequence)
            or len(rng) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in rng)
        ):
            problems.append(f"node {node_id!r}: a range is [start, end] (two integers), got {rng!r}")
            continue
        start, end = rng
        if not start < end:
            problems.append(f"node {node_id!r}: range [{start}, {end}) is empty (start must be below end)")
        elif not 0 <= start < end <= num_blocks:
            problems.append(f"node {node_id!r}: range [{start}, {end}) is not inside [0, {num_blocks})")
        elif end - start > cost.capacity[node_id]:
            problems.append(
                f"node {node_id!r}: holds {end - start} blocks but can hold at most {cost.capacity[node_id]} "
                f"under the {cost.name} cost model"
            )
        else:
            ranges[node_id] = (start, end)
    if problems:
        raise PlacementError("invalid placement: " + "; ".join(problems))
    return Placement(ranges)  # in the given order, so the max flow splits as it did for the plan given


def _unserved(placement: Placement, num_blocks: int) -> list[list[int]]:
    """Blocks no node of ``placement`` serves, as half-open ``[start, end]`` runs."""
    runs: list[list[int]] = []
    for b, count in enumerate(placement.coverage(num_blocks)):
        if count:
            continue
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return runs


def plan_all(
    cluster: Cluster,
    algorithms: Sequence[str] = PLACEMENT_ALGORITHMS,
    *,
    on_error: Callable[[str, PlannerError], None] | None = None,
    cost_params: CostParams | None = None,
    cost: CostModel | None = None,
    cost_model: str | None = None,
    partial_inference: bool = _UNSET,
    min_replicas: int = _UNSET,
    options: Mapping[str, AlgorithmOptions] | None = None,
    **shared: Any,
) -> list[PlanResult]:
    """:func:`plan` with each node-placement algorithm, results in the order of ``algorithms``, all with
    one cost model (:func:`resolve_cost`). The algorithms that take a warm start (the MILP) run last and
    start from the best placement found so far (the best heuristic's) unless their options give one. An
    algorithm that cannot plan this cluster is left out of the results and its error passed to
    ``on_error`` (``on_error(name, error)``) when given. ``min_replicas`` and ``partial_inference`` go to
    every :func:`plan`; with a floor above 1 the warm start is the fastest of the placements with the
    fewest blocks below it.

    Each algorithm's options: ``options[name]`` (its options type), else built from the keyword options
    ``shared`` that its options type has (``time_limit=5`` goes to the MILP, not to GMA). A keyword option
    none of ``algorithms`` takes is a :class:`PlannerError` (code ``bad_option``), and so is an entry of
    ``options`` for an algorithm not in ``algorithms``."""
    entries = [lookup(name, PLACEMENT) for name in algorithms]
    options = dict(options or {})
    stray = sorted(set(options) - set(algorithms))
    unknown = sorted(set(shared) - set().union(*(e.accepts for e in entries)))
    if stray or unknown:
        takes = ", ".join(sorted(set().union(*(e.accepts for e in entries))))
        what = f"options for {', '.join(stray)}, not planned here" if stray else f"unknown option(s) {', '.join(unknown)}"
        raise PlannerError(f"plan_all over {', '.join(algorithms)}: {what}; these algorithms take {takes}",
                           code="bad_option")
    cost = resolve_cost(cluster, cost, cost_model, cost_params)
    order = sorted(entries, key=lambda e: "warm_start" in e.accepts)  # stable: heuristics keep their order
    results: dict[str, PlanResult] = {}
    for entry in order:
        opts = options.get(entry.name)
        if opts is None:
            opts, _, _ = _placement_options(
                entry, None, {k: v for k, v in shared.items() if k in entry.accepts}, partial_inference, min_replicas
            )
        if "warm_start" in entry.accepts and results and getattr(opts, "warm_start", None) is None:
            opts = replace(opts, warm_start=max(  # type: ignore[call-arg]
                results.values(), key=lambda r: (-sum(e - s for s, e in r.single_points), r.throughput)
            ).placement)
        try:
            results[entry.name] = plan(cluster, entry.name, cost=cost, options=opts,
                                       partial_inference=partial_inference, min_replicas=min_replicas)
        except PlannerError as exc:  # the algorithm does not apply to this cluster (too few nodes, ...)
            if on_error is not None:
                on_error(entry.name, exc)
    return [results[name] for name in algorithms if name in results]


def plan_replicas(cluster: Cluster, algorithm: str, options: AlgorithmOptions | None = None, **raw: Any) -> Any:
    """Plan model replicas with ``algorithm`` (``hexgen``: :class:`~planner.algorithms.hexgen.HexGenResult`,
    ``hexgen2``: :class:`~planner.algorithms.hexgen2.HexGen2Result`). Its options: ``options`` (its options
    type, :class:`~planner.options.HexGenOptions` or :class:`~planner.options.HexGen2Options`), or keyword
    options built into one with :meth:`~planner.registry.Algorithm.options`; ``lengths`` is the planning
    request (a HexGen-2 workload name such as ``LPLD``, ``(s_in, s_out)``, or None for the spec's averages).
    An option the algorithm does not take is a :class:`PlannerError` (code ``bad_option``)."""
    entry = lookup(algorithm, REPLICAS)
    if options is not None and raw:
        raise PlannerError(f"{algorithm}: pass options= or keyword options, not both", code="bad_option")
    return entry.replicate(cluster, options if options is not None else entry.options(**raw))
