"""Petals' block selection (Borzunov et al., 2023), the baseline of Helix §6.6.

Servers join one after another (here in the spec's order); each takes a window of as many consecutive
blocks as its memory holds, choosing the window whose blocks have the least summed throughput so far
(the throughput a server adds to each block it holds is its ``T_j``, Helix's per-node throughput holding
``j`` blocks). Ties go to the earliest window. If blocks are still unserved after every server has
joined, servers re-choose in turn, as Petals' periodic rebalancing does, now preferring the windows that
serve the most uncovered blocks, until the model is covered.
"""

from __future__ import annotations

from .cluster import Cluster
from .cost_model import CostModel
from .errors import CannotPlaceError
from .placement import Placement, PlacementError

__all__ = ["petals"]


def _window_sums(per_block: list[float], size: int) -> list[float]:
    sums = []
    current = sum(per_block[:size])
    sums.append(current)
    for start in range(1, len(per_block) - size + 1):
        current += per_block[start + size - 1] - per_block[start - 1]
        sums.append(current)
    return sums


def petals(cluster: Cluster, *, cost: CostModel | None = None, order: list[str] | None = None) -> Placement:
    """Place the model as Petals servers would, joining in ``order`` (default: the spec's order)."""
    cost = cost or CostModel(cluster)
    num_blocks = cluster.model.num_blocks
    order = list(order or cluster.node_ids)
    sizes = {}
    for node_id in order:
        feasible = cost.feasible_sizes(node_id)
        if feasible:
            sizes[node_id] = min(max(feasible), num_blocks)
    if sum(sizes.values()) < num_blocks:
        raise CannotPlaceError(
            f"the nodes hold {sum(sizes.values())} blocks together but the model has {num_blocks}; "
            "add nodes or memory"
        )
    per_block = [0.0] * num_blocks
    chosen: dict[str, int] = {}

    def add(node_id: str, start: int, sign: float) -> None:
        rate = cost.throughput(node_id, sizes[node_id])
        for b in range(start, start + sizes[node_id]):
            per_block[b] += sign * rate

    for node_id in order:
        if node_id not in sizes:
            continue
        sums = _window_sums(per_block, sizes[node_id])
        start = min(range(len(sums)), key=lambda s: (sums[s], s))
        chosen[node_id] = start
        add(node_id, start, 1.0)

    for _ in range(len(order) + 1):
        if all(v > 0 for v in per_block):
            break
        for node_id in order:
            if node_id not in chosen or all(v > 0 for v in per_block):
                continue
            add(node_id, chosen[node_id], -1.0)
            size = sizes[node_id]
            sums = _window_sums(per_block, size)
            uncovered = [sum(1 for b in range(s, s + size) if per_block[b] <= 0) for s in range(len(sums))]
            start = min(range(len(sums)), key=lambda s: (-uncovered[s], sums[s], s))
            chosen[node_id] = start
            add(node_id, start, 1.0)
    if not all(v > 0 for v in per_block):
        raise PlacementError("Petals' block selection left blocks unserved")
    return Placement({n: (s, s + sizes[n]) for n, s in chosen.items()})
