"""IWRR per-request pipelines with KV-cache high-water masking (Helix §5)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from swarmnode.planner import (
    SINK,
    SOURCE,
    KVTracker,
    Placement,
    RouterState,
    RoutingTable,
    evaluate,
    load_shared_cluster,
    next_hop,
    petals,
    route,
)
from swarmnode.planner.costs.roofline import CostParams, kv_bytes_per_token, kv_free_bytes
from swarmnode.planner.routing import kv_capacity_bytes
from swarmnode.planner.simulator.serving import serving_from_placement
from swarmnode.planner.swrr import IWRR


def test_smooth_weighted_round_robin_follows_weights():
    table = RoutingTable(weights={SOURCE: {"a": 5.0, "b": 1.0, "c": 2.0}}, ranges={}, num_blocks=1)
    state = RouterState()
    picks = [next_hop(table, state, SOURCE) for _ in range(800)]
    assert Counter(picks) == {"a": 500, "b": 100, "c": 200}
    window = picks[:8]  # interleaved, not bursts: every window of 8 picks has the exact mix
    assert Counter(window) == {"a": 5, "b": 1, "c": 2}
    assert picks[:8] != ["a"] * 5 + ["c"] * 2 + ["b"]


def _table(placement, flows, num_blocks):
    return RoutingTable.from_flows(placement, flows, num_blocks)


def test_pipelines_follow_the_max_flow():
    cluster = load_shared_cluster("helix-single-24")
    placement = petals(cluster)
    ev = evaluate(cluster, placement)
    table = RoutingTable.from_evaluation(placement, ev, 80)
    state = RouterState()
    first_hops = Counter()
    for _ in range(500):
        stages = route(table, state)
        assert stages[0].start == 0 and stages[-1].end == 80
        assert all(a.end == b.start for a, b in itertools.pairwise(stages))
        for stage in stages:
            start, end = placement[stage.node]
            assert start <= stage.start < stage.end == end
        first_hops[stages[0].node] += 1
    total = sum(ev.flows[SOURCE].values())
    for node, flow in ev.flows[SOURCE].items():
        assert first_hops[node] == pytest.approx(500 * flow / total, abs=1.0)


def test_kv_high_water_masks_nodes():
    placement = Placement({"a": (0, 2), "b": (0, 2), "c": (2, 4)})
    flows = {SOURCE: {"a": 3.0, "b": 1.0}, "a": {"c": 3.0}, "b": {"c": 1.0}, "c": {SINK: 4.0}}
    table = _table(placement, flows, 4)
    state = RouterState()
    for _ in range(20):
        stages = route(table, state, kv_load={"a": 0.95, "b": 0.2, "c": 0.5}, high_water=0.9)
        assert [s.node for s in stages] == ["b", "c"]
    assert route(table, state, kv_load={"c": 0.99}) is None  # every pipeline needs c: wait
    assert route(table, state, kv_load={"a": 0.99, "b": 0.99}) is None


def test_kv_tracker_reserves_and_releases():
    cluster = load_shared_cluster("helix-single-24")
    placement = petals(cluster)
    ev = evaluate(cluster, placement)
    table = RoutingTable.from_evaluation(placement, ev, 80)
    tracker = KVTracker.for_cluster(cluster, placement)
    state = RouterState()
    stages = route(table, state, kv_load=tracker.load())
    tracker.admit("r1", stages, input_tokens=1000)
    load = tracker.load()
    per_token = 2 * 1024 * 2  # LLaMA-2 70B: GQA KV bytes per token and block
    for stage in stages:
        expected = (1000 + cluster.workload.avg_output_tokens) * per_token * (stage.end - stage.start)
        assert load[stage.node] * tracker.capacity[stage.node] == pytest.approx(expected)
    with pytest.raises(ValueError, match="already admitted"):
        tracker.admit("r1", stages, input_tokens=5)
    tracker.release("r1")
    assert all(v == 0 for v in tracker.load().values())
    # admitting requests until a node passes the mark takes it out of the rotation
    count = 0
    while True:
        stages = route(table, state, kv_load=tracker.load(), high_water=0.9)
        if stages is None:
            break
        tracker.admit(f"q{count}", stages, input_tokens=2000)
        count += 1
        assert count < 100000
    assert count > 0 and any(v > 0.9 for v in tracker.load().values())


def test_router_and_simulator_pick_alike():
    """One smooth weighted round-robin rule: the client's router and the simulator's IWRR make the same
    picks for the same flows (successors in name order, ties to the first)."""
    flows = {SOURCE: {"b": 1.0, "a": 1.0, "c": 2.0}}
    table = RoutingTable.from_flows({}, flows, 1)
    state = RouterState()
    names = sorted(flows[SOURCE])
    iwrr = IWRR(names, [flows[SOURCE][n] for n in names])
    picks = [next_hop(table, state, SOURCE) for _ in range(12)]
    assert picks == [iwrr.pick() for _ in range(12)]
    assert picks[:4] == ["c", "a", "b", "c"]
    masked = [next_hop(table, state, SOURCE, allowed={"a", "b"}) for _ in range(4)]
    assert sorted(masked) == ["a", "a", "b", "b"]


def test_kv_room_is_the_cost_models():
    """The router's KV estimate, the cost model and the simulator count the same room: memory less the
    framework overhead, the runtime reserve of every GPU and the weights."""
    cluster = load_shared_cluster("helix-single-24")
    placement = petals(cluster)
    tracker = KVTracker.for_cluster(cluster, placement)
    model = serving_from_placement(cluster, placement)
    reserve = CostParams().runtime_reserve_bytes
    for n, (s, e) in placement.items():
        node = cluster.node(n)
        weights = (e - s) * cluster.model.block_bytes
        expected = node.memory_bytes - cluster.overhead_bytes - node.gpus * reserve - weights
        assert tracker.capacity[n] == pytest.approx(expected)
        assert tracker.capacity[n] == pytest.approx(kv_free_bytes(cluster, node, e - s))
        assert tracker.capacity[n] == pytest.approx(model.servers[n].kv_capacity * kv_bytes_per_token(cluster.model))
    no_reserve = kv_capacity_bytes(cluster, placement, CostParams(runtime_reserve_bytes=0))
    assert all(no_reserve[n] > tracker.capacity[n] for n in placement)
