"""Benchmark the placement algorithms on Helix's evaluation clusters.

Runs every node-placement algorithm of the registry (milp, ahp, gma, petals, swarm; the MILP warm-started
from the best heuristic, as ``swarmnode plan --algorithm all`` does) on each cluster, prints a table
(throughput in tokens/s, ratio to Petals and to Swarm, the lowest proven upper bound with its name and the
gap to it, Helix's bound and the gap to it, solve seconds) and, last, one JSON line with every number. The machine's load average is
recorded before and after: the MILP runs under a time limit, so a busy CPU lowers what it reaches.

    python scripts/bench_planner.py                 # 60 s for 24-node clusters, 300 s for the 42-node one
    python scripts/bench_planner.py --quick         # 10 s / 30 s

``--scale`` plans past the papers' scale instead: seeded synthetic clusters (:mod:`planner.cluster.synthetic`: Helix's
GPU kinds, LLaMPS-like CPU nodes, 2-4 regions of Helix Table 7) of 100 and 250 nodes, the MILP with 120 s and
300 s, and reports the solve time (all algorithms, and the MILP alone), the MILP's throughput, the lowest
proven upper bound with its name and the gap to it, the heuristics' throughputs and the formulation used.
The aims: within 10% of the bound in 120 s at 100 nodes, a feasible plan in 300 s at 250 (Helix's Gurobi
runs stopped at a 5953% gap after 600 s).

    python scripts/bench_planner.py --scale                                   # 100 and 250 nodes
    python scripts/bench_planner.py --scale --scale-nodes 60 --scale-time-limit 30 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmnode.planner import Placement, evaluate, load_shared_cluster, plan_all
from swarmnode.planner.algorithms.petals import petals_orders
from swarmnode.planner.cluster.synthetic import synthetic_cluster
from swarmnode.planner.costs.factory import COST_MODELS, make_cost_model
from swarmnode.planner.simulator.scoring import serve_at_load

CLUSTERS = ["helix-single-24", "helix-geo-24", "helix-hetero-42"]
HEURISTICS = ("petals", "swarm", "gma", "ahp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", nargs="*", default=CLUSTERS)
    parser.add_argument(
        "--time-limit-24", type=float, default=60.0, help="MILP seconds for clusters up to 24 nodes"
    )
    parser.add_argument("--time-limit-42", type=float, default=300.0, help="MILP seconds for larger clusters")
    parser.add_argument("--gap", type=float, default=0.05, help="MILP early-stop gap")
    parser.add_argument("--quick", action="store_true", help="10 s and 30 s MILP limits")
    parser.add_argument(
        "--cost-model", nargs="+", choices=COST_MODELS, default=list(COST_MODELS),
        help="cost models to plan and score with (default: both)",
    )
    parser.add_argument("--petals-seeds", type=int, default=20, help="Petals join orders to try (seeds 0..N-1)")
    parser.add_argument(
        "--sim-duration", type=float, default=600.0,
        help="seconds of simulated serving per placement at one offered load (0: max flow only)",
    )
    parser.add_argument(
        "--sim-load", type=float, default=1.1, help="offered load of the simulation, times the MILP's max flow"
    )
    parser.add_argument("--scale", action="store_true", help="plan synthetic clusters of many nodes instead")
    parser.add_argument(
        "--scale-nodes", type=int, nargs="+", default=[100, 250], help="--scale: cluster sizes (nodes)"
    )
    parser.add_argument(
        "--scale-time-limit",
        type=float,
        nargs="+",
        default=[120.0, 300.0],
        help="--scale: MILP seconds, one per size (or one for all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="--scale: the synthetic clusters' seed")
    args = parser.parse_args()
    if args.scale:
        limits = args.scale_time_limit
        if len(limits) == 1:
            limits = limits * len(args.scale_nodes)
        if len(limits) != len(args.scale_nodes):
            parser.error("--scale-time-limit takes one limit, or one per size of --scale-nodes")
        scale(args.scale_nodes, limits, seed=args.seed, gap=args.gap)
        return
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
        limit = args.time_limit_24 if len(cluster.nodes) <= 24 else args.time_limit_42
        for cost_model in args.cost_model:
            entry = bench_cluster(
                cluster, cost_model, limit, args.gap, args.petals_seeds, rows,
                sim_duration=args.sim_duration, sim_load=args.sim_load,
            )
            report["clusters"].setdefault(name, {})[cost_model] = entry
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    header = (
        f"{'cluster':<18} {'model':<8} {'algorithm':<16} {'tokens/s':>9} {'x petals':>9} {'x swarm':>8} "
        f"{'bound':>9} {'(name)':<11} {'gap':>7} {'Helix':>9} {'gap(H)':>7} {'seconds':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, cost_model, algorithm, e in rows:
        print(
            f"{name:<18} {cost_model:<8} {algorithm:<16} {e['throughput']:>9.1f} {e['vs_petals'] or float('nan'):>9.2f} "
            f"{e['vs_swarm'] or float('nan'):>8.2f} {e['upper_bound']:>9.1f} {e['bound_name'] or '':<11} "
            f"{100 * e['gap']:>6.1f}% {e['helix_bound']:>9.1f} {100 * e['gap_to_helix_bound']:>6.1f}% "
            f"{e['solve_seconds']:>8.2f}"
        )
    print(
        "bound: the lowest proven upper bound (helix: Helix §4.5; coordinator: the coordinator's links; "
        "coverage: best minimum block coverage, links ignored; solver: a MILP dual bound); gap: to it; "
        "gap(H): to Helix's bound; petals: seed 0 of Helix's seeded join order (median: over the seeds); "
        "helix-*: Helix's published layouts (tests/data/helix_layouts/) scored by the same cost model"
    )
    for name, by_model in report["clusters"].items():
        for cost_model, entry in by_model.items():
            sim = entry.get("simulated")
            if sim is None:
                continue
            r = entry["ratios"]
            served = ", ".join(f"{k} {v:.0f}" for k, v in sim["tokens_per_s"].items())
            print(
                f"simulated {name} {cost_model} at {sim['load']}x the milp max flow ({sim['duration']:.0f} s): "
                f"{served} tokens/s; milp x petals {r['sim_milp_vs_petals_seed0']:.2f} (seed 0), "
                f"{r['sim_milp_vs_petals_median']:.2f} (median), x swarm {r['sim_milp_vs_swarm']:.2f}"
            )
    print(
        f"load average before {report['load_average_before']}, after {report['load_average_after']} "
        f"on {report['cpus']} CPUs"
    )
    print(json.dumps(report, sort_keys=True))


LAYOUTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "helix_layouts"


def _row(r, petals_tp: float, swarm_tp: float) -> dict:
    return {
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


def published_layouts(cluster) -> dict[str, Placement]:
    """Helix's published placements for this cluster (ilp, petals, swarm), when converted ones exist."""
    found = {}
    for kind in ("ilp", "petals", "swarm"):
        path = LAYOUTS / f"{cluster.name}.{kind}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            found[kind] = Placement({n: tuple(r) for n, r in data["placement"].items()})
    return found


def bench_cluster(
    cluster, cost_model: str, limit: float, gap: float, seeds: int, rows: list, *,
    sim_duration: float = 0.0, sim_load: float = 1.1,
) -> dict:
    """Every algorithm on one cluster under one cost model, Petals over ``seeds`` join orders, and Helix's
    published layouts scored alike; appends table rows to ``rows`` and returns the JSON entry. With
    ``sim_duration``, the MILP's, Petals' (seed 0 and the median order), Swarm's and the published
    placements are also served by the simulator at one offered load, ``sim_load`` times the MILP's max
    flow (:func:`planner.simulator.scoring.serve_at_load`; Helix Fig. 9 compares placements so)."""
    name = cluster.name
    cost = make_cost_model(cluster, cost_model)
    t0 = time.monotonic()
    planned = plan_all(
        cluster, time_limit=limit, gap=gap, cost=cost,
        on_error=lambda algorithm, exc: print(f"{name} {algorithm}: {exc}", file=sys.stderr),
    )
    results = {r.algorithm: r for r in planned}
    print(f"  {name:<18} {cost_model:<8} planned in {time.monotonic() - t0:6.1f} s", file=sys.stderr)
    runs = petals_orders(cluster, range(seeds), cost=cost)
    petals_tps = sorted(run.throughput for run in runs)
    petals_tp = results["petals"].throughput if "petals" in results else float("nan")
    swarm_tp = results["swarm"].throughput if "swarm" in results else float("nan")
    entry = {
        "nodes": len(cluster.nodes),
        "milp_time_limit": limit,
        "helix_bound": cost.upper_bound(),
        "petals_orders": {
            "seeds": seeds,
            "seed0": round(runs[0].throughput, 2),
            "median": round(statistics.median(petals_tps), 2),
            "min": round(petals_tps[0], 2),
            "max": round(petals_tps[-1], 2),
        },
    }
    for algorithm, r in results.items():
        entry[algorithm] = _row(r, petals_tp, swarm_tp)
        if algorithm == "milp":
            entry[algorithm]["formulation"] = r.details.get("formulation")
            entry[algorithm]["bounds"] = {k: round(v, 2) for k, v in r.details.get("bounds", {}).items()}
        rows.append((name, cost_model, algorithm, entry[algorithm]))
    published = {}
    for kind, placement in published_layouts(cluster).items():
        tp = evaluate(cluster, placement, cost=cost).throughput
        published[kind] = round(tp, 2)
    if published:
        entry["helix_published"] = published
    milp_tp = results["milp"].throughput if "milp" in results else float("nan")
    ratios = {
        "milp_vs_petals_seed0": milp_tp / runs[0].throughput,
        "milp_vs_petals_median": milp_tp / statistics.median(petals_tps),
        "milp_vs_swarm": milp_tp / swarm_tp,
    }
    if {"ilp", "petals", "swarm"} <= set(published):
        ratios["published_ilp_vs_petals"] = published["ilp"] / published["petals"]
        ratios["published_ilp_vs_swarm"] = published["ilp"] / published["swarm"]
        ratios["published_petals_vs_swarm"] = published["petals"] / published["swarm"]
    if sim_duration > 0 and "milp" in results and "swarm" in results:
        by_flow = sorted(runs, key=lambda run: run.throughput)
        placements = {
            "milp": results["milp"].placement,
            "petals_seed0": runs[0].placement,
            "petals_median": by_flow[(len(by_flow) - 1) // 2].placement,
            "swarm": results["swarm"].placement,
        } | {f"helix-{kind}": p for kind, p in published_layouts(cluster).items()}
        t1 = time.monotonic()
        served = serve_at_load(cluster, placements, cost, load=sim_load, duration=sim_duration)
        print(f"  {name:<18} {cost_model:<8} simulated in {time.monotonic() - t1:6.1f} s", file=sys.stderr)
        entry["simulated"] = {
            "load": sim_load,
            "duration": sim_duration,
            "tokens_per_s": {k: round(v[1], 1) for k, v in served.items()},
            "vs_max_flow": {k: round(v[1] / v[0], 3) if v[0] > 0 else None for k, v in served.items()},
        }
        sim = {k: v[1] for k, v in served.items()}
        ratios["sim_milp_vs_petals_seed0"] = sim["milp"] / sim["petals_seed0"]
        ratios["sim_milp_vs_petals_median"] = sim["milp"] / sim["petals_median"]
        ratios["sim_milp_vs_swarm"] = sim["milp"] / sim["swarm"]
        if {"helix-ilp", "helix-petals", "helix-swarm"} <= set(sim):
            ratios["sim_published_ilp_vs_petals"] = sim["helix-ilp"] / sim["helix-petals"]
            ratios["sim_published_petals_vs_swarm"] = sim["helix-petals"] / sim["helix-swarm"]
    entry["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    for kind, tp in published.items():
        rows.append((name, cost_model, f"helix-{kind}", {
            "throughput": tp, "vs_petals": round(tp / petals_tp, 3), "vs_swarm": round(tp / swarm_tp, 3),
            "upper_bound": round(cost.upper_bound(), 2), "bound_name": "helix", "gap": 1 - tp / cost.upper_bound(),
            "helix_bound": round(cost.upper_bound(), 2), "gap_to_helix_bound": 1 - tp / cost.upper_bound(),
            "solve_seconds": 0.0,
        }))
    return entry


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def scale(sizes: list[int], limits: list[float], *, seed: int, gap: float) -> None:
    """The ``--scale`` mode (module docstring): one synthetic cluster per size, every algorithm on it, a
    table and one JSON line last on stdout."""
    report = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seed": seed,
        "gap_option": gap,
        "load_average_before": _load(),
        "sizes": {},
    }
    for size, limit in zip(sizes, limits, strict=True):
        t0 = time.monotonic()
        cluster = synthetic_cluster(size, seed=seed)
        cost = make_cost_model(cluster)
        built = time.monotonic() - t0
        print(f"  {cluster.name}: {len(cluster.nodes)} nodes, built in {built:.1f} s", file=sys.stderr)
        load_before = _load()

        def progress(p, name=cluster.name):
            print(
                f"  {name} {p.phase:<10} {p.elapsed:7.1f} s  best {p.best:9.1f}  bound {p.bound:9.1f}  "
                f"{p.message}",
                file=sys.stderr,
            )

        t1 = time.monotonic()
        planned = plan_all(
            cluster,
            time_limit=limit,
            gap=gap,
            cost=cost,
            progress=progress,
            on_error=lambda algorithm, exc, name=cluster.name: print(
                f"{name} {algorithm}: {exc}", file=sys.stderr
            ),
        )
        total = time.monotonic() - t1
        results = {r.algorithm: r for r in planned}
        entry = {
            "cluster": cluster.name,
            "nodes": len(cluster.nodes),
            "cpu_nodes": sum(1 for n in cluster.nodes if n.device == "cpu"),
            "regions": sorted({n.region for n in cluster.nodes}),
            "build_seconds": round(built, 2),
            "milp_time_limit": limit,
            "total_seconds": round(total, 2),
            "heuristics": {a: round(results[a].throughput, 2) for a in HEURISTICS if a in results},
            "heuristic_seconds": {a: round(results[a].solve_seconds, 2) for a in HEURISTICS if a in results},
            "load_average_before": load_before,
            "load_average_after": _load(),
        }
        milp_result = results.get("milp")
        if milp_result is not None:
            details = milp_result.details
            entry["milp"] = {
                "throughput": round(milp_result.throughput, 2),
                "milp_seconds": round(milp_result.solve_seconds, 2),
                "upper_bound": round(milp_result.upper_bound, 2),
                "bound_name": details.get("bound_name"),
                "gap": round(milp_result.gap, 4),
                "helix_bound": round(milp_result.helix_bound, 2),
                "gap_to_helix_bound": round(milp_result.gap_to_helix_bound, 4),
                "bounds": {k: round(v, 2) for k, v in details.get("bounds", {}).items()},
                "formulation": details.get("formulation"),
                "status": details.get("status"),
                "start_algorithm": details.get("start_algorithm"),
                "phases": details.get("phases", []),
                "nodes_used": len(milp_result.placement),
            }
        report["sizes"][str(size)] = entry

    report["load_average_after"] = _load()
    header = (
        f"{'nodes':>5} {'limit':>6} {'total s':>8} {'MILP s':>7} {'tokens/s':>9} {'bound':>9} {'(name)':<11} "
        f"{'gap':>7} {'best heur.':>10} {'(name)':<7} {'formulation'}"
    )
    print(header)
    print("-" * len(header))
    for entry in report["sizes"].values():
        m = entry.get("milp")
        heur = entry["heuristics"]
        best_name = max(heur, key=heur.get) if heur else ""
        if m is None:
            print(
                f"{entry['nodes']:>5} {entry['milp_time_limit']:>6.0f} {entry['total_seconds']:>8.1f}  "
                "MILP failed"
            )
            continue
        print(
            f"{entry['nodes']:>5} {entry['milp_time_limit']:>6.0f} {entry['total_seconds']:>8.1f} "
            f"{m['milp_seconds']:>7.1f} {m['throughput']:>9.1f} {m['upper_bound']:>9.1f} "
            f"{m['bound_name'] or '':<11} {100 * m['gap']:>6.1f}% {heur.get(best_name, float('nan')):>10.1f} "
            f"{best_name:<7} {m['formulation']}"
        )
    for entry in report["sizes"].values():
        heur = ", ".join(f"{a} {v:.1f}" for a, v in entry["heuristics"].items())
        print(f"{entry['nodes']} nodes ({', '.join(entry['regions'])}): heuristics {heur}")
    print(
        "total s: every algorithm (heuristics, then the MILP warm-started from the best); MILP s: the MILP "
        "alone, time limit included; bound: the lowest proven upper bound; gap: to it"
    )
    print(
        f"load average before {report['load_average_before']}, after {report['load_average_after']} "
        f"on {report['cpus']} CPUs"
    )
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
