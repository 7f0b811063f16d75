"""Serving simulator against Helix's max flow at saturation, per cluster, workload and cost model.

For each cluster, cost model (``roofline``, ``helix``: :func:`planner.costs.factory.make_cost_model`) and
workload, the placement (by default the MILP's) is planned with that cost model for the workload's lengths,
its max flow computed, and the simulator is driven with Poisson arrivals at ``--load`` times that max flow
(requests/s = load x max flow / s_out), lengths spread by +-50% so that requests do not finish in
lockstep. The simulated output tokens/s are measured over the second half of the run. The default
workloads are Helix's trace as its paper reports it (763 prompt / 232 output tokens, §6.2) and as its code
uses it (750 / 240, ``simulator/event_simulator/utils.py``).

Next to the ratio, ``kv_share`` is the largest share of the max flow whose requests fit the nodes' KV
caches if every node ran continuously at its share of the flow (:func:`kv_share`): a ratio near it and well
below 1 says that the cost model's ``T_j`` asks for more concurrent requests than the placement's KV cache
holds, not that the simulator falls short of it. Under the roofline model the ratio is about 0.5-0.6 with
the nodes busy 85-90% of the time: its ``T_j`` sizes a node's batch by the node's own KV room (``N j / L``
requests, :func:`planner.costs.roofline.typical_batch`), but a pipeline carries only as many requests as its
tightest node holds, so the batches are a third to a half of that and each pays a whole weight scan
(``docs/planner.md`` lists this among the roofline's departures from Helix).

Prints a table on stderr and one JSON line on stdout with every row. A cost model that cannot be built
(its module missing) is skipped with the reason on stderr.

    .venv/bin/python scripts/bench_simulator.py [--clusters helix-single-24,helix-hetero-42]
        [--workloads 763/232,750/240] [--cost-models roofline,helix] [--algorithms milp]
        [--load 1.1] [--duration 1200] [--milp-time-limit 10] [--seed 0]

``--duration`` is seconds of arrivals per workload, or per workload as ``763/232=1200,16/16=60``: a
763/232 request lives for 232 round trips of about a second, so the run needs several request lifetimes
before the KV caches fill and completions stop arriving in step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from swarmnode.planner.cluster.shipped import load_shared_cluster
from swarmnode.planner.cluster.spec import Workload
from swarmnode.planner.costs.factory import COST_MODELS, make_cost_model
from swarmnode.planner.costs.roofline import CostModel
from swarmnode.planner.flow_graph import Evaluation, evaluate
from swarmnode.planner.placement import Placement
from swarmnode.planner.registry import PLACEMENT_ALGORITHMS
from swarmnode.planner.simulator.engine import simulate_rate
from swarmnode.planner.simulator.metrics import SimConfig
from swarmnode.planner.simulator.scoring import plan_placement
from swarmnode.planner.simulator.serving import EXPECTED_OUTPUT_SHARE, serving_from_placement

CLUSTERS = ["helix-single-24", "helix-hetero-42"]
WORKLOADS = ["763/232", "750/240"]


def _workload(text: str) -> Workload:
    try:
        s_in, s_out = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"workload {text!r}: write it as INPUT/OUTPUT tokens, e.g. 763/232") from None
    if s_in < 1 or s_out < 1:
        raise SystemExit(f"workload {text!r}: both lengths must be at least 1")
    return Workload(s_in, s_out)


def _durations(text: str, workloads: list[str]) -> dict[str, float]:
    if "=" not in text:
        return dict.fromkeys(workloads, float(text))
    out = {}
    for part in text.split(","):
        name, _, seconds = part.partition("=")
        out[name] = float(seconds)
    missing = [w for w in workloads if w not in out]
    if missing:
        raise SystemExit(f"--duration gives no seconds for workload(s) {', '.join(missing)}")
    return out


def _busy_batch(cost: CostModel, node_id: str, blocks: int, rate: float) -> float | None:
    """Passes per batch of a node that runs continuously at ``rate`` passes per second: the ``n`` with
    ``n = rate x B(n)``, ``B(n)`` the cost model's time of ``n`` average passes; None when the node
    cannot keep up with ``rate``."""
    shape = cost.shape
    share_in = shape.s_in / shape.s_out
    share_decode = (shape.s_out - 1.0) / shape.s_out

    def seconds(n: float) -> float:
        return cost.batch_seconds(node_id, blocks, n * share_in, n * share_decode, n * shape.context_per_pass)

    n = 1.0
    for _ in range(500):
        step = rate * seconds(n)
        if step > 1e6:
            return None
        if abs(step - n) < 1e-9 * max(1.0, n):
            return step
        n = step
    return None


def kv_share(cost: CostModel, placement: Placement, ev: Evaluation) -> float:
    """The largest share ``x`` (at most 1.5) of the max flow whose requests fit the KV caches, in a fluid
    view: at ``x`` every node runs continuously at ``x`` times its max-flow share with the batch that
    sustains it (:func:`_busy_batch`), a pass takes the flow-weighted sum of those batch times (no
    queueing, no network), and a node holds KV for its share of the ``x X R`` requests in flight (Little's
    law); it holds ``kv_token_layers / (j (s_in + s_out / 2))`` of them (the simulator's admission rule,
    Helix's KV expectation: :data:`planner.simulator.serving.EXPECTED_OUTPUT_SHARE`). An upper bound on what any
    scheduler can serve, not an estimate."""
    shape = cost.shape
    total = ev.throughput
    flows = {n: f for n, f in ev.node_flows.items() if f > 0}
    room = {}
    for n in flows:
        blocks = placement[n][1] - placement[n][0]
        room[n] = cost.kv_token_layers(n, blocks) / (blocks * (shape.s_in + EXPECTED_OUTPUT_SHARE * shape.s_out))

    def fits(x: float) -> bool:
        pass_seconds = 0.0
        for n, f in flows.items():
            blocks = placement[n][1] - placement[n][0]
            batch = _busy_batch(cost, n, blocks, x * f)
            if batch is None:
                return False
            pass_seconds += (f / total) * batch / (x * f)  # visited by f/X of the passes, B = n / rate
        return all(x * f * pass_seconds <= room[n] for n, f in flows.items())

    if total <= 0 or not flows:
        return 0.0
    low, high = 0.0, 1.5
    if fits(high):
        return high
    for _ in range(40):
        mid = (low + high) / 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--cost-models", default=",".join(COST_MODELS))
    parser.add_argument("--algorithms", default="milp")
    parser.add_argument("--load", type=float, default=1.1, help="offered load as a multiple of the max flow")
    parser.add_argument("--duration", default="1200")
    parser.add_argument("--milp-time-limit", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    durations = _durations(args.duration, workloads)
    algorithms = [a for a in args.algorithms.split(",") if a]
    for a in algorithms:
        if a not in PLACEMENT_ALGORITHMS:
            raise SystemExit(f"unknown algorithm {a!r}; choose among {', '.join(PLACEMENT_ALGORITHMS)}")
    cost_models = [c for c in args.cost_models.split(",") if c]
    for c in cost_models:
        if c not in COST_MODELS:
            raise SystemExit(f"unknown cost model {c!r}; choose among {', '.join(COST_MODELS)}")
    if not args.load > 0:
        raise SystemExit("--load must be positive")
    rows = []
    skipped = {}
    for name in [c for c in args.clusters.split(",") if c]:
        base = load_shared_cluster(name)
        for cost_name in cost_models:
            for text in workloads:
                workload = _workload(text)
                try:
                    cost = make_cost_model(base, cost_name, workload=workload)
                except ImportError as exc:
                    skipped[cost_name] = str(exc)
                    print(f"  skipping the {cost_name} cost model: {exc}", file=sys.stderr)
                    break
                for algorithm in algorithms:
                    t0 = time.monotonic()
                    placement = plan_placement(base, algorithm, cost, args.milp_time_limit)
                    solve = time.monotonic() - t0
                    ev = evaluate(base, placement, cost=cost, with_latency=False)
                    model = serving_from_placement(base, placement, cost=cost, flows=ev.flows)
                    duration = durations[text]
                    rate = args.load * ev.throughput / workload.avg_output_tokens
                    t1 = time.monotonic()
                    result = simulate_rate(
                        model,
                        rate,
                        duration,
                        input_tokens=int(workload.avg_input_tokens),
                        output_tokens=int(workload.avg_output_tokens),
                        spread=0.5,
                        seed=args.seed,
                        config=SimConfig(warmup=duration / 2, drain=0.0),
                    )
                    busy = [u for n, u in result.server_utilisation.items() if ev.node_flows.get(n, 0.0) > 0]
                    ratio = result.throughput / ev.throughput if ev.throughput > 0 else math.nan
                    rows.append(
                        {
                            "cluster": name,
                            "cost_model": cost_name,
                            "workload": text,
                            "algorithm": algorithm,
                            "solve_seconds": round(solve, 2),
                            "max_flow": round(ev.throughput, 1),
                            "rate": round(rate, 3),
                            "duration": duration,
                            "sim_throughput": round(result.throughput, 1),
                            "ratio": round(ratio, 3),
                            "kv_share": round(kv_share(cost, placement, ev), 3),
                            "waiting": result.waiting,
                            "mean_utilisation": round(sum(busy) / len(busy), 3) if busy else None,
                            "sim_seconds": round(time.monotonic() - t1, 1),
                        }
                    )
                    print(f"  {name} {cost_name} {text} {algorithm}: ratio {rows[-1]['ratio']}", file=sys.stderr)
    header = (
        f"{'cluster':16} {'cost':8} {'workload':9} {'algorithm':9} {'max flow':>9} {'sim tok/s':>9} "
        f"{'ratio':>6} {'kv share':>8} {'waiting':>8} {'util':>5} {'sim s':>6}"
    )
    print(header, file=sys.stderr)
    print("-" * len(header), file=sys.stderr)
    for r in rows:
        util = "-" if r["mean_utilisation"] is None else f"{r['mean_utilisation']:.2f}"
        print(
            f"{r['cluster']:16} {r['cost_model']:8} {r['workload']:9} {r['algorithm']:9} {r['max_flow']:9.1f} "
            f"{r['sim_throughput']:9.1f} {r['ratio']:6.3f} {r['kv_share']:8.3f} {r['waiting']:8d} {util:>5} "
            f"{r['duration']:6.0f}",
            file=sys.stderr,
        )
    print(json.dumps({"load": args.load, "seed": args.seed, "results": rows, "skipped": skipped}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
