"""Inference sessions across a route of peers, with failover that leaves the output unchanged.

An `InferenceSession` opens one `inference` stream per hop. Hidden states go between hops one of two ways:

- **push** (the default): the client sends a step's input to the first hop only, with where its output
  goes (`StepMeta.push_to`); each node sends its output straight to the next hop's node (`PUSH`) and answers
  the client with a small reply; only the last hop answers with hidden states. The client's link carries
  the step's input up once and the output down once, whatever the number of hops. Every hop but the last
  keeps its outputs for the session's life (`OpenSession.keep_outputs`, counted in its cache), so a
  replacement can be fed without the client having seen them: when hop k fails, the client fetches hop
  k-1's outputs for the whole sequence (`OUTPUTS`; its own inputs for the first hop), replays them into
  the replacement as one prefill, and the replacement pushes this step's output on to hop k+1, which was
  waiting for it (a duplicate of an input already run is dropped). A node that could not push says so;
  the client then fetches that output and pushes it itself. When the previous hop cannot be read either,
  the route is rebuilt and the client's own inputs are replayed through it.
- **relay** (`ClientConfig.push=False`, and whenever outputs are verified): every hop's output comes back
  to the client, which sends it to the next hop. Every hop's inputs are kept on the client; a failed hop's
  replacement is replayed from them.

Either way, when a hop fails (killed, timed out, silent, an error reply) its peer is banned, a new route
is found for that hop's blocks, and the replacement rebuilds the KV cache from the whole sequence's
inputs before the step goes on: the result is the same computation as without the failure.

A peer that refuses a session because its KV cache is full did nothing wrong: it is skipped for a moment
(`ClientConfig.cache_hold`), not banned, and the step tries other peers or waits, up to `route_wait` s,
for one with room. With `ClientConfig.verify` set, outputs are checked against other replicas
(`client.verify`); a peer found wrong is banned for good and its hop fails over like a failed peer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages
from swarmnode.client.errors import TRANSPORT_ERRORS, PeerDiverged, PeerSilent, RemoteError, SessionError
from swarmnode.client.routing import Hop, NoRouteError
from swarmnode.client.swarm import SwarmView
from swarmnode.client.verify import MAX_OPINIONS, Outcome, Verifier
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
        PeerID.from_base58(peer_id), messages.RPC_FORWARD, request, runtime_pb2.ExpertResponse))
    return _hidden_states(peer_id, response, hidden.shape, hidden.dtype)


async def fetch_outputs(p2p, peer_id: str, session_id: str, start: int, end: int, shape: tuple[int, int, int],
                        dtype: torch.dtype, *, timeout: float) -> torch.Tensor:
    """The outputs a peer kept for tokens [start, end) of its session (`OUTPUTS`), checked like a step's."""
    request = runtime_pb2.ExpertRequest(
        metadata=pack_metadata(OutputsRequest(session_id=session_id, start=start, end=end)))
    response = await _call(peer_id, "fetching kept outputs", timeout,
                           messages.call_streamed(p2p, peer_id, messages.RPC_OUTPUTS, request))
    return _hidden_states(peer_id, response, shape, dtype)


async def push_rpc(p2p, peer_id: str, target_session: str, step_id: int, prefix_length: int, chunk: _Chunk, *,
                   timeout: float) -> None:
    """Push one step's input to a peer's session (`PUSH`), as a node does; raises RemoteError."""
    request = messages.push_request(target_session, step_id, prefix_length, chunk.hidden, chunk.positions, chunk.mask)
    response = await _call(peer_id, "the push", timeout,
                           messages.call_sized(p2p, peer_id, messages.RPC_PUSH, messages.RPC_PUSH_STREAM, request))
    error = messages.response_error(response)
    if error is not None:
        raise RemoteError(peer_id, error, messages.response_error_code(response))


async def _call(peer_id: str, what: str, timeout: float, awaitable):
    """Await one call to a peer; a timeout or a transport failure becomes a RemoteError naming the peer."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise RemoteError(peer_id, f"no answer to {what} in {timeout:.0f} s") from None
    except StopAsyncIteration:
        raise RemoteError(peer_id, "closed the stream") from None
    except TRANSPORT_ERRORS as exc:
        raise RemoteError(peer_id, f"{what} failed: {type(exc).__name__}: {exc}") from exc


async def _keepalive(p2p, peer_id: str, period: float, silence: float) -> None:
    """Ping `peer_id` every `period` s; raise PeerSilent once it has not answered for `silence` s. Runs beside
    a wait for the peer's step: a SIGKILLed peer, a frozen one or one whose link is cut is noticed within
    about `silence` + `period` s of its last answer, instead of when the step's `request_timeout` runs out.
    A busy peer still answers: its RPCs are served on its event loop while blocks compute elsewhere."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        try:
            await messages.timed_call(p2p, peer_id, messages.RPC_PING, timeout=period)
            last = time.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever the cause, no answer; only a long enough silence is a failure
            quiet = time.monotonic() - last
            if quiet >= silence:
                raise PeerSilent(peer_id, f"answered neither the step nor keep-alive pings for {quiet:.1f} s "
                                          f"(last ping: {type(exc).__name__})", quiet) from None


async def _watched(p2p, peer_id: str, what: str, awaitable, config) -> object:
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
# Before pushing a step on for a hop that could not, the client pings the next hop for this long.
REPUSH_PING_TIMEOUT = 2.0


def _consume(task: asyncio.Future) -> None:
    """Retrieve a cancelled watch's or call's outcome, so it is never reported as an unretrieved error."""
    if not task.cancelled():
        task.exception()


def _hidden_states(peer_id: str, response: runtime_pb2.ExpertResponse, shape, dtype: torch.dtype) -> torch.Tensor:
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


def _step_reply(peer_id: str, response: runtime_pb2.ExpertResponse, step_id: int) -> StepReply:
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
class _Chunk:
    hidden: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor

    def tail(self, start: int) -> _Chunk:
        return _Chunk(self.hidden[:, start:], self.positions[:, start:], self.mask[:, start:])


def _concat(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return _Chunk(torch.cat([c.hidden for c in chunks], 1), torch.cat([c.positions for c in chunks], 1),
                  torch.cat([c.mask for c in chunks], 1))


@dataclass
class _Attempts:
    """What one step has met so far: failures (bounded by `max_retries`), refusals of moved peers, and since
    when it has waited for room in some peer's cache."""

    failures: int = 0
    moved: int = 0
    cache_wait_since: float | None = None


@dataclass
class _HopStream:
    """One open `inference` stream to one peer."""

    hop: Hop
    session_id: str
    max_length: int
    batch_size: int
    history: list[_Chunk] = field(default_factory=list)  # inputs this peer has cached, in order
    seed: list[_Chunk] = field(default_factory=list)  # inputs a new peer must replay before this step
    _queue: asyncio.Queue | None = None
    _responses: object = None
    _opened: bool = False
    _steps: int = 0

    @property
    def cached(self) -> int:
        return sum(c.hidden.shape[1] for c in self.history)

    keep_outputs: bool = False  # push mode, every hop but the last: kept for a replacement of the next one
    phase: Phase = Phase.BOTH  # the phase its session serves (`OpenSession.phase` carries its value)
    filled: bool = False  # its KV cache came by handover from prefill nodes (no step of its own yet)
    pending: tuple[int, int, int] | None = None  # the step in flight: (step id, prefix length, tokens)
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
                                                          messages.RPC_INFERENCE, requests(),
                                                          runtime_pb2.ExpertResponse)

    async def _started(self, p2p, config) -> None:
        try:  # a killed peer whose records linger fails here
            self._responses = await _watched(p2p, self.hop.peer_id, "opening the session", self._opening_call, config)
        except RemoteError as exc:
            self._broken = exc

    async def send(self, p2p, chunk: _Chunk | None, prefix_length: int, config, *, push_to: PushTarget | None = None,
                   tokens: int | None = None, keep_last: int = 0, handover_to: list[KvTarget] | None = None) -> None:
        """Send one step on this hop's stream, opening it first: `chunk` is the step's input, or None when it
        comes by push (`tokens` of them); with `push_to` the node sends its output there; with `keep_last` it
        answers with its last tokens' outputs only. A failure to open the stream is kept and raised by
        `receive`, where the session handles failures."""
        step_id = self._steps
        meta = InferenceRequest(
            session=self._opening(),
            step=StepMeta(step_id=step_id, prefix_length=prefix_length, pushed=chunk is None, push_to=push_to,
                          keep_last=keep_last, handover_to=handover_to or None),
        )
        request = runtime_pb2.ExpertRequest(
            metadata=pack_metadata(meta),
            tensors=[] if chunk is None else messages.step_tensors(chunk.hidden, chunk.positions, chunk.mask),
        )
        tokens = chunk.hidden.shape[1] if chunk is not None else tokens
        self.pending = (step_id, prefix_length, min(tokens, keep_last) if keep_last else tokens)
        self.traffic["up"] += sum(len(t.buffer) for t in request.tensors)
        self._steps += 1
        if self._queue is None:
            self._start(p2p, request)
            await self._started(p2p, config)
        else:
            self._queue.put_nowait(request)

    async def receive(self, p2p, config) -> runtime_pb2.ExpertResponse:
        """The reply to the step in flight, watched by keep-alive pings (`_watched`)."""
        if self._broken is not None:
            raise self._broken
        response = await _watched(p2p, self.hop.peer_id, "the step", self._responses.__anext__(), config)
        self.traffic["down"] += sum(len(t.buffer) for t in response.tensors)
        return response

    def target(self, p2p) -> PushTarget:
        """Where the previous hop pushes this hop's step in flight (through the peer's relay, if it has one)."""
        step_id, prefix_length, _ = self.pending
        return PushTarget(peer_id=self.hop.peer_id, session_id=self.session_id, step_id=step_id,
                          prefix_length=prefix_length, via=p2p.relay_of(self.hop.peer_id))

    async def step(self, p2p, chunk: _Chunk, prefix_length: int, config) -> torch.Tensor:
        """Send one step with its input and wait for the output (relay mode); `config` is the client's
        `ClientConfig`."""
        await self.send(p2p, chunk, prefix_length, config)
        response = await self.receive(p2p, config)
        return _hidden_states(self.hop.peer_id, response, chunk.hidden.shape, chunk.hidden.dtype)

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


class InferenceSession:
    """A stateful generation session through the swarm (use as a context manager, or call close())."""

    def __init__(self, swarm: SwarmView, max_length: int, start: int = 0, end: int | None = None):
        self.swarm = swarm
        self.max_length = max_length
        self.start, self.end = start, swarm.num_blocks if end is None else end
        self.position = 0  # tokens every hop has cached
        self.batch_size: int | None = None
        self.session_id = uuid.uuid4().hex
        self.hops: list[_HopStream] | None = None
        self.retries = 0
        self.cache_waits = 0  # refusals for a full KV cache that the session waited out
        self.silent_peers: list[tuple[str, float]] = []  # (peer, seconds quiet) for peers found silent
        self.closed = False
        config = swarm.config
        # hidden states go node to node, unless outputs are verified (that needs every hop's on the client)
        self.push = config.verify == 0 if config.push is None else config.push
        self.inputs: list[_Chunk] = []  # push mode: the first hop's inputs, every step's (the whole sequence)
        self.restarts = 0  # push mode: routes rebuilt because a failed hop's inputs could not be read
        self.prefills = 0  # prompts run on prefill nodes and handed over to the decode route (HexGen-2)
        # tensor bytes this session sent ("up") and received ("down") over the client's link, every RPC's
        self.traffic = {"up": 0, "down": 0}
        self.verifier: Verifier | None = None
        if config.verify > 0:
            seed = config.verify_seed if config.verify_seed is not None else secrets.randbits(63)
            logger.debug("session %s verifies with seed %d", self.session_id[:8], seed)

            async def forward(peer, start, end, hidden, positions, mask):
                return await forward_rpc(swarm.p2p, peer, start, end, hidden, positions, mask,
                                         timeout=config.request_timeout)

            self.verifier = Verifier(swarm, forward, share=config.verify, tolerance=config.verify_tolerance, seed=seed)

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        hops, self.hops = self.hops or [], None
        if hops:
            async def close_all():
                await asyncio.gather(*(h.close() for h in hops), return_exceptions=True)

            try:
                self.swarm.loop.run(close_all(), 15)
            except TimeoutError:
                logger.warning("closing the session's streams did not finish; peers free them on their idle timeout")

    def step(self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *,
             keep_last: int = 0) -> torch.Tensor:
        """Run n new tokens' hidden states (B, n, H) through every block; returns the output (B, n, H), or with
        `keep_last` > 0 at least the last `keep_last` tokens' of it (B, <= n, H): with push only those
        come back over the client's link, as generation needs the last token's output alone."""
        if self.closed:
            raise SessionError("the session is closed", code="session_closed")
        batch, n = hidden.shape[:2]
        if self.batch_size is None:
            self.batch_size = batch
        elif batch != self.batch_size:
            raise SessionError(f"batch size changed from {self.batch_size} to {batch} within a session",
                               code=messages.ERROR_BAD_REQUEST)
        if self.position + n > self.max_length:
            raise SessionError(
                f"session of max_length {self.max_length} cannot take {n} more tokens after {self.position}: "
                f"open it with a larger max_length", code=messages.ERROR_BAD_REQUEST
            )
        chunk = _Chunk(hidden.detach().cpu().contiguous(), position_ids.detach().cpu().to(torch.int64),
                       attention_mask.detach().cpu().to(torch.int64))
        config = self.swarm.config
        attempts = (config.max_retries + 1) * (1 + 2 * MAX_OPINIONS if self.verifier is not None else 1)
        timeout = config.request_timeout * attempts + 2 * config.route_wait + 30
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise SessionError(f"keep_last must be a whole number of tokens >= 0, got {keep_last!r}",
                               code=messages.ERROR_BAD_REQUEST)
        output = self.swarm.loop.run(self._step(chunk, keep_last), timeout)
        self.position += n
        return output

    async def _step(self, chunk: _Chunk, keep_last: int) -> torch.Tensor:
        if self.hops is None:
            self.hops = await self._reroute(self.start, self.end, None)
        return await (self._step_push(chunk, keep_last) if self.push else self._step_relay(chunk))

    async def _failed(self, hop: _HopStream, exc: RemoteError, attempts: _Attempts) -> list[_HopStream]:
        """Handle a hop's failure: a full cache or a moved peer is held off (waited for, within limits), any
        other failure bans the peer and counts against `max_retries` (SessionError past them). The hop's
        stream is closed; returns the hops that replace it."""
        config = self.swarm.config
        peer = hop.hop.peer_id
        if is_cache_full(exc):  # not a failure: try other peers, or wait for room
            now = time.monotonic()
            attempts.cache_wait_since = now if attempts.cache_wait_since is None else attempts.cache_wait_since
            if now - attempts.cache_wait_since > config.route_wait:
                raise SessionError(
                    f"no peer had room for this session's KV cache for {config.route_wait:.0f} s; "
                    f"last refusal: {exc}", code=messages.ERROR_CACHE_FULL) from exc
            self.cache_waits += 1
            self.swarm.hold_off(peer, str(exc))
        elif has_moved(exc) and attempts.moved < config.max_retries:  # a stale view, not a failure
            attempts.moved += 1
            self.retries += 1
            self.swarm.hold_off(peer, str(exc))
            await self.swarm.refresh(force=True)
        else:
            if isinstance(exc, PeerSilent):
                self.silent_peers.append((peer, exc.silence))
                logger.warning("%s: failing over", exc)
            attempts.failures += 1
            self.retries += 1
            self.swarm.ban(peer, str(exc))
            if attempts.failures > config.max_retries:
                raise SessionError(
                    f"giving up after {attempts.failures} failed attempts at this step; last: {exc}",
                    code="retries_exhausted") from exc
        await hop.close()
        replacement = await self._reroute(hop.hop.start, hop.hop.end, exc)
        logger.info("re-routed blocks [%d, %d) from %s to %s; replaying %d cached tokens", hop.hop.start,
                    hop.hop.end, short_id(peer),
                    ", ".join(f"{short_id(h.hop.peer_id)}[{h.hop.start}:{h.hop.end})" for h in replacement),
                    self.position)
        return replacement

    # --- relay: every hop's output through the client ---------------------------------------------------
    async def _step_relay(self, chunk: _Chunk) -> torch.Tensor:
        n = chunk.hidden.shape[1]
        index = 0
        x = chunk  # this step's input to hop `index`
        full: _Chunk | None = None  # the whole sequence's input to hop `index`, while replaying
        attempts = _Attempts()
        while index < len(self.hops):
            hop = self.hops[index]
            try:
                if hop.hop.peer_id in self.swarm.diverged:  # caught returning wrong outputs (maybe elsewhere)
                    raise PeerDiverged(hop.hop.peer_id, "was found returning wrong outputs: replacing it")
                first = hop._steps == 0
                if hop.cached < self.position:  # a new peer: replay everything before this step
                    if full is None:
                        full = _concat([*hop.seed, x])
                    hop.seed = [_Chunk(full.hidden[:, :-n], full.positions[:, :-n], full.mask[:, :-n])]
                    output = await hop.step(self.swarm.p2p, full, 0, self.swarm.config)
                    if self.verifier is not None and self.verifier.wants(True):
                        await self._verify(hop, full, output)
                    hop.history, hop.seed = [full], []
                    full = _Chunk(output, full.positions, full.mask)
                    x = _Chunk(output[:, -n:], x.positions, x.mask)
                else:
                    output = await hop.step(self.swarm.p2p, x, self.position, self.swarm.config)
                    if self.verifier is not None and self.verifier.wants(first):
                        await self._verify(hop, _concat([*hop.history, x]), output)
                    hop.history.append(x)
                    full = None
                    x = _Chunk(output, x.positions, x.mask)
                index += 1
            except RemoteError as exc:
                replacement = await self._failed(hop, exc, attempts)
                replacement[0].seed = [*hop.seed, *hop.history]
                self.hops[index:index + 1] = replacement
                full = None
        return x.hidden

    # --- push: node to node -----------------------------------------------------------------------------
    async def _step_push(self, chunk: _Chunk, keep_last: int) -> torch.Tensor:
        """One step with hidden states pushed from node to node (see the module's docstring); the last hop
        answers with its last `keep_last` tokens' outputs (0: all the step's)."""
        config, p2p = self.swarm.config, self.swarm.p2p
        n = chunk.hidden.shape[1]
        total = self.position + n
        keep = min(keep_last, n) if keep_last else n
        if self.position == 0 and n > 1 and self._split():
            output = await self._prefill_split(chunk, keep)
            if output is not None:
                self.inputs.append(chunk)
                return output
        if any(h.pending is None and not h.filled for h in self.hops):  # a route not yet run: replay from 0
            await self._restart(chunk, None, keep, close=False)
        else:
            await self._dispatch(0, len(self.hops), chunk, self.position, keep)
        attempts = _Attempts()
        index = 0
        output = None
        while index < len(self.hops):
            hop = self.hops[index]
            last = index == len(self.hops) - 1
            try:
                if hop.hop.peer_id in self.swarm.diverged:
                    raise PeerDiverged(hop.hop.peer_id, "was found returning wrong outputs: replacing it")
                response = await hop.receive(p2p, config)
                step_id, _, tokens = hop.pending
                if last:
                    shape = (chunk.hidden.shape[0], tokens, chunk.hidden.shape[2])
                    output = _hidden_states(hop.hop.peer_id, response, shape, chunk.hidden.dtype)[:, -keep:]
                else:
                    reply = _step_reply(hop.hop.peer_id, response, step_id)
                    if not reply.pushed:
                        await self._repush(index, chunk, reply.push_error)
                index += 1
            except RemoteError as exc:
                replacement = await self._failed(hop, exc, attempts)
                for each in replacement:
                    each.keep_outputs = each.hop.end < self.end
                try:
                    inputs = await self._inputs_of(index, chunk)
                except RemoteError as gone:  # the previous hop cannot be read either: rebuild the route
                    logger.warning("the inputs of blocks [%d, %d) cannot be read back (%s): rebuilding the route "
                                   "and replaying the session's %d tokens", hop.hop.start, hop.hop.end, gone, total)
                    if not self.hops[index - 1].filled:  # a handed-over prompt's outputs were never computed there
                        self.swarm.ban(gone.peer_id, str(gone))
                    await self._restart(chunk, gone, keep)
                    index = 0
                    continue
                self.hops[index:index + 1] = replacement
                await self._dispatch(index, index + len(replacement), inputs, 0, keep)
        self.inputs.append(chunk)
        return output

    # --- two phases (HexGen-2): the prompt on prefill nodes, its KV cache handed over to the decode route --
    def _split(self) -> bool:
        """Whether this session's prompt runs on prefill nodes (`ClientConfig.disaggregate`)."""
        wanted = self.swarm.config.disaggregate
        if wanted is False or not self.push:
            return False
        if self.swarm.splits():
            return True
        if wanted:
            raise SessionError("disaggregate=True, but prefill-only nodes do not serve every block now: start "
                               "nodes with --phase prefill, or leave disaggregate unset", code="no_route")
        return False

    async def _prefill_split(self, chunk: _Chunk, keep: int) -> torch.Tensor | None:
        """Run the prompt through a route of prefill nodes, each handing the KV cache of its blocks over to the
        decode hops that hold them (opened first, so their caches are reserved); the last prefill hop's
        output, or None when any part failed (the caller then runs the prompt on the decode route itself)."""
        config, p2p = self.swarm.config, self.swarm.p2p
        n = chunk.hidden.shape[1]
        try:
            routed = await self.swarm.route(self.start, self.end, min_cache_tokens=chunk.hidden.shape[0] * n,
                                            phase=Phase.PREFILL)
        except NoRouteError as exc:
            logger.info("no prefill route (%s): the prompt runs on the decode route", exc)
            return None
        prefill = [_HopStream(h, uuid.uuid4().hex, n, chunk.hidden.shape[0], traffic=self.traffic, phase=Phase.PREFILL)
                   for h in routed]
        for hop in self.hops:
            hop.phase, hop.keep_outputs = Phase.DECODE, hop.hop.end < self.end
        x, taken = chunk, True
        try:
            for hop in self.hops:
                await hop.open_only(p2p, config)
            # sent from the last prefill hop back, each pushing its output to the next (as `_dispatch` does):
            # the prompt's hidden states cross the client's link once up and its last tokens' once down
            for index in reversed(range(len(prefill))):
                hop = prefill[index]
                last = index == len(prefill) - 1
                targets = [KvTarget(peer_id=d.hop.peer_id, session_id=d.session_id,
                                    start=max(hop.hop.start, d.hop.start), end=min(hop.hop.end, d.hop.end),
                                    via=p2p.relay_of(d.hop.peer_id))
                           for d in self.hops if d.hop.start < hop.hop.end and hop.hop.start < d.hop.end]
                await hop.send(p2p, chunk if index == 0 else None, 0, config, tokens=n, handover_to=targets,
                               push_to=None if last else prefill[index + 1].target(p2p), keep_last=keep if last else 0)
            for index, hop in enumerate(prefill):
                response = await hop.receive(p2p, config)
                if index == len(prefill) - 1:
                    shape = (chunk.hidden.shape[0], keep, chunk.hidden.shape[2])
                    x = _Chunk(_hidden_states(hop.hop.peer_id, response, shape, chunk.hidden.dtype),
                               chunk.positions, chunk.mask)
                reply = _step_reply(hop.hop.peer_id, response, 0)
                if index < len(prefill) - 1 and not reply.pushed:
                    taken = False
                    logger.info("prefill node %s could not push the prompt on (%s): the prompt runs on the decode "
                                "route", short_id(hop.hop.peer_id), reply.push_error)
                    break
                if not all(reply.handed_over or [False]):
                    taken = False
                    logger.info("prefill node %s did not hand the KV cache over (%s): the prompt runs on the "
                                "decode route", short_id(hop.hop.peer_id), "; ".join(e or "" for e in reply.handover_errors or []))
                    break
        except RemoteError as exc:
            logger.info("the prefill route failed (%s): the prompt runs on the decode route", exc)
            self.swarm.hold_off(exc.peer_id, str(exc))
            taken = False
        finally:
            await asyncio.gather(*(h.close() for h in prefill), return_exceptions=True)
        if not taken:
            return None
        for hop in self.hops:
            hop.filled = True
        self.prefills += 1
        return x.hidden

    async def _dispatch(self, lo: int, hi: int, inputs: _Chunk, prefix_length: int, keep_last: int) -> None:
        """Send this step to hops [lo, hi): hop `lo` gets `inputs` (continuing from `prefix_length` tokens),
        the others get theirs by push, each hop pushing to the next, and hop hi-1 to hop `hi` (whose step is
        in flight already) when there is one; the route's last hop answers with its last `keep_last` tokens'
        outputs. Sent from the last hop back, so that each session is open (and its step in flight, which the
        push target names) before anything is pushed to it."""
        tokens = inputs.hidden.shape[1]
        for index in reversed(range(lo, hi)):
            last = index == len(self.hops) - 1
            await self.hops[index].send(self.swarm.p2p, inputs if index == lo else None, prefix_length,
                                        self.swarm.config, push_to=None if last else self.hops[index + 1].target(self.swarm.p2p),
                                        tokens=tokens, keep_last=keep_last if last else 0)

    async def _inputs_of(self, index: int, chunk: _Chunk) -> _Chunk:
        """Hop `index`'s inputs for the whole sequence, this step included: the client's own for the first
        hop, else the outputs the previous hop kept (RemoteError when it cannot be read)."""
        own = _concat([*self.inputs, chunk])
        if index == 0:
            return own
        previous = self.hops[index - 1]
        hidden = await fetch_outputs(self.swarm.p2p, previous.hop.peer_id, previous.session_id, 0,
                                     own.hidden.shape[1], own.hidden.shape, own.hidden.dtype,
                                     timeout=self.swarm.config.request_timeout)
        self.traffic["down"] += hidden.numel() * hidden.element_size()
        return _Chunk(hidden, own.positions, own.mask)

    async def _repush(self, index: int, chunk: _Chunk, error: str | None) -> None:
        """Hop `index` could not push its output to the next hop: fetch that output and push it from here.
        A failure to read it is hop `index`'s (RemoteError); a next hop that does not answer a ping, or a
        failed push, is left for the next hop's own reply (and keep-alives) to show."""
        hop, after = self.hops[index], self.hops[index + 1]
        step_id, prefix_length, _ = after.pending
        own = _concat([*self.inputs, chunk]).tail(prefix_length)
        if not await messages.answering(self.swarm.p2p, [after.hop.peer_id], REPUSH_PING_TIMEOUT):
            logger.info("%s could not push to %s (%s), which does not answer here either", short_id(hop.hop.peer_id),
                        short_id(after.hop.peer_id), error)
            return
        logger.info("%s could not push to %s (%s): pushing from the client", short_id(hop.hop.peer_id),
                    short_id(after.hop.peer_id), error)
        hidden = await fetch_outputs(self.swarm.p2p, hop.hop.peer_id, hop.session_id, prefix_length,
                                     prefix_length + own.hidden.shape[1], own.hidden.shape, own.hidden.dtype,
                                     timeout=self.swarm.config.request_timeout)
        self.traffic["down"] += hidden.numel() * hidden.element_size()
        self.traffic["up"] += hidden.numel() * hidden.element_size()
        payload = _Chunk(hidden, own.positions, own.mask)
        try:
            await push_rpc(self.swarm.p2p, after.hop.peer_id, after.session_id, step_id, prefix_length, payload,
                           timeout=messages.push_timeout(hidden.numel() * hidden.element_size()))
        except RemoteError as exc:
            logger.info("pushing to %s from the client failed too: %s", short_id(after.hop.peer_id), exc)

    async def _restart(self, chunk: _Chunk, cause: Exception | None, keep_last: int, *, close: bool = True) -> None:
        """Route all blocks anew (banned peers avoided) and send the whole sequence through the new route."""
        if close:
            self.restarts += 1
            old, self.hops = self.hops, None
            await asyncio.gather(*(h.close() for h in old), return_exceptions=True)
            self.hops = await self._reroute(self.start, self.end, cause)
        for hop in self.hops:
            hop.keep_outputs = hop.hop.end < self.end
        await self._dispatch(0, len(self.hops), _concat([*self.inputs, chunk]), 0, keep_last)

    async def _verify(self, hop: _HopStream, inputs: _Chunk, output: torch.Tensor) -> None:
        """Check a hop's output against other replicas; raise when the peer is wrong or no one can tell."""
        result = await self.verifier.check(hop.hop, inputs.hidden, inputs.positions, inputs.mask, output)
        if result.outcome == Outcome.WRONG:
            raise PeerDiverged(hop.hop.peer_id, result.message)
        if result.outcome == Outcome.UNRESOLVED:
            raise SessionError(result.message, code="unresolved")

    async def _reroute(self, start: int, end: int, cause: Exception | None) -> list[_HopStream]:
        """Hops for blocks [start, end); while no peer serves some block (a re-plan or restart under way),
        look again every second for up to `route_wait` s before giving up."""
        deadline = time.monotonic() + self.swarm.config.route_wait
        waited = False
        while True:
            try:
                return await self._open(start, end)
            except NoRouteError as exc:
                if exc.permanent or time.monotonic() > deadline:
                    message = f"{exc} (after: {cause})" if cause else str(exc)
                    raise SessionError(message, code="no_route") from exc
                if not waited:
                    logger.info("%s; waiting up to %.0f s for peers", exc, self.swarm.config.route_wait)
                    waited = True
                await asyncio.sleep(1.0)
                await self.swarm.refresh(force=True)

    async def _open(self, start: int, end: int) -> list[_HopStream]:
        batch = self.batch_size or 1
        hops = await self.swarm.route(start, end, min_cache_tokens=batch * self.max_length)
        return [_HopStream(hop, uuid.uuid4().hex, self.max_length, batch, traffic=self.traffic) for hop in hops]
