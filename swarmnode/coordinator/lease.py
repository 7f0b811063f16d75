"""The coordinator lease: at most one coordinator publishes placements at a time, and a standby takes
over within a bounded time when the holder disappears.

The lease is a signed `LeaseRecord` under `{prefix}.coordinator` (subkey: the coordinator key's owner
marker) that expires `LEASE_TTL` s after its last renewal; the holder renews it every `LEASE_RENEW` s.
A standby reads it every `LEASE_POLL` s; when no trusted, unexpired lease names another holder, it
stores a claim with the next term, waits `LEASE_SETTLE` s, and reads back: it holds the lease only if
its claim is the newest `(term, holder)` there. Coordinators that share a key share one subkey, so the
DHT keeps only the claim with the latest expiration and every reader sees the same winner; coordinators
with different keys are ordered by `(term, holder)`. A holder that sees a newer lease steps down.
Bound on takeover after the holder dies: `TAKEOVER_BOUND` = LEASE_TTL + LEASE_POLL + LEASE_SETTLE.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.utils import get_dht_time

from swarmnode.naming import short_id
from swarmnode.records import LEASE_SETTLE, LEASE_TTL, LeaseRecord, coordinator_key
from swarmnode.swarm_state import read_leases, store_owned

logger = logging.getLogger(__name__)


class Lease:
    def __init__(self, dht, prefix: str, subkey: bytes, peer_id: str, trusted: frozenset[str], *,
                 algorithm: str = "", settle: float = LEASE_SETTLE, ttl: float = LEASE_TTL):
        self.dht, self.prefix, self.subkey = dht, prefix, subkey
        self.peer_id, self.trusted, self.algorithm = peer_id, trusted, algorithm
        self.settle, self.ttl = settle, ttl
        self.term = 0
        self.held = False
        self.holder: str | None = None  # who holds it, as last seen
        self.seen_term = 0

    async def _store(self, term: int) -> bool:
        record = LeaseRecord(holder=self.peer_id, term=term, renewed=get_dht_time(), algorithm=self.algorithm)
        return await store_owned(self.dht, coordinator_key(self.prefix), self.subkey, record.to_dict(), self.ttl)

    async def poll(self) -> bool:
        """Renew, claim or stand by; returns whether this coordinator holds the lease now."""
        leases = await read_leases(self.dht, self.prefix, self.trusted)
        if leases:
            self.seen_term = max(self.seen_term, leases[0].lease.term)
        others = [s for s in leases if s.lease.holder != self.peer_id]
        if self.held:
            if others and (others[0].lease.term, others[0].lease.holder) > (self.term, self.peer_id):
                logger.warning("coordinator %s holds a newer lease (term %d): standing by", short_id(others[0].lease.holder),
                               others[0].lease.term)
                self.held, self.holder = False, others[0].lease.holder
                return False
            if not await self._store(self.term):
                logger.warning("could not renew the coordinator lease; will retry")
            return True
        if others:
            if self.holder != others[0].lease.holder:
                logger.info("coordinator %s holds the lease (term %d); standing by", short_id(others[0].lease.holder),
                            others[0].lease.term)
            self.holder = others[0].lease.holder
            return False
        term = self.seen_term + 1
        logger.info("no live coordinator lease: claiming term %d", term)
        await self._store(term)
        await asyncio.sleep(self.settle)
        leases = await read_leases(self.dht, self.prefix, self.trusted)
        if leases and leases[0].lease.holder == self.peer_id and leases[0].lease.term == term:
            self.held, self.term, self.holder = True, term, self.peer_id
            logger.info("holding the coordinator lease (term %d)", term)
            return True
        if leases:
            self.holder = leases[0].lease.holder
            logger.info("coordinator %s won the lease (term %d)", short_id(leases[0].lease.holder), leases[0].lease.term)
        return False
