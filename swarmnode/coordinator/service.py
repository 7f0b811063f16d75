"""The coordinator: reads the nodes' capacity records, plans, and publishes versioned, signed placements.

While it holds the lease (`coordinator.lease`), every `LEASE_RENEW` s it reads the live capacity records
and compares them with the ones it last planned from: a node joined, left (its record expired or went
OFFLINE), or its offer or measured throughput changed by more than `CHANGE_THRESHOLD`, or a measured link
that can limit the swarm's throughput appeared or changed (`cluster_view.link_changes`): typed events
(`coordinator.events`), whose sentences the log and the placement's reason show. Changes are
debounced (`debounce` s of quiet, at most `max_wait` s) and then planned with `planner.live.sticky`, which
keeps the old placement where a fresh one is not clearly better, and keeps every block on at least
`min_replicas` nodes where the offers allow it (a lost node is then no gap for clients). The placement
names the blocks it could not replicate (single points of failure) and says why each node with an offer
that it leaves out is unused (`planner.live.unused`): unreachable, still measuring, too small, or adding nothing. A placement that differs is published
as version `newest + 1` with the max-flow edge flows and the reason; an unchanged one is refreshed so it
does not expire. Planning runs in a worker thread; the lease keeps being renewed meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hivemind.utils import get_dht_time

from swarmnode import rpc
from swarmnode.coordinator.cluster_view import cluster_from_records, link_changes, plannable_records
from swarmnode.coordinator.events import (
    AlgorithmChanged,
    ChangeEvent,
    NodeJoined,
    NodeLeft,
    OfferChanged,
    RangeTooLarge,
    fingerprint,
)
from swarmnode.coordinator.lease import Lease
from swarmnode.identity import owner_marker
from swarmnode.naming import short_id
from swarmnode.planner.cluster.spec import ModelSpec
from swarmnode.planner.errors import CannotPlaceError, PlannerError
from swarmnode.planner.live.sticky import decide
from swarmnode.planner.live.sticky_phases import decide_phases
from swarmnode.planner.live.unused import unused_reasons
from swarmnode.planner.options import AlgorithmOptions
from swarmnode.planner.registry import COORDINATOR_ALGORITHMS, MIN_REPLICAS, lookup
from swarmnode.records import (
    LEASE_POLL,
    LEASE_RENEW,
    MAX_MIN_REPLICAS,
    MAX_REASON_CHARS,
    MAX_UNUSED_REASON_CHARS,
    NODE_RECORD_TTL,
    PLACEMENT_TTL,
    NodeRecord,
    NodeState,
    Phase,
    PlacementRecord,
    placement_key,
)
from swarmnode.relay.dialer import RelayDialer
from swarmnode.swarm_state import read_nodes, read_placement, store_owned

if TYPE_CHECKING:
    from swarmnode.membership import Membership

logger = logging.getLogger(__name__)

CHANGE_THRESHOLD = 0.25
# The most unused nodes a placement explains (the record must stay small; the rest are counted).
MAX_EXPLAINED_UNUSED = 64
REFRESH_PERIOD = 30.0
# A node whose record is still live but that fails this many pings in a row (one per tick, PING_TIMEOUT s
# each) is treated as gone: a killed node is noticed in seconds rather than when its record expires.
DEAD_AFTER_PINGS = 2
PING_TIMEOUT = 2.0


@dataclass
class CoordinatorConfig:
    algorithm: str = "milp"
    time_limit: float = 10.0
    improvement: float = 0.2
    debounce: float = 3.0
    max_wait: float = 15.0
    min_replicas: int = 2
    # the average request planned for, (prompt tokens, output tokens); None: the planner's default (Helix's
    # trace). Every link carries a request's prompt once, so long prompts make slow links matter more.
    workload: tuple[float, float] | None = None
    # the fresh plans' options, of `algorithm`'s options type (`planner.options`), built where the command line is
    # read; None: `planner.live.sticky.fresh_options` (the time limit for the MILP, the floor where it is placed for)
    options: AlgorithmOptions | None = None

    def __post_init__(self):
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) \
                or not 1 <= self.min_replicas <= MAX_MIN_REPLICAS:
            raise ValueError(f"min_replicas must be a whole number from 1 to {MAX_MIN_REPLICAS}, "
                             f"got {self.min_replicas!r}")
        if self.workload is not None and (len(self.workload) != 2 or not self.workload[0] >= 0
                                          or not self.workload[1] >= 1):
            raise ValueError(f"workload must be (prompt tokens >= 0, output tokens >= 1), got {self.workload!r}")
        if self.algorithm not in COORDINATOR_ALGORITHMS:
            raise ValueError(f"a coordinator plans with one of {', '.join(COORDINATOR_ALGORITHMS)}, not "
                             f"{self.algorithm!r}")
        if self.options is not None:
            lookup(self.algorithm).checked(self.options)  # a PlannerError (a ValueError) for another's options
            floor = getattr(self.options, MIN_REPLICAS, self.min_replicas)
            if floor != self.min_replicas:
                raise ValueError(f"min_replicas is {self.min_replicas} but the {self.algorithm} options say {floor}; "
                                 f"give it once")

    @property
    def two_phase(self) -> bool:
        """Whether it plans prefill and decode nodes apart (HexGen-2, `planner.live.sticky_phases`)."""
        return lookup(self.algorithm).live_phases


def model_info_from_checkpoint(checkpoint, dtype_bytes: int = 4) -> ModelSpec:
    """The planner's description of the served model, from its checkpoint: float32 block sizes, the largest block's
    (a model's blocks may differ, as DeepSeek's dense first blocks do; nodes count their capacity the same way)."""
    import torch

    from swarmnode.server.memory_plan import block_bytes

    config = checkpoint.config
    family = checkpoint.family
    return ModelSpec(
        name=checkpoint.name, num_blocks=checkpoint.num_blocks, hidden_size=checkpoint.hidden_size,
        dtype_bytes=dtype_bytes,
        block_bytes=max(block_bytes(family, i, torch.float32) for i in range(family.num_layers)),
        intermediate_size=getattr(config, "intermediate_size", None),
        num_attention_heads=getattr(config, "num_attention_heads", None),
        num_key_value_heads=getattr(config, "num_key_value_heads", None),
    )


def _changed(old: NodeRecord, new: NodeRecord) -> bool:
    def far(a: float, b: float) -> bool:
        return abs(a - b) > CHANGE_THRESHOLD * max(a, b, 1e-9)

    def pin(record: NodeRecord) -> str | None:
        return record.phase if record.phase_pinned else None

    return (far(old.max_blocks, new.max_blocks) or far(old.block_throughput, new.block_throughput)
            or pin(old) != pin(new))


def unplannable_reasons(everyone: dict[str, NodeRecord], plannable: dict[str, NodeRecord], unreachable: set[str],
                        missed_pings: dict[str, int]) -> dict[str, str]:
    """Why each node with a record is kept out of planning altogether (the planner explains the others it
    leaves out, `planner.live.unused`): it does not answer pings, is still measuring, or its offer holds no
    block. Nodes that chose their own blocks (`--blocks`) and departing ones are not unused."""
    from swarmnode.sizes import format_size

    reasons = {p: f"does not answer pings ({missed_pings.get(p, 0)} missed in a row): treated as gone"
               for p in unreachable}
    for peer, record in everyone.items():
        if peer in plannable or record.manual:
            continue
        if record.state == NodeState.MEASURING:
            reasons[peer] = "still measuring its speed; planned once it publishes the measurement"
        elif record.state != NodeState.OFFLINE and record.max_blocks <= 0:
            reasons[peer] = (f"its offer of {format_size(record.memory_bytes)} holds no block with room for "
                             f"its KV cache: offer more memory")
    return reasons


def explained_unused(reasons: dict[str, str], placement) -> dict[str, str]:
    """The reasons a placement record can carry: for nodes outside `placement` only, each shortened to
    `MAX_UNUSED_REASON_CHARS`, at most `MAX_EXPLAINED_UNUSED` of them (in peer-id order)."""
    out: dict[str, str] = {}
    for peer, why in sorted(reasons.items()):
        if peer in placement:
            continue
        if len(out) == MAX_EXPLAINED_UNUSED:
            break
        out[peer] = why if len(why) <= MAX_UNUSED_REASON_CHARS else why[:MAX_UNUSED_REASON_CHARS - 1] + "…"
    return out


class Coordinator:
    def __init__(self, dht, prefix: str, model: ModelSpec, key, trusted: frozenset[str],
                 config: CoordinatorConfig | None = None, members: Membership | None = None):
        self.dht, self.prefix, self.model, self.key = dht, prefix, model, key
        self.members = members  # a private swarm's members: only nodes admitted as nodes are planned
        self.config = config or CoordinatorConfig()
        self.peer_id = dht.peer_id.to_base58()
        self.subkey = owner_marker(key)
        from swarmnode.identity import public_key_text

        self.trusted = frozenset(trusted) | {public_key_text(key)}  # its own leases and placements, at least
        self.lease = Lease(dht, prefix, self.subkey, self.peer_id, self.trusted, algorithm=self.config.algorithm)
        self.planned_from: dict[str, NodeRecord] = {}
        self.published: PlacementRecord | None = None
        self._pending: list[str] = []
        self._first_change = 0.0
        self._last_change = 0.0
        self._last_refresh = 0.0
        self._fingerprint: frozenset[tuple] | None = None  # the changes under way (`events.fingerprint`)
        self._missed_pings: dict[str, int] = {}
        self._seen: dict[str, tuple[NodeRecord, float]] = {}
        self._unplannable: dict[str, str] = {}
        self._replanned_for: int | None = None  # a predecessor's placement version re-planned for its algorithm
        self._p2p: RelayDialer | None = None  # the DHT's P2P replica, made by the first ping round

    async def run(self, stop: asyncio.Event) -> None:
        logger.info("coordinator %s for %s (%s, %d blocks) started", short_id(self.peer_id), self.prefix,
                    self.config.algorithm, self.model.num_blocks)
        while not stop.is_set():
            try:
                if await self.lease.poll():
                    await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed step (a DHT hiccup, a planner bug) must not end the lease loop
                logger.exception("coordinator step failed; retrying")
            period = LEASE_RENEW if self.lease.held else LEASE_POLL
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass

    def _events(self, nodes: dict[str, NodeRecord], current: PlacementRecord | None) -> list[ChangeEvent]:
        """What changed since the last plan (`coordinator.events`): nodes joined, left or changed their offer,
        and links that can now limit the swarm."""
        events: list[ChangeEvent] = []
        assigned = set(current.assignments) if current else set()
        for peer, record in nodes.items():
            if peer not in self.planned_from and peer not in assigned:
                events.append(NodeJoined(peer, record.max_blocks, record.block_throughput))
            elif peer in self.planned_from and _changed(self.planned_from[peer], record):
                events.append(OfferChanged(peer))
            elif current is not None and peer in current.assignments:
                start, end = current.assignments[peer]
                if end - start > record.max_blocks:
                    events.append(RangeTooLarge(peer, end - start, record.max_blocks))
        for peer in sorted((set(self.planned_from) | assigned) - set(nodes)):
            events.append(NodeLeft(peer))
        if self.planned_from:
            events += link_changes(self.model, self.planned_from, nodes, workload=self.config.workload)
        return events

    async def tick(self) -> None:
        current = await read_placement(self.dht, self.prefix, self.trusted)
        if current is not None and (self.published is None or current.order > self.published.order):
            self.published = current  # a predecessor's placement: the baseline to keep
        everyone = self._remember(await read_nodes(self.dht, self.prefix, members=self.members))
        nodes = plannable_records(everyone)
        unreachable = await self._unreachable(nodes)
        self._unplannable = unplannable_reasons(everyone, nodes, unreachable, self._missed_pings)
        nodes = {p: r for p, r in nodes.items() if p not in unreachable}
        events = self._events(nodes, self.published)
        now = time.monotonic()
        under_way = fingerprint(events)
        if not events:
            self._first_change, self._fingerprint = 0.0, None
        if events:
            if under_way != self._fingerprint:
                self._fingerprint = under_way
                self._last_change = now
                if not self._first_change:
                    self._first_change = now
                    logger.info("change seen: %s; planning after %.0f s of quiet", "; ".join(map(str, events)),
                                self.config.debounce)
            quiet = now - self._last_change >= self.config.debounce
            overdue = now - self._first_change >= self.config.max_wait
            if quiet or overdue or (self.published is None and not self.planned_from):
                await self._plan(nodes, events)
                return
        if self.published is not None and self.published.coordinator != self.peer_id:
            mismatch = self.config.two_phase != bool(self.published.phases)
            if mismatch and nodes and self._replanned_for != self.published.version:
                # a predecessor planned with(out) phases and this coordinator plans otherwise: plan once
                # rather than keep its phases (or the lack of them) alive
                self._replanned_for = self.published.version
                await self._plan(nodes, [AlgorithmChanged(self.peer_id, self.config.algorithm)])
                if self.published.coordinator == self.peer_id:
                    return
            await self._adopt(self.published)
        elif self.published is not None and now - self._last_refresh > REFRESH_PERIOD:
            await self._store(self.published)

    def _remember(self, fresh: dict[str, NodeRecord]) -> dict[str, NodeRecord]:
        """The nodes read now plus those read within the record TTL: one DHT read can miss a record that is
        still alive, and a node must not look gone (and trigger a re-plan) because of that. A node that
        stops announces OFFLINE, and a killed one stops answering pings, so neither lingers."""
        now = time.monotonic()
        for peer, record in fresh.items():
            self._seen[peer] = (record, now)
        self._seen = {p: (r, t) for p, (r, t) in self._seen.items() if now - t < NODE_RECORD_TTL}
        return {p: r for p, (r, _t) in self._seen.items()}

    async def _unreachable(self, nodes: dict[str, NodeRecord]) -> set[str]:
        """Nodes that failed `DEAD_AFTER_PINGS` pings in a row. Placed nodes are pinged, and so are nodes
        already counted as gone while their records live: a SIGKILLed node that its service manager
        restarts with the same identity (peer id) announces itself again before the killed process's
        record expires, and must count as joining as soon as it answers, not stay gone (and unplanned)
        for as long as its record is refreshed."""

        if self._p2p is None:
            self._p2p = RelayDialer(await self.dht.replicate_p2p())
        self._p2p.learn({p: r.relay for p, r in nodes.items()})  # nodes behind NAT are pinged through their relays
        placed = [p for p in nodes if (self.published is not None and p in self.published.assignments)
                  or self._missed_pings.get(p, 0) >= DEAD_AFTER_PINGS]

        answering = await rpc.answering(self._p2p, placed, PING_TIMEOUT)  # it takes several misses to drop one
        for peer, ok in ((p, p in answering) for p in placed):
            if ok and self._missed_pings.get(peer, 0) >= DEAD_AFTER_PINGS:
                logger.info("node %s answers pings again (restarted): planning it again", short_id(peer))
            self._missed_pings[peer] = 0 if ok else self._missed_pings.get(peer, 0) + 1
            if self._missed_pings[peer] == DEAD_AFTER_PINGS:
                logger.warning("node %s does not answer pings: treating it as gone", short_id(peer))
        for peer in set(self._missed_pings) - set(nodes):
            del self._missed_pings[peer]
        return {p for p, missed in self._missed_pings.items() if missed >= DEAD_AFTER_PINGS}

    async def _plan(self, nodes: dict[str, NodeRecord], events: list[ChangeEvent]) -> None:
        self._first_change = 0.0
        self._fingerprint = None
        if not nodes:
            logger.info("no nodes to plan for yet")
            return
        previous = dict(self.published.assignments) if self.published else None
        reasons = [str(event) for event in events]  # what the placement's reason says it was planned for
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        try:
            if self.config.two_phase:
                planned = self._two_phase_planner(nodes, previous, reasons)
            else:
                def planned():
                    return self._placement(nodes, previous, reasons, self.config.algorithm, self.config.improvement)

            decision, unused = await loop.run_in_executor(None, planned)
        except CannotPlaceError as exc:
            logger.warning("cannot place the model yet: %s", exc)
            self.planned_from = dict(nodes)
            return
        except PlannerError as exc:  # the live records make a cluster the planner refuses: wait for new ones
            logger.error("the planner refused the swarm's offers (%s): %s", exc.code, exc)
            self.planned_from = dict(nodes)
            return
        self.planned_from = dict(nodes)
        logger.info("planned in %.1f s: %s", time.perf_counter() - began, decision.reason)
        unused = explained_unused({**unused, **self._unplannable}, decision.placement)
        for peer, why in sorted(unused.items()):
            logger.info("node %s unused: %s", short_id(peer), why)
        if decision.single_points:
            logger.warning("blocks %s have fewer than %d replicas: the offers cannot hold more",
                           ", ".join(f"{a}-{b - 1}" for a, b in decision.single_points), self.config.min_replicas)
        phases_changed = self.published is not None and dict(self.published.phases) != decision.phases
        if not decision.changed and not phases_changed and self.published is not None:
            if unused != self.published.unused:  # same blocks, new reasons: republish so status tells the truth
                await self._republish(unused)
            return
        if not self.lease.held:
            logger.info("lost the lease while planning: not publishing")
            return
        newest = await read_placement(self.dht, self.prefix, self.trusted)
        version = max(newest.version if newest else 0, self.published.version if self.published else 0) + 1
        record = PlacementRecord(
            version=version, term=self.lease.term, coordinator=self.peer_id, algorithm=decision.algorithm,
            reason=decision.reason, created=get_dht_time(), num_blocks=self.model.num_blocks,
            assignments={p: tuple(r) for p, r in decision.placement.items()}, flows=decision.flows,
            throughput=decision.throughput, moved_blocks=decision.moved_blocks,
            min_replicas=self.config.min_replicas, single_points=tuple(decision.single_points), unused=unused,
            phases=decision.phases, kv_links=decision.kv_links,
        )
        if await self._store(record):
            self.published = record
            ranges = sorted(record.assignments.items(), key=lambda i: i[1])
            logger.info("published placement v%d (%s, %.0f tok/s, %d blocks moved): %s", version,
                        decision.algorithm, decision.throughput, decision.moved_blocks,
                        ", ".join(f"{short_id(p)}={list(r)}{'/' + record.phases[p] if p in record.phases else ''}"
                                  for p, r in ranges))
        else:
            logger.warning("could not store placement v%d; will retry on the next change", version)
            self.planned_from = {}

    def _placement(self, nodes: dict[str, NodeRecord], previous: dict | None, reasons: list[str], algorithm: str,
                   improvement: float):
        """A node placement of `nodes` by `algorithm` (`planner.live.sticky.decide`, with the redundancy floor) and
        why each node it leaves out is unused."""
        cluster = cluster_from_records(self.model, nodes, workload=self.config.workload)
        # the configured algorithm's options as given; another algorithm (the MILP a two-phase swarm falls back
        # to) gets its own from `fresh_options`
        options = self.config.options if algorithm == self.config.algorithm else None
        decision = decide(cluster, previous, algorithm=algorithm, options=options, events=reasons,
                          improvement=improvement, time_limit=self.config.time_limit,
                          max_reason_chars=MAX_REASON_CHARS, min_replicas=self.config.min_replicas)
        unused = unused_reasons(cluster, decision.placement, single_points=decision.single_points,
                                min_replicas=self.config.min_replicas)
        return decision, unused

    def _two_phase_planner(self, nodes: dict[str, NodeRecord], previous: dict | None, reasons: list[str]):
        """The planning call for `--algorithm hexgen2` (`planner.live.sticky_phases`): nodes pinned to a phase with
        `join --phase prefill|decode` keep it; nodes pinned to `--phase both` cannot take part in a two-phase
        plan and are left out with that reason."""
        both = {p for p, r in nodes.items() if r.phase_pinned and r.phase == Phase.BOTH}
        phased = {p: r for p, r in nodes.items() if p not in both}
        pinned = {p: r.phase for p, r in phased.items() if r.phase_pinned}
        previous_phases = dict(self.published.phases) if self.published else None

        def planned():
            try:
                cluster = cluster_from_records(self.model, phased, workload=self.config.workload)
                decision = decide_phases(
                    cluster, previous, previous_phases, events=reasons, improvement=self.config.improvement,
                    time_limit=self.config.time_limit, workload=self.config.workload, pinned=pinned,
                    max_reason_chars=MAX_REASON_CHARS)
            except CannotPlaceError as exc:
                return self._colocated_fallback(nodes, previous, reasons, str(exc))
            unused = {p: "started with --phase both: a two-phase plan gives every node one phase" for p in both}
            for peer in phased:
                if peer not in decision.placement:
                    unused[peer] = "the two-phase plan's groups do not need it (hexgen2)"
            return decision, unused

        return planned

    def _colocated_fallback(self, nodes: dict[str, NodeRecord], previous: dict | None, reasons: list[str],
                            why: str):
        """A placement without phases (Helix's MILP) when the swarm cannot form a prefill and a decode group:
        a two-phase placement that lost a node would otherwise leave blocks with no node for one phase, and
        prefill-only nodes refuse generation. Every node serves both phases until two groups fit again, but
        nodes pinned to the prefill phase (`join --phase prefill`) cannot generate and are left out."""
        prefill_only = {p for p, r in nodes.items() if r.phase_pinned and r.phase == Phase.PREFILL}
        usable = {p: r for p, r in nodes.items() if p not in prefill_only}
        logger.warning("no two-phase plan (%s): every node serves both phases meanwhile", why)
        decision, unused = self._placement(usable, previous, [*reasons, f"no two-phase plan ({why})"], "milp", 0.0)
        for peer in prefill_only:
            unused[peer] = "started with --phase prefill, and there is no two-phase plan now (too few nodes)"
        return decision, unused

    async def _republish(self, unused: dict[str, str]) -> None:
        """The published placement again, same blocks and version order, with up-to-date unused reasons."""
        if not self.lease.held or self.published is None:
            return
        newest = await read_placement(self.dht, self.prefix, self.trusted)
        version = max(self.published.version, newest.version if newest else 0) + 1
        record = self.published.model_copy(update={
            "version": version, "term": self.lease.term, "coordinator": self.peer_id, "created": get_dht_time(),
            "moved_blocks": 0, "unused": unused,
        })
        if await self._store(record):
            self.published = record

    async def _adopt(self, previous: PlacementRecord) -> None:
        """A predecessor's placement: republish it unchanged under this coordinator's term and version, so
        it stays alive and status shows who coordinates now."""
        newest = await read_placement(self.dht, self.prefix, self.trusted)
        version = max(previous.version, newest.version if newest else 0) + 1
        record = previous.model_copy(update={
            "version": version, "term": self.lease.term, "coordinator": self.peer_id, "created": get_dht_time(),
            "moved_blocks": 0,
            "reason": f"coordinator {short_id(self.peer_id)} took over (term {self.lease.term}); keeps the placement "
                      f"of v{previous.version}",
        })
        if await self._store(record):
            self.published = record
            if not self.planned_from:
                live = plannable_records(await read_nodes(self.dht, self.prefix, members=self.members))
                self.planned_from = {p: r for p, r in live.items() if p in previous.assignments}
            logger.info("took over placement v%d as v%d", previous.version, version)

    async def _store(self, record: PlacementRecord) -> bool:
        self._last_refresh = time.monotonic()
        return await store_owned(self.dht, placement_key(self.prefix), self.subkey, record.to_dict(), PLACEMENT_TTL)
