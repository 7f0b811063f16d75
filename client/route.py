"""A session's route: the hops its steps go through, the inputs kept to replay them, and where it stands.

`Route` is what a transport (`client.transports`) steps on: the open hop streams covering blocks
[start, end) in order (`client.hops.HopStream`), the client's own inputs for every step (push mode: a
replacement or a rebuilt route is replayed from them), the number of tokens every hop has cached
(`position`) and its counters (routes rebuilt, prompts handed over by prefill nodes). Its methods are what
transports do to it: replace a failed hop by the hops that take over its blocks, name the hop after another
(where a step is pushed), the hops sharing blocks with a range (where a prefill node hands KV caches over),
the whole sequence's inputs, and taking every hop off it to close or rebuild it. It makes no call to a peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from swarmnode.client.hops import Chunk, HopStream, concat, cut


@dataclass
class Route:
    """The hops of blocks [start, end), in order; empty before the first step, while rebuilt and once closed.

    Indexing, `len` and iteration are over the hops."""

    start: int
    end: int
    hops: list[HopStream] = field(default_factory=list)
    inputs: list[Chunk] = field(default_factory=list)  # push mode: the first hop's inputs, every step's
    position: int = 0  # tokens every hop has cached
    restarts: int = 0  # push mode: routes rebuilt because a failed hop's inputs could not be read
    prefills: int = 0  # prompts run on prefill nodes and handed over to the decode route (HexGen-2)

    def __len__(self) -> int:
        return len(self.hops)

    def __getitem__(self, index: int) -> HopStream:
        return self.hops[index]

    def __iter__(self) -> Iterator[HopStream]:
        return iter(self.hops)

    @property
    def opened(self) -> bool:
        """Whether the route has hops (they are opened on their first step)."""
        return bool(self.hops)

    def is_last(self, index: int) -> bool:
        return index == len(self.hops) - 1

    def after(self, index: int) -> HopStream | None:
        """The hop after hop `index` (the one its output goes to), None after the last."""
        return None if self.is_last(index) else self.hops[index + 1]

    def replace(self, index: int, replacement: list[HopStream]) -> None:
        """Hop `index` is replaced by `replacement`, the hops that took its blocks over."""
        self.hops[index:index + 1] = replacement

    def covering(self, start: int, end: int) -> list[HopStream]:
        """The hops holding some block of [start, end)."""
        return [h for h in self.hops if h.hop.start < end and start < h.hop.end]

    def take(self) -> list[HopStream]:
        """Every hop, taken off the route (to close them, or to rebuild the route)."""
        hops, self.hops = self.hops, []
        return hops

    def keep_outputs(self) -> None:
        """Every hop but the last keeps its outputs (push mode: to feed a replacement of the next one)."""
        for hop in self.hops:
            hop.keep_outputs = hop.hop.end < self.end

    def unrun(self) -> bool:
        """Whether some hop has neither run a step nor been filled by a handover (its cache must be replayed)."""
        return any(h.pending is None and not h.filled for h in self.hops)

    def rewind(self, length: int) -> None:
        """Forget every token from `length` on: the kept inputs and each hop's cached history are cut there and
        `position` becomes `length`. The nodes roll their caches back when the next step continues from
        `length` (`StepMeta.prefix_length` below what they hold)."""
        self.inputs = cut(self.inputs, length)
        for hop in self.hops:
            hop.history = cut(hop.history, length)
            hop.seed = []
        self.position = length

    def sequence(self, chunk: Chunk) -> Chunk:
        """The first hop's inputs for the whole sequence: every step's kept so far, then `chunk`."""
        return concat([*self.inputs, chunk])
