"""A serving unit: one loaded range of blocks with its KV-cache budget and its compute thread.

A node serves one unit normally and two while it moves to a new range (the new one loads while the old
one still serves). Sessions hold the unit they opened on; when a unit is retired its compute thread
stops, its open sessions get an error that sends their clients to another peer, and its memory is freed.

Stopping the compute thread waits for the step it is running (up to `CLOSE_TIMEOUT`); coroutines close a
unit with `aclose`, which waits on another thread, so the node's RPCs and heartbeat go on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time

from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.runtime.scheduler import DEFAULT_PREFILL_CHUNK, StepScheduler

logger = logging.getLogger(__name__)

# Longest wait for the compute thread's running step when a unit closes; a longer step is abandoned.
CLOSE_TIMEOUT = 10.0


class ServingUnit:
    def __init__(self, stack: BlockStack, budget: CacheBudget, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.stack, self.budget = stack, budget
        self.scheduler = StepScheduler(stack, prefill_chunk=prefill_chunk)
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
        """Stop serving: refuse new steps, wait (bounded) for the running one; blocks the calling thread."""
        self.closed = True
        began = time.monotonic()
        stopped = self.scheduler.shutdown(timeout=CLOSE_TIMEOUT)
        logger.info("blocks [%d, %d) closed after %.1f s (%s)", self.start, self.end, time.monotonic() - began,
                    "compute thread stopped" if stopped else "a step still running is left to finish on its own")

    async def aclose(self) -> None:
        """`close` for coroutines: the wait for the compute thread runs on a worker thread, not the event loop."""
        self.closed = True  # at once: steps arriving meanwhile are refused
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __repr__(self) -> str:
        return f"ServingUnit[{self.start}, {self.end})"
