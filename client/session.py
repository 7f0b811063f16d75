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
for one with room. On a session's first step, the hops that did open hold room reserved for it; waiting with
them while other sessions wait with theirs can leave every session waiting for room another one holds (a
deadlock until `route_wait` runs out). So a full cache on the first step gives every reservation back first
(`start_over`), waits a moment, and routes all the blocks anew. With `ClientConfig.verify` set, outputs are checked against other replicas
(`client.verify`); a peer found wrong is banned for good and its hop fails over like a failed peer.

Where it lives: the session (this module) keeps its route (`client.route.Route`: the hops, the inputs kept
for replay, the position) and handles what a transport asks of it (`transports.RouteOwner`: `fail_over`,
`reroute`, `verify`, bans, the P2P handle and traffic counters); each way of stepping is a class in
`client.transports` (`PushTransport`, `RelayTransport`, and HexGen-2's `PrefillSplit`), built over the route
and the session; a hop's stream and the RPC calls to its peer are `client.hops`. With push, the transport is
`PipelinedPush`, which may also hold several steps in flight: `send_ahead`, `collect` and `discard_ahead` are
what speculative passes pipelined (`client.speculative`) use.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
import uuid

import torch

from swarmnode import messages
from swarmnode.client.errors import PeerDiverged, PeerSilent, RemoteError, SessionError
from swarmnode.client.hops import (
    Attempts,
    Chunk,
    HopStream,
    close_all,
    forward_rpc,
    has_moved,
    is_cache_full,
)
from swarmnode.client.route import Route
from swarmnode.client.routing import Hop, NoRouteError
from swarmnode.client.swarm import ClientConfig, SwarmView
from swarmnode.client.transports import PipelinedPush, RelayTransport, Transport
from swarmnode.client.verify import MAX_OPINIONS, Outcome, Verifier
from swarmnode.naming import short_id
from swarmnode.records import Phase
from swarmnode.relay.dialer import RelayDialer

logger = logging.getLogger(__name__)


class InferenceSession:
    """A stateful generation session through the swarm (use as a context manager, or call close())."""

    def __init__(self, swarm: SwarmView, max_length: int, start: int = 0, end: int | None = None):
        self.swarm = swarm
        self.max_length = max_length
        self.route = Route(start, swarm.num_blocks if end is None else end)
        self.batch_size: int | None = None
        self.session_id = uuid.uuid4().hex
        self.retries = 0
        self.cache_waits = 0  # refusals for a full KV cache that the session waited out
        self.steps = 0  # steps run through the route (a speculative pass of several tokens is one)
        self.rewound = 0  # tokens taken back: by `rewind`, or sent ahead and discarded (rejected drafts)
        self.sent_ahead = 0  # steps sent ahead of their answers (`send_ahead`)
        self.discarded = 0  # of those, the ones given up (`discard_ahead`) or lost to a failure
        self.silent_peers: list[tuple[str, float]] = []  # (peer, seconds quiet) for peers found silent
        self.closed = False
        config = swarm.config
        # hidden states go node to node, unless outputs are verified (that needs every hop's on the client)
        self.push = config.verify == 0 if config.push is None else config.push
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
        # the way of stepping, over the route and this session (`transports.RouteOwner`), once it is complete;
        # pushed steps may also be sent ahead of their answers (`send_ahead`)
        self.pipeline: PipelinedPush | None = PipelinedPush(self.route, self) if self.push else None
        self.transport: Transport = self.pipeline if self.pipeline is not None else RelayTransport(self.route, self)

    # --- what tests, scripts and the model read -------------------------------------------------------
    @property
    def hops(self) -> list[HopStream] | None:
        """The route's hop streams in order; None before the first step and once closed."""
        return self.route.hops if self.route.opened else None

    @property
    def position(self) -> int:
        """Tokens every hop has cached."""
        return self.route.position

    @property
    def start(self) -> int:
        return self.route.start

    @property
    def end(self) -> int:
        return self.route.end

    @property
    def restarts(self) -> int:
        """Push mode: routes rebuilt because a failed hop's inputs could not be read."""
        return self.route.restarts

    @property
    def prefills(self) -> int:
        """Prompts run on prefill nodes and handed over to the decode route (HexGen-2)."""
        return self.route.prefills

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        hops = self.route.take()
        if hops:
            try:
                self.swarm.loop.run(close_all(hops), 15)
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
        chunk = _chunk(hidden, position_ids, attention_mask)
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise SessionError(f"keep_last must be a whole number of tokens >= 0, got {keep_last!r}",
                               code=messages.ERROR_BAD_REQUEST)
        output = self.swarm.loop.run(self._step(chunk, keep_last), self._wait_limit())
        self.route.position += n
        self.steps += 1
        return output

    def _wait_limit(self) -> float:
        """How long the caller waits for one step, every retry and wait for room included."""
        config = self.swarm.config
        attempts = (config.max_retries + 1) * (1 + 2 * MAX_OPINIONS if self.verifier is not None else 1)
        return config.request_timeout * attempts + 2 * config.route_wait + 30

    # --- steps sent ahead of their answers (speculative passes pipelined: `client.speculative`) -------------
    def can_send_ahead(self) -> bool:
        """Whether `send_ahead` may be called now: hidden states go node to node (`push`) and the route has run
        (the first step, and the first after a route is rebuilt, are plain steps)."""
        return not self.closed and self.pipeline is not None and self.pipeline.can_send()

    @property
    def tokens_ahead(self) -> int:
        """Tokens sent ahead and neither collected nor discarded: the next step continues after them."""
        return 0 if self.pipeline is None else self.pipeline.tokens_ahead

    @property
    def steps_in_flight(self) -> int:
        """Steps sent ahead and not answered yet, discarded ones included."""
        return 0 if self.pipeline is None else len(self.pipeline.ahead)

    def send_ahead(self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Send n new tokens' hidden states (B, n, H) through every block without waiting for them: they continue
        after the tokens already sent ahead, and their output (every token's) comes from `collect`, in the order
        the steps were sent. Only when `can_send_ahead()`."""
        if not self.can_send_ahead():
            raise SessionError("steps are sent ahead only through pushed hops of a route that has run: send this one "
                               "with step()", code=messages.ERROR_BAD_REQUEST)
        assert self.pipeline is not None, "can_send_ahead() says the session pipelines"
        batch, n = hidden.shape[:2]
        if batch != self.batch_size:
            raise SessionError(f"batch size changed from {self.batch_size} to {batch} within a session",
                               code=messages.ERROR_BAD_REQUEST)
        end = self.position + self.pipeline.tokens_ahead + n
        if end > self.max_length:
            raise SessionError(f"session of max_length {self.max_length} cannot take {n} more tokens after "
                               f"{end - n} (sent ahead included)", code=messages.ERROR_BAD_REQUEST)
        self.swarm.loop.run(self.pipeline.send(_chunk(hidden, position_ids, attention_mask), 0), self._wait_limit())
        self.sent_ahead += 1

    def collect(self) -> torch.Tensor | None:
        """The output (B, n, H) of the oldest step sent ahead and not discarded, which then counts among the
        session's tokens; None when a failure lost it and every other step sent ahead (the route is rebuilt and
        the session holds what it held before them: send them again)."""
        if self.pipeline is None or not self.pipeline.live():
            raise SessionError("no step sent ahead waits to be collected", code=messages.ERROR_BAD_REQUEST)
        live = self.pipeline.live()
        # the answers of every step ahead of it may be read first
        output = self.swarm.loop.run(self.pipeline.collect(), self._wait_limit() * len(self.pipeline.ahead))
        if output is not None:
            self.route.position += output.shape[1]
            self.steps += 1
        else:
            self.discarded += live
        return output

    def discard_ahead(self) -> None:
        """Give up every step sent ahead and not collected (drafts an earlier pass rejected): they still run,
        their answers are dropped, and the next step continues from `position`, so the nodes roll back."""
        if self.pipeline is not None:
            self.rewound += self.pipeline.tokens_ahead
            self.discarded += self.pipeline.live()
            self.pipeline.discard()

    def rewind(self, length: int) -> None:
        """Take back every token from `length` on (speculative decoding's rejected drafts): the session then
        continues from `length` tokens. Each node rolls its KV cache back when the next step reaches it (the
        step continues from `length`, below what the node holds), so a rewind costs no call of its own; the
        inputs kept for failover are cut here, and a replacement replays only what stays. A length past what
        the session holds is refused."""
        if self.closed:
            raise SessionError("the session is closed", code="session_closed")
        if self.tokens_ahead:
            raise SessionError("steps sent ahead are in flight: discard them (discard_ahead) before rewinding",
                               code=messages.ERROR_BAD_REQUEST)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.position:
            raise SessionError(f"cannot rewind to {length!r} tokens: the session holds {self.position} (rewind to "
                               f"a length from 0 to {self.position})", code=messages.ERROR_BAD_REQUEST)
        if length < self.position:
            self.rewound += self.position - length
            self.route.rewind(length)

    async def _step(self, chunk: Chunk, keep_last: int) -> torch.Tensor:
        if not self.route.opened:
            self.route.hops = await self.reroute(self.route.start, self.route.end, None)
        return await self.transport.step(chunk, keep_last)

    # --- what a transport may ask (`transports.RouteOwner`) -------------------------------------------
    @property
    def p2p(self) -> RelayDialer:
        return self.swarm.p2p

    @property
    def config(self) -> ClientConfig:
        return self.swarm.config

    def dropped(self, peer_id: str) -> RemoteError | None:
        if peer_id in self.swarm.diverged:
            return PeerDiverged(peer_id, "was found returning wrong outputs: replacing it")
        return self.swarm.not_admitted(peer_id)

    def wants_check(self, first: bool) -> bool:
        return self.verifier is not None and self.verifier.wants(first)

    def ban(self, peer_id: str, reason: str) -> None:
        self.swarm.ban(peer_id, reason)

    def hold_off(self, peer_id: str, reason: str) -> None:
        self.swarm.hold_off(peer_id, reason)

    def splits(self) -> bool:
        return self.swarm.splits()

    async def prefill_hops(self, start: int, end: int, min_cache_tokens: int) -> list[Hop]:
        return await self.swarm.route(start, end, min_cache_tokens=min_cache_tokens, phase=Phase.PREFILL)

    async def fail_over(self, hop: HopStream, exc: RemoteError, attempts: Attempts) -> list[HopStream]:
        """Handle a hop's failure: a full cache or a moved peer is held off (waited for, within limits), any
        other failure bans the peer and counts against `max_retries` (SessionError past them). The hop's
        stream is closed; returns the hops that replace it."""
        await self.count_failure(hop.hop.peer_id, exc, attempts)
        await hop.close()
        replacement = await self.reroute(hop.hop.start, hop.hop.end, exc)
        logger.info("re-routed blocks [%d, %d) from %s to %s; replaying %d cached tokens", hop.hop.start,
                    hop.hop.end, short_id(hop.hop.peer_id), _hops_text(replacement), self.route.position)
        return replacement

    async def start_over(self, hop: HopStream, exc: RemoteError, attempts: Attempts) -> list[HopStream]:
        """The session's first step met a full cache at `hop` (`exc`): give back the room every hop reserved
        for the session (all of them are closed), wait a moment, and route all its blocks anew. Waiting for room
        while keeping those reservations is how sessions deadlock: each holds room on one peer and waits for
        room on another that the others hold. The wait is counted against `route_wait` as `fail_over` counts
        it; it is drawn at random, up to `cache_hold` s, so that sessions which gave back their room together
        do not all ask again at once."""
        await self.count_failure(hop.hop.peer_id, exc, attempts)
        released = self.route.take()
        await close_all(released)
        await asyncio.sleep(random.uniform(0.0, self.swarm.config.cache_hold))
        hops = await self.reroute(self.route.start, self.route.end, exc)
        logger.info("%s had no room for this session: gave back the room %d hop(s) reserved and routed all blocks "
                    "anew: %s", short_id(hop.hop.peer_id), len(released), _hops_text(hops))
        return hops

    async def count_failure(self, peer_id: str, exc: RemoteError, attempts: Attempts) -> None:
        """Account for a hop's failure (see `fail_over`): a full cache or a moved peer is held off within its
        limits, any other failure bans the peer; SessionError once the limits are past."""
        config = self.swarm.config
        if is_cache_full(exc):  # not a failure: try other peers, or wait for room
            now = time.monotonic()
            attempts.cache_wait_since = now if attempts.cache_wait_since is None else attempts.cache_wait_since
            if now - attempts.cache_wait_since > config.route_wait:
                raise SessionError(
                    f"no peer had room for this session's KV cache for {config.route_wait:.0f} s; "
                    f"last refusal: {exc}", code=messages.ERROR_CACHE_FULL) from exc
            self.cache_waits += 1
            self.swarm.hold_off(peer_id, str(exc))
        elif has_moved(exc) and attempts.moved < config.max_retries:  # a stale view, not a failure
            attempts.moved += 1
            self.retries += 1
            self.swarm.hold_off(peer_id, str(exc))
            await self.swarm.refresh(force=True)
        else:
            if isinstance(exc, PeerSilent):
                self.silent_peers.append((peer_id, exc.silence))
                logger.warning("%s: failing over", exc)
            attempts.failures += 1
            self.retries += 1
            self.swarm.ban(peer_id, str(exc))
            if attempts.failures > config.max_retries:
                raise SessionError(
                    f"giving up after {attempts.failures} failed attempts at this step; last: {exc}",
                    code="retries_exhausted") from exc

    async def verify(self, hop: HopStream, inputs: Chunk, output: torch.Tensor) -> None:
        """Check a hop's output against other replicas; raise when the peer is wrong or no one can tell."""
        assert self.verifier is not None, "steps are verified when the session has a verifier"
        result = await self.verifier.check(hop.hop, inputs.hidden, inputs.positions, inputs.mask, output)
        if result.outcome == Outcome.WRONG:
            raise PeerDiverged(hop.hop.peer_id, result.message)
        if result.outcome == Outcome.UNRESOLVED:
            raise SessionError(result.message, code="unresolved")

    async def reroute(self, start: int, end: int, cause: Exception | None) -> list[HopStream]:
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

    async def _open(self, start: int, end: int) -> list[HopStream]:
        batch = self.batch_size or 1
        hops = await self.swarm.route(start, end, min_cache_tokens=batch * self.max_length)
        return [HopStream(hop, uuid.uuid4().hex, self.max_length, batch, traffic=self.traffic) for hop in hops]


def _chunk(hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> Chunk:
    """A step's tensors as they go on the wire: on the CPU, contiguous, positions and mask as int64."""
    return Chunk(hidden.detach().cpu().contiguous(), position_ids.detach().cpu().to(torch.int64),
                 attention_mask.detach().cpu().to(torch.int64))


def _hops_text(hops: list[HopStream]) -> str:
    return ", ".join(f"{short_id(h.hop.peer_id)}[{h.hop.start}:{h.hop.end})" for h in hops)
