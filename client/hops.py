"""One hop of a route: the stream to one peer, the RPC calls a session makes to it, and the step's tensors.

`HopStream` is one open `inference` stream to one peer (opening it, sending steps, reading replies, closing it
cleanly); `forward_rpc`, `fetch_outputs` and `push_rpc` are the session's unary calls to a peer (a stateless
forward for verification, a hop's kept outputs for a replacement, a push of a step's input); `Chunk` is a
step's hidden states, positions and mask. Every call is watched (`_watched`): a peer that stops answering
pings while a call waits is given up on (`PeerSilent`) without waiting out the call's timeout; `close_all`
closes several streams at once. A session's hop streams, in order, make its route (`client.route.Route`),
which the transports (`client.transports`) step on; `client.session` handles their failover.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.client.errors import TRANSPORT_ERRORS, PeerSilent, RemoteError
from swarmnode.client.routing import Hop
from swarmnode.messages import (
    ForwardRequest,
    InferenceRequest,
    KvTarget,
    OpenSession,
    OutputsRequest,
    ProtocolError,
    PushTarget,
    StepMeta,
    StepReply,
    pack_metadata,
    unpack_metadata,
)
from swarmnode.naming import short_id
from swarmnode.records import Phase

logger = logging.getLogger(__name__)


def is_cache_full(exc: BaseException) -> bool:
    """Whether a peer refused only because its KV cache is full now (not a failure of the peer)."""
    return isinstance(exc, RemoteError) and exc.code == messages.ERROR_CACHE_FULL


def has_moved(exc: BaseException) -> bool:
    """Whether a peer refused because it no longer serves those blocks (its placement changed) or serves
    another phase of requests (`wrong_phase`): the client's view of the swarm is stale, the peer did
    nothing wrong."""
    return isinstance(exc, RemoteError) and exc.code in (messages.ERROR_MOVED, messages.ERROR_WRONG_PHASE)


async def forward_rpc(p2p, peer_id: str, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor, *, timeout: float) -> torch.Tensor:
    """Blocks [start, end) on `peer_id` through the stateless `forward` RPC: the output for every token."""
    request = runtime_pb2.ExpertRequest(metadata=pack_metadata(ForwardRequest(start=start, end=end)),
                                        tensors=messages.step_tensors(hidden, positions, mask))
    response = await _call(peer_id, "forward", timeout, p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), rpc.RPC_FORWARD, request, runtime_pb2.ExpertResponse))
    return hidden_states(peer_id, response, hidden.shape, hidden.dtype)


async def fetch_outputs(p2p, peer_id: str, session_id: str, start: int, end: int, shape: tuple[int, int, int],
                        dtype: torch.dtype, *, timeout: float) -> torch.Tensor:
    """The outputs a peer kept for tokens [start, end) of its session (`OUTPUTS`), checked like a step's."""
    request = runtime_pb2.ExpertRequest(
        metadata=pack_metadata(OutputsRequest(session_id=session_id, start=start, end=end)))
    response = await _call(peer_id, "fetching kept outputs", timeout,
                           rpc.call_streamed(p2p, peer_id, rpc.RPC_OUTPUTS, request))
    return hidden_states(peer_id, response, shape, dtype)


async def push_rpc(p2p, peer_id: str, target_session: str, step_id: int, prefix_length: int, chunk: Chunk, *,
                   timeout: float) -> None:
    """Push one step's input to a peer's session (`PUSH`), as a node does; raises RemoteError."""
    request = messages.push_request(target_session, step_id, prefix_length, chunk.hidden, chunk.positions, chunk.mask)
    response = await _call(peer_id, "the push", timeout,
                           rpc.call_sized(p2p, peer_id, rpc.RPC_PUSH, rpc.RPC_PUSH_STREAM, request))
    error = messages.response_error(response)
    if error is not None:
        raise RemoteError(peer_id, error, messages.response_error_code(response))


T = TypeVar("T")


async def _call(peer_id: str, what: str, timeout: float, awaitable: Awaitable[T]) -> T:
    """Await one call to a peer; a timeout or a transport failure becomes a RemoteError naming the peer."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise RemoteError(peer_id, f"no answer to {what} in {timeout:.0f} s") from None
    except StopAsyncIteration:
        raise RemoteError(peer_id, "closed the stream") from None
    except TRANSPORT_ERRORS as exc:
        raise RemoteError(peer_id, f"{what} failed: {type(exc).__name__}: {exc}") from exc


async def _keepalive(p2p, peer_id: str, period: float, silence: float) -> NoReturn:
    """Ping `peer_id` every `period` s; raise PeerSilent once it has not answered for `silence` s. Runs beside
    a wait for the peer's step: a SIGKILLed peer, a frozen one or one whose link is cut is noticed within
    about `silence` + `period` s of its last answer, instead of when the step's `request_timeout` runs out.
    A busy peer still answers: its RPCs are served on its event loop while blocks compute elsewhere."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        try:
            await rpc.timed_call(p2p, peer_id, rpc.RPC_PING, timeout=period)
            last = time.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever the cause, no answer; only a long enough silence is a failure
            quiet = time.monotonic() - last
            if quiet >= silence:
                raise PeerSilent(peer_id, f"answered neither the step nor keep-alive pings for {quiet:.1f} s "
                                          f"(last ping: {type(exc).__name__})", quiet) from None


async def _watched(p2p, peer_id: str, what: str, awaitable: Awaitable[T], config) -> T:
    """`_call` on `awaitable` with `config.request_timeout`, while `_keepalive` watches the peer: whichever
    ends first decides (the answer, or the RemoteError of a timeout, a broken stream or a silent peer)."""
    call = asyncio.ensure_future(_call(peer_id, what, config.request_timeout, awaitable))
    watch = asyncio.ensure_future(_keepalive(p2p, peer_id, config.keepalive_period, config.peer_silence))
    try:
        await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        return call.result() if call.done() else watch.result()
    finally:
        pending = [t for t in (call, watch) if not t.done()]
        for task in pending:
            task.cancel()
            task.add_done_callback(_consume)
        if pending:  # a transport call that ignores its cancellation must not hold the session (or the loop's
            await asyncio.wait(pending, timeout=CANCEL_WAIT)  # other sessions) past this: it is left to end


CANCEL_WAIT = 2.0


def _consume(task: asyncio.Future) -> None:
    """Retrieve a cancelled watch's or call's outcome, so it is never reported as an unretrieved error."""
    if not task.cancelled():
        task.exception()


def hidden_states(peer_id: str, response: runtime_pb2.ExpertResponse, shape, dtype: torch.dtype) -> torch.Tensor:
    """The hidden states of a peer's reply, checked: an error reply, malformed tensors, a shape other than
    `shape`, a dtype other than `dtype` (the wire dtype: a node answers in the dtype it was sent) or a
    non-finite value raise RemoteError."""
    shape = tuple(shape)
    error = messages.response_error(response)
    if error is not None:
        raise RemoteError(peer_id, error, messages.response_error_code(response))
    try:
        outputs = messages.deserialize_tensors(response.tensors)
    except ProtocolError as exc:
        raise RemoteError(peer_id, f"returned malformed tensors: {exc}") from exc
    if len(outputs) != 1 or tuple(outputs[0].shape) != shape:
        raise RemoteError(peer_id, f"returned tensors of shapes {[tuple(o.shape) for o in outputs]}, not {shape}")
    if outputs[0].dtype != dtype:
        raise RemoteError(peer_id, f"returned {outputs[0].dtype} hidden states for {dtype} ones")
    if not torch.isfinite(outputs[0]).all():
        raise RemoteError(peer_id, "returned NaN or infinite hidden states")
    return outputs[0]


def step_reply(peer_id: str, response: runtime_pb2.ExpertResponse, step_id: int) -> StepReply:
    """The `StepReply` of a step that pushed its output on; an error reply or a reply to another step raises
    RemoteError."""
    error = messages.response_error(response)
    if error is not None:
        raise RemoteError(peer_id, error, messages.response_error_code(response))
    try:
        reply = unpack_metadata(response.metadata, StepReply)
    except ProtocolError as exc:
        raise RemoteError(peer_id, f"sent a malformed step reply: {exc}") from exc
    if reply.step_id != step_id:
        raise RemoteError(peer_id, f"answered step {reply.step_id} for step {step_id}")
    return reply


@dataclass
class Chunk:
    hidden: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor

    def tail(self, start: int) -> Chunk:
        return Chunk(self.hidden[:, start:], self.positions[:, start:], self.mask[:, start:])


def concat(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(torch.cat([c.hidden for c in chunks], 1), torch.cat([c.positions for c in chunks], 1),
                  torch.cat([c.mask for c in chunks], 1))


def cut(chunks: list[Chunk], length: int) -> list[Chunk]:
    """The first `length` tokens of a sequence kept as consecutive chunks."""
    kept: list[Chunk] = []
    total = 0
    for chunk in chunks:
        n = chunk.hidden.shape[1]
        if total + n <= length:
            kept.append(chunk)
            total += n
            continue
        if total < length:
            end = length - total
            kept.append(Chunk(chunk.hidden[:, :end], chunk.positions[:, :end], chunk.mask[:, :end]))
        break
    return kept


@dataclass
class HopStream:
    """One open `inference` stream to one peer."""

    hop: Hop
    session_id: str
    max_length: int
    batch_size: int
    history: list[Chunk] = field(default_factory=list)  # inputs this peer has cached, in order
    seed: list[Chunk] = field(default_factory=list)  # inputs a new peer must replay before this step
    _queue: asyncio.Queue | None = None
    _responses: AsyncGenerator[runtime_pb2.ExpertResponse, None] | None = None  # the stream's replies, once open
    _opened: bool = False
    steps_sent: int = 0  # steps sent on this stream so far (the next one's id)

    @property
    def cached(self) -> int:
        return sum(c.hidden.shape[1] for c in self.history)

    keep_outputs: bool = False  # push mode, every hop but the last: kept for a replacement of the next one
    phase: Phase = Phase.BOTH  # the phase its session serves (`OpenSession.phase` carries its value)
    filled: bool = False  # its KV cache came by handover from prefill nodes (no step of its own yet)
    pending: tuple[int, int, int] | None = None  # the step sent last: (step id, prefix length, tokens)
    # every step sent and not yet answered, oldest first (several while speculative passes are pipelined)
    in_flight: deque[tuple[int, int, int]] = field(default_factory=deque)
    answered: tuple[int, int, int] | None = None  # the step the last reply `receive` read answers
    _broken: RemoteError | None = None  # opening the stream failed: raised by the next `receive`
    traffic: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})  # tensor bytes, the session's

    def _opening(self) -> OpenSession | None:
        return None if self._opened else OpenSession(
            session_id=self.session_id, start=self.hop.start, end=self.hop.end, max_length=self.max_length,
            batch_size=self.batch_size, keep_outputs=self.keep_outputs, phase=self.phase.value)

    async def open_only(self, p2p, config) -> None:
        """Open the session with no step (a decode hop, before prefill nodes hand its KV cache over): the node
        reserves the cache now, or refuses, which `receive` raises."""
        self._start(p2p, runtime_pb2.ExpertRequest(metadata=pack_metadata(InferenceRequest(session=self._opening()))))
        await self._started(p2p, config)

    def _start(self, p2p, request: runtime_pb2.ExpertRequest) -> None:
        self._queue = asyncio.Queue()

        async def requests():
            while True:
                item = await self._queue.get()
                if item is None:
                    return
                yield item

        self._queue.put_nowait(request)
        self._opened = True
        self._opening_call = p2p.iterate_protobuf_handler(PeerID.from_base58(self.hop.peer_id),
                                                          rpc.RPC_INFERENCE, requests(),
                                                          runtime_pb2.ExpertResponse)

    async def _started(self, p2p, config) -> None:
        try:  # a killed peer whose records linger fails here
            self._responses = await _watched(p2p, self.hop.peer_id, "opening the session", self._opening_call, config)
        except RemoteError as exc:
            self._broken = exc

    async def send(self, p2p, chunk: Chunk | None, prefix_length: int, config, *, push_to: PushTarget | None = None,
                   tokens: int | None = None, keep_last: int = 0, handover_to: list[KvTarget] | None = None) -> None:
        """Send one step on this hop's stream, opening it first: `chunk` is the step's input, or None when it
        comes by push (`tokens` of them); with `push_to` the node sends its output there; with `keep_last` it
        answers with its last tokens' outputs only. A failure to open the stream is kept and raised by
        `receive`, where the session handles failures."""
        step_id = self.steps_sent
        meta = InferenceRequest(
            session=self._opening(),
            step=StepMeta(step_id=step_id, prefix_length=prefix_length, pushed=chunk is None, push_to=push_to,
                          keep_last=keep_last, handover_to=handover_to or None),
        )
        request = runtime_pb2.ExpertRequest(
            metadata=pack_metadata(meta),
            tensors=[] if chunk is None else messages.step_tensors(chunk.hidden, chunk.positions, chunk.mask),
        )
        if chunk is not None:
            tokens = chunk.hidden.shape[1]
        else:
            assert tokens is not None, "a step whose input comes by push says how many tokens it carries"
        self.pending = (step_id, prefix_length, min(tokens, keep_last) if keep_last else tokens)
        self.in_flight.append(self.pending)
        self.traffic["up"] += sum(len(t.buffer) for t in request.tensors)
        self.steps_sent += 1
        if self._queue is None:
            self._start(p2p, request)
            await self._started(p2p, config)
        else:
            self._queue.put_nowait(request)

    async def receive(self, p2p, config) -> runtime_pb2.ExpertResponse:
        """The reply to the oldest step in flight (which `answered` then names), watched by keep-alive pings
        (`_watched`); steps are answered in the order they were sent."""
        if self._broken is not None:
            raise self._broken
        assert self._responses is not None, "`send` opened the stream (or `_broken` says why it did not)"
        response = await _watched(p2p, self.hop.peer_id, "the step", self._responses.__anext__(), config)
        self.answered = self.in_flight.popleft() if self.in_flight else None
        self.traffic["down"] += sum(len(t.buffer) for t in response.tensors)
        return response

    def target(self, p2p) -> PushTarget:
        """Where the previous hop pushes this hop's step sent last (through the peer's relay, if it has one)."""
        assert self.pending is not None, "a push target names the step in flight"
        step_id, prefix_length, _ = self.pending
        return PushTarget(peer_id=self.hop.peer_id, session_id=self.session_id, step_id=step_id,
                          prefix_length=prefix_length, via=p2p.relay_of(self.hop.peer_id))

    async def step(self, p2p, chunk: Chunk, prefix_length: int, config) -> torch.Tensor:
        """Send one step with its input and wait for the output (relay mode); `config` is the client's
        `ClientConfig`."""
        await self.send(p2p, chunk, prefix_length, config)
        response = await self.receive(p2p, config)
        return hidden_states(self.hop.peer_id, response, chunk.hidden.shape, chunk.hidden.dtype)

    async def close(self) -> None:
        """End the stream politely: the peer sees end-of-stream, frees the cache and closes its side."""
        if self._queue is not None:
            self._queue.put_nowait(None)
        responses, self._responses = self._responses, None
        if responses is None:
            return

        async def drain():
            async for _ in responses:
                pass

        # a stream that is already broken (the peer died, timed out or sent an error) has nothing left to free
        # on this side; the peer frees its cache on its idle timeout
        try:
            await asyncio.wait_for(drain(), 5)
        except (asyncio.TimeoutError, *TRANSPORT_ERRORS) as exc:
            logger.debug("the stream to %s ended uncleanly: %r", short_id(self.hop.peer_id), exc)
        finally:
            try:
                await asyncio.wait_for(responses.aclose(), 5)
            # RuntimeError: the generator is still running (a drain that timed out)
            except (asyncio.TimeoutError, RuntimeError, *TRANSPORT_ERRORS) as exc:
                logger.debug("closing the stream to %s failed: %r", short_id(self.hop.peer_id), exc)


async def close_all(hops: list[HopStream]) -> None:
    """Close every stream of `hops` at once (`HopStream.close`), whatever each one's outcome."""
    await asyncio.gather(*(h.close() for h in hops), return_exceptions=True)


@dataclass
class Attempts:
    """What one step has met so far: failures (bounded by `max_retries`), refusals of moved peers, and since
    when it has waited for room in some peer's cache."""

    failures: int = 0
    moved: int = 0
    cache_wait_since: float | None = None
