"""A serving unit: one loaded range of blocks with its KV-cache budget and its compute thread.

A node serves one unit normally and two while it moves to a new range (the new one loads while the old
one still serves). Sessions hold the unit they opened on; when a unit is retired its compute thread
stops, its open sessions get an error that sends their clients to another peer, and its memory is freed.
"""

from __future__ import annotations

from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.runtime.scheduler import StepScheduler


class ServingUnit:
    def __init__(self, stack: BlockStack, budget: CacheBudget):
        self.stack, self.budget = stack, budget
        self.scheduler = StepScheduler(stack)
        self.sessions: set[str] = set()
        self.closed = False
        self.retiring = False  # finishing its sessions; neither announced nor given new ones

    @property
    def live(self) -> bool:
        return not self.closed and not self.retiring

    @property
    def start(self) -> int:
        return self.stack.start

    @property
    def end(self) -> int:
        return self.stack.end

    @property
    def span(self) -> tuple[int, int]:
        return (self.stack.start, self.stack.end)

    def covers(self, start: int, end: int) -> bool:
        return self.stack.start <= start < end <= self.stack.end

    def close(self) -> None:
        self.closed = True
        self.scheduler.shutdown()

    def __repr__(self) -> str:
        return f"ServingUnit[{self.start}, {self.end})"
