"""One compute thread per node that batches concurrent sessions' decode steps and runs prompts in chunks.

Handlers submit steps and await a future. The thread takes every step that arrived while the previous
batch ran (HexGen-2 / Orca-style continuous batching without a wait window) and, on each turn, first runs
the decode steps waiting (one-token steps, grouped by the blocks they cover and run through
`BlockStack.step` as one batch), then one unit of prompt work: a prompt of at most `prefill_chunk` tokens
whole, or the next `prefill_chunk` tokens of a longer one, which then goes behind the prompts waiting
(Sarathi-Serve's chunked prefills with decode steps first, as vLLM's chunked-prefill scheduler runs them;
prompts take turns chunk by chunk, so a short prompt arriving during a long one waits for one chunk, not
for the long one's end). A decode step therefore waits for at most one chunk, not for a whole long prompt
(the prompt tokens each one waited behind are counted in `decode_waits` and the node metric
`swarmnode_node_decode_wait_tokens`: at most `prefill_chunk` behind sessions' prompts; a stateless forward,
such as a verifying client's check, runs whole and counts all its tokens);
the simulator (`planner.simulator.engine`) models nodes the same way. A chunked prompt's cache grows chunk by chunk
through the same masks and caches as a whole one (`BlockStack.step` masks by cache position), so its outputs
equal running it whole up to the rounding of the smaller matrix products; a step that fails half-way leaves
its cache as it was.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

import torch

from swarmnode import metrics
from swarmnode.errors import ERROR_MOVED, SwarmError
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.kv_cache import SessionCache

logger = logging.getLogger(__name__)

#: Prompt tokens a node runs in one go by default (`join --prefill-chunk`): large enough that a chunk's
#: matrix products run at the CPU's full prompt speed, small enough that a decode step waiting behind it is
#: held for a fraction of a second on a few blocks.
DEFAULT_PREFILL_CHUNK = 256


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
    prompt_tokens_before: int = -1  # the scheduler's `prompt_tokens_done` when it was submitted (-1: not yet)
    held: bool = False  # it waited behind its own session's prompt, as it must: not counted in `decode_waits`

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def is_decode(self) -> bool:
        return self.cache is not None and self.tokens == 1


@dataclass
class _Prompt:
    """Prompt work in the queue that takes turns: a stateless forward or a prompt run whole, or a long prompt
    run `chunk` tokens per turn (`done` tokens so far, their outputs in `outputs`)."""

    task: StepTask
    chunk: int  # tokens per turn; the whole step when it is not chunked
    done: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    length_before: int = 0  # the cache's length when the first chunk ran, restored if a later one fails

    @property
    def finished(self) -> bool:
        return self.done >= self.task.tokens


class StepScheduler:
    def __init__(self, stack: BlockStack, *, max_batch_rows: int = 64, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        """`prefill_chunk`: the most prompt tokens run between two turns of decode steps (0: prompts run whole)."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk is {prefill_chunk}: give a number of tokens, or 0 to run prompts whole")
        self.stack = stack
        self.max_batch_rows = max_batch_rows
        self.prefill_chunk = prefill_chunk
        self._queue: queue.SimpleQueue[StepTask | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="swarmnode-compute", daemon=True)
        self.steps_done = 0
        self.batches_done = 0
        self.chunks_done = 0  # prompt chunks run (a chunked prompt counts one per chunk)
        self.prompt_tokens_done = 0  # prompt positions run (a chunk's, or a whole prompt's or forward's)
        #: how many decode steps waited behind how many prompt tokens (other sessions' prompt positions), from
        #: submit to run: the promise of chunked prefill is at most `prefill_chunk` (the chunk running when the
        #: step arrived); a node running prompts whole holds them for a whole prompt
        self.decode_waits: dict[int, int] = defaultdict(int)
        self._counting = threading.Lock()
        self.busy_seconds = 0.0
        self._closed = False
        self._thread.start()

    def submit(self, task: StepTask) -> Future:
        if self._closed:
            task.future.set_exception(SchedulerClosedError("this node stopped serving these blocks"))
            return task.future
        with self._counting:  # in the queue before the chunk running now is counted, or after with its count
            task.prompt_tokens_before = self.prompt_tokens_done
            self._queue.put(task)
        return task.future

    def shutdown(self, timeout: float) -> bool:
        """Stop the compute thread after the steps already queued; later submits fail at once.

        A prompt run in chunks stops after the chunk it is running (its step fails with
        `SchedulerClosedError`). Waits up to `timeout` s for the thread (a running chunk or step cannot be
        interrupted), so it blocks the calling thread: coroutines call it through an executor
        (`ServingUnit.aclose`). True when the thread has stopped; False when a step still runs (the daemon
        thread ends after it).
        """
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        prompts: deque[_Prompt] = deque()  # prompt work, taking turns a chunk at a time
        held: list[StepTask] = []  # decode steps of a session whose prompt is still queued or running
        closing = False
        # the turn's work, dropped (set to None) at its end
        arrived: list[StepTask] | None
        decode: list[StepTask] | None
        group: list[StepTask] | None
        prompt: _Prompt | None
        while True:
            arrived, closing = self._take(wait=not (prompts or held) and not closing, closing=closing)
            if closing and not (arrived or prompts or held):
                return
            # a step whose caller gave up (timeout, closed stream) before it started is dropped here;
            # the rest are marked running, so they can no longer be cancelled half-way
            arrived = [t for t in arrived if t.future.set_running_or_notify_cancel()]
            decode = []
            for task in [*held, *arrived]:
                if task.is_decode:
                    decode.append(task)
                else:
                    prompts.append(self._prompt(task))
            busy = {id(p.task.cache) for p in prompts if p.task.cache is not None}
            held = [t for t in decode if id(t.cache) in busy]  # a session's steps run in the order it sent them
            for task in held:
                task.held = True
            for group in self._decode_groups([t for t in decode if id(t.cache) not in busy]):
                self._execute(group)
            if prompts and closing and prompts[0].done:  # a prompt half-way through: its session moves on
                self._abandon(prompts.popleft())
            elif prompts:
                prompt = prompts.popleft()
                self._advance(prompt)
                if not (prompt.finished or prompt.task.future.done()):
                    prompts.append(prompt)  # its next chunk after the prompts waiting behind it
                prompt = None
            # do not keep the last batch's sessions (their caches) alive while waiting for the next one
            arrived = decode = group = None

    def _take(self, *, wait: bool, closing: bool) -> tuple[list[StepTask], bool]:
        """Every step that arrived since the last turn (waiting for the first when `wait`), and whether the
        scheduler is closing (its stop mark was seen)."""
        tasks: list[StepTask] = []
        if closing:
            wait = False
        while True:
            try:
                task = self._queue.get() if wait and not tasks else self._queue.get_nowait()
            except queue.Empty:
                return tasks, closing
            if task is None:
                return tasks, True
            tasks.append(task)

    def _prompt(self, task: StepTask) -> _Prompt:
        chunked = task.cache is not None and 0 < self.prefill_chunk < task.tokens
        return _Prompt(task, self.prefill_chunk if chunked else task.tokens)

    def _decode_groups(self, tasks: list[StepTask]) -> list[list[StepTask]]:
        groups: list[list[StepTask]] = []
        decode: dict[tuple[int, int], list[StepTask]] = defaultdict(list)
        for task in tasks:
            decode[(task.start, task.end)].append(task)
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
        """One batch of decode steps covering the same blocks."""
        for task in group:
            if not task.held and task.prompt_tokens_before >= 0:
                waited = self.prompt_tokens_done - task.prompt_tokens_before
                self.decode_waits[waited] += 1
                metrics.NODE_DECODE_WAIT_TOKENS.observe(waited)
        began = time.perf_counter()
        try:
            first = group[0]
            hidden = torch.cat([t.hidden for t in group]) if len(group) > 1 else first.hidden
            positions = torch.cat([t.position_ids for t in group]) if len(group) > 1 else first.position_ids
            mask = torch.cat([t.mask for t in group]) if len(group) > 1 else first.mask
            caches = cast(list[SessionCache], [t.cache for t in group])  # decode steps hold one (`is_decode`)
            out = self.stack.step(caches, first.start, first.end, hidden, positions, mask)
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

    def _abandon(self, prompt: _Prompt) -> None:
        """Fail a chunked prompt the scheduler stops before its end (its unit closes): its cache is left as it
        was, and its client goes to another peer rather than waiting for chunks nobody will use."""
        assert prompt.task.cache is not None, "only a session's prompt runs in chunks"
        prompt.task.cache.length = prompt.length_before
        prompt.outputs = []
        prompt.task.future.set_exception(
            SchedulerClosedError(f"this node stopped serving these blocks after {prompt.done} of the prompt's "
                                 f"{prompt.task.tokens} tokens"))

    def _count_chunk(self, tokens: int) -> None:
        with self._counting:
            self.chunks_done += 1
            self.prompt_tokens_done += tokens

    def _advance(self, prompt: _Prompt) -> None:
        """Run the prompt's next chunk (the whole step when it is not chunked); on its last chunk the caller
        gets the outputs of all its tokens. A failure restores the cache's length and fails the step."""
        task = prompt.task
        began = time.perf_counter()
        a, b = prompt.done, min(prompt.done + prompt.chunk, task.tokens)
        counted = False
        try:
            if task.cache is None:
                out = self.stack.forward(task.start, task.end, task.hidden, task.position_ids, task.mask)
            else:
                cache = task.cache
                if a == 0:
                    prompt.length_before = cache.length
                    if cache.length + task.tokens > cache.max_length:  # refuse before any chunk runs
                        raise ValueError(f"session would hold {cache.length + task.tokens} tokens, more than its "
                                         f"max_length {cache.max_length}")
                out = self.stack.step([cache], task.start, task.end, task.hidden[:, a:b],
                                      task.position_ids[:, a:b], task.mask[:, a:b])
            prompt.outputs.append(out.to("cpu", copy=False))
            prompt.done = b
            self._count_chunk(b - a)  # before the caller can see its result
            counted = True
            if prompt.finished:
                outputs, prompt.outputs = prompt.outputs, []
                task.future.set_result(outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1))
        except Exception as exc:
            logger.exception("prompt step of %d token(s) failed at tokens %d:%d", task.tokens, a, b)
            if task.cache is not None:
                task.cache.length = prompt.length_before
            prompt.outputs = []
            if not counted:
                self._count_chunk(b - a)
                counted = True
            if not task.future.done():
                task.future.set_exception(exc)
        finally:
            self.busy_seconds += time.perf_counter() - began
            if prompt.finished or task.future.done():
                self.batches_done += 1
                self.steps_done += 1
