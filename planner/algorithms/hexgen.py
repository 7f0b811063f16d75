"""HexGen's scheduler: asymmetric tensor/pipeline-parallel replicas over heterogeneous GPUs.

HexGen (000_7037da9499fcd439.txt), §4. The assignment partitions the GPUs into independent pipeline groups;
each group serves one model replica as a pipeline whose stages are tensor-parallel GPU sets holding
different numbers of layers (§3, "asymmetric"). The search has two levels:

- **Algorithm 1** (§4.2): for one group and a layer partition ``{l_1..l_S}``, a dynamic program over
  (stage ``j``, GPU-type count vector ``tau``) picks for every stage ``j`` a set ``tau_k e_k`` of GPUs of
  one type, minimising Eq. 2 (compute, Eq. 4, plus tensor-parallel, Eq. 5, plus pipeline, Eq. 6,
  communication) under the memory limit of Eq. 7:
  ``DP[j; tau] = min_{tau_k e_k} DP[j-1; tau - tau_k e_k] + C_comp(tau_k e_k) + C_comm(tau_k e_k)`` (Eq. 3).
  Here a GPU type is kept per machine, so a tensor-parallel group never leaves a machine (the §4.2
  heuristic), TP degrees come from ``{1, 2, 4, 8}``, and the state also remembers the class of the last
  stage so that Eq. 6 is charged on the real link between consecutive stages.
- **Layer re-split** (§4.3, "Determine the pipeline partitions"): start from the even partition
  ``l_j = L / S``, run the DP, then set ``l_j`` proportional to the memory of the GPUs serving stage ``j``
  and run it again, until the partition stops changing. When the even partition does not fit anywhere,
  the first DP is run with memory overflow penalised instead of forbidden, only to pick the stage GPU sets
  the re-split starts from. Every stage count ``S`` up to ``max_stages`` is tried.
- **Genetic algorithm** (§4.3) over groupings: the initial population comes from K-means on the latency
  and bandwidth matrices with the number of groups chosen by the Elbow method, plus a grouping that packs
  as many replicas as memory allows (§5.2 and App. F: the schedule "aims to maximize device memory
  utilization by incorporating as many model replicas as possible"); mutations are *merge*, *split*
  (``tau^1_k = floor(tau_k / 2)``, ``tau^2_k = ceil(tau_k / 2)``) and *swap* (move one GPU of a sampled type);
  offspring with a group whose memory cannot hold one copy of the weights are dropped before any DP;
  groups never span regions (a hard constraint, App. F: the schedule "avoids cross-region
  communication"). Fitness is the SLO attainment the serving simulator (:mod:`planner.simulator.engine`)
  measures for the plan under a Poisson trace, ties broken by the plan's cost-model capacity (headroom)
  and then by mean latency (§4.3: "To estimate the expected SLO, we adopt the inference task simulator").
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster.spec import Cluster, SpecError
from ..costs.hexgen_gpus import (
    HexGenParams,
    StageCost,
    Task,
    cluster_gpus,
    gpu_classes,
    gpu_link,
    link_between,
    pipeline_capacity,
)
from ..costs.roofline import CostModel
from ..errors import PlannerError
from ..placement import PlacementError
from ..replicas import ReplicaPlan, build_stages, placement_of
from ..search.partition import elbow, kmeans
from ..simulator.engine import simulate
from ..simulator.metrics import SimConfig, SimResult
from ..simulator.serving import serving_from_replicas
from ..simulator.trace import Request, poisson_trace

__all__ = [
    "GroupLayout",
    "HexGenResult",
    "best_layout",
    "max_replicas",
    "memory_problems",
    "pipeline_dp",
    "plan_hexgen",
]

Group = tuple[int, ...]  # GPUs per class
Grouping = tuple[Group, ...]


@dataclass(frozen=True)
class GroupLayout:
    """Algorithm 1's answer for one group: stages ``(class index, TP degree, layers)`` in pipeline order
    and the Eq. 2 cost (seconds for the planning task)."""

    stages: tuple[tuple[int, int, int], ...]
    cost: float


# ---------------------------------------------------------------------------------------------------
# Algorithm 1 and the layer re-split
# ---------------------------------------------------------------------------------------------------


class _Planner:
    """Costs and caches shared by the DP, the GA and materialisation for one cluster and task."""

    def __init__(
        self, cluster: Cluster, task: Task, params: HexGenParams, max_stages: int, beam: int
    ) -> None:
        self.cluster = cluster
        self.task = task
        self.params = params
        self.classes = gpu_classes(cluster, params)
        self.sc = StageCost(cluster, task, params)
        self.max_stages = max_stages
        self.beam = beam
        self.num_layers = cluster.model.num_blocks
        n = len(self.classes)
        self.hop = [[0.0] * n for _ in range(n)]
        for a in self.classes:
            for b in self.classes:
                link = a.tp_link if a.index == b.index else link_between(cluster, a.gpus, b.gpus, params)
                self.hop[a.index][b.index] = self.sc.pipeline_hop(link)
        self._stage_cache: dict[tuple[int, int, int], float] = {}
        self._layout_cache: dict[Group, GroupLayout | None] = {}
        self.weights_bytes = self.num_layers * cluster.model.block_bytes

    def stage_cost(self, k: int, t: int, layers: int) -> float:
        key = (k, t, layers)
        v = self._stage_cache.get(key)
        if v is None:
            v = self.sc.stage(self.classes[k], t, layers)
            self._stage_cache[key] = v
        return v

    def relaxed_stage_cost(self, k: int, t: int, layers: int) -> float:
        """Stage cost with Eq. 7 overflow penalised (used only to seed the layer re-split)."""
        cls = self.classes[k]
        cap = self.sc.max_layers(cls, t)
        base = self.sc.compute(cls, t, layers) + self.sc.tensor_parallel(cls, t, layers)
        return base + (1e6 * (layers - cap) if layers > cap else 0.0)

    def usable_memory(self, group: Group) -> float:
        return sum(
            n * (c.memory_bytes - c.gpus[0].reserve_bytes) for n, c in zip(group, self.classes, strict=True)
        )

    def can_hold_model(self, group: Group) -> bool:
        """HexGen §4.3's early check: the group's memory must at least hold one copy of the weights."""
        return self.usable_memory(group) >= self.weights_bytes

    def tp_options(self, k: int) -> list[int]:
        return [t for t in self.params.tp_degrees if t <= self.classes[k].count]

    def layout(self, group: Group) -> GroupLayout | None:
        cached = self._layout_cache.get(group, ())
        if cached != ():
            return cached  # type: ignore[return-value]
        result = best_layout(self, group)
        self._layout_cache[group] = result
        return result


def pipeline_dp(
    planner: _Planner, group: Group, layers: Sequence[int], *, relaxed: bool = False
) -> GroupLayout | None:
    """HexGen Algorithm 1 / Eq. 3 for a fixed layer partition ``layers`` (one entry per stage).

    State: GPUs used per class so far and the class of the previous stage; a stage is ``t`` GPUs of one
    class (``t`` in the TP candidate set); the stages use every GPU of the group (they partition it,
    HexGen §4.1). Returns the cheapest assignment, or ``None`` when no assignment satisfies Eq. 7
    (``relaxed``: overflow is penalised instead, to seed the re-split)."""
    present = [k for k, n in enumerate(group) if n > 0]
    stage_fn = planner.relaxed_stage_cost if relaxed else planner.stage_cost
    start: tuple[int, ...] = tuple(0 for _ in group)
    total_gpus = sum(group)
    max_tp = max(planner.params.tp_degrees)
    S = len(layers)
    # level j: state (used, last) -> (cost, parent state, (k, t))
    levels: list[dict[tuple[tuple[int, ...], int], tuple[float, Any, tuple[int, int]]]] = []
    frontier: dict[tuple[tuple[int, ...], int], tuple[float, Any, tuple[int, int]]] = {
        (start, -1): (0.0, None, (-1, 0))
    }
    for j, l_j in enumerate(layers):
        nxt: dict[tuple[tuple[int, ...], int], tuple[float, Any, tuple[int, int]]] = {}
        stages_left = S - j - 1
        for (used, last), (cost, _parent, _choice) in frontier.items():
            used_total = sum(used)
            for k in present:
                remaining = group[k] - used[k]
                if remaining <= 0:
                    continue
                for t in planner.tp_options(k):
                    if t > remaining:
                        break
                    # every GPU of the group serves a stage (the stages partition the group, HexGen §4.1):
                    # the GPUs left must be coverable by the stages left
                    left = total_gpus - used_total - t
                    if left < stages_left or left > stages_left * max_tp:
                        continue
                    c = stage_fn(k, t, l_j)
                    if not math.isfinite(c):
                        continue
                    total = cost + c + (planner.hop[last][k] if j > 0 else 0.0)
                    new_used = (*used[:k], used[k] + t, *used[k + 1 :])
                    key = (new_used, k)
                    old = nxt.get(key)
                    if old is None or total < old[0]:
                        nxt[key] = (total, (used, last), (k, t))
        if not nxt:
            return None
        if len(nxt) > planner.beam:
            nxt = dict(sorted(nxt.items(), key=lambda kv: kv[1][0])[: planner.beam])
        levels.append(nxt)
        frontier = nxt
    frontier = {key: v for key, v in frontier.items() if key[0] == tuple(group)}
    if not frontier:
        return None
    best_key = min(frontier, key=lambda s: frontier[s][0])
    best_cost = frontier[best_key][0]
    # back-track
    stages = []
    key = best_key
    for j in range(len(layers) - 1, -1, -1):
        cost, parent, (k, t) = levels[j][key]
        stages.append((k, t, layers[j]))
        key = parent
    stages.reverse()
    return GroupLayout(stages=tuple(stages), cost=best_cost)


def _even(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _proportional(total: int, weights: Sequence[float], caps: Sequence[int]) -> list[int] | None:
    """Integers summing to ``total``, proportional to ``weights`` (largest remainder), each in ``[1, cap]``."""
    if sum(caps) < total or any(c < 1 for c in caps) or len(weights) > total:
        return None
    w = np.asarray(weights, dtype=float)
    raw = total * w / w.sum()
    out = [max(1, min(math.floor(x), cap)) for x, cap in zip(raw, caps, strict=True)]
    # fix the sum: add where the remainder is largest and room is left, remove where it is smallest
    while sum(out) < total:
        room = [i for i in range(len(out)) if out[i] < caps[i]]
        i = max(room, key=lambda i: raw[i] - out[i])
        out[i] += 1
    while sum(out) > total:
        spare = [i for i in range(len(out)) if out[i] > 1]
        i = min(spare, key=lambda i: raw[i] - out[i])
        out[i] -= 1
    return out


def best_layout(planner: _Planner, group: Group, *, em_rounds: int = 4) -> GroupLayout | None:
    """Best pipeline for ``group`` over stage counts ``S`` with HexGen's layer re-split (see module docstring)."""
    if not planner.can_hold_model(group):
        return None
    total_gpus = sum(group)
    L = planner.num_layers
    best: GroupLayout | None = None
    max_tp = max(planner.params.tp_degrees)
    for S in range(max(1, math.ceil(total_gpus / max_tp)), min(planner.max_stages, total_gpus, L) + 1):
        layers = _even(L, S)
        seen: set[tuple[int, ...]] = set()
        layout = pipeline_dp(planner, group, layers)
        if layout is None:
            layout = pipeline_dp(planner, group, layers, relaxed=True)
            if layout is None:
                continue
            relaxed_only = True
        else:
            relaxed_only = False
        for _ in range(em_rounds):
            if not relaxed_only and (best is None or layout.cost < best.cost):
                best = layout
            seen.add(tuple(layers))
            mem = [
                t * (planner.classes[k].memory_bytes - planner.classes[k].gpus[0].reserve_bytes)
                for k, t, _ in layout.stages
            ]
            caps = [planner.sc.max_layers(planner.classes[k], t) for k, t, _ in layout.stages]
            new_layers = _proportional(L, mem, caps)
            if new_layers is None or tuple(new_layers) in seen:
                break
            layers = new_layers
            nxt = pipeline_dp(planner, group, layers)
            if nxt is None:
                break
            layout, relaxed_only = nxt, False
        if not relaxed_only and (best is None or layout.cost < best.cost):
            best = layout
    return best


# ---------------------------------------------------------------------------------------------------
# Memory bound and checks
# ---------------------------------------------------------------------------------------------------


def memory_problems(
    cluster: Cluster,
    stages: Sequence[tuple[Sequence[str], int]],
    *,
    task: Task | None = None,
    params: HexGenParams | None = None,
) -> list[str]:
    """Eq. 7 violations of an explicit pipeline: ``stages`` lists ``(GPU ids, layers)`` (a stage with several
    GPUs runs them tensor-parallel, even across GPU types). Empty when every GPU fits."""
    params = params or HexGenParams()
    task = task or _default_task(cluster)
    gpus = {g.id: g for g in cluster_gpus(cluster, params)}
    sc = StageCost(cluster, task, params)
    problems = []
    if sum(layers for _, layers in stages) != cluster.model.num_blocks:
        problems.append(
            f"the stages hold {sum(layers for _, layers in stages)} layers, the model has {cluster.model.num_blocks}"
        )
    for j, (ids, layers) in enumerate(stages):
        if not ids:
            raise PlannerError(f"stage {j} has no GPUs", code="bad_plan")
        for gid in ids:
            if gid not in gpus:
                raise SpecError(
                    f"stage {j}: unknown GPU {gid!r} (GPU ids: node id, or node#index for multi-GPU nodes)"
                )
        need = sc.memory_per_gpu(len(ids), layers)
        for gid in ids:
            g = gpus[gid]
            have = g.memory_bytes - g.reserve_bytes
            if need > have:
                problems.append(
                    f"stage {j}: GPU {gid} needs {need / 2**30:.2f} GiB for {layers} layers at TP {len(ids)} "
                    f"but has {have / 2**30:.2f} GiB (out of memory)"
                )
    return problems


def _region_type_caps(planner: _Planner) -> dict[str, dict[tuple, tuple[int, int]]]:
    """Per region: GPU hardware -> (count, layers one GPU holds at TP 1)."""
    out: dict[str, dict[tuple, tuple[int, int]]] = {}
    for c in planner.classes:
        key = (c.gpu_type, c.memory_bytes, c.gpus[0].reserve_bytes)
        cap = planner.sc.max_layers(c, 1)
        region = out.setdefault(c.region, {})
        n, _ = region.get(key, (0, cap))
        region[key] = (n + c.count, cap)
    return out


def _covers(counts: Sequence[int], caps: Sequence[int], need: int) -> list[tuple[int, ...]]:
    """Minimal count vectors (each entry <= counts) whose summed capacity reaches ``need``."""
    ranges = [
        range(0, min(n, math.ceil(need / cap) if cap > 0 else 0) + 1)
        for n, cap in zip(counts, caps, strict=True)
    ]
    out = []
    for vec in itertools.product(*ranges):
        total = sum(v * c for v, c in zip(vec, caps, strict=True))
        if total < need:
            continue
        if all(v == 0 or total - caps[i] < need for i, v in enumerate(vec)):
            out.append(vec)
    return out


def _max_cover(counts: tuple[int, ...], caps: Sequence[int], need: int) -> tuple[int, list[tuple[int, ...]]]:
    covers = _covers(counts, caps, need)
    memo: dict[tuple[int, ...], tuple[int, list[tuple[int, ...]]]] = {}

    def solve(rest: tuple[int, ...]) -> tuple[int, list[tuple[int, ...]]]:
        if rest in memo:
            return memo[rest]
        best: tuple[int, list[tuple[int, ...]]] = (0, [])
        for cov in covers:
            if all(c <= r for c, r in zip(cov, rest, strict=True)):
                n, groups = solve(tuple(r - c for r, c in zip(rest, cov, strict=True)))
                if n + 1 > best[0]:
                    best = (n + 1, [cov, *groups])
        memo[rest] = best
        return best

    return solve(counts)


def max_replicas(cluster: Cluster, *, task: Task | None = None, params: HexGenParams | None = None) -> int:
    """How many replicas memory allows when no group crosses a region: per region, the largest number of
    disjoint GPU sets that each hold all layers (every GPU counted with the layers Eq. 7 lets it hold at
    TP 1), found exactly by a dynamic program over GPU-type counts."""
    planner = _Planner(cluster, task or _default_task(cluster), params or HexGenParams(), 8, 2000)
    total = 0
    for types in _region_type_caps(planner).values():
        keys = sorted(types)
        n, _ = _max_cover(tuple(types[k][0] for k in keys), [types[k][1] for k in keys], planner.num_layers)
        total += n
    return total


def _packing_grouping(planner: _Planner) -> Grouping | None:
    """A grouping with as many memory-feasible replicas as :func:`max_replicas` finds, GPUs taken from the
    machine with the most GPUs of the needed type left (so tensor parallelism can stay inside it)."""
    groups: list[list[int]] = []
    left = [c.count for c in planner.classes]
    for region, types in _region_type_caps(planner).items():
        keys = sorted(types)
        _, covers = _max_cover(
            tuple(types[k][0] for k in keys), [types[k][1] for k in keys], planner.num_layers
        )
        for cov in covers:
            group = [0] * len(planner.classes)
            for key, need in zip(keys, cov, strict=True):
                for _ in range(need):
                    cands = [
                        c.index
                        for c in planner.classes
                        if c.region == region
                        and (c.gpu_type, c.memory_bytes, c.gpus[0].reserve_bytes) == key
                        and left[c.index] > 0
                    ]
                    k = max(cands, key=lambda i: (group[i], left[i]))
                    group[k] += 1
                    left[k] -= 1
            groups.append(group)
    if not groups:
        return None
    # leftover GPUs join the group of their machine/region with the least memory
    for k, n in enumerate(left):
        if n == 0:
            continue
        same_region = [
            g
            for g in groups
            if any(g[i] and planner.classes[i].region == planner.classes[k].region for i in range(len(g)))
        ]
        if not same_region:
            continue
        target = min(same_region, key=lambda g: planner.usable_memory(tuple(g)))
        target[k] += n
    return _canonical(tuple(g) for g in groups)


# ---------------------------------------------------------------------------------------------------
# Genetic algorithm
# ---------------------------------------------------------------------------------------------------


def _canonical(groups: Iterable[Group]) -> Grouping:
    return tuple(sorted(g for g in groups if sum(g) > 0))


def _regions(planner: _Planner, group: Group) -> set[str]:
    return {planner.classes[k].region for k, n in enumerate(group) if n}


def _kmeans_grouping(planner: _Planner, seed: int) -> Grouping:
    """HexGen §4.3's initialisation: K-means over each GPU's rows of the latency (A) and bandwidth (B)
    matrices, the number of groups from the Elbow method; groups are then split by region."""
    gpus = [g for c in planner.classes for g in c.gpus]
    cls_of = {g.id: c.index for c in planner.classes for g in c.gpus}
    n = len(gpus)
    lat = np.zeros((n, n))
    bw = np.zeros((n, n))
    for i, a in enumerate(gpus):
        for j, b in enumerate(gpus):
            if i == j:
                continue
            link = gpu_link(planner.cluster, a, b, planner.params)
            lat[i, j] = link.latency_ms
            bw[i, j] = link.bandwidth_mbps
    feats = np.hstack([lat / max(lat.max(), 1e-12), bw / max(bw.max(), 1e-12)])
    bound = max(1, min(n, max_replicas_fast(planner)))
    k = elbow(feats, bound, seed=seed) if n > 1 else 1
    labels, _ = kmeans(feats, k, seed=seed)
    groups: dict[tuple[int, str], list[int]] = {}
    for g, lab in zip(gpus, labels, strict=True):
        vec = groups.setdefault((int(lab), g.region), [0] * len(planner.classes))
        vec[cls_of[g.id]] += 1
    return _canonical(tuple(v) for v in groups.values())


def max_replicas_fast(planner: _Planner) -> int:
    total = 0
    for types in _region_type_caps(planner).values():
        keys = sorted(types)
        total += _max_cover(
            tuple(types[k][0] for k in keys), [types[k][1] for k in keys], planner.num_layers
        )[0]
    return total


def _merge(ind: Grouping, rng: random.Random, planner: _Planner) -> Grouping | None:
    if len(ind) < 2:
        return None
    i, j = rng.sample(range(len(ind)), 2)
    if _regions(planner, ind[i]) != _regions(planner, ind[j]):
        return None
    merged = tuple(a + b for a, b in zip(ind[i], ind[j], strict=True))
    return _canonical([g for t, g in enumerate(ind) if t not in (i, j)] + [merged])


def _split(ind: Grouping, rng: random.Random, planner: _Planner) -> Grouping | None:
    cands = [i for i, g in enumerate(ind) if sum(g) > 1]
    if not cands:
        return None
    i = rng.choice(cands)
    g = ind[i]
    a = tuple(x // 2 for x in g)
    b = tuple(x - x // 2 for x in g)
    if sum(a) == 0:  # every class had one GPU: hand the first non-empty class to the other side
        k = next(k for k, x in enumerate(g) if x)
        a = tuple(1 if t == k else 0 for t in range(len(g)))
        b = tuple(x - y for x, y in zip(g, a, strict=True))
    return _canonical([x for t, x in enumerate(ind) if t != i] + [a, b])


def _swap(ind: Grouping, rng: random.Random, planner: _Planner) -> Grouping | None:
    if len(ind) < 2:
        return None
    i, j = rng.sample(range(len(ind)), 2)
    donors = [
        k for k, n in enumerate(ind[j]) if n > 0 and planner.classes[k].region in _regions(planner, ind[i])
    ]
    if not donors:
        return None
    k = rng.choice(donors)
    gi = tuple(n + (1 if t == k else 0) for t, n in enumerate(ind[i]))
    gj = tuple(n - (1 if t == k else 0) for t, n in enumerate(ind[j]))
    return _canonical([g for t, g in enumerate(ind) if t not in (i, j)] + [gi, gj])


_MUTATIONS = {"merge": _merge, "split": _split, "swap": _swap}


def _materialise(planner: _Planner, grouping: Grouping) -> list[ReplicaPlan]:
    """Concrete GPUs for every group's layout; groups that cannot hold the model serve nothing."""
    pools = [list(c.gpus) for c in planner.classes]
    node_gpus = {n.id: n.gpus for n in planner.cluster.nodes}
    replicas = []
    for group in grouping:
        layout = planner.layout(group)
        if layout is None:
            continue
        stages = build_stages(pools, layout.stages, node_gpus)
        capacity = pipeline_capacity(
            planner.sc,
            [(planner.classes[k], t, layers) for k, t, layers in layout.stages],
            [
                link_between(planner.cluster, a.gpus, b.gpus, planner.params)
                for a, b in itertools.pairwise(stages)
            ],
        )
        replicas.append(ReplicaPlan(stages, "replica", capacity))
    return replicas


@dataclass(frozen=True)
class HexGenResult:
    """A HexGen plan: its replicas, the simulated score that was its fitness, and how it was found."""

    cluster: str
    replicas: tuple[ReplicaPlan, ...]
    fitness: SimResult
    rate: float
    slo_scale: float
    task: Task
    solve_seconds: float
    evaluations: int
    generations: int
    upper_bound: float
    history: tuple[float, ...] = field(default_factory=tuple)

    @property
    def throughput(self) -> float:
        """Cost-model capacity of the plan: the sum of its replicas' output tokens/s."""
        return sum(r.capacity for r in self.replicas)

    def to_json(self) -> dict[str, Any]:
        flows: dict[str, dict[str, float]] = {}
        for r in self.replicas:
            ids = ["source"] + [s.id for s in r.stages] + ["sink"]
            for u, v in itertools.pairwise(ids):
                flows.setdefault(u, {})[v] = flows.get(u, {}).get(v, 0.0) + r.capacity
        return {
            "algorithm": "hexgen",
            "cluster": self.cluster,
            "placement": placement_of(self.replicas),
            "throughput": self.throughput,
            "upper_bound": self.upper_bound,
            "solve_seconds": self.solve_seconds,
            "flows": flows,
            "groups": [r.to_json() for r in self.replicas],
            "replicas": len(self.replicas),
            "fitness": {"rate": self.rate, **self.fitness.to_json()},
            "task": {"batch": self.task.batch, "s_in": self.task.s_in, "s_out": self.task.s_out},
            "evaluations": self.evaluations,
            "generations": self.generations,
        }


def _default_task(cluster: Cluster) -> Task:
    w = cluster.workload
    return Task(1.0, float(max(1, round(w.avg_input_tokens))), float(max(1, round(w.avg_output_tokens))))


class _Evolution:
    """HexGen §4.3's genetic search over groupings: fitness by simulation (cached per grouping), the
    feasibility filter, and the population's generations."""

    def __init__(self, cluster: Cluster, planner: _Planner, params: HexGenParams, rng: random.Random) -> None:
        self.cluster = cluster
        self.planner = planner
        self.params = params
        self.rng = rng
        self.trace: Sequence[Request] = []
        self.config = SimConfig()
        self.scores: dict[Grouping, tuple[tuple, SimResult | None]] = {}

    def feasible(self, ind: Grouping) -> bool:
        """Early pruning (§4.3): every group can hold one copy of the weights, in one region."""
        planner = self.planner
        return all(planner.can_hold_model(g) and len(_regions(planner, g)) == 1 for g in ind)

    def fitness(self, ind: Grouping) -> tuple:
        """SLO attainment first (HexGen Eq. 1); among equal attainment the plan with more cost-model
        capacity (headroom for more load), then the lower mean latency."""
        got = self.scores.get(ind)
        if got is not None:
            return got[0]
        replicas = _materialise(self.planner, ind)
        if not replicas:
            key: tuple = (-1.0, 0.0, 0.0)
            self.scores[ind] = (key, None)
            return key
        model = serving_from_replicas(self.cluster, replicas, params=self.params)
        result = simulate(model, self.trace, self.config)
        latency = result.latency_mean if result.latency_mean is not None else math.inf
        key = (round(result.slo_attainment, 4), round(sum(r.capacity for r in replicas), 1), -latency)
        self.scores[ind] = (key, result)
        return key

    def mutate(self, parent: Grouping) -> Grouping | None:
        return _MUTATIONS[self.rng.choice(sorted(_MUTATIONS))](parent, self.rng, self.planner)

    def initial_population(self, seeds: list[Grouping], population: int) -> list[Grouping]:
        """The seeds and up to ``population`` feasible mutants of them, best first."""
        pop: list[Grouping] = list(dict.fromkeys(seeds))
        attempts = 0
        while len(pop) < population and attempts < 20 * population:
            attempts += 1
            child = self.mutate(self.rng.choice(seeds))
            if child is not None and self.feasible(child) and child not in pop:
                pop.append(child)
        pop.sort(key=self.fitness, reverse=True)
        return pop

    def next_generation(self, pop: list[Grouping], population: int, offspring: int) -> list[Grouping]:
        """``offspring`` new feasible children of parents picked by tournaments of two; the best
        ``population`` of parents and children survive."""
        children: list[Grouping] = []
        tries = 0
        while len(children) < offspring and tries < 20 * offspring:
            tries += 1
            a, b = self.rng.sample(range(len(pop)), 2) if len(pop) > 1 else (0, 0)
            child = self.mutate(pop[min(a, b)])  # tournament of two over the sorted population
            if child is None or not self.feasible(child) or child in pop or child in children:
                continue
            children.append(child)
        return sorted(set(pop) | set(children), key=self.fitness, reverse=True)[:population]


def _seed_groupings(cluster: Cluster, evolution: _Evolution, seed: int) -> list[Grouping]:
    """The initial groupings: K-means with the Elbow method and the packing grouping when feasible, else
    every GPU of a region in one group; raises when no region can hold the model."""
    planner = evolution.planner
    seeds: list[Grouping] = []
    km = _kmeans_grouping(planner, seed)
    if evolution.feasible(km):
        seeds.append(km)
    packed = _packing_grouping(planner)
    if packed is not None and evolution.feasible(packed):
        seeds.append(packed)
    if not seeds:
        # every GPU of a region in one group, which is feasible whenever the region can hold the model
        by_region: dict[str, list[int]] = {}
        for c in planner.classes:
            by_region.setdefault(c.region, [0] * len(planner.classes))[c.index] += c.count
        fallback = _canonical(tuple(v) for v in by_region.values() if planner.can_hold_model(tuple(v)))
        if fallback:
            seeds.append(fallback)
    if not seeds or all(not _materialise(planner, s) for s in seeds):
        raise PlacementError(
            f"cluster {cluster.name!r} cannot hold {cluster.model.name} in any region under HexGen's memory model"
        )
    return seeds


def plan_hexgen(
    cluster: Cluster,
    *,
    rate: float | None = None,
    slo_scale: float = 5.0,
    task: Task | None = None,
    generations: int = 30,
    population: int = 8,
    offspring: int = 4,
    sim_duration: float = 30.0,
    max_stages: int = 8,
    time_limit: float = 120.0,
    seed: int = 0,
    params: HexGenParams | None = None,
    beam: int = 4000,
) -> HexGenResult:
    """Run HexGen's scheduler on ``cluster`` (see the module docstring).

    ``rate`` (requests/s) and ``slo_scale`` define the fitness trace (Poisson arrivals for ``sim_duration``
    seconds with the task's lengths); the default rate is 75% of the best initial grouping's cost-model
    capacity (HexGen-2 §5.1's online setting). ``task`` is HexGen's planning task ``(b_t, s_in, s_out)``, by
    default one request of the spec's average lengths. The search stops after ``generations`` or
    ``time_limit`` seconds."""
    t0 = time.monotonic()
    params = params or HexGenParams()
    task = task or _default_task(cluster)
    if generations < 0 or population < 1 or offspring < 1:
        raise PlannerError("generations must be >= 0, population and offspring >= 1", code="bad_option")
    if sim_duration <= 0 or slo_scale <= 0:
        raise PlannerError("sim_duration and slo_scale must be positive", code="bad_option")
    planner = _Planner(cluster, task, params, max_stages, beam)
    upper = CostModel(cluster, params.cost).upper_bound()
    evolution = _Evolution(cluster, planner, params, random.Random(seed))
    seeds = _seed_groupings(cluster, evolution, seed)
    if rate is None:
        # HexGen-2 §5.1's online setting: 75% of the peak throughput (here the best seed's cost-model capacity)
        peak = max(sum(r.capacity for r in _materialise(planner, s)) for s in seeds)
        rate = max(1e-3, 0.75 * peak / task.s_out)
    if not rate > 0:
        raise PlannerError(f"rate must be positive, got {rate}", code="bad_option")
    trace = poisson_trace(rate, sim_duration, int(task.s_in), int(task.s_out), seed=seed)
    if not trace:
        trace = poisson_trace(rate, max(sim_duration, 5.0 / rate), int(task.s_in), int(task.s_out), seed=seed)
    evolution.trace = trace
    evolution.config = SimConfig(slo_scale=slo_scale, drain=max(60.0, 4 * sim_duration))

    pop = evolution.initial_population(seeds, population)
    history = [evolution.scores[pop[0]][0][0]]
    done_generations = 0
    for _ in range(generations):
        if time.monotonic() - t0 > time_limit:
            break
        pop = evolution.next_generation(pop, population, offspring)
        history.append(evolution.scores[pop[0]][0][0])
        done_generations += 1
    best = pop[0]
    result = evolution.scores[best][1]
    assert result is not None
    return HexGenResult(
        cluster=cluster.name,
        replicas=tuple(_materialise(planner, best)),
        fitness=result,
        rate=rate,
        slo_scale=slo_scale,
        task=task,
        solve_seconds=time.monotonic() - t0,
        evaluations=len(evolution.scores),
        generations=done_generations,
        upper_bound=upper,
        history=tuple(history),
    )


def describe(result: HexGenResult) -> list[str]:
    """One line per replica in HexGen Table 4's notation (GPUs per type, TP degree per stage)."""
    lines = []
    for r in result.replicas:
        kinds: dict[str, int] = {}
        for g in r.gpus:
            kinds[g.gpu_type] = kinds.get(g.gpu_type, 0) + 1
        regions = sorted({g.region for g in r.gpus})
        text = " + ".join(f"{n}x{k}" for k, n in sorted(kinds.items()))
        layers = [s.layers for s in r.stages]
        lines.append(f"{'/'.join(regions)}: {text} strategy {r.strategy} layers {layers}")
    return lines
