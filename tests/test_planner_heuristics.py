"""LLaMPS' GMA and AHP-based OPA, and the Petals and SWARM baselines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmnode.planner import (
    DEFAULT_MATRIX,
    LLAMPS_MATRIX,
    AHPError,
    CannotPlaceError,
    CostModel,
    PairwiseMatrix,
    PlannerError,
    ahp,
    ahp_ranking,
    ahp_weights,
    cluster_from_dict,
    gma,
    load_shared_cluster,
    petals,
    placement_problems,
    swarm,
)
from swarmnode.planner.swarm import swarm_stages

HELIX = ["helix-single-24", "helix-geo-24", "helix-hetero-42"]


def test_llamps_table3_gma_and_ahp():
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    assert dict(gma(cluster).items()) == dict(cluster.expected["gma"])
    assert dict(ahp(cluster, matrix=LLAMPS_MATRIX).items()) == dict(cluster.expected["ahp"])
    assert dict(ahp(cluster).items()) == dict(cluster.expected["ahp"])  # the default matrix agrees
    # an operator who ranks cores above memory gets another placement
    cores_first = PairwiseMatrix.from_preferences(("memory", "cores"), {("cores", "memory"): 5})
    assert dict(ahp(cluster, matrix=cores_first).items()) != dict(cluster.expected["ahp"])


def test_ahp_weights_and_consistency():
    two = ahp_weights(LLAMPS_MATRIX)
    assert two.weights == pytest.approx((5 / 6, 1 / 6))
    assert two.consistency_ratio == pytest.approx(0.0, abs=1e-9)
    four = ahp_weights(DEFAULT_MATRIX)
    assert sum(four.weights) == pytest.approx(1.0)
    assert four.weights[0] == max(four.weights)  # memory first
    assert 0 < four.consistency_ratio <= 0.1
    cyclic = PairwiseMatrix.from_preferences(
        ("memory", "cores", "link"), {("memory", "cores"): 9, ("cores", "link"): 9, ("link", "memory"): 9}
    )
    with pytest.raises(AHPError, match="inconsistent"):
        ahp_weights(cyclic)
    with pytest.raises(AHPError, match="reciprocal"):
        ahp_weights(PairwiseMatrix(("memory", "cores"), ((1.0, 3.0), (3.0, 1.0))))
    # criteria the cluster says nothing about are dropped: a CPU cluster on one switch has memory and cores
    from swarmnode.planner.ahp import criteria_values

    assert sorted(criteria_values(load_shared_cluster("llamps-bloom3b-3server"))) == ["cores", "memory"]
    geo = criteria_values(load_shared_cluster("helix-geo-24"))
    assert sorted(geo) == ["link", "memory"]  # GPU nodes give no core counts


def cpu_cluster(servers: list[tuple[int, int]]) -> object:
    return cluster_from_dict(
        {
            "model": {
                "name": "m",
                "num_blocks": 10,
                "hidden_size": 256,
                "dtype_bytes": 4,
                "block_bytes": 10**8,
            },
            "overhead_bytes": 5 * 10**8,
            "nodes": [
                {"id": f"s{i}", "region": "lab", "device": "cpu", "memory_bytes": mem * 10**8, "cores": cores}
                for i, (mem, cores) in enumerate(servers)
            ],
            "network": {"intra_region": {"bandwidth_mbps": 1000, "latency_ms": 0.5}},
        }
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=6, max_value=20), st.integers(min_value=1, max_value=64)),
        min_size=2,
        max_size=7,
    ),
    st.integers(min_value=1, max_value=16),
)
def test_ahp_prefers_more_cores_up_to_the_knee(servers, knee):
    cluster = cpu_cluster(servers)
    ranking = [n for n, _ in ahp_ranking(cluster, knee=knee)]
    position = {n: i for i, n in enumerate(ranking)}
    for i, (mem_a, cores_a) in enumerate(servers):
        for j, (mem_b, cores_b) in enumerate(servers):
            if mem_a == mem_b and min(cores_a, knee) > min(cores_b, knee):
                assert position[f"s{i}"] < position[f"s{j}"]
            if mem_a > mem_b and min(cores_a, knee) >= min(cores_b, knee):
                assert position[f"s{i}"] < position[f"s{j}"]


@pytest.mark.parametrize("name", HELIX)
def test_heuristics_are_valid_on_helix_clusters(name):
    cluster = load_shared_cluster(name)
    cost = CostModel(cluster)
    for placement in (
        gma(cluster),
        ahp(cluster, cost=cost),
        petals(cluster, cost=cost),
        swarm(cluster, cost=cost),
    ):
        assert placement_problems(cluster, placement) == []


def test_petals_windows_and_order():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    placement = petals(cluster, cost=cost)
    for node_id in cluster.node_ids:  # every server takes as many blocks as its memory holds
        assert placement.size(node_id) == cost.capacity[node_id]
    # the first servers fill the model from the front: the least-served windows are the empty ones
    assert placement["a100-0"] == (0, 12) and placement["a100-1"] == (12, 24)


def test_swarm_equal_stages():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    placement = swarm(cluster, cost=cost)
    stages = swarm_stages(80, 4)
    assert len(stages) == 20
    assert sorted(set(placement.values())) == stages  # equal stages, each with at least one node
    load = {}
    for node_id, rng in placement.items():
        load[rng] = load.get(rng, 0.0) + cost.throughput(node_id, rng[1] - rng[0])
    # balanced: the strongest stage is a single A100; no stage gets two nodes while one has none
    assert len(placement) == 24 and len(load) == 20
    assert swarm_stages(10, 4) == [(0, 4), (4, 7), (7, 10)]


def test_too_little_memory_is_an_error():
    cluster = cpu_cluster([(7, 4), (7, 8)])  # 2 blocks each, 10 needed
    for algorithm in (gma, ahp, petals, swarm):
        with pytest.raises(CannotPlaceError) as caught:
            algorithm(cluster)
        assert caught.value.code == "cannot_place" and "add nodes" in str(caught.value)
    assert AHPError.code != PlannerError.code and issubclass(AHPError, PlannerError)
