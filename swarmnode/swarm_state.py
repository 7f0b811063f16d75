"""Reading the swarm's state from the DHT: serving records, capacity records, placements, leases, reports.

One place that fetches, validates (`swarmnode.records`) and filters by signer (`swarmnode.identity`), used
by nodes, coordinators, clients and `swarmnode status`, and that gives the state its JSON shape
(`state_dict`, for `swarmnode status --json` and the API server's dashboard). Only subkeys with an owner
marker are read: the DHT's signature validator has checked those were written by that key. A node or server
record counts only when that key is the identity key of the peer it names (a node signs with its libp2p
identity), so no peer can announce itself as another. A placement or lease is trusted only when its signer is
in the reader's trusted keys; the others are returned as rejections, with why,
so callers can log them. In a private swarm (`members`, `swarmnode.membership`), node and server records of
peers not admitted as nodes are refused too: coordinators never plan them, clients never route to them. Reports (a client saw a peer's outputs diverge) are read from anyone, grouped by
the accused peer; what counts is how many distinct keys reported it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hivemind.utils import get_dht_time

from swarmnode.admission import Role
from swarmnode.identity import owner_of, peer_id_of_key
from swarmnode.naming import short_id
from swarmnode.records import (
    LeaseRecord,
    NodeRecord,
    PlacementRecord,
    ReportRecord,
    ServerRecord,
    ServerState,
    block_key,
    coordinator_key,
    nodes_key,
    parse_record,
    placement_key,
    reported_peer,
    reports_key,
)

if TYPE_CHECKING:
    from swarmnode.membership import Membership

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rejected:
    """A record a reader refused: who signed it (public key) and why it was refused."""

    owner: str | None
    why: str
    record: Any = None


@dataclass(frozen=True)
class SignedLease:
    lease: LeaseRecord
    owner: str
    expiration: float


@dataclass(frozen=True)
class SignedReport:
    """A report and the public key that signed it (one reporter: one key)."""

    report: ReportRecord
    owner: str
    expiration: float


@dataclass
class SwarmState:
    """A snapshot: nodes by peer id, serving records per block, the newest trusted placement, leases, and
    reports of diverging outputs by accused peer id."""

    nodes: dict[str, NodeRecord]
    blocks: dict[int, list[ServerRecord]]
    placement: PlacementRecord | None
    leases: list[SignedLease]
    rejected: list[Rejected]
    read_at: float
    reports: dict[str, list[SignedReport]] = field(default_factory=dict)

    def replicas(self, num_blocks: int, *, online_only: bool = True) -> list[int]:
        """How many peers serve each block (ONLINE ones only by default)."""
        counts = []
        for block in range(num_blocks):
            records = self.blocks.get(block, [])
            counts.append(sum(1 for r in records if not online_only or r.state == ServerState.ONLINE))
        return counts


def state_dict(state: SwarmState, num_blocks: int, prefix: str, model: str | None = None) -> dict:
    """The swarm's state as JSON-ready data: the shape of `swarmnode status --json` and of the API server's
    `/api/v1/state` (the dashboard's feed). `model`: the model's name in the swarm, where the reader knows it."""
    placement = state.placement
    replicas = state.replicas(num_blocks)
    return {
        "model": model,
        "prefix": prefix,
        "num_blocks": num_blocks,
        "placement": None if placement is None else placement.to_dict(),
        "coordinators": [{"holder": s.lease.holder, "term": s.lease.term, "algorithm": s.lease.algorithm,
                          "expires_in": round(s.expiration - state.read_at, 1)} for s in state.leases],
        "nodes": {peer: record.to_dict() for peer, record in sorted(state.nodes.items())},
        "replicas": replicas,
        "uncovered_blocks": [b for b, n in enumerate(replicas) if n == 0],
        # the redundancy the placement asked for, what it could not give, and what is short of it right now
        "min_replicas": 1 if placement is None else placement.min_replicas,
        "single_points": [] if placement is None else [list(r) for r in placement.single_points],
        "under_replicated_blocks": [] if placement is None else
        [b for b, n in enumerate(replicas) if 0 < n < placement.min_replicas],
        "unused": {} if placement is None else dict(sorted(placement.unused.items())),
        "rejected": [{"owner": r.owner, "why": r.why} for r in state.rejected],
        "reports": {peer: _reports_dict(reports, state.read_at) for peer, reports in sorted(state.reports.items())},
    }


def _reports_dict(reports, now: float) -> dict:
    """What clients reported about one peer: how many distinct reporters, the worst difference, each report."""
    return {
        "reporters": len({r.owner for r in reports}),
        "max_diff": max(r.report.max_diff for r in reports),
        "tolerance": min(r.report.tolerance for r in reports),
        "reasons": sorted({r.report.reason for r in reports}),
        "blocks": sorted({(r.report.start, r.report.end) for r in reports}),
        "items": [{**r.report.to_dict(), "owner": r.owner, "expires_in": round(r.expiration - now, 1)}
                  for r in reports],
    }


async def read_items(dht, key: str, timeout: float | None = None) -> dict:
    """The subkey -> (value, expiration) items under `key`; empty when absent, unreadable or not read within
    `timeout` s."""
    try:
        result = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except Exception as exc:  # safe: an unreadable key reads as empty, as an absent one; readers retry later
        logger.debug("DHT get %s failed: %s", key, exc)
        return {}
    if result is None or not isinstance(result.value, dict):
        return {}
    return result.value


def _owned(items: dict, schema, what: str, rejected: list[Rejected]):
    """(record, owner, expiration) for every owner-marked subkey whose value fits `schema`."""
    out = []
    for subkey, item in items.items():
        owner = owner_of(subkey)
        if owner is None:
            rejected.append(Rejected(None, f"unsigned {what} under subkey {str(subkey)[:40]!r}"))
            continue
        record = parse_record(schema, getattr(item, "value", None), what=f"{what} signed by {short_id(owner)}")
        if record is None:
            rejected.append(Rejected(owner, f"malformed {what}"))
            continue
        out.append((record, owner, float(getattr(item, "expiration_time", 0.0))))
    return out


def _bound(items: dict, schema, what: str, rejected: list[Rejected], members: Membership | None = None):
    """`_owned` for records that name their writer's peer id (node and server records): only those signed by
    that peer's own identity key, so no peer can announce itself as another (`identity.peer_id_of_key`), and in
    a private swarm only those of peers admitted as nodes."""
    out = []
    for record, owner, expiration in _owned(items, schema, what, rejected):
        signer = peer_id_of_key(owner)
        if signer != record.peer_id:
            rejected.append(Rejected(owner, f"{what} claims peer {short_id(record.peer_id)} but is signed by the "
                                            f"key of peer {short_id(signer or '?')}", record))
            continue
        if members is not None and not members.admits(record.peer_id, Role.NODE):
            rejected.append(Rejected(owner, f"{what} of {members.why_not(record.peer_id, [Role.NODE])}", record))
            continue
        out.append((record, owner, expiration))
    return out


async def _learn(members: Membership | None, results: list[dict]) -> None:
    """Let `members` read the swarm's members again when records name peers it does not know yet."""
    if members is None:
        return
    peers = set()
    for items in results:
        for subkey in items:
            owner = owner_of(subkey)
            peer = peer_id_of_key(owner) if owner is not None else None
            if peer is not None:
                peers.add(peer)
    await members.learn(peers)


async def read_block_servers(dht, prefix: str, num_blocks: int,
                             members: Membership | None = None) -> dict[int, list[ServerRecord]]:
    results = await asyncio.gather(*(read_items(dht, block_key(prefix, i)) for i in range(num_blocks)))
    await _learn(members, results)
    rejected: list[Rejected] = []
    blocks: dict[int, list[ServerRecord]] = {}
    for block, items in enumerate(results):
        latest: dict[str, tuple[float, ServerRecord]] = {}
        for record, _owner, expiration in _bound(items, ServerRecord, f"server record of block {block}", rejected,
                                                 members):
            fits = record.start <= block < record.end <= num_blocks
            if fits and (record.peer_id not in latest or latest[record.peer_id][0] < expiration):
                latest[record.peer_id] = (expiration, record)
        blocks[block] = [r for _e, r in latest.values()]
    return blocks


async def read_nodes(dht, prefix: str, rejected: list[Rejected] | None = None,
                     members: Membership | None = None) -> dict[str, NodeRecord]:
    rejected = [] if rejected is None else rejected
    latest: dict[str, tuple[float, NodeRecord]] = {}
    items = await read_items(dht, nodes_key(prefix))
    await _learn(members, [items])
    for record, _owner, expiration in _bound(items, NodeRecord, "node record", rejected, members):
        if record.peer_id not in latest or latest[record.peer_id][0] < expiration:
            latest[record.peer_id] = (expiration, record)
    return {peer: record for peer, (_e, record) in latest.items()}


async def read_placement(dht, prefix: str, trusted: frozenset[str],
                         rejected: list[Rejected] | None = None) -> PlacementRecord | None:
    """The newest placement signed by a trusted key; others go to `rejected` with the reason."""
    rejected = [] if rejected is None else rejected
    best: PlacementRecord | None = None
    for record, owner, _exp in _owned(await read_items(dht, placement_key(prefix)), PlacementRecord, "placement", rejected):
        if owner not in trusted:
            rejected.append(Rejected(owner, f"placement v{record.version} by {short_id(record.coordinator)} is signed "
                                            f"by untrusted key {short_id(owner)}", record))
            continue
        if best is None or record.order > best.order:
            best = record
    return best


async def read_leases(dht, prefix: str, trusted: frozenset[str],
                      rejected: list[Rejected] | None = None) -> list[SignedLease]:
    """Unexpired leases signed by trusted keys, newest term first."""
    rejected = [] if rejected is None else rejected
    now = get_dht_time()
    leases = []
    for record, owner, expiration in _owned(await read_items(dht, coordinator_key(prefix)), LeaseRecord, "lease", rejected):
        if owner not in trusted:
            rejected.append(Rejected(owner, f"lease of {short_id(record.holder)} signed by untrusted key "
                                            f"{short_id(owner)}", record))
        elif expiration > now:
            leases.append(SignedLease(record, owner, expiration))
    return sorted(leases, key=lambda s: (s.lease.term, s.lease.holder), reverse=True)


async def read_reports(dht, prefix: str, rejected: list[Rejected] | None = None) -> dict[str, list[SignedReport]]:
    """Unexpired reports by accused peer id, newest first: one per (reporter key, peer). A report whose
    subkey names another peer than its value accuses is refused (it could not have been written that way
    by `report_subkey`, so something is off with it)."""
    rejected = [] if rejected is None else rejected
    now = get_dht_time()
    items = await read_items(dht, reports_key(prefix))
    by_peer: dict[str, dict[str, SignedReport]] = {}
    for subkey, item in items.items():
        for record, owner, expiration in _owned({subkey: item}, ReportRecord, "report", rejected):
            if reported_peer(subkey) != record.peer_id:
                rejected.append(Rejected(owner, f"report about {short_id(record.peer_id)} filed under a subkey naming "
                                                f"{short_id(str(reported_peer(subkey)))}", record))
                continue
            if expiration <= now:
                continue
            mine = by_peer.setdefault(record.peer_id, {})
            if owner not in mine or mine[owner].report.created < record.created:
                mine[owner] = SignedReport(record, owner, expiration)
    return {peer: sorted(reports.values(), key=lambda r: r.report.created, reverse=True)
            for peer, reports in by_peer.items()}


async def read_state(dht, prefix: str, num_blocks: int, trusted: frozenset[str],
                     members: Membership | None = None) -> SwarmState:
    rejected: list[Rejected] = []
    nodes, blocks, placement, leases, reports = await asyncio.gather(
        read_nodes(dht, prefix, rejected, members), read_block_servers(dht, prefix, num_blocks, members),
        read_placement(dht, prefix, trusted, rejected), read_leases(dht, prefix, trusted, rejected),
        read_reports(dht, prefix, rejected),
    )
    return SwarmState(nodes, blocks, placement, leases, rejected, get_dht_time(), reports)


async def store_owned(dht, key: str, subkey: bytes, value: dict, ttl: float) -> bool:
    """Store a record under our owner-marked subkey; the DHT's validator signs it."""
    return bool(await dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + ttl,
                                return_future=True))
