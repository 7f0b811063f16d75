"""What the RPCs carry: message schemas, the metadata and tensor codec, error replies; defined once here.

Every RPC carries hivemind's `runtime_pb2.ExpertRequest` / `ExpertResponse`: tensors go through hivemind's
tensor serialization, and the `metadata` bytes hold one msgpack dict validated by the pydantic models
below. Validation happens at the edge, before any work or allocation; a bad message is answered with
`ErrorReply` and never reaches the runtime.

The RPCs themselves (names, shapes, which servicer answers each, how they are called) are `swarmnode.rpc`.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# the error codes an `ErrorReply` carries are defined with the error base class, and part of this protocol
from swarmnode.errors import (  # noqa: F401
    ERROR_BAD_REQUEST,
    ERROR_CACHE_FULL,
    ERROR_MOVED,
    ERROR_WRONG_PHASE,
    SwarmError,
)
from swarmnode.records import PhaseName
from swarmnode.runtime.dtypes import DTYPES

# Upper bounds that a peer enforces on any request, whatever its own budget.
MAX_BATCH_SIZE = 64
MAX_SESSION_ID_LENGTH = 64
MAX_PEER_ID_LENGTH = 128  # a base58 libp2p peer id is about 46-53 characters
MAX_METADATA_BYTES = 4096
# Link probes: one uint8 tensor of at most this many bytes, at most PROBE_RATE probes a minute per caller; a
# node gives its probe slot (one measuring caller at a time, `server.probe.ProbeSlot`) for at most
# PROBE_MAX_HOLD seconds.
MAX_PROBE_BYTES = 1 << 20
PROBE_RATE = 30
PROBE_MAX_HOLD = 10.0


class ProtocolError(SwarmError, ValueError):
    """A request that does not follow the protocol; its message (and `code`, see `ErrorReply`) is sent back
    to the caller."""

    code = ERROR_BAD_REQUEST


class ReplyError(SwarmError, RuntimeError):
    """A peer answered a call with an `ErrorReply`; `code` is the reply's code when it sent one."""

    code = "error_reply"


class _Message(BaseModel):
    # strict: a bool, a string or a float is not an int, whatever it would coerce to
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Span(_Message):
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Span:
        if self.end <= self.start:
            raise ValueError(f"blocks [{self.start}, {self.end}) is empty")
        return self


class OpenSession(Span):
    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0, le=MAX_BATCH_SIZE)
    # keep every step's output for `OUTPUTS` (a pushing client's failover); counted in the cache reserved
    keep_outputs: bool = False
    # the phase of the request this session serves: a prefill-only node takes prefill sessions only, a
    # decode-only node all but prefill sessions (code `wrong_phase` otherwise)
    phase: PhaseName = "both"


class PushTarget(_Message):
    """Where a node sends a step's output: the next hop's peer and session, and that session's pending step.

    The next hop's step continues from `prefix_length` tokens, which must lie within the pushing step's
    tokens; the node sends its output from that position on (all of it when they match; the tail when the
    pushing step is a replay of the whole sequence into a replacement)."""

    peer_id: str = Field(min_length=1, max_length=MAX_PEER_ID_LENGTH)
    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    step_id: int = Field(ge=0)
    prefix_length: int = Field(ge=0)
    via: str | None = Field(default=None, min_length=1, max_length=MAX_PEER_ID_LENGTH)  # the peer's relay

    @model_validator(mode="after")
    def _peer(self) -> PushTarget:
        for peer in (self.peer_id, self.via):
            if peer is not None:
                check_peer_id(peer)
        return self


_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58, as long as a multihash of a key


def check_peer_id(text: str) -> str:
    """`text` when it is a base58 libp2p peer id; ValueError otherwise."""
    from hivemind.p2p import PeerID

    try:
        if not _PEER_ID.fullmatch(text):
            raise ValueError
        PeerID.from_base58(text)
    except Exception:  # base58 or multihash decoding: whatever fails, it is no peer id
        raise ValueError(f"{text[:60]!r} is not a libp2p peer id") from None
    return text


MAX_HANDOVER_TARGETS = 4


class KvTarget(_Message):
    """Where a prefill node sends a session's KV cache after a step: blocks `[start, end)` (those of them it
    holds) go to session `session_id` on `peer_id` (through its relay `via`, when it has one)."""

    peer_id: str = Field(min_length=1, max_length=MAX_PEER_ID_LENGTH)
    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    via: str | None = Field(default=None, min_length=1, max_length=MAX_PEER_ID_LENGTH)

    @model_validator(mode="after")
    def _valid(self) -> KvTarget:
        for peer in (self.peer_id, self.via):
            if peer is not None:
                check_peer_id(peer)
        if self.end <= self.start:
            raise ValueError(f"blocks [{self.start}, {self.end}) is empty")
        return self


class KvHandover(_Message):
    """The header of a `KV_HANDOVER`: blocks `[start, end)` of session `session_id`, `length` tokens of a
    batch of `batch_size`, keys and values in `dtype`; it carries one tensor, the (batch, length) mask of
    the tokens that hold a real key (0 for padding), and one message per block follows with its keys and
    values, each (batch, kv heads, length, head dim)."""

    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    length: int = Field(gt=0)
    batch_size: int = Field(gt=0, le=MAX_BATCH_SIZE)
    dtype: str = Field(min_length=1, max_length=16)

    @model_validator(mode="after")
    def _valid(self) -> KvHandover:
        if self.end <= self.start:
            raise ValueError(f"blocks [{self.start}, {self.end}) is empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype[:16]!r} is not one of {', '.join(DTYPES)}")
        return self


class KvHandoverReply(_Message):
    blocks: int  # blocks now held for the session
    complete: bool  # every block of the session's span is in: its decode steps can start


class StepMeta(_Message):
    """One step of an inference session: new tokens continue from `prefix_length` cached tokens.

    A `prefix_length` below the session's cached length rolls the cache back to it (used when a client
    replays or rewinds); above it is an error. Step ids increase along a stream. `pushed`: the step's
    tensors come by `PUSH`, not in this message. `push_to`: send the output there, not back. `keep_last`:
    answer with the outputs of the step's last `keep_last` tokens only (0: all of them), e.g. the one token a
    generating client needs, so the rest never crosses its link.
    """

    step_id: int = Field(ge=0)
    prefix_length: int = Field(ge=0)
    pushed: bool = False
    push_to: PushTarget | None = None
    keep_last: int = Field(default=0, ge=0)
    # after the step, send the session's KV cache for these blocks to these sessions (`KV_HANDOVER`)
    handover_to: list[KvTarget] | None = Field(default=None, min_length=1, max_length=MAX_HANDOVER_TARGETS)


class PushRequest(_Message):
    """One step's input for an open session, sent by `PUSH`: it must match the step the session's client
    sent (`StepMeta` with `pushed`) in `step_id` and `prefix_length`."""

    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    step_id: int = Field(ge=0)
    prefix_length: int = Field(ge=0)


class PushReply(_Message):
    queued: bool  # False: that step had already run (a duplicate push, e.g. from a replacement hop)


class OutputsRequest(_Message):
    """A session's kept outputs for token positions `[start, end)`."""

    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LENGTH)
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> OutputsRequest:
        if self.end <= self.start:
            raise ValueError(f"tokens [{self.start}, {self.end}) is empty")
        return self


class InferenceRequest(_Message):
    session: OpenSession | None = None
    step: StepMeta | None = None


class ProbeRequest(_Message):
    """What a `probe` says besides its payload (msgpack metadata; empty for a plain probe): `hold` asks for
    the node's probe slot for that many seconds (capped at `PROBE_MAX_HOLD`), `release` gives it
    back once this payload is in."""

    hold: float | None = Field(default=None, gt=0, le=3600)
    release: bool = False


class ProbeReply(BaseModel):
    """A `probe`'s answer as the prober reads it (`server.probe.ProbeSlot.answer`); fields it does not know are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    received: int = 0
    granted: bool | None = None
    retry_after: float | None = Field(default=None, ge=0, le=3600)
    shared: bool = False


class ForwardRequest(Span):
    pass


# Relays: reservations are granted for at most this long, and renewed by the node well before they lapse.
RELAY_MAX_TTL = 120.0
MAX_REACH_ADDRESSES = 8


class RelayReserve(_Message):
    """A node's request to be reached through the called peer for `ttl` seconds."""

    ttl: float = Field(gt=0, le=RELAY_MAX_TTL, allow_inf_nan=False)


class RelayReply(_Message):
    ttl: float  # seconds granted


class ReachCheck(_Message):
    """Addresses (`/ip4/A/tcp/P` multiaddrs) at which the caller listens; the called peer says whether a TCP
    connection to any of them opens and a libp2p listener answers there."""

    maddrs: list[str] = Field(min_length=1, max_length=MAX_REACH_ADDRESSES)


class ReachReply(_Message):
    reachable: bool
    address: str | None = None  # the address that answered
    why_not: str | None = None  # why none did (not `error`: that names an `ErrorReply`)


def relay_address(peer_id: str, rpc: str) -> str:
    """What a relayed call carries in its `uid`: the node it is for and the RPC to call there."""
    return f"{peer_id} {rpc}"


def parse_relay_address(uid: str, allowed: frozenset[str]) -> tuple[str, str]:
    """The (peer id, RPC) of a relayed call's `uid`; ProtocolError when malformed or not an RPC in `allowed`."""
    peer, _, rpc = uid.partition(" ")
    if not peer or len(peer) > MAX_PEER_ID_LENGTH:
        raise ProtocolError("a relayed call must name the peer it is for and the RPC: '<peer id> <rpc>'")
    try:
        check_peer_id(peer)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if rpc not in allowed:
        raise ProtocolError(f"{rpc[:60]!r} is not an RPC this relay forwards this way (one of {', '.join(sorted(allowed))})")
    return peer, rpc


def relayed_caller(remote_id: str, uid: str, relay: str | None) -> str:
    """Who made a call: the peer the call came from, or, for a call that came through this node's own relay
    (`relay`), the caller the relay names in the `uid`. A `uid` from anyone else is ignored."""
    if relay is not None and remote_id == relay and uid:
        return uid
    return remote_id


class ErrorReply(_Message):
    error: str  # what was wrong and what to do, for people
    code: str | None = None  # for programs: ERROR_CACHE_FULL, or None



class SpanInfo(_Message):
    start: int
    end: int
    cache_tokens: int
    free_cache_tokens: int


class InfoReply(_Message):
    """What a node serves now: its spans (none while it waits or loads; two while it moves)."""

    state: str
    spans: list[SpanInfo]
    num_blocks: int
    hidden_size: int
    free_cache_tokens: int
    cache_tokens: int
    throughput: float
    version: str
    dtype: str
    device: str
    quantization: str = "none"


class StepReply(_Message):
    step_id: int
    cache_length: int
    # set when the step had a `push_to`: whether the next hop took the output, and if not, why
    pushed: bool | None = None
    push_error: str | None = None
    # set when the step had a `handover_to`: whether each target took the KV cache, and if not, why
    handed_over: list[bool] | None = None
    handover_errors: list[str | None] | None = None


# What decoding untrusted msgpack bytes may raise (msgpack's own errors, bad UTF-8, extension types refused
# by `_refuse_extension`, non-string map keys, integers out of range, nesting past the stack limit).
_MSGPACK_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)


def _refuse_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed in metadata")


def _loads(raw: bytes) -> Any:
    """Plain msgpack with extension types refused and nesting bounded by msgpack's own stack limit.

    Not hivemind's serializer: it decodes nested tuple extensions recursively in C, and a few hundred levels
    in a sub-4 KiB message overflow the process stack."""
    return msgpack.unpackb(raw, raw=False, ext_hook=_refuse_extension, strict_map_key=True)


def pack_metadata(message: BaseModel | dict[str, Any]) -> bytes:
    """A message as msgpack bytes; fields left None are left out (every such field defaults to None)."""
    payload = message.model_dump(mode="json", exclude_none=True) if isinstance(message, BaseModel) else message
    return MSGPackSerializer.dumps(payload)


def unpack_metadata(raw: bytes, model: type[BaseModel]) -> Any:
    """Parse and validate a message's metadata, raising ProtocolError with a readable reason."""
    if len(raw) > MAX_METADATA_BYTES:
        raise ProtocolError(f"metadata is {len(raw)} bytes, more than the limit of {MAX_METADATA_BYTES}")
    try:
        payload = _loads(raw) if raw else {}
    except _MSGPACK_ERRORS as exc:
        raise ProtocolError(f"metadata is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"metadata must be a map, got {type(payload).__name__}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in exc.errors())
        raise ProtocolError(f"invalid {model.__name__}: {reasons}") from None


def error_response(message: str, code: str | None = None) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=pack_metadata(ErrorReply(error=message, code=code)))


def response_error(response: runtime_pb2.ExpertResponse) -> str | None:
    """The error text a peer put in its reply, if any."""
    if not response.metadata:
        return None
    if len(response.metadata) > MAX_METADATA_BYTES * 4:
        return "peer sent oversized metadata"
    try:
        payload = _loads(response.metadata)
    except _MSGPACK_ERRORS:
        return "peer sent unreadable metadata"
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return None


def response_error_code(response: runtime_pb2.ExpertResponse) -> str | None:
    """The machine-readable `ErrorReply.code` of an error reply, if it has a well-formed one."""
    if not response.metadata or len(response.metadata) > MAX_METADATA_BYTES * 4:
        return None
    try:
        payload = _loads(response.metadata)
    except _MSGPACK_ERRORS:
        return None
    code = payload.get("code") if isinstance(payload, dict) and "error" in payload else None
    return code if isinstance(code, str) else None


# Dtypes hidden states may travel in. A node computes in its own dtype and answers in the dtype it was sent
# (casting at its edge), so the sender decides the wire precision: a float32 route keeps float32 between
# hops whatever the nodes compute in, and a bfloat16 client's states are never widened on the wire.
WIRE_DTYPES: dict[str, torch.dtype] = DTYPES


def serialize_tensors(tensors: list[torch.Tensor]) -> list[runtime_pb2.Tensor]:
    return [_serialize(t.detach().cpu().contiguous()) for t in tensors]


def _serialize(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """One tensor in its own dtype. bfloat16 goes as its 2-byte words (hivemind's default widens it to
    float32 bytes, doubling the traffic; its decoder reads both forms)."""
    if tensor.dtype != torch.bfloat16:
        return serialize_torch_tensor(tensor)
    return runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE,
                              buffer=tensor.view(torch.int16).numpy().tobytes(), size=tensor.shape,
                              dtype="bfloat16", requires_grad=False)


# Checked on the raw protobufs before any tensor is decoded.
MAX_TENSORS = 3
MAX_TENSOR_BYTES = 256 * 2**20


def deserialize_tensors(protos) -> list[torch.Tensor]:
    if len(protos) > MAX_TENSORS:
        raise ProtocolError(f"expected {MAX_TENSORS} tensors (hidden states, position ids, attention mask), "
                            f"got {len(protos)}")
    total = sum(len(p.buffer) for p in protos)
    if total > MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensors of {total} bytes exceed the limit of {MAX_TENSOR_BYTES}")
    for p in protos:
        elements = 1
        for dim in p.size:
            elements *= max(int(dim), 0)
        if elements * 16 > MAX_TENSOR_BYTES * 4:  # what decoding could expand to, at 16 bytes an element
            raise ProtocolError(f"a tensor declares shape {list(p.size)}, too large to decode")
    try:
        return [deserialize_torch_tensor(p) for p in protos]
    except Exception as exc:  # any failure to decode a peer's bytes (torch, numpy, codec) is that peer's error
        raise ProtocolError(f"a tensor could not be decoded: {exc}") from exc


def push_request(session_id: str, step_id: int, prefix_length: int, hidden: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> runtime_pb2.ExpertRequest:
    """A `PUSH`: one step's input for a session, as a node (or the session's client) sends it."""
    return runtime_pb2.ExpertRequest(
        metadata=pack_metadata(PushRequest(session_id=session_id, step_id=step_id, prefix_length=prefix_length)),
        tensors=step_tensors(hidden, positions, mask))


def step_tensors(
    hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
) -> list[runtime_pb2.Tensor]:
    return serialize_tensors([hidden, position_ids.to(torch.int64), attention_mask.to(torch.int64)])


def validate_step_tensors(
    tensors: list[torch.Tensor],
    *,
    hidden_size: int,
    batch_size: int | None,
    max_tokens: int,
    max_position: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check `[hidden (B, T, H), position_ids (B, T), attention_mask (B, T)]` and return them.

    Raises ProtocolError naming the first thing that is wrong: count, rank, shape, a dtype outside
    `WIRE_DTYPES`, non-finite values, positions out of range or not increasing, a mask that is not 0/1.
    The hidden states keep their wire dtype: the receiver casts them to the dtype it computes in.
    """
    if len(tensors) != 3:
        raise ProtocolError(f"expected 3 tensors (hidden, position_ids, attention_mask), got {len(tensors)}")
    hidden, positions, mask = tensors
    if hidden.ndim != 3:
        raise ProtocolError(f"hidden states must have rank 3 (batch, tokens, hidden), got shape {tuple(hidden.shape)}")
    b, t, h = hidden.shape
    if h != hidden_size:
        raise ProtocolError(f"hidden size is {h}, this model has {hidden_size}")
    if b == 0 or t == 0:
        raise ProtocolError(f"hidden states are empty: shape {tuple(hidden.shape)}")
    if batch_size is not None and b != batch_size:
        raise ProtocolError(f"batch size is {b}, the session was opened with {batch_size}")
    if b > MAX_BATCH_SIZE:
        raise ProtocolError(f"batch size {b} exceeds the limit of {MAX_BATCH_SIZE}")
    if t > max_tokens:
        raise ProtocolError(f"{t} new tokens do not fit: at most {max_tokens} are allowed here")
    if hidden.dtype not in WIRE_DTYPES.values():
        raise ProtocolError(f"hidden states are {str(hidden.dtype).removeprefix('torch.')}: send them as one of "
                            f"{', '.join(WIRE_DTYPES)}")
    if not torch.isfinite(hidden).all():
        raise ProtocolError("hidden states contain NaN or infinity")
    for name, tensor in (("position_ids", positions), ("attention_mask", mask)):
        if tuple(tensor.shape) != (b, t):
            raise ProtocolError(f"{name} must have shape {(b, t)}, got {tuple(tensor.shape)}")
        if tensor.dtype not in (torch.int64, torch.int32):
            raise ProtocolError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if positions.min() < 0 or positions.max() >= max_position:
        raise ProtocolError(f"position ids must lie in [0, {max_position}), got [{positions.min()}, {positions.max()}]")
    if t > 1 and bool((positions[:, 1:] < positions[:, :-1]).any()):
        raise ProtocolError("position ids must not decrease along the sequence")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ProtocolError("attention_mask must hold only 0 and 1")
    return hidden, positions.to(torch.int64), mask.to(torch.bool)
