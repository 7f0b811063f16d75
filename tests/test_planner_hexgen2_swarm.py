"""HexGen-2 for a live swarm (`planner.algorithms.hexgen2_swarm`, `planner.live.sticky_phases`): phases, ranges and KV links of
swarm nodes with measured speeds, checked against every grouping of small swarms, pinned phases, the
sticky replanning a coordinator does, and the records that carry the plan."""

from __future__ import annotations

import itertools

import pytest

from swarmnode.coordinator.cluster_view import cluster_from_records
from swarmnode.planner.algorithms.hexgen2_swarm import DECODE, PREFILL, plan_swarm_phases, score_phase_groups
from swarmnode.planner.cluster.spec import ModelSpec, cluster_from_dict
from swarmnode.planner.errors import CannotPlaceError
from swarmnode.planner.live.sticky_phases import chains, decide_phases
from swarmnode.records import NodeRecord, NodeState, PlacementRecord

MODEL = {"name": "m", "num_blocks": 30, "hidden_size": 576, "dtype_bytes": 4, "block_bytes": 14_000_000,
         "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
WORKLOAD = (1024, 128)


def _cluster(nodes, *, links=(), bandwidth=1000.0):
    specs = [{"id": n, "region": "swarm", "device": "cpu", "memory_bytes": 10**9, "cores": 1, "max_blocks": cap,
              "block_throughput": dec, "prefill_throughput": pre} for n, cap, dec, pre in nodes]
    network = {"intra_region": {"bandwidth_mbps": bandwidth, "latency_ms": 1.0}, "coordinator_region": "swarm",
               "links": [{"a": a, "b": b, "bandwidth_mbps": bw, "latency_ms": 1.0} for a, b, bw in links]}
    return cluster_from_dict({"name": "t", "model": MODEL, "nodes": specs, "network": network,
                              "workload": {"avg_input_tokens": WORKLOAD[0], "avg_output_tokens": WORKLOAD[1]}})


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]
        yield [[first], *part]


def _exhaustive(cluster):
    """The best value over every grouping of every subset of the nodes and every role assignment."""
    best = 0.0
    ids = list(cluster.node_ids)
    for size in range(2, len(ids) + 1):
        for subset in itertools.combinations(ids, size):
            for groups in _set_partitions(list(subset)):
                for roles in itertools.product((PREFILL, DECODE), repeat=len(groups)):
                    plan = score_phase_groups(cluster, groups, roles, workload=WORKLOAD)
                    if plan is not None:
                        best = max(best, plan.value)
    return best


def _check_plan(cluster, plan):
    """Every group covers the model once with contiguous ranges inside its nodes' memory; ranges and phases
    agree with the groups; the KV links go from prefill to decode nodes sharing blocks."""
    caps = {n.id: n.max_blocks for n in cluster.nodes}
    for group in plan.groups:
        end = 0
        for node, a, b in group.ranges:
            assert a == end and b > a and b - a <= caps[node]
            end = b
        assert end == cluster.model.num_blocks
    assert {PREFILL, DECODE} <= {g.role for g in plan.groups}
    for sender, targets in plan.kv_links().items():
        assert plan.phases[sender] == PREFILL
        for target in targets:
            assert plan.phases[target] == DECODE
            (a, b), (c, d) = plan.assignments[sender], plan.assignments[target]
            assert max(a, c) < min(b, d)


CLUSTERS = {
    "four equal halves": [("a", 15, 400, 4000), ("b", 15, 400, 4000), ("c", 15, 400, 4000), ("d", 15, 400, 4000)],
    "one fast prefill node": [("a", 30, 300, 20000), ("b", 15, 500, 3000), ("c", 15, 500, 3000),
                              ("d", 30, 200, 2000)],
    "five mixed": [("a", 10, 300, 3000), ("b", 20, 600, 6000), ("c", 30, 900, 9000), ("d", 12, 250, 2500),
                   ("e", 25, 500, 12000)],
}


def _random_nodes(seed: int):
    import random

    rng = random.Random(seed)
    return [(f"n{i}", rng.randint(8, 30), rng.uniform(150, 900), rng.uniform(1500, 15000)) for i in range(5)]


@pytest.mark.parametrize("name", [*sorted(CLUSTERS), "random-1", "random-2", "random-3"])
def test_the_search_reaches_the_best_grouping_of_small_swarms(name):
    """HexGen-2 App. E checks its search against exhaustive enumeration; here every subset, grouping and role
    assignment of a swarm of up to five nodes."""
    nodes = CLUSTERS.get(name) or _random_nodes(int(name.split("-")[1]))
    if sum(cap for _n, cap, _d, _p in nodes) < 60:
        pytest.fail(f"{name}: the random swarm must hold two copies of the model")
    cluster = _cluster(nodes)
    plan = plan_swarm_phases(cluster, workload=WORKLOAD)
    _check_plan(cluster, plan)
    best = _exhaustive(cluster)
    assert plan.value >= 0.95 * best, (plan.to_json(), best)
    again = score_phase_groups(cluster, [[n for n, _a, _b in g.ranges] for g in plan.groups],
                               [g.role for g in plan.groups], workload=WORKLOAD)
    assert again is not None and again.value == pytest.approx(plan.value)


def test_speeds_decide_the_phases_and_the_kv_links_carry_the_flow():
    """The node that prefills fastest prefills; the decode capacity is the slowest decode node's rate over its
    blocks (Helix's T_j), and the KV routing carries every request that the max flow sends."""
    cluster = _cluster(CLUSTERS["one fast prefill node"])
    plan = plan_swarm_phases(cluster, workload=WORKLOAD)
    assert plan.phases["a"] == PREFILL
    for group in plan.groups:
        if group.role == DECODE:
            rates = {"a": 300, "b": 500, "c": 500, "d": 200}
            assert group.capacity == pytest.approx(
                min(rates[n] / (b - a) for n, a, b in group.ranges) / WORKLOAD[1])
    assert sum(plan.kv_routing.values()) == pytest.approx(plan.value)
    assert sum(plan.source_flow.values()) == pytest.approx(plan.value)
    flows = plan.flows()
    assert sum(flows["source"].values()) == pytest.approx(2 * plan.throughput)  # prefill and decode chains


def test_a_slow_kv_link_steers_the_pairing():
    """Two prefill/decode pairings of equal compute: the plan avoids the one whose KV cache crosses a 2 Mbps
    link (Table 1's KV cost), which would bound the flow far below the compute."""
    nodes = [("p1", 30, 100, 50000), ("p2", 30, 100, 50000), ("d1", 30, 800, 1000), ("d2", 30, 800, 1000)]
    slow = [("p1", "d1", 2.0), ("p1", "d2", 2.0)]
    plan = plan_swarm_phases(_cluster(nodes, links=slow), workload=WORKLOAD)
    assert plan.phases["p1"] != PREFILL or not plan.kv_links().get("p1")
    fast = plan_swarm_phases(_cluster(nodes), workload=WORKLOAD)
    assert plan.value == pytest.approx(fast.value, rel=0.2)


def test_pinned_phases_are_kept_and_impossible_swarms_are_refused():
    nodes = CLUSTERS["four equal halves"]
    cluster = _cluster(nodes)
    plan = plan_swarm_phases(cluster, workload=WORKLOAD, pinned={"a": DECODE, "c": DECODE})
    assert plan.phases["a"] == plan.phases["c"] == DECODE
    assert sorted(plan.phases.values()) == [DECODE, DECODE, PREFILL, PREFILL]
    with pytest.raises(CannotPlaceError, match="pinned"):
        plan_swarm_phases(cluster, workload=WORKLOAD, pinned=dict.fromkeys("abc", DECODE))
    with pytest.raises(CannotPlaceError, match="hold 45 blocks"):
        plan_swarm_phases(_cluster(nodes[:3]), workload=WORKLOAD)
    with pytest.raises(Exception, match="pinned to phase"):
        plan_swarm_phases(cluster, workload=WORKLOAD, pinned={"a": "both"})


def test_replanning_keeps_groups_until_a_fresh_plan_is_clearly_better():
    cluster = _cluster(CLUSTERS["four equal halves"])
    first = decide_phases(cluster, None, None, events=["node ..a joined"], workload=WORKLOAD)
    assert first.changed and "first placement" in first.reason and first.moved_blocks == 60
    same = decide_phases(cluster, first.placement, first.phases, workload=WORKLOAD)
    assert not same.changed and same.reason.startswith("keeps")
    # a fast node joins: the fresh plan is far better; nodes trade places so that the equal ones keep blocks
    bigger = _cluster([*CLUSTERS["four equal halves"], ("e", 30, 800, 8000)])
    grown = decide_phases(bigger, first.placement, first.phases, events=["node ..e joined"], workload=WORKLOAD)
    assert grown.changed and "fresh hexgen2 plan" in grown.reason
    assert grown.throughput > 1.2 * first.throughput
    kept = sum(1 for n in "abcd" if grown.placement.get(n) == first.placement[n])
    assert kept == 4 and grown.moved_blocks == 30
    # a node of the old groups left: the old plan is gone, a fresh one is made from what is left
    without = _cluster([x for x in CLUSTERS["four equal halves"] if x[0] != "a"] + [("e", 30, 800, 8000)])
    after = decide_phases(without, first.placement, first.phases, workload=WORKLOAD)
    assert "a" not in after.placement and after.changed
    assert chains({"x": (0, 10), "y": (10, 30), "z": (0, 30)}, 30) == [["x", "y"], ["z"]]
    assert chains({"x": (0, 10), "y": (12, 30)}, 30) is None


PEERS = ["Qm" + c * 44 for c in "ABCDEFG"]


def _record(peer, max_blocks, decode, prefill, *, phase="both", pinned=False):
    return NodeRecord(peer_id=peer, state=NodeState.ONLINE, device="cpu", dtype="float32", memory_bytes=10**9,
                      num_threads=1, block_bytes=14_000_000, overhead_bytes=10**8, max_blocks=max_blocks,
                      block_throughput=decode, prefill_throughput=prefill, phase=phase, phase_pinned=pinned)


def test_live_records_become_a_two_phase_placement_record():
    """What the coordinator does with `--algorithm hexgen2`: node records (with the measured prefill rate) to a
    cluster, a decision, and a placement record that validates its phases and KV links."""
    model = ModelSpec(**MODEL)
    records = {p: _record(p, 15, 400, 4000 * (i + 1)) for i, p in enumerate(PEERS[:4])}
    cluster = cluster_from_records(model, records)
    assert cluster.node(PEERS[3]).prefill_throughput == 16000
    decision = decide_phases(cluster, None, None, workload=WORKLOAD)
    assert {decision.phases[p] for p in PEERS[2:4]} == {PREFILL}, "the fastest prefill nodes prefill"
    record = PlacementRecord(version=1, term=1, coordinator=PEERS[6], algorithm="hexgen2", reason=decision.reason,
                             created=0.0, num_blocks=30, assignments=decision.placement, flows=decision.flows,
                             throughput=decision.throughput, phases=decision.phases, kv_links=decision.kv_links)
    assert PlacementRecord.model_validate(record.to_dict()) == record
    bad = record.to_dict()
    bad["kv_links"] = {PEERS[0]: {PEERS[2]: 1.0}}  # from a decode node
    with pytest.raises(ValueError, match="not an assigned prefill node"):
        PlacementRecord.model_validate(bad)
    bad = record.to_dict()
    bad["phases"] = {**bad["phases"], PEERS[5]: "decode"}
    with pytest.raises(ValueError, match="no assignment"):
        PlacementRecord.model_validate(bad)
    bad = record.to_dict()
    sender = next(iter(bad["kv_links"]))
    bad["kv_links"][sender] = {PEERS[4]: 0.5}
    with pytest.raises(ValueError, match="assigned decode node"):
        PlacementRecord.model_validate(bad)
    assert PlacementRecord.model_validate({**record.to_dict(), "phases": {}, "kv_links": {}}).phases == {}


def test_pins_with_many_nodes_and_tight_memory_still_plan():
    """Pins that the cut cannot honour: the role search is bounded (24 nodes that each hold the model, two pinned
    to each phase) and a fresh two-group split finds a plan where filling the prefill side largest first would
    not (8 blocks; the prefill pins hold 3 and 4, the decode pin 2, the free nodes 5, 3 and 2: f1 must decode)."""
    many = [(f"n{i:02d}", 30, 300 + 10 * i, 3000 + 100 * i) for i in range(24)]
    pins = {"n00": PREFILL, "n01": PREFILL, "n02": DECODE, "n03": DECODE}
    plan = plan_swarm_phases(_cluster(many), workload=WORKLOAD, pinned=pins, time_limit=5)
    assert all(plan.phases[n] == p for n, p in pins.items() if n in plan.phases)
    tight = {**MODEL, "num_blocks": 8}
    nodes = [("p1", 3, 400, 4000), ("p2", 4, 400, 4000), ("d1", 2, 400, 4000), ("f1", 5, 400, 4000),
             ("f2", 3, 400, 4000), ("f3", 2, 400, 4000)]
    specs = [{"id": n, "region": "swarm", "device": "cpu", "memory_bytes": 10**9, "cores": 1, "max_blocks": cap,
              "block_throughput": dec, "prefill_throughput": pre} for n, cap, dec, pre in nodes]
    cluster = cluster_from_dict({"name": "tight", "model": tight, "nodes": specs,
                                 "network": {"intra_region": {"bandwidth_mbps": 1000, "latency_ms": 1.0}}})
    plan = plan_swarm_phases(cluster, workload=WORKLOAD, pinned={"p1": PREFILL, "p2": PREFILL, "d1": DECODE})
    _check_plan(cluster, plan)
    assert plan.phases["p1"] == plan.phases["p2"] == PREFILL and plan.phases["d1"] == DECODE
    assert plan.phases["f1"] == DECODE  # the largest free node: with the prefill pins it would leave decode short


def test_replanning_never_swaps_a_pinned_node_into_the_other_phase():
    """Equal nodes trade places to keep their old ranges, but a node pinned to a phase only takes slots of it."""
    cluster = _cluster(CLUSTERS["four equal halves"])
    previous = {"a": (0, 15), "b": (15, 30), "c": (0, 15), "d": (15, 30)}
    phases = {"a": DECODE, "b": DECODE, "c": PREFILL, "d": PREFILL}
    decision = decide_phases(cluster, previous, phases, workload=WORKLOAD, pinned={"a": PREFILL})
    assert decision.phases["a"] == PREFILL
    assert decision.changed


def test_equally_fast_nodes_share_a_prefill_group_evenly():
    """Filling the first of two equally fast prefill nodes to its memory would give the same latency and leave
    it no room for KV cache: speeds within measurement noise split the blocks evenly."""
    nodes = [("a", 22, 400, 4000), ("b", 22, 402, 3990), ("c", 22, 400, 4000), ("d", 22, 400, 4010)]
    plan = plan_swarm_phases(_cluster(nodes), workload=WORKLOAD)
    for group in plan.groups:
        assert sorted(b - a for _n, a, b in group.ranges) == [15, 15], plan.to_json()
    fast = [("a", 22, 400, 8000), ("b", 22, 400, 4000), ("c", 22, 400, 4000), ("d", 22, 400, 4000)]
    plan = plan_swarm_phases(_cluster(fast), workload=WORKLOAD, pinned={"a": PREFILL})
    assert plan.assignments["a"] in ((0, 22), (8, 30)), "a node twice as fast takes all it holds"
