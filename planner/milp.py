"""Helix's MILP placement (ASPLOS 2025, §4.4, Tables 5-6), solved with HiGHS.

The problem: choose each node's contiguous block range so that the max flow of Helix's flow graph
(:mod:`planner.flow_graph`) is largest. Three formulations are built here:

``per-node`` — Helix Tables 5-6 as written: per node ``c_i`` an integer first layer ``s_i`` and binaries
``b_i^k`` (holds ``k`` layers; ``sum_k b_i^k = 1``; ``e_i = s_i + sum_k k b_i^k <= L``); per connection a
flow ``f_ij`` and a validity binary ``d_ij`` (with partial inference also the auxiliaries ``aux1``,
``aux2``); flow conservation; node capacity ``sum_in f <= sum_k b_i^k T_ik``; link capacity
``f_ij <= d_ij C_ij``; the big-M validity constraints of §4.4 (source ``s_j <= L (1 - d)``, sink
``L d <= e_i``; without partial inference ``L d <= L + e_i - s_j`` and ``L d <= L - e_i + s_j``; with it
``s_j <= e_i < e_j`` through the auxiliaries). §4.5's speed-ups: link pruning (each node keeps its
``link_degree`` fastest links, ties kept) and a warm start from the best heuristic. Interchangeable nodes
(same hardware, same coordinator link, same link to every other node) get ``s_i <= s_i'``, which removes
their symmetric copies without losing any placement.

``typed`` — the same flows aggregated over node types: an integer ``x[t, s, k]`` counts the type-``t``
nodes on ``[s, s + k)``, a continuous ``g`` carries their flow (``g <= T_t(k) x``; with partial inference
one ``g`` per entry block), and flow is conserved at every block boundary. Between types whose links can
bind, the flow across boundary ``b`` is split per type pair and bounded by ``C X Y``: the ``X`` type-``a``
nodes ending at ``b`` and the ``Y`` type-``c`` nodes taking tokens at ``b`` are ``X Y`` distinct node
pairs, one link of capacity ``C`` each (Helix §4.3). The product is exact: ``X = z_1 + ... + z_n`` with
binaries ``z_m`` ("at least ``m`` senders"), ``w_m = z_m Y`` by ``w_m <= Y`` and ``w_m <= n_c z_m``. The
model is still a relaxation (flows of one type are pooled, so one node may carry another's share), so its
dual bound is a valid, network-aware upper bound; its placements are scored exactly.

``coverage`` — with partial inference and links that never bind, the max flow equals the minimum block
coverage (:mod:`planner.coverage`), so the MILP becomes a covering problem over node types, solved after
a beam search and a large-neighbourhood search have found a strong incumbent.

``formulation="auto"`` picks ``coverage`` when it is exact. Otherwise it scores the heuristics; when slow
links separate regions (:func:`planner.flow_beam.link_regions`) it places each region alone with the exact
coverage search (links inside a region never bind; up to 65% of the time, 30% below 50 nodes) and scores the union of the
regions' placements, else it scores the coverage beam's placement; it proves the coverage bound (:mod:`planner.bounds`, links ignored; 10% of the
time), runs the flow beam (:mod:`planner.flow_beam`: placements built together with a feasible flow, over
orders of the regions that slow links separate; up to 70%), and spends the rest improving the best
placement with the ``typed`` model (nodes repeat; as a relaxation only up to
:data:`TYPED_RELAXATION_VARS` variables) and the ``per-node`` model. Every search stops early
once the best placement is within ``gap`` of the lowest proven upper bound — Helix's
``sum_i max_j (j T_ij) / L`` (§4.5), the coordinator cut, the coverage bound or a MILP dual bound
(:mod:`planner.bounds`) — or at the time limit. Solutions map back to concrete nodes type by type;
nodes left unused are placed as Petals would (window of least throughput), which can only add flow.
Every candidate is scored by :func:`planner.flow_graph.evaluate`, and the heuristics are candidates too,
so the result is never worse than the best heuristic.

Sizes (Helix Table 8). :func:`per_node_size` builds the per-node model as Tables 5-6 write it (no
symmetry-breaking rows) and counts its columns and rows; without partial inference, over the complete
graph of ``helix-single-24``, that is Table 8's 1376 variables and 1848 constraints (Helix's own run, whose
Gurobi log ``artifact_evaluation/model_placement/layout_single/ilp/trace.txt`` reads "1848 rows, 1376
columns", set ``allow_partial_inference = False``), and 4004 / 5502 for ``helix-hetero-42``.
:func:`model_size` reports that size unpruned and after link pruning, with the size of every model each
phase of a search actually solved (its ``phases`` carry ``models``, ``columns`` and ``rows``).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import preflow_push

from .bounds import coordinator_bound, coverage_bound
from .cluster import COORDINATOR, Cluster
from .cost_model import CostModel
from .cost_models import make_cost_model
from .coverage import _lns_key, _lns_neighbourhood, _lns_step, beam_coverage, coverage_profile, solve_coverage
from .errors import CannotPlaceError, PlannerError
from .flow_beam import link_regions, search_flows
from .flow_graph import SINK, SOURCE, evaluate
from .milp_model import ModelSize, SparseModel, recording
from .placement import Placement, PlacementError
from .redundancy import (
    Floor,
    achievable_floor,
    check_min_replicas,
    floor_layout,
    repair_floor,
    replica_counts,
)

__all__ = [
    "DEFAULT_LINK_DEGREE",
    "FORMULATIONS",
    "MilpResult",
    "Progress",
    "coverage_is_exact",
    "interchangeable_groups",
    "milp",
    "model_size",
    "per_node_size",
]

FORMULATIONS = ("auto", "coverage", "typed", "per-node")

#: Links each node keeps in the per-node model (Helix §4.5 pruning; Helix's runs keep 12).
DEFAULT_LINK_DEGREE = 12

#: The typed relaxation (slow links) runs under ``auto`` only up to this many variables: larger, HiGHS
#: does not finish its root LP within a minute on two cores (``helix-geo-24``: 24k variables), and the
#: LP bound equals Helix's anyway (fractional nodes spread over many boundaries get link pairs for free).
TYPED_RELAXATION_VARS = 10_000


@dataclass(frozen=True)
class Progress:
    """A report while the MILP runs: ``phase`` (``heuristics``, ``beam``, ``lns``, ``coverage``,
    ``flow beam``, ``bound``, ``typed``, ``per-node``, ``done``), seconds since the start, the best max
    flow so far and the best proven upper bound (tokens/s)."""

    phase: str
    elapsed: float
    best: float
    bound: float
    message: str = ""


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class MilpResult:
    """``upper_bound`` is the lowest proven bound of ``bounds`` (named: ``helix``, ``coordinator``,
    ``coverage``, ``solver``; :mod:`planner.bounds`), ``bound_name`` its name, ``gap`` is
    ``1 - throughput / upper_bound``; ``helix_bound`` is §4.5's bound alone, ``solver_bound`` the best
    MILP dual bound (None if none). ``floor`` is the redundancy floor the placement meets
    (:class:`planner.redundancy.Floor`: ``min_replicas`` and how many blocks the offers let reach it)."""

    placement: Placement
    throughput: float
    upper_bound: float
    helix_bound: float
    solver_bound: float | None
    gap: float
    solve_seconds: float
    formulation: str
    status: str
    start_algorithm: str
    phases: tuple[dict, ...] = field(default_factory=tuple)
    bounds: dict[str, float] = field(default_factory=dict)
    bound_name: str = "helix"
    floor: Floor | None = None


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
    """The typed formulation (module docstring): range variables per type, then flow conservation per
    block boundary, with the exact slow-link products where links between types can bind; with an active
    ``floor``, each block held by enough nodes (:func:`_floor_rows`)."""
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
    """The redundancy floor (:mod:`planner.redundancy`) over per-block holder terms: every block held
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
            for b in range(L):
                hv = m.var(0, 1, integer=True)
                hold[(n, b)] = hv
                holders[b].append((hv, 1.0))
                m.row([(start[n], 1.0), (hv, float(L))], -math.inf, float(L + b))  # s_n <= b + L (1 - h)
                ends = [(start[n], 1.0)] + [(v, float(k)) for k, v in sizes_of[n]]
                m.row([*ends, (hv, -(b + 1.0))], 0.0, math.inf)  # e_n >= (b + 1) h
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
    for (n, b), hv in pn.hold.items():
        values[hv] = 1.0 if ranges[n][0] <= b < ranges[n][1] else 0.0
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


# ---------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------


def coverage_is_exact(cluster: Cluster, cost: CostModel, partial_inference: bool = True) -> bool:
    """True when the max flow of every placement equals its minimum block coverage: partial inference is
    allowed and no link can carry less than the nodes at its ends can process."""
    if not partial_inference:
        return False
    rate = {
        n: max((cost.throughput(n, k) for k in cost.feasible_sizes(n)), default=0.0) for n in cluster.node_ids
    }
    ids = [n for n in cluster.node_ids if rate[n] > 0]
    for i, a in enumerate(ids):
        if min(cost.link_capacity(COORDINATOR, a), cost.link_capacity(a, COORDINATOR)) < rate[a]:
            return False
        for b in ids[i + 1 :]:
            if min(cost.link_capacity(a, b), cost.link_capacity(b, a)) < min(rate[a], rate[b]):
                return False
    return True


def _heuristic_starts(cluster: Cluster, cost: CostModel, min_replicas: int = 1) -> dict[str, Placement]:
    from .ahp import ahp
    from .gma import gma
    from .petals import petals
    from .swarm import swarm

    floor = {"min_replicas": min_replicas} if min_replicas > 1 else {}
    starts = {}
    for name, fn in (
        ("petals", lambda: petals(cluster, cost=cost, **floor)),
        ("swarm", lambda: swarm(cluster, cost=cost, **floor)),
        ("gma", lambda: gma(cluster)),
        ("ahp", lambda: ahp(cluster, cost=cost)),
    ):
        try:
            starts[name] = fn()
        except PlannerError:  # PlacementError, AHPError: the heuristic does not apply to this cluster
            continue
    return starts


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
) -> tuple[dict[str, tuple[int, int]] | None, float | None, SparseModel, object]:
    """The covering MILP (:mod:`planner.coverage`: ``max F``, ``F <= sum T_t(k) x[t, s, k]`` over the
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


# ---------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------


class _Search:
    """One :func:`milp` run: the best placement so far, the proven upper bounds, the phases run and the
    clock, with one method per phase of the search (module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        cost: CostModel,
        *,
        t0: float,
        time_limit: float,
        gap: float,
        mip_rel_gap: float,
        partial_inference: bool,
        link_degree: int | None,
        progress: ProgressCallback | None,
        seed: int,
        floor: Floor | None = None,
    ) -> None:
        self.cluster = cluster
        self.cost = cost
        self.floor_used = floor
        self.floor = floor if floor is not None and floor.active else None
        self.capacities = {
            n: min(max(cost.feasible_sizes(n)), cluster.model.num_blocks)
            for n in cluster.node_ids
            if cost.feasible_sizes(n)
        }
        self.floor_repairs = 0
        self.floor_rejects = 0
        self.t0 = t0
        self.deadline = t0 + time_limit
        self.gap = gap
        self.mip_rel_gap = mip_rel_gap
        self.partial = partial_inference
        self.link_degree = link_degree
        self.progress = progress
        self.seed = seed
        self.num_blocks = cluster.model.num_blocks
        self.helix = cost.upper_bound()
        self.groups = interchangeable_groups(cluster, cost)
        self.bounds: dict[str, float] = {"helix": self.helix, "coordinator": coordinator_bound(cluster, cost)}
        self.bound = min(self.bounds.values())
        self.solver_bound: float | None = None
        self.best: Placement | None = None
        self.best_value = -1.0
        self.best_name = ""
        self.start_name = ""
        self.phases: list[dict] = []
        self.used: list[str] = []
        self.status = "heuristics only"
        self.eval_seconds = 0.0

    # --- bookkeeping ---------------------------------------------------------------------------------

    def score(self, placement: Mapping[str, tuple[int, int]]) -> float:
        t1 = time.monotonic()
        value = evaluate(
            self.cluster, placement, cost=self.cost, partial_inference=self.partial, with_latency=False
        ).throughput
        self.eval_seconds = max(self.eval_seconds, time.monotonic() - t1)
        return value

    def margin(self) -> float:
        """Seconds a phase leaves before the deadline: scoring its last placements (two max flows, at
        the slowest seen) takes that long after the phase stops, and the time limit must hold."""
        return 0.05 + 2 * self.eval_seconds

    def report(self, phase: str, message: str = "") -> None:
        if self.progress is not None:
            elapsed = time.monotonic() - self.t0
            self.progress(Progress(phase, elapsed, max(self.best_value, 0.0), self.bound, message))

    def consider(self, name: str, placement: Placement, phase: str) -> None:
        """Keep ``placement`` if its exact max flow beats the best so far. Under a redundancy floor a
        placement below it is first repaired (:func:`planner.redundancy.repair_floor`, moves of whole
        nodes) and dropped when the repair falls short."""
        if self.floor is not None and not self.floor.met_by(placement):
            ranges, _ = repair_floor(placement, self.capacities, self.floor, all_sizes=False, rates=self.cost.table)
            if not self.floor.met_by(ranges):
                self.floor_rejects += 1
                return
            self.floor_repairs += 1
            placement = _ordered(self.cluster, ranges)
        value = self.score(placement)
        if value > self.best_value * (1 + 1e-9) + 1e-12:
            self.best, self.best_value, self.best_name = placement, value, name
            self.report(phase, f"{name}: {value:.1f} tokens/s")

    def prove(self, bound: float | None, name: str = "solver") -> None:
        """Record a proven upper bound on the max flow."""
        if bound is not None and math.isfinite(bound):
            self.bounds[name] = min(self.bounds.get(name, math.inf), bound)
            if name == "solver":
                self.solver_bound = self.bounds[name]
            self.bound = min(self.bound, bound)

    def good_enough(self) -> bool:
        return self.best_value >= (1 - max(self.gap, self.mip_rel_gap)) * self.bound - 1e-9

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def stop_at(self) -> float:
        """The flow at which a solver may stop: within ``gap`` of the best bound."""
        return (1 - self.gap) * self.bound

    def completed(self, ranges: Mapping[str, tuple[int, int]]) -> Placement:
        """``ranges`` with the nodes it leaves out placed as Petals would."""
        unused = [n for n in self.cluster.node_ids if n not in ranges]
        return _ordered(self.cluster, _complete(self.cluster, self.cost, dict(ranges), unused))

    def as_given(self, ranges: Mapping[str, tuple[int, int]]) -> Placement:
        """``ranges`` as a placement in the cluster's node order (coverage solutions place every node
        they use; the others stay idle)."""
        return _ordered(self.cluster, ranges)

    # --- phases --------------------------------------------------------------------------------------

    def start_from_heuristics(self, warm_start: Placement | None) -> None:
        """Score the heuristics (and ``warm_start``): the incumbent every later phase must beat."""
        replicas = self.floor.min_replicas if self.floor is not None else 1
        candidates = _heuristic_starts(self.cluster, self.cost, replicas)
        if warm_start is not None:
            candidates = {"given": warm_start, **candidates}
        if self.floor is not None:  # a placement meeting the floor exists: start from one
            layout = floor_layout(self.capacities, self.num_blocks, self.floor.min_replicas)
            candidates["floor layout"] = self.completed(layout)
            regions = {n: self.cluster.node(n).region for n in self.cluster.node_ids}
            by_region = floor_layout(self.capacities, self.num_blocks, self.floor.min_replicas, regions)
            candidates["floor layout by region"] = self.completed(by_region)
        for name, placement in candidates.items():
            self.consider(name, placement, "heuristics")
        if self.best is None:
            raise PlacementError("no heuristic found a placement to start the MILP from")
        self.start_name = self.best_name
        self.report("heuristics", f"best heuristic: {self.start_name}")

    def coverage_search(self) -> None:
        """The exact-coverage path: beam search, a short covering MILP for a proven bound, wider beams,
        then LNS and the covering MILP from the best placement until the time runs out. Under a
        redundancy floor: beams (their placements repaired to the floor), then the covering MILP with the
        floor's rows (:meth:`floor_cover`) for the time left."""
        total = self.remaining()
        if self.floor is not None:
            self.coverage_beam(16, 0.1, total)
            self.coverage_beam(64, 0.1, total)
            self.floor_lns(0.4, total)
            self.floor_cover(total)
            return
        self.coverage_beam(16, 0.1, total)
        self.cover(0.1, 0.0, total)  # a short covering MILP: a proven bound, maybe a better placement
        for width in (64, 256, 1024):
            self.coverage_beam(width, 0.5, total)
            if self.remaining() < 0.5 * total:
                break
        self.cover(1.0, 0.3, total)
        self.status = next(
            (p["status"] for p in reversed(self.phases) if "status" in p), "heuristics and beam search"
        )

    def coverage_beam(self, width: int, share: float, total: float) -> None:
        """A coverage beam of ``width`` for ``share`` of the ``total`` time."""
        if self.good_enough() or self.remaining() <= 0.1:
            return
        t1 = time.monotonic()
        found, _value = beam_coverage(
            self.cost,
            self.groups,
            self.num_blocks,
            low=max(self.best_value, 0.0),
            high=self.bound,
            time_limit=max(0.1, min(share * total, self.remaining() - self.margin())),
            width=width,
        )
        if found is not None:
            self.consider(f"beam {width}", self.as_given(found), "beam")
        self.phases.append(
            {"formulation": f"beam {width}", "seconds": time.monotonic() - t1, "best": self.best_value}
        )
        if "beam" not in self.used:
            self.used.append("beam")

    def cover(self, share: float, lns_share: float, total: float) -> None:
        """LNS and the covering MILP (:func:`planner.coverage.solve_coverage`) from the best placement, for
        ``share`` of the ``total`` time."""
        phase = "coverage"
        if self.good_enough() or self.remaining() <= 0.2:
            return
        t1 = time.monotonic()
        with recording() as solved:
            result = solve_coverage(
                self.cost,
                self.groups,
                self.num_blocks,
                dict(self.best.items()),
                time_limit=max(0.2, min(share * total, self.remaining() - self.margin())),
                stop_at=self.stop_at(),
                lns_share=lns_share,
                mip_rel_gap=max(self.gap, self.mip_rel_gap),  # exact model: HiGHS' own gap is the early stop
                seed=self.seed,
                on_improve=lambda v, b: self.report(phase, f"incumbent {v:.1f}"),
            )
        self.consider(phase, self.as_given(result.ranges), phase)
        self.prove(result.bound)
        self.phases.append(
            {
                "formulation": phase,
                "status": result.status,
                "objective": result.value,
                "bound": result.bound,
                "lns_seconds": result.lns_seconds,
                "lns_iterations": result.lns_iterations,
                "milp_seconds": result.milp_seconds,
                "seconds": time.monotonic() - t1,
                **_solved_sizes(solved),
            }
        )
        if phase not in self.used:
            self.used.append(phase)

    def network_search(self) -> None:
        """Links may bind. When slow links separate regions, each region alone first (:meth:`region_share`);
        else a coverage beam with links ignored. Then the coverage bound (links ignored) and the flow
        beam."""
        total = self.remaining()
        regions = link_regions(self.cost, self.groups) if self.partial else []
        if len(regions) > 1:
            self.regions_alone(regions, total)
        else:
            self.coverage_beam_ignoring_links(total)
        if not self.good_enough() and self.remaining() > 0.2:
            self.coverage_bound(total)
        if not self.good_enough() and self.remaining() > 0.2:
            self.flow_beam(total)

    def region_groups(self, regions: list[set[str]]) -> tuple[list[list[str]], list[int]]:
        """The interchangeable groups split by region (a group's nodes share every link, so they share a
        region unless links inside and between regions are equal), with each one's region index."""
        groups: list[list[str]] = []
        region_of: list[int] = []
        for members in self.groups:
            for r, region in enumerate(regions):
                inside = [n for n in members if n in region]
                if inside:
                    groups.append(inside)
                    region_of.append(r)
        return groups, region_of

    def region_share(self) -> float:
        """The share of the time the regions alone get: 65% from 50 nodes up, where the flow beam found
        nothing better than their union in 84 s (100 nodes); 30% below, where the flow beam needs its time
        (on helix-geo-24 it reaches 1424.6 tokens/s in about 35 s, pipelines crossing regions, which no
        region alone has)."""
        return 0.65 if len(self.cost.cluster.nodes) >= 50 else 0.3

    def regions_alone(self, regions: list[set[str]], total: float) -> None:
        """Each region on its own, for up to :meth:`region_share` of the time shared by the regions'
        sizes. Links inside a region never bind, so there the max flow is the minimum block coverage and the coverage search
        is exact: per region a coverage beam (widths 16 and 64), then LNS and the covering MILP from the
        best. The union of the regions' placements (pipelines that never cross a slow link; the exact
        max flow adds whatever the slow links carry between them) is a candidate."""
        t1 = time.monotonic()
        budget = max(0.2, min(self.region_share() * total, self.remaining()))
        groups, region_of = self.region_groups(regions)
        ranges: dict[str, tuple[int, int]] = {}
        values: list[float] = []
        bounds: list[float | None] = []
        size = sum(len(region) for region in regions)
        with recording() as solved:
            for r, region in enumerate(regions):
                if self.remaining() <= 0.2:
                    break
                t2 = time.monotonic()
                share = min(budget * len(region) / size, self.remaining() - self.margin())
                sub = [g for g, rr in zip(groups, region_of, strict=True) if rr == r]
                found, value, bound = self.region_alone(sub, share, t2)
                ranges.update(found)
                values.append(value)
                bounds.append(bound)
        self.consider("regions alone", self.completed(ranges), "regions")
        self.phases.append(
            {
                "formulation": "regions alone",
                "regions": len(regions),
                "coverage": values,
                "region_bounds": bounds,
                "seconds": time.monotonic() - t1,
                "best": self.best_value,
                **_solved_sizes(solved),
            }
        )
        self.used.append("regions")

    def region_alone(
        self, groups: list[list[str]], share: float, t0: float
    ) -> tuple[dict[str, tuple[int, int]], float, float | None]:
        """One region's best coverage placement within ``share`` seconds from ``t0``: beams of width 16
        and 64 (each up to 15% of the share, bisecting up to the region's own Helix bound), then LNS and
        the covering MILP from the best (:func:`planner.coverage.solve_coverage`). Returns the placement,
        its minimum coverage and the covering MILP's bound on it (None when it did not run)."""
        L = self.num_blocks
        area = sum(
            len(g) * max(k * self.cost.throughput(g[0], k) for k in self.cost.feasible_sizes(g[0]))
            for g in groups
        )
        members = {n for g in groups for n in g}
        best = {n: rg for n, rg in self.best.items() if n in members}
        best_value = min(coverage_profile(self.cost, best, L)) if best else 0.0
        for width in (16, 64):
            left = share - (time.monotonic() - t0)
            found, value = beam_coverage(
                self.cost,
                groups,
                L,
                low=best_value,
                high=area / L,
                time_limit=max(0.05, min(0.15 * share, left)),
                width=width,
            )
            if found is not None and value > best_value:
                best, best_value = found, value
        left = share - (time.monotonic() - t0)
        if left <= 0.2:
            return best, best_value, None
        result = solve_coverage(
            self.cost,
            groups,
            L,
            best,
            time_limit=left,
            lns_share=0.5,
            mip_rel_gap=max(self.mip_rel_gap, 0.01),
            seed=self.seed,
        )
        return result.ranges, result.value, result.bound

    def floor_lns(self, share: float, total: float) -> None:
        """The large-neighbourhood search of :mod:`planner.coverage` under the redundancy floor
        (:func:`_floor_lns_step`) from the best placement for ``share`` of the ``total`` time: windows around
        the bottleneck re-placed exactly, every block keeping ``min_replicas`` holders where it has them
        (one elsewhere), so every step meets the floor."""
        if self.good_enough() or self.remaining() <= 0.5:
            return
        t1 = time.monotonic()
        budget = max(0.2, min(share * total, self.remaining() - self.margin()))
        rng = random.Random(self.seed)
        L = self.num_blocks
        ranges = dict(self.best.items())
        cov = coverage_profile(self.cost, ranges, L)
        widths = sorted({min(L, w) for w in (8, 12, 16, 24, 32, 48)})
        iterations = 0
        while time.monotonic() - t1 < budget and min(cov) < self.stop_at():
            iterations += 1
            lo, hi, free = _lns_neighbourhood(self.cost, ranges, cov, L, widths, rng)
            if not free:
                continue
            r = self.floor.min_replicas
            targets = [r if c >= r else 1 for c in replica_counts(ranges, L)]
            near = min(cov) * 1.02
            step = min(2.0, max(0.2, budget - (time.monotonic() - t1)))
            new = _lns_step(self.cost, self.groups, ranges, free, lo, hi, L, near, step, targets)
            if new is None:
                continue
            new_cov = coverage_profile(self.cost, new, L)
            if _lns_key(new_cov, near) > _lns_key(cov, near):
                ranges, cov = new, new_cov
        self.consider("floor lns", self.as_given(ranges), "lns")
        self.used.append("floor lns")
        self.phases.append(
            {"formulation": "floor lns", "iterations": iterations, "seconds": time.monotonic() - t1, "best": self.best_value}
        )

    def floor_cover(self, total: float) -> None:
        """The covering MILP with the redundancy floor (:func:`_floor_cover`) from the best placement for
        the time left; exact here (links never bind), so its bound is proven."""
        if self.good_enough() or self.remaining() <= 0.2:
            return
        phase = "floor cover"
        found, bound, model, outcome = _floor_cover(
            self.cost,
            self.groups,
            self.num_blocks,
            self.floor,
            dict(self.best.items()),
            time_limit=max(0.2, self.remaining() - self.margin()),
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report(phase, f"incumbent {v:.1f}"),
            mip_rel_gap=max(self.gap, self.mip_rel_gap),
            seed=self.seed,
        )
        if found is not None:
            self.consider(phase, self.as_given(found), phase)
        self.prove(bound)
        self.status = outcome.status
        self.used.append(phase)
        self.phases.append(_phase(phase, model, outcome))

    def coverage_beam_ignoring_links(self, total: float) -> None:
        t1 = time.monotonic()
        found, _ = beam_coverage(
            self.cost,
            self.groups,
            self.num_blocks,
            low=0.0,
            high=self.helix,
            time_limit=max(0.1, 0.05 * total),
            width=16,
        )
        if found is not None:
            self.consider("coverage beam", self.completed(found), "beam")
        self.phases.append(
            {"formulation": "coverage beam", "seconds": time.monotonic() - t1, "best": self.best_value}
        )

    def coverage_bound(self, total: float) -> None:
        """Prove the coverage bound (:func:`planner.bounds.coverage_bound`) for up to 10% of the time."""
        t1 = time.monotonic()
        with recording() as solved:
            relaxed = coverage_bound(
                self.cluster,
                self.cost,
                time_limit=max(0.1, min(0.1 * total, self.remaining() - self.margin())),
                start=dict(self.best.items()),
                mip_rel_gap=self.mip_rel_gap,
                seed=self.seed,
            )
        self.prove(relaxed.bound, "coverage")
        if relaxed.bound is not None:
            self.report("bound", f"coverage bound (links ignored): {relaxed.bound:.1f} tokens/s")
        self.phases.append(
            {
                "formulation": "coverage bound",
                "status": relaxed.status,
                "bound": relaxed.bound,
                "objective": relaxed.value,
                "seconds": time.monotonic() - t1,
                **_solved_sizes(solved),
            }
        )

    def flow_beam(self, total: float) -> None:
        """The flow beam (:func:`planner.flow_beam.search_flows`) for up to 70% of the time."""
        t1 = time.monotonic()
        search_flows(
            self.cluster,
            self.cost,
            self.groups,
            low=self.best_value,
            high=self.bound,
            time_limit=max(0.1, min(0.7 * total, self.remaining() - self.margin())),
            score=lambda ranges: self.score(self.completed(ranges)),
            partial_inference=self.partial,
            stop_at=self.stop_at(),
            on_found=lambda name, ranges, _value: self.consider(name, self.completed(ranges), "flow beam"),
        )
        self.phases.append(
            {"formulation": "flow beam", "seconds": time.monotonic() - t1, "best": self.best_value}
        )
        self.used.append("flow beam")

    def milp_models(self, formulation: str) -> None:
        """The typed model (first when nodes repeat) and then the per-node model, as ``formulation``
        asks; a typed model that is exact makes the per-node one unnecessary under ``auto``."""
        repeated = len(self.groups) < len(self.cluster.nodes)
        typed_first = formulation == "typed" or (formulation == "auto" and repeated)
        typed_exact = False
        if typed_first and not self.good_enough() and self.remaining() > 0.2:
            typed = _typed_model(self.cluster, self.cost, self.groups, self.partial, self.floor)
            typed_exact = typed.exact
            if typed.exact or formulation == "typed" or typed.model.num_vars <= TYPED_RELAXATION_VARS:
                self.solve_typed(typed, formulation)
            else:
                self.phases.append({"formulation": "typed", "skipped": f"{typed.model.num_vars} variables"})
        run_per_node = formulation == "per-node" or (formulation == "auto" and not typed_exact)
        if run_per_node and not self.good_enough() and self.remaining() > 0.2:
            self.solve_per_node()

    def solve_typed(self, typed: _Typed, formulation: str) -> None:
        """Solve the typed model from the best placement: all the time left when it is exact (or asked
        for), else 40% of it, as a relaxation whose dual bound still holds."""
        start = _typed_start(typed, self.cluster, self.cost, self.best, self.partial)
        budget = (
            self.remaining() - self.margin()
            if (typed.exact or formulation == "typed")
            else 0.4 * self.remaining()
        )
        outcome = typed.model.solve(
            time_limit=budget,
            start=start,
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report("typed", f"incumbent {v:.1f}"),
            mip_rel_gap=max(self.gap, self.mip_rel_gap) if typed.exact else self.mip_rel_gap,
            seed=self.seed,
        )
        if outcome.values is not None:
            placement = _typed_decode(typed, self.cluster, self.cost, outcome.values)
            self.consider("typed MILP", placement, "typed")
        self.prove(outcome.bound)  # exact or a relaxation: a valid bound either way
        self.status = outcome.status
        self.used.append("typed")
        self.phases.append(_phase("typed", typed.model, outcome, exact=typed.exact))

    def solve_per_node(self) -> None:
        """Helix Tables 5-6 from the best placement for the time left; a pruned model's bound is not
        proven for the whole problem."""
        pn = _per_node_model(self.cluster, self.cost, self.groups, self.partial, self.link_degree, self.floor)
        start, _ = _per_node_start(pn, self.cluster, self.cost, self.best, self.groups, self.partial)
        outcome = pn.model.solve(
            time_limit=max(0.1, self.remaining() - self.margin()),
            start=start,
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report("per-node", f"incumbent {v:.1f}"),
            mip_rel_gap=self.mip_rel_gap,
            seed=self.seed,
        )
        if outcome.values is not None:
            self.consider("per-node MILP", _per_node_decode(pn, self.cluster, outcome.values), "per-node")
        complete = len(pn.flow) == 2 * len(pn.nodes) + len(pn.nodes) * (len(pn.nodes) - 1)
        if complete:  # a pruned model's bound only holds for the pruned problem
            self.prove(outcome.bound)
        self.status = outcome.status
        self.used.append("per-node")
        self.phases.append(_phase("per-node", pn.model, outcome, pruned=not complete))

    def result(self) -> MilpResult:
        elapsed = time.monotonic() - self.t0
        value = self.best_value
        bound = max(self.bound, value)  # tolerances can leave a solver bound a hair below the incumbent
        self.report("done", f"{'+'.join(self.used) or 'heuristics'} in {elapsed:.1f}s")
        if self.floor is not None:
            self.phases.append(
                {"formulation": "floor", "repaired": self.floor_repairs, "rejected": self.floor_rejects}
            )
        return MilpResult(
            placement=self.best,
            throughput=value,
            upper_bound=bound,
            helix_bound=self.helix,
            solver_bound=self.solver_bound,
            gap=0.0 if bound <= 0 else max(0.0, 1.0 - value / bound),
            solve_seconds=elapsed,
            formulation="+".join(self.used) or "heuristics",
            status=self.status,
            start_algorithm=self.start_name,
            phases=tuple(self.phases),
            bounds=dict(self.bounds),
            bound_name=min(self.bounds.items(), key=lambda item: item[1])[0],
            floor=self.floor_used,
        )


def milp(
    cluster: Cluster,
    *,
    time_limit: float = 60.0,
    gap: float = 0.05,
    partial_inference: bool = True,
    formulation: str = "auto",
    link_degree: int | None = DEFAULT_LINK_DEGREE,
    mip_rel_gap: float = 1e-4,
    cost: CostModel | None = None,
    warm_start: Placement | None = None,
    progress: ProgressCallback | None = None,
    seed: int = 0,
    min_replicas: int = 1,
) -> MilpResult:
    """Search the placement with the largest max flow (Helix §4.4).

    ``time_limit`` bounds the whole search (seconds); it stops early once the best placement is within
    ``gap`` (a fraction) of the best proven upper bound. ``partial_inference`` selects Helix's connection
    rule for the search and for scoring. ``formulation``: ``auto``, ``coverage``, ``typed`` or
    ``per-node`` (module docstring); ``link_degree`` prunes the per-node model to each node's fastest
    links (None: keep all). ``progress`` receives :class:`Progress` reports. ``cost`` defaults to the
    spec's cost model (:func:`planner.cost_models.make_cost_model`).

    ``min_replicas``: the redundancy floor (:mod:`planner.redundancy`): every block on at least that many
    nodes where the offers allow it (else as many blocks as they allow, every block once), throughput
    maximised subject to it; both formulations carry the floor's rows and candidates below it are repaired
    or dropped. 1 (the default) is Helix's problem as published.
    """
    _check_options(formulation, time_limit, gap, link_degree)
    min_replicas = check_min_replicas(min_replicas)
    t0 = time.monotonic()
    cost = cost or make_cost_model(cluster)
    held = sum(max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids)
    if held < cluster.model.num_blocks:
        raise CannotPlaceError(
            f"cluster {cluster.name!r} cannot hold the model: its nodes hold {held} of "
            f"{cluster.model.num_blocks} blocks; add nodes or memory"
        )
    floor = achievable_floor(
        (max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids), cluster.model.num_blocks, min_replicas
    )
    exact_cover = coverage_is_exact(cluster, cost, partial_inference)
    if formulation == "coverage" and not exact_cover:
        raise PlannerError(
            "the coverage formulation needs partial inference and links that never bind; "
            "use formulation='auto', 'typed' or 'per-node' for this cluster",
            code="bad_option",
        )
    search = _Search(
        cluster,
        cost,
        t0=t0,
        time_limit=time_limit,
        gap=gap,
        mip_rel_gap=mip_rel_gap,
        partial_inference=partial_inference,
        link_degree=link_degree,
        progress=progress,
        seed=seed,
        floor=floor,
    )
    search.start_from_heuristics(warm_start)
    if formulation in ("auto", "coverage") and exact_cover:
        search.coverage_search()
    else:
        if formulation == "auto" and not search.good_enough():
            search.network_search()
        search.milp_models(formulation)
    return search.result()


def _check_options(formulation: str, time_limit: float, gap: float, link_degree: int | None) -> None:
    if formulation not in FORMULATIONS:
        raise PlannerError(
            f"formulation must be one of {', '.join(FORMULATIONS)}, got {formulation!r}", code="bad_option"
        )
    if not time_limit > 0:
        raise PlannerError(f"time_limit must be positive, got {time_limit}", code="bad_option")
    if not 0 <= gap < 1:
        raise PlannerError(f"gap must be in [0, 1), got {gap}", code="bad_option")
    if link_degree is not None and link_degree < 1:
        raise PlannerError(f"link_degree must be at least 1 (or None), got {link_degree}", code="bad_option")


def _phase(name: str, model: SparseModel, outcome, **extra) -> dict:
    return {
        "formulation": name,
        **_solved_sizes([model.size]),
        "status": outcome.status,
        "objective": outcome.objective,
        "bound": outcome.bound,
        "seconds": outcome.seconds,
        **extra,
    }


def _solved_sizes(solved: list[ModelSize]) -> dict:
    """What a phase solved: how many models, and the columns and rows of the largest (none: ``{}``)."""
    if not solved:
        return {}
    largest = max(solved, key=lambda size: (size.columns, size.rows))
    return {"models": len(solved), "columns": largest.columns, "rows": largest.rows}


# ---------------------------------------------------------------------------------------------------
# Model sizes (Helix Table 8)
# ---------------------------------------------------------------------------------------------------


def per_node_size(
    cluster: Cluster,
    cost: CostModel | None = None,
    *,
    partial_inference: bool = False,
    link_degree: int | None = None,
) -> ModelSize:
    """Columns and rows of Helix Tables 5-6 as written for ``cluster``: per node ``s_i`` and one ``b_i^k``
    per size it can hold; per connection ``f_ij`` and ``d_ij`` (and ``aux1``, ``aux2`` with
    ``partial_inference``); the rows of one size, ``e_i <= L``, conservation and node capacity per node,
    ``f <= d C`` and the validity rows per connection. Connections are those of the complete graph, or the
    links each node keeps under §4.5 pruning with ``link_degree`` (:func:`_kept_links`; the source and
    sink links are never pruned). The symmetry-breaking rows the solver adds are not Helix's and are not
    counted. ``helix-single-24`` without partial inference: 1376 columns, 1848 rows (Table 8)."""
    cost = cost or make_cost_model(cluster)
    singletons = [[n] for n in cluster.node_ids]  # no interchangeable nodes: no symmetry rows
    return _per_node_model(cluster, cost, singletons, partial_inference, link_degree).model.size


def model_size(
    cluster: Cluster,
    cost: CostModel | None = None,
    *,
    partial_inference: bool = True,
    link_degree: int | None = DEFAULT_LINK_DEGREE,
    phases: tuple[dict, ...] | list[dict] = (),
) -> dict:
    """The JSON ``model_size`` of a MILP plan: Helix's per-node model (:func:`per_node_size`) for this
    cluster, cost model and ``partial_inference``, unpruned (the complete graph: Helix Table 8's "without
    pruning") and pruned to ``link_degree`` links per node (Table 8's "with pruning"), built whatever
    formulation the search then solved; and, from ``phases`` (:attr:`MilpResult.phases`), what was solved:
    per phase that ran HiGHS its formulation, the number of models and the columns and rows of the
    largest.

    ``{"formulation": "per-node", "partial_inference": bool, "link_degree": int | None,
    "unpruned": {"columns", "rows"}, "pruned": {"columns", "rows"},
    "solved": [{"formulation", "models", "columns", "rows"}, ...]}``"""
    cost = cost or make_cost_model(cluster)
    unpruned = per_node_size(cluster, cost, partial_inference=partial_inference)
    pruned = per_node_size(cluster, cost, partial_inference=partial_inference, link_degree=link_degree)
    solved = [
        {k: p[k] for k in ("formulation", "models", "columns", "rows")} for p in phases if p.get("models")
    ]
    return {
        "formulation": "per-node",
        "partial_inference": partial_inference,
        "link_degree": link_degree,
        "unpruned": unpruned.to_dict(),
        "pruned": pruned.to_dict(),
        "solved": solved,
    }
