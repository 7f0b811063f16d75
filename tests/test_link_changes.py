"""The coordinator's view of measured links (`coordinator.cluster_view`): it re-plans when a link that can
limit the swarm appears or changes (`link_changes`), not for the noise of links faster than the swarm can use,
and a node whose own connection limits all its links carries no more than that connection in all
(`access_links`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.coordinator.cluster_view import (
    access_links,
    cluster_from_records,
    link_changes,
    measured_links,
)
from swarmnode.coordinator.events import LinkChanged
from swarmnode.coordinator.service import Coordinator, CoordinatorConfig
from swarmnode.planner.cluster.spec import ModelSpec
from swarmnode.planner.costs.roofline import CostModel
from swarmnode.planner.flow_graph import evaluate
from swarmnode.records import LinkMeasurement, NodeRecord, NodeState

MIB = 1 << 20
# SmolLM2-135M in float32, as the coordinator describes it (`model_info_from_checkpoint`)
MODEL = ModelSpec(name="smollm2", num_blocks=30, hidden_size=576, dtype_bytes=4, block_bytes=int(13.5 * MIB),
                  intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
IDS = [c * 46 for c in "ABCD"]


def records(links: dict[tuple[str, str], float], *, max_blocks: int = 14) -> dict[str, NodeRecord]:
    """Four CPU nodes (212 tok/s per block, as one thread measures); `links` (a, b) -> Mbps as a measures it."""
    return {
        peer: NodeRecord(
            peer_id=peer, state=NodeState.WAITING, device="cpu", dtype="float32", memory_bytes=840 * MIB,
            num_threads=1, block_bytes=int(13.5 * MIB), overhead_bytes=615 * MIB, max_blocks=max_blocks,
            block_throughput=212.0,
            links={b: LinkMeasurement(rtt_ms=1.0, bandwidth_mbps=mbps) for (a, b), mbps in links.items() if a == peer},
        )
        for peer in IDS
    }


def all_links(mbps: float, **special: float) -> dict[tuple[str, str], float]:
    """Every directed pair at `mbps`, except pairs touching node `A` at `special['A']` when given."""
    return {(a, b): special.get("A", mbps) if "A" in (a[0], b[0]) else mbps for a in IDS for b in IDS if a != b}


def test_the_premise_a_20_mbit_link_cannot_limit_this_swarm_and_half_a_megabit_can():
    cost = CostModel(cluster_from_records(MODEL, records(all_links(800.0, A=20.0))))
    bound = cost.upper_bound()  # four nodes of 212 tok/s per block, 30 blocks: 28 tok/s at most
    assert 25 < bound < 30
    # 20 Mbit/s carries 2.5 MB/s; an output token costs (763 + 232 - 1) / 232 activations of 576 x 4 bytes
    assert cost.link_capacity(IDS[0], IDS[1]) > 8 * bound
    slow = CostModel(cluster_from_records(MODEL, records(all_links(800.0, A=0.5))))
    assert slow.link_capacity(IDS[0], IDS[1]) < bound / 4


def test_fast_links_never_cause_a_replan():
    before = records(all_links(800.0))
    assert link_changes(MODEL, before, before) == []
    assert link_changes(MODEL, records({}), records(all_links(300.0))) == []  # measured for the first time
    assert link_changes(MODEL, before, records(all_links(40.0))) == []  # 20x slower, still far above the swarm
    assert link_changes(MODEL, before, records(all_links(800.0, A=20.0))) == []


def test_a_link_that_can_limit_the_swarm_is_a_change():
    fast = records(all_links(800.0))
    slow = records(all_links(800.0, A=0.5))
    changes = link_changes(MODEL, fast, slow)
    assert len(changes) == 3 and all(IDS[0] in (c.a, c.b) and (c.mbps, c.was) == (0.5, 800.0) for c in changes)
    assert all("..AAAAAA" in str(c) and "0.5 Mbps (was 800)" in str(c) for c in changes), changes
    first = link_changes(MODEL, records({}), slow)
    assert len(first) == 3 and all(c.was is None and "first measurement" in str(c) for c in first), first
    # small moves of a slow link are not changes; large ones are, both ways (it may have stopped limiting)
    assert link_changes(MODEL, slow, records(all_links(800.0, A=0.7))) == []
    assert len(link_changes(MODEL, slow, records(all_links(800.0, A=5.0)))) == 3
    assert len(link_changes(MODEL, slow, fast)) == 3


def test_a_swarm_that_cannot_be_planned_has_no_link_changes():
    assert link_changes(MODEL, records({}), records(all_links(800.0, A=0.5), max_blocks=5)) == []


def test_the_coordinator_counts_link_changes_as_events():
    stand_in = SimpleNamespace(model=MODEL, planned_from=records(all_links(800.0)),
                               config=SimpleNamespace(workload=None))
    nodes = records(all_links(800.0, A=0.5))
    events = Coordinator._events(stand_in, nodes, None)
    assert len(events) == 3 and all(isinstance(e, LinkChanged) and str(e).startswith("link ") for e in events)
    assert Coordinator._events(stand_in, records(all_links(500.0)), None) == []


def test_a_node_behind_one_slow_line_carries_that_line_in_all():
    slow = records(all_links(800.0, A=20.0))
    assert access_links(measured_links(slow.values())) == {IDS[0]: 20.0}  # its peers reach each other faster
    assert access_links(measured_links(records(all_links(800.0)).values())) == {}  # a uniform swarm: no cap
    # a fast node among slow peers: its fastest link is as fast as its peers', so nothing says it is the limit
    hub = {(a, b): 800.0 if IDS[0] in (a, b) else 20.0 for a in IDS for b in IDS if a != b}
    assert IDS[0] not in access_links(measured_links(records(hub).values()))
    cluster = cluster_from_records(MODEL, slow)
    assert cluster.node(IDS[0]).nic_mbps == 20.0 and cluster.node(IDS[1]).nic_mbps is None
    # every request through node A, fed by two peers: per link it could take 2 x 20 Mbit/s, its line carries
    # 20 in all
    workload = (4096.0, 32.0)
    slow15 = records(all_links(800.0, A=20.0), max_blocks=15)
    cost = CostModel(cluster_from_records(MODEL, slow15, workload=workload))
    per_link = cost.link_capacity(IDS[1], IDS[0])
    assert 2 * per_link > 212.0 / 15 > per_link  # two links could feed its compute; one line cannot
    through_a = {IDS[1]: (0, 15), IDS[2]: (0, 15), IDS[0]: (15, 30)}
    capped = evaluate(cluster_from_records(MODEL, slow15, workload=workload), through_a).throughput
    assert capped == pytest.approx(per_link, rel=0.01)


@pytest.mark.parametrize("value,message", [("4096", "is not PROMPT:OUTPUT"), ("a:b", "is not PROMPT:OUTPUT"),
                                           ("4096:0", "output tokens from 1"), ("-1:32", "prompt tokens must be from 0"),
                                           ("inf:32", "under 10 million"), ("nan:32", "prompt tokens must be from 0")])
def test_coordinate_refuses_a_bad_workload(model_dir, value, message):
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"
    result = CliRunner().invoke(main, ["coordinate", "--model", str(model_dir), "--initial-peers", peer,
                                       "--workload", value])
    assert result.exit_code != 0 and message in result.output, result.output
    with pytest.raises(ValueError, match="workload"):
        CoordinatorConfig(workload=(4096.0, 0.0))


def test_the_workload_decides_whether_a_link_can_limit_the_swarm():
    fast = records(all_links(800.0))
    shaped = records(all_links(800.0, A=20.0))
    assert link_changes(MODEL, fast, shaped) == []  # Helix's lengths: 20 Mbit/s carries ~250 tok/s per link
    assert len(link_changes(MODEL, fast, shaped, workload=(4096.0, 32.0))) == 3  # long prompts: ~8


def test_debounce_keys_say_which_change_not_how_it_reads():
    from swarmnode.coordinator.events import AlgorithmChanged, NodeJoined, NodeLeft, OfferChanged, fingerprint

    a, b = IDS[0], IDS[1]
    # a joining node whose speed is refined, or a slow link whose reading wobbles, is one change under way
    assert fingerprint([NodeJoined(a, 10, 80.0)]) == fingerprint([NodeJoined(a, 12, 95.0)])
    assert fingerprint([LinkChanged(a, b, 0.5, 800.0)]) == fingerprint([LinkChanged(a, b, 0.61, 800.0)])
    # a new change, or one gone, is not
    assert fingerprint([NodeJoined(a, 10, 80.0)]) != fingerprint([NodeJoined(a, 10, 80.0), NodeLeft(b)])
    assert fingerprint([NodeJoined(a, 10, 80.0)]) != fingerprint([OfferChanged(a)])
    assert str(NodeJoined(a, 10, 80.4)) == "node ..AAAAAA joined (10 blocks, 80 tok/s per block)"
    assert str(NodeLeft(b)) == "node ..BBBBBB left" and str(OfferChanged(b)) == "node ..BBBBBB changed its offer or speed"
    assert str(AlgorithmChanged(a, "hexgen2")) == "coordinator ..AAAAAA plans with --algorithm hexgen2"
