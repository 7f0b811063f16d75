"""Property-based hardening of the node's RPC handlers: garbage in, one clear error out, nothing else moves.

The REAL `BlockHandler` runs in-process over a tiny random llama checkpoint (3 blocks, of which the node
serves [0, 2)), with a 256-token cache budget and `SessionLimits(step_timeout=30, idle_timeout=2,
max_length=64)`. Hypothesis generates bad metadata and tensors for `forward`, bad streams for `inference`
and bad payloads for `probe` / `ping`. For every bad request the handler must:

- answer with exactly one error reply whose message is not empty (a stream ends right after it);
- refuse it in validation (`requests_refused` grows by one) without running any step for it;
- keep serving: a well-formed request sent afterwards (or alongside) returns what `BlockStack.forward`
  returns on the same inputs, and sessions open at the same time are untouched;
- give back every cache token it reserved: the budget returns to its starting value, no session is left.

The tests at the end pin bugs these tests found (all fixed): a nested-msgpack crash, lenient field types,
tensors decoded before their count was checked, and an empty stream that got no reply.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import swarmnode
from swarmnode import messages, rpc
from swarmnode.messages import InfoReply, SpanInfo
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.server.handler import BlockHandler, SessionLimits
from swarmnode.server.unit import ServingUnit
from swarmnode.tiny_models import make_tiny_checkpoint

NUM_LAYERS = 3  # the tiny model's blocks: 0, 1, 2 ...
SERVED = (0, 2)  # ... of which the node serves [0, 2): block 2 exists but lives elsewhere
HIDDEN = 64  # tiny_config's hidden size
MAX_LENGTH = 64  # SessionLimits.max_length: the longest session and the bound on position ids
BUDGET = 256  # cache tokens over the served span
SUB_SPANS = [(0, 2), (0, 1), (1, 2)]
OUTSIDE = [(0, 3), (1, 3), (2, 3), (2, 9), (5, 6), (0, 2**40)]
LIMITS = SessionLimits(step_timeout=30, idle_timeout=2, max_length=MAX_LENGTH)
TOL = dict(atol=1e-5, rtol=1e-5)
I64 = 2**63 - 1

FUZZ = dict(deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

_PEER_PREFIX = PeerID.from_base58("12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j").to_bytes()[:-32]
_callers = itertools.count(1)
_session_ids = itertools.count()


def peer(index: int) -> PeerID:
    """A well-formed peer id (an ed25519 identity multihash) of its own for each index."""
    return PeerID(_PEER_PREFIX + index.to_bytes(32, "big"))


def context(rpc: str, caller: PeerID | None = None) -> P2PContext:
    return P2PContext(handle_name=rpc, local_id=peer(0), remote_id=caller or peer(next(_callers)))


# --- the node under test ---------------------------------------------------------------------------------

@dataclass
class Node:
    handler: BlockHandler
    unit: ServingUnit
    stack: BlockStack


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), num_layers=NUM_LAYERS)
    checkpoint = Checkpoint(path)
    assert (checkpoint.num_blocks, checkpoint.hidden_size) == (NUM_LAYERS, HIDDEN)
    stack = BlockStack(checkpoint, *SERVED)
    unit = ServingUnit(stack, CacheBudget(BUDGET, span_blocks=SERVED[1] - SERVED[0]))

    def info() -> InfoReply:  # as Node.info() builds it
        return InfoReply(
            state="online",
            spans=[SpanInfo(start=unit.start, end=unit.end, cache_tokens=unit.budget.tokens,
                            free_cache_tokens=unit.budget.free_tokens)],
            num_blocks=checkpoint.num_blocks, hidden_size=checkpoint.hidden_size,
            free_cache_tokens=unit.budget.free_tokens, cache_tokens=unit.budget.tokens, throughput=1000.0,
            version=swarmnode.__version__, dtype="float32", device="cpu",
        )

    handler = BlockHandler(lambda: [unit], limits=LIMITS, info=info)
    try:
        yield Node(handler, unit, stack)
    finally:
        unit.close()


def assert_at_rest(node: Node) -> None:
    """No session is left and every reserved cache token is back."""
    assert node.unit.budget.free_tokens == BUDGET
    assert node.unit.budget.used_block_tokens == 0
    assert node.handler.sessions == {}
    assert node.unit.sessions == set()


def wait_steps(node: Node, expected: int, timeout: float = 5.0) -> int:
    """The compute thread counts a step just after handing its result over: wait for the count to land."""
    deadline = time.monotonic() + timeout
    while node.unit.scheduler.steps_done < expected and time.monotonic() < deadline:
        time.sleep(0.001)
    return node.unit.scheduler.steps_done


# --- requests and replies --------------------------------------------------------------------------------

def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def as_protos(tensors) -> list[runtime_pb2.Tensor]:
    return [t if isinstance(t, runtime_pb2.Tensor) else serialize_torch_tensor(t.contiguous()) for t in tensors]


def request(meta: bytes | dict, tensors=()) -> runtime_pb2.ExpertRequest:
    raw = meta if isinstance(meta, bytes) else pack(meta)
    return runtime_pb2.ExpertRequest(metadata=raw, tensors=as_protos(tensors))


def reply_error(reply: runtime_pb2.ExpertResponse):
    """The error a reply carries (read with plain msgpack, not swarmnode's helper); None for a result."""
    if not reply.metadata:
        return None
    payload = msgpack.unpackb(reply.metadata, raw=False)
    return payload.get("error") if isinstance(payload, dict) else None


def assert_error(reply: runtime_pb2.ExpertResponse) -> str:
    text = reply_error(reply)
    assert isinstance(text, str) and text.strip(), f"not an error reply: {reply!r:.300}"
    assert len(reply.tensors) == 0, "an error reply carries no tensors"
    return text


def output_of(reply: runtime_pb2.ExpertResponse) -> torch.Tensor:
    assert reply_error(reply) is None, reply_error(reply)
    assert len(reply.tensors) == 1
    return deserialize_torch_tensor(reply.tensors[0])


def opening(sid: str, span: tuple[int, int], batch: int, max_length: int) -> dict:
    return {"session_id": sid, "start": span[0], "end": span[1], "max_length": max_length, "batch_size": batch}


def step(step_id: int, prefix: int) -> dict:
    return {"step_id": step_id, "prefix_length": prefix}


def session_requests(open_: dict, chunks: list, *, carry_first: bool) -> list[runtime_pb2.ExpertRequest]:
    """An inference stream: open, then one step per chunk of tensors (the first may ride on the open)."""
    out, prefix = [], 0
    for i, chunk in enumerate(chunks):
        meta = {"step": step(i, prefix)}
        if i == 0 and carry_first:
            meta["session"] = open_
        out.append(request(meta, chunk))
        prefix += chunk[0].shape[1]
    if not (chunks and carry_first):
        out.insert(0, request({"session": open_}))
    return out


async def feed(requests, *, pause: int = 0, wait_first: asyncio.Event | None = None,
               opened: asyncio.Event | None = None, wait_before_last: asyncio.Event | None = None):
    """A client's side of a stream. `opened` is set once the handler asks for the second message (the
    session is registered by then); `wait_before_last` holds the last message back until it is set."""
    if wait_first is not None:
        await wait_first.wait()
    for i, req in enumerate(requests):
        if i == 1 and opened is not None:
            opened.set()
        if i == len(requests) - 1 and i > 0 and wait_before_last is not None:
            await asyncio.wait_for(wait_before_last.wait(), 10)
        for _ in range(pause):
            await asyncio.sleep(0)
        yield req


async def collect(node: Node, stream) -> list[runtime_pb2.ExpertResponse]:
    return [reply async for reply in node.handler.rpc_inference(stream, context(rpc.RPC_INFERENCE))]


def check_session(node: Node, span: tuple[int, int], chunks: list, replies: list) -> None:
    """Each step's reply equals the stateless forward of the whole input so far, at that step's tokens."""
    assert len(replies) == len(chunks), [reply_error(r) for r in replies]
    hidden = torch.cat([c[0] for c in chunks], dim=1)
    positions = torch.cat([c[1].long() for c in chunks], dim=1)
    mask = torch.cat([c[2].long() for c in chunks], dim=1)
    reference = node.stack.forward(*span, hidden, positions, mask.bool())
    offset = 0
    for i, (chunk, reply) in enumerate(zip(chunks, replies)):
        tokens = chunk[0].shape[1]
        assert msgpack.unpackb(reply.metadata, raw=False) == {"step_id": i, "cache_length": offset + tokens}
        torch.testing.assert_close(output_of(reply), reference[:, offset:offset + tokens], **TOL)
        offset += tokens


def well_formed_forward(node: Node, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, HIDDEN, generator=g)
    positions = torch.arange(5).repeat(2, 1)
    mask = torch.ones(2, 5, dtype=torch.int64)
    before = node.unit.scheduler.steps_done
    reply = asyncio.run(node.handler.rpc_forward(request({"start": 0, "end": 2}, [hidden, positions, mask]),
                                                 context(rpc.RPC_FORWARD)))
    torch.testing.assert_close(output_of(reply), node.stack.forward(0, 2, hidden, positions, mask.bool()), **TOL)
    assert wait_steps(node, before + 1) == before + 1


def well_formed_session(node: Node, seed: int) -> None:
    """Open, prefill 5 tokens, decode 1: the outputs match `stack.forward` on all 6 tokens."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 6, HIDDEN, generator=g)
    positions = torch.arange(6)[None]
    mask = torch.ones(1, 6, dtype=torch.int64)
    chunks = [[hidden[:, :5], positions[:, :5], mask[:, :5]], [hidden[:, 5:], positions[:, 5:], mask[:, 5:]]]
    before = node.unit.scheduler.steps_done
    reqs = session_requests(opening(f"good-{next(_session_ids)}", SERVED, 1, 16), chunks, carry_first=False)
    replies = asyncio.run(collect(node, feed(reqs)))
    check_session(node, SERVED, chunks, replies)
    assert wait_steps(node, before + 2) == before + 2
    assert_at_rest(node)


# --- strategies: valid inputs ---------------------------------------------------------------------------

@st.composite
def step_tensors(draw, *, batch: int | None = None, tokens: int | None = None, first: int | None = None):
    """Valid `[hidden (B, T, H), position_ids (B, T), attention_mask (B, T)]`, in the protocol's variants."""
    b = batch if batch is not None else draw(st.integers(1, 3))
    t = tokens if tokens is not None else draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    hidden = torch.randn(b, t, HIDDEN, generator=g)
    p0 = first if first is not None else draw(st.integers(0, MAX_LENGTH - t))
    positions = (p0 + torch.arange(t)).repeat(b, 1)
    mask = torch.ones(b, t, dtype=torch.int64)
    if t > 1 and draw(st.booleans()):  # padding: some leading tokens of one row are masked out
        mask[draw(st.integers(0, b - 1)), : draw(st.integers(1, t - 1))] = 0
    if t > 1 and draw(st.booleans()):  # repeated positions (non-decreasing is allowed)
        i = draw(st.integers(1, t - 1))
        positions[:, i] = positions[:, i - 1]
    if draw(st.booleans()):
        positions = positions.to(torch.int32)
    if draw(st.booleans()):
        mask = mask.to(torch.int32)
    return [hidden, positions, mask]


# --- strategies: broken metadata -------------------------------------------------------------------------

def _decodes_to_map(raw: bytes) -> bool:
    try:
        return isinstance(msgpack.unpackb(raw, raw=False, strict_map_key=False), dict)
    except Exception:  # msgpack raises many kinds on garbage; any of them means "not a map"
        return False


GARBAGE_BYTES = st.one_of(st.just(b""), st.just(b"\xc1"), st.binary(max_size=64)).filter(
    lambda raw: not _decodes_to_map(raw))
NOT_A_MAP = st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8), st.binary(max_size=8),
                      st.lists(st.integers(0, 9), max_size=4), st.none(), st.booleans()).map(pack)
NOT_INT = st.one_of(  # values pydantic cannot read as an int, even leniently
    st.none(), st.text(alphabet="abcxyz -_", max_size=6), st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
    st.floats().filter(lambda x: not x.is_integer()),
)
NOT_STR = st.one_of(st.none(), st.integers(), st.floats(), st.booleans(), st.lists(st.text(max_size=2), max_size=2))
# integers within what msgpack can carry (64 bits): a larger one cannot even be sent
MSGPACK_INTS = st.integers(-2**63, 2**64 - 1)
ANY_SMALL = st.one_of(st.none(), st.booleans(), MSGPACK_INTS, st.text(max_size=6), st.lists(MSGPACK_INTS, max_size=2))


def coercible(value: int):
    """Values of the wrong msgpack type that pydantic's lax mode still reads as `value`."""
    options = [str(value), float(value), msgpack.ExtType(0x7F, str(value).encode())]
    if value in (0, 1):
        options.append(bool(value))
    return st.sampled_from(options)


@st.composite
def broken_map(draw, good: dict, *, pad_key: str = "padding"):
    """A message (top-level map) broken at the map level; always invalid."""
    how = draw(st.sampled_from(["garbage", "trailing", "not_a_map", "int_keys", "unknown_key", "oversized"]))
    if how == "garbage":
        return draw(GARBAGE_BYTES)
    if how == "trailing":  # a valid map followed by more bytes
        return pack(good) + draw(st.binary(min_size=1, max_size=8))
    if how == "not_a_map":
        return draw(NOT_A_MAP)
    if how == "int_keys":
        return pack({i: v for i, v in enumerate(good.values())} or {0: 0})
    if how == "unknown_key":
        key = draw(st.text(max_size=10).filter(lambda k: k not in good))
        return pack({**good, key: draw(ANY_SMALL)})
    return pack({**good, pad_key: "x" * draw(st.integers(messages.MAX_METADATA_BYTES, 6000))})


@st.composite
def span_metadata(draw, start: int, end: int):
    """Forward metadata for blocks [start, end) broken in one drawn way; always invalid."""
    good = {"start": start, "end": end}
    how = draw(st.sampled_from(["map", "missing", "wrong_type", "negative", "huge", "empty_span", "outside"]))
    if how == "map":
        return draw(broken_map(good))
    key = draw(st.sampled_from(["start", "end"]))
    if how == "missing":
        return pack({k: v for k, v in good.items() if k != key})
    if how == "wrong_type":
        return pack({**good, key: draw(NOT_INT)})
    if how == "negative":
        return pack({**good, key: draw(st.integers(-(2**63), -1))})
    if how == "huge":
        return pack({**good, key: draw(st.integers(NUM_LAYERS, 2**64 - 1))})
    if how == "empty_span":
        return pack({"start": end, "end": draw(st.integers(0, end))})
    lo, hi = draw(st.sampled_from(OUTSIDE))
    return pack({"start": lo, "end": hi})


# --- strategies: broken tensors --------------------------------------------------------------------------

@st.composite
def undecodable(draw, shape):
    """A tensor message that hivemind cannot turn into a tensor."""
    numel = 1
    for d in shape:
        numel *= d
    how = draw(st.sampled_from(["short", "dtype", "codec", "grad_int", "empty"]))
    if how == "short":
        size = draw(st.integers(0, 4 * numel + 8).filter(lambda n: n != 4 * numel))
        return runtime_pb2.Tensor(buffer=bytes(range(256)) * (size // 256) + bytes(size % 256), size=list(shape),
                                  dtype="float32")
    if how == "dtype":
        dtype = draw(st.sampled_from(["", "nonsense", "torch.float32", "object", "V0", "S4", "(2,)f4"]))
        # a sub-array dtype unpacks 4 * numel bytes into numel float32s, which is a valid tensor: give it
        # twice the bytes, so it unpacks into twice the elements its shape holds
        width = 8 if dtype == "(2,)f4" else 4
        return runtime_pb2.Tensor(buffer=bytes(width * numel), size=list(shape), dtype=dtype)
    if how == "codec":
        return runtime_pb2.Tensor(buffer=bytes(4 * numel), size=list(shape), dtype="float32",
                                  compression=draw(st.integers(6, 1000)))
    if how == "grad_int":  # integer tensors cannot require grad
        proto = serialize_torch_tensor(torch.zeros(shape, dtype=torch.int64))
        proto.requires_grad = True
        return proto
    return runtime_pb2.Tensor()


@st.composite
def random_proto(draw):
    """A tensor message with random fields: it may even decode; the handler must cope either way."""
    return runtime_pb2.Tensor(
        compression=draw(st.integers(0, 2)),
        dtype=draw(st.sampled_from(["float32", "float16", "float64", "int64", "int32", "bfloat16", "uint8", "bool"])),
        size=draw(st.lists(st.integers(0, 70), max_size=4)),
        buffer=draw(st.binary(max_size=2048)),
        requires_grad=draw(st.booleans()),
    )


BREAKS = ["count", "rank", "hidden_size", "empty", "batch", "too_long", "dtype", "nonfinite", "positions_shape",
          "positions_dtype", "positions_negative", "positions_too_big", "positions_decrease", "mask_shape",
          "mask_dtype", "mask_values", "undecodable"]


@st.composite
def broken_tensors(draw, tensors, *, session_batch: int | None = None, room: int | None = None,
                   how: str | None = None):
    """`tensors` made invalid in one way, `how` or drawn (for a session: opened with `session_batch`, `room`
    tokens left)."""
    hidden, positions, mask = (t.clone() for t in tensors)
    b, t, _ = hidden.shape
    how = how or draw(st.sampled_from(BREAKS))
    row = draw(st.integers(0, b - 1))
    col = draw(st.integers(0, t - 1))
    if how == "count":
        k = draw(st.sampled_from([0, 1, 2, 4, 5]))
        return ([hidden, positions, mask] * 2)[:k]
    if how == "rank":
        bad = draw(st.sampled_from([hidden.reshape(b * t, HIDDEN), hidden[..., None], hidden[0, 0], hidden.sum()]))
        return [bad, positions, mask]
    if how == "hidden_size":
        h = draw(st.sampled_from([1, 32, 63, 65, 128]))
        return [torch.zeros(b, t, h), positions, mask]
    if how == "empty":
        nb, nt = draw(st.sampled_from([(0, t), (b, 0), (0, 0)]))
        return [torch.zeros(nb, nt, HIDDEN), torch.zeros(nb, nt, dtype=torch.int64),
                torch.ones(nb, nt, dtype=torch.int64)]
    if how == "batch":
        if session_batch is None:
            nb = messages.MAX_BATCH_SIZE + draw(st.integers(1, 3))
        else:
            nb = draw(st.sampled_from([x for x in (session_batch - 1, session_batch + 1, session_batch + 5) if x > 0]))
        return [torch.zeros(nb, 1, HIDDEN), torch.zeros(nb, 1, dtype=torch.int64), torch.ones(nb, 1, dtype=torch.int64)]
    if how == "too_long":
        if room is None:  # a forward of more tokens than max_forward_tokens, in one row or in all
            nb, nt = draw(st.sampled_from([(1, LIMITS.max_forward_tokens + 1), (2, LIMITS.max_forward_tokens // 2 + 1)]))
        else:
            nb, nt = session_batch, room + draw(st.integers(1, 4))
        pos = (torch.arange(nt) * MAX_LENGTH // nt).repeat(nb, 1)  # non-decreasing and below max_length
        return [torch.zeros(nb, nt, HIDDEN), pos, torch.ones(nb, nt, dtype=torch.int64)]
    if how == "dtype":
        # float16 and bfloat16 are wire dtypes (the node casts them at its edge); these are not
        dtype = draw(st.sampled_from([torch.float64, torch.int64, torch.int32, torch.int16, torch.uint8]))
        return [hidden.to(dtype), positions, mask]
    if how == "nonfinite":
        hidden[row, col, draw(st.integers(0, HIDDEN - 1))] = draw(st.sampled_from([float("nan"), float("inf"),
                                                                                   float("-inf")]))
        return [hidden, positions, mask]
    if how in ("positions_shape", "mask_shape"):
        target = positions if how == "positions_shape" else mask
        bad = draw(st.sampled_from([target[:, :-1], torch.cat([target, target], dim=1), target[0], target[..., None],
                                    target.reshape(-1)[None, None]]))
        if tuple(bad.shape) == (b, t):  # target[0] or the reshape may keep the shape for b == 1: add a column
            bad = torch.cat([target, target[:, :1]], dim=1)
        return [hidden, bad, mask] if how == "positions_shape" else [hidden, positions, bad]
    if how == "positions_dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool]))
        return [hidden, positions.to(dtype), mask]
    if how == "positions_negative":
        positions = positions.long()
        positions[row, 0] = -draw(st.integers(1, 2**62))
        return [hidden, positions, mask]
    if how == "positions_too_big":
        positions = positions.long()
        positions[row, t - 1] = draw(st.integers(MAX_LENGTH, 2**62))
        return [hidden, positions, mask]
    if how == "positions_decrease":
        if t < 2:  # needs two tokens; for a session with no room left this is refused as too long instead
            hidden, mask = torch.cat([hidden, hidden], dim=1), torch.cat([mask, mask], dim=1)
            positions = torch.cat([positions, positions], dim=1)
            t = 2
        positions = positions.long()
        i = draw(st.integers(0, t - 2))
        positions[row, i] = positions[row, i + 1] + 1
        return [hidden, positions, mask]
    if how == "mask_dtype":
        dtype = draw(st.sampled_from([torch.bool, torch.float32, torch.float16, torch.uint8, torch.int16]))
        return [hidden, positions, mask.to(dtype)]
    if how == "mask_values":
        mask = mask.long()
        mask[row, col] = draw(st.sampled_from([2, -1, 7, 2**40]))
        return [hidden, positions, mask]
    index = draw(st.integers(0, 2))
    shapes = [(b, t, HIDDEN), (b, t), (b, t)]
    out: list = [hidden, positions, mask]
    out[index] = draw(undecodable(shapes[index]))
    return out


# --- test 1: forward ---------------------------------------------------------------------------------------

@dataclass
class ForwardCase:
    request: runtime_pb2.ExpertRequest
    expect: str  # "ok", "error" or "either"
    span: tuple[int, int]
    note: str


FORWARD_FOCI = ["valid", "metadata", "random_proto", *BREAKS]
BAD_FORWARD_FOCI = ["metadata", *BREAKS]


@st.composite
def forward_cases(draw, focus: str | None = None):
    """A forward request: valid (in one of the protocol's variants), with broken metadata, with one of the
    BREAKS in its tensors, or with a tensor message of random fields (which may even be valid)."""
    focus = focus or draw(st.sampled_from(FORWARD_FOCI))
    span = draw(st.sampled_from(SUB_SPANS))
    tensors = draw(step_tensors())
    meta, expect, note = pack({"start": span[0], "end": span[1]}), "ok", focus
    if focus == "metadata":
        meta, expect = draw(span_metadata(*span)), "error"
    elif focus == "random_proto":
        tensors[draw(st.integers(0, 2))] = draw(random_proto())
        expect = "either"
    elif focus != "valid":
        tensors, expect = draw(broken_tensors(tensors, how=focus)), "error"
    else:
        how = draw(st.sampled_from(["plain", "coerced", "requires_grad", "float16_wire", "bfloat16", "float16",
                                    "largest"]))
        note = f"valid, {how}"
        if how == "coerced":  # a wrong msgpack type that pydantic reads leniently: if accepted, it runs `span`
            key = draw(st.sampled_from(["start", "end"]))
            meta = pack({"start": span[0], "end": span[1], key: draw(coercible(span[1] if key == "end" else span[0]))})
            expect = "either"
        elif how == "requires_grad":
            tensors[0].requires_grad_(True)
        elif how == "float16_wire":  # compressed on the wire, float32 once decoded
            tensors[0] = serialize_torch_tensor(tensors[0], runtime_pb2.CompressionType.FLOAT16)
        elif how in ("bfloat16", "float16"):  # another wire dtype: cast at the node's edge, answered in it
            tensors[0] = tensors[0].to(getattr(torch, how))
        elif how == "largest":  # exactly max_forward_tokens tokens
            b = messages.MAX_BATCH_SIZE
            tensors = [torch.randn(b, MAX_LENGTH, HIDDEN, generator=torch.Generator().manual_seed(b)),
                       torch.arange(MAX_LENGTH).repeat(b, 1),
                       torch.ones(b, MAX_LENGTH, dtype=torch.int64)]
    return ForwardCase(request(meta, tensors), expect, span, note)


@pytest.mark.parametrize("focus", FORWARD_FOCI)
@settings(max_examples=6, **FUZZ)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_forward_fuzz_refuses_garbage_and_keeps_serving(node, focus, data, seed):
    case = data.draw(forward_cases(focus), label="case")
    event(case.note)
    refused = node.handler.requests_refused
    steps = node.unit.scheduler.steps_done
    reply = asyncio.run(node.handler.rpc_forward(case.request, context(rpc.RPC_FORWARD)))
    error = reply_error(reply)
    event(f"expected {case.expect}, got {'an error' if error else 'a result'}")
    if case.expect == "error":
        assert error is not None, f"{case.note}: a bad forward was answered"
    elif case.expect == "ok":
        assert error is None, f"{case.note}: a valid forward was refused: {error}"
    if error is not None:
        assert_error(reply)
        assert node.handler.requests_refused == refused + 1, f"{case.note}: not refused by validation: {error}"
        assert node.unit.scheduler.steps_done == steps, f"{case.note}: a refused forward ran a step"
    else:
        hidden, positions, mask = (deserialize_torch_tensor(p) for p in case.request.tensors)
        reference = node.stack.forward(*case.span, hidden, positions.long(), mask.bool())
        output = output_of(reply)
        assert output.dtype == hidden.dtype, f"{case.note}: answered in {output.dtype}, sent {hidden.dtype}"
        torch.testing.assert_close(output, reference.to(hidden.dtype), **TOL)
        assert wait_steps(node, steps + 1) == steps + 1
    assert_at_rest(node)
    well_formed_forward(node, seed)


# --- test 2: inference streams ---------------------------------------------------------------------------

STREAM_KINDS = ["first_garbage", "bad_session_field", "no_session", "outside_span", "over_max_length",
                "over_budget", "first_step_bad", "duplicate", "session_twice", "no_step", "bad_tensors",
                "prefix_beyond_cache", "garbage_later"]


@dataclass
class StreamPlan:
    kind: str
    span: tuple[int, int]
    sid: str
    requests: list[runtime_pb2.ExpertRequest]
    chunks: list = field(default_factory=list)  # the valid steps, answered before the one error

    @property
    def answered(self) -> int:
        return len(self.chunks)


@st.composite
def bad_session_field(draw, open_: dict):
    key = draw(st.sampled_from([*open_, "missing", "unknown"]))
    if key == "missing":
        gone = draw(st.sampled_from(list(open_)))
        return {k: v for k, v in open_.items() if k != gone}
    if key == "unknown":
        return {**open_, draw(st.text(max_size=8).filter(lambda k: k not in open_)): draw(ANY_SMALL)}
    if key == "session_id":
        bad = draw(st.one_of(st.just(""), st.text(min_size=messages.MAX_SESSION_ID_LENGTH + 1, max_size=80), NOT_STR))
    elif key == "start":
        bad = draw(st.one_of(st.integers(-(2**63), -1), st.integers(open_["end"], I64), NOT_INT))
    elif key == "end":
        bad = draw(st.one_of(st.integers(-(2**63), open_["start"]), NOT_INT))
    elif key == "max_length":
        bad = draw(st.one_of(st.integers(-(2**63), 0), NOT_INT))
    else:
        bad = draw(st.one_of(st.integers(-(2**63), 0), st.integers(messages.MAX_BATCH_SIZE + 1, I64), NOT_INT))
    return {**open_, key: bad}


@st.composite
def broken_step_metadata(draw, step_id: int, prefix: int):
    good = {"step": step(step_id, prefix)}
    how = draw(st.sampled_from(["map", "neither", "step_not_a_map", "step_field"]))
    if how == "map":
        return draw(broken_map(good))
    if how == "neither":
        return pack({})
    if how == "step_not_a_map":
        packable = st.integers(-(2**63), 2**64 - 1)  # what msgpack can encode at all
        return pack({"step": draw(st.one_of(packable, st.text(max_size=4), st.lists(packable, max_size=2)))})
    key = draw(st.sampled_from(["step_id", "prefix_length", "missing", "unknown"]))
    bad = dict(good["step"])
    if key == "missing":
        del bad[draw(st.sampled_from(["step_id", "prefix_length"]))]
    elif key == "unknown":
        bad["extra"] = draw(ANY_SMALL)
    else:
        bad[key] = draw(st.one_of(st.integers(-(2**63), -1), NOT_INT))
    return pack({"step": bad})


@st.composite
def stream_plans(draw, *, sid: str | None = None, kinds=STREAM_KINDS):
    """A stream that breaks the protocol once; steps before the break are valid and must be answered."""
    kind = draw(st.sampled_from(kinds))
    span = draw(st.sampled_from(SUB_SPANS))
    batch = draw(st.integers(1, 2))
    max_length = draw(st.integers(8, 16))
    sid = sid if sid is not None else draw(st.text(min_size=1, max_size=messages.MAX_SESSION_ID_LENGTH))
    open_ = opening(sid, span, batch, max_length)
    trailing = request({"step": step(99, 0)}, draw(step_tensors(batch=batch, tokens=1, first=0)))

    def plan(requests, chunks=()):  # whatever follows the bad message must never be answered
        return StreamPlan(kind, span, sid, [*requests, trailing], list(chunks))

    first_step = draw(step_tensors(batch=batch, tokens=draw(st.integers(1, 4)), first=0))
    if kind == "first_garbage":
        return plan([request(draw(broken_map({"session": open_})))])
    if kind == "bad_session_field":
        return plan([request({"session": draw(bad_session_field(open_))})])
    if kind == "no_session":
        return plan([request({"step": step(0, 0)}, first_step)])
    if kind == "outside_span":
        lo, hi = draw(st.sampled_from(OUTSIDE))
        return plan([request({"session": {**open_, "start": lo, "end": hi}})])
    if kind == "over_max_length":
        return plan([request({"session": {**open_, "max_length": draw(st.integers(MAX_LENGTH + 1, I64))}})])
    if kind == "over_budget":  # batch x max_length x blocks > the budget's 256 x 2 block-tokens
        least = BUDGET * (SERVED[1] - SERVED[0]) // (MAX_LENGTH * (span[1] - span[0])) + 1
        big = {**open_, "max_length": MAX_LENGTH, "batch_size": draw(st.integers(least, messages.MAX_BATCH_SIZE))}
        return plan([request({"session": big})])
    if kind == "first_step_bad":
        broken = draw(broken_tensors(first_step, session_batch=batch, room=max_length))
        return plan([request({"session": open_, "step": step(0, 0)}, broken)])
    if kind == "duplicate":  # the runner opens `sid` in another stream first
        return plan(session_requests(open_, [first_step], carry_first=draw(st.booleans()))[:1])
    # the rest break the protocol after 0-2 valid steps
    chunks, prefix = [], 0
    for _ in range(draw(st.integers(0, 2))):
        tokens = draw(st.integers(1, min(4, max_length - prefix - 2)))
        chunks.append(draw(step_tensors(batch=batch, tokens=tokens, first=prefix)))
        prefix += tokens
    reqs = session_requests(open_, chunks, carry_first=bool(chunks) and draw(st.booleans()))
    n = len(chunks)
    if kind == "session_twice":
        again = {"session": {**open_, "session_id": draw(st.sampled_from([sid, f"{sid[:60]}-2"]))}}
        if draw(st.booleans()):
            again["step"] = step(n, prefix)
        bad = request(again, draw(step_tensors(batch=batch, tokens=1, first=prefix)))
    elif kind == "no_step":
        bad = request({})
    elif kind == "bad_tensors":
        good = draw(step_tensors(batch=batch, tokens=draw(st.integers(1, max_length - prefix)), first=prefix))
        bad = request({"step": step(n, prefix)},
                      draw(broken_tensors(good, session_batch=batch, room=max_length - prefix)))
    elif kind == "prefix_beyond_cache":
        bad = request({"step": step(n, prefix + draw(st.integers(1, I64 - prefix)))},
                      draw(step_tensors(batch=batch, tokens=1, first=prefix)))
    else:  # garbage_later
        bad = request(draw(broken_step_metadata(n, prefix)), draw(step_tensors(batch=batch, tokens=1, first=prefix)))
    return plan([*reqs, bad], chunks)


async def run_plan(node: Node, plan: StreamPlan):
    """Run a planned bad stream; for `duplicate`, a holder stream keeps `plan.sid` open meanwhile.
    Returns (bad stream's replies, holder's chunks, holder's replies)."""
    if plan.kind != "duplicate":
        return await collect(node, feed(plan.requests)), [], []
    opened, bad_done = asyncio.Event(), asyncio.Event()
    g = torch.Generator().manual_seed(len(plan.sid))
    holder_chunks = [[torch.randn(1, 3, HIDDEN, generator=g), torch.arange(3)[None], torch.ones(1, 3, dtype=torch.int64)]]
    holder_reqs = session_requests(opening(plan.sid, SERVED, 1, 16), holder_chunks, carry_first=False)

    async def bad():
        try:
            return await collect(node, feed(plan.requests, wait_first=opened))
        finally:
            bad_done.set()

    holder, replies = await asyncio.gather(
        collect(node, feed(holder_reqs, opened=opened, wait_before_last=bad_done)), bad())
    return replies, holder_chunks, holder


def check_bad_stream(node: Node, plan: StreamPlan, replies: list) -> str:
    """The valid steps were answered correctly, then exactly one error, then the stream ended."""
    errors = [reply_error(r) for r in replies]
    assert len(replies) == plan.answered + 1, f"{plan.kind}: replies {errors}"
    if plan.answered:
        check_session(node, plan.span, plan.chunks, replies[:-1])
    return assert_error(replies[-1])


@pytest.mark.parametrize("kind", STREAM_KINDS)
@settings(max_examples=7, **FUZZ)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_inference_stream_fuzz_frees_everything_and_keeps_serving(node, kind, data, seed):
    plan = data.draw(stream_plans(kinds=[kind]), label="plan")
    event(f"{plan.kind}, {plan.answered} steps first")
    refused = node.handler.requests_refused
    steps = node.unit.scheduler.steps_done
    replies, holder_chunks, holder_replies = asyncio.run(run_plan(node, plan))
    error = check_bad_stream(node, plan, replies)
    if plan.kind == "duplicate":
        assert "already open" in error
        check_session(node, SERVED, holder_chunks, holder_replies)  # the open session is untouched
    expected = steps + plan.answered + len(holder_chunks)
    assert wait_steps(node, expected) == expected, f"{plan.kind}: steps ran for a refused message"
    assert node.handler.requests_refused == refused + 1, f"{plan.kind}: not refused by validation: {error}"
    assert_at_rest(node)
    well_formed_session(node, seed)


def test_silent_streams_time_out_and_free_their_cache(node):
    """A stream that never sends, one that stalls after its first step, and an empty one, all at once."""
    chunk = [torch.randn(1, 4, HIDDEN), torch.arange(4)[None], torch.ones(1, 4, dtype=torch.int64)]
    stall = asyncio.Event()  # never set

    async def never():
        await stall.wait()
        yield request({})

    async def stalls_after_first_step():
        yield session_requests(opening("stalling", SERVED, 1, 16), [chunk], carry_first=True)[0]
        await stall.wait()

    async def empty():
        return
        yield

    async def run():
        return await asyncio.gather(collect(node, never()), collect(node, stalls_after_first_step()),
                                    collect(node, empty()))

    began = time.monotonic()
    silent, stalled, nothing = asyncio.run(run())
    took = time.monotonic() - began
    assert len(silent) == 1 and "no message" in assert_error(silent[0])
    assert len(stalled) == 2 and "no message" in assert_error(stalled[1])
    check_session(node, SERVED, [chunk], stalled[:1])
    # a stream that ends before its first message gets at most one reply, an error (whether the handler
    # still answers depends on when the P2P layer reports the end of the stream)
    assert len(nothing) <= 1 and all(reply_error(r) for r in nothing)
    assert LIMITS.idle_timeout <= took < 3 * LIMITS.idle_timeout
    assert_at_rest(node)
    well_formed_session(node, 7)


# --- test 3: a good session amid garbage -----------------------------------------------------------------

@settings(max_examples=8, **FUZZ)
@given(data=st.data())
def test_good_session_is_untouched_by_concurrent_garbage(node, data):
    draw = data.draw
    tag = next(_session_ids)
    good_sid = f"good-{tag}"
    # the good session: 6-token prefill riding on the open, then 4 decode steps
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="seed"))
    hidden = torch.randn(1, 10, HIDDEN, generator=g)
    positions, mask = torch.arange(10)[None], torch.ones(1, 10, dtype=torch.int64)
    cuts = [0, 6, 7, 8, 9, 10]
    good_chunks = [[hidden[:, a:b], positions[:, a:b], mask[:, a:b]] for a, b in itertools.pairwise(cuts)]
    good_reqs = session_requests(opening(good_sid, SERVED, 1, 16), good_chunks, carry_first=True)
    # neighbours: valid sessions on the same blocks whose decode steps batch with the good one's, then break
    neighbours = []
    for i in range(draw(st.integers(1, 2), label="neighbours")):
        batch = draw(st.integers(1, 2))
        chunks = [draw(step_tensors(batch=batch, tokens=5, first=0))]
        chunks += [draw(step_tensors(batch=batch, tokens=1, first=5 + j)) for j in range(3)]
        reqs = session_requests(opening(f"neighbour-{tag}-{i}", SERVED, batch, 12), chunks, carry_first=True)
        bad = request({"step": step(4, 8)}, draw(broken_tensors(draw(step_tensors(batch=batch, tokens=1, first=8)),
                                                                 session_batch=batch, room=4)))
        neighbours.append(StreamPlan("neighbour", SERVED, f"neighbour-{tag}-{i}", [*reqs, bad], chunks))
    plans = [draw(stream_plans(sid=f"bad-{tag}-{i}", kinds=[k for k in STREAM_KINDS if k != "duplicate"]))
             for i in range(draw(st.integers(2, 4), label="bad streams"))]
    duplicates = [request({"session": opening(good_sid, span, 1, 8)}) for span in draw(
        st.lists(st.sampled_from(SUB_SPANS), min_size=1, max_size=2), label="duplicates")]
    bad_forwards = [draw(forward_cases(draw(st.sampled_from(BAD_FORWARD_FOCI)))) for _ in range(2)]
    pauses = draw(st.lists(st.integers(0, 3), min_size=20, max_size=20), label="pauses")
    refused = node.handler.requests_refused
    steps = node.unit.scheduler.steps_done

    async def run():
        opened, dups_done = asyncio.Event(), asyncio.Event()

        async def dups():
            try:
                return await asyncio.gather(*[collect(node, feed([d], wait_first=opened)) for d in duplicates])
            finally:
                dups_done.set()

        streams = [collect(node, feed(p.requests, pause=pauses[i])) for i, p in enumerate([*neighbours, *plans])]
        forwards = [node.handler.rpc_forward(c.request, context(rpc.RPC_FORWARD)) for c in bad_forwards]
        return await asyncio.gather(
            collect(node, feed(good_reqs, pause=pauses[-1], opened=opened, wait_before_last=dups_done)),
            dups(), asyncio.gather(*streams), asyncio.gather(*forwards))

    good, dup_replies, stream_replies, forward_replies = asyncio.run(run())
    check_session(node, SERVED, good_chunks, good)
    for replies in dup_replies:
        assert len(replies) == 1 and "already open" in assert_error(replies[0])
    for plan, replies in zip([*neighbours, *plans], stream_replies):
        check_bad_stream(node, plan, replies)
    for reply in forward_replies:
        assert_error(reply)
    valid_steps = len(good_chunks) + sum(p.answered for p in [*neighbours, *plans])
    assert wait_steps(node, steps + valid_steps) == steps + valid_steps
    bad_requests = len(duplicates) + len(neighbours) + len(plans) + len(bad_forwards)
    assert node.handler.requests_refused == refused + bad_requests
    assert_at_rest(node)


# --- test 4: probe, ping, info ---------------------------------------------------------------------------

def probe(node: Node, sizes: list[int], caller: PeerID | None = None) -> runtime_pb2.ExpertResponse:
    tensors = [runtime_pb2.Tensor(buffer=bytes(n), size=[n], dtype="uint8") for n in sizes]
    return asyncio.run(node.handler.rpc_probe(runtime_pb2.ExpertRequest(tensors=tensors),
                                              context(rpc.RPC_PROBE, caller)))


@settings(max_examples=40, **FUZZ)
@given(payload=st.one_of(st.binary(max_size=200),  # and long payloads around the limit, built from a short motif
                        st.tuples(st.integers(0, 6000), st.binary(min_size=1, max_size=8)).map(
                            lambda x: (x[1] * x[0])[: x[0]])),
       tensors=st.lists(st.integers(0, 64), max_size=2))
def test_ping_echoes_bounded_payloads(node, payload, tensors):
    req = runtime_pb2.ExpertRequest(metadata=payload, tensors=as_protos([torch.zeros(n) for n in tensors]))
    reply = asyncio.run(node.handler.rpc_ping(req, context(rpc.RPC_PING)))
    if len(payload) <= messages.MAX_METADATA_BYTES:
        assert reply.metadata == payload and not reply.tensors
    else:
        assert str(messages.MAX_METADATA_BYTES) in assert_error(reply)


SIZES = [0, 1, 1000, messages.MAX_PROBE_BYTES, messages.MAX_PROBE_BYTES + 1, 3 * messages.MAX_PROBE_BYTES]


@settings(max_examples=20, **FUZZ)
@given(sizes=st.lists(st.sampled_from(SIZES), max_size=3))
def test_probe_answers_one_bounded_tensor(node, sizes):
    reply = probe(node, sizes)  # a fresh caller each time: below the rate limit
    if len(sizes) == 1 and sizes[0] <= messages.MAX_PROBE_BYTES:
        assert msgpack.unpackb(reply.metadata) == {"received": sizes[0]} and not reply.tensors
    else:
        assert "one tensor" in assert_error(reply)


def test_probe_rate_limit_is_per_caller_and_info_stays_correct(node):
    caller, other = peer(10**6), peer(10**6 + 1)
    for _ in range(messages.PROBE_RATE):
        assert msgpack.unpackb(probe(node, [100], caller).metadata) == {"received": 100}
    for sizes in ([100], [], [5, 5]):  # over the rate: refused whatever the payload
        assert "probes a minute" in assert_error(probe(node, sizes, caller))
    assert msgpack.unpackb(probe(node, [100], other).metadata) == {"received": 100}
    reply = asyncio.run(node.handler.rpc_info(runtime_pb2.ExpertRequest(metadata=b"\xc1junk"),
                                              context(rpc.RPC_INFO)))
    info = InfoReply.model_validate(msgpack.unpackb(reply.metadata, raw=False))
    assert [(s.start, s.end) for s in info.spans] == [SERVED]
    assert info.free_cache_tokens == info.cache_tokens == BUDGET
    well_formed_forward(node, 3)


# --- library bugs, pinned -----------------------------------------------------------------------------------

_CRASH_SCRIPT = textwrap.dedent("""
    import asyncio, msgpack
    from hivemind.p2p import P2PContext, PeerID
    from hivemind.proto import runtime_pb2
    from swarmnode.messages import MAX_METADATA_BYTES
    from swarmnode.server.handler import BlockHandler, SessionLimits

    # hivemind's MSGPackSerializer decodes ext type 0x40 as a tuple by unpacking its payload recursively
    raw = msgpack.packb([])
    while len(msgpack.packb(msgpack.ExtType(0x40, raw))) <= MAX_METADATA_BYTES:
        raw = msgpack.packb(msgpack.ExtType(0x40, raw))
    me = PeerID.from_base58("12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j")
    handler = BlockHandler(lambda: [], limits=SessionLimits(), info=lambda: None)
    reply = asyncio.run(handler.rpc_forward(runtime_pb2.ExpertRequest(metadata=raw),
                                            P2PContext("swarmnode.forward", me, me)))
    print("FORWARD", len(raw), msgpack.unpackb(reply.metadata))

    async def one(stream):
        return [r async for r in handler.rpc_inference(stream, P2PContext("swarmnode.inference", me, me))]

    async def stream():
        yield runtime_pb2.ExpertRequest(metadata=raw)

    print("INFERENCE", [msgpack.unpackb(r.metadata) for r in asyncio.run(one(stream()))])
""")


def test_nested_msgpack_extension_metadata_gets_an_error_reply_not_a_crash():
    result = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, f"the handler's process died with status {result.returncode}: {result.stderr[-500:]}"
    assert "FORWARD" in result.stdout and "'error'" in result.stdout.split("INFERENCE")[0]
    assert "INFERENCE [{'error'" in result.stdout


@pytest.mark.parametrize("end", [True, "1", 1.0, b"1", msgpack.ExtType(0x7F, b"1")],
                         ids=["bool", "str", "float", "bytes", "unknown-ext"])
def test_wrongly_typed_span_fields_are_refused(node, end):
    hidden, positions, mask = torch.randn(1, 2, HIDDEN), torch.arange(2)[None], torch.ones(1, 2, dtype=torch.int64)
    reply = asyncio.run(node.handler.rpc_forward(request({"start": 0, "end": end}, [hidden, positions, mask]),
                                                 context(rpc.RPC_FORWARD)))
    error = reply_error(reply)
    assert error is not None, f"end={end!r} was read as an integer and the forward was served"


def test_tensor_fields_are_checked_before_any_tensor_is_decoded(node, monkeypatch):
    decoded = []

    def counting(proto):
        decoded.append(proto.dtype)
        return deserialize_torch_tensor(proto)

    monkeypatch.setattr(messages, "deserialize_torch_tensor", counting)
    tensors = [torch.zeros(1, 1, HIDDEN), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.int64)]
    reply = asyncio.run(node.handler.rpc_forward(request({"start": 0, "end": 2}, tensors * 17),
                                                 context(rpc.RPC_FORWARD)))
    assert "expected 3 tensors" in assert_error(reply)
    assert decoded == [], f"{len(decoded)} tensors were decoded to refuse a request of {3 * 17} tensors"


def test_empty_inference_stream_gets_one_error_reply(node):
    async def empty():
        return
        yield

    replies = asyncio.run(collect(node, empty()))
    assert_at_rest(node)
    assert len(replies) == 1 and assert_error(replies[0])


def test_a_step_continuing_from_fewer_tokens_rolls_the_cache_back_and_one_from_more_is_refused(node):
    """Speculative decoding's rewind, as a node sees it: 5 tokens, a pass of 4 drafted ones, then a step that
    continues from 6 (the first draft kept, three rejected) computes as if the rejected ones never came; a
    step continuing from more tokens than the session holds is refused, with what to do."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, 12, HIDDEN, generator=g)
    positions = torch.arange(12)[None]
    mask = torch.ones(1, 12, dtype=torch.int64)

    def part(a, b):
        return [hidden[:, a:b], positions[:, a:b], mask[:, a:b]]

    kept = [part(0, 5), part(5, 6), part(9, 11)]  # what stays: 5, the accepted draft, then 2 new at 6, 7
    kept[2][1] = positions[:, 6:8]
    reqs = [request({"session": opening(f"rewind-{next(_session_ids)}", SERVED, 1, 16), "step": step(0, 0)},
                    part(0, 5)),
            request({"step": step(1, 5)}, part(5, 9)),  # a pass of 4 drafts
            request({"step": step(2, 6)}, kept[2]),  # 3 of them rejected: continue from 6
            request({"step": step(3, 9)}, part(11, 12))]  # from 9, but the session holds 8
    replies = asyncio.run(collect(node, feed(reqs)))
    assert len(replies) == 4, [reply_error(r) for r in replies]
    reference = node.stack.forward(*SERVED, torch.cat([c[0] for c in kept], 1), torch.arange(8)[None],
                                   torch.ones(1, 8, dtype=torch.bool))
    torch.testing.assert_close(output_of(replies[0]), reference[:, :5], **TOL)
    assert msgpack.unpackb(replies[2].metadata, raw=False) == {"step_id": 2, "cache_length": 8}
    torch.testing.assert_close(output_of(replies[2]), reference[:, 6:8], **TOL)
    assert "continues from 9 tokens, but this node holds 8" in assert_error(replies[3])
    assert_at_rest(node)
