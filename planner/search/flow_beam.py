"""A beam search that builds placements together with a feasible flow, for clusters whose links bind.

The coverage beam (:mod:`planner.search.coverage`) is exact only when links never bind: there, any placement
whose every block is covered by ``F`` tokens/s of node throughput carries ``F``. When the links between
regions are slow (Helix §6.4: 100 Mb/s between regions carries a few hundred activations per second per
node pair), a placement must also give every region boundary enough node *pairs*: ``X`` nodes ending at
block ``p`` in one region and ``Y`` nodes holding ``p`` in another carry at most ``C X Y`` across it
(Helix §4.3: each node pair is one link of capacity ``C``). Helix §6.4 observes the same trade-off:
placements that cross regions rarely, with shallower pipelines.

This search sweeps the blocks left to right carrying a *committed flow* of ``target`` tokens/s:

* at block 0 the coordinator sends ``target`` to nodes that start there (at most ``min(T_j, c_src)``
  each);
* at each block ``p`` the tokens leaving the nodes that end at ``p`` must all be taken by nodes holding
  ``p``: first by nodes already holding it that have spare throughput (with partial inference, Helix §4.4,
  a node ``[s, e)`` accepts tokens at any ``s <= p < e``), then by nodes started at ``p``; each node pair
  carries at most its link capacity, each node at most its ``T_j``;
* at the last block the tokens return to the coordinator over the nodes' coordinator links.

Every state thus holds a feasible flow of value ``target`` in Helix's flow graph of its placement (node
capacities, link capacities and §4.4's valid connections all respected), so a completed placement has a
max flow of at least ``target`` (:func:`planner.flow_graph.evaluate` may find more). New nodes start only
at blocks where tokens leave a node (as the coverage beam starts intervals only where coverage is short),
near the end shifted left to fit. States are ranked by their slack in layer-tokens per second: what the
nodes that may still start can process (``max_j j T_j`` each), minus what the committed tokens still need
past the nodes holding them; states with negative slack (also counting the spare throughput of started
nodes) or too few blocks left to reach the last block are dropped. :func:`search_flows` searches the
target over orders of the regions that slow links separate (:func:`link_regions`, :func:`region_orders`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.roofline import CostModel

__all__ = ["flow_beam", "link_regions", "region_orders", "search_flows"]

_EPS = 1e-9


@dataclass(frozen=True)
class _Types:
    """Node types (interchangeable nodes) with their sizes, rates and link capacities."""

    groups: list[list[str]]
    counts: tuple[int, ...]
    rates: list[dict[int, float]]
    area: list[float]
    longest: list[int]
    link: list[list[float]]  # link[a][b]: one type-a node to one (other) type-b node
    source: list[float]
    sink: list[float]


def _types(cost: CostModel, groups: list[list[str]], num_blocks: int) -> _Types:
    groups = [g for g in groups if any(k <= num_blocks for k in cost.feasible_sizes(g[0]))]
    reps = [g[0] for g in groups]
    rates = [{k: cost.throughput(r, k) for k in cost.feasible_sizes(r) if k <= num_blocks} for r in reps]
    link = []
    for a, ga in enumerate(groups):
        row = []
        for b, gb in enumerate(groups):
            if a != b:
                row.append(cost.link_capacity(ga[0], gb[0]))
            elif len(ga) > 1:
                row.append(cost.link_capacity(ga[0], ga[1]))
            else:
                row.append(0.0)
        link.append(row)
    return _Types(
        groups=groups,
        counts=tuple(len(g) for g in groups),
        rates=rates,
        area=[max(k * r for k, r in tp.items()) for tp in rates],
        longest=[max(tp) for tp in rates],
        link=link,
        source=[cost.link_capacity(COORDINATOR, r) for r in reps],
        sink=[cost.link_capacity(r, COORDINATOR) for r in reps],
    )


# A started node: (type, start, end, inflow, capacity). Senders: (type or -1 for the coordinator, left).
_Node = tuple[int, int, int, float, float]


def _absorb(
    types: _Types, senders: list[list], receiver_type: int, room: float
) -> tuple[float, list[tuple[int, float]]]:
    """How much a receiver of ``receiver_type`` with ``room`` spare throughput takes from ``senders``
    (each ``[type, left]``), one link per sender, largest senders first. Returns the amount and the
    per-sender takes (index, amount)."""
    taken = 0.0
    takes = []
    for i in sorted(range(len(senders)), key=lambda j: -senders[j][1]):
        if room - taken <= _EPS:
            break
        t, left = senders[i]
        if left <= _EPS:
            continue
        cap = types.source[receiver_type] if t < 0 else types.link[t][receiver_type]
        amount = min(cap, left, room - taken)
        if amount > _EPS:
            takes.append((i, amount))
            taken += amount
    return taken, takes


# A beam state at a block boundary: (nodes left per type, started nodes, placed (type, start, size)).
_State = tuple[tuple[int, ...], tuple[_Node, ...], tuple[tuple[int, int, int], ...]]


class _FlowBeam:
    """One :func:`flow_beam` search: the sweep over block boundaries and its ranking rules."""

    def __init__(
        self,
        types: _Types,
        num_blocks: int,
        target: float,
        *,
        partial_inference: bool,
        width: int,
        deadline: float,
        phases: list[set[str]] | None,
    ) -> None:
        self.types = types
        self.L = num_blocks
        self.target = target
        self.partial = partial_inference
        self.width = width
        self.deadline = deadline
        self.options = [(t, k, r) for t, tp in enumerate(types.rates) for k, r in sorted(tp.items())]
        if phases is None:
            self.phase_of = [0] * len(types.groups)
        else:
            self.phase_of = [
                next((i for i, ph in enumerate(phases) if g[0] in ph), len(phases)) for g in types.groups
            ]

    # --- ranking -------------------------------------------------------------------------------------

    def slack(
        self, counts, active: tuple[_Node, ...], waiting: float, b: int, phase: int
    ) -> tuple[float, float]:
        """(pessimistic, optimistic) slack in layer-tokens/s: what the nodes that may still start can
        process, less what the committed tokens still need; the optimistic one adds the started nodes'
        spare throughput."""
        L = self.L
        unused = sum(
            c * a
            for t, (c, a) in enumerate(zip(counts, self.types.area, strict=True))
            if self.phase_of[t] >= phase
        )
        need = sum(f * (L - e) for _, _, e, f, _ in active) + waiting * (L - b)
        spare = sum((cap - f) * (e - b) for _, _, e, f, cap in active)
        return unused - need, unused + spare - need

    def reach_ok(self, counts, active: tuple[_Node, ...], b: int, phase: int) -> bool:
        """The committed tokens can still reach the last block: the furthest started node plus every
        node that can still start, end to end."""
        furthest = max((e for _, _, e, _, _ in active), default=b)
        more = sum(
            c * m
            for t, (c, m) in enumerate(zip(counts, self.types.longest, strict=True))
            if self.phase_of[t] >= phase
        )
        return furthest + more >= self.L

    def phase_at(self, placed) -> int:
        return max((self.phase_of[t] for t, _s, _k in placed), default=-1)

    # --- the sweep -----------------------------------------------------------------------------------

    def run(self) -> dict[str, tuple[int, int]] | None:
        """Sweep the boundaries 0..L keeping the ``width`` best states; the best finished placement."""
        states: list[_State] = [(self.types.counts, (), ())]
        for b in range(self.L + 1):
            finished: dict[tuple, tuple[float, _State]] = {}
            pending = self.hand_over(states, b, finished)
            while pending:
                if time.monotonic() > self.deadline:
                    return None
                pending = self.start_nodes(pending, b, finished)
            if not finished:
                return None
            ranked = sorted(finished.values(), key=lambda item: -item[0])[: self.width]
            states = [state for _, state in ranked]
        return self.ranges(states[0][2])

    def hand_over(self, states: list[_State], b: int, finished: dict) -> list[tuple]:
        """At boundary ``b``: the tokens leaving the nodes that end there (or the coordinator's at 0) go
        first to started nodes holding ``b`` with spare throughput (partial inference); returns the states
        with tokens still waiting. At the last block a state whose tokens the coordinator links take is
        finished."""
        types = self.types
        pending = []
        for counts, active, placed in states:
            if b == 0:
                senders = [[-1, self.target]]
            else:
                senders = [[t, f] for t, _s, e, f, _c in active if e == b and f > _EPS]
            holding = [n for n in active if n[2] > b]
            if b == self.L:
                ending = [n for n in active if n[2] == self.L]
                if all(f <= types.sink[t] * (1 + 1e-9) + _EPS for t, _s, _e, f, _c in ending):
                    finished[(counts, ())] = (0.0, (counts, (), placed))
                continue
            if self.partial and senders:
                new_holding = []
                for node in holding:
                    t, s, e, f, cap = node
                    got, takes = _absorb(types, senders, t, cap - f)
                    for i, amount in takes:
                        senders[i][1] -= amount
                    new_holding.append((t, s, e, f + got, cap))
                holding = new_holding
            waiting = sum(left for _, left in senders)
            pending.append((counts, tuple(holding), placed, senders, waiting, 0))
        return pending

    def start_nodes(self, pending: list[tuple], b: int, finished: dict) -> list[tuple]:
        """One round of starting a node at ``b`` for the waiting tokens, in every way the options allow
        (options in a fixed order from ``first``, so each set of new nodes is built once); states with no
        tokens waiting are finished; returns the ``width`` best grown states."""
        grown: dict[tuple, tuple[float, tuple]] = {}
        for counts, active, placed, senders, waiting, first in pending:
            phase = self.phase_at(placed)
            pess, opt = self.slack(counts, active, waiting, b, phase)
            if opt < -1e-6 * self.target * self.L or not self.reach_ok(counts, active, b, phase):
                continue
            if waiting <= 1e-9 * max(1.0, self.target):
                key = (counts, tuple(sorted((t, e, round(f, 6)) for t, _s, e, f, _c in active)))
                if key not in finished or finished[key][0] < pess:
                    finished[key] = (pess, (counts, active, placed))
                continue
            for i in range(first, len(self.options)):
                child = self.start_one(i, counts, active, placed, senders, b, phase)
                if child is None:
                    continue
                key, score, state = child
                if key not in grown or grown[key][0] < score:
                    grown[key] = (score, state)
        best = sorted(grown.values(), key=lambda item: -item[0])[: self.width]
        return [state for _, state in best]

    def start_one(self, i: int, counts, active, placed, senders, b: int, phase: int) -> tuple | None:
        """The state after starting a node of option ``i`` (type, size) at ``b`` (near the end shifted
        left to fit) taking what it can of the waiting tokens: ``(key, pessimistic slack, state)``, or
        None when the option does not apply."""
        t, k, rate = self.options[i]
        if counts[t] == 0 or not phase <= self.phase_of[t] <= max(phase + 1, 0):
            return None
        start = b
        if b + k > self.L:
            if not self.partial:
                return None
            start = self.L - k
        got, takes = _absorb(self.types, senders, t, rate)
        if got <= _EPS:
            return None
        left = [list(sd) for sd in senders]
        for j, amount in takes:
            left[j][1] -= amount
        new_counts = (*counts[:t], counts[t] - 1, *counts[t + 1 :])
        new_active = (*active, (t, start, start + k, got, rate))
        new_waiting = sum(lf for _, lf in left)
        new_pess, _ = self.slack(new_counts, new_active, new_waiting, b, max(phase, self.phase_of[t]))
        key = (
            new_counts,
            tuple(sorted((tt, e, round(f, 6)) for tt, _s, e, f, _c in new_active)),
            round(new_waiting, 6),
        )
        return key, new_pess, (new_counts, new_active, (*placed, (t, start, k)), left, new_waiting, i)

    def ranges(self, placed) -> dict[str, tuple[int, int]]:
        """Concrete nodes for the placed (type, start, size) triples, type by type in group order."""
        ranges: dict[str, tuple[int, int]] = {}
        used = [0] * len(self.types.groups)
        for t, s, k in placed:
            ranges[self.types.groups[t][used[t]]] = (s, s + k)
            used[t] += 1
        return ranges


def flow_beam(
    cost: CostModel,
    groups: list[list[str]],
    num_blocks: int,
    target: float,
    *,
    partial_inference: bool = True,
    width: int = 24,
    deadline: float = float("inf"),
    phases: list[set[str]] | None = None,
) -> dict[str, tuple[int, int]] | None:
    """A placement of ``groups`` (lists of interchangeable nodes) on ``num_blocks`` blocks that carries a
    flow of ``target`` tokens/s (module docstring), or None when the beam finds none (or time runs out).

    ``phases`` (sets of node ids) orders the nodes' starts: the first nodes come from the first phase, a
    phase opens once a node of the one before it has started, and then nodes of earlier phases no longer
    start (e.g. one phase per region: tokens pass the regions in that order)."""
    types = _types(cost, groups, num_blocks)
    if not types.groups or target <= 0:
        return None
    beam = _FlowBeam(
        types,
        num_blocks,
        target,
        partial_inference=partial_inference,
        width=width,
        deadline=deadline,
        phases=phases,
    )
    return beam.run()


def link_regions(cost: CostModel, groups: list[list[str]]) -> list[set[str]]:
    """Node sets joined by fast links: the regions the tokens should cross rarely. One set when no link
    is slow.

    A type is *strong* when some link at it carries less than the slower of its two ends processes (the
    network can bind it). Two strong types are joined when the links between them (both ways) carry at
    least what the slower of the two nodes can process. A weak type (a node slower than every link it
    has, such as a CPU node next to GPUs) joins the region of the strong type it has the fastest link to:
    joining it by the rule above would chain every region together through it (a 50 tokens/s CPU node is
    never slowed by a 283 tokens/s link between two continents, though the GPUs on either side are)."""
    rate = [max((cost.throughput(g[0], k) for k in cost.feasible_sizes(g[0])), default=0.0) for g in groups]
    n = len(groups)

    def cap(a: int, b: int) -> float:
        if a == b:
            if len(groups[a]) < 2:
                return float("inf")
            u, v = groups[a][0], groups[a][1]
        else:
            u, v = groups[a][0], groups[b][0]
        return min(cost.link_capacity(u, v), cost.link_capacity(v, u))

    caps = [[cap(a, b) for b in range(n)] for a in range(n)]
    slow = [[caps[a][b] < min(rate[a], rate[b]) * (1 - 1e-9) for b in range(n)] for a in range(n)]
    strong = [any(slow[a]) for a in range(n)]
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a in range(n):
        for b in range(a + 1, n):
            if strong[a] and strong[b] and not slow[a][b]:
                parent[root(a)] = root(b)
    strong_ids = [b for b in range(n) if strong[b]]
    if strong_ids:
        for a in range(n):
            if not strong[a]:
                nearest = max(strong_ids, key=lambda b: (caps[a][b], -b))
                parent[root(a)] = root(nearest)
    else:
        for a in range(1, n):
            parent[root(a)] = root(0)
    sets: dict[int, set[str]] = {}
    for i, g in enumerate(groups):
        sets.setdefault(root(i), set()).update(g)
    return list(sets.values())


def _ordered_partitions(items: list[int]):
    if not items:
        yield []
        return
    for size in range(1, len(items) + 1):
        for first in itertools.combinations(items, size):
            rest = [x for x in items if x not in first]
            for tail in _ordered_partitions(rest):
                yield [list(first), *tail]


def region_orders(regions: list[set[str]], limit: int = 4) -> list[list[set[str]] | None]:
    """Phase orders for :func:`flow_beam`: no order, then every ordered partition of the regions (the
    regions of a part start together, the parts one after another) when there are 2 to ``limit``."""
    orders: list[list[set[str]] | None] = [None]
    if 2 <= len(regions) <= limit:
        for parts in _ordered_partitions(list(range(len(regions)))):
            if len(parts) > 1:
                orders.append([set().union(*(regions[i] for i in part)) for part in parts])
    return orders


def search_flows(
    cluster: Cluster,
    cost: CostModel,
    groups: list[list[str]],
    *,
    low: float,
    high: float,
    time_limit: float,
    score: Callable[[dict[str, tuple[int, int]]], float],
    partial_inference: bool = True,
    stop_at: float = float("inf"),
    on_found: Callable[[str, dict[str, tuple[int, int]], float], None] | None = None,
) -> tuple[dict[str, tuple[int, int]] | None, float]:
    """:func:`flow_beam` over the region orders of :func:`region_orders`, searching the target between the
    best flow found and the lowest target missed: first every order with beams of width 8 (halving the
    interval; a target is reached when any order reaches it, the orders that reached the most tried
    first), then the three best orders with width 32, the best with width 96 and the two best with width
    256 while time is left (a quarter of the way up: wide beams reach targets unevenly). ``score`` gives a placement's exact max flow; ``on_found``
    hears of every placement found; the search stops once a placement reaches ``stop_at``. Returns the
    best placement (or None) and its flow."""
    deadline = time.monotonic() + time_limit
    orders = region_orders(link_regions(cost, groups))
    reached = [0.0] * len(orders)
    best: tuple[dict[str, tuple[int, int]] | None, float] = (None, max(0.0, low))
    L = cluster.model.num_blocks

    def attempt(index: int, target: float, width: int) -> bool:
        nonlocal best
        found = flow_beam(
            cost,
            groups,
            L,
            target,
            partial_inference=partial_inference,
            width=width,
            deadline=deadline,
            phases=orders[index],
        )
        if found is None:
            return False
        value = score(found)
        reached[index] = max(reached[index], value)
        if on_found is not None:
            on_found(f"flow beam {width} order {index}", found, value)
        if value > best[1]:
            best = (found, value)
        return True

    lo, hi = best[1], high
    for width, keep, step in ((8, len(orders), 0.5), (32, 3, 0.25), (96, 1, 0.25), (256, 2, 0.25)):
        while hi - lo > 5e-3 * hi and time.monotonic() < deadline and best[1] < stop_at:
            target = lo + (hi - lo) * step if lo > 0 else hi / 2
            ranking = sorted(range(len(orders)), key=lambda i: -reached[i])
            if any(attempt(i, target, width) for i in ranking[:keep]):
                lo = max(target, best[1])
            elif time.monotonic() < deadline:
                hi = target
        lo, hi = best[1], min(high, max(hi, best[1]) * 1.15)
    return best
