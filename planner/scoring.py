"""Plan a cluster with any planner algorithm and score the plan with the serving simulator.

The node-level algorithms (``gma``, ``ahp``, ``petals``, ``swarm``, ``milp``) return a
:class:`~planner.placement.Placement`; the simulator routes requests over Helix's flow graph of it with the
max-flow weights (:func:`planner.simulator.serving_from_placement`). ``hexgen`` returns replicas
(:func:`planner.simulator.serving_from_replicas`), ``hexgen2`` prefill and decode replicas with KV routing
(:func:`planner.simulator.serving_from_disaggregated`). ``expected:<name>`` uses a placement the spec
lists under ``expected``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cluster import Cluster, Workload
from .cost_model import CostModel
from .flow_graph import evaluate
from .hexgen_cost import HexGenParams, Task
from .placement import Placement, PlacementError
from .simulator import (
    ServingModel,
    SimConfig,
    SimResult,
    serving_from_disaggregated,
    serving_from_placement,
    serving_from_replicas,
    simulate,
)
from .trace import Request, poisson_trace

__all__ = ["ALGORITHMS", "PLACEMENT_ALGORITHMS", "PlannedModel", "plan_for_simulation", "plan_placement", "score"]

PLACEMENT_ALGORITHMS = ("gma", "ahp", "petals", "swarm", "milp")
ALGORITHMS = (*PLACEMENT_ALGORITHMS, "hexgen", "hexgen2")


@dataclass
class PlannedModel:
    """A plan ready to simulate: the algorithm, the simulator's view of it, and the plan JSON."""

    algorithm: str
    model: ServingModel
    plan: dict[str, Any]


def plan_placement(cluster: Cluster, algorithm: str, cost: CostModel, milp_time_limit: float) -> Placement:
    """The placement a node-level ``algorithm`` (or ``expected:<name>``) makes with ``cost``'s ``T_j``."""
    if algorithm.startswith("expected:"):
        name = algorithm.split(":", 1)[1]
        if name not in cluster.expected:
            known = ", ".join(sorted(cluster.expected)) or "none"
            raise PlacementError(
                f"spec {cluster.name!r} lists no expected placement {name!r} (it lists: {known})"
            )
        return Placement(cluster.expected[name])
    if algorithm == "gma":
        from .gma import gma

        return gma(cluster)
    if algorithm == "ahp":
        from .ahp import ahp

        return ahp(cluster, cost=cost)
    if algorithm == "petals":
        from .petals import petals

        return petals(cluster, cost=cost)
    if algorithm == "swarm":
        from .swarm import swarm

        return swarm(cluster, cost=cost)
    if algorithm == "milp":
        from .milp import milp

        return milp(cluster, time_limit=milp_time_limit, cost=cost).placement
    raise ValueError(
        f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)} or expected:<name>"
    )


def plan_for_simulation(
    cluster: Cluster,
    algorithm: str,
    *,
    params: HexGenParams | None = None,
    milp_time_limit: float = 60.0,
    hexgen_options: dict[str, Any] | None = None,
    hexgen2_options: dict[str, Any] | None = None,
    workload: Workload | None = None,
) -> PlannedModel:
    """Run ``algorithm`` on ``cluster`` and build the simulator's model of its plan. ``workload``: the
    average request the node-level algorithms plan for (their cost model's ``T_j`` and link capacities);
    by default the cluster's. HexGen and HexGen-2 take their task from their options."""
    params = params or HexGenParams()
    t0 = time.monotonic()
    if algorithm == "hexgen":
        from .hexgen import plan_hexgen

        result = plan_hexgen(cluster, params=params, **(hexgen_options or {}))
        return PlannedModel(
            algorithm, serving_from_replicas(cluster, result.replicas, params=params), result.to_json()
        )
    if algorithm == "hexgen2":
        from .hexgen2 import plan_hexgen2

        result2 = plan_hexgen2(cluster, params=params, **(hexgen2_options or {}))
        model = serving_from_disaggregated(
            cluster, result2.prefill, result2.decode, result2.source_flow, result2.kv_routing, params=params
        )
        return PlannedModel(algorithm, model, result2.to_json())
    if algorithm not in PLACEMENT_ALGORITHMS and not algorithm.startswith("expected:"):
        raise ValueError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)} or expected:<name>"
        )
    cost = CostModel(cluster, params.cost, workload)
    placement = plan_placement(cluster, algorithm, cost, milp_time_limit)
    solve = time.monotonic() - t0
    ev = evaluate(cluster, placement, cost=cost, with_latency=False)
    model = serving_from_placement(cluster, placement, cost=cost, params=params, flows=ev.flows)
    plan = {
        "algorithm": algorithm,
        "cluster": cluster.name,
        "placement": placement.to_dict(),
        "throughput": ev.throughput,
        "upper_bound": cost.upper_bound(),
        "solve_seconds": solve,
        "flows": ev.flows,
    }
    return PlannedModel(algorithm, model, plan)


def score(
    planned: PlannedModel,
    *,
    rate: float | None = None,
    duration: float = 60.0,
    trace: tuple[Request, ...] | None = None,
    task: Task | None = None,
    slo_scale: float = 5.0,
    seed: int = 0,
    spread: float = 0.0,
    warmup: float = 0.0,
    drain: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> SimResult:
    """Simulate a planned model under Poisson arrivals at ``rate`` (or an explicit ``trace``)."""
    cluster = planned.model.cluster
    if trace is None:
        if rate is None:
            raise ValueError("give a rate (requests/s) or a trace")
        if task is None:
            w = planned.model.workload or cluster.workload
            task = Task(
                1.0, float(max(1, round(w.avg_input_tokens))), float(max(1, round(w.avg_output_tokens)))
            )
        trace = poisson_trace(rate, duration, int(task.s_in), int(task.s_out), spread=spread, seed=seed)
        if not trace:
            raise ValueError(
                f"no request arrives in {duration} s at {rate} requests/s; raise the rate or the duration"
            )
    if progress is not None:
        progress(f"simulating {len(trace)} requests on the {planned.algorithm} plan")
    return simulate(planned.model, trace, SimConfig(slo_scale=slo_scale, warmup=warmup, drain=drain))
