"""Replanning with stickiness: when the swarm changes, move as few blocks as the throughput allows.

Helix (ASPLOS 2025) §4-5 plans a placement once for a fixed cluster: the MILP (§4.4) maximises the max
flow of the flow graph (§4.3) and requests are routed along that flow (§5). A swarm changes while it
serves: nodes join and leave. Every block a node must newly load costs minutes of downloading and
loading during which that node serves less, so a fresh plan is worth publishing only when it is clearly
better. :func:`decide` therefore builds two candidates and explains its choice:

* *sticky*: the previous placement on the nodes still present, each range clipped to what its node can
  hold now; every new node gets the window of its size that maximises the evaluated max flow (§4.3),
  one at a time; blocks left unserved by departed nodes are repaired with the smallest moves (a new or
  idle node takes the gap, or a neighbour extends or slides within its capacity); with a redundancy
  floor (``min_replicas``, :mod:`planner.search.redundancy`), blocks left below it are raised the same way, one
  node at a time with the smallest moves (a new or idle node takes the under-replicated window, a
  neighbour extends), as far as the offers allow; finally blocks that more nodes serve than the floor
  needs are dropped at range ends while that raises the max flow (fewer blocks, faster ``T_j``;
  dropping loads nothing; never below the floor);
* *fresh*: the planner's own plan (``milp`` by default: Helix §4.4) of the current cluster, its nodes
  relabelled among interchangeable ones so it keeps as many of their blocks as possible.

The sticky plan wins when it serves every block, meets the floor as far as the offers allow (or falls
short of it no more than the fresh plan does) and the fresh one is not at least ``improvement`` (20 %)
faster. The decision names the blocks left below the floor (``single_points``) and says so in its
reason. Plain data in, plain data out: no network, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from swarmnode.naming import short_id, shorten_ids

from ..algorithms.milp_formulations import interchangeable_groups
from ..api import PlanResult, plan
from ..cluster.spec import Cluster
from ..costs.roofline import CostModel
from ..errors import CannotPlaceError, PlannerError
from ..flow_graph import evaluate
from ..options import AlgorithmOptions
from ..placement import placement_problems
from ..registry import MIN_REPLICAS, PLACEMENT, lookup
from ..search.redundancy import (
    Floor,
    achievable_floor,
    check_min_replicas,
    floor_text,
    repair_floor,
    replica_counts,
)
from ..search.redundancy import single_points as floor_gaps
from .unused import add_helpful

__all__ = ["Decision", "decide", "fresh_options", "moved_blocks"]

Ranges = dict[str, tuple[int, int]]

_EPS = 1e-9


@dataclass(frozen=True)
class Decision:
    """The placement to publish, with its flows (tokens/s on Helix's flow graph: ``flows[u][v]``,
    ``u`` = ``source`` or a node, ``v`` = a node or ``sink``), its max-flow throughput, how it was made
    (``milp``/… for a fresh plan, ``keep``/``extend``/``repair``/``trim`` for a sticky one), why (one
    sentence for status and dashboard), how many blocks nodes must newly load, and whether it differs
    from the previous placement at all (``changed=False``: nothing to publish). ``min_replicas`` is the
    redundancy floor asked for and ``single_points`` the half-open block ranges ``(start, end)`` the
    placement holds on fewer nodes than that (empty when the floor holds everywhere). A two-phase plan
    (:mod:`planner.live.sticky_phases`) also gives each node its ``phases`` and the ``kv_links`` (prefill node ->
    decode node -> requests/s); both are empty for every other plan."""

    placement: dict[str, tuple[int, int]]
    flows: dict[str, dict[str, float]]
    throughput: float
    algorithm: str
    reason: str
    moved_blocks: int
    changed: bool
    single_points: tuple[tuple[int, int], ...] = ()
    min_replicas: int = 1
    phases: dict[str, str] = field(default_factory=dict)
    kv_links: dict[str, dict[str, float]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------------


def _new_blocks(new: tuple[int, int], old: tuple[int, int] | None) -> int:
    """Blocks of ``new`` that ``old`` does not hold."""
    if old is None:
        return new[1] - new[0]
    overlap = max(0, min(new[1], old[1]) - max(new[0], old[0]))
    return new[1] - new[0] - overlap


def moved_blocks(placement: Mapping[str, tuple[int, int]], previous: Mapping[str, tuple[int, int]]) -> int:
    """Blocks the nodes must newly load to go from ``previous`` to ``placement``."""
    return sum(_new_blocks((rng[0], rng[1]), _as_range(previous.get(n))) for n, rng in placement.items())


def _as_range(value: Sequence[int] | None) -> tuple[int, int] | None:
    return None if value is None else (int(value[0]), int(value[1]))


def _coverage(ranges: Mapping[str, tuple[int, int]], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for start, end in ranges.values():
        for b in range(max(0, start), min(end, num_blocks)):
            counts[b] += 1
    return counts


def _gaps(ranges: Mapping[str, tuple[int, int]], num_blocks: int) -> list[tuple[int, int]]:
    """Maximal runs of blocks nobody serves, as half-open ranges."""
    gaps: list[tuple[int, int]] = []
    start = None
    for b, count in enumerate([*_coverage(ranges, num_blocks), 1]):
        if count == 0 and start is None:
            start = b
        elif count > 0 and start is not None:
            gaps.append((start, b))
            start = None
    return gaps


def _gaps_text(gaps: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in gaps)


def _ordered(ranges: Mapping[str, tuple[int, int]]) -> Ranges:
    """Ranges sorted by block then node id: a stable order for records and display."""
    return {n: ranges[n] for n in sorted(ranges, key=lambda n: (ranges[n], n))}


def _sizes(cluster: Cluster, cost: CostModel) -> dict[str, int]:
    """Blocks each node holds at most (capped at the model's size); nodes that hold none are left out."""
    num_blocks = cluster.model.num_blocks
    sizes = {}
    for node_id in cluster.node_ids:
        feasible = cost.feasible_sizes(node_id)
        if feasible:
            sizes[node_id] = min(max(feasible), num_blocks)
    return sizes


def _throughput(cluster: Cluster, ranges: Mapping[str, tuple[int, int]], cost: CostModel) -> float:
    if not ranges or _gaps(ranges, cluster.model.num_blocks):
        return 0.0
    return evaluate(cluster, ranges, cost=cost, with_latency=False).throughput


# ---------------------------------------------------------------------------------------------------
# The sticky candidate
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sticky:
    ranges: Ranges
    added: dict[str, tuple[int, int]]  # new nodes and their windows
    repaired: dict[str, tuple[int, int]]  # nodes whose range a repair set (new ranges)
    shrunk: dict[str, tuple[int, int]]  # kept nodes that now hold fewer blocks (new ranges)
    clipped: tuple[str, ...]  # kept nodes whose old range no longer fits their capacity
    dropped: tuple[str, ...]  # nodes of the previous placement that are gone or hold nothing now
    gaps: tuple[tuple[int, int], ...]  # blocks still unserved (empty when the plan covers the model)
    floor_short: tuple[tuple[int, int], ...] = ()  # blocks below the redundancy floor


def _clip(previous: Mapping[str, tuple[int, int]], sizes: Mapping[str, int], num_blocks: int) -> Ranges:
    """The previous ranges of nodes still present, each cut to the node's capacity and the model."""
    kept: Ranges = {}
    for node_id, rng in previous.items():
        if node_id not in sizes:
            continue
        start, end = int(rng[0]), min(int(rng[1]), num_blocks)
        end = min(end, start + sizes[node_id])
        if 0 <= start < end:
            kept[node_id] = (start, end)
    return kept


def _best_window(
    cluster: Cluster, cost: CostModel, ranges: Ranges, node_id: str, size: int, deadline: float
) -> tuple[int, int]:
    """The window of ``size`` blocks for ``node_id`` that gives the largest max flow with ``ranges``;
    ties (e.g. all zero while blocks are unserved) go to the window serving the most unserved blocks,
    then to the one whose blocks carry the least throughput so far (Petals' rule), then the earliest.
    Past ``deadline`` (``time.monotonic()``) windows are no longer scored by max flow, only by the ties'
    rules, so a large swarm still gets an answer in time."""
    num_blocks = cluster.model.num_blocks
    counts = _coverage(ranges, num_blocks)
    per_block = [0.0] * num_blocks
    for n, (s, e) in ranges.items():
        rate = cost.throughput(n, e - s)
        for b in range(s, e):
            per_block[b] += rate
    best_key = None
    best = (0, size)
    for start in range(num_blocks - size + 1):
        window = (start, start + size)
        scored = time.monotonic() <= deadline
        value = _throughput(cluster, {**ranges, node_id: window}, cost) if scored else 0.0
        fills = sum(1 for b in range(*window) if counts[b] == 0)
        key = (round(value, 6), fills, -sum(per_block[start : start + size]), -start)
        if best_key is None or key > best_key:
            best_key, best = key, window
    return best


def _repair_move(
    ranges: Ranges,
    sizes: Mapping[str, int],
    previous: Mapping[str, tuple[int, int]],
    num_blocks: int,
) -> tuple[str, tuple[int, int]] | None:
    """One node's new range that serves the most unserved blocks without unserving any other block
    nobody else holds, preferring moves that load the fewest blocks; None when no move helps.

    A node may slide or grow up to its capacity (which covers extending towards a gap); a node without a
    range (new or idle) may take any window it can hold. The most blocks served wins, then the fewest
    blocks to load (so a small gap goes to the neighbour that extends least), then an idle node."""
    counts = _coverage(ranges, num_blocks)
    best_key = None
    best = None
    for node_id in sorted(sizes):
        current = ranges.get(node_id)
        alone = list(counts)
        if current is not None:
            for b in range(*current):
                alone[b] -= 1
        # prefix sums of the blocks nobody else serves
        prefix = [0]
        for count in alone:
            prefix.append(prefix[-1] + (count == 0))
        served_now = 0 if current is None else prefix[current[1]] - prefix[current[0]]
        smallest = 1 if current is None else current[1] - current[0]
        old = _as_range(previous.get(node_id))
        loaded_now = 0 if current is None else _new_blocks(current, old)
        for size in range(smallest, sizes[node_id] + 1):
            for start in range(num_blocks - size + 1):
                window = (start, start + size)
                gain = prefix[window[1]] - prefix[window[0]] - served_now
                if gain <= 0:
                    continue
                loads = _new_blocks(window, old) - loaded_now
                # on a tie an idle node takes the gap rather than a serving node moving
                key = (gain, -loads, current is None, -size, node_id, -start)
                if best_key is None or key > best_key:
                    best_key, best = key, (node_id, window)
    return best


def _sticky(
    cluster: Cluster,
    cost: CostModel,
    previous: Mapping[str, tuple[int, int]],
    sizes: Mapping[str, int],
    deadline: float,
    floor: Floor | None = None,
) -> _Sticky:
    """The previous placement adapted to the current cluster with the fewest moves (module docstring);
    the max-flow scoring of windows and trims stops at ``deadline`` (``time.monotonic()``). An active
    ``floor`` is repaired after the gaps (:func:`planner.search.redundancy.repair_floor`)."""
    num_blocks = cluster.model.num_blocks
    ranges = _clip(previous, sizes, num_blocks)
    clipped = {n: r for n, r in ranges.items() if tuple(previous[n]) != r}
    new = [n for n in cluster.node_ids if n in sizes and n not in ranges]
    # strongest new nodes first: they shape the flow most
    new.sort(key=lambda n: (-cost.best_layer_rate(n), n))
    repaired: Ranges = {}
    # a gap first goes to new or idle nodes or the cheapest neighbour moves
    for _ in range(2 * num_blocks + len(sizes)):
        if not _gaps(ranges, num_blocks):
            break
        move = _repair_move(ranges, sizes, previous, num_blocks)
        if move is None:
            break
        ranges[move[0]] = move[1]
        repaired[move[0]] = move[1]
    if floor is not None and floor.active and not _gaps(ranges, num_blocks):
        ranges, raised = repair_floor(ranges, sizes, floor, previous=previous, deadline=deadline)
        repaired.update(raised)
    added: Ranges = {}
    for node_id in new:
        if node_id in ranges:  # a repair gave it a gap: keep that, it is what serves the gap
            added[node_id] = repaired.pop(node_id)
            continue
        window = _best_window(cluster, cost, ranges, node_id, sizes[node_id], deadline)
        ranges[node_id] = window
        added[node_id] = window
    trimmed: Ranges = {}
    if not _gaps(ranges, num_blocks):
        keep = floor.min_replicas if floor is not None and floor.active else 1
        ranges, trimmed = _trim(cluster, cost, ranges, deadline, keep=keep)
    for node_id, rng in trimmed.items():
        for changes in (added, repaired):
            if node_id in changes:
                changes[node_id] = rng
    shrunk = {**clipped, **trimmed}
    return _Sticky(
        ranges=ranges,
        added=added,
        repaired=repaired,
        shrunk={n: ranges[n] for n in shrunk if n in ranges and n not in repaired and n not in added},
        clipped=tuple(n for n in clipped if n in ranges),
        dropped=tuple(sorted(n for n in previous if n not in ranges)),
        gaps=tuple(_gaps(ranges, num_blocks)),
        floor_short=tuple(floor_gaps(ranges, num_blocks, floor.min_replicas)) if floor is not None else (),
    )


def _trim(
    cluster: Cluster, cost: CostModel, ranges: Ranges, deadline: float, min_gain: float = 0.01, keep: int = 1
) -> tuple[Ranges, Ranges]:
    """Drop blocks at the ends of ranges where more than ``keep`` nodes serve them (``keep``: the
    redundancy floor; a block never falls below it), while that raises the max
    flow by at least ``min_gain`` (a fraction): a node holding fewer blocks runs each token faster
    (Helix's ``T_j`` falls with ``j``), and dropping blocks loads nothing. Only nodes whose capacity the
    flow saturates are tried (trimming another cannot lift the max flow through a node), until
    ``deadline`` (``time.monotonic()``). Returns the ranges and the nodes trimmed (new ranges)."""
    num_blocks = cluster.model.num_blocks
    ranges = dict(ranges)
    current = evaluate(cluster, ranges, cost=cost, with_latency=False)
    value = current.throughput
    trimmed: Ranges = {}
    for _ in range(2 * len(ranges)):
        counts = _coverage(ranges, num_blocks)
        best: tuple[float, str, tuple[int, int]] | None = None
        for node_id, (start, end) in ranges.items():
            capacity = current.node_capacity.get(node_id, 0.0)
            if current.node_flows.get(node_id, 0.0) < capacity * (1.0 - 1e-6) or time.monotonic() > deadline:
                continue
            candidates = []
            for s in range(start + 1, end):  # drop [start, s): each block must stay served
                if counts[s - 1] < keep + 1:
                    break
                candidates.append((s, end))
            for e in range(end - 1, start, -1):  # drop [e, end)
                if counts[e] < keep + 1:
                    break
                candidates.append((start, e))
            for window in candidates:
                score = _throughput(cluster, {**ranges, node_id: window}, cost)
                if best is None or score > best[0]:
                    best = (score, node_id, window)
        if best is None or best[0] < value * (1.0 + min_gain) or best[0] <= _EPS:
            break
        _, node_id, window = best
        ranges[node_id] = window
        trimmed[node_id] = window
        current = evaluate(cluster, ranges, cost=cost, with_latency=False)
        value = current.throughput
    return ranges, trimmed


def _sticky_kind(sticky: _Sticky, previous: Mapping[str, tuple[int, int]]) -> str:
    if sticky.ranges == {n: tuple(r) for n, r in previous.items()}:
        return "keep"
    if sticky.repaired or sticky.clipped or sticky.dropped:
        return "repair"
    return "extend" if sticky.added else "trim"


def _sticky_text(sticky: _Sticky, kind: str, previous: Mapping[str, tuple[int, int]]) -> str:
    """What the sticky plan does, e.g. ``added ..abc with blocks [12, 20)``."""
    if kind == "keep":
        return "kept the placement"
    parts = [f"added {short_id(n)} with blocks [{s}, {e})" for n, (s, e) in sticky.added.items()]
    for node_id, (s, e) in sticky.repaired.items():
        old = previous.get(node_id)
        verb = "extended" if old is not None and s <= old[0] and old[1] <= e else "moved"
        parts.append(f"{verb} {short_id(node_id)} to [{s}, {e})")
    parts += [f"shrank {short_id(n)} to [{s}, {e})" for n, (s, e) in sticky.shrunk.items()]
    if not parts and sticky.dropped:
        parts.append("dropped " + ", ".join(short_id(n) for n in sticky.dropped))
    if not parts:
        parts.append("adjusted the placement")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------
# The fresh candidate
# ---------------------------------------------------------------------------------------------------


def _align(
    cluster: Cluster, cost: CostModel, ranges: Mapping[str, tuple[int, int]], previous: Mapping[str, tuple]
) -> Ranges:
    """The same plan with its ranges handed among interchangeable nodes (same hardware and links, so the
    flow graph is the same) so that each keeps as much of its previous range as possible (greedy)."""
    result = dict(ranges)
    for group in interchangeable_groups(cluster, cost):
        if len(group) < 2:
            continue
        slots = [ranges.get(n) for n in group]
        pairs = sorted(
            (_new_blocks(slot, _as_range(previous.get(n))), -_kept(slot, previous.get(n)), i, j)
            if slot is not None
            else (0, 0, i, j)
            for i, n in enumerate(group)
            for j, slot in enumerate(slots)
        )
        taken_nodes: set[int] = set()
        taken_slots: set[int] = set()
        for _moved, _kept_blocks, i, j in pairs:
            if i in taken_nodes or j in taken_slots:
                continue
            taken_nodes.add(i)
            taken_slots.add(j)
            slot = slots[j]
            if slot is None:
                result.pop(group[i], None)
            else:
                result[group[i]] = slot
    return result


def _kept(new: tuple[int, int], old: Sequence[int] | None) -> int:
    """Blocks of ``new`` that ``old`` already holds."""
    if old is None:
        return 0
    return max(0, min(new[1], int(old[1])) - max(new[0], int(old[0])))


def _percent(new: float, old: float) -> str:
    if old <= _EPS:
        return "the old one serves nothing" if new > _EPS else "neither serves anything"
    return f"{(new / old - 1.0) * 100.0:+.0f}%"


# ---------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------


def _finish(
    cluster: Cluster,
    cost: CostModel,
    ranges: Mapping[str, tuple[int, int]],
    previous: Mapping[str, tuple[int, int]] | None,
    algorithm: str,
    reason: str,
    max_reason_chars: int | None,
    floor: Floor | None = None,
) -> Decision:
    ranges, added = add_helpful(cluster, ranges, cost=cost)
    if added:
        reason += "; " + ", ".join(f"idle node {short_id(n)} added on blocks {w[0]}-{w[1] - 1} (+{g:.0f} tok/s)"
                                   for n, w, g in added)
    ranges = _ordered(ranges)
    ev = evaluate(cluster, ranges, cost=cost, with_latency=False)
    flows = {str(u): {str(v): float(f) for v, f in targets.items()} for u, targets in ev.flows.items()}
    old = {n: (int(r[0]), int(r[1])) for n, r in (previous or {}).items()}
    min_replicas = floor.min_replicas if floor is not None else 1
    below = tuple(floor_gaps(ranges, cluster.model.num_blocks, min_replicas))
    if below and floor is not None and min_replicas > 1:
        reason = f"{reason}; {floor_text(ranges, floor)}"
    reason = shorten_ids(reason)
    if max_reason_chars is not None and len(reason) > max_reason_chars:
        reason = reason[: max_reason_chars - 1] + "…"
    return Decision(
        placement=ranges,
        flows=flows,
        throughput=float(ev.throughput),
        algorithm=algorithm,
        reason=reason,
        moved_blocks=moved_blocks(ranges, old),
        changed=ranges != old,
        single_points=below,
        min_replicas=min_replicas,
    )


def _events_text(events: Sequence[str]) -> str:
    events = [e.strip() for e in events if e and e.strip()]
    if not events:
        return ""
    if len(events) > 4:
        return "; ".join(events[:3]) + f"; and {len(events) - 3} more changes"
    return "; ".join(events)


def _check_decide_options(improvement: float, max_reason_chars: int | None) -> None:
    """Refuse :func:`decide`'s unusable options (``min_replicas`` is checked by the redundancy floor)."""
    if improvement < 0:
        raise PlannerError(
            f"improvement must be >= 0 (a fraction, 0.2 = 20%), got {improvement}", code="bad_option"
        )
    if max_reason_chars is not None and max_reason_chars < 2:
        raise PlannerError(f"max_reason_chars must be at least 2, got {max_reason_chars}", code="bad_option")


def _first_placement(
    cluster: Cluster,
    cost: CostModel,
    previous: Mapping[str, tuple[int, int]] | None,
    algorithm: str,
    options: AlgorithmOptions,
    min_replicas: int,
    prefix: str,
    max_reason_chars: int | None,
    floor: Floor,
) -> Decision:
    """No previous placement: the fresh ``algorithm`` plan, nothing to stick to."""
    fresh = plan(cluster, algorithm, options=options, cost=cost, min_replicas=min_replicas)
    used = len(fresh.placement)
    text = f"first placement: {prefix}fresh {algorithm} plan over {used} node{'s' * (used != 1)}"
    text += f", {fresh.throughput:.0f} tok/s"
    ranges = dict(fresh.placement.items())
    return _finish(cluster, cost, ranges, previous, algorithm, text, max_reason_chars, floor)


def _aligned_fresh(
    cluster: Cluster, cost: CostModel, fresh: PlanResult, previous: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """The fresh plan's ranges aligned with ``previous`` (:func:`_align`), or as planned when aligning
    would lose throughput."""
    fresh_ranges = _align(cluster, cost, dict(fresh.placement.items()), previous)
    if _throughput(cluster, fresh_ranges, cost) < fresh.throughput * (1 - 1e-9):
        fresh_ranges = dict(fresh.placement.items())  # never trade throughput for stickiness here
    return fresh_ranges


def _why_not_sticky(
    sticky: _Sticky,
    kind: str,
    sticky_ok: bool,
    floor_ok: bool,
    sticky_value: float,
    fresh_value: float,
    min_replicas: int,
) -> str:
    """Why the fresh plan wins over the sticky candidate: the tail of the reason after its throughput."""
    if sticky_ok and not floor_ok:
        short = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in sticky.floor_short)
        return f"; the old one leaves blocks {short} on fewer than {min_replicas} nodes"
    if sticky_ok:
        how = {"keep": "keeping", "extend": "extending", "repair": "repairing", "trim": "trimming"}[kind]
        return f" vs {sticky_value:.0f} for {how} the old one ({_percent(fresh_value, sticky_value)})"
    if sticky.gaps:
        return f"; the old one cannot be repaired (blocks {_gaps_text(sticky.gaps)} unserved)"
    return "; the old one does not fit the nodes' capacity"


def fresh_options(algorithm: str, time_limit: float, min_replicas: int) -> AlgorithmOptions:
    """The options of a live re-plan with the node placement ``algorithm``: the re-plan's ``time_limit`` for
    an algorithm with a time limit (the MILP) and the redundancy floor for those that place for one
    (:mod:`planner.options`: ``MilpOptions``, ``PetalsOptions``, ``SwarmOptions``); the rest their defaults."""
    entry = lookup(algorithm, PLACEMENT)
    raw: dict[str, float | int] = {}
    if "time_limit" in entry.accepts:
        raw["time_limit"] = time_limit
    if MIN_REPLICAS in entry.accepts:
        raw[MIN_REPLICAS] = min_replicas
    return entry.options(**raw)


def decide(
    cluster: Cluster,
    previous: Mapping[str, tuple[int, int]] | None,
    *,
    algorithm: str = "milp",
    options: AlgorithmOptions | None = None,
    events: Sequence[str] = (),
    improvement: float = 0.2,
    time_limit: float = 10.0,
    max_reason_chars: int | None = None,
    min_replicas: int = 1,
) -> Decision:
    """The placement to publish for ``cluster`` given the ``previous`` one (None: first placement).

    ``events`` are human sentences about what changed (``node ..abc joined``); they start the reason.
    The sticky candidate wins when it serves every block and the fresh ``algorithm`` plan is less than
    ``improvement`` (a fraction) faster; otherwise the fresh plan is taken. ``max_reason_chars``: the
    longest reason the caller can store (the swarm's records limit it); longer ones end in ``…``.
    ``options``: the fresh plan's options, of ``algorithm``'s options type (:mod:`planner.options`); None
    builds them with :func:`fresh_options`. ``time_limit``: seconds a re-plan may take; the sticky search
    gets about half of it.
    ``min_replicas``: the redundancy floor (:mod:`planner.search.redundancy`): the sticky candidate is repaired
    up to it and trimmed never below it, the fresh plan is asked for it, and the sticky candidate only
    wins when it meets it as far as the offers allow (or the fresh plan falls as short); the decision's
    ``single_points`` and reason name the blocks left below it.
    Raises :class:`~swarmnode.planner.errors.CannotPlaceError` when neither candidate serves the model,
    and another :class:`~swarmnode.planner.errors.PlannerError` for unusable options.
    """
    _check_decide_options(improvement, max_reason_chars)
    min_replicas = check_min_replicas(min_replicas)
    options = fresh_options(algorithm, time_limit, min_replicas) if options is None else options
    cost = CostModel(cluster)
    sizes = _sizes(cluster, cost)
    num_blocks = cluster.model.num_blocks
    floor = achievable_floor(sizes.values(), num_blocks, min_replicas)
    what = _events_text(events)
    prefix = f"{what}: " if what else ""
    if not previous:
        return _first_placement(
            cluster, cost, previous, algorithm, options, min_replicas, prefix, max_reason_chars, floor
        )

    previous = {n: (int(r[0]), int(r[1])) for n, r in previous.items()}
    # the sticky search scores many placements; give it at most about half the fresh plan's time
    sticky = _sticky(cluster, cost, previous, sizes, time.monotonic() + max(1.0, time_limit / 2), floor)
    sticky_ok = not sticky.gaps and not placement_problems(cluster, sticky.ranges)
    sticky_short = floor.shortfall(replica_counts(sticky.ranges, num_blocks))
    sticky_value = _throughput(cluster, sticky.ranges, cost) if sticky_ok else 0.0
    kind = _sticky_kind(sticky, previous)
    prefix = prefix or ("no change in the swarm: " if kind == "keep" else "the swarm changed: ")
    try:
        fresh = plan(cluster, algorithm, options=options, cost=cost, min_replicas=min_replicas)
    except PlannerError as exc:
        if sticky_ok:
            text = f"{prefix}{_sticky_text(sticky, kind, previous)}; a fresh {algorithm} plan failed ({exc})"
            return _finish(cluster, cost, sticky.ranges, previous, kind, text, max_reason_chars, floor)
        if isinstance(exc, CannotPlaceError):
            raise
        old = f"blocks {_gaps_text(sticky.gaps)} unserved" if sticky.gaps else "over the nodes' capacity"
        raise CannotPlaceError(
            f"neither the old placement ({old}) nor a fresh {algorithm} plan serves the model: {exc}"
        ) from exc
    fresh_ranges = _aligned_fresh(cluster, cost, fresh, previous)
    fresh_value = fresh.throughput
    # the floor first: the sticky plan may fall short of it only where the fresh one falls as short
    floor_ok = sticky_short <= floor.shortfall(replica_counts(fresh_ranges, num_blocks))

    if sticky_ok and floor_ok and sticky_value > _EPS and fresh_value < (1.0 + improvement) * sticky_value:
        text = (
            f"{prefix}{_sticky_text(sticky, kind, previous)}; a fresh {algorithm} plan would give "
            f"{fresh_value:.0f} tok/s vs {sticky_value:.0f} ({_percent(fresh_value, sticky_value)}), "
            f"below the {improvement * 100:.0f}% threshold for moving blocks"
        )
        return _finish(cluster, cost, sticky.ranges, previous, kind, text, max_reason_chars, floor)
    moves = moved_blocks(fresh_ranges, previous)
    why = _why_not_sticky(sticky, kind, sticky_ok, floor_ok, sticky_value, fresh_value, min_replicas)
    text = f"{prefix}fresh {algorithm} plan, {fresh_value:.0f} tok/s{why}; loads {moves} blocks"
    return _finish(cluster, cost, fresh_ranges, previous, algorithm, text, max_reason_chars, floor)
