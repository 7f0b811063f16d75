"""What the redundancy floor costs: the MILP's planned max flow with ``min_replicas`` 1 and 2, side by side.

For each of Helix's evaluation clusters the MILP plans twice under the same time limit, once with Helix's
objective alone (``min_replicas=1``) and once keeping every block on at least two nodes where the nodes'
capacities allow it (``min_replicas=2``, :mod:`planner.search.redundancy`). Prints one JSON line: per cluster
both throughputs (tokens/s on Helix's flow graph), their ratio (floor 2 / floor 1), how many of the
blocks the offers let reach the floor, the blocks left on one node, the proven upper bound of the floor-2
plan and both solve times; and the machine's load before and after (the MILP runs under a time limit, so
a busy CPU lowers what it reaches).

    python scripts/bench_redundancy.py                   # 60 s per solve, about 6 minutes
    python scripts/bench_redundancy.py --time-limit 20 --cluster helix-hetero-42
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmnode.planner import load_shared_cluster, plan

CLUSTERS = ("helix-single-24", "helix-geo-24", "helix-hetero-42")


def measure(name: str, time_limit: float) -> dict:
    cluster = load_shared_cluster(name)
    results = {}
    for floor in (1, 2):
        t0 = time.monotonic()
        results[floor] = (plan(cluster, "milp", time_limit=time_limit, min_replicas=floor), time.monotonic() - t0)
    (one, one_s), (two, two_s) = results[1], results[2]
    floor = two.details.get("floor", {})
    return {
        "floor1_tok_s": round(one.throughput, 1),
        "floor2_tok_s": round(two.throughput, 1),
        "ratio": round(two.throughput / one.throughput, 3) if one.throughput > 0 else None,
        "blocks_at_floor": floor.get("blocks_at_floor"),
        "num_blocks": cluster.model.num_blocks,
        "floor2_single_points": [list(r) for r in two.single_points],
        "floor1_single_points": [list(r) for r in one.single_points],
        "floor2_upper_bound": round(two.upper_bound, 1),
        "floor1_seconds": round(one_s, 1),
        "floor2_seconds": round(two_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per MILP solve (default 60)")
    parser.add_argument("--cluster", action="append", choices=CLUSTERS, help="cluster(s) to run (default all)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    clusters = {name: measure(name, args.time_limit) for name in (args.cluster or CLUSTERS)}
    print(
        json.dumps(
            {
                "time_limit": args.time_limit,
                "clusters": clusters,
                "load_before": round(load_before, 2),
                "load_after": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
