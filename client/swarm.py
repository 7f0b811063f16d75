"""The client's view of the swarm: live peers from the DHT, their measured RTTs, and the peers it bans.

Serving records are read from `{prefix}.block.{i}` and validated (`swarmnode.swarm_state`); malformed or
unsigned ones are skipped. A peer that fails is banned with exponential back-off, so a flaky peer is
retried later but not hammered. RTTs are measured with the `ping` RPC.

Routes: when a placement signed by a trusted coordinator exists, a whole-model route follows its max-flow
edge flows with the planner's IWRR router (Helix §5.1), masking peers whose KV cache is above the high
-water mark or short of the session's need (§5.2), and peers that are banned or not serving their
assigned range yet; otherwise (no placement, a partial route, or no usable pipeline) the
shortest-latency route over live spans, as before.

Bans: a peer that fails is banned with exponential back-off; a peer that refused a session because its
KV cache was full is only held off for `cache_hold` s, without escalating (it did nothing wrong); a peer
whose outputs a verifying client found wrong (`client.verify`) is banned for good, for every session of
this client, and reported under `{prefix}.reports`, signed with this client's key.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from swarmnode import rpc
from swarmnode.admission import Role
from swarmnode.client.errors import TRANSPORT_ERRORS, ClientConfigError, PeerNotAdmitted
from swarmnode.client.loop import LoopThread
from swarmnode.client.routing import Hop, NoRouteError, PeerSpan, shortest_route
from swarmnode.client.verify import DEFAULT_TOLERANCE
from swarmnode.errors import SwarmError
from swarmnode.naming import short_id
from swarmnode.planner.routing import DEFAULT_HIGH_WATER, RouterState, RoutingTable
from swarmnode.planner.routing import route as iwrr_route
from swarmnode.records import (
    REPORT_TTL,
    Phase,
    PlacementRecord,
    ReportRecord,
    ServerState,
    report_subkey,
    reports_key,
    served_kind,
)
from swarmnode.relay.dialer import RelayDialer
from swarmnode.swarm_state import read_block_servers, read_placement, store_owned

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from swarmnode.membership import Membership

logger = logging.getLogger(__name__)


# The longest a refresh of the client's view may wait for the DHT before it keeps the view it has.
DHT_READ_TIMEOUT = 20.0
# How long a banned peer may take to answer the ping that lifts its ban when no route avoids it.
PAROLE_PING_TIMEOUT = 1.5


# The most speculative passes in flight at once, given-up ones included (after a rejection one pass is sent until
# one is accepted whole, and given-up ones are answered before it): what a node queues for one session stays within
# `server.session.MAX_QUEUED_PUSHES`.
MAX_SPECULATIVE_PASSES = 4


@dataclass
class ClientConfig:
    """Timeouts (seconds) and retry policy of a client; see docs/operations.md."""

    connect_timeout: float = 30.0  # joining the DHT
    request_timeout: float = 60.0  # one step or RPC, compute and transfer included
    keepalive_period: float = 1.0  # while a step waits on a peer, ping it this often
    peer_silence: float = 4.0  # a peer that answers neither the step nor a keep-alive ping this long has failed
    update_period: float = 15.0  # refresh of the DHT view
    max_retries: int = 8  # failed attempts of one step before giving up
    route_wait: float = 60.0  # how long a step waits for some peer to serve missing blocks (re-plans, restarts)
    ban_base: float = 5.0  # first ban; doubles per repeated failure
    ban_max: float = 300.0
    exclude_peers: frozenset[str] = frozenset()  # never route through these
    trusted_coordinators: frozenset[str] | None = None  # placement keys to follow; None: this machine's swarm key
    use_placement: bool = True  # follow a trusted placement's flows when one exists
    high_water: float = DEFAULT_HIGH_WATER
    cache_hold: float = 2.0  # a peer whose KV cache was full is skipped this long (no escalation, no failure)
    verify: float = 0.0  # share of later steps re-run on another replica; > 0 also checks every hop's first step
    verify_tolerance: float = DEFAULT_TOLERANCE  # float32 hops: largest relative element difference still agreeing
    verify_seed: int | None = None  # seed of which steps are checked (None: a fresh one per session)
    # hidden states go node to node (True) or through the client (False); None: node to node unless verifying
    push: bool | None = None
    # HexGen-2's split: a session's prompt runs on prefill nodes, which hand its KV cache over to the decode
    # route (True); everything on one route (False); None: split when prefill-only nodes serve every block
    disaggregate: bool | None = None
    # speculative decoding (prompt lookup) with pushed hidden states: verification passes in flight at once, each
    # sent before the ones ahead of it are verified, on drafts continuing theirs (1: one pass at a time)
    speculative_passes: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.speculative_passes, bool) or not isinstance(self.speculative_passes, int) \
                or not 1 <= self.speculative_passes <= MAX_SPECULATIVE_PASSES:
            raise ClientConfigError(f"ClientConfig.speculative_passes must be a whole number from 1 (one pass at a "
                                    f"time) to {MAX_SPECULATIVE_PASSES}, got {self.speculative_passes!r}")
        for name in ("push", "disaggregate"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ClientConfigError(f"ClientConfig.{name} must be True, False or None (automatic), got {value!r}")
        if self.disaggregate and (self.push is False or self.verify > 0):
            raise ClientConfigError("ClientConfig.disaggregate=True needs hidden states pushed node to node: leave "
                                    "push and verify unset")
        for name in ("keepalive_period", "peer_silence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ClientConfigError(f"ClientConfig.{name} must be a number of seconds above 0, got {value!r}")
        if self.keepalive_period >= self.peer_silence:
            raise ClientConfigError(
                f"ClientConfig.keepalive_period ({self.keepalive_period!r} s) must be shorter than peer_silence "
                f"({self.peer_silence!r} s): a peer must get several pings before it counts as silent")
        for name in ("verify", "verify_tolerance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ClientConfigError(f"ClientConfig.{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.verify <= 1.0:
            raise ClientConfigError(f"ClientConfig.verify is the share of steps to verify, between 0 and 1 "
                                    f"(e.g. 0.25); got {self.verify!r}")
        if self.verify_tolerance <= 0:
            raise ClientConfigError(
                f"ClientConfig.verify_tolerance must be above 0, got {self.verify_tolerance!r}")
        if self.push and self.verify > 0:
            raise ClientConfigError(
                f"ClientConfig.push=True cannot go with verify={self.verify!r}: verification compares every hop's "
                f"output on the client, so its states must come back (leave push unset, or pass push=False)")
        if self.verify_seed is not None and (isinstance(self.verify_seed, bool) or not isinstance(self.verify_seed, int)):
            raise ClientConfigError(
                f"ClientConfig.verify_seed must be an integer or None, got {self.verify_seed!r}")


@dataclass
class _Ban:
    until: float
    failures: int
    reason: str = ""


@dataclass
class SwarmView:
    dht: DHT
    p2p: RelayDialer | P2P  # a plain P2P is wrapped in a RelayDialer by `__post_init__`
    loop: LoopThread
    prefix: str
    num_blocks: int
    config: ClientConfig = field(default_factory=ClientConfig)
    key: object = None  # this client's RSA key (`hivemind.utils.crypto.RSAPrivateKey`): reports are signed with it
    members: Membership | None = None  # a private swarm's members (`swarmnode.membership`): only nodes are routed to

    def __post_init__(self) -> None:
        if not isinstance(self.p2p, RelayDialer):  # peers behind NAT are called through their relays
            self.p2p = RelayDialer(self.p2p)
        self.spans: dict[tuple[str, int, int], PeerSpan] = {}
        self.phases: dict[str, Phase] = {}  # peer -> the phase it serves, when not both (HexGen-2's split)
        self.rtts: dict[str, float] = {}
        self._bans: dict[str, _Ban] = {}
        self._updated = 0.0
        self.placement: PlacementRecord | None = None
        self._table: RoutingTable | None = None
        self._router = RouterState()
        self._cache_load: dict[str, float] = {}
        self.plan_routes = 0  # routes that followed the placement's flows (for tests and metrics)
        self.diverged: dict[str, ReportRecord] = {}  # peers caught returning wrong outputs (banned for good)
        self.reports_stored = 0
        # a private swarm's members are read every heartbeat on the client's loop (the future keeps the task
        # referenced; stopping the loop cancels it)
        self._members_run = (asyncio.run_coroutine_threadsafe(self.members.run(), self.loop.loop)
                             if self.members is not None else None)
        if self.config.trusted_coordinators is None:
            from swarmnode.identity import load_trusted_keys

            self.config.trusted_coordinators = load_trusted_keys(None, create=False)

    # --- DHT -----------------------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._updated < self.config.update_period:
            return
        try:
            blocks, placement = await asyncio.wait_for(asyncio.gather(
                read_block_servers(self.dht, self.prefix, self.num_blocks, self.members),
                read_placement(self.dht, self.prefix, self.config.trusted_coordinators)
                if self.config.use_placement and self.config.trusted_coordinators else _none(),
            ), DHT_READ_TIMEOUT)
        except asyncio.TimeoutError:  # a slow DHT must not hold a step: route with the view we have, retry later
            logger.warning("reading the swarm from the DHT took over %.0f s; keeping the previous view",
                           DHT_READ_TIMEOUT)
            return
        spans: dict[tuple[str, int, int], PeerSpan] = {}
        phases: dict[str, Phase] = {}
        self._cache_load = {}
        for records in blocks.values():
            for record in records:
                if record.state != ServerState.ONLINE:
                    continue
                self.p2p.learn({record.peer_id: record.relay})
                if record.phase != Phase.BOTH:
                    phases[record.peer_id] = Phase(record.phase)
                spans[(record.peer_id, record.start, record.end)] = PeerSpan(
                    record.peer_id, record.start, record.end, record.throughput, record.free_cache_tokens,
                    record.cache_tokens, served_kind(record.dtype, record.quantization))
                if record.cache_tokens > 0:
                    self._cache_load[record.peer_id] = 1.0 - record.free_cache_tokens / record.cache_tokens
        self.spans, self.phases = spans, phases
        newer = placement is not None and (self.placement is None or placement.order != self.placement.order)
        if newer and placement is not None and placement.num_blocks == self.num_blocks:
            logger.info("following placement v%d (%s): %s", placement.version, placement.algorithm, placement.reason)
            self._table = RoutingTable.from_flows(placement.assignments, placement.flows, self.num_blocks)
            self._router = RouterState()
            self.placement = placement
        self._updated = time.monotonic()
        await self._measure_rtts(sorted({s.peer_id for s in spans.values()} - set(self.rtts)))

    async def _measure_rtts(self, peers: list[str]) -> None:
        async def ping(peer: str) -> None:
            try:
                self.rtts[peer] = await rpc.timed_call(self.p2p, peer, rpc.RPC_PING, timeout=5.0)
            except (SwarmError, RuntimeError, *TRANSPORT_ERRORS) as exc:  # RuntimeError: an error reply
                logger.debug("ping to %s failed: %r", short_id(peer), exc)

        await asyncio.gather(*(ping(p) for p in peers))

    def not_admitted(self, peer: str) -> PeerNotAdmitted | None:
        """In a private swarm, why `peer` may no longer serve this client's sessions (revoked, expired), else
        None: the members' view is read every heartbeat, so a revoked node is left within one."""
        if self.members is None or self.members.admits(peer, Role.NODE):
            return None
        return PeerNotAdmitted(peer, f"{self.members.why_not(peer, [Role.NODE])}: moving its sessions to other nodes")

    # --- bans ----------------------------------------------------------------------------------------
    def ban(self, peer: str, reason: str, *, permanent: bool = False) -> None:
        """Stop routing through `peer`: for 5, 10, 20 ... s as its failures repeat, or for good."""
        previous = self._bans.get(peer)
        if previous is not None and previous.until == math.inf:
            return  # banned for good already
        failures = previous.failures + 1 if previous else 1
        duration = math.inf if permanent else min(self.config.ban_base * 2 ** (failures - 1), self.config.ban_max)
        self._bans[peer] = _Ban(time.monotonic() + duration, failures, reason)
        if permanent:
            logger.warning("banning peer %s for the rest of this client's life: %s", short_id(peer), reason)
        else:
            logger.warning("banning peer %s for %.0f s: %s", short_id(peer), duration, reason)

    def hold_off(self, peer: str, reason: str) -> None:
        """Skip `peer` for `cache_hold` s without counting a failure (it refused work it had no room for)."""
        previous = self._bans.get(peer)
        until = time.monotonic() + self.config.cache_hold
        if previous is None:
            self._bans[peer] = _Ban(until, 0, reason)
        elif previous.until < until:
            previous.until = until
        logger.info("peer %s is full, trying others for %.0f s: %s", short_id(peer), self.config.cache_hold, reason)

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p for p, b in self._bans.items() if b.until > now) | self.config.exclude_peers

    # --- reports -------------------------------------------------------------------------------------
    async def report(self, record: ReportRecord) -> bool:
        """Ban `record.peer_id` for good and publish the report under this client's key (`{prefix}.reports`)."""
        self.diverged[record.peer_id] = record
        self.ban(record.peer_id, f"{record.reason} on blocks [{record.start}, {record.end}) (difference "
                                 f"{record.max_diff:.3g} > tolerance {record.tolerance:.3g})", permanent=True)
        if self.key is None:
            logger.warning("cannot publish the report about %s: this client has no signing key", short_id(record.peer_id))
            return False
        from swarmnode.identity import owner_marker

        try:
            stored = await asyncio.wait_for(
                store_owned(self.dht, reports_key(self.prefix), report_subkey(owner_marker(self.key), record.peer_id),
                            record.to_dict(), REPORT_TTL), self.config.request_timeout)
        except Exception as exc:  # a store fails with whatever the DHT process met: a report is best-effort
            logger.warning("publishing the report about %s failed: %r", short_id(record.peer_id), exc)
            return False
        if stored:
            self.reports_stored += 1
        else:
            logger.warning("the DHT did not store the report about %s", short_id(record.peer_id))
        return bool(stored)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    # --- routes --------------------------------------------------------------------------------------
    def _plan_route(self, min_cache_tokens: int) -> list[Hop] | None:
        """A whole-model route along the placement's flows, or None when none is usable now."""
        if self._table is None:
            return None
        banned = self.banned()
        load: dict[str, float] = {}
        for peer, (a, b) in self._table.ranges.items():
            live = [s for s in self.spans.values() if s.peer_id == peer and s.start <= a and b <= s.end]
            if peer in banned or not live or max(s.free_cache_tokens for s in live) < min_cache_tokens \
                    or not Phase.BOTH.routed_to(self.phase_of(peer)):
                load[peer] = float("inf")
            else:
                load[peer] = self._cache_load.get(peer, 0.0)
        stages = iwrr_route(self._table, self._router, kv_load=load, high_water=self.config.high_water)
        if not stages:
            return None
        self.plan_routes += 1
        return [Hop(stage.node, stage.start, stage.end) for stage in stages]

    def phase_of(self, peer: str) -> Phase:
        """The phase `peer` serves, as its record says (both when it says none)."""
        return self.phases.get(peer, Phase.BOTH)

    def serving(self, phase: Phase) -> list[PeerSpan]:
        """The spans a session of `phase` is routed through (`Phase.routed_to`: prefill sessions through
        prefill-only nodes, the others through every node but those)."""
        return [s for s in self.spans.values() if phase.routed_to(self.phase_of(s.peer_id))]

    def splits(self) -> bool:
        """Whether prefill-only nodes serve every block (a session's prompt can run on them)."""
        covered: set[int] = set()
        for span in self.serving(Phase.PREFILL):
            covered.update(range(span.start, span.end))
        return len(covered) == self.num_blocks and bool(self.serving(Phase.DECODE))

    async def route(self, start: int, end: int, min_cache_tokens: int = 0, *,
                    phase: Phase = Phase.BOTH) -> list[Hop]:
        await self.refresh()
        if start == 0 and end == self.num_blocks and phase is not Phase.PREFILL:
            hops = self._plan_route(min_cache_tokens)
            if hops is not None:
                return hops
        try:
            return shortest_route(self.serving(phase), start, end, rtts=self.rtts, banned=self.banned(),
                                  min_cache_tokens=min_cache_tokens)
        except NoRouteError:
            await self.refresh(force=True)  # the view may be stale: look again before giving up
            try:
                return shortest_route(self.serving(phase), start, end, rtts=self.rtts, banned=self.banned(),
                                      min_cache_tokens=min_cache_tokens)
            except NoRouteError:
                if not await self._parole(start, end):
                    raise
                return shortest_route(self.serving(phase), start, end, rtts=self.rtts, banned=self.banned(),
                                      min_cache_tokens=min_cache_tokens)

    async def _parole(self, start: int, end: int) -> bool:
        """Lift the bans of peers serving blocks of [start, end) that answer a ping now; whether any was lifted.

        Used only when no route exists without them. A ban is for a peer that failed, but a peer's id
        outlives its process: a node that was SIGKILLed and restarted with its identity serves again under the
        same id, while its ban (doubled at each failure, up to `ban_max`) would keep this client off it, and
        so off blocks it may now be the only one to serve. A peer that fails again is banned again, with the
        failure count it had; peers banned for good (wrong outputs) stay banned, and peers only held off for
        a full cache (no failure) are waited for as before."""
        now = time.monotonic()
        candidates = sorted({s.peer_id for s in self.spans.values() if s.start < end and start < s.end}
                            & {p for p, b in self._bans.items() if now < b.until < math.inf and b.failures > 0}
                            - self.config.exclude_peers - set(self.diverged))
        if not candidates:
            return False

        answered = await rpc.answering(self.p2p, candidates, PAROLE_PING_TIMEOUT)
        lifted = [p for p in candidates if p in answered]
        for peer in lifted:
            self._bans[peer].until = now
            logger.info("peer %s answers again and no route avoids it: lifting its ban", short_id(peer))
        return bool(lifted)


async def _none() -> None:
    return None
