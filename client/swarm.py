"""The client's view of the swarm: live peers from the DHT, their measured RTTs, and the peers it bans.

Records are read from `{prefix}.block.{i}` and validated (`swarmnode.records`); malformed ones are logged
and skipped. A peer that fails is banned with exponential back-off, so a flaky peer is retried later but
not hammered. RTTs are measured with the `ping` RPC and smoothed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from swarmnode.client.loop import LoopThread
from swarmnode.client.routing import Hop, PeerSpan, shortest_route

from swarmnode import messages
from swarmnode.records import ServerRecord, ServerState, block_key, parse_record

logger = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    """Timeouts (seconds) and retry policy of a client; see docs/operations.md."""

    connect_timeout: float = 30.0  # joining the DHT
    request_timeout: float = 60.0  # one step or RPC, compute and transfer included
    update_period: float = 15.0  # refresh of the DHT view
    max_retries: int = 8  # failed attempts of one step before giving up
    ban_base: float = 5.0  # first ban; doubles per repeated failure
    ban_max: float = 300.0
    exclude_peers: frozenset[str] = frozenset()  # never route through these


@dataclass
class _Ban:
    until: float
    failures: int


@dataclass
class SwarmView:
    dht: object
    p2p: object
    loop: LoopThread
    prefix: str
    num_blocks: int
    config: ClientConfig = field(default_factory=ClientConfig)

    def __post_init__(self):
        self.spans: dict[str, PeerSpan] = {}
        self.rtts: dict[str, float] = {}
        self._bans: dict[str, _Ban] = {}
        self._updated = 0.0

    # --- DHT -----------------------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._updated < self.config.update_period:
            return
        futures = [self.dht.get(block_key(self.prefix, i), latest=True, return_future=True)
                   for i in range(self.num_blocks)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        spans: dict[str, PeerSpan] = {}
        for result in results:
            if isinstance(result, BaseException) or result is None or not isinstance(result.value, dict):
                continue
            for subkey, item in result.value.items():
                record = parse_record(ServerRecord, getattr(item, "value", None), what=f"server record of {subkey}")
                if record is None or record.state != ServerState.ONLINE or record.end > self.num_blocks:
                    continue
                spans[str(subkey)] = PeerSpan(str(subkey), record.start, record.end, record.throughput,
                                              record.free_cache_tokens)
        self.spans = spans
        self._updated = time.monotonic()
        await self._measure_rtts([p for p in spans if p not in self.rtts])

    async def _measure_rtts(self, peers: list[str]) -> None:
        async def ping(peer: str) -> None:
            began = time.perf_counter()
            try:
                await asyncio.wait_for(
                    self.p2p.call_protobuf_handler(PeerID.from_base58(peer), messages.RPC_PING,
                                                   runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse),
                    timeout=5.0,
                )
                self.rtts[peer] = time.perf_counter() - began
            except Exception as exc:
                logger.debug("ping to %s failed: %s", peer[-6:], exc)

        await asyncio.gather(*(ping(p) for p in peers))

    # --- bans ----------------------------------------------------------------------------------------
    def ban(self, peer: str, reason: str) -> None:
        previous = self._bans.get(peer)
        failures = previous.failures + 1 if previous else 1
        duration = min(self.config.ban_base * 2 ** (failures - 1), self.config.ban_max)
        self._bans[peer] = _Ban(time.monotonic() + duration, failures)
        logger.warning("banning peer %s for %.0f s: %s", peer[-8:], duration, reason)

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p for p, b in self._bans.items() if b.until > now) | self.config.exclude_peers

    # --- routes --------------------------------------------------------------------------------------
    async def route(self, start: int, end: int, min_cache_tokens: int = 0) -> list[Hop]:
        await self.refresh()
        try:
            return shortest_route(self.spans.values(), start, end, rtts=self.rtts, banned=self.banned(),
                                  min_cache_tokens=min_cache_tokens)
        except Exception:
            await self.refresh(force=True)  # the view may be stale: look again before giving up
            return shortest_route(self.spans.values(), start, end, rtts=self.rtts, banned=self.banned(),
                                  min_cache_tokens=min_cache_tokens)
