"""The coordinator's planning: node records -> planner cluster, and sticky re-planning (real planner)."""

from __future__ import annotations

import random

import pytest

from swarmnode.coordinator.cluster_view import cluster_from_records, plannable_records
from swarmnode.naming import short_id
from swarmnode.planner import SINK, SOURCE, CannotPlaceError, CostModel, ModelSpec, placement_problems, plan
from swarmnode.planner.live.sticky import Decision, decide, moved_blocks
from swarmnode.records import MAX_REASON_CHARS, LinkMeasurement, NodeRecord

# SmolLM2-135M: 30 blocks of (2 H^2 + 2 H kv + 3 H I + 2 H) fp32 weights
BLOCK_BYTES = (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) * 4
SMOL = ModelSpec(
    name="SmolLM2-135M",
    num_blocks=30,
    hidden_size=576,
    dtype_bytes=4,
    block_bytes=BLOCK_BYTES,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
)
B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
OVERHEAD = 60_000_000


def peer(seed: int) -> str:
    rng = random.Random(seed)
    return "12D3KooW" + "".join(rng.choice(B58) for _ in range(44))


A, B, C, D, E = (peer(i) for i in range(5))


def record(
    peer_id: str,
    max_blocks: int,
    throughput: float,
    *,
    links: dict[str, tuple[float, float | None]] | None = None,
    device: str = "cpu",
    manual: bool = False,
    overhead: int = OVERHEAD,
    state: str = "waiting",
) -> NodeRecord:
    return NodeRecord(
        peer_id=peer_id,
        state=state,
        device=device,
        dtype="float32",
        memory_bytes=overhead + max_blocks * BLOCK_BYTES + 100_000_000,
        cores=8,
        num_threads=8,
        block_bytes=BLOCK_BYTES,
        overhead_bytes=overhead,
        max_blocks=max_blocks,
        block_throughput=throughput,
        links={
            other: LinkMeasurement(rtt_ms=rtt, bandwidth_mbps=bandwidth)
            for other, (rtt, bandwidth) in (links or {}).items()
        },
        manual=manual,
    )


def swarm(*records: NodeRecord) -> dict[str, NodeRecord]:
    return {r.peer_id: r for r in records}


THREE = swarm(record(A, 12, 300.0), record(B, 12, 200.0), record(C, 10, 250.0))


def covers(decision: Decision, cluster) -> None:
    assert placement_problems(cluster, decision.placement) == []
    assert decision.throughput > 0
    assert sum(decision.flows[SOURCE].values()) == pytest.approx(decision.throughput)
    assert sum(t.get(SINK, 0.0) for t in decision.flows.values()) == pytest.approx(decision.throughput)


# ---------------------------------------------------------------------------------------------------
# cluster_from_records
# ---------------------------------------------------------------------------------------------------


def test_cluster_carries_measurements_and_links():
    nodes = swarm(
        record(A, 12, 300.0, links={B: (4.0, 900.0), C: (10.0, None), E: (1.0, 5.0)}),
        record(B, 12, 200.0, links={A: (6.0, 500.0)}, device="cuda:0", overhead=OVERHEAD + 5),
        record(C, 10, 250.0),
    )
    cluster = cluster_from_records(SMOL, nodes, workload=(100.0, 50.0))
    assert sorted(cluster.node_ids) == sorted([A, B, C])
    a, b = cluster.node(A), cluster.node(B)
    assert (a.device, b.device) == ("cpu", "gpu")
    assert (a.block_throughput, b.block_throughput) == (300.0, 200.0)
    assert (a.max_blocks, a.memory_bytes, a.cores) == (12, nodes[A].memory_bytes, 8)
    assert cluster.overhead_bytes == OVERHEAD + 5
    assert cluster.model.block_bytes == BLOCK_BYTES and cluster.model.num_key_value_heads == 3
    assert (cluster.workload.avg_input_tokens, cluster.workload.avg_output_tokens) == (100.0, 50.0)
    # both ends measured A-B: the lower bandwidth, the higher rtt (latency = rtt / 2)
    assert cluster.link(A, B).bandwidth_mbps == 500.0
    assert cluster.link(A, B).latency_ms == 3.0
    # A-C measured without bandwidth: the median bandwidth of the measured links (only A-B: 500)
    assert cluster.link(A, C).bandwidth_mbps == 500.0
    assert cluster.link(A, C).latency_ms == 5.0
    # unmeasured pairs and the coordinator get the median link; the link to unknown E is ignored
    assert cluster.network.intra_region.bandwidth_mbps == 500.0
    assert cluster.network.intra_region.latency_ms == pytest.approx(4.0)  # median of 3 and 5
    assert cluster.link(B, C) == cluster.network.intra_region
    assert cluster.network.coordinator_region == "swarm"
    assert {n.region for n in cluster.nodes} == {"swarm"}
    cost = CostModel(cluster)
    assert cost.capacity == {A: 12, B: 12, C: 10}
    assert cost.throughput(A, 6) == pytest.approx(50.0)


def test_defaults_without_measured_links_and_unmeasured_nodes():
    nodes = swarm(record(A, 20, 0.0), record(B, 20, 0.0, device="cuda"))
    cluster = cluster_from_records(SMOL, nodes)
    assert cluster.network.intra_region.bandwidth_mbps == 1000.0
    assert cluster.network.intra_region.latency_ms == 1.0
    assert cluster.network.links == ()
    assert cluster.node(A).block_throughput is None and cluster.node(A).cores == 8
    cost = CostModel(cluster)  # both fall back to the hardware cost model
    assert cost.throughput(A, 10) > 0 and cost.throughput(B, 10) > 0


def test_manual_nodes_are_skipped():
    nodes = swarm(
        record(A, 20, 300.0, links={C: (2.0, 100.0)}),
        record(B, 20, 300.0),
        record(C, 30, 900.0, manual=True),
    )
    cluster = cluster_from_records(SMOL, nodes)
    assert sorted(cluster.node_ids) == sorted([A, B])
    assert cluster.network.links == ()  # the link to the manual node is not the planner's business


def test_only_nodes_that_can_take_blocks_are_plannable():
    nodes = swarm(
        record(E, 12, 300.0),
        record(A, 12, 300.0, state="online"),
        record(B, 12, 300.0, state="offline"),
        record(C, 12, 300.0, state="measuring"),
        record(D, 0, 300.0),
    )
    assert list(plannable_records(nodes)) == sorted([A, E])


def test_not_enough_memory_and_no_nodes():
    with pytest.raises(CannotPlaceError, match=r"hold at most 20 of 30 blocks.*larger --leftover-mem"):
        cluster_from_records(SMOL, swarm(record(A, 10, 300.0), record(B, 10, 300.0)))
    with pytest.raises(CannotPlaceError, match="no plannable nodes"):
        cluster_from_records(SMOL, swarm(record(A, 30, 300.0, manual=True)))
    with pytest.raises(CannotPlaceError, match="no plannable nodes"):
        cluster_from_records(SMOL, {})


# ---------------------------------------------------------------------------------------------------
# decide
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["milp", "petals", "gma"])
def test_first_decision_covers_and_fits(algorithm):
    cluster = cluster_from_records(SMOL, THREE)
    decision = decide(cluster, None, algorithm=algorithm, time_limit=2.0)
    covers(decision, cluster)
    for node_id, (start, end) in decision.placement.items():
        assert end - start <= THREE[node_id].max_blocks
    assert decision.algorithm == algorithm
    assert decision.changed and decision.moved_blocks == sum(e - s for s, e in decision.placement.values())
    assert decision.reason.startswith("first placement")
    assert A not in decision.reason  # peer ids are abbreviated


def test_unchanged_cluster_keeps_the_placement():
    cluster = cluster_from_records(SMOL, THREE)
    first = decide(cluster, None, time_limit=2.0)
    again = decide(cluster, first.placement, time_limit=2.0)
    assert not again.changed and again.moved_blocks == 0
    assert again.algorithm == "keep" and again.placement == first.placement
    assert "no change" in again.reason
    # a heuristic's plan may have overlaps worth trimming once (no block loaded), then it is stable
    petals_first = decide(cluster, None, algorithm="petals")
    settled = decide(cluster, petals_first.placement, algorithm="petals")
    assert settled.moved_blocks == 0
    assert not decide(cluster, settled.placement, algorithm="petals").changed


def test_a_range_larger_than_the_node_now_offers_is_re_planned_to_fit():
    """A node whose processes grew beyond its serving reserve announces one block fewer: a change below the
    coordinator's threshold, but its range would leave it short of KV cache, so it is an event of its own
    and the sticky plan clips the range."""
    from types import SimpleNamespace

    from swarmnode.coordinator.events import RangeTooLarge
    from swarmnode.coordinator.service import CHANGE_THRESHOLD, Coordinator

    first = decide(cluster_from_records(SMOL, THREE), None, time_limit=2.0)
    largest = max(first.placement, key=lambda p: first.placement[p][1] - first.placement[p][0])
    start, end = first.placement[largest]
    shrunk = dict(THREE)
    shrunk[largest] = THREE[largest].model_copy(update={"max_blocks": end - start - 1})
    assert 1 / (end - start) < CHANGE_THRESHOLD  # no OfferChanged: the range alone makes it a change
    published = SimpleNamespace(assignments=first.placement)  # what `_events` reads of the placement
    stand_in = SimpleNamespace(model=SMOL, planned_from=dict(THREE), config=SimpleNamespace(workload=None))
    events = Coordinator._events(stand_in, shrunk, published)
    assert events == [RangeTooLarge(largest, end - start, end - start - 1)]
    assert "now offers" in str(events[0])
    assert Coordinator._events(stand_in, dict(THREE), published) == []
    cluster = cluster_from_records(SMOL, shrunk)
    again = decide(cluster, first.placement, time_limit=2.0, events=[str(e) for e in events])
    covers(again, cluster)
    assert again.changed
    assert again.placement[largest][1] - again.placement[largest][0] <= end - start - 1


def test_join_adds_the_node_and_moves_fewer_blocks_than_a_fresh_plan():
    cluster = cluster_from_records(SMOL, THREE)
    first = decide(cluster, None, time_limit=2.0)
    grown = cluster_from_records(SMOL, {**THREE, D: record(D, 12, 400.0)})
    event = f"node {D} joined"
    decision = decide(grown, first.placement, events=[event], time_limit=1.0)
    covers(decision, grown)
    assert D in decision.placement
    assert decision.reason.startswith(f"node {short_id(D)} joined")
    # with a higher bar for moving blocks the sticky plan is chosen; it loads only the new node's window
    sticky = decide(grown, first.placement, events=[event], improvement=1.0, time_limit=1.0)
    covers(sticky, grown)
    assert sticky.algorithm == "extend" and D in sticky.placement
    assert sticky.moved_blocks == sticky.placement[D][1] - sticky.placement[D][0]
    assert f"added {short_id(D)} with blocks" in sticky.reason and "below the 100% threshold" in sticky.reason
    fresh = plan(grown, "milp", time_limit=1.0)
    assert sticky.moved_blocks < moved_blocks(dict(fresh.placement.items()), first.placement)
    for chosen in (decision, sticky):
        if chosen.algorithm != "milp":
            assert chosen.moved_blocks < moved_blocks(dict(fresh.placement.items()), first.placement)


def test_weak_joiner_is_added_without_moving_anyone():
    strong = swarm(record(A, 12, 1200.0), record(B, 12, 1200.0), record(C, 12, 1200.0))
    cluster = cluster_from_records(SMOL, strong)
    first = decide(cluster, None, time_limit=2.0)
    grown = cluster_from_records(SMOL, {**strong, D: record(D, 6, 60.0)})
    decision = decide(grown, first.placement, events=[f"node {D} joined"], time_limit=2.0)
    covers(decision, grown)
    assert decision.algorithm == "extend"
    assert {n: r for n, r in decision.placement.items() if n != D} == first.placement
    assert decision.moved_blocks == 6 and decision.placement[D][1] - decision.placement[D][0] == 6
    assert "threshold" in decision.reason


def test_leave_yields_a_covering_placement():
    four = {**THREE, D: record(D, 12, 400.0)}
    cluster = cluster_from_records(SMOL, four)
    first = decide(cluster, None, algorithm="petals")
    gone = max(first.placement, key=lambda n: first.placement[n][0])  # the last stage leaves
    rest = {n: r for n, r in four.items() if n != gone}
    shrunk = cluster_from_records(SMOL, rest)
    event = f"node {gone} left"
    decision = decide(shrunk, first.placement, events=[event], time_limit=2.0)
    covers(decision, shrunk)
    assert gone not in decision.placement
    assert decision.reason.startswith(f"node {short_id(gone)} left")
    assert decision.changed
    for algorithm in ("petals", "gma"):
        covers(decide(shrunk, first.placement, algorithm=algorithm, events=[event]), shrunk)


def test_repair_extends_neighbours_into_the_gap():
    nodes = swarm(record(A, 15, 600.0), record(B, 15, 600.0), record(C, 15, 600.0))
    cluster = cluster_from_records(SMOL, nodes)
    previous = {A: (0, 10), B: (10, 20), C: (20, 30)}
    shrunk = cluster_from_records(SMOL, {n: r for n, r in nodes.items() if n != B})
    decision = decide(shrunk, previous, algorithm="gma", events=[f"node {B} left"], improvement=10.0)
    covers(decision, shrunk)
    assert decision.algorithm == "repair"
    a, c = decision.placement[A], decision.placement[C]
    assert a[0] == 0 and c[1] == 30 and a[1] >= c[0]  # both grew towards the gap, nobody slid
    assert decision.moved_blocks == 10
    assert "extended" in decision.reason
    assert cluster.has_node(B)


def test_idle_node_takes_the_gap():
    nodes = swarm(record(A, 10, 600.0), record(B, 10, 600.0), record(C, 10, 600.0), record(D, 10, 600.0))
    previous = {A: (0, 10), B: (10, 20), C: (20, 30)}
    shrunk = cluster_from_records(SMOL, {n: r for n, r in nodes.items() if n != B})
    decision = decide(shrunk, previous, algorithm="gma", events=[f"node {B} left", f"node {D} joined"])
    covers(decision, shrunk)
    assert decision.algorithm == "repair"
    assert decision.placement == {A: (0, 10), D: (10, 20), C: (20, 30)} and decision.moved_blocks == 10


def test_fresh_plan_when_the_old_one_cannot_be_repaired():
    # B served the first blocks; covering them takes a chain of moves (C down, then A down), which the
    # repair does not search: the fresh plan is taken whatever the threshold
    nodes = swarm(record(A, 15, 600.0), record(C, 15, 600.0))
    previous = {B: (0, 10), A: (10, 20), C: (20, 30)}
    cluster = cluster_from_records(SMOL, nodes)
    decision = decide(cluster, previous, algorithm="gma", events=[f"node {B} left"], improvement=10.0)
    covers(decision, cluster)
    assert decision.algorithm == "gma"
    assert "cannot be repaired" in decision.reason and "[0, 5)" in decision.reason


def test_reason_is_short_and_mentions_every_event():
    cluster = cluster_from_records(SMOL, THREE)
    first = decide(cluster, None, algorithm="gma")
    events = [f"node {p} joined" for p in (A, B)]
    decision = decide(cluster, first.placement, algorithm="gma", events=events)
    for p in (A, B):
        assert short_id(p) in decision.reason and p not in decision.reason
    many = [f"node {peer(100 + i)} joined" for i in range(40)]
    assert len(decide(cluster, first.placement, algorithm="gma", events=many).reason) <= MAX_REASON_CHARS
    many = [f"node {peer(100 + i)} changed its offer or speed: {'a long explanation ' * 10}" for i in range(3)]
    unbounded = decide(cluster, first.placement, algorithm="gma", events=many).reason
    assert len(unbounded) > MAX_REASON_CHARS
    bounded = decide(cluster, first.placement, algorithm="gma", events=many, max_reason_chars=MAX_REASON_CHARS).reason
    assert len(bounded) <= MAX_REASON_CHARS and bounded == unbounded[: MAX_REASON_CHARS - 1] + "…"


def test_overlaps_are_trimmed_without_loading_blocks():
    cluster = cluster_from_records(SMOL, THREE)
    previous = {A: (0, 12), B: (10, 20), C: (20, 30)}  # B holds 10 blocks: 20 tok/s, the bottleneck
    decision = decide(cluster, previous, algorithm="gma")
    covers(decision, cluster)
    assert decision.algorithm == "trim" and decision.changed and decision.moved_blocks == 0
    assert decision.placement[B] == (12, 20) and decision.throughput == pytest.approx(25.0)
    assert f"shrank {short_id(B)} to [12, 20)" in decision.reason


# ---------------------------------------------------------------------------------------------------
# Why a node is unused (status and the node's own note say it)
# ---------------------------------------------------------------------------------------------------


def test_a_node_that_adds_nothing_is_explained_and_one_that_would_add_is_named():
    from swarmnode.planner.live.unused import best_addition, unused_reasons

    # A (fast) holds 0-15 and B (slow) 15-30: every token crosses B, and a 5-block node cannot go round it
    nodes = swarm(record(A, 15, 900.0), record(B, 15, 100.0), record(D, 5, 900.0), record(E, 15, 900.0))
    cluster = cluster_from_records(SMOL, nodes)
    placement = {A: (0, 15), B: (15, 30)}
    reasons = unused_reasons(cluster, placement)
    assert set(reasons) == {D, E}
    assert reasons[D].startswith("adds no throughput"), reasons[D]
    window, gain = best_addition(cluster, placement, E)
    assert window == (15, 30) and gain > 0  # E beside B doubles the bottleneck stage
    assert f"would add {gain:.0f} tok/s" in reasons[E] and "blocks 15-29" in reasons[E]
    assert unused_reasons(cluster, {**placement, D: (0, 5), E: (15, 30)}) == {}
    spof = unused_reasons(cluster, placement, single_points=[(15, 30)], min_replicas=2)
    assert "could replicate single-point blocks 15-19" in spof[D]
    # no offer waits unplanned while it could help: E is added where it helps, D (which cannot) is not
    from swarmnode.planner.live.unused import add_helpful

    filled, added = add_helpful(cluster, placement)
    assert filled == {**placement, E: (15, 30)} and [(n, w) for n, w, _g in added] == [(E, (15, 30))]
    assert added[0][2] == pytest.approx(gain)


def test_nodes_kept_out_of_planning_are_explained():
    from swarmnode.coordinator.service import explained_unused, unplannable_reasons

    everyone = swarm(record(A, 12, 300.0), record(B, 0, 300.0), record(C, 10, 250.0, state="measuring"),
                     record(D, 10, 250.0, manual=True), record(E, 10, 250.0, state="offline"))
    plannable = plannable_records(everyone)
    assert set(plannable) == {A}
    reasons = unplannable_reasons(everyone, plannable, {A}, {A: 2})
    assert set(reasons) == {A, B, C}  # a manual node serves its own blocks; a departing one is not unused
    assert "does not answer pings (2 missed" in reasons[A]
    assert "holds no block" in reasons[B] and "offer more memory" in reasons[B]
    assert "still measuring" in reasons[C]
    long = {B: "x" * 1000, A: "placed", C: "y"}
    kept = explained_unused(long, {A: (0, 30)})
    assert set(kept) == {B, C} and kept[B].endswith("…")
    from swarmnode.records import MAX_UNUSED_REASON_CHARS, PlacementRecord

    assert len(kept[B]) == MAX_UNUSED_REASON_CHARS
    record_ = PlacementRecord(version=1, term=1, coordinator=A, algorithm="milp", reason="r", created=0.0,
                              num_blocks=30, assignments={A: (0, 30)}, min_replicas=2,
                              single_points=((0, 30),), unused=kept)
    assert PlacementRecord(**record_.to_dict()) == record_


@pytest.mark.parametrize("change,message", [
    (dict(unused={A: "placed and unused at once"}), "outside the assignments"),
    (dict(unused={"not-a-peer": "why"}), "outside the assignments"),
    (dict(unused={B: "z" * 1000}), "over"),
    (dict(single_points=((20, 31),)), "runs past"),
    (dict(single_points=((5, 5),)), "not a range"),
    (dict(min_replicas=0), "greater than or equal to 1"),
])
def test_placement_records_with_bad_redundancy_fields_are_refused(change, message):
    from pydantic import ValidationError

    from swarmnode.records import PlacementRecord

    fields = dict(version=1, term=1, coordinator=A, algorithm="milp", reason="r", created=0.0, num_blocks=30,
                  assignments={A: (0, 30)})
    with pytest.raises(ValidationError, match=message):
        PlacementRecord(**fields, **change)
