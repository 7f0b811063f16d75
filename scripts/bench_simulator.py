"""Serving simulator against Helix's max flow on the Helix clusters, at saturation.

For each cluster and workload, the placement (by default the MILP's) is planned for the workload's average
lengths (the cost model's workload), its max flow computed, and the simulator is driven with Poisson
arrivals at ``--load`` times that max flow (requests/s = load x max flow / s_out), lengths spread by
+-50% so that requests do not finish in lockstep. The simulated output tokens/s are measured over the
second half of the run. Prints a table, then one JSON line with every row and the simulated/max-flow
ratios side by side.

    .venv/bin/python scripts/bench_simulator.py [--clusters helix-single-24,...] [--workloads 16/16,64/16]
        [--algorithms milp,petals] [--load 1.1] [--duration 60] [--milp-time-limit 10]

``--duration`` is per workload unless given as ``16/16=60,763/232=600``: long requests need minutes of
simulated time before their KV cache fills and completions stop arriving in step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from swarmnode.planner.cluster import Workload
from swarmnode.planner.cost_model import CostModel
from swarmnode.planner.flow_graph import evaluate
from swarmnode.planner.registry import PLACEMENT_ALGORITHMS
from swarmnode.planner.scoring import plan_placement
from swarmnode.planner.simulator import SimConfig, serving_from_placement, simulate_rate
from swarmnode.planner.specs import load_shared_cluster

CLUSTERS = ["helix-single-24", "helix-geo-24", "helix-hetero-42"]


def _workload(text: str) -> Workload:
    try:
        s_in, s_out = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"workload {text!r}: write it as INPUT/OUTPUT tokens, e.g. 64/16") from None
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--workloads", default="16/16,64/16,763/232")
    parser.add_argument("--algorithms", default="milp")
    parser.add_argument("--load", type=float, default=1.1, help="offered load as a multiple of the max flow")
    parser.add_argument("--duration", default="16/16=60,64/16=120,763/232=900")
    parser.add_argument("--milp-time-limit", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    durations = _durations(args.duration, workloads)
    algorithms = [a for a in args.algorithms.split(",") if a]
    for a in algorithms:
        if a not in PLACEMENT_ALGORITHMS:
            raise SystemExit(f"unknown algorithm {a!r}; choose among {', '.join(PLACEMENT_ALGORITHMS)}")
    if not args.load > 0:
        raise SystemExit("--load must be positive")
    rows = []
    for name in [c for c in args.clusters.split(",") if c]:
        base = load_shared_cluster(name)
        for text in workloads:
            workload = _workload(text)
            cost = CostModel(base, workload=workload)
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
                rows.append(
                    {
                        "cluster": name,
                        "workload": text,
                        "algorithm": algorithm,
                        "solve_seconds": round(solve, 2),
                        "max_flow": round(ev.throughput, 1),
                        "rate": round(rate, 3),
                        "duration": duration,
                        "sim_throughput": round(result.throughput, 1),
                        "ratio": round(result.throughput / ev.throughput, 3) if ev.throughput > 0 else None,
                        "waiting": result.waiting,
                        "mean_utilisation": round(sum(busy) / len(busy), 3) if busy else None,
                        "sim_seconds": round(time.monotonic() - t1, 1),
                    }
                )
                print(f"  {name} {text} {algorithm}: ratio {rows[-1]['ratio']}", file=sys.stderr)
    header = (
        f"{'cluster':16} {'workload':9} {'algorithm':9} {'max flow':>9} {'sim tok/s':>9} {'ratio':>6} "
        f"{'waiting':>8} {'util':>5} {'sim s':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        util = "-" if r["mean_utilisation"] is None else f"{r['mean_utilisation']:.2f}"
        print(
            f"{r['cluster']:16} {r['workload']:9} {r['algorithm']:9} {r['max_flow']:9.1f} "
            f"{r['sim_throughput']:9.1f} {r['ratio']:6.3f} {r['waiting']:8d} {util:>5} {r['duration']:6.0f}"
        )
    print(json.dumps({"load": args.load, "seed": args.seed, "results": rows}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
