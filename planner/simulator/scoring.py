"""Plan a cluster with any planner algorithm and score the plan with the serving simulator.

Node-placement algorithms (:data:`planner.registry.PLACEMENT`) return a
:class:`~planner.placement.Placement`; the simulator routes requests over Helix's flow graph of it with the
max-flow weights (:func:`planner.simulator.serving.serving_from_placement`). Replica algorithms
(:data:`planner.registry.REPLICAS`) build the simulator's model of their groups with their registry
entry's ``serving`` (HexGen's replicas, HexGen-2's prefill and decode groups with KV routing).
``expected:<name>`` uses a placement the spec lists under ``expected``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..api import plan_replicas
from ..cluster.spec import Cluster, Workload
from ..costs.factory import make_cost_model
from ..costs.hexgen_gpus import HexGenParams, Task
from ..costs.roofline import CostModel
from ..errors import PlannerError
from ..flow_graph import evaluate
from ..placement import Placement, PlacementError
from ..registry import ALGORITHMS, PLACEMENT, REPLICAS, lookup
from .engine import simulate
from .metrics import SimConfig, SimResult
from .serving import ServingModel, serving_from_placement
from .trace import Request, poisson_trace

__all__ = [
    "EXPECTED_PREFIX",
    "PlannedModel",
    "is_simulable",
    "plan_for_simulation",
    "plan_placement",
    "score",
    "serve_at_load",
]

#: ``expected:<name>``: the placement a spec lists under ``expected`` instead of an algorithm's.
EXPECTED_PREFIX = "expected:"


@dataclass
class PlannedModel:
    """A plan ready to simulate: the algorithm, the simulator's view of it, and the plan JSON."""

    algorithm: str
    model: ServingModel
    plan: dict[str, Any]


def is_simulable(name: str) -> bool:
    """Whether ``name`` is an algorithm of the registry or ``expected:<name>``."""
    return name in ALGORITHMS or (name.startswith(EXPECTED_PREFIX) and len(name) > len(EXPECTED_PREFIX))


def _unknown(algorithm: str) -> PlannerError:
    return PlannerError(
        f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)} or {EXPECTED_PREFIX}<name>",
        code="unknown_algorithm",
    )


def plan_placement(cluster: Cluster, algorithm: str, cost: CostModel, milp_time_limit: float) -> Placement:
    """The placement a node-placement ``algorithm`` (or ``expected:<name>``) makes with ``cost``'s ``T_j``;
    ``milp_time_limit`` bounds the algorithms that take a time limit."""
    if algorithm.startswith(EXPECTED_PREFIX):
        name = algorithm[len(EXPECTED_PREFIX) :]
        if name not in cluster.expected:
            known = ", ".join(sorted(cluster.expected)) or "none"
            raise PlacementError(
                f"spec {cluster.name!r} lists no expected placement {name!r} (it lists: {known})"
            )
        return Placement(cluster.expected[name])
    if not is_simulable(algorithm):
        raise _unknown(algorithm)
    entry = lookup(algorithm, PLACEMENT)
    # the MILP is the node placement with a time limit: it gets ``milp_time_limit``, the others their defaults
    options = entry.options(time_limit=milp_time_limit) if "time_limit" in entry.accepts else entry.options()
    return entry.place(cluster, cost, options).placement


def plan_for_simulation(
    cluster: Cluster,
    algorithm: str,
    *,
    params: HexGenParams | None = None,
    milp_time_limit: float = 60.0,
    replica_options: Mapping[str, Any] | None = None,
    workload: Workload | None = None,
) -> PlannedModel:
    """Run ``algorithm`` on ``cluster`` and build the simulator's model of its plan. Node placements are
    planned and simulated with the spec's cost model (``cluster.cost_model``). ``workload``: the
    average request the node-placement algorithms plan for (their cost model's ``T_j`` and link
    capacities); by default the cluster's. Replica algorithms take ``replica_options`` (their planning
    request as ``lengths``, ``seed``, ...), built into the algorithm's options type by
    :func:`planner.api.plan_replicas`: an option it does not take is an error, not dropped."""
    if not is_simulable(algorithm):
        raise _unknown(algorithm)
    params = params or HexGenParams()
    entry = None if algorithm.startswith(EXPECTED_PREFIX) else lookup(algorithm)
    if entry is not None and entry.kind == REPLICAS:
        assert entry.serving is not None  # every replica algorithm of the registry has a serving model
        result = plan_replicas(cluster, algorithm, params=params, **(replica_options or {}))
        return PlannedModel(algorithm, entry.serving(cluster, result, params), result.to_json())
    t0 = time.monotonic()
    cost = make_cost_model(cluster, params=params.cost, workload=workload)  # the spec's cost model
    placement = plan_placement(cluster, algorithm, cost, milp_time_limit)
    solve = time.monotonic() - t0
    ev = evaluate(cluster, placement, cost=cost, with_latency=False)
    model = serving_from_placement(cluster, placement, cost=cost, params=params, flows=ev.flows)
    plan = {
        "algorithm": algorithm,
        "cluster": cluster.name,
        "cost_model": cost.name,
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
            raise PlannerError("give a rate (requests/s) or a trace", code="bad_option")
        if task is None:
            w = planned.model.workload or cluster.workload
            task = Task(
                1.0, float(max(1, round(w.avg_input_tokens))), float(max(1, round(w.avg_output_tokens)))
            )
        trace = poisson_trace(rate, duration, int(task.s_in), int(task.s_out), spread=spread, seed=seed)
        if not trace:
            raise PlannerError(
                f"no request arrives in {duration} s at {rate} requests/s; raise the rate or the duration",
                code="no_requests",
            )
    if progress is not None:
        progress(f"simulating {len(trace)} requests on the {planned.algorithm} plan")
    return simulate(planned.model, trace, SimConfig(slo_scale=slo_scale, warmup=warmup, drain=drain))


def serve_at_load(
    cluster: Cluster,
    placements: Mapping[str, Mapping[str, tuple[int, int]]],
    cost: CostModel,
    *,
    load: float = 1.1,
    duration: float = 600.0,
    spread: float = 0.5,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """``{name: (max flow, simulated output tokens/s)}`` of each placement served at one offered load:
    Poisson arrivals at ``load`` times the best placement's max flow (Helix Fig. 9 compares placements at
    the same offered load), the cost model's average lengths spread by ``spread`` so that requests do not
    finish in lockstep, measured over the second half of ``duration`` seconds (a 763/232 request lives
    for minutes; the KV caches fill and completions reach their steady rate well before the half)."""
    if not placements:
        raise PlannerError("no placement to serve", code="bad_option")
    if not load > 0 or not duration > 0:
        raise PlannerError("load and duration must be positive", code="bad_option")
    shape = cost.shape
    flows = {name: evaluate(cluster, p, cost=cost, with_latency=False) for name, p in placements.items()}
    top = max(ev.throughput for ev in flows.values())
    if top <= 0:
        raise PlannerError("no placement serves every block", code="bad_plan")
    rate = load * top / shape.s_out
    trace = poisson_trace(rate, duration, round(shape.s_in), round(shape.s_out), spread=spread, seed=seed)
    config = SimConfig(warmup=duration / 2, drain=0.0)
    out = {}
    for name, placement in placements.items():
        ev = flows[name]
        if ev.throughput <= 0:
            out[name] = (0.0, 0.0)
            continue
        model = serving_from_placement(cluster, placement, cost=cost, flows=ev.flows)
        out[name] = (ev.throughput, simulate(model, trace, config).throughput)
    return out
