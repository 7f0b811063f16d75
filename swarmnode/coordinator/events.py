"""The changes of a live swarm that the coordinator re-plans for, as typed events.

Each event says what changed (its fields) and, through `str`, the sentence the log and the placement's
reason show. What the coordinator decides with is the event's `key`: which change it is, never how the
sentence happens to read. The debounce (`Coordinator.tick`) waits until the set of keys stops changing, so a
joining node whose measured speed is refined, or a slow link whose reading wobbles, is one change that is
still under way, not a new one each time; and rewording a log line cannot change when the swarm re-plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmnode.naming import short_id

__all__ = ["AlgorithmChanged", "ChangeEvent", "LinkChanged", "NodeJoined", "NodeLeft", "OfferChanged",
           "RangeTooLarge", "fingerprint"]


@dataclass(frozen=True)
class NodeJoined:
    """A plannable node the last plan did not count: its offer in blocks and its measured speed."""

    peer: str
    max_blocks: int
    block_throughput: float

    @property
    def key(self) -> tuple:
        return ("joined", self.peer)

    def __str__(self) -> str:
        return (f"node {short_id(self.peer)} joined ({self.max_blocks} blocks, {self.block_throughput:.0f} tok/s "
                f"per block)")


@dataclass(frozen=True)
class OfferChanged:
    """A planned node whose offer (blocks, memory, cores) or measured speed changed since the last plan
    (`service._changed` says what counts)."""

    peer: str

    @property
    def key(self) -> tuple:
        return ("offer", self.peer)

    def __str__(self) -> str:
        return f"node {short_id(self.peer)} changed its offer or speed"


@dataclass(frozen=True)
class RangeTooLarge:
    """A node whose placed range holds more blocks than it now offers (`max_blocks`): once serving, its
    processes grew beyond the reserve its first offer kept (`server.memory_plan.SERVING_RESERVE_BYTES`), and
    the range leaves it less KV cache than `MIN_CACHE_TOKENS` per block. However small the change in
    `max_blocks`, the placement no longer fits the node, so it is re-planned (the sticky plan clips the range)."""

    peer: str
    blocks: int
    max_blocks: int

    @property
    def key(self) -> tuple:
        return ("range", self.peer, self.max_blocks)

    def __str__(self) -> str:
        return (f"node {short_id(self.peer)} holds {self.blocks} blocks but now offers {self.max_blocks} "
                f"(with room for its KV cache)")


@dataclass(frozen=True)
class NodeLeft:
    """A node the last plan counted or the placement assigns, gone from the plannable records."""

    peer: str

    @property
    def key(self) -> tuple:
        return ("left", self.peer)

    def __str__(self) -> str:
        return f"node {short_id(self.peer)} left"


@dataclass(frozen=True)
class LinkChanged:
    """A measured link between two plannable nodes that can now limit the swarm, measured for the first
    time (`was` None) or moved by `cluster_view.LINK_CHANGE_FACTOR` or more (`cluster_view.link_changes`)."""

    a: str
    b: str
    mbps: float
    was: float | None

    @property
    def key(self) -> tuple:
        return ("link", self.a, self.b)

    def __str__(self) -> str:
        change = f"was {_mbps(self.was)}" if self.was is not None else "first measurement"
        return f"link {short_id(self.a)}-{short_id(self.b)} measured at {_mbps(self.mbps)} Mbps ({change})"


@dataclass(frozen=True)
class AlgorithmChanged:
    """A coordinator that took over a predecessor's placement plans with another algorithm (with phases
    where the placement has none, or the other way round): it plans once rather than keep the old kind."""

    coordinator: str
    algorithm: str

    @property
    def key(self) -> tuple:
        return ("algorithm", self.coordinator, self.algorithm)

    def __str__(self) -> str:
        return f"coordinator {short_id(self.coordinator)} plans with --algorithm {self.algorithm}"


ChangeEvent = NodeJoined | OfferChanged | RangeTooLarge | NodeLeft | LinkChanged | AlgorithmChanged


def fingerprint(events: list[ChangeEvent]) -> frozenset[tuple]:
    """Which changes are under way: the debounce restarts when this set changes."""
    return frozenset(event.key for event in events)


def _mbps(value: float) -> str:
    """A bandwidth for a sentence, to two significant figures below 10 Mbps."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"
