"""How a session's steps travel along its route: one class per way, behind one interface (`Transport`).

- `RelayTransport` (`ClientConfig.push=False`, and whenever outputs are verified): every hop's output comes
  back to the client, which sends it to the next hop; a failed hop's replacement is replayed from the inputs
  the client kept for it.
- `PushTransport` (the default): the client sends a step's input to the first hop only; each node pushes its
  output straight to the next hop's node, and only the last hop answers with hidden states. A failed hop's
  replacement is fed from the outputs the previous hop kept, or the route is rebuilt and the client's own
  inputs replayed (`client.session`'s docstring tells the whole story).
- `PipelinedPush` (push, as the session's transport): `PushTransport` with several steps in flight at once,
  for speculative passes sent before the earlier ones are verified (`client.speculative`).
- `PrefillSplit` (HexGen-2, with push): a session's prompt runs on prefill nodes, which hand its KV cache over
  to the decode route.

A transport is built over two things, both given to its constructor: the `Route` it steps on
(`client.route`: the hops, the inputs kept for replay, the position and counters) and a `RouteOwner`, what it
may ask of the session that owns the route: the P2P handle, the client's settings and traffic counters, to
fail a hop over (`fail_over`), to give back every hop's room and route all blocks anew when the first step
finds a cache full (`start_over`), to route blocks anew (`reroute`), to verify an output (`verify`), to ban or
hold off a peer, and a route of prefill nodes. `InferenceSession` is the owner; a transport knows nothing else
of it. A new way of stepping (speculative verification, say) is a new class implementing `Transport` over a
`Route` and a `RouteOwner`.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmnode import rpc
from swarmnode.client.errors import RemoteError, SessionError
from swarmnode.client.hops import (
    Attempts,
    Chunk,
    HopStream,
    close_all,
    concat,
    fetch_outputs,
    hidden_states,
    is_cache_full,
    push_rpc,
    step_reply,
)
from swarmnode.client.route import Route
from swarmnode.client.routing import Hop, NoRouteError
from swarmnode.client.swarm import ClientConfig
from swarmnode.messages import ERROR_BAD_REQUEST, KvTarget, StepReply
from swarmnode.naming import short_id
from swarmnode.records import Phase
from swarmnode.relay.dialer import RelayDialer

logger = logging.getLogger(__name__)

# Before pushing a step on for a hop that could not, the client pings the next hop for this long.
REPUSH_PING_TIMEOUT = 2.0


class Transport(Protocol):
    """One way of running a step through a `Route`."""

    async def step(self, chunk: Chunk, keep_last: int) -> torch.Tensor:
        """Run `chunk` (the step's new tokens) through every hop; the output (B, n, H), or with `keep_last`
        at least the last `keep_last` tokens' of it."""
        ...


class RouteOwner(Protocol):
    """What a transport may ask of the session whose route it steps on (`InferenceSession` is one)."""

    @property
    def p2p(self) -> RelayDialer:
        """The client's P2P handle (peers behind NAT are called through their relays)."""
        ...

    @property
    def config(self) -> ClientConfig:
        ...

    @property
    def traffic(self) -> dict[str, int]:
        """Tensor bytes the session sent ("up") and received ("down"): a transport's own calls count here."""
        ...

    def dropped(self, peer_id: str) -> RemoteError | None:
        """Why this client no longer routes through the peer (caught returning wrong outputs by any session of
        this client, or no longer admitted to a private swarm), as the error its hop fails with; None if it
        still does."""
        ...

    def wants_check(self, first: bool) -> bool:
        """Whether this output is verified (`first`: a hop's first step, or a replay into a new peer)."""
        ...

    async def verify(self, hop: HopStream, inputs: Chunk, output: torch.Tensor) -> None:
        """Check a hop's output for its whole input so far; raises PeerDiverged or SessionError."""
        ...

    async def fail_over(self, hop: HopStream, exc: RemoteError, attempts: Attempts) -> list[HopStream]:
        """Handle the failure `exc` of `hop` (closed here); the hops that replace it, not yet opened."""
        ...

    async def count_failure(self, peer_id: str, exc: RemoteError, attempts: Attempts) -> None:
        """Account for the failure `exc` of the peer's hop as `fail_over` does (held off or banned; SessionError
        past the step's limits), without routing anew."""
        ...

    async def start_over(self, hop: HopStream, exc: RemoteError, attempts: Attempts) -> list[HopStream]:
        """The session's first step met a full cache at `hop`: every hop is closed (the room they reserved given
        back) and all blocks routed anew; the new hops, not yet opened."""
        ...

    async def reroute(self, start: int, end: int, cause: Exception | None) -> list[HopStream]:
        """New hops (not yet opened) for blocks [start, end); SessionError when none can be found."""
        ...

    def ban(self, peer_id: str, reason: str) -> None:
        ...

    def hold_off(self, peer_id: str, reason: str) -> None:
        ...

    def splits(self) -> bool:
        """Whether prefill-only nodes serve every block now (a prompt can run on them)."""
        ...

    async def prefill_hops(self, start: int, end: int, min_cache_tokens: int) -> list[Hop]:
        """A route of prefill nodes over blocks [start, end); NoRouteError when there is none."""
        ...


class RelayTransport:
    """Every hop's output through the client (see the module's docstring)."""

    def __init__(self, route: Route, owner: RouteOwner):
        self.route = route
        self.owner = owner

    async def step(self, chunk: Chunk, keep_last: int) -> torch.Tensor:
        route, owner = self.route, self.owner
        n = chunk.hidden.shape[1]
        index = 0
        x = chunk  # this step's input to hop `index`
        full: Chunk | None = None  # the whole sequence's input to hop `index`, while replaying
        attempts = Attempts()
        while index < len(route):
            hop = route[index]
            try:
                dropped = owner.dropped(hop.hop.peer_id)  # wrong outputs (maybe elsewhere), or revoked
                if dropped is not None:
                    raise dropped
                first = hop.steps_sent == 0
                if hop.cached < route.position:  # a new peer: replay everything before this step
                    if full is None:
                        full = concat([*hop.seed, x])
                    hop.seed = [Chunk(full.hidden[:, :-n], full.positions[:, :-n], full.mask[:, :-n])]
                    output = await hop.step(owner.p2p, full, 0, owner.config)
                    if owner.wants_check(True):
                        await owner.verify(hop, full, output)
                    hop.history, hop.seed = [full], []
                    full = Chunk(output, full.positions, full.mask)
                    x = Chunk(output[:, -n:], x.positions, x.mask)
                else:
                    output = await hop.step(owner.p2p, x, route.position, owner.config)
                    if owner.wants_check(first):
                        await owner.verify(hop, concat([*hop.history, x]), output)
                    hop.history.append(x)
                    full = None
                    x = Chunk(output, x.positions, x.mask)
                index += 1
            except RemoteError as exc:
                if is_cache_full(exc) and route.position == 0:  # the first step: no hop keeps its room meanwhile
                    route.hops = await owner.start_over(hop, exc, attempts)
                    index, x, full = 0, chunk, None
                    continue
                replacement = await owner.fail_over(hop, exc, attempts)
                replacement[0].seed = [*hop.seed, *hop.history]
                route.replace(index, replacement)
                full = None
        return x.hidden


class PushTransport:
    """Hidden states pushed from node to node (see the module's docstring), with the prompt on prefill nodes
    when the swarm splits the phases (`PrefillSplit`)."""

    def __init__(self, route: Route, owner: RouteOwner):
        self.route = route
        self.owner = owner
        self.split = PrefillSplit(route, owner)

    async def step(self, chunk: Chunk, keep_last: int) -> torch.Tensor:
        """One step with hidden states pushed from node to node (see the module's docstring); the last hop
        answers with its last `keep_last` tokens' outputs (0: all the step's)."""
        route = self.route
        n = chunk.hidden.shape[1]
        keep = min(keep_last, n) if keep_last else n
        if route.position == 0 and n > 1 and self.split.wanted():
            output = await self.split.run(chunk, keep)
            if output is not None:
                route.inputs.append(chunk)
                return output
        if route.unrun():  # a route not yet run: replay from 0
            await self._restart(chunk, None, keep, close=False)
        else:
            await self._dispatch(0, len(route), chunk, route.position, keep)
        return await self._gather(chunk, keep)

    async def _gather(self, chunk: Chunk, keep: int) -> torch.Tensor:
        """Every hop's answer to the step in flight (`chunk`, dispatched), a failed hop failed over on the way (see
        the module's docstring); the last hop's output for the last `keep` tokens. The step's input then counts
        among the route's kept inputs."""
        route, owner = self.route, self.owner
        n = chunk.hidden.shape[1]
        total = route.position + n
        attempts = Attempts()
        index = 0
        output = None
        while index < len(route):
            hop = route[index]
            try:
                answer = await self._answer(index, chunk)
                if isinstance(answer, torch.Tensor):
                    output = answer[:, -keep:]
                elif not answer.pushed:
                    await self._repush(index, chunk, answer.push_error)
                index += 1
            except RemoteError as exc:
                if is_cache_full(exc) and route.position == 0 and not route.inputs:  # no hop keeps its room meanwhile
                    route.hops = await owner.start_over(hop, exc, attempts)
                    await self._restart(chunk, exc, keep, close=False)
                    index = 0
                    continue
                replacement = await owner.fail_over(hop, exc, attempts)
                for each in replacement:
                    each.keep_outputs = each.hop.end < route.end
                try:
                    inputs = await self._inputs_of(index, chunk)
                except RemoteError as gone:  # the previous hop cannot be read either: rebuild the route
                    logger.warning("the inputs of blocks [%d, %d) cannot be read back (%s): rebuilding the route "
                                   "and replaying the session's %d tokens", hop.hop.start, hop.hop.end, gone, total)
                    if not route[index - 1].filled:  # a handed-over prompt's outputs were never computed there
                        owner.ban(gone.peer_id, str(gone))
                    await self._restart(chunk, gone, keep)
                    index = 0
                    continue
                route.replace(index, replacement)
                await self._dispatch(index, index + len(replacement), inputs, 0, keep)
        route.inputs.append(chunk)
        assert output is not None, "the route's last hop answered with it"
        return output

    async def _answer(self, index: int, chunk: Chunk) -> torch.Tensor | StepReply:
        """Hop `index`'s answer to the oldest step it has in flight (whose input to the route was `chunk`): the
        route's last hop's output, any other hop's `StepReply`. RemoteError on a failed hop, or on a peer this
        client no longer routes through (`RouteOwner.dropped`)."""
        hop, owner = self.route[index], self.owner
        dropped = owner.dropped(hop.hop.peer_id)
        if dropped is not None:
            raise dropped
        response = await hop.receive(owner.p2p, owner.config)
        assert hop.answered is not None, "the reply answers a step sent to this hop"
        step_id, _, tokens = hop.answered
        if self.route.is_last(index):
            shape = (chunk.hidden.shape[0], tokens, chunk.hidden.shape[2])
            return hidden_states(hop.hop.peer_id, response, shape, chunk.hidden.dtype)
        return step_reply(hop.hop.peer_id, response, step_id)

    async def _dispatch(self, lo: int, hi: int, inputs: Chunk, prefix_length: int, keep_last: int) -> None:
        """Send this step to hops [lo, hi): hop `lo` gets `inputs` (continuing from `prefix_length` tokens),
        the others get theirs by push, each hop pushing to the next, and hop hi-1 to hop `hi` (whose step is
        in flight already) when there is one; the route's last hop answers with its last `keep_last` tokens'
        outputs. Sent from the last hop back, so that each session is open (and its step in flight, which the
        push target names) before anything is pushed to it."""
        route, p2p = self.route, self.owner.p2p
        tokens = inputs.hidden.shape[1]
        for index in reversed(range(lo, hi)):
            after = route.after(index)
            await route[index].send(p2p, inputs if index == lo else None, prefix_length, self.owner.config,
                                    push_to=None if after is None else after.target(p2p), tokens=tokens,
                                    keep_last=keep_last if after is None else 0)

    async def _inputs_of(self, index: int, chunk: Chunk) -> Chunk:
        """Hop `index`'s inputs for the whole sequence, this step included: the client's own for the first
        hop, else the outputs the previous hop kept (RemoteError when it cannot be read)."""
        owner = self.owner
        own = self.route.sequence(chunk)
        if index == 0:
            return own
        previous = self.route[index - 1]
        hidden = await fetch_outputs(owner.p2p, previous.hop.peer_id, previous.session_id, 0,
                                     own.hidden.shape[1], own.hidden.shape, own.hidden.dtype,
                                     timeout=owner.config.request_timeout)
        owner.traffic["down"] += hidden.numel() * hidden.element_size()
        return Chunk(hidden, own.positions, own.mask)

    async def _repush(self, index: int, chunk: Chunk, error: str | None) -> None:
        """Hop `index` could not push its output to the next hop: fetch that output and push it from here.
        A failure to read it is hop `index`'s (RemoteError); a next hop that does not answer a ping, or a
        failed push, is left for the next hop's own reply (and keep-alives) to show."""
        owner = self.owner
        hop, after = self.route[index], self.route[index + 1]
        step_id, prefix_length, _ = after.in_flight[0]  # the step it waits for: its reply is not read yet
        own = self.route.sequence(chunk).tail(prefix_length)
        if not await rpc.answering(owner.p2p, [after.hop.peer_id], REPUSH_PING_TIMEOUT):
            logger.info("%s could not push to %s (%s), which does not answer here either", short_id(hop.hop.peer_id),
                        short_id(after.hop.peer_id), error)
            return
        logger.info("%s could not push to %s (%s): pushing from the client", short_id(hop.hop.peer_id),
                    short_id(after.hop.peer_id), error)
        hidden = await fetch_outputs(owner.p2p, hop.hop.peer_id, hop.session_id, prefix_length,
                                     prefix_length + own.hidden.shape[1], own.hidden.shape, own.hidden.dtype,
                                     timeout=owner.config.request_timeout)
        owner.traffic["down"] += hidden.numel() * hidden.element_size()
        owner.traffic["up"] += hidden.numel() * hidden.element_size()
        payload = Chunk(hidden, own.positions, own.mask)
        try:
            await push_rpc(owner.p2p, after.hop.peer_id, after.session_id, step_id, prefix_length, payload,
                           timeout=rpc.push_timeout(hidden.numel() * hidden.element_size()))
        except RemoteError as exc:
            logger.info("pushing to %s from the client failed too: %s", short_id(after.hop.peer_id), exc)

    async def _restart(self, chunk: Chunk, cause: Exception | None, keep_last: int, *, close: bool = True) -> None:
        """Route all blocks anew (banned peers avoided) and send the whole sequence through the new route."""
        route = self.route
        if close:
            route.restarts += 1
            await close_all(route.take())
            route.hops = await self.owner.reroute(route.start, route.end, cause)
        route.keep_outputs()
        await self._dispatch(0, len(route), route.sequence(chunk), 0, keep_last)


@dataclass
class Ahead:
    """A step sent without waiting for its answer (`PipelinedPush.send`)."""

    chunk: Chunk  # the step's input
    keep_last: int  # the last hop answers with the last this many tokens' outputs (0: all)
    discarded: bool = False  # given up by the caller: its answers are read and dropped


class PipelinedPush(PushTransport):
    """`PushTransport` with several steps in flight: speculative passes sent before the earlier ones are verified
    (`client.speculative`).

    `send` dispatches a step behind the ones not answered yet, continuing from their tokens; every node runs a
    session's steps in the order they came, pushing each output on as it is computed, so while the last hop runs
    one pass the first may run the next. `collect` reads the oldest step's answers. A step given up (`discard`:
    an earlier pass rejected the drafts it continues) still runs and is answered; its answers are read and dropped,
    and the next step sent continues from before its tokens, so every node rolls its KV cache back to there
    (`StepMeta.prefix_length`, as after a rewind). A failure while steps are in flight rebuilds the route: the
    failed peer is banned or held off (`RouteOwner.count_failure`), every stream closed and the blocks routed anew;
    the steps in flight are lost (`collect` answers None) and the next step replays the session's inputs through
    the new route, as `PushTransport` does for a route that cannot be repaired (a hop that could not push a step
    on fails nobody: the route is rebuilt once and the session sends one step at a time from then on, the client
    pushing for a node that cannot). With nothing in flight, `step` is
    `PushTransport.step`, failover and all, and so is collecting a step alone in flight: a failed hop is replaced
    and fed from the previous hop's kept outputs, with no route rebuilt."""

    def __init__(self, route: Route, owner: RouteOwner):
        super().__init__(route, owner)
        self.ahead: deque[Ahead] = deque()
        # a hop could not push a step on while several were in flight: from then on this session sends one at a
        # time, whose pushes the client makes itself when a node cannot (`PushTransport._repush`)
        self.one_at_a_time = False

    @property
    def tokens_ahead(self) -> int:
        """Tokens of the steps in flight that are not given up (the next step sent continues after them)."""
        return sum(a.chunk.hidden.shape[1] for a in self.ahead if not a.discarded)

    def live(self) -> int:
        """Steps in flight that are not given up."""
        return sum(not a.discarded for a in self.ahead)

    def can_send(self) -> bool:
        """Whether a step may be sent ahead: the route has run or was filled by a handover (a new or rebuilt one
        replays the session's inputs in a plain `step` first), and no push has failed with steps in flight."""
        return self.route.opened and not self.route.unrun() and not self.one_at_a_time

    async def step(self, chunk: Chunk, keep_last: int) -> torch.Tensor:
        await self._drain()
        if self.ahead:
            raise SessionError(f"{len(self.ahead)} step(s) sent ahead are not collected yet: collect or discard them "
                               f"before a plain step", code=ERROR_BAD_REQUEST)
        return await super().step(chunk, keep_last)

    async def send(self, chunk: Chunk, keep_last: int) -> None:
        """Dispatch `chunk` behind the steps in flight (see the class docstring); `can_send` must hold."""
        assert self.can_send(), "a step is sent ahead only on a route that has run"
        prefix = self.route.position + self.tokens_ahead
        await self._dispatch(0, len(self.route), chunk, prefix, keep_last)
        self.ahead.append(Ahead(chunk, keep_last))

    def discard(self) -> None:
        """Give up every step in flight (their tokens continue drafts that were rejected)."""
        for ahead in self.ahead:
            ahead.discarded = True

    async def collect(self) -> torch.Tensor | None:
        """The output of the oldest step in flight that is not given up (the answers of given-up ones before it
        read and dropped; its input then counts among the session's kept inputs); None when a failure lost it
        and every other step in flight (the route is rebuilt: send them again)."""
        while self.ahead:
            ahead = self.ahead[0]
            if len(self.ahead) == 1 and not ahead.discarded:  # alone in flight: a failed hop is failed over
                self.ahead.popleft()
                n = ahead.chunk.hidden.shape[1]
                return await self._gather(ahead.chunk, min(ahead.keep_last, n) if ahead.keep_last else n)
            try:
                output = await self._answers(ahead)
            except RemoteError as exc:
                await self._rebuild(exc)
                return None
            self.ahead.popleft()
            if output is None:  # a hop could not push it on: no step after it can run either
                self.one_at_a_time = True
                await self._rebuild(None)
                return None
            if not ahead.discarded:
                self.route.inputs.append(ahead.chunk)
                return output
        return None

    async def _drain(self) -> None:
        """Read the answers of given-up steps at the head of the queue."""
        while self.ahead and self.ahead[0].discarded:
            try:
                output = await self._answers(self.ahead[0])
            except RemoteError as exc:
                await self._rebuild(exc)
                return
            self.ahead.popleft()
            if output is None:
                self.one_at_a_time = True
                await self._rebuild(None)
                return

    async def _answers(self, ahead: Ahead) -> torch.Tensor | None:
        """Every hop's answer to the oldest step in flight, in route order: the last hop's output, or None when a
        hop could not push its output on (the next hop's step then never runs). RemoteError on a failed hop."""
        output = None
        for index, hop in enumerate(self.route):
            answer = await self._answer(index, ahead.chunk)
            if isinstance(answer, torch.Tensor):
                output = answer
            elif not answer.pushed:
                logger.info("%s could not push a pipelined step on (%s): rebuilding the route",
                            short_id(hop.hop.peer_id), answer.push_error)
                return None
        return output

    async def _rebuild(self, exc: RemoteError | None) -> None:
        """A failure with steps in flight: account for the failed peer, close every stream, route the blocks anew
        (not run yet: the next `step` replays the session's inputs) and forget the steps in flight."""
        route = self.route
        lost = len(self.ahead)
        self.ahead.clear()
        route.restarts += 1
        # the streams go first: they hold answers to the lost steps, which no later step may read as its own
        await close_all(route.take())
        if exc is not None:
            await self.owner.count_failure(exc.peer_id, exc, Attempts())
        route.hops = await self.owner.reroute(route.start, route.end, exc)
        logger.info("a pipelined step failed (%s) with %d step(s) in flight: the route is rebuilt and replays the "
                    "session's %d tokens on its next step", exc or "a push failed", lost, route.position)


class PrefillSplit:
    """HexGen-2's two phases: the prompt on prefill nodes, its KV cache handed over to the decode route
    (the `Route` it is given: the session's, which `PushTransport` steps on)."""

    def __init__(self, route: Route, owner: RouteOwner):
        self.route = route
        self.owner = owner

    def wanted(self) -> bool:
        """Whether this session's prompt runs on prefill nodes (`ClientConfig.disaggregate`)."""
        wanted = self.owner.config.disaggregate
        if wanted is False:
            return False
        if self.owner.splits():
            return True
        if wanted:
            raise SessionError("disaggregate=True, but prefill-only nodes do not serve every block now: start "
                               "nodes with --phase prefill, or leave disaggregate unset", code="no_route")
        return False

    async def run(self, chunk: Chunk, keep: int) -> torch.Tensor | None:
        """Run the prompt through a route of prefill nodes, each handing the KV cache of its blocks over to the
        decode hops that hold them (opened first, so their caches are reserved); the last prefill hop's
        output, or None when any part failed (the caller then runs the prompt on the decode route itself)."""
        route, owner = self.route, self.owner
        config, p2p = owner.config, owner.p2p
        n = chunk.hidden.shape[1]
        try:
            routed = await owner.prefill_hops(route.start, route.end, chunk.hidden.shape[0] * n)
        except NoRouteError as exc:
            logger.info("no prefill route (%s): the prompt runs on the decode route", exc)
            return None
        prefill = [HopStream(h, uuid.uuid4().hex, n, chunk.hidden.shape[0], traffic=owner.traffic,
                             phase=Phase.PREFILL) for h in routed]
        for hop in route:
            hop.phase = Phase.DECODE
        route.keep_outputs()
        x, taken = chunk, True
        try:
            for hop in route:
                await hop.open_only(p2p, config)
            # sent from the last prefill hop back, each pushing its output to the next (as `PushTransport._dispatch` does):
            # the prompt's hidden states cross the client's link once up and its last tokens' once down
            for index in reversed(range(len(prefill))):
                hop = prefill[index]
                last = index == len(prefill) - 1
                targets = [KvTarget(peer_id=d.hop.peer_id, session_id=d.session_id,
                                    start=max(hop.hop.start, d.hop.start), end=min(hop.hop.end, d.hop.end),
                                    via=p2p.relay_of(d.hop.peer_id))
                           for d in route.covering(hop.hop.start, hop.hop.end)]
                await hop.send(p2p, chunk if index == 0 else None, 0, config, tokens=n, handover_to=targets,
                               push_to=None if last else prefill[index + 1].target(p2p), keep_last=keep if last else 0)
            for index, hop in enumerate(prefill):
                response = await hop.receive(p2p, config)
                if index == len(prefill) - 1:
                    shape = (chunk.hidden.shape[0], keep, chunk.hidden.shape[2])
                    x = Chunk(hidden_states(hop.hop.peer_id, response, shape, chunk.hidden.dtype),
                               chunk.positions, chunk.mask)
                reply = step_reply(hop.hop.peer_id, response, 0)
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
            owner.hold_off(exc.peer_id, str(exc))
            taken = False
        finally:
            await close_all(prefill)
        if not taken:
            return None
        for hop in route:
            hop.filled = True
        route.prefills += 1
        return x.hidden
