"""The MILP models of Helix's placement problem (ASPLOS 2025, §4.4, Tables 5-6), built on
:class:`planner.search.milp_model.SparseModel`: how each is built, warm-started from a placement and decoded back
into one. :func:`planner.algorithms.milp.milp` solves them inside its search (:mod:`planner.search.portfolio`); the
formulations themselves are described in :mod:`planner.algorithms.milp`'s docstring.

- interchangeable nodes (:func:`interchangeable_groups`): nodes that can swap places without changing any
  flow graph, the node types of the ``typed`` model and the symmetry-breaking rows of the ``per-node`` one;
- the ``typed`` formulation (symmetry-reduced; exact slow-link products between types, Helix §4.3);
- the ``per-node`` formulation, Helix Tables 5-6 as written, with §4.5's link pruning (:func:`_kept_links`);
- the covering MILP under a redundancy floor (:func:`_floor_cover`; :mod:`planner.search.coverage`,
  :mod:`planner.search.redundancy`);
- the redundancy floor's rows shared by all three (:func:`_floor_rows`, :func:`_floor_start`), and the
  placement helpers the decoders share with the search (:func:`_complete`, :func:`_ordered`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import preflow_push

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.factory import make_cost_model
from ..costs.roofline import CostModel
from ..flow_graph import SINK, SOURCE, evaluate
from ..placement import Placement
from ..search.coverage import coverage_profile
from ..search.milp_model import SolveOutcome, SparseModel
from ..search.redundancy import Floor, replica_counts

# ---------------------------------------------------------------------------------------------------
# Interchangeable nodes
# ---------------------------------------------------------------------------------------------------


def interchangeable_groups(cluster: Cluster, cost: CostModel | None = None) -> list[list[str]]:
    """Partition the nodes into groups whose members can swap places without changing any flow graph:
    same capacity and ``T_j`` table, same coordinator link, and the same link to every other node."""
    cost = cost or make_cost_model(cluster)
    groups: list[list[str]] = []
    keys: list[tuple] = []
    for node in cluster.nodes:
        key = (cost.table[node.id], cluster.coordinator_link(node.id))
        placed = False
        for g, members in enumerate(groups):
            if keys[g] != key:
                continue
            rep = members[0]
            if all(
                cluster.link(rep, other) == cluster.link(node.id, other)
                for other in cluster.node_ids
                if other not in (rep, node.id)
            ):
                members.append(node.id)
                placed = True
                break
        if not placed:
            groups.append([node.id])
            keys.append(key)
    return groups


# ---------------------------------------------------------------------------------------------------
# Placement helpers
# ---------------------------------------------------------------------------------------------------


def _complete(
    cluster: Cluster, cost: CostModel, ranges: dict[str, tuple[int, int]], unused: list[str]
) -> dict[str, tuple[int, int]]:
    """Place unused nodes as Petals would: the window of their largest size with least throughput."""
    num_blocks = cluster.model.num_blocks
    per_block = [0.0] * num_blocks
    for n, (s, e) in ranges.items():
        rate = cost.throughput(n, e - s)
        for b in range(s, e):
            per_block[b] += rate
    result = dict(ranges)
    for n in unused:
        sizes = cost.feasible_sizes(n)
        if not sizes:
            continue
        size = min(max(sizes), num_blocks)
        start = min(range(num_blocks - size + 1), key=lambda s: (sum(per_block[s : s + size]), s))
        result[n] = (start, start + size)
        rate = cost.throughput(n, size)
        for b in range(start, start + size):
            per_block[b] += rate
    return result


def _ordered(cluster: Cluster, ranges: Mapping[str, tuple[int, int]]) -> Placement:
    return Placement({n: ranges[n] for n in cluster.node_ids if n in ranges})


# ---------------------------------------------------------------------------------------------------
# Typed (symmetry-reduced) formulation
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Typed:
    model: SparseModel
    groups: list[list[str]]
    x: dict[tuple[int, int, int], int]  # (t, s, k) -> var
    g: dict[tuple[int, int, int, int], int]  # (t, s, k, entry) -> var
    h: dict[tuple[int, int, int], int]  # (t, t2, boundary) -> var
    exact: bool
    # slow links: (t, boundary) -> [at least m type-t nodes end there]; (t, t2, boundary) -> [z_m x takers]
    z: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    w: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    # the redundancy floor: per block "held min_replicas times" (only where the offers cannot everywhere)
    floor: Floor | None = None
    y: list[int] = field(default_factory=list)


def _typed_model(
    cluster: Cluster, cost: CostModel, groups: list[list[str]], partial: bool, floor: Floor | None = None
) -> _Typed:
    """The typed formulation (:mod:`planner.algorithms.milp`'s docstring): range variables per type, then flow
    conservation per block boundary, with the exact slow-link products where links between types can bind;
    with an active ``floor``, each block held by enough nodes (:func:`_floor_rows`)."""
    L = cluster.model.num_blocks
    m = SparseModel()
    reps = [members[0] for members in groups]
    count = [len(members) for members in groups]
    sizes = [[k for k in cost.feasible_sizes(rep) if k <= L] for rep in reps]
    max_rate = [max((cost.throughput(rep, k) for k in sizes[t]), default=0.0) for t, rep in enumerate(reps)]
    pair_cap = _binding_type_pairs(cost, groups, max_rate)
    x, g = _typed_ranges(m, cost, reps, count, sizes, L, partial)
    exact = not pair_cap
    h, z, w = _typed_boundaries(m, x, g, count, pair_cap, L, partial)
    y: list[int] = []
    if floor is not None and floor.active:
        y = _floor_rows(m, _block_holders(x, L), floor)
    return _Typed(model=m, groups=groups, x=x, g=g, h=h, exact=exact, z=z, w=w, floor=floor, y=y)


def _block_holders(x: Mapping[tuple[int, int, int], int], L: int) -> list[list[tuple[int, float]]]:
    """Per block the range variables ``x[t, s, k]`` that hold it."""
    holders: list[list[tuple[int, float]]] = [[] for _ in range(L)]
    for (_t, s, k), xv in x.items():
        for b in range(s, s + k):
            holders[b].append((xv, 1.0))
    return holders


def _floor_rows(m: SparseModel, holders: list[list[tuple[int, float]]], floor: Floor) -> list[int]:
    """The redundancy floor (:mod:`planner.search.redundancy`) over per-block holder terms: every block held
    ``min_replicas`` times when the offers allow it; else every block once, ``1 + (r - 1) y_b`` times with
    binaries ``y_b`` of which at least ``blocks_at_floor`` are set. Returns the ``y_b`` (empty when the
    floor holds everywhere)."""
    r = floor.min_replicas
    if floor.everywhere:
        for terms in holders:
            m.row(terms, float(r), math.inf)
        return []
    y = [m.var(0, 1, integer=True) for _ in holders]
    for terms, yv in zip(holders, y, strict=True):
        m.row([*terms, (yv, -(r - 1.0))], 1.0, math.inf)
    m.row([(yv, 1.0) for yv in y], float(floor.blocks_at_floor), math.inf)
    return y


def _floor_start(values: list[float], y: list[int], counts: list[int], floor: Floor | None) -> None:
    """Set the floor's ``y_b`` in a start from the placement's holder ``counts``."""
    if floor is not None:
        for b, yv in enumerate(y):
            values[yv] = 1.0 if counts[b] >= floor.min_replicas else 0.0


def _binding_type_pairs(
    cost: CostModel, groups: list[list[str]], max_rate: list[float]
) -> dict[tuple[int, int], float]:
    """Type pairs whose link can carry less than both ends process: ``(a, b) -> link capacity``."""
    pair_cap: dict[tuple[int, int], float] = {}
    for a in range(len(groups)):
        for b in range(len(groups)):
            if a == b and len(groups[a]) < 2:
                continue
            u = groups[a][0]
            v = groups[b][0] if a != b else groups[a][1]
            cap = cost.link_capacity(u, v)
            if cap < min(max_rate[a], max_rate[b]) * (1 - 1e-9):
                pair_cap[(a, b)] = cap
    return pair_cap


def _typed_ranges(
    m: SparseModel,
    cost: CostModel,
    reps: list[str],
    count: list[int],
    sizes: list[list[int]],
    L: int,
    partial: bool,
) -> tuple[dict[tuple[int, int, int], int], dict[tuple[int, int, int, int], int]]:
    """``x[t, s, k]`` (type-``t`` nodes on ``[s, s + k)``) and their flows ``g`` per entry block, bounded
    by ``T_t(k) x`` and by the coordinator's links; at most the type's count of nodes."""
    coord = [cost.link_capacity(COORDINATOR, rep) for rep in reps]
    back = [cost.link_capacity(rep, COORDINATOR) for rep in reps]
    x: dict[tuple[int, int, int], int] = {}
    g: dict[tuple[int, int, int, int], int] = {}
    for t in range(len(reps)):
        for k in sizes[t]:
            rate = cost.throughput(reps[t], k)
            for s in range(0, L - k + 1):
                x[(t, s, k)] = m.var(0, count[t], integer=True)
                entries = range(s, s + k) if partial else [s]
                terms = [(x[(t, s, k)], -rate)]
                for p in entries:
                    gv = m.var(0, count[t] * rate, obj=1.0 if p == 0 else 0.0)
                    g[(t, s, k, p)] = gv
                    terms.append((gv, 1.0))
                    if p == 0 and coord[t] < rate:
                        m.row([(gv, 1.0), (x[(t, s, k)], -coord[t])], -math.inf, 0.0)
                m.row(terms, -math.inf, 0.0)
                if s + k == L and back[t] < rate:
                    m.row(
                        [(g[(t, s, k, p)], 1.0) for p in entries] + [(x[(t, s, k)], -back[t])],
                        -math.inf,
                        0.0,
                    )
        m.row([(x[key], 1.0) for key in x if key[0] == t], -math.inf, count[t])
    return x, g


def _typed_boundaries(
    m: SparseModel,
    x: dict[tuple[int, int, int], int],
    g: dict[tuple[int, int, int, int], int],
    count: list[int],
    pair_cap: dict[tuple[int, int], float],
    L: int,
    partial: bool,
) -> tuple[dict, dict, dict]:
    """Flow conservation at every block boundary: pooled when no link binds, else split per type pair
    (``h``) with the slow-link products ``z``, ``w``."""
    T = len(count)
    exits: dict[tuple[int, int], list[int]] = {}
    entries_at: dict[tuple[int, int], list[int]] = {}
    enders: dict[tuple[int, int], list[int]] = {}
    holders: dict[tuple[int, int], list[int]] = {}
    for (t, s, k, p), gv in g.items():
        exits.setdefault((t, s + k), []).append(gv)
        entries_at.setdefault((t, p), []).append(gv)
    for (t, s, k), xv in x.items():
        enders.setdefault((t, s + k), []).append(xv)
        for b in range(s, s + k) if partial else [s]:
            holders.setdefault((t, b), []).append(xv)
    h: dict[tuple[int, int, int], int] = {}
    z: dict[tuple[int, int], list[int]] = {}
    w: dict[tuple[int, int, int], list[int]] = {}
    for b in range(1, L):
        if not pair_cap:
            terms = [(gv, 1.0) for t in range(T) for gv in exits.get((t, b), [])]
            terms += [(gv, -1.0) for t in range(T) for gv in entries_at.get((t, b), [])]
            m.row(terms, 0.0, 0.0)
            continue
        for a in range(T):
            for c in range(T):
                if a == c and count[a] < 2:
                    continue
                if not exits.get((a, b)) or not entries_at.get((c, b)):
                    continue
                h[(a, c, b)] = m.var(0.0)
        for a in range(T):
            out = [(gv, 1.0) for gv in exits.get((a, b), [])]
            m.row(out + [(h[key], -1.0) for key in h if key[0] == a and key[2] == b], 0.0, 0.0)
        for c in range(T):
            inn = [(gv, 1.0) for gv in entries_at.get((c, b), [])]
            m.row(inn + [(h[key], -1.0) for key in h if key[1] == c and key[2] == b], 0.0, 0.0)
        _slow_link_rows(m, b, h, z, w, count, pair_cap, enders, holders)
    return h, z, w


def _slow_link_rows(m, b, h, z, w, count, pair_cap, enders, holders) -> None:
    """Slow links at boundary ``b``: the X type-a nodes ending at b and the Y type-c nodes taking tokens at
    b are X * Y distinct node pairs (a node cannot both end at b and hold b), one link of capacity C each,
    so h <= C X Y. Exactly, with X = z_1 + ... + z_n (z_m: "at least m senders") and w_m = z_m Y."""
    T = len(count)
    for a in range(T):
        if not any((a, c, b) in h and (a, c) in pair_cap for c in range(T)):
            continue
        zs = [m.var(0, 1, integer=True) for _ in range(count[a])]
        z[(a, b)] = zs
        m.row([(zv, 1.0) for zv in zs] + [(xv, -1.0) for xv in enders[(a, b)]], 0.0, 0.0)
        for z1, z2 in itertools.pairwise(zs):
            m.row([(z1, 1.0), (z2, -1.0)], 0.0, math.inf)
    for (a, c, bb), hv in list(h.items()):
        if bb != b or (a, c) not in pair_cap:
            continue
        ws = []
        for zv in z[(a, b)]:
            wv = m.var(0.0, count[c])
            ws.append(wv)
            m.row([(wv, 1.0)] + [(xv, -1.0) for xv in holders.get((c, b), [])], -math.inf, 0.0)
            m.row([(wv, 1.0), (zv, -float(count[c]))], -math.inf, 0.0)
        w[(a, c, b)] = ws
        m.row([(hv, 1.0)] + [(wv, -pair_cap[(a, c)]) for wv in ws], -math.inf, 0.0)


def _typed_start(
    typed: _Typed, cluster: Cluster, cost: CostModel, placement: Placement, partial: bool
) -> list[float]:
    """Variable values of ``placement`` (and its max flow) in the typed model."""
    values = [0.0] * typed.model.num_vars
    type_of = {n: t for t, members in enumerate(typed.groups) for n in members}
    ev = evaluate(cluster, placement, cost=cost, partial_inference=partial, with_latency=False)
    for n, (s, e) in placement.items():
        key = (type_of[n], s, e - s)
        if key in typed.x:
            values[typed.x[key]] += 1
    for u, targets in ev.flows.items():
        for v, f in targets.items():
            if v == SINK:
                continue
            t = type_of[v]
            s, e = placement[v]
            p = 0 if u == SOURCE else placement[u][1]
            gv = typed.g.get((t, s, e - s, p))
            if gv is not None:
                values[gv] += f
            if u != SOURCE:
                hv = typed.h.get((type_of[u], t, p))
                if hv is not None:
                    values[hv] += f
    for (a, b), zs in typed.z.items():
        senders = sum(1 for n, (s, e) in placement.items() if type_of[n] == a and e == b)
        for i, zv in enumerate(zs):
            values[zv] = 1.0 if i < senders else 0.0
    for (a, c, b), ws in typed.w.items():
        takers = sum(
            1 for n, (s, e) in placement.items() if type_of[n] == c and (s <= b < e if partial else s == b)
        )
        for zv, wv in zip(typed.z[(a, b)], ws, strict=True):
            values[wv] = takers * values[zv]
    if typed.y:
        _floor_start(values, typed.y, replica_counts(placement, cluster.model.num_blocks), typed.floor)
    return values


def _typed_decode(typed: _Typed, cluster: Cluster, cost: CostModel, values: list[float]) -> Placement:
    ranges: dict[str, tuple[int, int]] = {}
    unused: list[str] = []
    for t, members in enumerate(typed.groups):
        intervals = []
        for (tt, s, k), xv in sorted(typed.x.items()):
            if tt != t:
                continue
            intervals += [(s, s + k)] * round(values[xv])
        for i, n in enumerate(members):
            if i < len(intervals):
                ranges[n] = intervals[i]
            else:
                unused.append(n)
    ranges = _complete(cluster, cost, ranges, unused)
    return _ordered(cluster, ranges)


# ---------------------------------------------------------------------------------------------------
# Per-node formulation (Helix Tables 5-6)
# ---------------------------------------------------------------------------------------------------


@dataclass
class _PerNode:
    model: SparseModel
    nodes: list[str]
    start: dict[str, int]
    size: dict[tuple[str, int], int]
    flow: dict[tuple[str, str], int]
    valid: dict[tuple[str, str], int]
    aux: dict[tuple[str, str], tuple[int, int]]
    # the redundancy floor: hold[(n, b)] = 1 only if node n holds block b; y as in the typed model
    floor: Floor | None = None
    hold: dict[tuple[str, int], int] = field(default_factory=dict)
    y: list[int] = field(default_factory=list)


def _kept_links(cluster: Cluster, cost: CostModel, nodes: list[str], degree: int | None) -> set[frozenset]:
    """Helix §4.5 pruning: each node keeps its ``degree`` fastest links (all links tied with the last one
    kept too, so interchangeable nodes keep the same links); a link stays if either end keeps it."""
    kept: set[frozenset] = set()
    for n in nodes:
        others = [m for m in nodes if m != n]
        if degree is None or len(others) <= degree:
            kept.update(frozenset((n, m)) for m in others)
            continue
        caps = sorted((cost.link_capacity(n, m) for m in others), reverse=True)
        threshold = caps[degree - 1]
        kept.update(frozenset((n, m)) for m in others if cost.link_capacity(n, m) >= threshold)
    return kept


def _per_node_model(
    cluster: Cluster,
    cost: CostModel,
    groups: list[list[str]],
    partial: bool,
    degree: int | None,
    floor: Floor | None = None,
) -> _PerNode:
    """Helix Tables 5-6: per node a first layer and a size, per kept connection a flow and a validity
    binary, then conservation and node capacity, and ``s_i <= s_i'`` among interchangeable nodes. With an
    active ``floor``, per node and block a binary ``hold`` that may be 1 only where the node holds the
    block (``s_i <= b`` and ``e_i >= b + 1``, big-M), and the floor over the ``hold`` sums
    (:func:`_floor_rows`)."""
    L = cluster.model.num_blocks
    m = SparseModel()
    nodes = [n for n in cluster.node_ids if cost.feasible_sizes(n)]
    start: dict[str, int] = {}
    size: dict[tuple[str, int], int] = {}
    max_rate: dict[str, float] = {}
    for n in nodes:
        start[n] = m.var(0, L - 1, integer=True)
        sizes = [k for k in cost.feasible_sizes(n) if k <= L]
        for k in sizes:
            size[(n, k)] = m.var(0, 1, integer=True)
        m.row([(size[(n, k)], 1.0) for k in sizes], 1.0, 1.0)  # constraint-1: one size
        m.row([(start[n], 1.0)] + [(size[(n, k)], float(k)) for k in sizes], -math.inf, L)  # e_i <= L
        max_rate[n] = max(cost.throughput(n, k) for k in sizes)
    sizes_of: dict[str, list[tuple[int, int]]] = {n: [] for n in nodes}
    for (n, k), v in size.items():
        sizes_of[n].append((k, v))
    kept = _kept_links(cluster, cost, nodes, degree)
    edges: list[tuple[str, str]] = [(SOURCE, n) for n in nodes] + [(n, SINK) for n in nodes]
    edges += [(a, b) for a in nodes for b in nodes if a != b and frozenset((a, b)) in kept]
    flow, valid, aux = _per_node_connections(m, cost, edges, start, sizes_of, max_rate, L, partial)
    _per_node_conservation(m, cost, nodes, flow, sizes_of)
    # symmetry breaking among interchangeable nodes: s_i <= s_i'
    for members in groups:
        members = [n for n in members if n in start]
        for a, b in itertools.pairwise(members):
            m.row([(start[a], 1.0), (start[b], -1.0)], -math.inf, 0.0)
    hold: dict[tuple[str, int], int] = {}
    y: list[int] = []
    if floor is not None and floor.active:
        holders: list[list[tuple[int, float]]] = [[] for _ in range(L)]
        for n in nodes:
            for block in range(L):
                hv = m.var(0, 1, integer=True)
                hold[(n, block)] = hv
                holders[block].append((hv, 1.0))
                m.row([(start[n], 1.0), (hv, float(L))], -math.inf, float(L + block))  # s_n <= b + L (1 - h)
                ends = [(start[n], 1.0)] + [(v, float(k)) for k, v in sizes_of[n]]
                m.row([*ends, (hv, -(block + 1.0))], 0.0, math.inf)  # e_n >= (b + 1) h
        y = _floor_rows(m, holders, floor)
    return _PerNode(
        model=m, nodes=nodes, start=start, size=size, flow=flow, valid=valid, aux=aux, floor=floor, hold=hold, y=y
    )


def _per_node_connections(
    m: SparseModel,
    cost: CostModel,
    edges: list[tuple[str, str]],
    start: dict[str, int],
    sizes_of: dict[str, list[tuple[int, int]]],
    max_rate: dict[str, float],
    L: int,
    partial: bool,
) -> tuple[dict, dict, dict]:
    """Per connection a flow ``f <= d C`` and the big-M rules of Helix §4.4 that make ``d`` valid only
    where the connection may carry tokens (with partial inference through ``aux1``, ``aux2``)."""

    def end_terms(n: str, sign: float) -> list[tuple[int, float]]:
        return [(start[n], sign)] + [(v, sign * k) for k, v in sizes_of[n]]

    flow: dict[tuple[str, str], int] = {}
    valid: dict[tuple[str, str], int] = {}
    aux: dict[tuple[str, str], tuple[int, int]] = {}
    big = float(L)
    for a, b in edges:
        if a == SOURCE:
            cap = min(cost.link_capacity(COORDINATOR, b), max_rate[b])
        elif b == SINK:
            cap = min(cost.link_capacity(a, COORDINATOR), max_rate[a])
        else:
            cap = min(cost.link_capacity(a, b), max_rate[a], max_rate[b])
        f = m.var(0.0, cap, obj=1.0 if a == SOURCE else 0.0)
        d = m.var(0, 1, integer=True)
        flow[(a, b)] = f
        valid[(a, b)] = d
        m.row([(f, 1.0), (d, -cap)], -math.inf, 0.0)  # constraint-5: f <= d C
        if a == SOURCE:
            m.row([(start[b], 1.0), (d, big)], -math.inf, big)  # s_j <= L (1 - d)
        elif b == SINK:
            m.row([(d, big), *end_terms(a, -1.0)], -math.inf, 0.0)  # L d <= e_i
        elif not partial:
            # L d <= L + e_a - s_b  and  L d <= L - e_a + s_b
            m.row([(d, big), *end_terms(a, -1.0), (start[b], 1.0)], -math.inf, big)
            m.row([(d, big), *end_terms(a, 1.0), (start[b], -1.0)], -math.inf, big)
        else:
            a1 = m.var(0, 1, integer=True)
            a2 = m.var(0, 1, integer=True)
            aux[(a, b)] = (a1, a2)
            # (L + 1)(1 - aux1) >= s_b - e_a
            m.row([(start[b], 1.0), (a1, big + 1), *end_terms(a, -1.0)], -math.inf, big + 1)
            # e_b - e_a >= 1 - (L + 1)(1 - aux2)
            m.row(end_terms(b, 1.0) + end_terms(a, -1.0) + [(a2, -(big + 1))], -big, math.inf)
            # d <= 0.5 aux1 + 0.5 aux2
            m.row([(d, 1.0), (a1, -0.5), (a2, -0.5)], -math.inf, 0.0)
    return flow, valid, aux


def _per_node_conservation(
    m: SparseModel,
    cost: CostModel,
    nodes: list[str],
    flow: dict[tuple[str, str], int],
    sizes_of: dict[str, list[tuple[int, int]]],
) -> None:
    """Constraint-2 (flow in = flow out at every node) and constraint-3 (``sum_in f <= sum_k b_k T_k``)."""
    into: dict[str, list[int]] = {n: [] for n in nodes}
    out_of: dict[str, list[int]] = {n: [] for n in nodes}
    for (a, b), f in flow.items():
        if b != SINK:
            into[b].append(f)
        if a != SOURCE:
            out_of[a].append(f)
    for n in nodes:
        inflow = [(f, 1.0) for f in into[n]]
        outflow = [(f, -1.0) for f in out_of[n]]
        m.row(inflow + outflow, 0.0, 0.0)  # constraint-2: conservation
        rates = [(v, -cost.throughput(n, k)) for k, v in sizes_of[n]]
        m.row(inflow + rates, -math.inf, 0.0)  # constraint-3: sum_in f <= sum_k b_k T_k


def _per_node_start(
    pn: _PerNode,
    cluster: Cluster,
    cost: CostModel,
    placement: Placement,
    groups: list[list[str]],
    partial: bool,
) -> tuple[list[float], Placement]:
    """Variable values of ``placement`` in the per-node model. Interchangeable nodes are first reordered
    so that their starts are sorted (the symmetry-breaking constraints), and links the model pruned carry
    no flow (the max flow is recomputed without them)."""
    L = cluster.model.num_blocks
    ranges = dict(placement.items())
    # nodes the placement leaves idle hold their smallest size at block 0, so that sum_k b_k = 1 holds
    for n in pn.nodes:
        if n not in ranges:
            k = min(cost.feasible_sizes(n))
            ranges[n] = (0, k)
    # interchangeable nodes swap ranges so that their starts are sorted (symmetry breaking)
    for members in groups:
        members = [n for n in members if n in pn.start]
        held = sorted((ranges[n] for n in members), key=lambda r: (r[0], r[1]))
        for n, r in zip(members, held, strict=True):
            ranges[n] = r
    placement = _ordered(cluster, ranges)
    values = [0.0] * pn.model.num_vars
    for n in pn.nodes:
        s, e = ranges[n]
        values[pn.start[n]] = s
        values[pn.size[(n, e - s)]] = 1.0
    for (n, block), hv in pn.hold.items():
        values[hv] = 1.0 if ranges[n][0] <= block < ranges[n][1] else 0.0
    if pn.y:
        counts = replica_counts({n: ranges[n] for n in pn.nodes}, L)
        _floor_start(values, pn.y, counts, pn.floor)
    for (a, b), d in pn.valid.items():
        if a == SOURCE:
            ok = ranges[b][0] == 0
        elif b == SINK:
            ok = ranges[a][1] == L
        elif partial:
            ok = ranges[b][0] <= ranges[a][1] < ranges[b][1]
        else:
            ok = ranges[b][0] == ranges[a][1]
        values[d] = 1.0 if ok else 0.0
        if (a, b) in pn.aux:
            a1, a2 = pn.aux[(a, b)]
            values[a1] = 1.0 if ranges[b][0] <= ranges[a][1] else 0.0
            values[a2] = 1.0 if ranges[a][1] < ranges[b][1] else 0.0
    # max flow restricted to the model's edges
    graph = nx.DiGraph()
    for (a, b), fv in pn.flow.items():
        if values[pn.valid[(a, b)]] < 0.5:
            continue
        u = a if a == SOURCE else (a, "out")
        v = b if b == SINK else (b, "in")
        graph.add_edge(u, v, capacity=pn.model.upper[fv])
    for n in pn.nodes:
        s, e = ranges[n]
        graph.add_edge((n, "in"), (n, "out"), capacity=cost.throughput(n, e - s))
    if graph.has_node(SOURCE) and graph.has_node(SINK):
        _, flows = nx.maximum_flow(graph, SOURCE, SINK, flow_func=preflow_push)
        for (a, b), fv in pn.flow.items():
            u = a if a == SOURCE else (a, "out")
            v = b if b == SINK else (b, "in")
            if u in flows and v in flows[u]:
                values[fv] = max(0.0, flows[u][v] * (1 - 1e-9))
    return values, placement


def _per_node_decode(pn: _PerNode, cluster: Cluster, values: list[float]) -> Placement:
    ranges = {}
    for n in pn.nodes:
        s = round(values[pn.start[n]])
        k = max((kk for (nn, kk), v in pn.size.items() if nn == n and values[v] > 0.5), default=0)
        if k > 0:
            ranges[n] = (s, s + k)
    return _ordered(cluster, ranges)



def _floor_cover(
    cost: CostModel,
    groups: list[list[str]],
    L: int,
    floor: Floor,
    start: Mapping[str, tuple[int, int]],
    *,
    time_limit: float,
    stop_at: float,
    on_improve: Callable[[float, float], None] | None,
    mip_rel_gap: float,
    seed: int,
) -> tuple[dict[str, tuple[int, int]] | None, float | None, SparseModel, SolveOutcome]:
    """The covering MILP (:mod:`planner.search.coverage`: ``max F``, ``F <= sum T_t(k) x[t, s, k]`` over the
    ranges holding each block, at most ``n_t`` nodes of type ``t``) with the redundancy floor's rows
    (:func:`_floor_rows`), warm-started from ``start``. Exact where links never bind, so its dual bound
    is a proven bound under the floor. Returns the placement found (None if none), the bound, the model
    and the solver's outcome."""
    model = SparseModel()
    sizes = [[k for k in cost.feasible_sizes(g[0]) if k <= L] for g in groups]
    area = sum(len(g) * max(k * cost.throughput(g[0], k) for k in ks) for g, ks in zip(groups, sizes, strict=True))
    f = model.var(0.0, area / L, obj=1.0)
    terms: list[list[tuple[int, float]]] = [[] for _ in range(L)]
    x: dict[tuple[int, int, int], int] = {}
    for t, members in enumerate(groups):
        keys = []
        for k in sizes[t]:
            rate = cost.throughput(members[0], k)
            for s in range(L - k + 1):
                v = model.var(0, len(members), integer=True)
                x[(t, s, k)] = v
                keys.append(v)
                for b in range(s, s + k):
                    terms[b].append((v, -rate))
        model.row([(v, 1.0) for v in keys], -math.inf, len(members))
    for b in range(L):
        model.row([(f, 1.0), *terms[b]], -math.inf, 0.0)
    y = _floor_rows(model, _block_holders(x, L), floor)
    values = [0.0] * model.num_vars
    type_of = {n: t for t, members in enumerate(groups) for n in members}
    for n, (s, e) in start.items():
        if n in type_of and (type_of[n], s, e - s) in x:
            values[x[(type_of[n], s, e - s)]] += 1
    values[f] = min(coverage_profile(cost, start, L))
    _floor_start(values, y, replica_counts(start, L), floor)
    outcome = model.solve(
        time_limit=time_limit,
        start=values,
        stop_at=stop_at,
        on_improve=on_improve,
        mip_rel_gap=mip_rel_gap,
        seed=seed,
    )
    if outcome.values is None:
        return None, outcome.bound, model, outcome
    ranges: dict[str, tuple[int, int]] = {}
    for t, members in enumerate(groups):
        intervals = [(s, s + k) for (tt, s, k), v in sorted(x.items()) if tt == t for _ in range(round(outcome.values[v]))]
        for n, r in zip(members, intervals, strict=False):
            ranges[n] = r
    return ranges, outcome.bound, model, outcome
