"""Link probes (`swarmnode.server.probe`): the reading from samples, the schedule, the payload sizes, the
receiver's probe slot, and a prober against a simulated link of known rate, alone and with other probers
sending into the same node at the same time."""

from __future__ import annotations

import asyncio
import random
import time

import msgpack
import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.messages import ProbeRequest
from swarmnode.server.handler import BlockHandler, SessionLimits
from swarmnode.server.probe import (
    DUTY,
    FIRST_GAP,
    FIRST_LARGE,
    FORGET_AFTER,
    HISTORY,
    JITTER,
    KIB,
    LARGE_SIZES,
    MAX_SPEEDUP,
    WINDOW,
    LinkHistory,
    LinkProber,
    ProbeSlot,
    Sample,
    next_large,
    reading,
    sample_mbps,
)

MIB = 1024 * KIB


def timed(small: int, large: int, mbps: float, fixed: float = 0.002, *, extra_small: float = 0.0,
          extra_large: float = 0.0, rtt: float = 0.001, at: float = 0.0) -> Sample:
    """A sample of a link that moves `mbps` after a `fixed` cost per call, with added delays."""
    def seconds(size: int) -> float:
        return fixed + size * 8 / (mbps * 1e6)

    return Sample(at, rtt, small, large, seconds(small) + extra_small, seconds(large) + extra_large)


# --- readings -----------------------------------------------------------------------------------------------

def test_the_slope_cancels_the_fixed_cost_of_a_call():
    for fixed in (0.0005, 0.003, 0.05):  # the old way read 256 KiB / (fixed + transfer - rtt)
        link = reading([timed(256 * KIB, MIB, 20.0, fixed)])
        assert link.bandwidth_mbps == pytest.approx(20.0, rel=1e-3)
    assert reading([]) is None


def test_a_reading_takes_the_fastest_time_of_each_size_over_the_window():
    clean = timed(256 * KIB, MIB, 20.0)
    slow_large = timed(256 * KIB, MIB, 20.0, extra_large=0.3)  # contention on the large payload: lower
    slow_small = timed(256 * KIB, MIB, 20.0, extra_small=0.03)  # on the small one: higher, alone
    assert reading([slow_large]).bandwidth_mbps < 15
    assert reading([slow_small]).bandwidth_mbps > 21
    # one quiet moment per size is enough, whichever samples they come from
    assert reading([slow_large, slow_small]).bandwidth_mbps == pytest.approx(20.0, rel=1e-3)
    assert reading([slow_small, clean, slow_large]).bandwidth_mbps == pytest.approx(20.0, rel=1e-3)
    assert reading([timed(256 * KIB, MIB, 20.0, rtt=r) for r in (0.004, 0.002, 0.003)]).rtt_ms == 2.0


def test_old_samples_leave_the_window_and_other_sizes_do_not_count():
    fast = [timed(256 * KIB, MIB, 100.0) for _ in range(3)]
    slow = [timed(256 * KIB, MIB, 10.0) for _ in range(WINDOW)]
    assert reading(fast + slow[:1]).bandwidth_mbps == pytest.approx(100.0, rel=1e-3)  # one slow sample: contention?
    assert reading(fast + slow).bandwidth_mbps == pytest.approx(10.0, rel=1e-3)  # WINDOW of them: the link
    # samples of other sizes than the newest one's are not compared with it, nor those before them
    assert reading([*fast, timed(64 * KIB, 256 * KIB, 10.0)]).bandwidth_mbps == pytest.approx(10.0, rel=1e-3)
    assert reading([*fast, timed(64 * KIB, 256 * KIB, 10.0), slow[0]]).bandwidth_mbps == pytest.approx(10.0, rel=1e-3)


def test_a_slope_never_claims_more_than_the_whole_call_allows():
    # a large payload timed faster than the small one (noise on a fast link): bounded by the whole call
    sample = Sample(0.0, 0.001, 256 * KIB, MIB, small_seconds=0.02, large_seconds=0.01)
    assert reading([sample]).bandwidth_mbps == pytest.approx(MAX_SPEEDUP * MIB * 8 / 0.01 / 1e6, rel=1e-3)
    # two small payloads that both stalled (a lost packet each, say) cannot make a slow link look fast
    stalled = timed(16 * KIB, 64 * KIB, 0.3, extra_small=1.2)
    assert reading([stalled]).bandwidth_mbps <= MAX_SPEEDUP * 64 * KIB * 8 / stalled.large_seconds / 1e6 < 2.1 * 0.3


def test_one_sample_is_judged_against_the_fastest_small_time():
    history = [timed(256 * KIB, MIB, 20.0)]
    late = timed(256 * KIB, MIB, 20.0, extra_small=0.05, extra_large=0.05)
    assert sample_mbps(late, history) < 20.0 * 0.9  # only its large payload's delay shows
    assert sample_mbps(history[0], history) == pytest.approx(20.0, rel=1e-3)


# --- sizes and schedule ------------------------------------------------------------------------------------

def test_payload_sizes_follow_the_link_with_margins():
    assert next_large(256 * KIB, None) == 256 * KIB
    assert FIRST_LARGE == 64 * KIB
    assert next_large(256 * KIB, 500.0) == MIB  # a fast link: the largest payload
    assert next_large(256 * KIB, 20.0) == MIB  # 1 MiB takes 0.42 s at 20 Mbit/s
    assert next_large(256 * KIB, 0.5) == 64 * KIB  # 256 KiB would take 4.2 s: down to what fits in 2 s
    assert next_large(64 * KIB, 0.5) == 64 * KIB
    # near a boundary a link keeps its size: a larger one must fit in half the target, a smaller one is
    # taken only when the current one takes over twice the target
    assert next_large(256 * KIB, 8.0) == 256 * KIB  # 1 MiB would take 1.05 s
    assert next_large(256 * KIB, 1.0) == 256 * KIB  # 256 KiB takes 2.1 s
    assert next_large(64 * KIB, 2.0) == 64 * KIB  # 256 KiB would take 1.05 s
    assert next_large(64 * KIB, 2.2) == 256 * KIB
    assert all(next_large(size, mbps) in LARGE_SIZES for size in LARGE_SIZES for mbps in (0.01, 1, 10, 1e4))


def test_samples_come_sooner_at_start_and_slower_later_and_never_hog_the_link():
    rng = random.Random(1)
    history = LinkHistory(large=MIB)
    gaps = []
    for _ in range(8):
        history.add(timed(history.small, history.large, 500.0), 1000.0, 300.0, rng)
        gaps.append(history.due - 1000.0)
    expected = [min(300.0, FIRST_GAP * 3 ** i) for i in range(8)]
    assert all(e * (1 - JITTER) <= g <= e * (1 + JITTER) for g, e in zip(gaps, expected)), gaps
    assert len(history.samples) == HISTORY
    # a slow link: the gap is at least DUTY times what the sample took
    slow = LinkHistory(large=64 * KIB)
    sample = timed(slow.small, slow.large, 0.5)
    slow.add(sample, 0.0, 300.0, rng)
    assert slow.due >= DUTY * sample.seconds > 2 * FIRST_GAP


def test_a_low_sample_is_checked_again_soon():
    rng = random.Random(2)
    history = LinkHistory(large=MIB)
    for _ in range(4):
        history.add(timed(history.small, history.large, 100.0), 0.0, 300.0, rng)
    assert history.due > 100.0
    history.add(timed(history.small, history.large, 30.0), 0.0, 300.0, rng)
    assert history.due <= FIRST_GAP * (1 + JITTER)


def test_failures_back_off_and_a_timeout_shrinks_the_payload():
    rng = random.Random(3)
    history = LinkHistory()
    dues = []
    for _ in range(6):
        history.failed(0.0, 300.0, rng)
        dues.append(history.due)
    expected = [min(300.0, FIRST_GAP * 3 ** i) for i in range(6)]
    assert all(e * (1 - JITTER) <= d <= e * (1 + JITTER) for d, e in zip(dues, expected)), dues
    assert history.large == FIRST_LARGE
    history.failed(0.0, 300.0, rng, timed_out=True)
    assert history.large == LARGE_SIZES[0]


def test_the_slot_asked_for_fits_the_sample():
    history = LinkHistory(large=MIB)
    assert history.hold_seconds() == messages.PROBE_MAX_HOLD  # nothing known yet
    history.add(timed(history.small, history.large, 20.0), 0.0, 300.0, random.Random(4))
    assert 1.0 < history.hold_seconds() < 2 * (history.large + 2 * history.small) * 8 / 20e6 + 1.1
    slow = LinkHistory()
    slow.add(timed(slow.small, slow.large, 0.05), 0.0, 300.0, random.Random(4))
    assert slow.hold_seconds() == messages.PROBE_MAX_HOLD  # at most


def test_the_first_samples_find_the_sizes_before_a_reading_is_published():
    rng = random.Random(5)
    fast = LinkHistory()
    assert fast.large == LARGE_SIZES[0]  # the first sample is the smallest
    # 64 KiB at 20 Mbit/s behind a 64 KiB burst: far too small to say anything, so nothing is published
    assert fast.add(timed(fast.small, fast.large, 60.0), 10.0, 300.0, rng) is None
    assert fast.large == MIB and fast.due == 10.0 and fast.taken == 0  # the next one, at once
    link = fast.add(timed(fast.small, fast.large, 20.0), 11.0, 300.0, rng)
    assert link.bandwidth_mbps == pytest.approx(20.0, rel=1e-3) and fast.taken == 1
    # a link that got much slower: a sample over twice the target shrinks the payloads at once (after the
    # duty gap), whatever the older samples say
    sample = timed(fast.small, fast.large, 0.5)
    assert fast.add(sample, 20.0, 300.0, rng) is None
    assert fast.large == 64 * KIB and fast.due == pytest.approx(20.0 + DUTY * sample.seconds)
    assert fast.add(timed(fast.small, fast.large, 0.5), 200.0, 300.0, rng).bandwidth_mbps == pytest.approx(0.5, rel=1e-3)
    # a slow link is read from its first sample
    slow = LinkHistory()
    assert slow.add(timed(slow.small, slow.large, 0.3), 0.0, 300.0, rng).bandwidth_mbps == pytest.approx(0.3, rel=1e-3)


# --- the receiver's probe slot -------------------------------------------------------------------------------

def test_one_caller_holds_the_slot_at_a_time():
    slot = ProbeSlot()
    hold, release, plain = ProbeRequest(hold=2.0), ProbeRequest(release=True), ProbeRequest()
    assert slot.answer("a", 0.0, plain) == {}  # nobody holds it: a plain probe is just a probe
    assert slot.answer("a", 0.0, hold) == {"granted": True}
    assert slot.answer("b", 0.5, hold) == {"granted": False, "retry_after": 1.5}
    assert slot.answer("a", 0.6, plain) == {}
    assert slot.answer("a", 0.7, release) == {}
    assert slot.answer("b", 0.8, hold) == {"granted": True}  # released: the next one gets it
    assert slot.answer("c", 3.0, ProbeRequest(hold=1e3)) == {"granted": True}  # expired: taken over, for at most
    assert slot.answer("a", 3.0, hold) == {"granted": False, "retry_after": messages.PROBE_MAX_HOLD}  # the bound


def test_a_payload_during_another_callers_slot_spoils_both_samples():
    slot = ProbeSlot()
    slot.answer("a", 0.0, ProbeRequest(hold=5.0))
    assert slot.answer("old-peer", 1.0, ProbeRequest()) == {"shared": True}  # one that does not reserve
    assert slot.answer("a", 2.0, ProbeRequest()) == {"shared": True}
    assert slot.answer("a", 2.1, ProbeRequest(release=True)) == {"shared": True}
    slot.answer("a", 3.0, ProbeRequest(hold=5.0))  # a new slot starts clean
    assert slot.answer("a", 3.1, ProbeRequest(release=True)) == {}


def probe_request(size: int, meta: dict | None = None) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(tensors=messages.serialize_tensors([torch.zeros(size, dtype=torch.uint8)]),
                                     metadata=messages.pack_metadata(meta) if meta is not None else b"")


_PEER_PREFIX = PeerID.from_base58("12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j").to_bytes()[:-32]


def peer(index: int) -> PeerID:
    return PeerID(_PEER_PREFIX + index.to_bytes(32, "big"))


def handler() -> BlockHandler:
    return BlockHandler(lambda: [], limits=SessionLimits(), info=lambda: None)


def test_the_handler_keeps_plain_probes_as_they_were_and_checks_probe_metadata():
    node = handler()

    def call(size, meta, who):
        context = P2PContext(rpc.RPC_PROBE, peer(0), peer(who))
        reply = asyncio.run(node.rpc_probe(probe_request(size, meta), context))
        return msgpack.unpackb(reply.metadata, raw=False)

    assert call(100, None, 1) == {"received": 100}
    assert call(1, {"hold": 3.0}, 1) == {"received": 1, "granted": True}
    busy = call(1, {"hold": 3.0}, 2)
    assert busy["granted"] is False and 0 < busy["retry_after"] <= 3.0
    assert call(10, None, 2) == {"received": 10, "shared": True}
    assert call(10, {"release": True}, 1) == {"received": 10, "shared": True}
    assert call(1, {"hold": 3.0}, 2) == {"received": 1, "granted": True}
    for bad in ({"hold": -1.0}, {"hold": "long"}, {"stay": True}):
        assert "ProbeRequest" in call(1, bad, 3)["error"]


# --- a prober against a simulated link ------------------------------------------------------------------------

class SharedLink:
    """A receiver's link of `mbps`, shared equally by the payloads crossing it at the same time (each call also
    costs `fixed` s, and `burst` bytes pass at once after the link has been idle, as a token bucket's do)."""

    def __init__(self, mbps: float, fixed: float = 0.003, burst: int = 64 * KIB):
        self.rate = mbps * 1e6 / 8
        self.fixed, self.burst = fixed, burst
        self.active = 0
        self.idle_since = 0.0

    async def transfer(self, size: int) -> None:
        await asyncio.sleep(self.fixed / 2)
        if self.active == 0:
            size = max(0, size - min(self.burst, int((time.monotonic() - self.idle_since) * self.rate)))
        self.active += 1
        try:
            remaining, last = float(size), time.monotonic()
            while remaining > 0:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                remaining -= (now - last) * self.rate / self.active
                last = now
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle_since = time.monotonic()
        await asyncio.sleep(self.fixed / 2)


class FakeP2P:
    """Calls from one prober (`me`) into one node's handler, across `link`."""

    def __init__(self, node: BlockHandler, link: SharedLink, me: int):
        self.node, self.link, self.me = node, link, me

    async def call_protobuf_handler(self, peer_id, name, request, response_type):
        context = P2PContext(name, peer(0), peer(self.me))
        if name == rpc.RPC_PING:
            await asyncio.sleep(self.link.fixed)
            return await self.node.rpc_ping(request, context)
        await self.link.transfer(sum(len(t.buffer) for t in request.tensors))
        return await self.node.rpc_probe(request, context)


TARGET = str(peer(0).to_base58())


def test_a_prober_reads_the_link_not_the_call():
    link = SharedLink(20.0, fixed=0.01)  # the old way: 256 KiB / (0.105 + 0.01 - 0.01 s) read ~14% high at best
    prober = LinkProber(FakeP2P(handler(), link, 1), "me")

    async def until_read():
        for _ in range(3):
            if await prober.measure(TARGET) is not None:
                return prober.links[TARGET]
        raise AssertionError("no reading after three samples")

    link_reading = asyncio.run(until_read())
    # real time: a busy CPU stalling the simulated transfer can only lower the reading
    assert 0.75 * 20 <= link_reading.bandwidth_mbps <= 1.1 * 20, link_reading
    assert prober.history[TARGET].large == messages.MAX_PROBE_BYTES  # grown to the largest payload


def test_probers_sending_into_one_node_take_turns():
    node, link = handler(), SharedLink(40.0)
    probers = [LinkProber(FakeP2P(node, link, i + 1), f"me{i}") for i in range(3)]

    async def sample_until_measured(prober):
        while TARGET not in prober.links:
            await prober.measure(TARGET)
            await asyncio.sleep(max(0.0, prober.history[TARGET].due - time.monotonic()) if TARGET not in prober.links
                                else 0.0)
        return prober.links[TARGET]

    async def together():
        return await asyncio.gather(*(sample_until_measured(p) for p in probers))

    began = time.monotonic()
    readings = asyncio.run(asyncio.wait_for(together(), 60))
    for link_reading in readings:  # sharing the link, each would read a third to a half of it
        assert 0.7 * 40 <= link_reading.bandwidth_mbps <= 1.1 * 40, readings
    assert time.monotonic() - began < 10  # a prober waiting for the slot asks again soon, not when the hold ends


def test_a_peer_missing_from_one_listing_keeps_its_samples():
    prober = LinkProber(None, "me")
    prober._forget_gone(["x", "y"])
    prober.links["x"] = reading([timed(256 * KIB, MIB, 20.0)])
    prober.history["x"].samples.append(timed(256 * KIB, MIB, 20.0))
    prober._forget_gone(["y"])  # a DHT read that missed x's record
    assert "x" in prober.links and len(prober.history["x"].samples) == 1
    prober._seen["x"] -= FORGET_AFTER + 1  # not listed for longer than a record lives: gone
    prober._forget_gone(["y"])
    assert "x" not in prober.links and "x" not in prober.history and set(prober.history) == {"y"}
