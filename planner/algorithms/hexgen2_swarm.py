"""HexGen-2's scheduler for a live swarm: which nodes prefill, which decode, their block ranges and KV links.

:mod:`planner.algorithms.hexgen2` runs HexGen-2 (002_ac42bb48b964a3e9.txt) §3 on GPUs described by TFLOPS and memory
bandwidth. A swarm is different, and this module is the same three-phase search adapted to it:

* every node is one device (a CPU server or one GPU) and one pipeline stage: there is no tensor
  parallelism, so a group's parallel strategy (§3.3) is the order of its nodes and each node's contiguous
  block range, within the node's own ``max_blocks`` (what it computed its memory holds with KV room);
* speeds are measured, not modelled: a node's decode rate is its ``block_throughput`` (tokens/s through
  one block, one token per step) and its prefill rate its ``prefill_throughput`` (prompt tokens/s through
  one block); a node without a measurement gets both from the cost model
  (:func:`planner.costs.roofline.batch_time`, HexGen Eq. 4);
* HexGen-2 Table 1 per node: a prefill node of ``b`` blocks takes ``b s_in / prefill rate``; a pipeline hop
  ``alpha + s_in H B / beta`` over the measured link; a decode node of ``b`` blocks serves ``rate / b``
  tokens/s (Helix's ``T_j``, Helix §4.2) and a decode group the least of its nodes (its bottleneck stage);
  the KV cache of a request moves, for every block range a prefill node shares with a decode node,
  ``s_in`` tokens of :func:`planner.costs.roofline.kv_bytes_per_token` per block over their link (Table 1's last
  row, ``alpha + 2 s_in H B / beta`` per layer), one sender's transfers serialised and different senders'
  in parallel.

The search (:func:`plan_swarm_phases`):

1. **Graph partition** (§3.2): the nodes form a graph with the blocks they hold as node weight and the
   measured bandwidth as edge weight; ``K`` = blocks held over the model's blocks (every group must hold the
   whole model), spectral partitioning and Kernighan-Lin (:mod:`planner.search.partition`) cut it into ``K`` groups,
   and a max-cut bipartition of the coarsened groups gives the prefill and the decode side (both
   orientations are scored).
2. **Max flow** (§3.3): prefill groups take their latency-optimal strategy (blocks on the fastest prefill
   nodes first, capacity ``1 / latency`` requests/s), decode groups their throughput-optimal one (blocks in
   proportion to the decode rates, capacity ``tokens/s / s_out``); a graph source -> prefill -> decode ->
   sink with coordinator edges (the client links) and KV edges of capacity ``1 / transfer time`` is solved
   by preflow-push; the flow on the KV edges is the KV routing.
3. **Refinement** (§3.4): a node moves into a group on a saturated edge, two nodes swap, a node leaves a
   group that holds the model without it, a group flips its role, or two groups merge; the best improving
   move is applied until none improves, and when no single move improves, the ``lookahead`` best
   neighbours are expanded by one more move first.

Nodes pinned to a phase (``pinned``, e.g. ``join --phase prefill``) only join groups of that phase. Plain
data in and out: the cluster spec and a :class:`SwarmPhasePlan` of peer ids.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
from networkx.algorithms.flow import preflow_push

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.roofline import activation_bytes, batch_time, kv_bytes_per_token
from ..errors import CannotPlaceError, PlannerError
from ..search.partition import coarsen, kernighan_lin, max_cut_bipartition, spectral_partition

__all__ = ["DECODE", "PREFILL", "SwarmPhasePlan", "plan_swarm_phases", "score_phase_groups"]

PREFILL, DECODE = "prefill", "decode"
_SOURCE, _SINK = "source", "sink"
#: Groups of at most this many nodes try every pipeline order of their nodes (§3.3's stage orders).
_ORDER_SEARCH_NODES = 5
#: Measured speeds this close (relative) count as equal when blocks are split (measurement noise).
_SAME_SPEED = 0.05
#: When the cut's two orientations fail, up to this many groups without pinned nodes try every role.
_ROLE_SEARCH_GROUPS = 8
#: Starting from two groups anew, up to this many free nodes try every side (2^n splits), more go by memory.
_SPLIT_SEARCH_NODES = 10

Group = tuple[int, ...]  # node indices, sorted


@dataclass(frozen=True)
class GroupPlan:
    """One group: its role, its nodes in pipeline order with their ranges, and its capacity in requests/s
    (prefill: ``1 / latency``; decode: tokens/s over ``s_out``)."""

    role: str
    ranges: tuple[tuple[str, int, int], ...]  # (node id, start, end) in pipeline order
    capacity: float
    latency: float


@dataclass(frozen=True)
class SwarmPhasePlan:
    """A two-phase plan of a swarm: every node's phase and range, the KV routing between groups (requests/s),
    and the max flow ``value`` in requests/s (``throughput`` = ``value * s_out`` output tokens/s)."""

    groups: tuple[GroupPlan, ...]
    kv_routing: dict[tuple[int, int], float]
    source_flow: dict[int, float]
    value: float
    s_in: float
    s_out: float
    solve_seconds: float = 0.0
    iterations: int = 0
    moves: tuple[str, ...] = field(default_factory=tuple)

    @property
    def throughput(self) -> float:
        return self.value * self.s_out

    @property
    def assignments(self) -> dict[str, tuple[int, int]]:
        return {n: (a, b) for g in self.groups for n, a, b in g.ranges}

    @property
    def phases(self) -> dict[str, str]:
        return {n: g.role for g in self.groups for n, _a, _b in g.ranges}

    def kv_links(self) -> dict[str, dict[str, float]]:
        """Prefill node -> decode node -> requests/s whose KV cache crosses that pair (the group routing spread
        over the node pairs that share blocks)."""
        out: dict[str, dict[str, float]] = {}
        for (i, j), rate in sorted(self.kv_routing.items()):
            if rate <= 0:
                continue
            for p, a, b in self.groups[i].ranges:
                for d, c, e in self.groups[j].ranges:
                    if max(a, c) < min(b, e):
                        out.setdefault(p, {})[d] = out.get(p, {}).get(d, 0.0) + rate
        return out

    def flows(self) -> dict[str, dict[str, float]]:
        """Output tokens/s on the edges source -> first node -> ... -> last node -> sink of every group, the
        routing weights clients read (Helix §5.1), prefill groups with the requests they prefill."""
        out: dict[str, dict[str, float]] = {}
        for i, group in enumerate(self.groups):
            if group.role == PREFILL:
                rate = self.source_flow.get(i, 0.0)
            else:
                rate = sum(f for (_, j), f in self.kv_routing.items() if j == i)
            tokens = rate * self.s_out
            if tokens <= 0:
                continue
            chain = [_SOURCE, *(n for n, _a, _b in group.ranges), _SINK]
            for u, v in itertools.pairwise(chain):
                out.setdefault(u, {})[v] = out.get(u, {}).get(v, 0.0) + tokens
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": "hexgen2",
            "requests_per_s": self.value,
            "throughput": self.throughput,
            "task": {"s_in": self.s_in, "s_out": self.s_out},
            "groups": [{"id": f"{g.role}-{i}", "role": g.role, "capacity": g.capacity, "latency_s": g.latency,
                        "ranges": [[n, a, b] for n, a, b in g.ranges]} for i, g in enumerate(self.groups)],
            "kv_routing": [{"prefill": f"prefill-{i}", "decode": f"decode-{j}", "requests_per_s": f}
                           for (i, j), f in sorted(self.kv_routing.items()) if f > 0],
            "solve_seconds": self.solve_seconds,
            "iterations": self.iterations,
            "moves": list(self.moves),
        }


class _Swarm:
    """The per-node figures of Table 1 for one cluster and request shape, with the group strategies cached."""

    def __init__(self, cluster: Cluster, s_in: float, s_out: float, pinned: Mapping[str, str]) -> None:
        self.cluster = cluster
        self.model = cluster.model
        self.L = cluster.model.num_blocks
        self.s_in, self.s_out = float(s_in), float(s_out)
        self.ids = list(cluster.node_ids)
        self.nodes = [cluster.node(n) for n in self.ids]
        self.cap = []
        for node in self.nodes:
            held = node.max_blocks if node.max_blocks is not None else self.L
            self.cap.append(max(0, min(held, self.L)))
        self.decode_rate = [self._rate(n, 1.0, measured=n.block_throughput) for n in self.nodes]
        self.prefill_rate = [self._rate(n, self.s_in, measured=n.prefill_throughput) for n in self.nodes]
        self.kv = kv_bytes_per_token(self.model)
        self.act = activation_bytes(self.model)
        self.pinned = {self.ids.index(n): p for n, p in pinned.items() if n in self.ids}
        self._strategies: dict[tuple[Group, str], GroupPlan | None] = {}

    def _rate(self, node, tokens: float, *, measured: float | None) -> float:
        if measured:
            return float(measured)
        seconds = batch_time(self.cluster, node, 1, tokens)
        return tokens / seconds if seconds > 0 else 0.0

    def link(self, a: int, b: int):
        return self.cluster.link(self.ids[a], self.ids[b])

    def holds_model(self, group: Group) -> bool:
        return sum(self.cap[i] for i in group) >= self.L and len(group) <= self.L

    def allowed(self, group: Group, role: str) -> bool:
        return all(self.pinned.get(i, role) == role for i in group)

    # -- §3.3: a group's strategy ------------------------------------------------------------------
    def _hops(self, order: Sequence[int], tokens: float) -> float:
        return sum(self.link(a, b).latency_s + tokens * self.act / self.link(a, b).bytes_per_second
                   for a, b in itertools.pairwise(order))

    def _prefill_split(self, order: Sequence[int]) -> list[int] | None:
        """Latency-optimal: one block each, the rest on the fastest prefill nodes first up to their memory.
        Nodes whose speeds lie within :data:`_SAME_SPEED` of each other (measurement noise) share their blocks
        evenly: the latency is the same, and no node is filled to its last block's worth of KV cache."""
        if any(self.cap[i] < 1 or self.prefill_rate[i] <= 0 for i in order):
            return None
        out = {i: 1 for i in order}
        rest = self.L - len(order)
        fastest_first = sorted(order, key=lambda i: -self.prefill_rate[i])
        while fastest_first and rest:
            top = self.prefill_rate[fastest_first[0]]
            tier = [i for i in fastest_first if self.prefill_rate[i] >= top * (1 - _SAME_SPEED)]
            fastest_first = fastest_first[len(tier):]
            while rest and any(out[i] < self.cap[i] for i in tier):  # round robin within the tier
                for i in tier:
                    if rest and out[i] < self.cap[i]:
                        out[i] += 1
                        rest -= 1
        return None if rest else [out[i] for i in order]

    def _decode_split(self, order: Sequence[int]) -> list[int] | None:
        """Throughput-optimal: blocks in proportion to the decode rates (the bottleneck ``rate / blocks`` as
        high as it goes), within memory, one block at least each."""
        if any(self.cap[i] < 1 or self.decode_rate[i] <= 0 for i in order):
            return None
        out = {i: 1 for i in order}
        for _ in range(self.L - len(order)):
            room = [i for i in order if out[i] < self.cap[i]]
            if not room:
                return None
            best = max(room, key=lambda i: (self.decode_rate[i] / (out[i] + 1), -i))
            out[best] += 1
        return [out[i] for i in order]

    def strategy(self, group: Group, role: str) -> GroupPlan | None:
        key = (group, role)
        if key in self._strategies:
            return self._strategies[key]
        best: GroupPlan | None = None
        if self.holds_model(group) and self.allowed(group, role):
            orders = (itertools.permutations(group) if len(group) <= _ORDER_SEARCH_NODES
                      else [sorted(group, key=lambda i: -self.prefill_rate[i])])
            for order in orders:
                if role == PREFILL:
                    split = self._prefill_split(order)
                    if split is None:
                        continue
                    latency = sum(b * self.s_in / self.prefill_rate[i] for i, b in zip(order, split, strict=True))
                    latency += self._hops(order, self.s_in)
                    capacity = 1.0 / latency
                else:
                    split = self._decode_split(order)
                    if split is None:
                        continue
                    tokens = min(self.decode_rate[i] / b for i, b in zip(order, split, strict=True))
                    latency = sum(b / self.decode_rate[i] for i, b in zip(order, split, strict=True))
                    latency += self._hops(order, 1.0)
                    capacity = tokens / self.s_out
                if best is None or capacity > best.capacity * (1 + 1e-12):
                    ranges, start = [], 0
                    for i, b in zip(order, split, strict=True):
                        ranges.append((self.ids[i], start, start + b))
                        start += b
                    best = GroupPlan(role, tuple(ranges), capacity, latency)
        self._strategies[key] = best
        return best

    # -- Table 1's last row: moving a request's KV cache ---------------------------------------------
    def kv_time(self, pre: GroupPlan, dec: GroupPlan) -> float:
        busy: dict[str, float] = {}
        for p, a, b in pre.ranges:
            for d, c, e in dec.ranges:
                shared = min(b, e) - max(a, c)
                if shared <= 0:
                    continue
                link = self.cluster.link(p, d)
                busy[p] = busy.get(p, 0.0) + link.latency_s + shared * self.s_in * self.kv / link.bytes_per_second
        return max(busy.values(), default=0.0)

    def coordinator_capacity(self, group: GroupPlan, tokens: float, first: bool) -> float:
        """Requests/s the client link of the group's first (prompt in) or last node (tokens out) carries."""
        node = group.ranges[0][0] if first else group.ranges[-1][0]
        link = self.cluster.link(COORDINATOR, node)
        return link.bytes_per_second / max(tokens * self.cluster.token_bytes, 1e-9)


@dataclass
class _Eval:
    value: float
    groups: tuple[Group, ...]
    roles: tuple[str, ...]
    plans: tuple[GroupPlan, ...]
    flow: dict[Any, dict[Any, float]]
    saturated: frozenset[int]


def _evaluate(sw: _Swarm, groups: Sequence[Group], roles: Sequence[str]) -> _Eval | None:
    """Phase 2 (§3.3): every group's strategy, the KV edges, the max flow by preflow-push."""
    if PREFILL not in roles or DECODE not in roles:
        return None
    plans = []
    for g, r in zip(groups, roles, strict=True):
        plan = sw.strategy(g, r)
        if plan is None:
            return None
        plans.append(plan)
    graph = nx.DiGraph()
    for i, (plan, role) in enumerate(zip(plans, roles, strict=True)):
        graph.add_edge((i, "in"), (i, "out"), capacity=plan.capacity)
        if role == PREFILL:
            graph.add_edge(_SOURCE, (i, "in"), capacity=sw.coordinator_capacity(plan, sw.s_in, True))
        else:
            graph.add_edge((i, "out"), _SINK, capacity=sw.coordinator_capacity(plan, sw.s_out, False))
    for i, pre in enumerate(plans):
        if roles[i] != PREFILL:
            continue
        for j, dec in enumerate(plans):
            if roles[j] == DECODE:
                t = sw.kv_time(pre, dec)
                graph.add_edge((i, "out"), (j, "in"), capacity=1.0 / t if t > 0 else math.inf)
    value, flow = nx.maximum_flow(graph, _SOURCE, _SINK, flow_func=preflow_push)
    saturated = frozenset(
        i for i, plan in enumerate(plans) if flow[(i, "in")][(i, "out")] >= plan.capacity * (1 - 1e-9))
    return _Eval(float(value), tuple(groups), tuple(roles), tuple(plans), flow, saturated)


def score_phase_groups(cluster: Cluster, groups: Sequence[Sequence[str]], roles: Sequence[str], *,
                       workload: tuple[float, float] | None = None,
                       pinned: Mapping[str, str] | None = None) -> SwarmPhasePlan | None:
    """Phase 2 alone for given groups (lists of node ids) and roles: the plan, or None when a group cannot hold
    the model in its role. The coordinator scores the published plan with it to decide whether to move."""
    sw = _swarm(cluster, workload, pinned)
    index = {n: i for i, n in enumerate(sw.ids)}
    try:
        as_groups = [tuple(sorted(index[n] for n in g)) for g in groups]
    except KeyError:
        return None
    ev = _evaluate(sw, as_groups, list(roles))
    return None if ev is None else _plan(sw, ev, 0.0, 0, ())


def _swarm(cluster: Cluster, workload: tuple[float, float] | None, pinned: Mapping[str, str] | None) -> _Swarm:
    if workload is None:
        workload = (cluster.workload.avg_input_tokens, cluster.workload.avg_output_tokens)
    s_in, s_out = workload
    if not s_in >= 1 or not s_out >= 1:
        raise PlannerError(f"hexgen2 plans for prompts and outputs of at least one token, got {workload!r}",
                           code="bad_option")
    for node, phase in (pinned or {}).items():
        if phase not in (PREFILL, DECODE):
            raise PlannerError(f"node {node!r} is pinned to phase {phase!r}; a pin is prefill or decode",
                               code="bad_option")
    return _Swarm(cluster, s_in, s_out, pinned or {})


def _plan(sw: _Swarm, ev: _Eval, seconds: float, iterations: int, moves: Sequence[str]) -> SwarmPhasePlan:
    kv: dict[tuple[int, int], float] = {}
    source: dict[int, float] = {}
    for i, role in enumerate(ev.roles):
        if role != PREFILL:
            continue
        source[i] = ev.flow[_SOURCE].get((i, "in"), 0.0)
        for j, r2 in enumerate(ev.roles):
            if r2 == DECODE:
                f = ev.flow[(i, "out")].get((j, "in"), 0.0)
                if f > 1e-12:
                    kv[(i, j)] = f
    return SwarmPhasePlan(ev.plans, kv, source, ev.value, sw.s_in, sw.s_out, seconds, iterations, tuple(moves))


# -- Phase 1 (§3.2) ------------------------------------------------------------------------------------

def _initial(sw: _Swarm, seed: int, k: int | None = None) -> list[_Eval]:
    """The initial groups under both role orientations; if the partition's groups cannot all hold the model,
    the smallest are merged until they can. ``k``: the number of groups (default: §3.2's memory bound)."""
    usable = [i for i in range(len(sw.ids)) if sw.cap[i] > 0]
    n = len(usable)
    if k is None:
        k = sum(sw.cap[i] for i in usable) // sw.L
    k = max(2, min(n, k))
    bw = np.zeros((n, n))
    for a, i in enumerate(usable):
        for b, j in enumerate(usable):
            if a != b:
                bw[a, b] = sw.link(i, j).bandwidth_mbps
    weights = np.array([float(sw.cap[i]) for i in usable])
    labels = spectral_partition(bw, k, seed=seed) if n > 1 else np.zeros(n, dtype=int)
    labels = kernighan_lin(bw, labels, weights, tolerance=0.1) if len(set(labels.tolist())) > 1 else labels
    by_label: dict[int, list[int]] = {}
    for a, lab in enumerate(labels):
        by_label.setdefault(int(lab), []).append(usable[a])
    groups = [tuple(sorted(g)) for _, g in sorted(by_label.items())]
    while len(groups) > 2 and not all(sw.holds_model(g) for g in groups):
        groups.sort(key=lambda g: sum(sw.cap[i] for i in g))
        groups = [tuple(sorted(groups[0] + groups[1])), *groups[2:]]
    masks: list[list[bool]] = []
    if len(groups) >= 2:
        group_of = {i: gi for gi, g in enumerate(groups) for i in g}
        coarse, _ = coarsen(bw, np.array([group_of[usable[a]] for a in range(n)]))
        cut = max_cut_bipartition(coarse, seed=seed)
        masks = [list(map(bool, cut)), [not m for m in cut]]
    out = []
    for mask in masks:
        ev = _evaluate(sw, groups, [PREFILL if m else DECODE for m in mask])
        if ev is not None:
            out.append(ev)
    if not out:  # every orientation failed (pins, or groups too small): other role assignments
        # a group with pinned nodes can only take their phase; the free groups try both, for few groups
        fixed = [next((sw.pinned[i] for i in g if i in sw.pinned), None) for g in groups]
        free = [k for k, role in enumerate(fixed) if role is None]
        if len(free) <= _ROLE_SEARCH_GROUPS:
            for choice in itertools.product((PREFILL, DECODE), repeat=len(free)):
                chosen = dict(zip(free, choice, strict=True))
                roles = [chosen[gi] if role is None else role for gi, role in enumerate(fixed)]
                ev = _evaluate(sw, groups, roles)
                if ev is not None:
                    out.append(ev)
    if not out:  # the cut put nodes pinned to both phases together, or left a group short: two groups anew
        ev = _two_group_start(sw, usable)
        if ev is not None:
            out.append(ev)
    return out


def _two_group_start(sw: _Swarm, usable: Sequence[int]) -> _Eval | None:
    """The best split of the nodes into one prefill and one decode group, the pinned nodes on their side:
    every split of the free nodes when there are at most ``_SPLIT_SEARCH_NODES`` of them, else the free nodes
    by memory alone (largest first, into the side with fewer blocks: LPT)."""
    sides: dict[str, list[int]] = {PREFILL: [], DECODE: []}
    free: list[int] = []
    for i in usable:
        (sides[sw.pinned[i]] if i in sw.pinned else free).append(i)
    splits: Iterable[tuple[str, ...]]
    if len(free) <= _SPLIT_SEARCH_NODES:
        splits = itertools.product((PREFILL, DECODE), repeat=len(free))
    else:
        held = {PREFILL: sum(sw.cap[i] for i in sides[PREFILL]), DECODE: sum(sw.cap[i] for i in sides[DECODE])}
        choice = {}
        for i in sorted(free, key=lambda i: -sw.cap[i]):
            side = min(held, key=lambda s: held[s])
            choice[i] = side
            held[side] += sw.cap[i]
        splits = [tuple(choice[i] for i in free)]
    best = None
    for split in splits:
        groups = {PREFILL: list(sides[PREFILL]), DECODE: list(sides[DECODE])}
        for i, side in zip(free, split, strict=True):
            groups[side].append(i)
        if not all(sw.holds_model(tuple(g)) for g in groups.values()):
            continue
        ev = _evaluate(sw, [tuple(sorted(groups[PREFILL])), tuple(sorted(groups[DECODE]))], [PREFILL, DECODE])
        if ev is not None and (best is None or ev.value > best.value):
            best = ev
    return best


# -- Phase 3 (§3.4) ------------------------------------------------------------------------------------

def _moves(ev: _Eval, sw: _Swarm) -> list[tuple[list[Group], list[str], str]]:
    """Neighbours guided by the max flow: a node into a saturated group (or into any group when none is), a
    swap between a saturated group and another, a node leaving a group that holds the model without it, a role
    flip, a merge of two groups, and the unused nodes joining a group."""
    groups, roles = list(ev.groups), list(ev.roles)
    receivers = sorted(ev.saturated) or list(range(len(groups)))
    out: list[tuple[list[Group], list[str], str]] = []
    name = [f"{r}-{i}" for i, r in enumerate(roles)]
    placed = {i for g in groups for i in g}
    for spare in (i for i in range(len(sw.ids)) if i not in placed and sw.cap[i] > 0):
        for r in range(len(groups)):
            g2 = list(groups)
            g2[r] = tuple(sorted((*g2[r], spare)))
            out.append((g2, roles, f"add {sw.ids[spare][:8]} to {name[r]}"))
    for r in receivers:
        for d in range(len(groups)):
            if d == r:
                continue
            for node in groups[d]:
                g2 = list(groups)
                g2[d] = tuple(x for x in groups[d] if x != node)
                g2[r] = tuple(sorted((*groups[r], node)))
                r2 = list(roles)
                if not g2[d]:
                    del g2[d], r2[d]
                out.append((g2, r2, f"move {sw.ids[node][:8]} {name[d]}->{name[r]}"))
                for other in groups[r]:
                    g3 = list(groups)
                    g3[d] = tuple(sorted((*(x for x in groups[d] if x != node), other)))
                    g3[r] = tuple(sorted((*(x for x in groups[r] if x != other), node)))
                    out.append((g3, list(roles), f"swap {sw.ids[node][:8]}<->{sw.ids[other][:8]}"))
    for gi, group in enumerate(groups):  # a node that slows its group down (a slow prefill stage) leaves it
        for node in group:
            rest = tuple(x for x in group if x != node)
            if rest and sw.holds_model(rest):
                g2 = list(groups)
                g2[gi] = rest
                out.append((g2, roles, f"drop {sw.ids[node][:8]} from {name[gi]}"))
    for i in range(len(groups)):
        flipped = list(roles)
        flipped[i] = DECODE if roles[i] == PREFILL else PREFILL
        out.append((list(groups), flipped, f"flip {name[i]}"))
    for a, b in itertools.combinations(range(len(groups)), 2):  # two groups trade roles (with two, the only
        if roles[a] != roles[b]:  # way to turn them: a single flip leaves both in one role)
            traded = list(roles)
            traded[a], traded[b] = roles[b], roles[a]
            out.append((list(groups), traded, f"trade roles {name[a]}<->{name[b]}"))
    for a, b in itertools.combinations(range(len(groups)), 2):
        if len(groups) > 2:
            merged = [g for k, g in enumerate(groups) if k not in (a, b)] + [tuple(sorted(groups[a] + groups[b]))]
            for role in (PREFILL, DECODE):
                r2 = [r for k, r in enumerate(roles) if k not in (a, b)] + [role]
                out.append((merged, r2, f"merge {name[a]}+{name[b]} as {role}"))
    return out


def _canon(groups: Sequence[Group], roles: Sequence[str]) -> tuple:
    return tuple(sorted(zip(groups, roles, strict=True)))


def plan_swarm_phases(
    cluster: Cluster,
    *,
    workload: tuple[float, float] | None = None,
    pinned: Mapping[str, str] | None = None,
    max_iterations: int = 100,
    lookahead: int = 8,
    time_limit: float = 30.0,
    seed: int = 0,
) -> SwarmPhasePlan:
    """HexGen-2's three phases for a swarm (module docstring). ``workload`` = ``(s_in, s_out)`` (default: the
    cluster's averages); ``pinned``: node id -> the only phase it may serve.

    Raises :class:`CannotPlaceError` when the nodes cannot form one prefill and one decode group that each
    hold the whole model (the message says how many blocks are missing)."""
    t0 = time.monotonic()
    sw = _swarm(cluster, workload, pinned)
    held = sum(sw.cap)
    if held < 2 * sw.L or len([c for c in sw.cap if c > 0]) < 2:
        raise CannotPlaceError(
            f"two phases need one prefill and one decode copy of all {sw.L} blocks on different nodes: the nodes "
            f"hold {held} blocks in all; add nodes or memory (or plan without phases, e.g. --algorithm milp)")
    deadline = t0 + time_limit
    k_memory = sum(sw.cap) // sw.L
    results = []
    # §3.2's number of groups, and the fewest (two), each refined: small swarms often do best with fewer,
    # larger groups than memory allows, which single moves from many small groups rarely reach
    for k in sorted({max(2, k_memory), 2}, reverse=True):
        starts = _initial(sw, seed, k)
        if starts:
            results.append(_refine(sw, starts, max_iterations, lookahead, deadline))
    if not results:
        raise CannotPlaceError(
            f"the nodes cannot form a prefill and a decode group that each hold all {sw.L} blocks"
            + (" with the pinned phases" if sw.pinned else "") + "; add nodes or memory")
    best, iterations, moves = max(results, key=lambda r: r[0].value)
    return _plan(sw, best, time.monotonic() - t0, iterations, moves)


def _refine(sw: _Swarm, starts: list[_Eval], max_iterations: int, lookahead: int,
            deadline: float) -> tuple[_Eval, int, list[str]]:
    """Phase 3 from the best of ``starts``: the best improving move (or pair of moves) until none improves."""
    best = max(starts, key=lambda e: e.value)
    seen = {_canon(e.groups, e.roles) for e in starts}
    moves: list[str] = []
    iterations = 0
    scored: dict[tuple, _Eval | None] = {}

    def score(groups: list[Group], roles: list[str]) -> _Eval | None:
        key = _canon(groups, roles)
        if key not in scored:
            scored[key] = _evaluate(sw, groups, roles)
        return scored[key]

    def better(ev: _Eval, improved: tuple[_Eval, str] | None) -> bool:
        return ev.value > (improved[0].value if improved else best.value) * (1 + 1e-9)

    while iterations < max_iterations and time.monotonic() < deadline:
        iterations += 1
        improved: tuple[_Eval, str] | None = None
        neighbours = []
        for groups, roles, label in _moves(best, sw):
            groups = [tuple(sorted(g)) for g in groups]
            key = _canon(groups, roles)
            if key in seen:
                continue
            seen.add(key)
            ev = score(groups, roles)
            if ev is not None:
                neighbours.append((ev.value, label, ev))
            if ev is not None and better(ev, improved):
                improved = (ev, label)
        if improved is None and lookahead:
            # no single move helps: one move further from the most promising neighbours (as planner.algorithms.hexgen2)
            neighbours.sort(key=lambda x: -x[0])
            for _value, label, ev in neighbours[:lookahead]:
                for groups, roles, label2 in _moves(ev, sw):
                    ev2 = score([tuple(sorted(g)) for g in groups], roles)
                    if ev2 is not None and better(ev2, improved):
                        improved = (ev2, f"{label}; {label2}")
        if improved is None:
            break
        best = improved[0]
        moves.append(improved[1])
    return best, iterations, moves
