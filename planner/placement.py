"""The placement type: which contiguous half-open block range ``[start, end)`` each node serves.

Helix §4.1 (the placement function Psi from a compute node to a contiguous subset of the model) and
LLaMPS Alg. 1-2 (blocks assigned contiguously to servers) both produce this shape; every algorithm of the
planner returns a :class:`Placement`. Nodes that serve nothing are absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .cluster.spec import Cluster
from .costs.roofline import block_capacity
from .errors import CannotPlaceError, PlannerError

__all__ = ["Placement", "PlacementError", "placement_problems", "validate_placement"]


class PlacementError(PlannerError):
    """A placement that cannot serve the model (a block nobody serves, a range outside the model or over
    a node's memory, an unknown node). A cluster that cannot hold the model at all is a
    :class:`~planner.errors.CannotPlaceError` instead."""

    code = "invalid_placement"


class Placement(Mapping[str, tuple[int, int]]):
    """An immutable map ``node_id -> (start, end)`` of half-open block ranges (insertion order kept)."""

    __slots__ = ("_index", "ranges")

    def __init__(self, ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
        items = []
        for node_id, rng in (ranges or {}).items():
            start, end = int(rng[0]), int(rng[1])
            if not 0 <= start < end:
                raise PlacementError(f"node {node_id!r}: range [{start}, {end}) is empty or negative")
            items.append((str(node_id), start, end))
        self.ranges: tuple[tuple[str, int, int], ...] = tuple(items)
        self._index = {n: (s, e) for n, s, e in items}

    def __getitem__(self, node_id: str) -> tuple[int, int]:
        return self._index[node_id]

    def __iter__(self) -> Iterator[str]:
        return (n for n, _, _ in self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: [{s}, {e})" for n, s, e in self.ranges)
        return f"Placement({{{inner}}})"

    def __hash__(self) -> int:
        return hash(frozenset(self.ranges))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self.items()) == {k: tuple(v) for k, v in other.items()}
        return NotImplemented

    def size(self, node_id: str) -> int:
        start, end = self[node_id]
        return end - start

    def to_dict(self) -> dict[str, list[int]]:
        """JSON form: ``{node_id: [start, end]}``."""
        return {n: [s, e] for n, s, e in self.ranges}

    def coverage(self, num_blocks: int) -> list[int]:
        """How many nodes serve each block."""
        counts = [0] * num_blocks
        for _, start, end in self.ranges:
            for b in range(start, min(end, num_blocks)):
                counts[b] += 1
        return counts


def placement_problems(cluster: Cluster, placement: Mapping[str, tuple[int, int]]) -> list[str]:
    """Everything that makes ``placement`` invalid for ``cluster`` (empty list when valid): unknown nodes,
    ranges outside ``[0, num_blocks)``, more blocks than a node's memory (or ``max_blocks``) allows, and
    blocks nobody serves."""
    problems = []
    num_blocks = cluster.model.num_blocks
    covered = [False] * num_blocks
    for node_id, (start, end) in placement.items():
        if not cluster.has_node(node_id):
            problems.append(f"node {node_id!r} is not in cluster {cluster.name!r}")
            continue
        if not 0 <= start < end <= num_blocks:
            problems.append(f"node {node_id!r}: range [{start}, {end}) is not inside [0, {num_blocks})")
            continue
        capacity = block_capacity(cluster, cluster.node(node_id))
        if end - start > capacity:
            problems.append(f"node {node_id!r}: holds {end - start} blocks but its memory allows {capacity}")
        for b in range(start, end):
            covered[b] = True
    missing = [b for b, ok in enumerate(covered) if not ok]
    if missing:
        problems.append(f"blocks not served by any node: {_ranges_text(missing)}")
    return problems


def validate_placement(cluster: Cluster, placement: Mapping[str, tuple[int, int]]) -> None:
    """Raise :class:`PlacementError` listing every problem of :func:`placement_problems`."""
    problems = placement_problems(cluster, placement)
    if problems:
        raise PlacementError("invalid placement: " + "; ".join(problems))


def _ranges_text(blocks: list[int]) -> str:
    parts = []
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b == prev + 1:
            prev = b
            continue
        parts.append(f"[{start}, {prev + 1})")
        start = prev = b
    parts.append(f"[{start}, {prev + 1})")
    return ", ".join(parts)


def contiguous_fill(order: list[str], sizes: Mapping[str, int], num_blocks: int) -> Placement:
    """Give blocks ``[0, num_blocks)`` to the nodes of ``order`` one after another, each taking as many as
    ``sizes`` allows (the last one only what is left), until every block is served (LLaMPS Alg. 1 step
    13, Alg. 2 step 5). Raises :class:`~planner.errors.CannotPlaceError` when the nodes together hold
    too few blocks."""
    ranges: dict[str, tuple[int, int]] = {}
    position = 0
    for node_id in order:
        if position >= num_blocks:
            break
        size = min(sizes.get(node_id, 0), num_blocks - position)
        if size <= 0:
            continue
        ranges[node_id] = (position, position + size)
        position += size
    if position < num_blocks:
        total = sum(max(0, sizes.get(n, 0)) for n in order)
        raise CannotPlaceError(
            f"the nodes hold {total} blocks together but the model has {num_blocks}; "
            "add nodes or memory, or lower overhead_bytes"
        )
    return Placement(ranges)
