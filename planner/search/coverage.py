"""Block coverage: the max flow of a placement when links never bind, and a solver for it.

With partial inference (Helix §4.4) a token at position ``p`` (blocks ``[0, p)`` done) may go to any node
``j`` with ``s_j <= p < e_j`` and leaves it at ``e_j``. Every token processes block ``b`` in exactly one
node that holds ``b``, so the nodes holding ``b`` form a vertex cut of Helix's flow graph; conversely a
set of nodes that misses, for every block, one of the nodes holding it is no cut (a token can hop from
position to position through the missed nodes). Hence, when links and coordinator links are never the
bottleneck, the max flow equals the *minimum block coverage*::

    min over blocks b of  sum over nodes i holding b of T_i(e_i - s_i)

This turns Helix's MILP into a covering problem over node types (interchangeable nodes): an integer
``x[t, s, k]`` counts the nodes of type ``t`` on ``[s, s + k)``, and ``F <= sum T_t(k) x`` for every
block. :func:`solve_coverage` improves a starting placement with a large-neighbourhood search (windows of
blocks around the bottleneck re-optimised exactly by small MILPs), then runs the full covering MILP from
that incumbent until the time limit, an early stop, or a proof of optimality.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..costs.roofline import CostModel
from .milp_model import SparseModel

__all__ = ["CoverageResult", "beam_coverage", "coverage_profile", "solve_coverage"]


def coverage_profile(
    cost: CostModel, ranges: Mapping[str, tuple[int, int]], num_blocks: int, offset: int = 0
) -> list[float]:
    """Summed ``T_i`` of the nodes holding each block of ``[offset, offset + num_blocks)``."""
    cov = [0.0] * num_blocks
    for n, (s, e) in ranges.items():
        rate = cost.throughput(n, e - s)
        for b in range(max(s, offset), min(e, offset + num_blocks)):
            cov[b - offset] += rate
    return cov


def _beam_feasible(
    rates: list[dict[int, float]], counts: list[int], length: int, target: float, width: int, deadline: float
) -> list[tuple[int, int, int]] | None:
    """Beam search for a placement whose every block has coverage >= ``target``.

    Blocks are swept left to right; an interval is only started at a block whose coverage is still
    below the target (any solution can be rearranged that way by shifting intervals right), or ends at
    the last block. States are ranked by their slack: the area the unused nodes could still add plus
    what started intervals add from here on, minus ``target`` for every block left (negative slack
    cannot be completed and is pruned). Returns ``(type, start, size)`` triples, or None."""
    areas = [max((k * r for k, r in tp.items()), default=0.0) for tp in rates]
    options = [(t, k, r) for t, tp in enumerate(rates) for k, r in sorted(tp.items())]
    # a state: (counts, actives (end, rate) sorted, placed intervals)
    states: list[tuple[tuple[int, ...], tuple[tuple[int, float], ...], tuple[tuple[int, int, int], ...]]] = [
        (tuple(counts), (), ())
    ]
    for b in range(length):
        done: dict[tuple, tuple[float, tuple]] = {}
        pending = [(cnt, tuple(a for a in act if a[0] > b), placed, 0) for cnt, act, placed in states]
        while pending:
            if time.monotonic() > deadline:
                return None
            grown: dict[tuple, tuple[float, tuple]] = {}
            for cnt, act, placed, first in pending:
                covered = sum(r for _, r in act)
                slack = (
                    sum(c * a for c, a in zip(cnt, areas, strict=True))
                    + sum(r * (e - b) for e, r in act)
                    - target * (length - b)
                )
                if slack < -1e-6:
                    continue
                key = (cnt, act)
                if covered >= target - 1e-9:
                    if key not in done or done[key][0] < slack:
                        done[key] = (slack, (cnt, act, placed))
                    continue
                for i in range(first, len(options)):
                    t, k, r = options[i]
                    if cnt[t] == 0:
                        continue
                    start = b if b + k <= length else length - k
                    if start < 0:
                        continue
                    new_cnt = (*cnt[:t], cnt[t] - 1, *cnt[t + 1 :])
                    new_act = tuple(sorted((*act, (start + k, r))))
                    new_slack = slack - r * (b - start)
                    new_key = (new_cnt, new_act)
                    if new_key not in grown or grown[new_key][0] < new_slack:
                        grown[new_key] = (new_slack, (new_cnt, new_act, (*placed, (t, start, k)), i))
            best = sorted(grown.values(), key=lambda item: -item[0])[:width]
            pending = [state for _, state in best]
        if not done:
            return None
        ranked = sorted(done.values(), key=lambda item: -item[0])[:width]
        states = [state for _, state in ranked]
    return list(states[0][2]) if states else None


def beam_coverage(
    cost: CostModel,
    groups: list[list[str]],
    length: int,
    *,
    low: float,
    high: float,
    time_limit: float,
    width: int = 64,
    tolerance: float = 1e-3,
) -> tuple[dict[str, tuple[int, int]] | None, float]:
    """Bisect the coverage target between ``low`` (known reachable) and ``high`` (an upper bound) with
    :func:`_beam_feasible`; returns the best placement found (or None) and its minimum coverage."""
    deadline = time.monotonic() + time_limit
    rates = [{k: cost.throughput(g[0], k) for k in _sizes(cost, g[0], length)} for g in groups]
    counts = [len(g) for g in groups]
    best_ranges = None
    best_value = 0.0
    while high - low > tolerance * high and time.monotonic() < deadline:
        target = (low + high) / 2
        found = _beam_feasible(rates, counts, length, target, width, deadline)
        if found is None:
            if time.monotonic() >= deadline:
                break
            high = target
            continue
        ranges: dict[str, tuple[int, int]] = {}
        used = [0] * len(groups)
        for t, start, k in found:
            ranges[groups[t][used[t]]] = (start, start + k)
            used[t] += 1
        value = min(coverage_profile(cost, ranges, length))
        if value > best_value:
            best_ranges, best_value = ranges, value
        low = max(target, value)
    return best_ranges, best_value


@dataclass(frozen=True)
class CoverageResult:
    ranges: dict[str, tuple[int, int]]
    value: float
    bound: float | None
    status: str
    lns_seconds: float
    milp_seconds: float
    lns_iterations: int


def _sizes(cost: CostModel, node_id: str, length: int) -> list[int]:
    return [k for k in cost.feasible_sizes(node_id) if k <= length]


def _lns_step(
    cost: CostModel,
    groups: list[list[str]],
    ranges: dict[str, tuple[int, int]],
    free: set[str],
    lo: int,
    hi: int,
    length: int,
    near: float,
    time_limit: float,
    targets: list[int] | None = None,
) -> dict[str, tuple[int, int]] | None:
    """Re-place the ``free`` nodes optimally inside ``[lo, hi)`` (or where they are now), maximising the
    minimum coverage and, second, the coverage of blocks below ``near``. ``targets``: a redundancy floor
    (:mod:`planner.search.redundancy`): every block ``b`` still held by at least ``targets[b]`` nodes."""
    fixed = {n: r for n, r in ranges.items() if n not in free}
    base = coverage_profile(cost, fixed, length)
    held = [0] * length
    for s, e in fixed.values():
        for b in range(s, e):
            held[b] += 1
    model = SparseModel()
    f = model.var(0.0, math.inf, obj=1.0)
    terms: list[list[tuple[int, float]]] = [[] for _ in range(length)]
    holders: list[list[tuple[int, float]]] = [[] for _ in range(length)]
    y: dict[tuple[int, int, int], int] = {}
    free_groups = [[n for n in members if n in free] for members in groups]
    free_groups = [g for g in free_groups if g]
    for t, members in enumerate(free_groups):
        rep = members[0]
        options = {(s, k) for k in _sizes(cost, rep, hi - lo) for s in range(lo, hi - k + 1)}
        options |= {(ranges[n][0], ranges[n][1] - ranges[n][0]) for n in members}
        keys = []
        for s, k in sorted(options):
            rate = cost.throughput(rep, k)
            v = model.var(0, len(members), integer=True)
            y[(t, s, k)] = v
            keys.append(v)
            for b in range(s, s + k):
                terms[b].append((v, -rate))
                holders[b].append((v, 1.0))
        model.row([(v, 1.0) for v in keys], len(members), len(members))
    z = []
    for b in range(length):
        model.row([(f, 1.0), *terms[b]], -math.inf, base[b])
        zb = model.var(-math.inf, near, obj=1.0 / length)
        model.row([(zb, 1.0), *terms[b]], -math.inf, base[b])
        z.append(zb)
        if targets is not None and targets[b] > held[b]:
            model.row(holders[b], float(targets[b] - held[b]), math.inf)
    start = [0.0] * model.num_vars
    current = coverage_profile(cost, ranges, length)
    start[f] = min(current)
    for t, members in enumerate(free_groups):
        for n in members:
            s, e = ranges[n]
            start[y[(t, s, e - s)]] += 1
    for b in range(length):
        start[z[b]] = min(near, current[b])
    outcome = model.solve(time_limit=time_limit, start=start, mip_rel_gap=1e-6)
    if outcome.values is None:
        return None
    new = dict(fixed)
    for t, members in enumerate(free_groups):
        intervals = []
        for (tt, s, k), v in sorted(y.items()):
            if tt == t:
                intervals += [(s, s + k)] * round(outcome.values[v])
        if len(intervals) != len(members):
            return None
        for n, r in zip(members, intervals, strict=True):
            new[n] = r
    return new


def _typed_milp(
    cost: CostModel,
    groups: list[list[str]],
    ranges: dict[str, tuple[int, int]],
    length: int,
    time_limit: float,
    stop_at: float,
    on_improve: Callable[[float, float], None] | None,
    mip_rel_gap: float,
) -> tuple[dict[str, tuple[int, int]] | None, float | None, float | None, str]:
    """The covering MILP over node types: ``max F`` subject to ``F <= sum T_t(k) x[t, s, k]`` over the
    intervals holding each block and ``sum_{s,k} x[t, s, k] <= n_t``, warm-started from ``ranges``."""
    model = SparseModel()
    # Helix's bound restricted to these nodes: total layer-rate over the blocks (tightens HiGHS' search)
    area = sum(len(m) * max(k * cost.throughput(m[0], k) for k in _sizes(cost, m[0], length)) for m in groups)
    f = model.var(0.0, area / length, obj=1.0)
    terms: list[list[tuple[int, float]]] = [[] for _ in range(length)]
    x: dict[tuple[int, int, int], int] = {}
    for t, members in enumerate(groups):
        rep = members[0]
        keys = []
        for k in _sizes(cost, rep, length):
            rate = cost.throughput(rep, k)
            for s in range(length - k + 1):
                v = model.var(0, len(members), integer=True)
                x[(t, s, k)] = v
                keys.append(v)
                for b in range(s, s + k):
                    terms[b].append((v, -rate))
        model.row([(v, 1.0) for v in keys], -math.inf, len(members))
    for b in range(length):
        model.row([(f, 1.0), *terms[b]], -math.inf, 0.0)
    start = [0.0] * model.num_vars
    start[f] = min(coverage_profile(cost, ranges, length)) if ranges else 0.0
    for t, members in enumerate(groups):
        for n in members:
            if n in ranges:
                s, e = ranges[n]
                start[x[(t, s, e - s)]] += 1
    outcome = model.solve(
        time_limit=time_limit,
        start=start if ranges else None,
        stop_at=stop_at,
        on_improve=on_improve,
        mip_rel_gap=mip_rel_gap,
    )
    if outcome.values is None:
        return None, None, outcome.bound, outcome.status
    new: dict[str, tuple[int, int]] = {}
    for t, members in enumerate(groups):
        intervals = []
        for (tt, s, k), v in sorted(x.items()):
            if tt == t:
                intervals += [(s, s + k)] * round(outcome.values[v])
        for n, r in zip(members, intervals, strict=False):
            new[n] = r
    return new, outcome.objective, outcome.bound, outcome.status


def _initial_ranges(
    cost: CostModel, groups: list[list[str]], length: int, start: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """Every node's starting range: its range in ``start``, else its smallest feasible block count at
    block 0; a node that fits no block count up to ``length`` gets none and is left out."""
    ranges: dict[str, tuple[int, int]] = {}
    for n in (n for members in groups for n in members):
        if n in start:
            ranges[n] = start[n]
        else:
            sizes = _sizes(cost, n, length)
            if sizes:
                ranges[n] = (0, min(sizes))
    return ranges


def _lns_neighbourhood(
    cost: CostModel,
    ranges: dict[str, tuple[int, int]],
    cov: list[float],
    length: int,
    widths: list[int],
    rng: random.Random,
) -> tuple[int, int, set[str]]:
    """A random window ``[lo, hi)`` around a bottleneck block (one whose coverage is within 0.1% of the
    minimum) and the nodes it frees: those lying inside it, plus up to three random others that fit in it."""
    low = min(cov)
    bottlenecks = [b for b in range(length) if cov[b] <= low * (1 + 1e-3)]
    b = rng.choice(bottlenecks)
    w = rng.choice(widths)
    lo = max(0, min(b - rng.randrange(w), length - w))
    hi = lo + w
    free = {n for n, (s, e) in ranges.items() if lo <= s and e <= hi}
    outside = [n for n in ranges if n not in free and min(_sizes(cost, n, length)) <= w]
    rng.shuffle(outside)
    free |= set(outside[: rng.randint(0, 3)])
    return lo, hi, free


def _lns_key(cov: list[float], near: float) -> tuple[float, float]:
    """How the search ranks placements: the minimum coverage first, then the coverage of the blocks below
    ``near`` (so that lifting some of several bottleneck blocks counts as progress)."""
    return round(min(cov), 6), sum(min(c, near) for c in cov)


def _large_neighbourhood_search(
    cost: CostModel,
    groups: list[list[str]],
    length: int,
    ranges: dict[str, tuple[int, int]],
    best: float,
    *,
    t0: float,
    budget: float,
    stop_at: float,
    rng: random.Random,
    on_improve: Callable[[float, float], None] | None,
) -> tuple[dict[str, tuple[int, int]], float, int]:
    """Re-optimise random windows around the bottleneck (:func:`_lns_neighbourhood`, :func:`_lns_step`)
    until ``budget`` seconds after ``t0`` or the coverage reaches ``stop_at``, keeping a new placement when
    :func:`_lns_key` ranks it higher. Returns the placement, its minimum coverage and the iterations run."""
    iterations = 0
    widths = sorted({min(length, w) for w in (8, 12, 16, 24, 32, 48)})
    while time.monotonic() - t0 < budget and best < stop_at:
        iterations += 1
        cov = coverage_profile(cost, ranges, length)
        low = min(cov)
        lo, hi, free = _lns_neighbourhood(cost, ranges, cov, length, widths, rng)
        if not free:
            continue
        near = low * 1.02
        step_limit = min(2.0, max(0.2, budget - (time.monotonic() - t0)))
        new = _lns_step(cost, groups, ranges, free, lo, hi, length, near, step_limit)
        if new is None:
            continue
        new_cov = coverage_profile(cost, new, length)
        if _lns_key(new_cov, near) > _lns_key(cov, near):
            ranges = new
            if min(new_cov) > best + 1e-9:
                best = min(new_cov)
                if on_improve is not None:
                    on_improve(best, math.inf)
    return ranges, best, iterations


def _milp_from_incumbent(
    cost: CostModel,
    groups: list[list[str]],
    length: int,
    ranges: dict[str, tuple[int, int]],
    best: float,
    time_limit: float,
    stop_at: float,
    on_improve: Callable[[float, float], None] | None,
    mip_rel_gap: float,
) -> tuple[dict[str, tuple[int, int]], float, float | None, str]:
    """Run the covering MILP (:func:`_typed_milp`) warm-started from ``ranges`` and keep its placement when
    it places every node and beats ``best``. Returns the placement, its minimum coverage, the MILP's bound
    and its status."""
    improved, _objective, bound, status = _typed_milp(
        cost, groups, ranges, length, time_limit, stop_at, on_improve, mip_rel_gap
    )
    if improved is not None and len(improved) == len(ranges):
        value = min(coverage_profile(cost, improved, length))
        if value > best + 1e-9:
            return improved, value, bound, status
    return ranges, best, bound, status


def solve_coverage(
    cost: CostModel,
    groups: list[list[str]],
    length: int,
    start: Mapping[str, tuple[int, int]],
    *,
    time_limit: float,
    stop_at: float = math.inf,
    lns_share: float = 0.35,
    mip_rel_gap: float = 1e-4,
    seed: int = 0,
    on_improve: Callable[[float, float], None] | None = None,
) -> CoverageResult:
    """Maximise the minimum coverage of ``length`` blocks by the nodes of ``groups`` (lists of
    interchangeable nodes), starting from ``start`` (ranges inside ``[0, length)``).

    ``lns_share`` of the time goes to the large-neighbourhood search, the rest to the covering MILP over
    node types; both stop once the coverage reaches ``stop_at``. Returns every node's range, the minimum
    coverage, and the MILP's proven upper bound (None when it did not run)."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    ranges = _initial_ranges(cost, groups, length, start)
    groups = [[n for n in members if n in ranges] for members in groups]
    groups = [g for g in groups if g]
    best = min(coverage_profile(cost, ranges, length))
    if on_improve is not None:
        on_improve(best, math.inf)
    ranges, best, iterations = _large_neighbourhood_search(
        cost,
        groups,
        length,
        ranges,
        best,
        t0=t0,
        budget=time_limit * lns_share,
        stop_at=stop_at,
        rng=rng,
        on_improve=on_improve,
    )
    lns_seconds = time.monotonic() - t0
    bound: float | None = None
    status = "lns"
    remaining = time_limit - (time.monotonic() - t0)
    if best < stop_at and remaining > 0.2:
        ranges, best, bound, status = _milp_from_incumbent(
            cost, groups, length, ranges, best, remaining, stop_at, on_improve, mip_rel_gap
        )
    return CoverageResult(
        ranges=ranges,
        value=best,
        bound=bound,
        status=status,
        lns_seconds=lns_seconds,
        milp_seconds=time.monotonic() - t0 - lns_seconds,
        lns_iterations=iterations,
    )
