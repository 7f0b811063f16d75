"""Following the coordinator's placement: load the assigned range, then let go of the old one safely.

Every `POLL` seconds the node reads the newest placement signed by a trusted coordinator key (others are
ignored and logged once, with the reason). When its assignment differs from what it serves, it takes one
step at a time toward it:

- If memory allows holding both (`MemoryPlan.side_by_side`: the overhead, the weights held, those of the
  new range's other blocks, the cache in use and some cache for the new range fit the offer), it loads
  the new range first (sharing the overlap) and serves both for a while; otherwise it first waits until
  every block of the old range has another live replica, then retires the old range and loads the new one.
- An older range is retired only when each block it alone holds has another ONLINE replica in the swarm:
  a node never drops the last live replica of a block. Retiring stops announcing the blocks, lets open
  sessions finish (up to `DRAIN_TIMEOUT`; clients of sessions still open then fail over and replay),
  and frees the memory (off the event loop: the node answers RPCs meanwhile).

While loading, the node's capacity record says LOADING with progress, and no serving record is ONLINE
for the new range, so clients do not route to it early.

The follower changes the node's `NodeStatus` (`server.node_status`: units, assignment, state, note) and asks
the rest of the node for what only it can do through `FollowerHost` (loading a range, reading the swarm's
records, pinging peers, switching phase); it never reaches into `server.node.Node` itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from swarmnode.naming import short_id
from swarmnode.records import NodeState, Phase, PlacementRecord, ServerRecord, ServerState
from swarmnode.server.announcer import block_ranges
from swarmnode.server.memory_plan import TRANSITION_CACHE_TOKENS, MemoryPlan
from swarmnode.server.node_status import NodeStatus
from swarmnode.server.unit import ServingUnit
from swarmnode.swarm_state import Rejected

logger = logging.getLogger(__name__)

# How long a peer that would be the only other replica of blocks this node drops may take to answer a ping.
REPLICA_PING_TIMEOUT = 2.0

POLL = 2.0
DRAIN_TIMEOUT = 15.0


class FollowerHost(Protocol):
    """What the placement follower may ask of the node that runs it (`server.node.Node` is one)."""

    @property
    def peer_id(self) -> str:
        """This node's peer id (the key of its assignment in a placement)."""
        ...

    @property
    def memory(self) -> MemoryPlan:
        """The node's current memory plan (it changes when the overhead is measured again)."""
        ...

    async def aload_unit(self, start: int, end: int, *, cache_tokens: int | None = None,
                         reuse: ServingUnit | None = None) -> ServingUnit:
        """Load blocks [start, end) off the event loop (not yet added to the node's units)."""
        ...

    def set_phase(self, phase: Phase | str, why: str) -> None:
        """Serve `phase` from now on."""
        ...

    async def read_placement(self, trusted: frozenset[str], rejected: list[Rejected]) -> PlacementRecord | None:
        """The newest placement signed by one of `trusted`; the others go to `rejected`."""
        ...

    async def read_block_servers(self) -> dict[int, list[ServerRecord]]:
        """The swarm's serving records, by block."""
        ...

    async def answering(self, peers: list[str], timeout: float) -> set[str]:
        """The peers of `peers` that answer a ping within `timeout` s (all of them when it cannot ping yet)."""
        ...


class PlacementFollower:
    def __init__(self, host: FollowerHost, status: NodeStatus, trusted: frozenset[str], *,
                 phase: Phase, phase_pinned: bool):
        """`phase`: the phase the node was started with; `phase_pinned`: the operator chose it (`join --phase`),
        so a two-phase placement does not change it."""
        self.host = host
        self.status = status
        self.trusted = trusted
        self.phase = phase
        self.phase_pinned = phase_pinned
        self.placement: PlacementRecord | None = None
        self._logged: set[tuple] = set()
        self._waiting_logged: str = ""
        # the note written while a moved node still serves its old range beside the new one (`_move`): kept
        # as long as both are held, replaced by the plain serving note otherwise
        self._keeping_note: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # safe: one failed step (a DHT read, a range that cannot load) is logged and retried
                logger.exception("following the placement failed; retrying in %.0f s", POLL)
            try:
                await asyncio.wait_for(stop.wait(), POLL)
            except asyncio.TimeoutError:
                pass

    def _log_rejections(self, rejected: list[Rejected]) -> None:
        for item in rejected:
            version = getattr(item.record, "version", None)
            marker = (item.owner, version, item.why)
            if marker not in self._logged and "placement" in item.why:
                self._logged.add(marker)
                logger.warning("ignoring %s", item.why)

    async def step(self) -> None:
        host, status = self.host, self.status
        rejected: list[Rejected] = []
        placement = await host.read_placement(self.trusted, rejected)
        self._log_rejections(rejected)
        if placement is None:
            return
        if self.placement is None or placement.order != self.placement.order:
            logger.info("placement v%d by coordinator %s (%s, key %s): %s", placement.version,
                        short_id(placement.coordinator), placement.algorithm, short_id(next(iter(self.trusted))),
                        placement.reason)
            self.placement = placement
        status.placement_version = placement.version
        target = placement.assignments.get(host.peer_id)
        live = status.live_units()
        if target is None:
            status.assigned = None
            if live:
                note = (f"not in placement v{placement.version}: keeps serving "
                        f"{', '.join(str(list(u.span)) for u in live)} as an extra replica")
                await self._retire_extras(live[:-1], keep=live[-1].span)
            else:
                why = placement.unused.get(host.peer_id)
                note = (f"not used by placement v{placement.version}: {why}" if why else
                        f"not used by placement v{placement.version}; waiting for a later one")
            if note != status.note:
                status.set_state(status.state if live else NodeState.WAITING, note)
            return
        target = (target[0], target[1])  # a tuple, as spans are
        status.assigned = target
        self._follow_phase(placement)
        newest = live[-1] if live else None
        if newest is not None and newest.span == target:
            await self._retire_extras(live[:-1], keep=target)
            if status.state != NodeState.ONLINE or (len(live) > 1 and status.note != self._keeping_note):
                status.set_state(NodeState.ONLINE, f"serving blocks {list(target)} (placement v{placement.version})")
            return
        if newest is None:
            await self._load(target, placement)
            return
        await self._move(newest, target, placement)

    def _follow_phase(self, placement: PlacementRecord) -> None:
        """Take the phase a two-phase placement gives this node (HexGen-2), or serve both when the placement
        gives none; a phase the operator chose (`join --phase`) is kept."""
        peer_id = self.host.peer_id
        if self.phase_pinned:
            wanted = self.phase
            given = placement.phases.get(peer_id)
            if given and given != wanted and ("phase", placement.version) not in self._logged:
                self._logged.add(("phase", placement.version))
                logger.warning("placement v%d gives this node the %s phase, but it was started with --phase %s: "
                               "keeping %s", placement.version, given, wanted, wanted)
            return
        self.host.set_phase(placement.phases.get(peer_id, self.phase),
                            f"placement v{placement.version} ({placement.algorithm})")

    # --- steps ---------------------------------------------------------------------------------------
    async def _load(self, target: tuple[int, int], placement: PlacementRecord, *,
                    cache_tokens: int | None = None, reuse: ServingUnit | None = None) -> ServingUnit:
        unit = await self.host.aload_unit(*target, cache_tokens=cache_tokens, reuse=reuse)
        self.status.add_unit(unit)
        self.status.set_state(NodeState.ONLINE, f"serving blocks {list(target)} (placement v{placement.version})")
        return unit

    async def _move(self, old: ServingUnit, target: tuple[int, int], placement: PlacementRecord) -> None:
        held = [u for u in self.status.units if not u.closed]
        both = self.host.memory.side_by_side([u.span for u in held], sum(u.budget.used_block_tokens for u in held),
                                             old.span, old.budget.used_block_tokens, target)
        if both is not None:
            old.budget.resize(both.old_tokens)
            logger.info("moving to blocks %s while still serving %s (memory allows both)", list(target),
                        list(old.span))
            unit = await self._load(target, placement, cache_tokens=both.new_tokens, reuse=old)
            self.status.note = self._keeping_note = (
                f"serving blocks {list(target)} (placement v{placement.version}); "
                f"keeping {list(old.span)} until its blocks have another replica")
            await self._retire_extras([old], keep=target)
            if old.closed:
                unit.budget.resize(self.host.memory.cache_tokens(*unit.span))
            return
        await self._move_in_place(old, target, placement)

    async def _move_in_place(self, old: ServingUnit, target: tuple[int, int], placement: PlacementRecord) -> None:
        """A move for which memory does not hold both ranges."""
        status = self.status
        old_blocks = set(range(*old.span))
        # Memory does not hold both: drop the blocks the new range does not need (once each has another
        # live replica), keep serving the overlap from the tensors already in memory, then load the rest.
        missing = await self._without_other_replica(old_blocks - set(range(*target)))
        if missing:
            note = (f"assigned blocks {list(target)} by placement v{placement.version}, but memory does not hold "
                    f"both ranges: keeps serving {list(old.span)} until blocks {block_ranges(missing)} have another "
                    f"live replica")
            if note != status.note:
                status.set_state(status.state, note)
            return
        overlap = (max(old.start, target[0]), min(old.end, target[1]))
        if overlap[0] < overlap[1] and overlap != old.span:
            # shares the old range's tensors: nothing is read
            keep = await self.host.aload_unit(*overlap, cache_tokens=TRANSITION_CACHE_TOKENS, reuse=old)
            status.add_unit(keep)
            status.set_state(NodeState.ONLINE, f"narrowing to blocks {list(overlap)} before loading {list(target)}")
            await self._retire(old)
            old = keep
        elif overlap[0] >= overlap[1]:
            await self._retire(old)
        tokens = self.host.memory.cache_tokens_beside(target, old.span, old.budget.tokens) if old.live else None
        await self._load(target, placement, reuse=old, cache_tokens=tokens)

    async def _retire_extras(self, units: list[ServingUnit], keep: tuple[int, int]) -> None:
        keep_blocks = set(range(*keep))
        for unit in units:
            dropped = set(range(*unit.span)) - keep_blocks
            missing = await self._without_other_replica(dropped)
            if missing:
                note = (f"keeping blocks {block_ranges(missing)} of {list(unit.span)} until they have another live "
                        f"replica")
                if note != self._waiting_logged:
                    self._waiting_logged = note
                    logger.info("%s", note)
                continue
            await self._retire(unit)
            remaining = self.status.live_units()
            if len(remaining) == 1:
                remaining[0].budget.resize(self.host.memory.cache_tokens(*remaining[0].span))

    async def _without_other_replica(self, blocks: set[int]) -> list[int]:
        """Blocks (of `blocks`) that no other live peer serves ONLINE right now. A record alone is not
        enough: a SIGKILLed peer's records say ONLINE until they expire (up to 30 s), so the peers that
        would be the only other replica must answer a ping too; otherwise dropping the blocks would leave
        them with no live replica at all."""
        if not blocks:
            return []
        me = self.host.peer_id
        servers = await self.host.read_block_servers()
        holders = {b: {r.peer_id for r in servers.get(b, []) if r.peer_id != me
                       and r.state == ServerState.ONLINE} for b in blocks}
        peers = sorted(set().union(*holders.values()))
        alive = await self.host.answering(peers, REPLICA_PING_TIMEOUT)
        return sorted(b for b in blocks if not holders[b] & alive)

    async def _retire(self, unit: ServingUnit) -> None:
        """Stop announcing `unit`, let its sessions finish (bounded), then free it."""
        unit.retiring = True
        self.status.changed()
        logger.info("retiring blocks %s: %d open sessions may finish within %.0f s", list(unit.span),
                    len(unit.sessions), DRAIN_TIMEOUT)
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while unit.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if unit.sessions:
            logger.info("closing %d sessions still open on blocks %s: their clients will fail over",
                        len(unit.sessions), list(unit.span))
        await unit.aclose()  # waits for a running step on a worker thread; RPCs and heartbeats go on
        self.status.remove_unit(unit)
        self.status.changed()
