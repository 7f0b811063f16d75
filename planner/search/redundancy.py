"""The redundancy floor: keep every block on at least ``min_replicas`` nodes when the offers allow it.

Why. A volunteer swarm loses nodes every few minutes. With one replica of a block, each loss of its
holder leaves a gap that every client waits out until the coordinator replans and a node has loaded the
block again (minutes). With two replicas the swarm keeps serving through a single loss, at a lower rate,
while the replan runs. Helix's objective (§4.4) values throughput alone, so the planner's default stays
``min_replicas=1`` (the papers' numbers unchanged); the swarm's coordinator asks for 2.

The floor is a constraint, not an objective: placements maximise throughput subject to it.

The rule where the offers cannot hold ``min_replicas`` copies of every block. Every block is held at least
once (else the model cannot be served at all), and as many blocks as the nodes' capacities allow are held
``min_replicas`` times: :func:`achievable_floor` computes that number, ``blocks_at_floor``. Which blocks
reach the floor is left to the planner (the MILP picks them for throughput); only how many is fixed. A
placement *meets the floor* when every block has a holder and at least ``blocks_at_floor`` blocks have
``min_replicas`` holders (:meth:`Floor.met_by`); when the offers allow, that is every block.

How ``blocks_at_floor`` is found. A node holding fewer blocks than it can never adds a holder, so every
node holds its full capacity (capped at the model). When the capacities fill ``min_replicas`` rows each
covering the whole model (largest first, each into the row missing most: an ``r``-fold cover of a line
by intervals is ``r`` single covers), the floor holds everywhere. Otherwise a small exact covering MILP
over (capacity, start) counts maximises the number of blocks held ``min_replicas`` times with every block
held once (HiGHS, a few seconds at most; results are cached per set of capacities). The layout it finds
is :func:`floor_layout`, so a placement meeting the floor always exists to start from.

Plain data in, plain data out: no torch, no network.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import PlannerError

__all__ = [
    "Floor",
    "achievable_floor",
    "check_min_replicas",
    "floor_layout",
    "floor_text",
    "repair_floor",
    "replica_counts",
    "single_points",
]

Ranges = dict[str, tuple[int, int]]
#: How :func:`_floor_move` ranks a move: ``(gain, -blocks loaded, node had no range, -size, node, -start)``,
#: with ``rates`` led by the lowest summed throughput of a block after the move.
_MoveKey = tuple[int, int, bool, int, str, int]
_RatedMoveKey = tuple[float, int, int, bool, int, str, int]

_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def check_min_replicas(value: object) -> int:
    """``value`` as the floor (an integer >= 1), or a :class:`PlannerError` with code ``bad_option``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlannerError(
            f"min_replicas must be a whole number of nodes per block (1, 2, ...), got {value!r}",
            code="bad_option",
        )
    if value < 1:
        raise PlannerError(
            f"min_replicas must be at least 1 (every block on at least one node), got {value}",
            code="bad_option",
        )
    return int(value)


def replica_counts(placement: Mapping[str, Sequence[int]], num_blocks: int) -> list[int]:
    """How many nodes hold each block of ``[0, num_blocks)`` (ranges are half-open ``[start, end)``)."""
    counts = [0] * num_blocks
    for rng in placement.values():
        for b in range(max(0, int(rng[0])), min(int(rng[1]), num_blocks)):
            counts[b] += 1
    return counts


def single_points(
    placement: Mapping[str, Sequence[int]], num_blocks: int, min_replicas: int
) -> list[tuple[int, int]]:
    """Maximal half-open block ranges held by fewer than ``min_replicas`` nodes (empty when every block
    has ``min_replicas`` holders)."""
    return _runs([c < min_replicas for c in replica_counts(placement, num_blocks)])


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = None
    for b, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = b
        elif not flag and start is not None:
            runs.append((start, b))
            start = None
    return runs


# ---------------------------------------------------------------------------------------------------
# What the offers allow
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floor:
    """The floor a placement must meet: ``min_replicas`` holders on at least ``blocks_at_floor`` of the
    ``num_blocks`` blocks, every block at least one (module docstring). ``blocks_at_floor`` is
    ``num_blocks`` when the offers allow the floor everywhere."""

    min_replicas: int
    num_blocks: int
    blocks_at_floor: int

    @property
    def everywhere(self) -> bool:
        """Whether the offers allow ``min_replicas`` holders on every block."""
        return self.blocks_at_floor >= self.num_blocks

    @property
    def active(self) -> bool:
        """Whether the floor asks for more than one holder anywhere."""
        return self.min_replicas > 1 and self.blocks_at_floor > 0

    def met(self, counts: Sequence[int]) -> bool:
        """Whether per-block holder ``counts`` meet the floor."""
        if any(c < 1 for c in counts):
            return False
        return sum(1 for c in counts if c >= self.min_replicas) >= self.blocks_at_floor

    def met_by(self, placement: Mapping[str, Sequence[int]]) -> bool:
        return self.met(replica_counts(placement, self.num_blocks))

    def targets(self, counts: Sequence[int]) -> list[int]:
        """Per-block holder counts to aim at from ``counts``: ``min_replicas`` everywhere when the offers
        allow it, else on the run of ``blocks_at_floor`` blocks nearest to it already (most holders,
        capped at the floor; the earliest on ties) and one elsewhere."""
        r, m, L = self.min_replicas, self.blocks_at_floor, self.num_blocks
        if m >= L:
            return [r] * L
        if m <= 0:
            return [1] * L
        capped = [min(c, r) for c in counts]
        window = sum(capped[:m])
        best, best_start = window, 0
        for s in range(1, L - m + 1):
            window += capped[s + m - 1] - capped[s - 1]
            if window > best:
                best, best_start = window, s
        return [r if best_start <= b < best_start + m else 1 for b in range(L)]

    def shortfall(self, counts: Sequence[int]) -> int:
        """Holders missing to meet the floor (0 exactly when :meth:`met`): summed over blocks against
        :meth:`targets`."""
        if self.met(counts):
            return 0
        return sum(max(0, t - c) for t, c in zip(self.targets(counts), counts, strict=True))

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "min_replicas": self.min_replicas,
            "blocks_at_floor": self.blocks_at_floor,
            "num_blocks": self.num_blocks,
            "everywhere": self.everywhere,
        }


def achievable_floor(capacities: Iterable[int], num_blocks: int, min_replicas: int) -> Floor:
    """The floor the offers allow: the most blocks that can have ``min_replicas`` holders while every
    block has one, for nodes holding at most ``capacities`` contiguous blocks each (module docstring).
    Nodes that hold nothing count for nothing; when all together hold fewer than ``num_blocks`` blocks,
    ``blocks_at_floor`` is 0."""
    min_replicas = check_min_replicas(min_replicas)
    caps = tuple(sorted((min(int(c), num_blocks) for c in capacities if int(c) > 0), reverse=True))
    return Floor(min_replicas, num_blocks, _solve_floor(caps, num_blocks, min_replicas)[0])


@functools.lru_cache(maxsize=256)
def _solve_floor(caps: tuple[int, ...], length: int, r: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``blocks_at_floor`` for capacities ``caps`` (sorted, largest first, each at most ``length``) and a
    layout reaching it: ``(index into caps, start)`` per node used."""
    if sum(caps) < length:
        return 0, ()
    if r == 1 or sum(caps) >= r * length:
        rows = _greedy_rows(caps, [length] * r)
        if rows is not None:
            return length, _row_layout(caps, rows, length)
    if r == 1:  # pragma: no cover - one row of total capacity >= length always fills
        return 0, ()
    # a start: one row over the model and r - 1 rows over the longest run [0, m) the greedy fills
    lo, hi = 0, min(length, (sum(caps) - length) // (r - 1))
    start = _row_layout(caps, _greedy_rows(caps, [length]) or [], length)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        rows = _greedy_rows(caps, [length] + [mid] * (r - 1))
        if rows is None:
            hi = mid - 1
            continue
        lo = mid
        start = _row_layout(caps, rows[:1], length) + _row_layout(caps, rows[1:], mid, length)
    return _floor_milp(caps, length, r, tuple(sorted(start)))


def _greedy_rows(caps: Sequence[int], targets: list[int]) -> list[list[int]] | None:
    """Largest capacities first, each into the row still missing the most blocks; None when a row stays
    short."""
    rows: list[list[int]] = [[] for _ in targets]
    missing = list(targets)
    for i, c in enumerate(caps):  # caps are sorted, largest first
        j = max(range(len(targets)), key=lambda k: (missing[k], -k))
        if missing[j] <= 0:
            break
        rows[j].append(i)
        missing[j] -= min(c, targets[j])
    return rows if all(v <= 0 for v in missing) else None


def _row_layout(
    caps: Sequence[int], rows: list[list[int]], length: int, model: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Each row's nodes laid left to right over ``[0, length)``, a node reaching past the model's
    ``model`` blocks (default ``length``) slid back inside it."""
    model = length if model is None else model
    layout = []
    for row in rows:
        position = 0
        for i in row:
            if position >= length:
                break
            layout.append((i, min(position, model - caps[i])))
            position += caps[i]
    return tuple(sorted(layout))


def _floor_milp(
    caps: tuple[int, ...], length: int, r: int, start: tuple[tuple[int, int], ...]
) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The exact floor when the greedy rows fall short: per capacity ``c`` and start ``s`` an integer
    ``x[c, s]`` (nodes of that capacity on ``[s, s + c)``; a node holding less is never better), per
    block a binary ``y_b`` (held ``r`` times); every block held ``1 + (r - 1) y_b`` times, at most as many
    nodes of each capacity as there are; maximise ``sum y_b`` (HiGHS, a few seconds at most) from the
    layout ``start``, which it returns when it finds nothing better."""
    from .milp_model import SparseModel

    model = SparseModel()
    kinds: dict[int, list[int]] = {}
    for i, c in enumerate(caps):
        kinds.setdefault(c, []).append(i)
    x: dict[tuple[int, int], int] = {}
    holders: list[list[tuple[int, float]]] = [[] for _ in range(length)]
    for c, members in kinds.items():
        for s in range(length - c + 1):
            x[(c, s)] = model.var(0, len(members), integer=True)
            for b in range(s, s + c):
                holders[b].append((x[(c, s)], 1.0))
        model.row([(x[(c, s)], 1.0) for s in range(length - c + 1)], -math.inf, len(members))
    y = [model.var(0, 1, integer=True, obj=1.0) for _ in range(length)]
    for b in range(length):
        model.row([*holders[b], (y[b], -(r - 1.0))], 1.0, math.inf)
    # every node full: sum of holders <= sum(caps), and it is >= length + (r - 1) sum y
    upper = min(length, (sum(caps) - length) // (r - 1))
    # the objective is whole: a bound less than one above the incumbent proves it
    values = [0.0] * model.num_vars
    for i, s in start:
        values[x[(caps[i], s)]] += 1
    start_value = _at_floor(caps, start, length, r)
    for b, held in enumerate(_held(caps, start, length)):
        values[y[b]] = 1.0 if held >= r else 0.0
    outcome = model.solve(time_limit=5.0, start=values, stop_at=upper - 0.5, mip_rel_gap=0.9 / length)
    if outcome.values is None:  # pragma: no cover - the start is feasible
        return start_value, start
    layout = []
    for c, members in kinds.items():
        starts = [s for s in range(length - c + 1) for _ in range(round(outcome.values[x[(c, s)]]))]
        layout += list(zip(members, starts, strict=False))
    value = _at_floor(caps, layout, length, r)
    if value <= start_value or min(_held(caps, layout, length)) < 1:
        return start_value, start
    return value, tuple(sorted(layout))


def _held(caps: Sequence[int], layout: Iterable[tuple[int, int]], length: int) -> list[int]:
    counts = [0] * length
    for i, s in layout:
        for b in range(s, s + caps[i]):
            counts[b] += 1
    return counts


def _at_floor(caps: Sequence[int], layout: Iterable[tuple[int, int]], length: int, r: int) -> int:
    return sum(1 for c in _held(caps, layout, length) if c >= r)


def floor_layout(
    capacities: Mapping[str, int],
    num_blocks: int,
    min_replicas: int,
    groups: Mapping[str, str] | None = None,
) -> Ranges:
    """A placement meeting the floor the offers allow (:func:`achievable_floor`), each node it uses at its
    full capacity; nodes it does not need are left out. Empty when the nodes cannot hold the model.
    Nodes of equal capacity are interchangeable for the floor; with ``groups`` (e.g. each node's region)
    they are handed out so that neighbouring ranges go to nodes of one group where they can (a pipeline
    then crosses few slow links)."""
    ids = [n for n in capacities if int(capacities[n]) > 0]
    ids.sort(key=lambda n: -min(int(capacities[n]), num_blocks))  # stable: ties keep the given order
    caps = tuple(min(int(capacities[n]), num_blocks) for n in ids)
    _, layout = _solve_floor(caps, num_blocks, check_min_replicas(min_replicas))
    if groups is None:
        return {ids[i]: (s, s + caps[i]) for i, s in layout}
    # the slots of each capacity, left to right, go to that capacity's nodes taken group by group
    ranges: Ranges = {}
    for c in sorted(set(caps)):
        slots = sorted(s for i, s in layout if caps[i] == c)
        members = sorted((n for n, cap in zip(ids, caps, strict=True) if cap == c), key=lambda n: groups.get(n, ""))
        for n, s in zip(members, slots, strict=False):
            ranges[n] = (s, s + c)
    return ranges


# ---------------------------------------------------------------------------------------------------
# Repair
# ---------------------------------------------------------------------------------------------------


def _new_blocks(new: tuple[int, int], old: tuple[int, int] | None) -> int:
    if old is None:
        return new[1] - new[0]
    return new[1] - new[0] - max(0, min(new[1], old[1]) - max(new[0], old[0]))


def _prefix(flags: Sequence[bool]) -> list[int]:
    out = [0]
    for f in flags:
        out.append(out[-1] + (1 if f else 0))
    return out


def _lowest_after(others: Sequence[float], rate: float, size: int) -> list[float]:
    """For every start of a ``size``-block window, the lowest summed throughput over the blocks once a
    node of throughput ``rate`` holds that window, the others giving ``others`` per block (the max flow
    when links never bind)."""
    import numpy as np

    cov = np.asarray(others, dtype=float)
    L = len(cov)
    inf = np.array([np.inf])
    before = np.concatenate([inf, np.minimum.accumulate(cov)])  # before[s]: min over blocks < s
    after = np.concatenate([np.minimum.accumulate(cov[::-1])[::-1], inf])  # after[e]: min over blocks >= e
    inside = np.lib.stride_tricks.sliding_window_view(cov, size).min(axis=1) + rate
    starts = np.arange(L - size + 1)
    return np.minimum(np.minimum(before[starts], after[starts + size]), inside).tolist()


def _floor_move(
    ranges: Ranges,
    capacities: Mapping[str, int],
    floor: Floor,
    previous: Mapping[str, tuple[int, int]] | None,
    all_sizes: bool,
    rates: Mapping[str, Sequence[float]] | None = None,
) -> tuple[str, tuple[int, int]] | None:
    """One node's new range that lowers the shortfall (:meth:`Floor.shortfall`) the most without leaving
    any block below its target that was not before; ties go to the move loading the fewest blocks, then to
    a node without a range, then to the smaller window. With ``rates`` (per node, throughput by blocks
    held) the move keeping the lowest summed throughput of a block highest goes first."""
    L = floor.num_blocks
    counts = replica_counts(ranges, L)
    targets = floor.targets(counts)
    need = _prefix([c < t for c, t in zip(counts, targets, strict=True)])
    tight = _prefix([c <= t for c, t in zip(counts, targets, strict=True)])
    served = [0.0] * L
    if rates is not None:
        for n, (s, e) in ranges.items():
            for b in range(s, e):
                served[b] += rates[n][e - s]
    best_key: _MoveKey | _RatedMoveKey | None = None
    best = None
    for node_id in sorted(capacities):
        cap = min(int(capacities[node_id]), L)
        if cap <= 0:
            continue
        current = ranges.get(node_id)
        old = previous.get(node_id) if previous is not None else current
        old = None if old is None else (int(old[0]), int(old[1]))
        loaded_now = 0 if current is None else _new_blocks(current, old)
        smallest = 1 if current is None else current[1] - current[0]
        sizes = range(smallest, cap + 1) if all_sizes else sorted({cap, smallest if current else cap})
        lost_now = 0 if current is None else tight[current[1]] - tight[current[0]]
        others = list(served)
        if rates is not None and current is not None:
            for b in range(*current):
                others[b] -= rates[node_id][current[1] - current[0]]
        for size in sizes:
            kept = None
            for start in range(L - size + 1):
                end = start + size
                if current is None:
                    gain = need[end] - need[start]
                else:
                    lo, hi = max(start, current[0]), min(end, current[1])
                    both_need = need[hi] - need[lo] if lo < hi else 0
                    both_tight = tight[hi] - tight[lo] if lo < hi else 0
                    gain = (need[end] - need[start] - both_need) - (lost_now - both_tight)
                if gain <= 0:
                    continue
                window = (start, end)
                loads = _new_blocks(window, old) - loaded_now
                key: _MoveKey | _RatedMoveKey = (gain, -loads, current is None, -size, node_id, -start)
                if rates is not None:
                    if kept is None:
                        kept = _lowest_after(others, rates[node_id][size], size)
                    key = (round(kept[start], 6), *key)
                if best_key is None or key > best_key:
                    best_key, best = key, (node_id, window)
    return best


def repair_floor(
    ranges: Mapping[str, tuple[int, int]],
    capacities: Mapping[str, int],
    floor: Floor,
    *,
    previous: Mapping[str, tuple[int, int]] | None = None,
    all_sizes: bool = True,
    deadline: float | None = None,
    rates: Mapping[str, Sequence[float]] | None = None,
) -> tuple[Ranges, Ranges]:
    """Raise ``ranges`` towards ``floor`` with the smallest moves: one node at a time takes the window
    that lowers the shortfall most (a node without a range takes any window it can hold; a node with one
    slides or grows, never shrinks), never dropping a block below its target; the fewest newly loaded
    blocks (against ``previous``, by default ``ranges``) break ties, then a node without a range. Only
    nodes in ``capacities`` move. ``all_sizes=False`` tries only a node's full capacity and its current
    size (faster). ``rates`` (per node, its throughput by blocks held: ``rates[n][k]``) puts throughput
    first: the move leaving the least-served block best served wins, then the rules above. Stops when the
    floor is met, no move helps, or at ``deadline`` (``time.monotonic()``). Returns the ranges and the
    nodes moved (their new ranges)."""
    result: Ranges = {n: (int(r[0]), int(r[1])) for n, r in ranges.items()}
    moved: Ranges = {}
    if not floor.active:
        return result, moved
    for _ in range(floor.num_blocks * floor.min_replicas + len(capacities)):
        if floor.met(replica_counts(result, floor.num_blocks)):
            break
        if deadline is not None and time.monotonic() > deadline:
            break
        move = _floor_move(result, capacities, floor, previous, all_sizes, rates)
        if move is None:
            break
        result[move[0]] = move[1]
        moved[move[0]] = move[1]
    return result, moved


# ---------------------------------------------------------------------------------------------------
# Words
# ---------------------------------------------------------------------------------------------------


def _word(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def _blocks_text(runs: Sequence[tuple[int, int]]) -> str:
    parts = [f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in runs]
    if len(parts) > 4:
        parts = [*parts[:3], f"{len(parts) - 3} more runs"]
    text = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return ("block " if len(runs) == 1 and runs[0][1] - runs[0][0] == 1 else "blocks ") + text


def floor_text(placement: Mapping[str, Sequence[int]], floor: Floor) -> str:
    """A sentence naming the blocks below the floor, e.g. ``blocks 10-14 have one replica: the offers
    cannot hold two``; empty when every block has ``min_replicas`` holders. Blocks nobody holds are
    named as unserved."""
    counts = replica_counts(placement, floor.num_blocks)
    r = floor.min_replicas
    if all(c >= r for c in counts):
        return ""
    parts = []
    for level in range(0, r):
        runs = _runs([c == level for c in counts])
        if not runs:
            continue
        if level == 0:
            parts.append(f"{_blocks_text(runs)} unserved")
            continue
        plural = len(runs) > 1 or runs[0][1] - runs[0][0] > 1
        verb = "have" if plural else "has"
        parts.append(f"{_blocks_text(runs)} {verb} {_word(level)} replica{'s' * (level != 1)}")
    text = "; ".join(parts)
    if floor.met(counts):
        return f"{text}: the offers cannot hold {_word(r)}"
    return f"{text}: below the floor of {_word(r)}"
