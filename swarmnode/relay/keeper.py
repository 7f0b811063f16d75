"""A node behind NAT keeps a reservation with one relay (`relay.service`) for as long as it serves.

The node reserves with the first candidate that grants it (its initial peers first, then nodes that announce
relay service), renews every `renew` s (which also keeps its connection to the relay open, the one the relay
forwards calls over), and, when its relay stops answering or refuses, reserves with the next candidate at once.
Every change of relay is announced in the node's records (`on_change`), which is how clients find the node
again; calls that were on their way through the old relay fail, and their clients fail over as for any peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.naming import short_id

logger = logging.getLogger(__name__)

RESERVE_TTL = 30.0
RENEW_PERIOD = 5.0
CALL_TIMEOUT = 5.0
RETRY_PERIOD = 3.0  # while no candidate grants a reservation
FAILED_HOLD = 60.0  # a relay that failed is tried after the others for this long


class RelayKeeper:
    def __init__(self, p2p, candidates: Callable[[], Awaitable[list[str]]], *,
                 on_change: Callable[[str | None], None] = lambda relay: None,
                 ttl: float = RESERVE_TTL, renew: float = RENEW_PERIOD):
        self.p2p = p2p
        self.candidates = candidates
        self.on_change = on_change
        self.ttl = ttl
        self.renew = renew
        self.relay: str | None = None
        self.changes = 0
        self._failed: dict[str, float] = {}  # relay -> when it last failed

    async def _reserve(self, relay: str) -> None:
        request = runtime_pb2.ExpertRequest(metadata=messages.pack_metadata(messages.RelayReserve(ttl=self.ttl)))
        response = await asyncio.wait_for(self.p2p.call_protobuf_handler(
            PeerID.from_base58(relay), rpc.RPC_RELAY_RESERVE, request, runtime_pb2.ExpertResponse), CALL_TIMEOUT)
        error = messages.response_error(response)
        if error is not None:
            raise messages.ReplyError(error, code=messages.response_error_code(response))

    async def acquire(self) -> str | None:
        """Reserve with the first candidate that grants it (failed relays last); the relay, or None."""
        now = time.monotonic()
        try:
            candidates = await self.candidates()
        except Exception as exc:  # safe: no candidates this time; tried again at the next period
            logger.warning("cannot list relay candidates: %s", exc)
            candidates = []
        recent = {r for r, t in self._failed.items() if now - t < FAILED_HOLD}
        ordered = [c for c in candidates if c not in recent] + [c for c in candidates if c in recent]
        tried = []
        for relay in ordered:
            try:
                await self._reserve(relay)
            except Exception as exc:  # safe: this candidate could not relay; the next may
                tried.append(f"{short_id(relay)}: {type(exc).__name__}: {str(exc)[:120]}")
                self._failed[relay] = time.monotonic()
                continue
            self._set(relay)
            return relay
        logger.warning("no relay granted a reservation (%s); trying again in %.0f s",
                       "; ".join(tried) or "no candidate: no initial peer or node offers relay service", RETRY_PERIOD)
        return None

    def _set(self, relay: str | None) -> None:
        if relay == self.relay:
            return
        previous, self.relay = self.relay, relay
        self.changes += 1
        if relay is not None:
            logger.info("reachable through relay %s%s", short_id(relay),
                        f" (was {short_id(previous)})" if previous else "")
        self.on_change(relay)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a reservation until `stop` is set."""
        while not stop.is_set():
            if self.relay is None:
                await self.acquire()
            else:
                try:
                    await self._reserve(self.relay)
                except Exception as exc:  # safe: the relay is gone or refuses; the next candidate is asked now
                    logger.warning("relay %s stopped relaying for this node (%s): reserving with another",
                                   short_id(self.relay), exc)
                    self._failed[self.relay] = time.monotonic()
                    self._set(None)
                    await self.acquire()
            try:
                await asyncio.wait_for(stop.wait(), self.renew if self.relay is not None else RETRY_PERIOD)
            except asyncio.TimeoutError:
                pass
