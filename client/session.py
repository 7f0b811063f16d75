"""Inference sessions across a route of peers, with failover that leaves the output unchanged.

An `InferenceSession` opens one `inference` stream per hop and pushes each step's hidden states through
the hops in order. Every hop's inputs are kept on the client. When a hop fails (killed, timed out, an
error reply), its peer is banned, a new route is found for that hop's blocks, and the stored inputs are
replayed into the new peers as one prefill so they rebuild the KV cache; then the step goes on. The
result is the same computation as without the failure.

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
    OpenSession,
    ProtocolError,
    StepMeta,
    pack_metadata,
)
from swarmnode.planner.naming import short_id

logger = logging.getLogger(__name__)


def is_cache_full(exc: BaseException) -> bool:
    """Whether a peer refused only because its KV cache is full now (not a failure of the peer)."""
    return isinstance(exc, RemoteError) and exc.code == messages.ERROR_CACHE_FULL


def has_moved(exc: BaseException) -> bool:
    """Whether a peer refused because it no longer serves those blocks (its placement changed): the
    client's view of the swarm is stale, the peer did nothing wrong."""
    return isinstance(exc, RemoteError) and exc.code == messages.ERROR_MOVED


async def forward_rpc(p2p, peer_id: str, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor, *, timeout: float) -> torch.Tensor:
    """Blocks [start, end) on `peer_id` through the stateless `forward` RPC: the output for every token."""
    request = runtime_pb2.ExpertRequest(metadata=pack_metadata(ForwardRequest(start=start, end=end)),
                                        tensors=messages.step_tensors(hidden, positions, mask))
    response = await _call(peer_id, "forward", timeout, p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), messages.RPC_FORWARD, request, runtime_pb2.ExpertResponse))
    return _hidden_states(peer_id, response, hidden)


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


def _consume(task: asyncio.Future) -> None:
    """Retrieve a cancelled watch's or call's outcome, so it is never reported as an unretrieved error."""
    if not task.cancelled():
        task.exception()


def _hidden_states(peer_id: str, response: runtime_pb2.ExpertResponse, sent: torch.Tensor) -> torch.Tensor:
    """The hidden states of a peer's reply, checked: an error reply, malformed tensors, a shape or dtype other
    than those of the states sent (`sent`: a node answers in the wire dtype it was sent) or a non-finite
    value raise RemoteError."""
    shape = sent.shape
    error = messages.response_error(response)
    if error is not None:
        raise RemoteError(peer_id, error, messages.response_error_code(response))
    try:
        outputs = messages.deserialize_tensors(response.tensors)
    except ProtocolError as exc:
        raise RemoteError(peer_id, f"returned malformed tensors: {exc}") from exc
    if len(outputs) != 1 or outputs[0].shape != shape:
        raise RemoteError(peer_id, f"returned tensors of shapes {[tuple(o.shape) for o in outputs]}")
    if outputs[0].dtype != sent.dtype:
        raise RemoteError(peer_id, f"returned {outputs[0].dtype} hidden states for {sent.dtype} ones")
    if not torch.isfinite(outputs[0]).all():
        raise RemoteError(peer_id, "returned NaN or infinite hidden states")
    return outputs[0]


@dataclass
class _Chunk:
    hidden: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


def _concat(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return _Chunk(torch.cat([c.hidden for c in chunks], 1), torch.cat([c.positions for c in chunks], 1),
                  torch.cat([c.mask for c in chunks], 1))


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

    async def step(self, p2p, chunk: _Chunk, prefix_length: int, config) -> torch.Tensor:
        """Send one step on this hop's stream (opening it first) and wait for the output, watched by
        keep-alive pings (`_watched`); `config` is the client's `ClientConfig`."""
        meta = InferenceRequest(
            session=None if self._opened else OpenSession(
                session_id=self.session_id, start=self.hop.start, end=self.hop.end,
                max_length=self.max_length, batch_size=self.batch_size),
            step=StepMeta(step_id=self._steps, prefix_length=prefix_length),
        )
        request = runtime_pb2.ExpertRequest(
            metadata=pack_metadata(meta), tensors=messages.step_tensors(chunk.hidden, chunk.positions, chunk.mask)
        )
        if self._queue is None:
            self._queue = asyncio.Queue()

            async def requests():
                while True:
                    item = await self._queue.get()
                    if item is None:
                        return
                    yield item

            self._queue.put_nowait(request)
            peer = PeerID.from_base58(self.hop.peer_id)
            opening = p2p.iterate_protobuf_handler(peer, messages.RPC_INFERENCE, requests(),
                                                   runtime_pb2.ExpertResponse)
            # a killed peer whose records linger fails here
            self._responses = await _watched(p2p, self.hop.peer_id, "opening the session", opening, config)
        else:
            self._queue.put_nowait(request)
        self._opened = True
        self._steps += 1
        response = await _watched(p2p, self.hop.peer_id, "the step", self._responses.__anext__(), config)
        return _hidden_states(self.hop.peer_id, response, chunk.hidden)

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

    def step(self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run n new tokens' hidden states (B, n, H) through every block; returns the output (B, n, H)."""
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
        output = self.swarm.loop.run(self._step(chunk), timeout)
        self.position += n
        return output

    async def _step(self, chunk: _Chunk) -> torch.Tensor:
        config = self.swarm.config
        if self.hops is None:
            self.hops = await self._reroute(self.start, self.end, None)
        n = chunk.hidden.shape[1]
        index = 0
        x = chunk  # this step's input to hop `index`
        full: _Chunk | None = None  # the whole sequence's input to hop `index`, while replaying
        failures = 0
        cache_wait_since: float | None = None
        moved = 0  # refusals from peers that no longer serve the blocks (re-planned since the view was read)
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
                    output = await hop.step(self.swarm.p2p, full, 0, config)
                    if self.verifier is not None and self.verifier.wants(True):
                        await self._verify(hop, full, output)
                    hop.history, hop.seed = [full], []
                    full = _Chunk(output, full.positions, full.mask)
                    x = _Chunk(output[:, -n:], x.positions, x.mask)
                else:
                    output = await hop.step(self.swarm.p2p, x, self.position, config)
                    if self.verifier is not None and self.verifier.wants(first):
                        await self._verify(hop, _concat([*hop.history, x]), output)
                    hop.history.append(x)
                    full = None
                    x = _Chunk(output, x.positions, x.mask)
                index += 1
            except RemoteError as exc:
                peer = hop.hop.peer_id
                if is_cache_full(exc):  # not a failure: try other peers, or wait for room
                    now = time.monotonic()
                    cache_wait_since = now if cache_wait_since is None else cache_wait_since
                    if now - cache_wait_since > config.route_wait:
                        raise SessionError(
                            f"no peer had room for this session's KV cache for {config.route_wait:.0f} s; "
                            f"last refusal: {exc}", code=messages.ERROR_CACHE_FULL) from exc
                    self.cache_waits += 1
                    self.swarm.hold_off(peer, str(exc))
                elif has_moved(exc) and moved < config.max_retries:  # a stale view, not a failure
                    moved += 1
                    self.retries += 1
                    self.swarm.hold_off(peer, str(exc))
                    await self.swarm.refresh(force=True)
                else:
                    if isinstance(exc, PeerSilent):
                        self.silent_peers.append((peer, exc.silence))
                        logger.warning("%s: failing over", exc)
                    failures += 1
                    self.retries += 1
                    self.swarm.ban(peer, str(exc))
                    if failures > config.max_retries:
                        raise SessionError(
                            f"giving up after {failures} failed attempts at this step; last: {exc}",
                            code="retries_exhausted") from exc
                await hop.close()
                replacement = await self._reroute(hop.hop.start, hop.hop.end, exc)
                logger.info("re-routed blocks [%d, %d) from %s to %s; replaying %d cached tokens", hop.hop.start,
                            hop.hop.end, short_id(peer),
                            ", ".join(f"{short_id(h.hop.peer_id)}[{h.hop.start}:{h.hop.end})" for h in replacement),
                            self.position)
                replacement[0].seed = [*hop.seed, *hop.history]
                self.hops[index:index + 1] = replacement
                full = None
        return x.hidden

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
        return [_HopStream(hop, uuid.uuid4().hex, self.max_length, batch) for hop in hops]
