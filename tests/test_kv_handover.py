"""KV caches handed over from prefill nodes to decode nodes (`KV_HANDOVER`, `server.handover`): HexGen-2's
split of the two phases, on the node side.

Four REAL `BlockHandler`s over a tiny random llama (3 blocks), each on its own real `p2pd` peer: prefill nodes
P1 [0, 2) and P2 [2, 3), decode nodes D1 [0, 1) and D2 [1, 3), so ranges do not align (P1 feeds D1 and D2,
D2 is fed by P1 and P2). The prompt runs on P1 then P2 with `handover_to` naming the decode sessions, which
the client opened first (their caches reserved); the decode steps then continue from the prompt's length
without recomputing it, and their outputs equal the stateless forward of the whole sequence. Every field of
a handover is checked before anything is written: unknown sessions, blocks outside the session's span, the
wrong batch, length, shapes, dtypes, values, too few or too many messages, a session that ran steps already
and blocks handed over twice are refused with the reason, and leave the session as it was.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from test_handler_fuzz import (
    FUZZ,
    LIMITS,
    NUM_LAYERS,
    broken_map,
    context,
    pack,
    request,
)

from swarmnode import messages, rpc
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.server.handler import BlockHandler
from swarmnode.server.unit import ServingUnit
from swarmnode.tiny_models import make_tiny_checkpoint

SPANS = {"P1": (0, 2), "P2": (2, 3), "D1": (0, 1), "D2": (1, 3)}
BUDGET = 256
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return Checkpoint(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-kv"), num_layers=NUM_LAYERS))


@pytest.fixture(scope="module")
def handlers(checkpoint):
    out = {}
    for name, (start, end) in SPANS.items():
        unit = ServingUnit(BlockStack(checkpoint, start, end), CacheBudget(BUDGET, span_blocks=end - start))
        out[name] = BlockHandler(lambda unit=unit: [unit], limits=LIMITS, info=None)
    yield out
    for handler in out.values():
        for unit in handler.units():
            unit.close()


@pytest.fixture(scope="module")
def reference(checkpoint):
    return BlockStack(checkpoint, 0, NUM_LAYERS)


class Stream:
    """One inference stream to a handler, driven message by message (the client's side, in this process)."""

    def __init__(self, handler: BlockHandler):
        self.handler = handler
        self.queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await self.queue.get()) is not None:
                yield item

        self.replies = handler.rpc_inference(requests(), context(rpc.RPC_INFERENCE))

    async def open(self, opening: dict) -> None:
        """Open a session with no step (no reply comes): return once the node registered it."""
        self.queue.put_nowait(request({"session": opening}))
        self.reading = asyncio.ensure_future(anext(self.replies))  # the handler runs while it is read
        for _ in range(200):
            if opening["session_id"] in self.handler.sessions:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"session {opening['session_id']} did not open: {await self.reading}")

    async def send(self, meta: dict, tensors=()) -> runtime_pb2.ExpertResponse:
        if getattr(self, "reading", None) is not None:
            self.queue.put_nowait(request(meta, tensors))
            reading, self.reading = self.reading, None
            return await reading
        self.queue.put_nowait(request(meta, tensors))
        return await anext(self.replies)

    async def close(self) -> None:
        self.queue.put_nowait(None)
        if getattr(self, "reading", None) is not None:
            with contextlib.suppress(StopAsyncIteration):
                await self.reading
            self.reading = None
        async for _ in self.replies:
            pass


def _opening(sid: str, span, max_length: int = 32) -> dict:
    return {"session_id": sid, "start": span[0], "end": span[1], "max_length": max_length, "batch_size": 1}


def _output(reply: runtime_pb2.ExpertResponse) -> torch.Tensor:
    assert messages.response_error(reply) is None, messages.response_error(reply)
    return messages.deserialize_tensors(reply.tensors)[0]


def _step_reply(reply) -> messages.StepReply:
    return messages.unpack_metadata(reply.metadata, messages.StepReply)


@contextlib.asynccontextmanager
async def peers(handlers):
    """A real p2pd peer per handler, each connected to every other, its handlers registered."""
    made = []
    try:
        first = None
        for handler in handlers.values():
            p2p = await P2P.create(initial_peers=first or [], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            made.append(p2p)
            if first is None:
                first = [f"{m}/p2p/{p2p.peer_id}" for m in await p2p.get_visible_maddrs()]
            await handler.register(p2p)
        # every peer dials every other: nodes that met only through the first would otherwise look each
        # other up in libp2p's DHT first, which a loaded machine may not finish in time
        from hivemind.utils.multiaddr import Multiaddr

        for a in made:
            for b in made:
                if a is not b:
                    addresses = [Multiaddr(str(m).split("/p2p/")[0]) for m in await b.get_visible_maddrs()]
                    await a._client.connect(b.peer_id, addresses)
        yield {name: str(p2p.peer_id) for name, p2p in zip(handlers, made)}
    finally:
        for p2p in made:
            with contextlib.suppress(Exception):
                await p2p.shutdown()


def test_prompt_on_prefill_nodes_decode_on_others_with_unaligned_ranges(handlers, reference):
    g = torch.Generator().manual_seed(3)
    prompt, decode = 7, 3
    hidden = torch.randn(1, prompt + decode, 64, generator=g)
    positions = torch.arange(prompt + decode)[None]
    mask = torch.ones(1, prompt + decode, dtype=torch.int64)
    full = reference.forward(0, NUM_LAYERS, hidden, positions, mask.bool())

    def chunk(a: int, b: int, states=None):
        return [hidden[:, a:b] if states is None else states, positions[:, a:b], mask[:, a:b]]

    async def run():
        async with peers(handlers) as ids:
            d1, d2 = Stream(handlers["D1"]), Stream(handlers["D2"])
            # the decode sessions are opened first: their caches are reserved before anything is handed over
            for stream, name, sid in ((d1, "D1", "d1"), (d2, "D2", "d2")):
                await stream.open(_opening(sid, SPANS[name]))
            to = {"D1": {"peer_id": ids["D1"], "session_id": "d1"}, "D2": {"peer_id": ids["D2"], "session_id": "d2"}}
            p1, p2 = Stream(handlers["P1"]), Stream(handlers["P2"])
            r1 = await p1.send({"session": _opening("p1", SPANS["P1"]), "step": {
                "step_id": 0, "prefix_length": 0, "handover_to": [{**to["D1"], "start": 0, "end": 1},
                                                                  {**to["D2"], "start": 1, "end": 3}]}}, chunk(0, prompt))
            mid = _output(r1)
            r2 = await p2.send({"session": _opening("p2", SPANS["P2"]), "step": {
                "step_id": 0, "prefix_length": 0, "handover_to": [{**to["D2"], "start": 0, "end": 3}]}},
                chunk(0, prompt, mid))
            out_prompt = _output(r2)
            for stream in (p1, p2):
                await stream.close()
            # decode: D1 then D2, continuing from the prompt's length without it
            outs = []
            for t in range(prompt, prompt + decode):
                a = _output(await d1.send({"step": {"step_id": t - prompt, "prefix_length": t}}, chunk(t, t + 1)))
                b = _output(await d2.send({"step": {"step_id": t - prompt, "prefix_length": t}}, chunk(t, t + 1, a)))
                outs.append(b)
            for stream in (d1, d2):
                await stream.close()
            return _step_reply(r1), _step_reply(r2), out_prompt, torch.cat(outs, dim=1)

    reply1, reply2, out_prompt, decoded = asyncio.run(run())
    assert reply1.handed_over == [True, True] and reply1.handover_errors == [None, None], reply1
    assert reply2.handed_over == [True], reply2
    torch.testing.assert_close(out_prompt, full[:, :prompt], **TOL)
    torch.testing.assert_close(decoded, full[:, prompt:], **TOL)
    for handler in handlers.values():
        assert handler.sessions == {}
        assert all(u.budget.free_tokens == BUDGET for u in handler.units())


def test_a_handover_to_a_node_that_holds_none_of_the_blocks_is_reported(handlers):
    async def run():
        async with peers(handlers) as ids:
            p2 = Stream(handlers["P2"])
            reply = await p2.send({"session": _opening("p2x", SPANS["P2"]), "step": {
                "step_id": 0, "prefix_length": 0,
                "handover_to": [{"peer_id": ids["D1"], "session_id": "nowhere", "start": 0, "end": 1},
                                {"peer_id": ids["D2"], "session_id": "not-open", "start": 2, "end": 3}]}},
                [torch.randn(1, 4, 64), torch.arange(4)[None], torch.ones(1, 4, dtype=torch.int64)])
            await p2.close()
            return _step_reply(reply)

    reply = asyncio.run(run())
    assert reply.handed_over == [False, False]
    assert "none of [0, 1)" in reply.handover_errors[0]
    assert "no session not-open" in reply.handover_errors[1] and "opens it" in reply.handover_errors[1]


# --- bad handovers, straight into the decode node's handler -------------------------------------------------

def _header(**changes) -> dict:
    return {"session_id": "dx", "start": 1, "end": 3, "length": 5, "batch_size": 1, "dtype": "float32", **changes}


def _blocks(n: int, length: int = 5, **kw) -> list:
    shape = kw.get("shape", (1, 1, length, 16))
    dtype = kw.get("dtype", torch.float32)
    return [request(b"", [torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)]) for _ in range(n)]


def _first(header: dict, valid=None) -> runtime_pb2.ExpertRequest:
    length, batch = header.get("length", 5), header.get("batch_size", 1)
    return request(pack(header), [torch.ones(batch, length, dtype=torch.int64) if valid is None else valid])


async def _handover(handler: BlockHandler, msgs: list) -> runtime_pb2.ExpertResponse:
    async def feed():
        for m in msgs:
            yield m

    replies = [r async for r in handler.rpc_kv_handover(feed(), context(rpc.RPC_KV_HANDOVER))]
    assert len(replies) == 1, replies
    return replies[0]


def _kv_shape(checkpoint) -> tuple:
    layer = checkpoint.family.layer_caches[0]  # keys and values of every KV head, as the layers write them
    assert (layer.key_heads, layer.key_dim) == (layer.value_heads, layer.value_dim)
    return (1, layer.key_heads, 5, layer.key_dim)


def test_bad_handovers_are_refused_with_the_reason_and_change_nothing(handlers, checkpoint):
    good = _kv_shape(checkpoint)
    d2 = handlers["D2"]
    cases = {
        "unknown session": ([_first(_header(session_id="nope")), *_blocks(2, shape=good)], "no session nope"),
        "outside span": ([_first(_header(start=0, end=2)), *_blocks(2, shape=good)], "outside this session's"),
        "batch": ([_first(_header(batch_size=2)), *_blocks(2, shape=good)], "batch of 2"),
        "too long": ([_first(_header(length=40)), *_blocks(2, shape=good)], "max_length"),
        "mask shape": ([_first(_header(), torch.ones(1, 4, dtype=torch.int64)), *_blocks(2, shape=good)], "shape"),
        "mask values": ([_first(_header(), torch.full((1, 5), 2)), *_blocks(2, shape=good)], "only 0 and 1"),
        "kv shape": ([_first(_header()), *_blocks(2, shape=(1, 1, 5, 16))], "must have shape"),
        "kv dtype": ([_first(_header()), *_blocks(2, shape=good, dtype=torch.bfloat16)], "the header says float32"),
        "too few": ([_first(_header()), *_blocks(1, shape=good)], "ended after 1 of the 2 blocks"),
        "too many": ([_first(_header()), *_blocks(3, shape=good)], "more than the 2 blocks"),
        "three tensors": ([_first(_header()), request(b"", [torch.zeros(good)] * 3)], "carries 2 tensors"),
        "bad dtype name": ([_first(_header(dtype="int8")), *_blocks(2, shape=good)], "is not one of"),
        "empty": ([], "ended before its header"),
    }
    nan = _blocks(2, shape=good)
    nan[1] = request(b"", [torch.full(good, float("nan")), torch.zeros(good)])
    cases["nan"] = ([_first(_header()), *nan], "NaN")

    async def run():
        stream = Stream(d2)
        await stream.open(_opening("dx", SPANS["D2"], max_length=16))
        session = d2.sessions["dx"]
        before = {i: session.cache.keys[i].clone() for i in (1, 2)}
        replies = {name: await _handover(d2, msgs) for name, (msgs, _) in cases.items()}
        unchanged = all(torch.equal(session.cache.keys[i], before[i]) for i in (1, 2))
        state = (session.cache.length, set(session.handed_blocks))
        # a good handover of block 1 only: taken, not complete; block 1 again: refused
        part = await _handover(d2, [_first(_header(end=2)), *_blocks(1, shape=good)])
        again = await _handover(d2, [_first(_header(end=2)), *_blocks(1, shape=good)])
        other_length = await _handover(d2, [_first(_header(start=2, length=4)),
                                            *_blocks(1, shape=(1, good[1], 4, good[3]))])
        rest = await _handover(d2, [_first(_header(start=2)), *_blocks(1, shape=good)])
        length = session.cache.length
        await stream.send({"step": {"step_id": 0, "prefix_length": 5}},
                          [torch.randn(1, 1, 64), torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.int64)])
        late = await _handover(d2, [_first(_header(end=2)), *_blocks(1, shape=good)])
        await stream.close()
        return replies, unchanged, state, part, again, other_length, rest, length, late

    replies, unchanged, state, part, again, other_length, rest, length, late = asyncio.run(run())
    for name, (_, reason) in cases.items():
        error = messages.response_error(replies[name])
        assert error is not None and reason in error, (name, error)
    assert unchanged and state == (0, set())
    assert messages.unpack_metadata(part.metadata, messages.KvHandoverReply) == messages.KvHandoverReply(
        blocks=1, complete=False)
    assert "handed over to this session already" in messages.response_error(again)
    assert "took 5 tokens by handover already" in messages.response_error(other_length)
    assert messages.unpack_metadata(rest.metadata, messages.KvHandoverReply).complete is True
    assert length == 5
    assert "has run steps already" in messages.response_error(late)
    assert d2.sessions == {}


@settings(max_examples=120, **FUZZ)
@given(data=st.data())
def test_handover_headers_fuzzed_are_refused(handlers, data):
    """Any broken header (metadata of the first message) is refused with a reason; nothing is written."""
    good = _header(session_id="fz")
    meta = data.draw(st.one_of(
        broken_map(good),
        st.builds(lambda k, v: pack({**good, k: v}), st.sampled_from(sorted(good)),
                  st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=20),
                            st.floats(allow_nan=True)))))
    try:
        header = messages.unpack_metadata(meta, messages.KvHandover)
        if header.session_id == "fz" and (header.start, header.end, header.length, header.batch_size) == (1, 3, 5, 1):
            return  # the good header itself, drawn through a value equal to it
    except messages.ProtocolError:
        pass
    d2 = handlers["D2"]

    async def run():
        stream = Stream(d2)
        await stream.open(_opening("fz", SPANS["D2"], max_length=16))
        reply = await _handover(d2, [request(meta, [torch.ones(1, 5, dtype=torch.int64)])])
        cache = d2.sessions["fz"].cache
        state = (cache.length, set(d2.sessions["fz"].handed_blocks))
        await stream.close()
        return reply, state

    reply, state = asyncio.run(run())
    assert messages.response_error(reply), reply
    assert state == (0, set())
