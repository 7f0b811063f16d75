"""One compute thread per node that batches concurrent sessions' steps together.

Handlers submit steps and await a future. The thread takes every step that arrived while the previous
batch ran (HexGen-2 / Orca-style continuous batching without a wait window), groups decode steps that
cover the same blocks, and runs each group through `BlockStack.step` as one batch. Prefill steps (more
than one new token) run on their own so a long prompt does not hold up other sessions' short steps more
than once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from swarmnode.errors import ERROR_MOVED, SwarmError
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.kv_cache import SessionCache

logger = logging.getLogger(__name__)


class SchedulerClosedError(SwarmError, RuntimeError):
    """A step submitted after its unit stopped serving (its placement changed, or the node is stopping)."""

    code = ERROR_MOVED


@dataclass
class StepTask:
    cache: SessionCache | None  # None: a stateless forward
    start: int
    end: int
    hidden: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


class StepScheduler:
    def __init__(self, stack: BlockStack, *, max_batch_rows: int = 64):
        self.stack = stack
        self.max_batch_rows = max_batch_rows
        self._queue: queue.SimpleQueue[StepTask | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="swarmnode-compute", daemon=True)
        self.steps_done = 0
        self.batches_done = 0
        self.busy_seconds = 0.0
        self._closed = False
        self._thread.start()

    def submit(self, task: StepTask) -> Future:
        if self._closed:
            task.future.set_exception(SchedulerClosedError("this node stopped serving these blocks"))
            return task.future
        self._queue.put(task)
        return task.future

    def shutdown(self, timeout: float) -> bool:
        """Stop the compute thread after the steps already queued; later submits fail at once.

        Waits up to `timeout` s for the thread (a running step cannot be interrupted), so it blocks the
        calling thread: coroutines call it through an executor (`ServingUnit.aclose`). True when the
        thread has stopped; False when a step still runs (the daemon thread ends after it).
        """
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            pending = [task]
            while True:  # everything that arrived while the last batch ran
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                pending.append(more)
            # a step whose caller gave up (timeout, closed stream) before it started is dropped here;
            # the rest are marked running, so they can no longer be cancelled half-way
            pending = [t for t in pending if t.future.set_running_or_notify_cancel()]
            for group in self._groups(pending):
                self._execute(group)
            # do not keep the last batch's sessions (their caches) alive while waiting for the next one
            task = more = pending = group = None

    def _groups(self, tasks: list[StepTask]) -> list[list[StepTask]]:
        groups: list[list[StepTask]] = []
        decode: dict[tuple[int, int], list[StepTask]] = defaultdict(list)
        for task in tasks:
            if task.cache is not None and task.hidden.shape[1] == 1:
                decode[(task.start, task.end)].append(task)
            else:
                groups.append([task])
        for same_span in decode.values():
            batch: list[StepTask] = []
            rows = 0
            seen: set[int] = set()
            for task in same_span:
                if batch and (rows + task.hidden.shape[0] > self.max_batch_rows or id(task.cache) in seen):
                    groups.append(batch)
                    batch, rows, seen = [], 0, set()
                batch.append(task)
                rows += task.hidden.shape[0]
                seen.add(id(task.cache))
            groups.append(batch)
        return groups

    def _execute(self, group: list[StepTask]) -> None:
        began = time.perf_counter()
        try:
            first = group[0]
            if first.cache is None:
                outputs = [self.stack.forward(first.start, first.end, first.hidden, first.position_ids, first.mask)]
            else:
                hidden = torch.cat([t.hidden for t in group]) if len(group) > 1 else first.hidden
                positions = torch.cat([t.position_ids for t in group]) if len(group) > 1 else first.position_ids
                mask = torch.cat([t.mask for t in group]) if len(group) > 1 else first.mask
                out = self.stack.step([t.cache for t in group], first.start, first.end, hidden, positions, mask)
                outputs = list(out.split([t.hidden.shape[0] for t in group])) if len(group) > 1 else [out]
            for task, output in zip(group, outputs):
                task.future.set_result(output.to("cpu", copy=False))
        except Exception as exc:  # a step failed: its callers get the error, the node goes on
            logger.exception("step of %d session(s) failed", len(group))
            for task in group:
                if not task.future.done():
                    task.future.set_exception(exc)
        finally:
            self.busy_seconds += time.perf_counter() - began
            self.batches_done += 1
            self.steps_done += len(group)
