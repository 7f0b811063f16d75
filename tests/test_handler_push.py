"""The node's side of steps that go node to node: `push`, `outputs`, and steps whose input comes by push.

The REAL `BlockHandler` of `test_handler_fuzz` (a tiny random llama, blocks [0, 2) served) runs in-process.
A pushed input is queued for the step the session's client sends with `pushed` set, whichever arrives
first; the output equals the stateless forward of the same inputs; a duplicate push is dropped; a session
opened with `keep_outputs` hands its outputs back to its own client only, and reserves the cache for them.
Bad pushes and fetches get an error naming what was wrong, and leave the session and the budget as they were.
"""

# ruff: noqa: F401, F811  (`node` is test_handler_fuzz's fixture, imported for pytest to find: tests take it by name)
from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch
from test_handler_fuzz import (  # the same node under test and wire helpers
    BUDGET,
    HIDDEN,
    SERVED,
    TOL,
    assert_at_rest,
    assert_error,
    context,
    node,
    opening,
    output_of,
    peer,
    request,
    step,
)

from swarmnode import messages, rpc
from swarmnode.server.session import MAX_QUEUED_PUSHES, kept_output_blocks


def tensors(tokens: int, first: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, HIDDEN, generator=g), torch.arange(first, first + tokens)[None],
            torch.ones(1, tokens, dtype=torch.int64)]


def push_request(sid: str, step_id: int, prefix: int, chunk) -> object:
    return request({"session_id": sid, "step_id": step_id, "prefix_length": prefix}, chunk)


async def stream(node, requests, caller, *, before_each=None):
    """Drive one inference stream; `before_each(i)` runs (awaited) before message i is handed over."""
    async def feed():
        for i, req in enumerate(requests):
            if before_each is not None:
                await before_each(i)
            yield req

    return [r async for r in node.handler.rpc_inference(feed(), context(rpc.RPC_INFERENCE, caller))]


def pushed(step_id: int, prefix: int) -> dict:
    return {**step(step_id, prefix), "pushed": True}


def test_pushed_steps_run_on_their_pushed_input_whichever_comes_first(node):
    caller, pusher = peer(9001), peer(9002)
    first, second = tensors(5), tensors(2, first=5, seed=1)
    sid = "pushed-1"

    async def run():
        async def push_before(i):
            if i == 1:  # the second step's input lands before the step message
                reply = await node.handler.rpc_push(push_request(sid, 1, 5, second), context(rpc.RPC_PUSH, pusher))
                assert msgpack.unpackb(reply.metadata) == {"queued": True}

        async def push_later():  # the first step's input comes after its step message
            await asyncio.sleep(0.3)
            return await node.handler.rpc_push(push_request(sid, 0, 0, first), context(rpc.RPC_PUSH, pusher))

        replies, late = await asyncio.gather(
            stream(node, [request({"session": opening(sid, SERVED, 1, 16), "step": pushed(0, 0)}),
                          request({"step": pushed(1, 5)})], caller, before_each=push_before),
            push_later())
        return replies, late

    replies, late = asyncio.run(run())
    assert msgpack.unpackb(late.metadata) == {"queued": True}
    hidden = torch.cat([first[0], second[0]], 1)
    reference = node.stack.forward(*SERVED, hidden, torch.arange(7)[None], torch.ones(1, 7, dtype=torch.bool))
    torch.testing.assert_close(output_of(replies[0]), reference[:, :5], **TOL)
    torch.testing.assert_close(output_of(replies[1]), reference[:, 5:], **TOL)
    assert_at_rest(node)


def test_kept_outputs_go_to_their_client_only_and_are_counted_in_the_cache(node):
    caller, stranger = peer(9101), peer(9102)
    chunk = tensors(6, seed=3)
    sid = "kept-1"
    open_ = {**opening(sid, SERVED, 1, 16), "keep_outputs": True}
    free_during = {}

    async def run():
        async def fetch(who, start, end, session=sid):
            return await node.handler.rpc_outputs(request({"session_id": session, "start": start, "end": end}),
                                                  context(rpc.RPC_OUTPUTS, who))

        results = {}

        async def between(i):
            if i == 1:  # after the first step: fetch while the session is open
                free_during["tokens"] = node.unit.budget.used_block_tokens
                results["own"] = await fetch(caller, 1, 6)
                results["stranger"] = await fetch(stranger, 0, 6)
                results["too_far"] = await fetch(caller, 0, 7)
                results["empty"] = await fetch(caller, 3, 3)
                results["unknown"] = await fetch(caller, 0, 1, session="no-such-session")

        replies = await stream(node, [request({"session": open_, "step": step(0, 0)}, chunk),
                                      request({"step": step(1, 6)}, tensors(1, first=6, seed=4))],
                               caller, before_each=between)
        return replies, results

    replies, results = asyncio.run(run())
    torch.testing.assert_close(output_of(results["own"]), output_of(replies[0])[:, 1:6], atol=0, rtol=0)
    assert "of yours" in assert_error(results["stranger"])
    assert "not all computed" in assert_error(results["too_far"])
    assert "empty" in assert_error(results["empty"])
    assert "of yours" in assert_error(results["unknown"])
    blocks = SERVED[1] - SERVED[0] + kept_output_blocks(node.unit)
    assert free_during["tokens"] == 16 * blocks  # max_length x (served blocks + the outputs' share)
    assert_at_rest(node)


def test_bad_pushes_are_refused_and_change_nothing(node):
    caller, pusher = peer(9201), peer(9202)
    sid = "victim-1"
    chunk = tensors(4, seed=5)

    async def run():
        refusals = {}

        async def between(i):
            if i != 1:
                return
            push = lambda meta, t=chunk: node.handler.rpc_push(request(meta, t), context(rpc.RPC_PUSH, pusher))  # noqa: E731
            refusals["unknown"] = await push({"session_id": "nobody", "step_id": 1, "prefix_length": 4})
            refusals["two_tensors"] = await push({"session_id": sid, "step_id": 1, "prefix_length": 4}, chunk[:2])
            refusals["bad_meta"] = await push({"session_id": sid, "step_id": -1, "prefix_length": 4})
            refusals["extra_field"] = await push({"session_id": sid, "step_id": 1, "prefix_length": 4, "x": 1})
            dup = await push({"session_id": sid, "step_id": 0, "prefix_length": 0})  # step 0 has run
            refusals["duplicate"] = msgpack.unpackb(dup.metadata)
            ok = await push({"session_id": sid, "step_id": 1, "prefix_length": 4}, tensors(1, first=4, seed=6))
            refusals["good"] = msgpack.unpackb(ok.metadata)
            again = await push({"session_id": sid, "step_id": 1, "prefix_length": 4}, tensors(1, first=4, seed=7))
            refusals["queued_twice"] = msgpack.unpackb(again.metadata)
            for extra in range(2, MAX_QUEUED_PUSHES + 1):  # step 1's input waits already
                await push({"session_id": sid, "step_id": extra, "prefix_length": 4 + extra}, tensors(1, 4 + extra))
            over = MAX_QUEUED_PUSHES + 1
            refusals["too_many"] = await push({"session_id": sid, "step_id": over, "prefix_length": 4 + over},
                                              tensors(1, 4 + over))

        replies = await stream(node, [request({"session": opening(sid, SERVED, 1, 16), "step": step(0, 0)}, chunk),
                                      request({"step": pushed(1, 4)})], caller, before_each=between)
        return replies, refusals

    replies, refusals = asyncio.run(run())
    assert "no session" in assert_error(refusals["unknown"])
    assert "3 tensors" in assert_error(refusals["two_tensors"])
    assert "step_id" in assert_error(refusals["bad_meta"])
    assert "x" in assert_error(refusals["extra_field"])
    assert refusals["duplicate"] == {"queued": False}
    assert refusals["good"] == {"queued": True}
    assert refusals["queued_twice"] == {"queued": False}  # the first input queued for a step is the one run
    assert "wait already" in assert_error(refusals["too_many"])
    # the session ran its steps on the right inputs all along
    hidden = torch.cat([chunk[0], tensors(1, first=4, seed=6)[0]], 1)
    reference = node.stack.forward(*SERVED, hidden, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool))
    torch.testing.assert_close(output_of(replies[1]), reference[:, 4:], **TOL)
    assert_at_rest(node)


@pytest.mark.parametrize("case", ["tensors_with_pushed", "step_ids_go_back", "bad_push_target", "target_outside",
                                  "prefix_mismatch"])
def test_bad_pushed_steps_end_only_their_session(node, case):
    caller, pusher = peer(9301), peer(9302)
    sid = f"bad-{case}"
    chunk = tensors(3, seed=8)
    target = {"peer_id": str(peer(77)), "session_id": "next", "step_id": 0, "prefix_length": 0}
    second = {
        "tensors_with_pushed": request({"step": pushed(1, 3)}, tensors(1, 3)),
        "step_ids_go_back": request({"step": step(0, 3)}, tensors(1, 3)),
        "bad_push_target": request({"step": {**step(1, 3), "push_to": {**target, "peer_id": "not-a-peer"}}},
                                   tensors(1, 3)),
        "target_outside": request({"step": {**step(1, 3), "push_to": {**target, "prefix_length": 9}}},
                                  tensors(1, 3)),
        "prefix_mismatch": request({"step": pushed(1, 3)}),
    }[case]

    async def run():
        async def between(i):
            if i == 1 and case == "prefix_mismatch":
                await node.handler.rpc_push(push_request(sid, 1, 2, tensors(1, 3)), context(rpc.RPC_PUSH, pusher))

        return await stream(node, [request({"session": opening(sid, SERVED, 1, 16), "step": step(0, 0)}, chunk),
                                   second], caller, before_each=between)

    replies = asyncio.run(run())
    assert len(replies) == 2
    output_of(replies[0])
    error = assert_error(replies[1])
    expected = {"tensors_with_pushed": "carries no tensors", "step_ids_go_back": "step ids increase",
                "bad_push_target": "not a libp2p peer id", "target_outside": "outside this step's tokens",
                "prefix_mismatch": "continues from 2 tokens"}[case]
    assert expected in error, error
    assert node.unit.budget.free_tokens == BUDGET
    assert_at_rest(node)


def test_a_client_that_hangs_up_while_a_step_waits_for_its_push_frees_the_cache_at_once(node):
    """The stream ends while its step waits for a push that never comes: the wait ends then, not at the
    node's step timeout (30 s here), and the cache goes back."""
    async def run():
        async def feed():
            yield request({"session": opening("hangup", SERVED, 1, 16), "step": pushed(0, 0)})
            await asyncio.sleep(0.3)

        began = time.monotonic()
        replies = [r async for r in node.handler.rpc_inference(feed(), context(rpc.RPC_INFERENCE, peer(9401)))]
        return replies, time.monotonic() - began

    replies, took = asyncio.run(run())
    assert len(replies) <= 1 and all("ended the stream" in assert_error(r) for r in replies)
    assert took < 5
    assert_at_rest(node)
