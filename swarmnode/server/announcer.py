"""Publishing a node's serving records to the DHT on a heartbeat, with an expiration.

Each block of the span gets a `ServerRecord` under `{prefix}.block.{i}`, subkey = the node's peer id.
Records expire after `SERVER_RECORD_TTL` unless refreshed, so a node that dies silently disappears from
clients' routes within that time; a node that stops cleanly announces OFFLINE first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarmnode.records import HEARTBEAT_INTERVAL, SERVER_RECORD_TTL, ServerRecord, block_key

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(self, dht: DHT, prefix: str, record: Callable[[], ServerRecord], *,
                 interval: float = HEARTBEAT_INTERVAL, ttl: float = SERVER_RECORD_TTL):
        self.dht, self.prefix, self.record = dht, prefix, record
        self.interval, self.ttl = interval, ttl
        self.subkey = dht.peer_id.to_base58()

    async def announce(self, record: ServerRecord | None = None, ttl: float | None = None) -> bool:
        record = record or self.record()
        expiration = get_dht_time() + (ttl or self.ttl)
        futures = [
            self.dht.store(block_key(self.prefix, i), subkey=self.subkey, value=record.to_dict(),
                           expiration_time=expiration, return_future=True)
            for i in range(record.start, record.end)
        ]
        results = await asyncio.gather(*futures, return_exceptions=True)
        stored = sum(1 for r in results if r is True)
        if stored < len(results):
            logger.warning("announced %d of %d block records (%s)", stored, len(results), record.state.value)
        return stored == len(results)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.announce()
            except Exception:
                logger.exception("heartbeat failed; retrying in %.0f s", self.interval)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
