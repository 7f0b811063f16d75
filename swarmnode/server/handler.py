"""The node's RPC handlers over hivemind P2P: `info`, `ping`, `probe`, `forward`, the streaming `inference`,
`push` and `outputs` for steps that go from node to node, and `kv_handover` for a session's KV cache handed
over from the node that ran its prompt (`server.handover`).

Every field of every request is validated (`swarmnode.messages`) before any work or allocation. A bad
request gets an error reply naming what was wrong; the handler, the node and other sessions go on. A
session's cache is reserved from the node's budget when it opens (refused up front when it does not
fit) and given back when its stream ends, fails, or sits idle past the session timeout; a session's
life is `server.session.ServerSession`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarmnode import messages, metrics, rpc
from swarmnode.admission import Role
from swarmnode.errors import SwarmError
from swarmnode.messages import (
    ForwardRequest,
    InferenceRequest,
    InfoReply,
    KvHandover,
    OutputsRequest,
    ProtocolError,
    PushReply,
    PushRequest,
    error_response,
    pack_metadata,
    unpack_metadata,
)
from swarmnode.naming import short_id
from swarmnode.records import Phase
from swarmnode.relay.dialer import RelayDialer
from swarmnode.runtime.memory import TrimScheduler
from swarmnode.runtime.scheduler import StepTask
from swarmnode.server.output_hook import OutputFilter
from swarmnode.server.probe import ProbeSlot
from swarmnode.server.session import ServerSession
from swarmnode.server.unit import ServingUnit

logger = logging.getLogger(__name__)


@dataclass
class SessionLimits:
    """Timeouts (seconds) and sizes a node enforces on every session; see docs/operations.md."""

    step_timeout: float = 120.0  # one step's compute, queueing included
    idle_timeout: float = 60.0  # longest wait for a client's next message before the session is dropped
    max_length: int = 8192  # longest session, in tokens
    max_forward_tokens: int = 4096  # tokens in one stateless forward


class BlockHandler:
    """RPC handlers over the node's serving units (`units()`: the live ones, newest last)."""

    def __init__(self, units: Callable[[], list[ServingUnit]], *, limits: SessionLimits,
                 info: Callable[[], InfoReply], output_filter: OutputFilter | None = None,
                 phase: Phase = Phase.BOTH):
        self.units = units
        self.limits = limits
        self._info = info
        self.sessions: dict[str, ServerSession] = {}  # open sessions by id
        self.p2p: RelayDialer | None = None  # set by `register`: steps with a push target send their output with it
        self.requests_refused = 0
        self._probes: dict[str, list[float]] = {}  # caller -> times of its recent probes
        self.probe_slot = ProbeSlot()  # the one caller whose measurement payloads this node takes now
        # applied to every step's output before it is sent (none in a normal node: `server.output_hook`)
        self.output_filter = output_filter
        self._trim = TrimScheduler()  # closed sessions' memory goes back to the OS after a burst of closes
        self.relay: str | None = None  # this node's relay, when it is behind NAT (`relay.keeper`)
        self.phase = phase  # the phase of requests this node serves (HexGen-2's split; the node changes it)

    def caller(self, context: P2PContext, request: runtime_pb2.ExpertRequest) -> str:
        """Who sent `request`: the peer it came from, or the caller its relay names (`messages.relayed_caller`)."""
        return messages.relayed_caller(str(context.remote_id), request.uid, self.relay)

    async def compute(self, unit: ServingUnit, task: StepTask) -> torch.Tensor:
        """Run one step on the unit's compute thread, bounded by the step timeout.

        On a timeout the step is cancelled if it has not started; one already running cannot be stopped,
        so the caller must keep its cache reserved until `task.future` is done (`ServerSession.close`).
        """
        output = await asyncio.wait_for(asyncio.wrap_future(unit.scheduler.submit(task)), self.limits.step_timeout)
        if self.output_filter is not None:
            output = self.output_filter(output)
        return output

    async def register(self, p2p: P2P | RelayDialer, gate: rpc.Gate | None = None) -> None:
        """Answer the node RPCs on `p2p`; in a private swarm behind `gate` (calls from this node's own relay
        pass: the relay gated their callers)."""
        self.p2p = p2p if isinstance(p2p, RelayDialer) else RelayDialer(p2p)
        await rpc.register(p2p, self, rpc.NODE_RPCS, gate=_TrustingRelay(gate, self) if gate is not None else None)

    def trim_soon(self) -> None:
        """A session closed: give freed memory back to the OS after the burst of closes (`runtime.memory`)."""
        self._trim.soon()

    def _failure_reply(self, kind: str, context: P2PContext, exc: Exception) -> runtime_pb2.ExpertResponse:
        """The error reply that ends a failed `forward` or `inference` request. The project's own errors (a
        bad request, a full cache, blocks no longer served) are the caller's to handle and go back with
        their code; a step past its deadline says so; anything else is this node's failure and is logged."""
        if isinstance(exc, SwarmError):
            self.requests_refused += 1
            metrics.NODE_REQUESTS_REFUSED.inc()
            logger.info("refused %s from %s: %s", kind, short_id(str(context.remote_id)), exc)
            return error_response(str(exc), exc.code)
        if isinstance(exc, asyncio.TimeoutError):
            return error_response(f"{kind} step took longer than {self.limits.step_timeout:.0f} s on this node")
        logger.error("%s failed", kind, exc_info=exc)
        return error_response(f"{kind} failed on this node: {type(exc).__name__}: {exc}")

    def unit_for(self, start: int, end: int) -> ServingUnit:
        """The newest live unit that serves blocks [start, end); `ProtocolError` (code moved) when none does."""
        units = [u for u in self.units() if u.live]
        for unit in reversed(units):
            if unit.covers(start, end):
                return unit
        served = ", ".join(f"[{u.start}, {u.end})" for u in units) or "no blocks yet"
        raise ProtocolError(f"blocks [{start}, {end}) are outside what this node serves ({served}): route elsewhere",
                            code=messages.ERROR_MOVED)

    def validate(self, unit: ServingUnit, request: runtime_pb2.ExpertRequest, *, batch_size: int | None,
                 max_tokens: int, max_position: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
        """The request's (hidden, positions, mask, wire dtype), checked against the unit's model and the given
        bounds; the hidden states are cast to the dtype this node computes in, and the reply goes back in the
        wire dtype (`messages.WIRE_DTYPES`)."""
        tensors = messages.deserialize_tensors(request.tensors)
        hidden, positions, mask = messages.validate_step_tensors(
            tensors, hidden_size=unit.stack.checkpoint.hidden_size,
            batch_size=batch_size, max_tokens=max_tokens, max_position=max_position,
        )
        cast = hidden.to(unit.stack.dtype)
        if cast.dtype != hidden.dtype and not torch.isfinite(cast).all():
            raise ProtocolError(f"hidden states overflow {str(unit.stack.dtype).removeprefix('torch.')}, the dtype "
                                f"this node computes in: route these blocks through a float32 or bfloat16 node")
        return cast, positions, mask, hidden.dtype

    async def rpc_probe(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Receive a bounded payload and answer with its size; peers time it to measure bandwidth. A probe may
        ask for this node's probe slot or give it back (`server.probe.ProbeSlot`: one caller measures at a time)."""
        caller = self.caller(context, request)
        now = time.monotonic()
        recent = [t for t in self._probes.get(caller, []) if now - t < 60.0]
        if len(recent) >= messages.PROBE_RATE:
            return error_response(f"more than {messages.PROBE_RATE} probes a minute: slow down")
        recent.append(now)
        self._probes[caller] = recent
        if len(self._probes) > 4096:  # forget the oldest callers rather than grow without bound
            for stale in list(self._probes)[: len(self._probes) - 4096]:
                del self._probes[stale]
        sizes = [len(t.buffer) for t in request.tensors]
        if len(sizes) != 1 or sizes[0] > messages.MAX_PROBE_BYTES:
            return error_response(f"a probe carries one tensor of at most {messages.MAX_PROBE_BYTES} bytes")
        try:
            ask = unpack_metadata(request.metadata, messages.ProbeRequest)
        except ProtocolError as exc:
            return error_response(str(exc))
        slot = self.probe_slot.answer(caller, now, ask)
        return runtime_pb2.ExpertResponse(metadata=pack_metadata({"received": sizes[0], **slot}))

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=pack_metadata(self._info()))

    async def rpc_ping(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Echo the payload back (bounded): clients and peers time it to measure RTT and bandwidth."""
        if len(request.metadata) > messages.MAX_METADATA_BYTES:
            return error_response(f"ping payload over {messages.MAX_METADATA_BYTES} bytes")
        return runtime_pb2.ExpertResponse(metadata=request.metadata)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            meta = unpack_metadata(request.metadata, ForwardRequest)
            unit = self.unit_for(meta.start, meta.end)
            hidden, positions, mask, wire_dtype = self.validate(
                unit, request, batch_size=None, max_tokens=self.limits.max_forward_tokens,
                max_position=self.limits.max_length,
            )
            if hidden.shape[0] * hidden.shape[1] > self.limits.max_forward_tokens:
                raise ProtocolError(
                    f"forward of {hidden.shape[0]} x {hidden.shape[1]} tokens exceeds {self.limits.max_forward_tokens}"
                )
            task = StepTask(None, meta.start, meta.end, hidden, positions, mask)
            began = time.perf_counter()
            output = await self.compute(unit, task)
            metrics.NODE_STEP_LATENCY.labels("forward").observe(time.perf_counter() - began)
            metrics.NODE_TOKENS_PROCESSED.labels("forward").inc(hidden.shape[0] * hidden.shape[1])
            return runtime_pb2.ExpertResponse(tensors=messages.serialize_tensors([output.to(wire_dtype)]))
        except Exception as exc:  # safe: a failed forward ends only this request; the caller gets the error
            return self._failure_reply("forward", context, exc)

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A step's input for an open session, from the previous hop (or whoever holds the session's id):
        queued for the step the session's client sends with `pushed` set. Its tensors are checked when that
        step runs, against the session's shapes."""
        try:
            push = unpack_metadata(request.metadata, PushRequest)
            session = self.sessions.get(push.session_id)
            if session is None:
                raise ProtocolError(f"no session {push.session_id[:8]}... is open on this node: it ended, or never "
                                    f"opened here")
            if len(request.tensors) != 3:
                raise ProtocolError(f"a push carries 3 tensors (hidden, position_ids, attention_mask), got "
                                    f"{len(request.tensors)}")
            queued = session.deliver(push, request)
            return runtime_pb2.ExpertResponse(metadata=pack_metadata(PushReply(queued=queued)))
        except Exception as exc:  # safe: a refused push changes nothing; the pusher gets the reason
            return self._failure_reply("push", context, exc)

    async def rpc_kv_handover(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A session's KV cache for some of its blocks, from the node that ran its prompt (`server.handover`):
        every message is checked against the open session before its cache is written; one reply."""
        try:
            first = await self._next(requests)
            if first is None:
                raise ProtocolError("the handover stream ended before its header")
            header = unpack_metadata(first.metadata, KvHandover)
            session = self.sessions.get(header.session_id)
            if session is None:
                raise ProtocolError(f"no session {header.session_id[:8]}... is open on this node: the client opens "
                                    f"it (reserving its cache) before the handover")
            valid = session.check_handover(header, first)
            blocks: dict[int, list[torch.Tensor]] = {}
            for index in range(header.start, header.end):
                message = await self._next(requests)
                if message is None:
                    raise ProtocolError(f"the handover ended after {len(blocks)} of the {header.end - header.start} "
                                        f"blocks its header announced")
                self._check_still_open(session, header)  # its stream may have closed while a block was on the way
                blocks[index] = session.check_block(header, index, message)
            if await self._next(requests) is not None:
                raise ProtocolError(f"the handover sent more than the {header.end - header.start} blocks its header "
                                    f"announced")
            self._check_still_open(session, header)
            yield runtime_pb2.ExpertResponse(metadata=pack_metadata(session.take_handover(header, valid, blocks)))
        except Exception as exc:  # safe: nothing is written before every message passed; the sender gets why
            reply = self._failure_reply("kv_handover", context, exc)
            await rpc.read_to_end(requests)  # before the reply: the sender is still writing its blocks
            yield reply

    def _check_still_open(self, session: ServerSession, header: KvHandover) -> None:
        if self.sessions.get(header.session_id) is not session:
            raise ProtocolError(f"session {header.session_id[:8]}... closed during the handover")

    async def rpc_outputs(self, request: runtime_pb2.ExpertRequest,
                          context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A session's kept outputs for a range of tokens, to the client that opened the session only."""
        try:
            ask = unpack_metadata(request.metadata, OutputsRequest)
            session = self.sessions.get(ask.session_id)
            if session is None or session.caller != self.caller(context, request):
                raise ProtocolError(f"no session {ask.session_id[:8]}... of yours is open on this node")
            outputs = session.outputs(ask.start, ask.end)
            return runtime_pb2.ExpertResponse(tensors=messages.serialize_tensors([outputs]))
        except Exception as exc:  # safe: a refused fetch changes nothing; the caller gets the reason
            return self._failure_reply("outputs", context, exc)

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A session's stream: the first message opens it (and may carry a step), each later one is a step."""
        session = ServerSession(self, caller=str(context.remote_id))
        request = failure = None
        try:
            request = await self._next(requests)
            if request is None:
                raise ProtocolError("the stream ended before it opened a session")
            session.caller = self.caller(context, request)
            meta = unpack_metadata(request.metadata, InferenceRequest)
            if meta.session is None:
                raise ProtocolError("the first message of an inference stream must open a session")
            session.open(meta.session)
            ahead = None  # the client's next message, being read while a pushed step waited for its input
            while request is not None:
                if meta.step is not None and meta.step.pushed:
                    reply, ahead = await self._pushed_step(session, request, meta.step, requests)
                    yield reply
                elif meta.step is not None:
                    yield await session.step(request, meta.step)
                request, ahead = await self._next(requests, ahead), None
                if request is not None:
                    meta = _continuation(request)
        except Exception as exc:  # safe: a failed step ends only this session; the caller gets the error
            failure = self._failure_reply("inference", context, exc)
        finally:
            session.close()
            request = None  # see `ServerSession.step`: freed with the stream, not at the next GC pass
        if failure is not None:
            yield failure
            await rpc.read_to_end(requests)

    async def _pushed_step(self, session: ServerSession, request: runtime_pb2.ExpertRequest, step,
                           requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        """Run a step whose input comes by push while reading the client's next message: a client that ends its
        stream meanwhile (it gave the session up) ends the wait at once, not at the step timeout, and frees the
        cache; a message that comes meanwhile waits its turn. Returns the reply and the read (under way or
        done: the client's next message, for `_next`)."""
        stepping = asyncio.ensure_future(session.step(request, step))
        reading = asyncio.ensure_future(requests.__anext__())
        try:
            await asyncio.wait({stepping, reading}, return_when=asyncio.FIRST_COMPLETED)
            # the next message, early, waits its turn; so does the stream's end once the input has come (a client
            # ends its side after its last step and still reads the reply)
            if not stepping.done() and (reading.exception() is None or not session.waiting_for_push):
                await asyncio.wait({stepping})
            if not stepping.done():
                raise ProtocolError(f"the client ended the stream while step {step.step_id} waited for its pushed "
                                    f"input: session closed, its cache freed")
            return stepping.result(), reading
        except BaseException:
            for task in (stepping, reading):
                task.cancel()
            await asyncio.wait({stepping, reading})
            for task in (stepping, reading):  # retrieved: the error raised here is the one that counts
                if not task.cancelled():
                    task.exception()
            raise

    async def _next(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                    ahead: asyncio.Future | None = None) -> runtime_pb2.ExpertRequest | None:
        """The client's next message (`ahead`: its read, already under way), None when the stream ended; a
        silent client times out."""
        try:
            return await asyncio.wait_for(ahead if ahead is not None else requests.__anext__(),
                                          self.limits.idle_timeout)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise ProtocolError(
                f"no message for {self.limits.idle_timeout:.0f} s: session closed, its cache freed"
            ) from None


def _continuation(request: runtime_pb2.ExpertRequest) -> InferenceRequest:
    """A message after a stream's first: it must carry a step and must not open another session."""
    meta = unpack_metadata(request.metadata, InferenceRequest)
    if meta.session is not None:
        raise ProtocolError("a session is already open on this stream")
    if meta.step is None:
        raise ProtocolError("a message after the first must carry a step")
    return meta


class _TrustingRelay:
    """A node's gate: calls from its relay pass while the relay is admitted as a node (the relay checked the roles
    of the caller it forwards for, `relay.service`); all others go to `gate`."""

    def __init__(self, gate: rpc.Gate, handler: BlockHandler):
        self.gate, self.handler = gate, handler

    async def refusal(self, peer_id: str, roles) -> str | None:
        if self.handler.relay is not None and peer_id == self.handler.relay:
            return await self.gate.refusal(peer_id, frozenset({Role.NODE}))
        return await self.gate.refusal(peer_id, roles)

