"""One entry point for every placement algorithm: :func:`plan` returns a :class:`PlanResult`.

The coordinator builds a :class:`~planner.cluster.Cluster` (from a spec file, or from live measurements
with :func:`~planner.cluster.cluster_from_dict`), calls :func:`plan`, deploys ``result.placement`` and
routes requests with ``result.routing_table()`` (:mod:`planner.routing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ahp import DEFAULT_KNEE, PairwiseMatrix, ahp
from .bounds import coordinator_bound, tightest
from .cluster import Cluster
from .cost_model import CostModel, CostParams
from .flow_graph import evaluate
from .gma import gma
from .milp import Progress, milp
from .petals import petals
from .placement import Placement
from .routing import RoutingTable
from .swarm import swarm

__all__ = ["ALGORITHMS", "PlanResult", "plan", "plan_all"]

ALGORITHMS = ("milp", "ahp", "gma", "petals", "swarm")


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


def plan(
    cluster: Cluster,
    algorithm: str = "milp",
    *,
    time_limit: float = 60.0,
    gap: float = 0.05,
    partial_inference: bool = True,
    progress: Callable[[Progress], None] | None = None,
    cost_params: CostParams | None = None,
    cost: CostModel | None = None,
    ahp_matrix: PairwiseMatrix | None = None,
    knee: int = DEFAULT_KNEE,
    **milp_options: Any,
) -> PlanResult:
    """Place ``cluster``'s model with ``algorithm`` (one of :data:`ALGORITHMS`) and score it on Helix's
    flow graph. ``time_limit``, ``gap`` and ``milp_options`` (``formulation``, ``link_degree``,
    ``mip_rel_gap``, ``warm_start``, ``seed``) apply to ``milp``; ``ahp_matrix`` and ``knee`` to ``ahp``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    cost = cost or CostModel(cluster, cost_params)
    t0 = time.monotonic()
    details: dict[str, Any] = {}
    bounds = {"helix": cost.upper_bound(), "coordinator": coordinator_bound(cluster, cost)}
    if algorithm == "milp":
        result = milp(
            cluster,
            time_limit=time_limit,
            gap=gap,
            partial_inference=partial_inference,
            cost=cost,
            progress=progress,
            **milp_options,
        )
        placement: Placement = result.placement
        bounds = dict(result.bounds)
        details = {
            "formulation": result.formulation,
            "status": result.status,
            "solver_bound": result.solver_bound,
            "start_algorithm": result.start_algorithm,
            "phases": list(result.phases),
        }
    elif algorithm == "ahp":
        placement = ahp(cluster, matrix=ahp_matrix, knee=knee, cost=cost)
    elif algorithm == "gma":
        placement = gma(cluster)
    elif algorithm == "petals":
        placement = petals(cluster, cost=cost)
    else:
        placement = swarm(cluster, cost=cost)
    seconds = time.monotonic() - t0
    ev = evaluate(cluster, placement, cost=cost, partial_inference=partial_inference)
    bound_name, upper = tightest(bounds)
    details["bounds"] = bounds
    details["bound_name"] = bound_name
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
    )


def plan_all(cluster: Cluster, algorithms: Sequence[str] = ALGORITHMS, **options: Any) -> list[PlanResult]:
    """:func:`plan` with each algorithm; the MILP runs last and starts from the others' best placement."""
    cost = options.pop("cost", None) or CostModel(cluster, options.pop("cost_params", None))
    order = [a for a in algorithms if a != "milp"] + [a for a in algorithms if a == "milp"]
    results = {}
    for algorithm in order:
        kwargs = dict(options)
        if algorithm != "milp":
            kwargs = {k: v for k, v in kwargs.items() if k in ("partial_inference", "ahp_matrix", "knee")}
        try:
            results[algorithm] = plan(cluster, algorithm, cost=cost, **kwargs)
        except ValueError as exc:  # a heuristic that does not apply to this cluster
            if algorithm == "milp":
                raise
            results[algorithm] = exc
    return [results[a] for a in algorithms if isinstance(results[a], PlanResult)]
