"""Publishing a node's records to the DHT on a heartbeat, with an expiration.

Two kinds of record, both under the node's owner-marked subkey (only this node can write them):
- a `NodeRecord` under `{prefix}.nodes`: its offer, measurements, state, assigned and loaded ranges;
- a `ServerRecord` under `{prefix}.block.{i}` for every block it serves (the newest range wins where two
  overlap), which is what clients route by.

Records expire unless refreshed, so a node that dies silently disappears within the TTL; blocks the node
stopped serving are announced OFFLINE at once, and a node that stops cleanly announces OFFLINE first.
`wake()` makes the next heartbeat happen now (state changes, loading progress).

The DHT keeps, per subkey, the value that expires last and rejects a store that would expire sooner
(hivemind's `DictionaryDHTValue`: "rejected (current value is newer)"). An OFFLINE record therefore
expires after every record this node stored before it (`_offline_ttl`), or it is refused and the node
looks online until its last heartbeat's record expires (a stopping node logged "announced 0 of N
records (offline)"). A node restarted with the same identity stores its first records seconds later,
so they expire after the OFFLINE ones and replace them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.identity import owner_marker
from swarmnode.records import (
    HEARTBEAT_INTERVAL,
    NODE_RECORD_TTL,
    SERVER_RECORD_TTL,
    NodeRecord,
    ServerRecord,
    ServerState,
    block_key,
    nodes_key,
)
from swarmnode.swarm_state import store_owned

logger = logging.getLogger(__name__)

OFFLINE_TTL = 10.0


class Announcer:
    def __init__(self, dht: DHT, prefix: str, key: RSAPrivateKey, *,
                 server_records: Callable[[], list[ServerRecord]], node_record: Callable[[], NodeRecord],
                 interval: float = HEARTBEAT_INTERVAL, ttl: float = SERVER_RECORD_TTL):
        self.dht, self.prefix = dht, prefix
        self.server_records, self.node_record = server_records, node_record
        self.interval, self.ttl = interval, ttl
        self.subkey = owner_marker(key)
        self._announced: set[int] = set()
        self._latest = 0.0  # the latest expiration (DHT time) of any record stored so far
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Ask for an announcement now; safe to call from any thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _offline_ttl(self, ttl: float) -> float:
        """A TTL of at least `ttl` whose expiration comes after every record stored so far (see the module
        docstring), so that the DHT takes the OFFLINE record over the online one."""
        return max(ttl, self._latest - get_dht_time() + 1.0)

    async def announce(self, *, offline: bool = False, ttl: float | None = None) -> bool:
        ttl = ttl or self.ttl
        gone_ttl = self._offline_ttl(OFFLINE_TTL)  # for OFFLINE records: after every record stored so far
        if offline:
            ttl = self._offline_ttl(ttl)
        per_block: dict[int, ServerRecord] = {}
        for record in self.server_records():  # oldest first: a newer range overrides an overlap
            if offline:
                record = record.model_copy(update={"state": ServerState.OFFLINE})
            for block in range(record.start, record.end):
                per_block[block] = record
        stores = [store_owned(self.dht, block_key(self.prefix, b), self.subkey, r.to_dict(), ttl)
                  for b, r in per_block.items()]
        dropped = sorted(self._announced - set(per_block))
        if dropped:
            logger.info("announcing blocks %s offline: this node no longer serves them", block_ranges(dropped))
        for block in dropped:
            gone = ServerRecord(state=ServerState.OFFLINE, peer_id=str(self.dht.peer_id), start=block,
                                end=block + 1, throughput=0.0, free_cache_tokens=0, cache_tokens=0)
            stores.append(store_owned(self.dht, block_key(self.prefix, block), self.subkey, gone.to_dict(),
                                      gone_ttl))
        node = self.node_record()
        stores.append(store_owned(self.dht, nodes_key(self.prefix), self.subkey, node.to_dict(),
                                  min(ttl, NODE_RECORD_TTL) if not offline else gone_ttl))
        self._latest = max(self._latest, get_dht_time() + max(ttl, gone_ttl if dropped or offline else 0.0))
        results = await asyncio.gather(*stores, return_exceptions=True)
        self._announced = set(per_block) if not offline else set()
        stored = sum(1 for r in results if r is True)
        if stored < len(results):
            logger.warning("announced %d of %d records (%s)", stored, len(results), node.state.value)
        return stored == len(results)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.announce()
            except Exception:  # safe: a failed heartbeat is logged and the next one retries; records outlive one miss
                logger.exception("heartbeat failed; retrying in %.0f s", self.interval)
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            await asyncio.wait(waits, timeout=self.interval, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()


def block_ranges(blocks: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    parts, start = [], None
    for i, block in enumerate(blocks):
        if start is None:
            start = block
        if i + 1 == len(blocks) or blocks[i + 1] != block + 1:
            parts.append(f"{start}-{block}" if block != start else f"{block}")
            start = None
    return ", ".join(parts)
