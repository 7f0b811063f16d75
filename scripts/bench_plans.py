"""Plan the HexGen and HexGen-2 clusters with every algorithm and score the plans in the serving simulator.

For each cluster, every algorithm gets the same Poisson trace: HexGen clusters use HexGen §3.1's request
(128 prompt / 64 output tokens), HexGen-2 clusters the LPLD class (256 / 64, HexGen-2 §5.1). The offered
load is HexGen-2 §5.1's online setting, 75% of the peak: here the HexGen-2 plan's max flow on HexGen-2
clusters and the HexGen plan's cost-model capacity on HexGen clusters. The node-level algorithms plan
for the trace's lengths (their cost model's workload). Prints a table, then one JSON line.

    .venv/bin/python scripts/bench_plans.py [--duration 30] [--slo-scale 5] [--clusters a,b] [--milp-time-limit 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from swarmnode.planner.cluster.shipped import load_shared_cluster
from swarmnode.planner.cluster.spec import Workload
from swarmnode.planner.costs.hexgen_gpus import Task
from swarmnode.planner.errors import PlannerError
from swarmnode.planner.registry import ALGORITHMS
from swarmnode.planner.simulator.scoring import plan_for_simulation, score

HEXGEN_CLUSTERS = [
    "hexgen-case-study-8",
    "hexgen-half-price-30",
    "hexgen-full-price-58",
    "hexgen-homogeneous-a100",
]
HEXGEN2_CLUSTERS = ["hexgen2-case-study-8"] + [f"hexgen2-setting-{i}" for i in range(1, 6)]


def _plan_cluster(name: str, cluster, task: Task, algorithms: list[str], args) -> dict:
    """Every algorithm's plan of ``cluster`` for ``task`` (or the error that stopped it), by name."""
    planned = {}
    for algorithm in algorithms:
        # each replica algorithm gets only the options it takes (planner.options): the request and the seed, and
        # HexGen's genetic search fewer generations and shorter fitness runs than its defaults
        replica_options: dict[str, object] = {"lengths": (int(task.s_in), int(task.s_out)), "seed": args.seed}
        if algorithm == "hexgen":
            replica_options |= {"generations": args.hexgen_generations, "sim_duration": 15.0}
        t0 = time.monotonic()
        try:
            planned[algorithm] = plan_for_simulation(
                cluster,
                algorithm,
                milp_time_limit=args.milp_time_limit,
                replica_options=replica_options,
                workload=Workload(task.s_in, task.s_out),
            )
        except PlannerError as exc:
            planned[algorithm] = exc
        except Exception as exc:  # a planner bug must not hide the other algorithms' rows
            planned[algorithm] = RuntimeError(f"{type(exc).__name__}: {exc}")
        print(f"  planned {name} with {algorithm} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per simulation")
    parser.add_argument("--slo-scale", type=float, default=5.0)
    parser.add_argument("--milp-time-limit", type=float, default=10.0)
    parser.add_argument("--hexgen-generations", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clusters", default=",".join(HEXGEN_CLUSTERS + HEXGEN2_CLUSTERS))
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = parser.parse_args(argv)
    clusters = [c for c in args.clusters.split(",") if c]
    algorithms = [a for a in args.algorithms.split(",") if a]
    rows = []
    for name in clusters:
        cluster = load_shared_cluster(name)
        task = Task(1.0, 256.0, 64.0) if name.startswith("hexgen2") else Task(1.0, 128.0, 64.0)
        planned = _plan_cluster(name, cluster, task, algorithms, args)
        anchor = "hexgen2" if name.startswith("hexgen2") else "hexgen"
        ref = planned.get(anchor)
        if ref is None or isinstance(ref, Exception):
            raise SystemExit(f"{name}: the {anchor} plan is needed to set the offered load ({ref})")
        peak_rps = ref.plan["requests_per_s"] if anchor == "hexgen2" else ref.plan["throughput"] / task.s_out
        rate = 0.75 * peak_rps
        for algorithm, item in planned.items():
            row = {
                "cluster": name,
                "algorithm": algorithm,
                "rate": rate,
                "s_in": task.s_in,
                "s_out": task.s_out,
            }
            if isinstance(item, Exception):
                row["error"] = str(item)
                rows.append(row)
                continue
            result = score(
                item, rate=rate, duration=args.duration, task=task, slo_scale=args.slo_scale, seed=args.seed
            )
            row.update(
                solve_seconds=round(item.plan["solve_seconds"], 3),
                planner_throughput=round(item.plan["throughput"], 1),
                sim_throughput=round(result.throughput, 1),
                slo_attainment=round(result.slo_attainment, 4),
                prompt_latency_mean=None
                if result.prompt_latency_mean is None
                else round(result.prompt_latency_mean, 3),
                decode_latency_mean=None
                if result.decode_latency_mean is None
                else round(result.decode_latency_mean, 4),
                completed=result.completed,
                requests=result.requests,
            )
            rows.append(row)
    header = f"{'cluster':24} {'algorithm':9} {'rate/s':>7} {'solve s':>8} {'plan tok/s':>10} {'sim tok/s':>9} {'SLO %':>6} {'TTFT s':>7} {'TPOT s':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            print(f"{row['cluster']:24} {row['algorithm']:9} {row['rate']:7.2f}  error: {row['error'][:70]}")
            continue
        ttft = "-" if row["prompt_latency_mean"] is None else f"{row['prompt_latency_mean']:.2f}"
        tpot = "-" if row["decode_latency_mean"] is None else f"{row['decode_latency_mean']:.3f}"
        print(
            f"{row['cluster']:24} {row['algorithm']:9} {row['rate']:7.2f} {row['solve_seconds']:8.2f} "
            f"{row['planner_throughput']:10.1f} {row['sim_throughput']:9.1f} {100 * row['slo_attainment']:6.1f} {ttft:>7} {tpot:>7}"
        )
    print(
        json.dumps({"duration": args.duration, "slo_scale": args.slo_scale, "results": rows}, sort_keys=True)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
