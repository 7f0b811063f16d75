"""One entry point per kind of algorithm: :func:`plan` (node placement, returning a :class:`PlanResult`),
:func:`plan_all` (every node-placement algorithm, the MILP warm-started from the best heuristic) and
:func:`plan_replicas` (HexGen / HexGen-2 replica groups). The algorithms themselves are listed in
:mod:`planner.registry`.

The coordinator builds a :class:`~planner.cluster.Cluster` (from a spec file, or from live measurements
with :func:`~planner.cluster.cluster_from_dict`), calls :func:`plan`, deploys ``result.placement`` and
routes requests with ``result.routing_table()`` (:mod:`planner.routing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .bounds import coordinator_bound, tightest
from .cluster import Cluster
from .cost_model import CostModel, CostParams
from .errors import PlannerError
from .flow_graph import evaluate
from .placement import Placement
from .registry import PLACEMENT, PLACEMENT_ALGORITHMS, REGISTRY, REPLICAS, lookup
from .routing import RoutingTable

__all__ = ["PlanResult", "plan", "plan_all", "plan_replicas"]


@dataclass(frozen=True)
class PlanResult:
    """A placement with its max-flow throughput (tokens/s), the best proven upper bound and the gap
    ``1 - throughput / upper_bound``, Helix's bound (§4.5) and the gap to it, the wall time, the flows
    (``flows[u][v]``, ``u`` = ``source`` or a node, ``v`` = a node or ``sink``), the flow through each
    node, and the latency (s) of the fastest flow-carrying pipeline. ``details["bounds"]`` names every
    proven bound (:mod:`planner.bounds`) and ``details["bound_name"]`` the lowest; for the MILP
    ``details`` also holds its phases."""

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

    @property
    def gap_to_helix_bound(self) -> float:
        """``1 - throughput / helix_bound`` (compute only; 0 when the bound is 0)."""
        return 0.0 if self.helix_bound <= 0 else max(0.0, 1.0 - self.throughput / self.helix_bound)

    def routing_table(self) -> RoutingTable:
        return RoutingTable.from_flows(self.placement, self.flows, self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``swarmnode plan --json``."""
        return {
            "algorithm": self.algorithm,
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
        }


def _options_for(entry, options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` ``entry`` takes. Options another algorithm of the same kind takes are left out (one
    set of options serves several algorithms); options no such algorithm takes are an error."""
    known = set().union(*(a.accepts for a in REGISTRY.values() if a.kind == entry.kind))
    unknown = sorted(set(options) - known)
    if unknown:
        raise PlannerError(
            f"{entry.name}: unknown option(s) {', '.join(unknown)}; {entry.kind} algorithms take "
            f"{', '.join(sorted(known))}",
            code="bad_option",
        )
    return {k: v for k, v in options.items() if k in entry.accepts}


def plan(
    cluster: Cluster,
    algorithm: str = "milp",
    *,
    partial_inference: bool = True,
    cost_params: CostParams | None = None,
    cost: CostModel | None = None,
    **options: Any,
) -> PlanResult:
    """Place ``cluster``'s model with the node-placement ``algorithm`` (:data:`planner.registry.REGISTRY`)
    and score it on Helix's flow graph (§4.3), entering nodes mid-range when ``partial_inference``
    (§4.4). ``options`` go to the algorithm that takes them (``time_limit``, ``gap``, ``formulation``,
    ``link_degree``, ``mip_rel_gap``, ``warm_start``, ``seed``, ``progress`` to ``milp``; ``ahp_matrix``
    and ``knee`` to ``ahp``) and are ignored by the others."""
    entry = lookup(algorithm, PLACEMENT)
    kwargs = _options_for(entry, options)
    if "partial_inference" in entry.accepts:
        kwargs["partial_inference"] = partial_inference
    cost = cost or CostModel(cluster, cost_params)
    t0 = time.monotonic()
    solved = entry.run(cluster, cost, **kwargs)
    seconds = time.monotonic() - t0
    ev = evaluate(cluster, solved.placement, cost=cost, partial_inference=partial_inference)
    bounds = {"helix": cost.upper_bound(), "coordinator": coordinator_bound(cluster, cost), **solved.bounds}
    bound_name, upper = tightest(bounds)
    details = {**solved.details, "bounds": bounds, "bound_name": bound_name}
    upper = max(upper, ev.throughput)  # solver tolerances can leave a bound a hair below the flow
    return PlanResult(
        algorithm=algorithm,
        placement=solved.placement,
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
    )


def plan_all(
    cluster: Cluster,
    algorithms: Sequence[str] = PLACEMENT_ALGORITHMS,
    *,
    on_error: Callable[[str, PlannerError], None] | None = None,
    cost_params: CostParams | None = None,
    cost: CostModel | None = None,
    **options: Any,
) -> list[PlanResult]:
    """:func:`plan` with each node-placement algorithm, results in the order of ``algorithms``. The
    algorithms that take a warm start (the MILP) run last and start from the best placement found so far
    (the best heuristic's). An algorithm that cannot plan this cluster is left out of the results and
    its error passed to ``on_error`` (``on_error(name, error)``) when given."""
    entries = [lookup(name, PLACEMENT) for name in algorithms]
    cost = cost or CostModel(cluster, cost_params)
    order = sorted(entries, key=lambda e: "warm_start" in e.accepts)  # stable: heuristics keep their order
    results: dict[str, PlanResult] = {}
    for entry in order:
        kwargs = dict(options)
        if "warm_start" in entry.accepts and results and "warm_start" not in kwargs:
            kwargs["warm_start"] = max(results.values(), key=lambda r: r.throughput).placement
        try:
            results[entry.name] = plan(cluster, entry.name, cost=cost, **kwargs)
        except PlannerError as exc:  # the algorithm does not apply to this cluster (too few nodes, ...)
            if on_error is not None:
                on_error(entry.name, exc)
    return [results[name] for name in algorithms if name in results]


def plan_replicas(cluster: Cluster, algorithm: str, **options: Any):
    """Plan model replicas with ``algorithm`` (``hexgen``: :class:`~planner.hexgen.HexGenResult`,
    ``hexgen2``: :class:`~planner.hexgen2.HexGen2Result`). ``lengths`` is the planning request (a
    HexGen-2 workload name such as ``LPLD``, ``(s_in, s_out)``, or None for the spec's averages); other
    ``options`` go to the algorithm that takes them and are ignored by the others."""
    entry = lookup(algorithm, REPLICAS)
    return entry.run(cluster, **_options_for(entry, options))
