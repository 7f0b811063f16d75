"""One inference session on a node: what its stream opened, the cache it holds, and the step in flight.

`BlockHandler.rpc_inference` drives a `ServerSession` through its life: `open` checks the opening message
against the node's limits and reserves the session's cache from the serving unit's budget (refused up
front when it does not fit), `step` runs one step's new tokens through the unit's blocks and builds the
reply, and `close` gives everything back. A step that timed out or whose client vanished may still be
running on the compute thread; its cache is released only once that step ends (`close`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from hivemind.proto import runtime_pb2

from swarmnode import messages, metrics
from swarmnode.messages import OpenSession, ProtocolError, StepMeta, StepReply, pack_metadata
from swarmnode.runtime.kv_cache import SessionCache
from swarmnode.runtime.scheduler import StepTask
from swarmnode.server.unit import ServingUnit

logger = logging.getLogger(__name__)


class ServerSession:
    """The node's side of one `inference` stream, opened on one serving unit."""

    def __init__(self, handler, caller: str):
        self.handler = handler  # the `BlockHandler`: limits, open sessions, compute
        self.caller = caller
        self.opening: OpenSession | None = None
        self.unit: ServingUnit | None = None
        self.cache: SessionCache | None = None
        self.reserved = 0  # block-tokens taken from the unit's budget
        self.running: Future | None = None  # the step on the compute thread, while one is

    def open(self, opening: OpenSession) -> None:
        """Check the opening against the node's limits, reserve the cache and register the session.

        Raises `ProtocolError` (bad request, or blocks this node does not serve) or `CacheFullError`.
        """
        handler = self.handler
        unit = handler.unit_for(opening.start, opening.end)
        if opening.max_length > handler.limits.max_length:
            raise ProtocolError(
                f"max_length {opening.max_length} exceeds this node's limit of {handler.limits.max_length} tokens"
            )
        if opening.session_id in handler.sessions:
            raise ProtocolError(f"session id {opening.session_id!r} is already open on this node")
        self.reserved = unit.budget.reserve(opening.batch_size, opening.max_length, opening.end - opening.start)
        self.unit, self.opening = unit, opening
        handler.sessions[opening.session_id] = time.monotonic()
        unit.sessions.add(opening.session_id)
        metrics.NODE_SESSIONS.inc()
        self.cache = unit.stack.new_session_cache(opening.start, opening.end, opening.batch_size,
                                                  opening.max_length)
        logger.info("session %s opened by %s: blocks [%d, %d), batch %d, max_length %d", opening.session_id[:8],
                    self.caller, opening.start, opening.end, opening.batch_size, opening.max_length)

    async def step(self, request: runtime_pb2.ExpertRequest, step: StepMeta) -> runtime_pb2.ExpertResponse:
        """Run one step (validated first) and answer with its output and the cache's new length."""
        unit, cache, opening = self.unit, self.cache, self.opening
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
        hidden = positions = mask = task = output = None
        try:
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
            reply = StepReply(step_id=step.step_id, cache_length=cache.length)
            return runtime_pb2.ExpertResponse(tensors=messages.serialize_tensors([output.to(wire_dtype)]),
                                              metadata=pack_metadata(reply))
        finally:
            # A stream dropped by its client cancels the step; the CancelledError's traceback keeps this frame
            # alive in a reference cycle until the garbage collector's next full pass. Drop the tensors now
            # so the session's memory is freed with its stream, not whenever that pass comes.
            hidden = positions = mask = task = output = None

    def close(self) -> None:
        """Give the cache back (once no step still writes to it) and unregister the session."""
        if self.reserved:
            _release_after(self.running, self.unit, self.reserved)
            self.reserved = 0
        if self.opening is not None:
            session_id = self.opening.session_id
            self.handler.sessions.pop(session_id, None)
            self.unit.sessions.discard(session_id)
            logger.info("session %s closed", session_id[:8])
            self.handler.trim_soon()
        self.cache = self.running = None


def _release_after(running: Future | None, unit: ServingUnit, reserved: int) -> None:
    """Give a closed session's cache back to the budget, but only once no compute step still writes to it.

    A step that timed out or whose client vanished may still be running on the compute thread; its
    memory stays in use until it ends, so the budget is released from the future's done callback then.
    """
    if running is None or running.done():
        unit.budget.release(reserved)
    else:
        running.add_done_callback(lambda _: unit.budget.release(reserved))
