"""HexGen-2's scheduler: prefill/decode disaggregation over heterogeneous GPUs.

HexGen-2 (002_ac42bb48b964a3e9.txt) §3 decides four things: how GPUs form model-serving groups, whether a
group serves prefill or decoding, each group's parallel strategy, and how KV caches travel from prefill to
decode groups. The search has three phases:

1. **Graph partition** (§3.2). The GPUs form a graph with memory as node weight and bandwidth as edge
   weight. (i) Spectral partitioning (:func:`planner.search.partition.spectral_partition`) cuts it into ``K``
   groups, ``K`` = total memory over the memory one replica needs (its weights plus the KV cache of
   ``kv_batch`` requests), and Kernighan-Lin (:func:`planner.search.partition.kernighan_lin`) refines the cut while
   balancing memory. (ii) The groups are coarsened into super nodes and split in two maximising the
   bandwidth between the sides (:func:`planner.search.partition.max_cut_bipartition`): one side prefills, the other
   decodes (both orientations are scored). (iii) Projection back to GPUs.
2. **Max-flow** (§3.3, App. A). Per group, every parallel strategy (stages of ``t`` GPUs of one type inside
   one machine, ``t`` in ``{1, 2, 4, 8}``, all GPUs used) is scored with HexGen's cost model (Table 1):
   prefill groups take the *latency-optimal* one (layers loaded onto the fastest stages up to their
   memory), decode groups the *throughput-optimal* one (layers split in proportion to memory, capacity
   ``b_max / latency(b_max)``). A flow graph source -> prefill -> decode -> sink is built with node
   capacities (prefill: ``1 / latency``; decode: ``b_max / latency``, in requests per second), coordinator
   edges (bandwidth over the request's token bytes) and KV edges whose capacity is ``1 / KV-transfer time``
   over the layer-matched GPU pairs (Table 1's ``alpha + 2 b s_in H B / beta``, the stage orders of both
   groups chosen to minimise it). The max flow comes from the preflow-push algorithm (networkx); the flow
   on the KV edges is the KV routing.
3. **Iterative refinement** (§3.4). Edges whose flow reaches capacity are bottlenecks, the rest are
   underused; candidate moves take a GPU from a group into a bottleneck group, swap two GPUs between a
   bottleneck group and another group, or flip the type of a group; HexGen's merge and split of groups are
   added so that the search can cross groupings that single-GPU moves cannot reach without leaving a group
   unable to hold the model. The best improving move is applied and the two phases rerun, until no move
   (nor any pair of moves starting from the few best neighbours) improves the max flow.

:func:`exhaustive_hexgen2` enumerates every grouping (GPUs of one class are interchangeable) and type
assignment under the same phase-2 scoring, for checking the search on small clusters (App. E).

Phases 1 and 3 and the plan they return are here; phase 2, the scoring both searches share, is in
:mod:`planner.algorithms.hexgen2_flow`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster.spec import Cluster
from ..costs.hexgen_gpus import Gpu, HexGenParams, Task, gpu_link
from ..errors import PlannerError
from ..placement import PlacementError
from ..replicas import ReplicaPlan, build_stages, placement_of
from ..search.partition import coarsen, kernighan_lin, max_cut_bipartition, spectral_partition
from ..simulator.trace import request_lengths
from .hexgen2_flow import _SINK, _SOURCE, DECODE, PREFILL, Group, _Eval, _evaluate, _Scorer

__all__ = [
    "HexGen2Result",
    "exhaustive_hexgen2",
    "plan_hexgen2",
    "workload_task",
]


def workload_task(cluster: Cluster, workload: str | tuple[int, int] | None = None) -> Task:
    """The planning task: a HexGen-2 workload name (``HPLD``, ``HPHD``, ``LPHD``, ``LPLD``), explicit
    ``(s_in, s_out)``, or the spec's average lengths (:func:`planner.simulator.trace.request_lengths`)."""
    s_in, s_out = workload if isinstance(workload, tuple) else request_lengths(cluster.workload, workload)
    return Task(1.0, float(s_in), float(s_out))


# ---------------------------------------------------------------------------------------------------
# Phase 1: graph partition
# ---------------------------------------------------------------------------------------------------


def _gpu_graph(scorer: _Scorer) -> tuple[list[Gpu], np.ndarray, np.ndarray]:
    gpus = [g for c in scorer.classes for g in c.gpus]
    n = len(gpus)
    bw = np.zeros((n, n))
    for i, a in enumerate(gpus):
        for j, b in enumerate(gpus):
            if i != j:
                bw[i, j] = gpu_link(scorer.cluster, a, b, scorer.params).bandwidth_mbps
    mem = np.array([g.memory_bytes - g.reserve_bytes for g in gpus])
    return gpus, bw, mem


def _to_groups(scorer: _Scorer, gpus: Sequence[Gpu], labels: Sequence[int] | np.ndarray) -> list[Group]:
    cls_of = {g.id: c.index for c in scorer.classes for g in c.gpus}
    out: dict[int, list[int]] = {}
    for g, lab in zip(gpus, labels, strict=True):
        out.setdefault(int(lab), [0] * len(scorer.classes))[cls_of[g.id]] += 1
    return [tuple(v) for _, v in sorted(out.items())]


def _initial(
    scorer: _Scorer, kv_batch: int, seed: int
) -> tuple[list[Group], list[np.ndarray], dict[str, Any]]:
    """Steps (i)-(iii) of §3.2: groups and the two candidate role assignments."""
    gpus, bw, mem = _gpu_graph(scorer)
    task = scorer.task
    replica = scorer.weights_bytes + kv_batch * (task.s_in + task.s_out) * scorer.kv * scorer.L
    k = int(mem.sum() // replica)
    k = max(2, min(k, len(gpus)))
    labels = spectral_partition(bw, k, seed=seed)
    labels = kernighan_lin(bw, labels, mem, tolerance=0.1)
    groups = _to_groups(scorer, gpus, labels)
    info = {"k": k, "replica_bytes": replica}
    if len(groups) < 2:
        return groups, [], info
    # coarsen on the class-level groups and split maximising the bandwidth between the sides
    group_labels = np.zeros(len(gpus), dtype=int)
    lab_order = sorted(set(int(x) for x in labels))
    for i, lab in enumerate(labels):
        group_labels[i] = lab_order.index(int(lab))
    coarse, _ = coarsen(bw, group_labels)
    mask = max_cut_bipartition(coarse, seed=seed)
    return groups, [mask, ~mask], info


# ---------------------------------------------------------------------------------------------------
# Phase 3: max-flow guided refinement
# ---------------------------------------------------------------------------------------------------


def _moves(ev: _Eval, scorer: _Scorer) -> list[tuple[list[Group], list[str], str]]:
    """Candidate neighbours of an evaluated plan, guided by the max-flow outputs (§3.4): GPU moves and
    swaps into the groups on saturated edges, role flips, then HexGen's merges and splits."""
    names = [f"{r}-{i}" for i, r in enumerate(ev.roles)]
    groups, roles = list(ev.groups), list(ev.roles)
    receivers = sorted(_saturated(ev, names)) or list(range(len(groups)))
    out = _gpu_moves(groups, roles, names, receivers, scorer)
    for i in range(len(groups)):
        flipped = list(roles)
        flipped[i] = DECODE if roles[i] == PREFILL else PREFILL
        out.append((list(groups), flipped, f"flip {names[i]}"))
    out += _merges_and_splits(groups, roles, names)
    return out


def _saturated(ev: _Eval, names: list[str]) -> set[int]:
    """Groups whose own capacity, a KV edge they touch, or their coordinator edge the max flow saturates."""
    flow, cap = ev.flow, ev.capacity
    saturated = set()
    for i, n in enumerate(names):
        node_cap = cap.get((n, n), 0.0)
        if node_cap > 0 and flow.get(n, {}).get(n, 0.0) >= node_cap * (1 - 1e-6):
            saturated.add(i)
    for (u, v), c in cap.items():
        if u in (v, _SOURCE) or v == _SINK:
            continue
        if c > 0 and flow.get(u, {}).get(v, 0.0) >= c * (1 - 1e-6):
            saturated.add(names.index(u))
            saturated.add(names.index(v))
    for (u, v), c in cap.items():  # coordinator edges
        if (u == _SOURCE or v == _SINK) and c > 0:
            n = v if u == _SOURCE else u
            if flow.get(u, {}).get(v, 0.0) >= c * (1 - 1e-6):
                saturated.add(names.index(n))
    return saturated


def _gpu_moves(
    groups: list[Group], roles: list[str], names: list[str], receivers: list[int], scorer: _Scorer
) -> list[tuple[list[Group], list[str], str]]:
    """Move one GPU of a class from any other group into a receiver, or swap it for one GPU of another
    class of the receiver."""
    out = []
    for r in receivers:
        for d in range(len(groups)):
            if d == r:
                continue
            for k, n in enumerate(groups[d]):
                if n == 0:
                    continue
                # move one GPU of class k from d to r
                gd = tuple(x - (1 if i == k else 0) for i, x in enumerate(groups[d]))
                gr = tuple(x + (1 if i == k else 0) for i, x in enumerate(groups[r]))
                new = list(groups)
                new[d], new[r] = gd, gr
                if sum(gd) == 0:
                    new_groups = [g for i, g in enumerate(new) if i != d]
                    new_roles = [x for i, x in enumerate(roles) if i != d]
                else:
                    new_groups, new_roles = new, list(roles)
                out.append((new_groups, new_roles, f"move {scorer.classes[k].label} {names[d]}->{names[r]}"))
                # swap: one GPU of class k from d for one GPU of another class from r
                for k2, n2 in enumerate(groups[r]):
                    if n2 == 0 or k2 == k:
                        continue
                    gd2 = tuple(
                        x - (1 if i == k else 0) + (1 if i == k2 else 0) for i, x in enumerate(groups[d])
                    )
                    gr2 = tuple(
                        x + (1 if i == k else 0) - (1 if i == k2 else 0) for i, x in enumerate(groups[r])
                    )
                    new2 = list(groups)
                    new2[d], new2[r] = gd2, gr2
                    labels = f"{scorer.classes[k].label}<->{scorer.classes[k2].label}"
                    out.append((new2, list(roles), f"swap {labels} {names[d]}/{names[r]}"))
    return out


def _merges_and_splits(
    groups: list[Group], roles: list[str], names: list[str]
) -> list[tuple[list[Group], list[str], str]]:
    """HexGen's merge and split mutations, so that the search can cross groupings whose intermediate
    single-GPU moves would leave a group unable to hold the model."""
    out = []
    n_groups = len(groups)
    for a in range(n_groups):
        for b in range(a + 1, n_groups):
            merged = tuple(x + y for x, y in zip(groups[a], groups[b], strict=True))
            rest_g = [g for i, g in enumerate(groups) if i not in (a, b)]
            rest_r = [x for i, x in enumerate(roles) if i not in (a, b)]
            for role in (PREFILL, DECODE):
                out.append(([*rest_g, merged], [*rest_r, role], f"merge {names[a]}+{names[b]} as {role}"))
    for i in range(n_groups):
        g = groups[i]
        if sum(g) < 2:
            continue
        half = tuple(x // 2 for x in g)
        other = tuple(x - y for x, y in zip(g, half, strict=True))
        if not any(half):
            continue
        rest_g = [x for t, x in enumerate(groups) if t != i]
        rest_r = [x for t, x in enumerate(roles) if t != i]
        for r1, r2 in ((roles[i], roles[i]), (PREFILL, DECODE), (DECODE, PREFILL)):
            out.append(([*rest_g, half, other], [*rest_r, r1, r2], f"split {names[i]} as {r1}/{r2}"))
    return out


def _canon(groups: Sequence[Group], roles: Sequence[str]) -> tuple:
    return tuple(sorted(zip(roles, groups, strict=True)))


# ---------------------------------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HexGen2Result:
    """A HexGen-2 plan. ``value`` is the max flow in requests/s; ``throughput`` = ``value * s_out``."""

    cluster: str
    task: Task
    value: float
    prefill: tuple[ReplicaPlan, ...]
    decode: tuple[ReplicaPlan, ...]
    kv_routing: dict[tuple[int, int], float]
    source_flow: tuple[float, ...]
    solve_seconds: float
    iterations: int
    history: tuple[float, ...] = field(default_factory=tuple)
    moves: tuple[str, ...] = field(default_factory=tuple)
    initial_groups: int = 0

    @property
    def throughput(self) -> float:
        return self.value * self.task.s_out

    def signature(self) -> tuple:
        """Groups as (role, GPU types and counts, strategy) — what the plan is, independent of GPU names."""
        out = []
        for r in (*self.prefill, *self.decode):
            kinds: dict[tuple[str, str], int] = {}
            for g in r.gpus:
                kinds[(g.machine, g.gpu_type)] = kinds.get((g.machine, g.gpu_type), 0) + 1
            out.append((r.role, tuple(sorted(kinds.items())), tuple(r.strategy)))
        return tuple(sorted(out))

    def to_json(self) -> dict[str, Any]:
        groups = []
        for i, r in enumerate(self.prefill):
            groups.append({"id": f"prefill-{i}", **r.to_json(), "tp_pp": _tp_pp(r)})
        for j, r in enumerate(self.decode):
            groups.append({"id": f"decode-{j}", **r.to_json(), "tp_pp": _tp_pp(r)})
        s_out = self.task.s_out
        flows: dict[str, dict[str, float]] = {}
        for i, f in enumerate(self.source_flow):
            if f > 0:
                flows.setdefault("source", {})[f"prefill-{i}"] = f * s_out
        for (i, j), f in self.kv_routing.items():
            flows.setdefault(f"prefill-{i}", {})[f"decode-{j}"] = f * s_out
        for j in range(len(self.decode)):
            total = sum(f for (_, jj), f in self.kv_routing.items() if jj == j)
            if total > 0:
                flows.setdefault(f"decode-{j}", {})["sink"] = total * s_out
        upper = sum(r.capacity for r in self.decode)  # decode capacities are already tokens/s
        return {
            "algorithm": "hexgen2",
            "cluster": self.cluster,
            "placement": placement_of((*self.prefill, *self.decode)),
            "throughput": self.throughput,
            "upper_bound": upper,
            "solve_seconds": self.solve_seconds,
            "flows": flows,
            "groups": groups,
            "kv_routing": [
                {
                    "prefill": f"prefill-{i}",
                    "decode": f"decode-{j}",
                    "requests_per_s": f,
                    "weight": f / self.value if self.value else 0.0,
                }
                for (i, j), f in sorted(self.kv_routing.items())
                if f > 0
            ],
            "requests_per_s": self.value,
            "task": {"s_in": self.task.s_in, "s_out": self.task.s_out},
            "iterations": self.iterations,
            "moves": list(self.moves),
        }


def _tp_pp(r: ReplicaPlan) -> dict[str, int]:
    return {"tp": max(r.strategy), "pp": len(r.stages)}


def _materialise(
    scorer: _Scorer, ev: _Eval
) -> tuple[list[ReplicaPlan], list[ReplicaPlan], dict[tuple[int, int], float], list[float]]:
    pools = [list(c.gpus) for c in scorer.classes]
    node_gpus = {n.id: n.gpus for n in scorer.cluster.nodes}
    names = [f"{r}-{i}" for i, r in enumerate(ev.roles)]
    prefill: list[ReplicaPlan] = []
    decode: list[ReplicaPlan] = []
    index: dict[int, int] = {}
    for i, (role, strat, order) in enumerate(zip(ev.roles, ev.strategies, ev.orders, strict=True)):
        stages = build_stages(pools, order, node_gpus)
        cap = strat.capacity * (scorer.task.s_out if role == DECODE else 1.0)
        plan = ReplicaPlan(stages, role, cap)
        if role == PREFILL:
            index[i] = len(prefill)
            prefill.append(plan)
        else:
            index[i] = len(decode)
            decode.append(plan)
    kv: dict[tuple[int, int], float] = {}
    source = [0.0] * len(prefill)
    for i, role in enumerate(ev.roles):
        if role != PREFILL:
            continue
        source[index[i]] = ev.flow.get(_SOURCE, {}).get(names[i], 0.0)
        for j, r2 in enumerate(ev.roles):
            if r2 == DECODE:
                f = ev.flow.get(names[i], {}).get(names[j], 0.0)
                if f > 0:
                    kv[(index[i], index[j])] = f
    return prefill, decode, kv, source


def _result(scorer: _Scorer, best: _Eval, t0: float, iterations: int, **search: Any) -> HexGen2Result:
    """The plan of ``best`` with its concrete groups (:func:`_materialise`), timed from ``t0``; ``search``
    holds what the search reports besides (history, moves, initial groups)."""
    prefill, decode, kv, source = _materialise(scorer, best)
    return HexGen2Result(
        cluster=scorer.cluster.name,
        task=scorer.task,
        value=best.value,
        prefill=tuple(prefill),
        decode=tuple(decode),
        kv_routing=kv,
        source_flow=tuple(source),
        solve_seconds=time.monotonic() - t0,
        iterations=iterations,
        **search,
    )


def _initial_plan(scorer: _Scorer, groups: list[Group], masks: list) -> _Eval:
    """The best of the initial groups under each bipartition of roles; when those groups cannot all hold
    the model, the smallest are merged until they can (one prefill and one decode group at least)."""
    best: _Eval | None = None
    for mask in masks:
        roles = [PREFILL if m else DECODE for m in mask]
        ev = _evaluate(scorer, groups, roles)
        if ev is not None and (best is None or ev.value > best.value):
            best = ev
    if best is None and len(groups) == 2 and not all(scorer.can_hold(g) for g in groups):
        # two groups of which one cannot hold the model (the cut balances memory only within its tolerance):
        # split the GPUs again by memory alone, largest first into the group with less (LPT), and score it
        pair = [[0] * len(scorer.classes), [0] * len(scorer.classes)]
        held = [0.0, 0.0]
        gpus = sorted(((c.memory_bytes - c.gpus[0].reserve_bytes, c.index) for c in scorer.classes
                       for _ in c.gpus), reverse=True)
        for memory, k in gpus:
            side = held.index(min(held))
            pair[side][k] += 1
            held[side] += memory
        split = [tuple(pair[0]), tuple(pair[1])]
        if all(scorer.can_hold(g) for g in split):
            for roles in ([PREFILL, DECODE], [DECODE, PREFILL]):
                ev = _evaluate(scorer, split, roles)
                if ev is not None and (best is None or ev.value > best.value):
                    best = ev
    if best is None:
        merged = sorted(groups, key=scorer.usable)
        while len(merged) > 2 and not all(scorer.can_hold(g) for g in merged):
            a, b = merged[0], merged[1]
            merged = sorted([tuple(x + y for x, y in zip(a, b, strict=True)), *merged[2:]], key=scorer.usable)
        for roles in (
            [PREFILL, DECODE] + [DECODE] * (len(merged) - 2),
            [DECODE, PREFILL] + [PREFILL] * (len(merged) - 2),
        ):
            ev = _evaluate(scorer, merged, roles)
            if ev is not None and (best is None or ev.value > best.value):
                best = ev
    if best is None:
        cluster = scorer.cluster
        raise PlacementError(
            f"cluster {cluster.name!r} cannot form one prefill and one decode group that each hold "
            f"{cluster.model.name}"
        )
    return best


class _Refinement:
    """Phase 3 (§3.4): hill climbing over :func:`_moves` from a plan, each neighbour scored once, with a
    ``lookahead`` of one more move from the best neighbours when no single move improves."""

    def __init__(self, scorer: _Scorer, best: _Eval, lookahead: int, deadline: float) -> None:
        self.scorer = scorer
        self.best = best
        self.lookahead = lookahead
        self.deadline = deadline
        self.history = [best.value]
        self.moves: list[str] = []
        self.seen = {_canon(best.groups, best.roles)}
        self.scored: dict[tuple, _Eval | None] = {}
        self.iterations = 0

    def score(self, g: list[Group], r: list[str]) -> _Eval | None:
        key = _canon(g, r)
        if key not in self.scored:
            self.scored[key] = _evaluate(self.scorer, g, r)
        return self.scored[key]

    def run(self, max_iterations: int) -> None:
        while self.iterations < max_iterations and time.monotonic() < self.deadline:
            self.iterations += 1
            improved = self.step()
            if improved is None:
                break
            self.best = improved[0]
            self.seen.add(_canon(self.best.groups, self.best.roles))
            self.moves.append(improved[1])
            self.history.append(self.best.value)

    def better(self, ev: _Eval, improved: tuple[_Eval, str] | None) -> bool:
        return ev.value > (improved[0].value if improved else self.best.value) * (1 + 1e-9)

    def step(self) -> tuple[_Eval, str] | None:
        """The best improving neighbour (one move, else two) and its label, or None."""
        improved = None
        first_steps = []
        for g, r, label in _moves(self.best, self.scorer):
            key = _canon(g, r)
            if key in self.seen:
                continue
            self.seen.add(key)
            ev = self.score(g, r)
            if ev is None:
                continue
            first_steps.append((ev.value, label, ev))
            if self.better(ev, improved):
                improved = (ev, label)
        if improved is None and self.lookahead > 0:
            # no single move helps: look one move further from the most promising neighbours
            first_steps.sort(key=lambda x: -x[0])
            for _, label, ev in first_steps[: self.lookahead]:
                for g, r, label2 in _moves(ev, self.scorer):
                    ev2 = self.score(g, r)
                    if ev2 is not None and self.better(ev2, improved):
                        improved = (ev2, f"{label}; {label2}")
                if time.monotonic() > self.deadline:
                    break
        return improved


def plan_hexgen2(
    cluster: Cluster,
    *,
    workload: str | tuple[int, int] | None = None,
    kv_batch: int = 32,
    max_iterations: int = 50,
    lookahead: int = 8,
    time_limit: float = 120.0,
    seed: int = 0,
    params: HexGenParams | None = None,
) -> HexGen2Result:
    """Run HexGen-2's scheduler (module docstring). ``workload``: a HexGen-2 workload name, ``(s_in, s_out)``
    or ``None`` for the spec's averages; ``kv_batch`` requests' KV cache are counted in a replica's memory
    when choosing the number of groups. When no single move improves, the ``lookahead`` best neighbours are
    expanded one move further before the search stops."""
    t0 = time.monotonic()
    params = params or HexGenParams()
    if kv_batch < 0 or max_iterations < 0:
        raise PlannerError("kv_batch and max_iterations must be >= 0", code="bad_option")
    task = workload_task(cluster, workload)
    scorer = _Scorer(cluster, task, params)
    groups, masks, info = _initial(scorer, kv_batch, seed)
    refinement = _Refinement(scorer, _initial_plan(scorer, groups, masks), lookahead, t0 + time_limit)
    refinement.run(max_iterations)
    return _result(
        scorer,
        refinement.best,
        t0,
        refinement.iterations,
        history=tuple(refinement.history),
        moves=tuple(refinement.moves),
        initial_groups=info["k"],
    )


def _vector_partitions(vec: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
    """All multisets of non-zero vectors summing to ``vec`` (parts in non-increasing order)."""
    parts = [p for p in itertools.product(*(range(n + 1) for n in vec)) if any(p)]
    parts.sort(reverse=True)
    out: list[list[tuple[int, ...]]] = []

    def rec(rest: tuple[int, ...], start: int, acc: list[tuple[int, ...]]) -> None:
        if not any(rest):
            out.append(list(acc))
            return
        for i in range(start, len(parts)):
            p = parts[i]
            if all(a <= b for a, b in zip(p, rest, strict=True)):
                acc.append(p)
                rec(tuple(b - a for a, b in zip(p, rest, strict=True)), i, acc)
                acc.pop()

    rec(vec, 0, [])
    return out


def exhaustive_hexgen2(
    cluster: Cluster,
    *,
    workload: str | tuple[int, int] | None = None,
    params: HexGenParams | None = None,
    max_groupings: int = 200_000,
) -> HexGen2Result:
    """Every grouping of the GPUs (GPUs of one class interchangeable) into groups that each hold the model,
    every prefill/decode labelling, scored by phase 2; the best one. For small clusters only."""
    t0 = time.monotonic()
    params = params or HexGenParams()
    task = workload_task(cluster, workload)
    scorer = _Scorer(cluster, task, params)
    total = tuple(c.count for c in scorer.classes)
    best: _Eval | None = None
    count = 0
    for grouping in _vector_partitions(total):
        if not all(scorer.can_hold(g) for g in grouping):
            continue
        if len(grouping) < 2:
            continue
        seen_labels = set()
        for bits in itertools.product((PREFILL, DECODE), repeat=len(grouping)):
            key = _canon(grouping, bits)
            if key in seen_labels:
                continue
            seen_labels.add(key)
            count += 1
            if count > max_groupings:
                raise PlannerError(
                    f"more than {max_groupings} groupings; the cluster is too large for exhaustive search",
                    code="bad_option",
                )
            ev = _evaluate(scorer, grouping, bits)
            if ev is not None and (best is None or ev.value > best.value * (1 + 1e-12)):
                best = ev
    if best is None:
        raise PlacementError(
            f"no grouping of cluster {cluster.name!r} has a prefill and a decode group that hold the model"
        )
    return _result(scorer, best, t0, count)
