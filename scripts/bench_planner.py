"""Benchmark the placement algorithms on Helix's evaluation clusters.

Runs every node-placement algorithm of the registry (milp, ahp, gma, petals, swarm; the MILP warm-started
from the best heuristic, as ``swarmnode plan --algorithm all`` does) on each cluster, prints a table
(throughput in tokens/s, ratio to Petals and to Swarm, the lowest proven upper bound with its name and the
gap to it, Helix's bound and the gap to it, solve seconds) and, last, one JSON line with every number. The machine's load average is
recorded before and after: the MILP runs under a time limit, so a busy CPU lowers what it reaches.

    python scripts/bench_planner.py                 # 60 s for 24-node clusters, 300 s for the 42-node one
    python scripts/bench_planner.py --quick         # 10 s / 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmnode.planner import CostModel, load_shared_cluster, plan_all

CLUSTERS = ["helix-single-24", "helix-geo-24", "helix-hetero-42"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", nargs="*", default=CLUSTERS)
    parser.add_argument(
        "--time-limit-24", type=float, default=60.0, help="MILP seconds for clusters up to 24 nodes"
    )
    parser.add_argument("--time-limit-42", type=float, default=300.0, help="MILP seconds for larger clusters")
    parser.add_argument("--gap", type=float, default=0.05, help="MILP early-stop gap")
    parser.add_argument("--quick", action="store_true", help="10 s and 30 s MILP limits")
    args = parser.parse_args()
    if args.quick:
        args.time_limit_24, args.time_limit_42 = 10.0, 30.0

    rows = []
    report = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "clusters": {},
    }
    for name in args.clusters:
        cluster = load_shared_cluster(name)
        cost = CostModel(cluster)
        limit = args.time_limit_24 if len(cluster.nodes) <= 24 else args.time_limit_42
        t0 = time.monotonic()
        planned = plan_all(
            cluster, time_limit=limit, gap=args.gap, cost=cost,
            on_error=lambda algorithm, exc, name=name: print(f"{name} {algorithm}: {exc}", file=sys.stderr),
        )
        results = {r.algorithm: r for r in planned}
        print(f"  {name:<18} planned in {time.monotonic() - t0:6.1f} s", file=sys.stderr)
        petals_tp = results["petals"].throughput if "petals" in results else float("nan")
        swarm_tp = results["swarm"].throughput if "swarm" in results else float("nan")
        entry = {"nodes": len(cluster.nodes), "milp_time_limit": limit, "helix_bound": cost.upper_bound()}
        for algorithm, r in results.items():
            entry[algorithm] = {
                "throughput": round(r.throughput, 2),
                "vs_petals": round(r.throughput / petals_tp, 3) if petals_tp > 0 else None,
                "vs_swarm": round(r.throughput / swarm_tp, 3) if swarm_tp > 0 else None,
                "upper_bound": round(r.upper_bound, 2),
                "bound_name": r.details.get("bound_name"),
                "gap": round(r.gap, 4),
                "helix_bound": round(r.helix_bound, 2),
                "gap_to_helix_bound": round(r.gap_to_helix_bound, 4),
                "solve_seconds": round(r.solve_seconds, 2),
            }
            if algorithm == "milp":
                entry[algorithm]["formulation"] = r.details.get("formulation")
                entry[algorithm]["bounds"] = {k: round(v, 2) for k, v in r.details.get("bounds", {}).items()}
            rows.append((name, algorithm, entry[algorithm]))
        report["clusters"][name] = entry

    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    header = (
        f"{'cluster':<18} {'algorithm':<9} {'tokens/s':>9} {'x petals':>9} {'x swarm':>8} "
        f"{'bound':>9} {'(name)':<11} {'gap':>7} {'Helix':>9} {'gap(H)':>7} {'seconds':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, algorithm, e in rows:
        print(
            f"{name:<18} {algorithm:<9} {e['throughput']:>9.1f} {e['vs_petals'] or float('nan'):>9.2f} "
            f"{e['vs_swarm'] or float('nan'):>8.2f} {e['upper_bound']:>9.1f} {e['bound_name'] or '':<11} "
            f"{100 * e['gap']:>6.1f}% {e['helix_bound']:>9.1f} {100 * e['gap_to_helix_bound']:>6.1f}% "
            f"{e['solve_seconds']:>8.2f}"
        )
    print(
        "bound: the lowest proven upper bound (helix: Helix §4.5; coordinator: the coordinator's links; "
        "coverage: best minimum block coverage, links ignored; solver: a MILP dual bound); gap: to it; "
        "gap(H): to Helix's bound"
    )
    print(
        f"load average before {report['load_average_before']}, after {report['load_average_after']} "
        f"on {report['cpus']} CPUs"
    )
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
