"""Measuring a node's links to the other nodes: round trip and bandwidth over the P2P stream.

**What a reading is.** The round trip is the best of three empty `ping`s. The bandwidth is the rate at which
the `probe` RPC moves payload bytes, found as a slope between two payload sizes, `small` and `large` = 4 x
`small`: (large - small) / (t_large - t_small). Whatever a call costs regardless of its size (the round
trip, the RPC's framing and scheduling on both peers, TCP's first round trips) is in both times and cancels;
what is left is the per-byte cost of the path hidden states take (serialization, `p2pd`, the network), the
rate the swarm can actually use. A sample sends small, large, small, back to back: the first small payload
also uses up whatever burst a token bucket on the path allows (which would make the payload after it look
fast), so the large one and the second small one start alike; the small time is the faster of the two,
which errs towards a lower reading. Timing a single 256 KiB payload less one round trip, as nodes did
before, measured the call more than the link: on a veth pair where a raw socket moves about 10 Gbit/s it
read 200-700 Mbit/s, and behind a token bucket the burst made it read anywhere around the real rate.

**Why the fastest of several samples.** Anything else on the path during a sample (another peer's probe,
serving traffic, a busy CPU) only ever adds time. So a link's reading takes, over its last `WINDOW` samples
of the current sizes, the shortest time seen for each size (`reading`): one quiet moment per size is enough
for an accurate reading. A delayed large payload lowers a reading; a delayed small one would raise it, which
is why a sample times two small payloads and the reading takes the fastest small time of the window (and
never more than `MAX_SPEEDUP` times what the large payload's whole call implies).

**When.** A peer is sampled as soon as it is seen, then at growing gaps (`FIRST_GAP` s, three times longer
each time, up to `interval`, 300 s), each jittered by +-20% so that peers which started together drift apart.
A sample much slower than the link's reading (below `LOW_SHARE` of it) is checked again after `FIRST_GAP` s,
so a link that really got slower shows within a few samples rather than `WINDOW` intervals. One peer is
sampled at a time, with a pause between samples.

**Bounded.** The payload sizes are chosen per link so that the large one takes at most about
`TARGET_SECONDS` at the link's reading (`next_large`: 64 KiB, 256 KiB or `messages.MAX_PROBE_BYTES`). The
first sample uses the smallest; a sample whose sizes turn out wrong for the link is not published, and one
with the sizes its reading calls for follows (`LinkHistory.add`). The gap after a sample is at least `DUTY`
times what the sample took, so one prober uses at most about a tenth of any link. Peers also refuse more
than `messages.PROBE_RATE` probes a minute from one caller.

**One sender at a time per receiver.** Two peers probing one node at the same moment share its link and
each reads about half of it. Before a sample the prober asks the peer for its probe slot (a 1-byte `probe`
whose metadata is `{"hold": seconds}`); the node grants the slot to one caller at a time for at most
`messages.PROBE_MAX_HOLD` s (`ProbeSlot`) and tells the others so; they ask again within `BUSY_RETRY` s, as
the holder's last payload (`{"release": true}`) usually frees the slot well before its hold ends. A payload that arrives while another caller holds the slot is answered with
`"shared": true`, and so is the holder's release after such an intrusion: the prober drops that sample and
samples again soon. A peer that answers a reservation without `granted` (an older node) is probed anyway.

The coordinator turns the readings into the planner's link capacities (Helix §4.3,
`coordinator.cluster_view`), and re-plans when a link that could limit the swarm's throughput changes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.messages import ProbeReply, ProbeRequest
from swarmnode.naming import short_id
from swarmnode.records import NODE_RECORD_TTL, LinkMeasurement

logger = logging.getLogger(__name__)

KIB = 1024
LARGE_SIZES = (64 * KIB, 256 * KIB, messages.MAX_PROBE_BYTES)  # the large payload; the small one is a quarter
FIRST_LARGE = 64 * KIB
SMALL_SHARE = 4
TARGET_SECONDS = 2.0  # the most the large payload should take at the link's reading
WINDOW = 4  # samples of the current sizes a reading is taken over
HISTORY = 8  # samples kept per peer
FIRST_GAP = 5.0
GAP_GROWTH = 3.0
JITTER = 0.2
DUTY = 10.0  # the gap after a sample is at least this many times what the sample took
LOW_SHARE = 0.5  # a sample below this share of the link's reading is checked again soon
MAX_SPEEDUP = 2.0  # a slope may not say the payload moves more than this many times faster than a whole call
BUSY_RETRY = 1.0  # the most a prober waits before asking a busy peer for its slot again
PROBE_INTERVAL = 300.0
PROBE_PAUSE = 0.5
PEERS_REFRESH = 5.0
FORGET_AFTER = NODE_RECORD_TTL  # a peer missing from the listings this long is gone
CALL_TIMEOUT = 30.0
PING_TIMEOUT = 5.0


# --- the receiving side ----------------------------------------------------------------------------------

class ProbeSlot:
    """A node's probe slot: the one caller whose measurement payloads it expects now (module docstring)."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.until = 0.0
        self.shared = False  # another caller's payload arrived while the slot was held

    def answer(self, caller: str, now: float, request: ProbeRequest) -> dict:
        """The reply's fields beyond `received` for `request` from `caller` at `now` (monotonic seconds):
        `granted` (and `retry_after` s when not) for a reservation; `shared` when the payload, or the
        holder's measurement that it releases, shared the link with another caller's."""
        held = self.holder is not None and now < self.until
        if request.hold is not None:
            if held and self.holder != caller:
                return {"granted": False, "retry_after": round(self.until - now, 3)}
            self.holder, self.until, self.shared = caller, now + min(request.hold, messages.PROBE_MAX_HOLD), False
            return {"granted": True}
        if not held:
            return {}
        if caller != self.holder:
            self.shared = True
            return {"shared": True}
        shared = self.shared
        if request.release:
            self.holder, self.until, self.shared = None, 0.0, False
        return {"shared": True} if shared else {}


# --- readings: pure functions over samples ---------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One sample of a link: when (monotonic s), the best ping, and the two payloads' sizes and times."""

    at: float
    rtt: float
    small: int
    large: int
    small_seconds: float  # the faster of the two small payloads
    large_seconds: float

    @property
    def seconds(self) -> float:
        """About what the sample held the link for."""
        return 2 * self.small_seconds + self.large_seconds


def _slope_mbps(small: int, large: int, small_seconds: float, large_seconds: float) -> float:
    whole = large * 8 / max(large_seconds, 1e-6) / 1e6  # what the large call moved, fixed cost and all
    slope = (large - small) * 8 / max(large_seconds - small_seconds, 1e-6) / 1e6
    return min(slope, MAX_SPEEDUP * whole, 1e7)


def reading(samples: Sequence[Sample]) -> LinkMeasurement | None:
    """The link's measurement from its samples (oldest first): over the last `WINDOW` samples taken since the
    sizes last changed (samples of other sizes, and those before them, do not count), the shortest time of
    each size gives the slope, and the best round trip is the round trip. None without samples."""
    same = _current(samples)
    if not same:
        return None
    newest = same[-1]
    mbps = _slope_mbps(newest.small, newest.large, min(s.small_seconds for s in same),
                       min(s.large_seconds for s in same))
    rtt = min(s.rtt for s in same)
    return LinkMeasurement(rtt_ms=round(rtt * 1000, 3), bandwidth_mbps=max(round(mbps, 3 if mbps < 10 else 1), 0.001))


def _mbps(measurement: LinkMeasurement) -> float:
    """The bandwidth of a measurement this node made (`reading` always gives one; others' records may not)."""
    assert measurement.bandwidth_mbps is not None, "`reading` measures the bandwidth"
    return measurement.bandwidth_mbps


def _current(samples: Sequence[Sample]) -> list[Sample]:
    """The last `WINDOW` samples of the newest sample's sizes with no sample of other sizes after them."""
    run: list[Sample] = []
    for sample in reversed(samples):
        if (run and (sample.small, sample.large) != (run[0].small, run[0].large)) or len(run) == WINDOW:
            break
        run.insert(0, sample)
    return run


def sample_mbps(sample: Sample, samples: Sequence[Sample]) -> float:
    """What `sample` alone says of the link: its large payload's time against the shortest small one of the
    current samples (`samples` with `sample` after them) of its sizes, so that only the large payload's
    contention shows."""
    small = min(s.small_seconds for s in _current([*samples, sample]))
    return _slope_mbps(sample.small, sample.large, small, sample.large_seconds)


def next_large(current: int, mbps: float | None) -> int:
    """The large payload for the next sample of a link read at `mbps`: down to the largest size that takes at
    most `TARGET_SECONDS` once `current` takes over twice that, up to a larger one once it takes at most half
    of it (the margins keep a link near a boundary on one size, so its samples stay comparable)."""
    if not mbps:
        return current

    def seconds(size: int) -> float:
        return size * 8 / (mbps * 1e6)

    if seconds(current) > 2 * TARGET_SECONDS:
        return max((s for s in LARGE_SIZES if seconds(s) <= TARGET_SECONDS), default=LARGE_SIZES[0])
    return max((s for s in LARGE_SIZES if s > current and seconds(s) <= TARGET_SECONDS / 2), default=current)


def jittered(seconds: float, rng: random.Random) -> float:
    return seconds * rng.uniform(1 - JITTER, 1 + JITTER)


@dataclass
class LinkHistory:
    """A peer's samples and when to sample it next."""

    samples: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    large: int = FIRST_LARGE
    taken: int = 0  # samples whose readings were published
    failures: int = 0
    due: float = 0.0

    @property
    def small(self) -> int:
        return self.large // SMALL_SHARE

    def add(self, sample: Sample, now: float, interval: float, rng: random.Random) -> LinkMeasurement | None:
        """Take `sample` in; the link's new reading, or None while its payload sizes are still being found: a
        sample too small for the link (a payload that takes a few milliseconds, or rides a token bucket's
        burst, says little) or one whose large payload took over twice `TARGET_SECONDS` is followed at once
        (after `DUTY` times what it took, when it was too large) by one with the sizes its reading calls for.
        Otherwise the next sample is due after the next gap of the schedule, after `FIRST_GAP` when this one
        read low, and never sooner than `DUTY` times what this one took."""
        before = reading(self.samples)
        alone = sample_mbps(sample, self.samples)
        low = before is not None and alone < LOW_SHARE * _mbps(before)
        self.samples.append(sample)
        self.failures = 0
        measurement = reading(self.samples)
        assert measurement is not None, "the samples hold `sample` now"
        if sample.large_seconds > 2 * TARGET_SECONDS:  # over the budget: smaller payloads, whatever the window says
            sizes = next_large(sample.large, min(alone, _mbps(measurement)))
        else:
            sizes = next_large(sample.large, _mbps(measurement))
        if sizes != sample.large:
            self.large = sizes
            self.due = now + (DUTY * sample.seconds if sizes < sample.large else 0.0)
            return None
        self.taken += 1
        gap = FIRST_GAP if low else min(interval, FIRST_GAP * GAP_GROWTH ** (self.taken - 1))
        self.due = now + max(jittered(gap, rng), DUTY * sample.seconds)
        return measurement

    def failed(self, now: float, interval: float, rng: random.Random, *, timed_out: bool = False) -> None:
        """A sample could not be taken: try again later, the more failures the later (a timeout on the
        smallest payloads next)."""
        self.failures += 1
        self.due = now + jittered(min(interval, FIRST_GAP * GAP_GROWTH ** (self.failures - 1)), rng)
        if timed_out:
            self.large = LARGE_SIZES[0]

    def hold_seconds(self) -> float:
        """How long to ask the peer's probe slot for: twice what the payloads should take at the link's
        reading, plus a second; `messages.PROBE_MAX_HOLD` before the first reading."""
        current = reading(self.samples)
        if current is None or not current.bandwidth_mbps:
            return messages.PROBE_MAX_HOLD
        seconds = (self.large + 2 * self.small) * 8 / (current.bandwidth_mbps * 1e6)
        return min(messages.PROBE_MAX_HOLD, 2 * seconds + 6 * current.rtt_ms / 1000 + 1.0)


class Busy(Exception):
    """The peer's probe slot is held by another caller for `retry_after` more seconds."""

    def __init__(self, retry_after: float):
        super().__init__(f"probe slot busy for {retry_after:.1f} s")
        self.retry_after = retry_after


class Shared(Exception):
    """Another caller's payload reached the peer during the sample: it does not measure the link alone."""


# --- the measuring side ----------------------------------------------------------------------------------

class LinkProber:
    """Samples this node's links to the other nodes (see the module docstring); `links` holds the readings.
    `on_change` is called when a link is measured for the first time or its bandwidth moves by a quarter."""

    def __init__(self, p2p, own_id: str, *, interval: float = PROBE_INTERVAL,
                 on_change: Callable[[], None] | None = None, rng: random.Random | None = None):
        self.p2p, self.own_id = p2p, own_id
        self.interval = interval
        self.on_change = on_change
        self.rng = rng or random.Random()
        self.links: dict[str, LinkMeasurement] = {}
        self.history: dict[str, LinkHistory] = {}
        self._seen: dict[str, float] = {}  # peer -> when a listing last had it

    async def _probe(self, peer: str, size: int, meta: dict | None = None) -> tuple[float, ProbeReply]:
        """Send `size` payload bytes; (seconds, the reply's metadata)."""
        blob = messages.serialize_tensors([torch.zeros(size, dtype=torch.uint8)])
        request = runtime_pb2.ExpertRequest(tensors=blob, metadata=messages.pack_metadata(meta) if meta else b"")
        began = time.perf_counter()
        response = await asyncio.wait_for(self.p2p.call_protobuf_handler(
            PeerID.from_base58(peer), rpc.RPC_PROBE, request, runtime_pb2.ExpertResponse), CALL_TIMEOUT)
        elapsed = time.perf_counter() - began
        error = messages.response_error(response)
        if error is not None:
            raise messages.ReplyError(error, code=messages.response_error_code(response))
        try:
            reply = messages.unpack_metadata(response.metadata, ProbeReply)
        except messages.ProtocolError:  # an odd reply only means no slot information
            reply = ProbeReply()
        return elapsed, reply

    async def sample(self, peer: str, history: LinkHistory) -> Sample:
        """One sample of the link to `peer` at `history`'s sizes. Raises `Busy` when the peer's slot is taken,
        `Shared` when another caller's payload overlapped this one's, anything else when the peer fails."""
        _, slot = await self._probe(peer, 1, {"hold": history.hold_seconds()})
        if slot.granted is False:
            raise Busy(slot.retry_after if slot.retry_after is not None else FIRST_GAP)
        rtt = min([await rpc.timed_call(self.p2p, peer, rpc.RPC_PING, timeout=PING_TIMEOUT)
                   for _ in range(3)])
        first, first_reply = await self._probe(peer, history.small)
        large_seconds, large_reply = await self._probe(peer, history.large)
        second, second_reply = await self._probe(peer, history.small, {"release": True})
        if first_reply.shared or large_reply.shared or second_reply.shared:
            raise Shared()
        return Sample(time.monotonic(), rtt, history.small, history.large, min(first, second), large_seconds)

    async def measure(self, peer: str) -> LinkMeasurement | None:
        """Sample `peer` once now and return its reading (None when the sample could not be taken)."""
        history = self.history.setdefault(peer, LinkHistory())
        await self._measure(peer, history)
        return self.links.get(peer)

    async def _measure(self, peer: str, history: LinkHistory) -> None:
        try:
            sample = await self.sample(peer, history)
        except Busy as busy:  # the holder usually releases the slot well before its hold ends
            history.due = time.monotonic() + jittered(min(busy.retry_after, BUSY_RETRY), self.rng) + 0.05
            return
        except Shared:
            history.due = time.monotonic() + jittered(FIRST_GAP, self.rng)
            logger.debug("probe of %s overlapped another peer's: sampling again soon", short_id(peer))
            return
        except Exception as exc:  # safe: an unreachable or failing peer keeps its last reading and is retried later
            logger.debug("probing %s failed: %s", short_id(peer), exc)
            history.failed(time.monotonic(), self.interval, self.rng, timed_out=isinstance(exc, asyncio.TimeoutError))
            return
        before = self.links.get(peer)
        link = history.add(sample, time.monotonic(), self.interval, self.rng)
        if link is None:  # the sizes for this link are still being found: the next sample follows
            return
        self.links[peer] = link
        mbps = _mbps(link)
        if before is None or not before.bandwidth_mbps or \
                abs(mbps - before.bandwidth_mbps) > 0.25 * max(mbps, before.bandwidth_mbps):
            logger.info("link to %s: rtt %.1f ms, %.3g Mbps (%d samples)", short_id(peer), link.rtt_ms,
                        link.bandwidth_mbps, history.taken)
            if self.on_change is not None:
                self.on_change()

    def _forget_gone(self, current: list[str]) -> None:
        """Take the peers listed now in: a new one is sampled soon (in a jittered order); one not listed for
        `FORGET_AFTER` s is forgotten, with its samples (one DHT read can miss a record that is alive)."""
        now = time.monotonic()
        for peer in current:
            self._seen[peer] = now
            if peer not in self.history:
                self.history[peer] = LinkHistory(due=now + self.rng.uniform(0.0, 1.0))
        for gone in [p for p, seen in self._seen.items() if now - seen > FORGET_AFTER]:
            self._seen.pop(gone)
            self.history.pop(gone, None)
            self.links.pop(gone, None)

    async def run(self, stop: asyncio.Event, peers) -> None:
        """Sample the links to `peers()` (an async callable returning peer ids, re-read every few seconds) until
        `stop`, the most overdue first."""
        listed = -PEERS_REFRESH
        while not stop.is_set():
            now = time.monotonic()
            if now - listed >= PEERS_REFRESH:
                try:
                    current = [p for p in await peers() if p != self.own_id]
                    self._forget_gone(current)
                except Exception as exc:  # safe: a failed DHT read keeps the peers known so far until the next one
                    logger.debug("could not list peers to probe: %s", exc)
                listed = now
            due = min(self.history.items(), key=lambda item: item[1].due, default=None)
            if due is not None and due[1].due <= now:
                await self._measure(*due)
                wait = PROBE_PAUSE
            else:
                wait = PEERS_REFRESH if due is None else due[1].due - now
                wait = max(0.05, min(wait, listed + PEERS_REFRESH - now))
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass
