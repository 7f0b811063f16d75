"""The text tables ``swarmnode plan`` prints for a plan: one line per node range, or per replica group
and its stages.

A node placement (:class:`~planner.api.PlanResult`) shows each node's range, its capacity holding that
range (Helix's ``T_j``) and the max flow through it. A HexGen or HexGen-2 plan shows each group's GPUs,
parallel strategy, capacity, HexGen Eq. 2 latency and Eq. 7 memory verdict
(:mod:`planner.costs.replica_figures`), its stages, and for HexGen-2 the KV routing between groups.
"""

from __future__ import annotations

from .cluster.spec import Cluster
from .costs.factory import make_cost_model
from .costs.replica_figures import memory_verdict, request_latency

__all__ = ["hexgen2_table", "hexgen_table", "placement_table"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def seconds_text(value: float | None) -> str:
    """Seconds for a table: three decimals, or ``-`` when there is no figure."""
    return "-" if value is None else f"{value:.3f} s"


def placement_table(cluster: Cluster, result) -> str:
    """A node placement: throughput, bound and gap, then one line per node (range, capacity, flow)."""
    lines = [
        f"{result.algorithm}: throughput {result.throughput:.1f} tokens/s, "
        f"upper bound {result.upper_bound:.1f} (gap {100 * result.gap:.1f}%), solved in {result.solve_seconds:.2f} s"
        + (f", best pipeline {1000 * result.latency:.1f} ms/token" if result.latency is not None else ""),
    ]
    header = f"{'node':<24} {'range':>12} {'blocks':>6} {'capacity':>10} {'flow':>10}"
    lines += [header, "-" * len(header)]
    cost = make_cost_model(cluster, getattr(result, "cost_model", None))
    for node_id, (start, end) in sorted(result.placement.items(), key=lambda item: (item[1], item[0])):
        lines.append(
            f"{node_id:<24} {f'[{start}, {end})':>12} {end - start:>6} "
            f"{cost.throughput(node_id, end - start):>10.1f} {result.node_flows.get(node_id, 0.0):>10.1f}"
        )
    idle = [n for n in cluster.node_ids if n not in result.placement]
    if idle:
        lines.append(f"unused: {', '.join(idle)}")
    return "\n".join(lines)


def _gpu_mix(gpus) -> str:
    kinds: dict[str, int] = {}
    for g in gpus:
        kinds[g.gpu_type] = kinds.get(g.gpu_type, 0) + 1
    mix = ", ".join(f"{n}x {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{_plural(len(gpus), 'GPU')} ({mix})"


def _stage_lines(replica) -> list[str]:
    width = max(len(s.id) for s in replica.stages)
    return [
        f"    stage {j}  {s.id:<{width}}  {'/'.join(sorted(s.gpu_types))}  TP {s.tp}  "
        f"layers [{s.start}, {s.end}) ({_plural(s.layers, 'layer')})"
        for j, s in enumerate(replica.stages)
    ]


def _group_lines(cluster: Cluster, name: str, replica, task, figures: str) -> list[str]:
    verdict, problems = memory_verdict(cluster, replica, task)
    lines = [
        f"{name}  {replica.role:<7}  {_gpu_mix(replica.gpus)}  TP {'/'.join(map(str, replica.strategy))}, "
        f"PP {len(replica.stages)}  {figures}  memory {verdict}"
    ]
    lines.extend(_stage_lines(replica))
    lines.extend(f"    ! {p}" for p in problems)
    return lines


def _unused(cluster: Cluster, replicas) -> list[str]:
    used = {g.node for r in replicas for g in r.gpus}
    idle = [n.id for n in cluster.nodes if n.gpus and n.id not in used]
    return [f"unused: {', '.join(idle)}"] if idle else []


def hexgen_table(cluster: Cluster, result) -> str:
    """A HexGen plan (:class:`~planner.algorithms.hexgen.HexGenResult`): its fitness, then every replica group."""
    task, fit = result.task, result.fitness
    lines = [
        f"hexgen: {_plural(len(result.replicas), 'replica group')}, "
        f"capacity {result.throughput:.1f} tokens/s (cost model), upper bound {result.upper_bound:.1f}, "
        f"solved in {result.solve_seconds:.2f} s ({_plural(result.generations, 'generation')}, "
        f"{_plural(result.evaluations, 'grouping')} simulated)",
        f"task {task.s_in:g} prompt / {task.s_out:g} output tokens; "
        f"fitness trace {result.rate:.2f} requests/s: SLO attainment {100 * fit.slo_attainment:.1f}% (scale {result.slo_scale:g}), "
        f"simulated {fit.throughput:.1f} tokens/s, prompt latency {seconds_text(fit.prompt_latency_mean)}, "
        f"decode {seconds_text(fit.decode_latency_mean)}/token, end to end {seconds_text(fit.latency_mean)}",
        "capacity: output tokens/s at the largest batch that fits; latency: HexGen Eq. 2 for one request; "
        "memory: Eq. 7 per GPU",
    ]
    for i, r in enumerate(result.replicas):
        figures = f"capacity {r.capacity:.1f} tokens/s, latency {request_latency(cluster, r, task):.3f} s"
        lines.extend(_group_lines(cluster, f"replica-{i}", r, task, figures))
    return "\n".join(lines + _unused(cluster, result.replicas))


def hexgen2_table(cluster: Cluster, result) -> str:
    """A HexGen-2 plan (:class:`~planner.algorithms.hexgen2.HexGen2Result`): its max flow, the prefill and decode
    groups with the requests/s routed through each, the KV routing and the refinement's moves."""
    task = result.task
    decode_capacity = sum(r.capacity for r in result.decode)
    lines = [
        f"hexgen2: {len(result.prefill)} prefill + {len(result.decode)} decode groups, max flow "
        f"{result.value:.2f} requests/s = {result.throughput:.1f} tokens/s (decode capacity "
        f"{decode_capacity:.1f} tokens/s), solved in {result.solve_seconds:.2f} s "
        f"({_plural(result.iterations, 'refinement iteration')}, "
        f"{_plural(len(result.moves), 'move')} applied)",
        f"task {task.s_in:g} prompt / {task.s_out:g} output tokens; prefill capacity in prompts/s (latency = "
        "one prompt), decode in output tokens/s; routed = max-flow requests/s; memory: Eq. 7 per GPU",
    ]
    for i, r in enumerate(result.prefill):
        routed = result.source_flow[i] if i < len(result.source_flow) else 0.0
        latency = 1.0 / r.capacity if r.capacity > 0 else float("inf")
        figures = f"capacity {r.capacity:.2f} prompts/s, latency {latency:.3f} s, routed {routed:.2f} req/s"
        lines.extend(_group_lines(cluster, f"prefill-{i}", r, task, figures))
    for j, r in enumerate(result.decode):
        routed = sum(f for (_, jj), f in result.kv_routing.items() if jj == j)
        figures = f"capacity {r.capacity:.1f} tokens/s, routed {routed:.2f} req/s"
        lines.extend(_group_lines(cluster, f"decode-{j}", r, task, figures))
    routes = [(key, f) for key, f in sorted(result.kv_routing.items()) if f > 0]
    if routes:
        lines.append("KV routing:")
        for (i, j), f in routes:
            share = f / result.value if result.value else 0.0
            lines.append(f"    prefill-{i} -> decode-{j}  {f:.2f} requests/s ({100 * share:.1f}%)")
    if result.moves:
        lines.append(f"moves: {'; '.join(result.moves)}")
    return "\n".join(lines + _unused(cluster, (*result.prefill, *result.decode)))
