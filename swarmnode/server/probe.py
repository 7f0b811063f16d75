"""Measuring a node's links to the other nodes: round trip and bandwidth over the P2P stream.

Round trip: the best of three empty `ping`s. Bandwidth: a `probe` RPC carrying `payload` bytes, timed,
less one round trip. Probes go to one peer at a time with a pause between them, each peer at most once
per `interval`, so measuring never floods a link (and peers rate-limit probes on their side too). The
coordinator turns these figures into the planner's link capacities (Helix §4.3).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from hivemind.proto import runtime_pb2

from swarmnode import messages
from swarmnode.planner.naming import short_id
from swarmnode.records import LinkMeasurement

logger = logging.getLogger(__name__)

PROBE_PAYLOAD = 256 * 1024
PROBE_INTERVAL = 300.0
PROBE_PAUSE = 0.5


class LinkProber:
    def __init__(self, p2p, own_id: str, *, payload: int = PROBE_PAYLOAD, interval: float = PROBE_INTERVAL):
        if not 0 < payload <= messages.MAX_PROBE_BYTES:
            raise ValueError(f"probe payload must be 1..{messages.MAX_PROBE_BYTES} bytes")
        self.p2p, self.own_id = p2p, own_id
        self.payload, self.interval = payload, interval
        self.links: dict[str, LinkMeasurement] = {}
        self._measured_at: dict[str, float] = {}

    async def measure(self, peer: str) -> LinkMeasurement | None:
        try:
            rtt = min([await messages.timed_call(self.p2p, peer, messages.RPC_PING, timeout=5.0)
                       for _ in range(3)])
            blob = messages.serialize_tensors([torch.zeros(self.payload, dtype=torch.uint8)])
            elapsed = await messages.timed_call(self.p2p, peer, messages.RPC_PROBE,
                                                runtime_pb2.ExpertRequest(tensors=blob), timeout=30.0)
        except Exception as exc:  # safe: an unreachable or failing peer just has no measured link this round
            logger.debug("probing %s failed: %s", short_id(peer), exc)
            return None
        bandwidth = self.payload * 8 / max(elapsed - rtt, 1e-4) / 1e6
        return LinkMeasurement(rtt_ms=round(rtt * 1000, 3), bandwidth_mbps=round(min(bandwidth, 1e7), 1))

    async def run(self, stop: asyncio.Event, peers) -> None:
        """Probe `peers()` (an async callable returning peer ids) until `stop`, newest peers first."""
        while not stop.is_set():
            try:
                current = [p for p in await peers() if p != self.own_id]
            except Exception as exc:  # safe: a failed DHT read means no peers to probe until the next round
                logger.debug("could not list peers to probe: %s", exc)
                current = []
            for gone in set(self.links) - set(current):
                self.links.pop(gone, None)
                self._measured_at.pop(gone, None)
            now = time.monotonic()
            due = sorted((p for p in current if now - self._measured_at.get(p, -1e9) > self.interval),
                         key=lambda p: self._measured_at.get(p, -1e9))
            for peer in due:
                if stop.is_set():
                    return
                link = await self.measure(peer)
                self._measured_at[peer] = time.monotonic()
                if link is not None:
                    self.links[peer] = link
                    logger.info("link to %s: rtt %.1f ms, %.0f Mbps", short_id(peer), link.rtt_ms, link.bandwidth_mbps)
                await asyncio.sleep(PROBE_PAUSE)
            try:
                await asyncio.wait_for(stop.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
