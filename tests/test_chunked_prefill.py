"""Chunked prefill: a node runs a long prompt a chunk at a time, with other sessions' decode steps between.

In-process checks on SmolLM2's real blocks (`runtime.scheduler.StepScheduler` over a `BlockStack`):

- a prompt run in chunks gives the outputs, cache and following decode steps of the same prompt run whole;
- while a long prompt runs, another session's decode steps go on between its chunks (counted by order of
  completion, not by time), where a node that runs prompts whole makes them wait for the whole prompt;
- a prompt that cannot fit its session is refused before any chunk runs, and a prompt half-way through when
  its unit closes fails with the error that sends its client elsewhere, its cache left as it was.

The same property through a real node process and the client library, in time as a user sees it, is
`test_swarm_chunked_prefill`.
"""

from __future__ import annotations

import time

import pytest
import torch

from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.scheduler import SchedulerClosedError, StepScheduler, StepTask

START, END = 0, 4  # four real blocks: enough to run real attention, quick on two cores
PROMPT = 1024
CHUNK = 128


@pytest.fixture(scope="module")
def stack(model_dir):
    return BlockStack(Checkpoint(model_dir), START, END)


def _prompt_task(stack, cache, tokens: int, seed: int = 0, offset: int = 0) -> StepTask:
    hidden = torch.randn(1, tokens, stack.checkpoint.hidden_size, generator=torch.Generator().manual_seed(seed))
    return StepTask(cache, START, END, hidden, torch.arange(offset, offset + tokens)[None],
                    torch.ones(1, tokens, dtype=torch.bool))


def _run(scheduler: StepScheduler, task: StepTask) -> torch.Tensor:
    return scheduler.submit(task).result(timeout=300)


def test_a_chunked_prompt_equals_the_prompt_run_whole(stack):
    whole, chunked = StepScheduler(stack, prefill_chunk=0), StepScheduler(stack, prefill_chunk=CHUNK)
    try:
        outputs, caches = [], []
        for scheduler in (whole, chunked):
            cache = stack.new_session_cache(START, END, 1, PROMPT + 8)
            out = _run(scheduler, _prompt_task(stack, cache, PROMPT - 3))  # chunks of 128 and a last of 125
            steps = [_run(scheduler, _prompt_task(stack, cache, 1, seed=s, offset=PROMPT - 3 + s)) for s in range(3)]
            outputs.append((out, steps))
            caches.append(cache)
        assert chunked.chunks_done == 8 and whole.chunks_done == 1  # decode steps are not prompt chunks
        (out_whole, steps_whole), (out_chunked, steps_chunked) = outputs
        assert out_chunked.shape == out_whole.shape == (1, PROMPT - 3, stack.checkpoint.hidden_size)
        scale = out_whole.abs().max().item()
        assert (out_chunked - out_whole).abs().max().item() <= 1e-5 * scale
        for a, b in zip(steps_whole, steps_chunked):
            assert (a - b).abs().max().item() <= 1e-5 * scale
        assert caches[0].length == caches[1].length == PROMPT
    finally:
        whole.shutdown(10)
        chunked.shutdown(10)


def _decode_steps_during_prompt(stack, prefill_chunk: int) -> tuple[int, int, dict[int, int]]:
    """Submit a long prompt, then another session's decode steps one after another until the prompt is done;
    returns (decode steps finished before the prompt, chunks the prompt took, the scheduler's count of decode
    steps by the prompt tokens each waited behind)."""
    scheduler = StepScheduler(stack, prefill_chunk=prefill_chunk)
    try:
        other = stack.new_session_cache(START, END, 1, 512)
        _run(scheduler, _prompt_task(stack, other, 4, seed=1))
        long_cache = stack.new_session_cache(START, END, 1, PROMPT)
        prompt = scheduler.submit(_prompt_task(stack, long_cache, PROMPT))
        done_before = 0
        position = 4
        while True:
            step = scheduler.submit(_prompt_task(stack, other, 1, seed=position, offset=position))
            step.result(timeout=300)
            position += 1
            if prompt.done():
                break
            done_before += 1
        prompt.result()
        # less the short prompt of the decoding session
        return done_before, scheduler.chunks_done - 1, dict(scheduler.decode_waits)
    finally:
        scheduler.shutdown(10)


def test_decode_steps_run_between_a_long_prompts_chunks(stack):
    interleaved, chunks, waits = _decode_steps_during_prompt(stack, CHUNK)
    assert chunks == PROMPT // CHUNK
    # each turn runs the waiting decode step, then one chunk: a step finishes between every two chunks
    assert interleaved >= chunks - 2, f"only {interleaved} decode steps ran during {chunks} chunks"
    # and the scheduler's own count says so: every decode step waited behind one chunk's tokens at most
    assert sum(waits.values()) == interleaved + 1 and max(waits) <= CHUNK, waits
    # a node that runs prompts whole holds every decode step until the prompt is done
    held, whole_chunks, whole_waits = _decode_steps_during_prompt(stack, 0)
    assert whole_chunks == 1 and held <= 1
    assert max(whole_waits) == PROMPT, whole_waits


def test_an_oversized_prompt_is_refused_before_any_chunk(stack):
    scheduler = StepScheduler(stack, prefill_chunk=CHUNK)
    try:
        cache = stack.new_session_cache(START, END, 1, 300)
        with pytest.raises(ValueError, match=r"would hold 400 tokens, more than its max_length 300"):
            _run(scheduler, _prompt_task(stack, cache, 400))
        assert cache.length == 0 and scheduler.chunks_done == 1
        out = _run(scheduler, _prompt_task(stack, cache, 300))  # the session still works
        assert out.shape[1] == 300 and cache.length == 300
    finally:
        scheduler.shutdown(10)


def test_a_closing_unit_stops_a_chunked_prompt_after_its_running_chunk(stack):
    scheduler = StepScheduler(stack, prefill_chunk=32)
    cache = stack.new_session_cache(START, END, 1, 4096)
    future = scheduler.submit(_prompt_task(stack, cache, 4096))
    while scheduler.chunks_done < 1:  # the prompt is under way
        time.sleep(0.01)
    assert scheduler.shutdown(60)
    with pytest.raises(SchedulerClosedError, match=r"stopped serving these blocks after \d+ of the prompt's 4096"):
        future.result(timeout=1)
    assert cache.length == 0 and scheduler.chunks_done < 4096 // 32
    with pytest.raises(SchedulerClosedError):
        scheduler.submit(_prompt_task(stack, cache, 4)).result(timeout=1)


def test_a_negative_chunk_is_refused(stack):
    with pytest.raises(ValueError, match="prefill_chunk is -1"):
        StepScheduler(stack, prefill_chunk=-1)
