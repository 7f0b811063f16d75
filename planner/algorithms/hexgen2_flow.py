"""Phase 2 of HexGen-2's scheduler (002_ac42bb48b964a3e9.txt §3.3, App. A): how well a grouping of GPUs
into prefill and decode groups serves, as the max flow of its flow graph.

For one cluster and task, :class:`_Scorer` gives each group its parallel strategy (:class:`GroupStrategy`),
every split into stages of ``t`` GPUs of one type inside one machine scored with HexGen's cost model
(HexGen-2 Table 1): prefill groups take the *latency-optimal* one, decode groups the *throughput-optimal*
one (``b_max / latency(b_max)``); and the time to move one request's KV cache between two groups over the
layer-matched GPU pairs (Table 1's last row, stage orders chosen to minimise it). :func:`_evaluate` builds
the flow graph source -> prefill -> decode -> sink with those capacities and the coordinator edges and
solves it by preflow-push (networkx); the flow on the KV edges is the KV routing. Strategies and KV times
are cached per group and per pair of strategies, since a search scores many groupings that share groups.

Why apart from :mod:`planner.algorithms.hexgen2`: this is the scoring both of its searches share, the partition and
refinement of phases 1 and 3 (§3.2, §3.4, :func:`~planner.algorithms.hexgen2.plan_hexgen2`) and the exhaustive check
of App. E (:func:`~planner.algorithms.hexgen2.exhaustive_hexgen2`); it knows nothing of how groupings are proposed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
from networkx.algorithms.flow import preflow_push

from ..cluster.spec import Cluster, LinkSpec
from ..costs.hexgen_gpus import (
    HexGenParams,
    StageCost,
    Task,
    coordinator_link,
    gpu_classes,
    link_between,
    stage_compute_time,
    stage_max_batch,
)
from ..costs.roofline import kv_bytes_per_token, pp_comm_time, tp_comm_time

__all__ = ["DECODE", "PREFILL", "Group", "GroupStrategy"]

Group = tuple[int, ...]
PREFILL, DECODE = "prefill", "decode"
_SOURCE, _SINK = "source", "sink"


@dataclass(frozen=True)
class GroupStrategy:
    """A group's parallel strategy: stages ``(class index, TP degree, layers)`` in pipeline order, its
    capacity in requests/s and the latency that capacity comes from (seconds)."""

    stages: tuple[tuple[int, int, int], ...]
    capacity: float
    latency: float
    batch: int

    @property
    def tp_pp(self) -> tuple[int, int]:
        """HexGen-2 Table 2's notation ``(TP, PP)`` (TP of the widest stage)."""
        return max(t for _, t, _ in self.stages), len(self.stages)


class _Scorer:
    """Phase 2 for one cluster and task: strategies per group, KV edges, max flow; all cached."""

    def __init__(self, cluster: Cluster, task: Task, params: HexGenParams) -> None:
        self.cluster = cluster
        self.task = task
        self.params = params
        self.classes = gpu_classes(cluster, params)
        self.sc = StageCost(cluster, task, params)
        self.model = cluster.model
        self.L = cluster.model.num_blocks
        self.kv = kv_bytes_per_token(self.model)
        n = len(self.classes)
        self.links: list[list[LinkSpec]] = [[self.classes[a].tp_link] * n for a in range(n)]
        for a in self.classes:
            for b in self.classes:
                if a.index != b.index:
                    self.links[a.index][b.index] = link_between(cluster, a.gpus, b.gpus, params)
        self.coord = [coordinator_link(cluster, c.gpus) for c in self.classes]
        self._strategies: dict[tuple[Group, str], GroupStrategy | None] = {}
        self._kv: dict[tuple, float] = {}
        self.weights_bytes = self.L * self.model.block_bytes

    # -- helpers --------------------------------------------------------------------------------
    def usable(self, group: Group) -> float:
        return sum(
            n * (c.memory_bytes - c.gpus[0].reserve_bytes) for n, c in zip(group, self.classes, strict=True)
        )

    def can_hold(self, group: Group) -> bool:
        return self.usable(group) >= self.weights_bytes

    def _stage_sets(self, group: Group) -> list[list[tuple[int, int]]]:
        """Every multiset of stages ``(class, TP)`` that uses each GPU of ``group`` exactly once."""
        per_class = []
        for k, n in enumerate(group):
            if n == 0:
                continue
            degrees = [t for t in self.params.tp_degrees if t <= n]
            options: list[list[int]] = []

            def parts(
                rest: int,
                largest: int,
                acc: list[int],
                degrees: list[int] = degrees,
                options: list[list[int]] = options,
            ) -> None:
                if rest == 0:
                    options.append(list(acc))
                    return
                for t in degrees:
                    if t <= rest and t <= largest:
                        acc.append(t)
                        parts(rest - t, t, acc)
                        acc.pop()

            parts(n, n, [])
            per_class.append([[(k, t) for t in opt] for opt in options])
        out = []
        for combo in itertools.product(*per_class):
            stages = [s for part in combo for s in part]
            if len(stages) <= self.L:
                out.append(stages)
        return out

    # -- Table 1, per phase -------------------------------------------------------------------------
    def _stage_compute(self, k: int, t: int, layers: int, batch: float, s_in: float, s_out: float) -> float:
        """Compute time of a stage of ``t`` GPUs of class ``k`` holding ``layers`` layers for ``batch``
        requests of ``s_in`` prompt and ``s_out`` output tokens: HexGen-2 Table 1's compute term, i.e.
        HexGen Eq. 4 (:func:`planner.costs.hexgen_gpus.stage_compute_time`) with the model's per-layer parameters and
        weight bytes. The prefill phase passes ``s_out = 0``, the decode phase ``s_in = 0``."""
        return stage_compute_time(self.model, self.classes[k], t, layers, batch=batch, s_in=s_in, s_out=s_out)

    def _prefill_stage(self, k: int, t: int, layers: int, batch: float = 1.0) -> float:
        cls = self.classes[k]
        m = self.model
        c = self._stage_compute(k, t, layers, batch, self.task.s_in, 0.0)
        # one weight scan per prefill (Table 1's prefill row omits it; HexGen Eq. 4 charges it per pass)
        c += layers * m.block_bytes / (t * cls.bandwidth)
        return c + self._tp(k, t, layers, batch, self.task.s_in, 0.0)

    def _decode_stage(self, k: int, t: int, layers: int, batch: float) -> float:
        cls = self.classes[k]
        s_out = self.task.s_out
        c = self._stage_compute(k, t, layers, batch, 0.0, s_out)
        if self.params.cost.kv_scan:
            c += layers * s_out * batch * (self.task.s_in + s_out / 2.0) * self.kv / (t * cls.bandwidth)
        return c + self._tp(k, t, layers, batch, 0.0, s_out)

    def _tp(self, k: int, t: int, layers: int, batch: float, s_in: float, s_out: float) -> float:
        if t <= 1:
            return 0.0
        link = self.classes[k].tp_link
        alpha = [[link.latency_s] * t for _ in range(t)]
        beta = [[link.bytes_per_second] * t for _ in range(t)]
        m = self.model
        seconds = tp_comm_time(
            layers,
            alpha,
            beta,
            hidden_size=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            batch=batch,
            s_in=s_in,
            s_out=s_out,
        )
        if s_in == 0:
            # Eq. 5's prefill supersteps move nothing in the decode phase: drop their latency too
            seconds -= 4 * layers * (t - 1) * link.latency_s
        return seconds

    def _pp(self, a: int, b: int, batch: float, s_in: float, s_out: float) -> float:
        link = self.links[a][b]
        m = self.model
        return pp_comm_time(
            [(link.latency_s, link.bytes_per_second)],
            hidden_size=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            batch=batch,
            s_in=s_in,
            s_out=s_out,
        )

    @staticmethod
    def _order(stages: list[tuple[int, int]]) -> list[tuple[int, int]]:
        # stages of one machine next to each other, wider stages first
        return sorted(stages, key=lambda s: (s[0], -s[1]))

    def _latency_split(self, stages: list[tuple[int, int]]) -> list[int] | None:
        """Layers per stage minimising the prefill latency: every stage gets one layer, the rest go to the
        stages with the cheapest per-layer cost first, each up to its Eq. 7 limit."""
        caps = [self.sc.max_layers(self.classes[k], t) for k, t in stages]
        if any(c < 1 for c in caps) or sum(caps) < self.L or len(stages) > self.L:
            return None
        per_layer = [self._prefill_stage(k, t, 1) for k, t in stages]
        out = [1] * len(stages)
        rest = self.L - len(stages)
        for i in sorted(range(len(stages)), key=lambda i: per_layer[i]):
            add = min(rest, caps[i] - 1)
            out[i] += add
            rest -= add
        return out if rest == 0 else None

    def _memory_split(self, stages: list[tuple[int, int]]) -> list[int] | None:
        """Layers per stage proportional to the stage's memory (HexGen §4.3's re-split), within Eq. 7."""
        caps = [self.sc.max_layers(self.classes[k], t) for k, t in stages]
        if any(c < 1 for c in caps) or sum(caps) < self.L or len(stages) > self.L:
            return None
        mem = np.array(
            [t * (self.classes[k].memory_bytes - self.classes[k].gpus[0].reserve_bytes) for k, t in stages]
        )
        raw = self.L * mem / mem.sum()
        out = [max(1, min(math.floor(x), c)) for x, c in zip(raw, caps, strict=True)]
        while sum(out) < self.L:
            room = [i for i in range(len(out)) if out[i] < caps[i]]
            if not room:
                return None
            i = max(room, key=lambda i: raw[i] - out[i])
            out[i] += 1
        while sum(out) > self.L:
            i = min((i for i in range(len(out)) if out[i] > 1), key=lambda i: raw[i] - out[i])
            out[i] -= 1
        return out

    def strategy(self, group: Group, role: str) -> GroupStrategy | None:
        """The latency-optimal (prefill) or throughput-optimal (decode) strategy of a group (§3.3)."""
        key = (group, role)
        if key in self._strategies:
            return self._strategies[key]
        best: GroupStrategy | None = None
        if self.can_hold(group):
            for stage_set in self._stage_sets(group):
                stages = self._order(stage_set)
                if role == PREFILL:
                    layers = self._latency_split(stages)
                    if layers is None:
                        continue
                    lat = sum(self._prefill_stage(k, t, n) for (k, t), n in zip(stages, layers, strict=True))
                    lat += sum(
                        self._pp(a[0], b[0], 1.0, self.task.s_in, 0.0) for a, b in itertools.pairwise(stages)
                    )
                    cand = GroupStrategy(
                        tuple((k, t, n) for (k, t), n in zip(stages, layers, strict=True)), 1.0 / lat, lat, 1
                    )
                else:
                    layers = self._memory_split(stages)
                    if layers is None:
                        continue
                    b = min(
                        stage_max_batch(self.sc, self.classes[k], t, n)
                        for (k, t), n in zip(stages, layers, strict=True)
                    )
                    if b < 1:
                        continue
                    lat = sum(
                        self._decode_stage(k, t, n, b) for (k, t), n in zip(stages, layers, strict=True)
                    )
                    lat += sum(
                        self._pp(a[0], c[0], b, 0.0, self.task.s_out) for a, c in itertools.pairwise(stages)
                    )
                    cand = GroupStrategy(
                        tuple((k, t, n) for (k, t), n in zip(stages, layers, strict=True)), b / lat, lat, b
                    )
                if best is None or cand.capacity > best.capacity * (1 + 1e-12):
                    best = cand
        self._strategies[key] = best
        return best

    # -- KV edges ----------------------------------------------------------------------------------
    def kv_time(self, pre: tuple[tuple[int, int, int], ...], dec: tuple[tuple[int, int, int], ...]) -> float:
        """KV transfer time of one request between two ordered strategies (HexGen-2 Table 1, last row):
        every overlapping layer range moves from the prefill stage to the decode stage holding it; segments
        sharing a stage are serialised, the rest run in parallel."""
        key = (pre, dec)
        v = self._kv.get(key)
        if v is not None:
            return v
        load: dict[tuple[str, int], float] = {}
        ps, pos = [], 0
        for k, t, n in pre:
            ps.append((k, t, pos, pos + n))
            pos += n
        ds, pos = [], 0
        for k, t, n in dec:
            ds.append((k, t, pos, pos + n))
            pos += n
        for i, (kp, tp, a0, a1) in enumerate(ps):
            for j, (kd, td, b0, b1) in enumerate(ds):
                lo, hi = max(a0, b0), min(a1, b1)
                if hi <= lo:
                    continue
                link = self.links[kp][kd]
                sec = link.latency_s + self.task.s_in * self.kv * (hi - lo) / (
                    min(tp, td) * link.bytes_per_second
                )
                load[("p", i)] = load.get(("p", i), 0.0) + sec
                load[("d", j)] = load.get(("d", j), 0.0) + sec
        v = max(load.values(), default=0.0)
        self._kv[key] = v
        return v

    @staticmethod
    def orders(
        stages: tuple[tuple[int, int, int], ...], limit: int = 4
    ) -> list[tuple[tuple[int, int, int], ...]]:
        """Stage orders considered when matching KV layers (App. A): all permutations up to ``limit`` stages."""
        if len(stages) > limit:
            return [stages]
        return list(dict.fromkeys(itertools.permutations(stages)))


@dataclass(frozen=True)
class _Eval:
    value: float  # requests/s
    groups: tuple[Group, ...]
    roles: tuple[str, ...]
    strategies: tuple[GroupStrategy, ...]
    orders: tuple[tuple[tuple[int, int, int], ...], ...]
    flow: dict[str, dict[str, float]]
    capacity: dict[tuple[str, str], float]


def _evaluate(scorer: _Scorer, groups: Sequence[Group], roles: Sequence[str]) -> _Eval | None:
    """Phase 2 (§3.3): strategies, KV edges with the best stage orders, max flow by preflow-push."""
    if PREFILL not in roles or DECODE not in roles:
        return None
    strategies = []
    for g, r in zip(groups, roles, strict=True):
        s = scorer.strategy(g, r)
        if s is None:
            return None
        strategies.append(s)
    names = [f"{r}-{i}" for i, r in enumerate(roles)]
    pre = [i for i, r in enumerate(roles) if r == PREFILL]
    dec = [i for i, r in enumerate(roles) if r == DECODE]
    task = scorer.task
    tb = scorer.cluster.token_bytes

    def coord_cap(i: int, tokens: float) -> float:
        g = groups[i]
        link = max((scorer.coord[k] for k, n in enumerate(g) if n), key=lambda lk: lk.bandwidth_mbps)
        return link.bytes_per_second / (tokens * tb)

    # choose each group's stage order: best order per pair first, then fix by coordinate descent
    order = {i: strategies[i].stages for i in range(len(groups))}
    cands = {i: _Scorer.orders(strategies[i].stages) for i in range(len(groups))}
    for _ in range(2):
        for i in range(len(groups)):
            others = dec if i in pre else pre
            best_o, best_v = order[i], math.inf
            for o in cands[i]:
                v = 0.0
                for j in others:
                    v += scorer.kv_time(o, order[j]) if i in pre else scorer.kv_time(order[j], o)
                if v < best_v - 1e-15:
                    best_o, best_v = o, v
            order[i] = best_o

    graph = nx.DiGraph()
    capacity: dict[tuple[str, str], float] = {}

    def edge(u: Any, v: Any, cap: float, key: tuple[str, str]) -> None:
        graph.add_edge(u, v, capacity=cap)
        capacity[key] = cap

    for i in pre:
        edge(_SOURCE, (names[i], "in"), coord_cap(i, task.s_in), (_SOURCE, names[i]))
        edge((names[i], "in"), (names[i], "out"), strategies[i].capacity, (names[i], names[i]))
    for j in dec:
        edge((names[j], "in"), (names[j], "out"), strategies[j].capacity, (names[j], names[j]))
        edge((names[j], "out"), _SINK, coord_cap(j, task.s_out), (names[j], _SINK))
    for i in pre:
        for j in dec:
            t = scorer.kv_time(order[i], order[j])
            edge((names[i], "out"), (names[j], "in"), 1.0 / t if t > 0 else math.inf, (names[i], names[j]))
    value, flow_dict = nx.maximum_flow(graph, _SOURCE, _SINK, flow_func=preflow_push)
    flow: dict[str, dict[str, float]] = {}
    for u, targets in flow_dict.items():
        for v, f in targets.items():
            a = u if isinstance(u, str) else u[0]
            b = v if isinstance(v, str) else v[0]
            if f > 1e-12:
                flow.setdefault(a, {})[b] = flow.get(a, {}).get(b, 0.0) + f
    return _Eval(
        value=float(value),
        groups=tuple(groups),
        roles=tuple(roles),
        strategies=tuple(strategies),
        orders=tuple(order[i] for i in range(len(groups))),
        flow=flow,
        capacity=capacity,
    )
