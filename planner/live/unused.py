"""Why a placement leaves a node out: the best window the node could take and what it would add there.

A swarm's operators and volunteers see nodes that offer memory and serve nothing; each one needs a reason
it can act on. For every node of ``cluster`` that ``placement`` does not use, :func:`unused_reasons` tries
the node on every window of each size it can hold (Helix §4.4: a node holds one contiguous range of
blocks) added to the placement, scores each on Helix's flow graph (§4.3, :func:`flow_graph.evaluate`),
and says what the best one would add: nothing (the node cannot hold a block, or its speed and links add
no flow because the pipeline is limited elsewhere), throughput (so the next re-plan should take it), or
replicas of blocks below the placement's redundancy floor. Plain data in, plain data out: no network,
no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from swarmnode.naming import short_id

from ..cluster.spec import Cluster
from ..costs.roofline import CostModel
from ..flow_graph import evaluate

__all__ = ["MAX_SIZES", "MAX_WINDOWS", "MIN_GAIN", "add_helpful", "best_addition", "describe", "unused_reasons"]

#: The most window starts, and window sizes, tried per node; longer models and larger offers are sampled
#: evenly (always with the largest size), which keeps a swarm's re-plan to a fraction of a second per node.
MAX_WINDOWS = 48
MAX_SIZES = 8
#: A left-out node whose best window raises the max flow by more than this share is worth adding.
MIN_GAIN = 0.01
_EPS = 1e-9


def _sizes(sizes: list[int]) -> list[int]:
    sizes = sorted(set(sizes))
    if len(sizes) <= MAX_SIZES:
        return sizes
    step = (len(sizes) - 1) / (MAX_SIZES - 1)
    return sorted({sizes[round(i * step)] for i in range(MAX_SIZES)})


def _starts(num_blocks: int, size: int) -> list[int]:
    count = num_blocks - size + 1
    if count <= MAX_WINDOWS:
        return list(range(count))
    step = (count - 1) / (MAX_WINDOWS - 1)
    return sorted({round(i * step) for i in range(MAX_WINDOWS)})


def best_addition(
    cluster: Cluster, placement: Mapping[str, tuple[int, int]], node_id: str, *, cost: CostModel | None = None,
    base: float | None = None,
) -> tuple[tuple[int, int] | None, float]:
    """The window ``(start, end)`` on which adding ``node_id`` to ``placement`` raises the max flow most,
    and that gain in tokens/s (``(None, 0.0)`` when the node cannot hold a single block). ``base``: the
    placement's own max flow, when the caller has it."""
    cost = cost or CostModel(cluster)
    sizes = [s for s in cost.feasible_sizes(node_id) if 1 <= s <= cluster.num_blocks]
    if not sizes:
        return None, 0.0
    if base is None:
        base = evaluate(cluster, placement, cost=cost, with_latency=False).throughput
    best: tuple[tuple[int, int] | None, float] = (None, -1.0)
    for size in _sizes(sizes):
        for start in _starts(cluster.num_blocks, size):
            window = (start, start + size)
            trial = {**placement, node_id: window}
            gain = evaluate(cluster, trial, cost=cost, with_latency=False).throughput - base
            if gain > best[1] + _EPS:
                best = (window, gain)
    return best[0], max(0.0, best[1])


def add_helpful(
    cluster: Cluster, placement: Mapping[str, tuple[int, int]], *, cost: CostModel | None = None,
    min_gain: float = MIN_GAIN,
) -> tuple[dict[str, tuple[int, int]], list[tuple[str, tuple[int, int], float]]]:
    """``placement`` with every left-out node that raises the max flow by more than ``min_gain`` (a share
    of it) added on its best window, greedily (largest gain first, re-scored after each addition): no offer
    waits unplanned while it could help. Returns the placement and ``(node, window, gain)`` per addition.
    Adding a node loads blocks only on that node; no placed node moves."""
    cost = cost or CostModel(cluster)
    ranges = dict(placement)
    added: list[tuple[str, tuple[int, int], float]] = []
    while True:
        base = evaluate(cluster, ranges, cost=cost, with_latency=False).throughput
        best: tuple[str, tuple[int, int], float] | None = None
        for node_id in cluster.node_ids:
            if node_id in ranges:
                continue
            window, gain = best_addition(cluster, ranges, node_id, cost=cost, base=base)
            if window is not None and gain > max(_EPS, min_gain * base) and (best is None or gain > best[2]):
                best = (node_id, window, gain)
        if best is None:
            return ranges, added
        ranges[best[0]] = best[1]
        added.append(best)


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in ranges)


def unused_reasons(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    *,
    cost: CostModel | None = None,
    single_points: list[tuple[int, int]] | tuple[tuple[int, int], ...] = (),
    min_replicas: int = 1,
) -> dict[str, str]:
    """One sentence per node of ``cluster`` that ``placement`` leaves out, saying why, keyed by node id.

    ``single_points``: block ranges ``[start, end)`` the placement holds on fewer than ``min_replicas``
    nodes; a left-out node that could hold some of them is named as a spare replica the placement missed."""
    cost = cost or CostModel(cluster)
    left_out = [n for n in cluster.node_ids if n not in placement]
    if not left_out:
        return {}
    base = evaluate(cluster, placement, cost=cost, with_latency=False).throughput
    reasons: dict[str, str] = {}
    for node_id in left_out:
        sizes = [s for s in cost.feasible_sizes(node_id) if s >= 1]
        if not sizes:
            reasons[node_id] = "its offer holds no block with room for its KV cache: offer more memory"
            continue
        window, gain = best_addition(cluster, placement, node_id, cost=cost, base=base)
        largest = max(sizes)
        covers = [(a, min(b, a + largest)) for a, b in single_points]
        if gain <= max(_EPS, 1e-3 * base):
            text = (f"adds no throughput: on its best window of up to {largest} blocks the flow is limited by "
                    f"other nodes or links ({base:.0f} tok/s planned either way)")
            if covers and min_replicas > 1:
                text += f"; could replicate single-point blocks {_ranges_text(covers)}"
        else:
            assert window is not None  # a positive gain comes from a window tried (best_addition)
            text = (f"would add {gain:.0f} tok/s ({100 * gain / max(base, _EPS):.0f}%) on blocks "
                    f"{window[0]}-{window[1] - 1}; the next re-plan takes it")
        reasons[node_id] = text
    return reasons


def describe(reasons: Mapping[str, str]) -> str:
    """The reasons as one line for logs: ``..abc: why; ..def: why``."""
    return "; ".join(f"{short_id(n)}: {why}" for n, why in sorted(reasons.items()))
