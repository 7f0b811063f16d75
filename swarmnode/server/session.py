"""One inference session on a node: what its stream opened, the cache it holds, and the step in flight.

`BlockHandler.rpc_inference` drives a `ServerSession` through its life: `open` checks the opening message
against the node's limits and reserves the session's cache from the serving unit's budget (refused up
front when it does not fit), `step` runs one step's new tokens through the unit's blocks and builds the
reply, and `close` gives everything back. A step that timed out or whose client vanished may still be
running on the compute thread; its cache is released only once that step ends (`close`).

Peer-to-peer steps: a step with `pushed` set waits for its input to arrive by `PUSH` (`deliver`, from the
previous hop or whoever holds the session's id), and a step with `push_to` sends its output on
(`server.push`) and answers the client with a `StepReply` alone. A session opened with `keep_outputs`
keeps every step's output (in the wire dtype, preallocated to max_length and counted in the cache it
reserves) so that its client can fetch what a replacement of the next hop must replay (`outputs`).

Two phases (HexGen-2): a step with `handover_to` sends the session's KV cache on to decode nodes once it ran
(`server.handover`), and a fresh session takes a KV cache handed over to it (`check_handover`, `check_block`,
`take_handover`): once every block of its span is in, its steps continue from the handed-over length.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypedDict

import torch
from hivemind.proto import runtime_pb2

from swarmnode import messages, metrics
from swarmnode.messages import (
    KvHandover,
    KvHandoverReply,
    OpenSession,
    ProtocolError,
    PushRequest,
    StepMeta,
    StepReply,
    pack_metadata,
)
from swarmnode.naming import short_id
from swarmnode.records import Phase
from swarmnode.runtime.kv_cache import SessionCache
from swarmnode.runtime.scheduler import StepTask
from swarmnode.server.handover import hand_over
from swarmnode.server.push import push_step
from swarmnode.server.unit import ServingUnit

if TYPE_CHECKING:
    from swarmnode.relay.dialer import RelayDialer
    from swarmnode.server.handler import SessionLimits

logger = logging.getLogger(__name__)


class SessionHost(Protocol):
    """What a session may ask of the node that hosts it (`BlockHandler` is the one host): its limits and
    phase, the table of open sessions (a session registers and removes itself), the unit that serves a
    range, the checks of a step's tensors, the compute thread, the P2P handle that pushes and hands over,
    and the memory trim after closes. A session reaches nothing else of the node."""

    limits: SessionLimits
    phase: Phase
    sessions: dict[str, ServerSession]
    p2p: RelayDialer | None

    def unit_for(self, start: int, end: int) -> ServingUnit: ...

    def validate(self, unit: ServingUnit, request: runtime_pb2.ExpertRequest, *, batch_size: int | None,
                 max_tokens: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.dtype]: ...

    async def compute(self, unit: ServingUnit, task: StepTask) -> torch.Tensor: ...

    def trim_soon(self) -> None: ...


class _HandedOver(TypedDict, total=False):
    """The fields of a `StepReply` that say how a step's handovers went (none without `handover_to`)."""

    handed_over: list[bool]
    handover_errors: list[str | None]


class ServerSession:
    """The node's side of one `inference` stream, opened on one serving unit."""

    def __init__(self, handler: SessionHost, caller: str):
        self.handler = handler  # the node's side that hosts it: limits, open sessions, compute, p2p
        self.caller = caller  # the opener's peer id
        self.opening: OpenSession | None = None
        self.unit: ServingUnit | None = None
        self.cache: SessionCache | None = None
        self.reserved = 0  # block-tokens taken from the unit's budget
        self.running: Future | None = None  # the step on the compute thread, while one is
        self.last_step = -1  # the id of the last step run (ids increase along the stream)
        self.inbox: dict[int, tuple[PushRequest, runtime_pb2.ExpertRequest]] = {}  # pushed inputs not yet run
        self._arrived = asyncio.Event()
        self.kept: torch.Tensor | None = None  # (batch, max_length, hidden) outputs, with `keep_outputs`
        self.kept_from = 0  # the first token whose output is kept
        self.waiting_for_push = False  # a step waits for its pushed input now
        self.handed_blocks: set[int] = set()  # blocks whose KV cache was handed over to this session
        self.handed_length: int | None = None  # the tokens those hold

    def open(self, opening: OpenSession) -> None:
        """Check the opening against the node's limits, reserve the cache and register the session.

        Raises `ProtocolError` (bad request, or blocks this node does not serve) or `CacheFullError`.
        """
        handler = self.handler
        unit = handler.unit_for(opening.start, opening.end)
        if not handler.phase.takes(Phase(opening.phase)):
            raise ProtocolError(
                f"this node serves the {handler.phase} phase only, not {opening.phase} sessions: route "
                f"{'prompts' if handler.phase is Phase.DECODE else 'generation'} through other nodes",
                code=messages.ERROR_WRONG_PHASE)
        if opening.max_length > handler.limits.max_length:
            raise ProtocolError(
                f"max_length {opening.max_length} exceeds this node's limit of {handler.limits.max_length} tokens"
            )
        if opening.session_id in handler.sessions:
            raise ProtocolError(f"session id {opening.session_id!r} is already open on this node")
        blocks = opening.end - opening.start
        if opening.keep_outputs:
            blocks += kept_output_blocks(unit)
        self.reserved = unit.budget.reserve(opening.batch_size, opening.max_length, blocks)
        self.unit, self.opening = unit, opening
        self.opened_at = time.monotonic()
        handler.sessions[opening.session_id] = self
        unit.sessions.add(opening.session_id)
        metrics.NODE_SESSIONS.inc()
        self.cache = unit.stack.new_session_cache(opening.start, opening.end, opening.batch_size,
                                                  opening.max_length)
        logger.info("session %s opened by %s: blocks [%d, %d), batch %d, max_length %d%s", opening.session_id[:8],
                    short_id(self.caller), opening.start, opening.end, opening.batch_size, opening.max_length,
                    ", keeping outputs" if opening.keep_outputs else "")

    def _opened(self) -> tuple[OpenSession, ServingUnit, SessionCache]:
        """The opening, unit and cache `open` set: every step and handover runs on an opened session."""
        opening, unit, cache = self.opening, self.unit, self.cache
        assert opening is not None and unit is not None and cache is not None, "the session is not open"
        return opening, unit, cache

    def _p2p(self) -> RelayDialer:
        """The host's P2P handle, set when the node registered its handlers (before any stream came)."""
        p2p = self.handler.p2p
        assert p2p is not None, "the node's handlers are not registered"
        return p2p

    # --- pushed inputs ---------------------------------------------------------------------------------
    def deliver(self, push: PushRequest, request: runtime_pb2.ExpertRequest) -> bool:
        """Queue a pushed input for step `push.step_id`; False when that step has run or has an input queued
        already (a duplicate, e.g. from a replacement of the previous hop: the same computation), which is
        dropped. Raises ProtocolError when too many pushes wait."""
        if push.step_id <= self.last_step or push.step_id in self.inbox:
            return False
        if len(self.inbox) >= MAX_QUEUED_PUSHES:
            raise ProtocolError(f"{MAX_QUEUED_PUSHES} pushed steps of this session wait already: send the steps "
                                f"they belong to first")
        self.inbox[push.step_id] = (push, request)
        self._arrived.set()
        return True

    async def _pushed_input(self, step: StepMeta) -> runtime_pb2.ExpertRequest:
        """The pushed input of `step`, waited for up to the step timeout."""
        deadline = time.monotonic() + self.handler.limits.step_timeout
        self.waiting_for_push = step.step_id not in self.inbox
        while step.step_id not in self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(
                    f"the input of step {step.step_id} did not arrive by push within "
                    f"{self.handler.limits.step_timeout:.0f} s: send it with the step, or push it again")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                pass
        self.waiting_for_push = False
        push, request = self.inbox.pop(step.step_id)
        for stale in [s for s in self.inbox if s < step.step_id]:
            del self.inbox[stale]
        if push.prefix_length != step.prefix_length:
            raise ProtocolError(f"the pushed input of step {step.step_id} continues from {push.prefix_length} "
                                f"tokens, the step from {step.prefix_length}")
        return request

    # --- KV caches handed over (HexGen-2's two phases) --------------------------------------------------
    def check_handover(self, header: KvHandover, request: runtime_pb2.ExpertRequest) -> torch.Tensor:
        """Check a handover's header against this session, and return the (batch, length) mask it carries."""
        opening, _, cache = self._opened()
        if not opening.start <= header.start < header.end <= opening.end:
            raise ProtocolError(f"blocks [{header.start}, {header.end}) are outside this session's "
                                f"[{opening.start}, {opening.end})")
        if header.batch_size != opening.batch_size:
            raise ProtocolError(f"the handover is for a batch of {header.batch_size}, the session was opened with "
                                f"{opening.batch_size}")
        if header.length > opening.max_length:
            raise ProtocolError(f"{header.length} tokens do not fit the session's max_length {opening.max_length}")
        if self.last_step >= 0 or cache.length:
            raise ProtocolError("this session has run steps already: a KV cache is handed over to a fresh session")
        if self.handed_length is not None and header.length != self.handed_length:
            raise ProtocolError(f"this session took {self.handed_length} tokens by handover already, not "
                                f"{header.length}")
        again = self.handed_blocks & set(range(header.start, header.end))
        if again:
            raise ProtocolError(f"blocks {sorted(again)[:4]} were handed over to this session already")
        tensors = messages.deserialize_tensors(request.tensors)
        if len(tensors) != 1:
            raise ProtocolError(f"a handover's first message carries 1 tensor (the token mask), got {len(tensors)}")
        (valid,) = tensors
        if tuple(valid.shape) != (header.batch_size, header.length):
            raise ProtocolError(f"the token mask must have shape {(header.batch_size, header.length)}, got "
                                f"{tuple(valid.shape)}")
        if valid.dtype not in (torch.int64, torch.int32, torch.bool) or not bool(((valid == 0) | (valid == 1)).all()):
            raise ProtocolError("the token mask must hold only 0 and 1, as an integer tensor")
        return valid.to(torch.bool)

    def check_block(self, header: KvHandover, index: int,
                    request: runtime_pb2.ExpertRequest) -> list[torch.Tensor]:
        """The keys and values of block `index` in one handover message, checked against the header and the
        model this node serves."""
        tensors = messages.deserialize_tensors(request.tensors)
        if len(tensors) != 2:
            raise ProtocolError(f"block {index}'s message carries 2 tensors (keys, values), got {len(tensors)}")
        shapes = self._opened()[2].shapes(index, header.length)
        dtype = messages.WIRE_DTYPES[header.dtype]
        for name, tensor, shape in zip(("keys", "values"), tensors, shapes):
            if tuple(tensor.shape) != shape:
                raise ProtocolError(f"block {index}'s {name} must have shape {shape}, got {tuple(tensor.shape)}")
            if tensor.dtype != dtype:
                raise ProtocolError(f"block {index}'s {name} are {str(tensor.dtype).removeprefix('torch.')}, the "
                                    f"header says {header.dtype}")
            if not bool(torch.isfinite(tensor).all()):
                raise ProtocolError(f"block {index}'s {name} contain NaN or infinity")
        return tensors

    def take_handover(self, header: KvHandover, valid: torch.Tensor,
                      blocks: dict[int, list[torch.Tensor]]) -> KvHandoverReply:
        """Write checked blocks into the session's cache; once every block is in, the cache holds
        `header.length` tokens."""
        opening, _, cache = self._opened()
        length = header.length
        for index, (keys, values) in blocks.items():
            cache.keys[index][:, :, :length] = keys.to(cache.keys[index].dtype)
            cache.values[index][:, :, :length] = values.to(cache.values[index].dtype)
        cache.valid[:, :length] = valid.to(cache.valid.device)
        self.handed_blocks |= set(blocks)
        self.handed_length = length
        complete = self.handed_blocks >= set(range(opening.start, opening.end))
        if complete:
            cache.length = length
        logger.info("session %s took blocks [%d, %d) of %d tokens by handover%s", opening.session_id[:8],
                    header.start, header.end, length, "; its cache is complete" if complete else "")
        return KvHandoverReply(blocks=len(self.handed_blocks), complete=complete)

    # --- kept outputs ----------------------------------------------------------------------------------
    def outputs(self, start: int, end: int) -> torch.Tensor:
        """Kept outputs for token positions [start, end) (`OUTPUTS`)."""
        assert self.opening is not None, "outputs are fetched from sessions registered by `open`"
        if not self.opening.keep_outputs:
            raise ProtocolError("this session was not opened with keep_outputs: its outputs are not kept")
        if self.kept is None or self.cache is None or end > self.cache.length:
            length = 0 if self.cache is None else self.cache.length
            raise ProtocolError(f"tokens [{start}, {end}) are not all computed: this session holds {length}")
        if start < self.kept_from:
            raise ProtocolError(f"the outputs of tokens before {self.kept_from} were not computed here (their KV "
                                f"cache was handed over): replay the session from its own inputs")
        return self.kept[:, start:end]

    def _keep(self, prefix: int, output: torch.Tensor) -> None:
        if self.kept is None:
            max_length = self._opened()[0].max_length
            self.kept = torch.empty(output.shape[0], max_length, output.shape[2], dtype=output.dtype)
            self.kept_from = prefix  # tokens before it came by handover: their outputs were never computed here
        elif self.kept.dtype != output.dtype:
            raise ProtocolError(f"this session's hidden states came as {self.kept.dtype} and now as "
                                f"{output.dtype}: keep one wire dtype for a session")
        self.kept[:, prefix:prefix + output.shape[1]] = output

    # --- steps -----------------------------------------------------------------------------------------
    async def step(self, request: runtime_pb2.ExpertRequest, step: StepMeta) -> runtime_pb2.ExpertResponse:
        """Run one step (validated first; its input waited for when it comes by push) and answer with its
        output and the cache's new length, or, with `step.push_to`, send the output on and answer with the
        reply alone."""
        opening, unit, cache = self._opened()
        if step.step_id <= self.last_step:
            raise ProtocolError(f"step id {step.step_id} does not follow {self.last_step}: step ids increase")
        if unit.closed:
            raise ProtocolError(
                f"this node stopped serving blocks [{unit.start}, {unit.end}) (its placement changed): continue "
                f"the session on another peer", code=messages.ERROR_MOVED,
            )
        if step.prefix_length > cache.length:
            raise ProtocolError(
                f"step continues from {step.prefix_length} tokens, but this node holds {cache.length} for the "
                f"session: replay the missing tokens first"
            )
        if step.pushed and request.tensors:
            raise ProtocolError("a step whose input comes by push carries no tensors")
        hidden: torch.Tensor | None = None
        positions: torch.Tensor | None = None
        mask: torch.Tensor | None = None
        task: StepTask | None = None
        output: torch.Tensor | None = None
        try:
            if step.pushed:
                request = await self._pushed_input(step)
            self.last_step = step.step_id
            hidden, positions, mask, wire_dtype = self.handler.validate(
                unit, request, batch_size=opening.batch_size, max_tokens=opening.max_length - step.prefix_length,
                max_position=self.handler.limits.max_length,
            )
            if step.prefix_length < cache.length:
                cache.rewind(step.prefix_length)
            task = StepTask(cache, opening.start, opening.end, hidden, positions, mask)
            began = time.perf_counter()
            self.running = task.future
            output = await self.handler.compute(unit, task)
            self.running = None
            metrics.NODE_STEP_LATENCY.labels("inference").observe(time.perf_counter() - began)
            metrics.NODE_TOKENS_PROCESSED.labels("inference").inc(hidden.shape[0] * hidden.shape[1])
            output = output.to(wire_dtype)
            if opening.keep_outputs:
                self._keep(step.prefix_length, output)
            handed = await self._hand_over(step)
            if step.push_to is None:
                reply = StepReply(step_id=step.step_id, cache_length=cache.length, **handed)
                if 0 < step.keep_last < output.shape[1]:
                    output = output[:, -step.keep_last:]
                return runtime_pb2.ExpertResponse(tensors=messages.serialize_tensors([output]),
                                                  metadata=pack_metadata(reply))
            skip = step.push_to.prefix_length - step.prefix_length
            if not 0 <= skip < output.shape[1]:
                raise ProtocolError(f"push_to continues from {step.push_to.prefix_length} tokens, outside this "
                                    f"step's tokens [{step.prefix_length}, {cache.length})")
            pushed, error = await push_step(self._p2p(), step.push_to, output[:, skip:], positions[:, skip:],
                                            mask[:, skip:])
            if pushed:
                logger.debug("session %s step %d: pushed %d tokens to %s", opening.session_id[:8], step.step_id,
                             output.shape[1] - skip, short_id(step.push_to.peer_id))
            else:
                logger.warning("session %s step %d: %s", opening.session_id[:8], step.step_id, error)
            reply = StepReply(step_id=step.step_id, cache_length=cache.length, pushed=pushed,
                              push_error=None if error is None else error[:MAX_PUSH_ERROR_CHARS], **handed)
            return runtime_pb2.ExpertResponse(metadata=pack_metadata(reply))
        finally:
            # A stream dropped by its client cancels the step; the CancelledError's traceback keeps this frame
            # alive in a reference cycle until the garbage collector's next full pass. Drop the tensors now
            # so the session's memory is freed with its stream, not whenever that pass comes.
            hidden = positions = mask = task = output = None

    async def _hand_over(self, step: StepMeta) -> _HandedOver:
        """Send the KV cache to the step's `handover_to` targets, side by side: the reply's fields."""
        if not step.handover_to:
            return {}
        opening, _, cache = self._opened()
        p2p = self._p2p()
        results = await asyncio.gather(*(hand_over(p2p, cache, target, cache.length)
                                         for target in step.handover_to))
        for _taken, error in results:
            if error is not None:
                logger.warning("session %s step %d: could not hand the KV cache over: %s (the client runs the "
                               "prompt on its decode route instead)", opening.session_id[:8], step.step_id, error)
        return {"handed_over": [taken for taken, _ in results],
                "handover_errors": [None if e is None else e[:MAX_PUSH_ERROR_CHARS] for _, e in results]}

    def close(self) -> None:
        """Give the cache back (once no step still writes to it) and unregister the session."""
        if self.reserved:
            assert self.unit is not None, "a cache is reserved from the unit `open` set"
            _release_after(self.running, self.unit, self.reserved)
            self.reserved = 0
        self.inbox.clear()
        self.kept = None
        if self.opening is not None:
            session_id = self.opening.session_id
            if self.handler.sessions.get(session_id) is self:
                del self.handler.sessions[session_id]
            assert self.unit is not None, "`open` sets the unit with the opening"
            self.unit.sessions.discard(session_id)
            logger.info("session %s closed", session_id[:8])
            self.handler.trim_soon()
        self.cache = None
        self.running = None


# Pushed inputs a session holds for steps it has not reached: one a step in flight, and a client pipelining
# speculative passes keeps up to `client.swarm.MAX_SPECULATIVE_PASSES` (4) in flight, given-up ones included.
MAX_QUEUED_PUSHES = 4
MAX_PUSH_ERROR_CHARS = 480


def kept_output_blocks(unit: ServingUnit) -> int:
    """Blocks' worth of cache that keeping a session's outputs takes: a token's hidden state (at up to 4
    bytes an element, float32 on the wire) against one block's keys and values for a token."""
    stack = unit.stack
    return math.ceil(stack.checkpoint.hidden_size * 4 / stack.family.kv_bytes_per_token(stack.dtype))


def _release_after(running: Future | None, unit: ServingUnit, reserved: int) -> None:
    """Give a closed session's cache back to the budget, but only once no compute step still writes to it.

    A step that timed out or whose client vanished may still be running on the compute thread; its
    memory stays in use until it ends, so the budget is released from the future's done callback then.
    """
    if running is None or running.done():
        unit.budget.release(reserved)
    else:
        running.add_done_callback(lambda _: unit.budget.release(reserved))
