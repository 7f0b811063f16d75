"""Synthetic clusters (planner.cluster.synthetic): deterministic per seed, valid specs with Helix's GPU kinds, CPU
nodes and Helix Table 7's regions, placeable by a heuristic and by a short MILP run."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from swarmnode.planner import (
    CostModel,
    SpecError,
    cluster_from_dict,
    cluster_to_dict,
    load_shared_cluster,
    milp,
    placement_problems,
    plan,
)
from swarmnode.planner.cluster.synthetic import (
    CPU_PROFILES,
    GPU_KINDS,
    MIN_COPIES,
    REGION_BANDWIDTH_MBPS,
    REGIONS,
    main,
    spec_json,
    synthetic_cluster,
    synthetic_spec,
)
from swarmnode.planner.costs.roofline import block_capacity


def test_same_seed_same_cluster() -> None:
    assert synthetic_spec(60, seed=3) == synthetic_spec(60, seed=3)
    assert synthetic_cluster(60, seed=3) == synthetic_cluster(60, seed=3)


def test_different_seeds_differ() -> None:
    specs = [json.dumps(synthetic_spec(60, seed=seed), sort_keys=True) for seed in range(4)]
    assert len(set(specs)) == 4


def test_round_trips_through_plain_data_and_json() -> None:
    cluster = synthetic_cluster(40, seed=1)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    assert cluster_from_dict(json.loads(spec_json(cluster))) == cluster


def test_main_writes_a_spec(tmp_path) -> None:
    out = tmp_path / "synthetic.json"
    assert main(["30", "--seed", "2", "--regions", "3", "-o", str(out)]) == 0
    assert cluster_from_dict(json.loads(out.read_text())) == synthetic_cluster(30, seed=2, regions=3)


def test_size_ids_and_mix() -> None:
    cluster = synthetic_cluster(100, seed=0)
    assert len(cluster.nodes) == 100
    assert len(set(cluster.node_ids)) == 100
    kinds = Counter(n.id.rsplit("-", 1)[0] for n in cluster.nodes)
    assert set(kinds) == {kind["prefix"] for kind in GPU_KINDS} | {"cpu"}
    assert 15 <= kinds["cpu"] <= 25  # one node in five
    assert kinds["t4"] > kinds["a100"]  # Helix's proportions: 10 T4 for 4 A100
    for node in cluster.nodes:
        if node.device == "cpu":
            assert (node.cores, node.memory_bytes) in CPU_PROFILES
            assert node.tflops is None and node.gpu is None


@pytest.mark.parametrize("regions", [1, 2, 3, 4])
def test_requested_regions_and_links(regions: int) -> None:
    cluster = synthetic_cluster(50, seed=5, regions=regions)
    used = {n.region for n in cluster.nodes}
    assert len(used) == regions and used <= set(REGIONS)
    assert cluster.network.coordinator_region in used
    assert cluster.network.intra_region.bandwidth_mbps == 10_000
    names = sorted(used)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            link = cluster.region_link(a, b)
            assert link.bandwidth_mbps == REGION_BANDWIDTH_MBPS[frozenset((a, b))]
            assert 50 <= link.bandwidth_mbps <= 210 and link.latency_ms == 50


def test_default_regions_are_two_to_four() -> None:
    counts = {len({n.region for n in synthetic_cluster(40, seed=s).nodes}) for s in range(12)}
    assert counts <= {2, 3, 4} and len(counts) > 1


def test_gpu_kinds_match_helix_hetero_42() -> None:
    """The kinds' figures are those of the shipped Helix spec."""
    hetero = load_shared_cluster("helix-hetero-42")
    shipped = {
        (n.gpu, n.gpus): (n.memory_bytes, n.tflops, n.memory_bandwidth_gbs, n.max_blocks, n.nic_mbps)
        for n in hetero.nodes
    }
    synthetic = {
        (n.gpu, n.gpus): (n.memory_bytes, n.tflops, n.memory_bandwidth_gbs, n.max_blocks, n.nic_mbps)
        for n in synthetic_cluster(60).nodes
        if n.device == "gpu"
    }
    assert synthetic == shipped
    assert synthetic_cluster(60).model == hetero.model


def test_other_model_drops_helix_caps() -> None:
    model = {
        "name": "small",
        "num_blocks": 32,
        "hidden_size": 4096,
        "dtype_bytes": 2,
        "block_bytes": 400_000_000,
    }
    cluster = synthetic_cluster(30, model=model)
    assert cluster.model.name == "small"
    assert all(n.max_blocks is None for n in cluster.nodes)


def test_placeable_with_margin() -> None:
    cluster = synthetic_cluster(30, seed=4)
    held = sum(block_capacity(cluster, n) for n in cluster.nodes)
    assert held >= MIN_COPIES * cluster.model.num_blocks
    result = plan(cluster, "petals")
    assert placement_problems(cluster, result.placement) == []
    assert result.throughput > 0


def test_too_small_or_bad_arguments_are_refused() -> None:
    with pytest.raises(SpecError, match="ask for at least"):
        synthetic_cluster(8)
    with pytest.raises(SpecError, match="regions must be"):
        synthetic_cluster(30, regions=5)
    with pytest.raises(SpecError, match="num_nodes"):
        synthetic_cluster(0)
    with pytest.raises(SpecError, match="num_blocks"):
        synthetic_cluster(30, model={"name": "broken"})


def test_short_milp_finds_a_feasible_placement() -> None:
    cluster = synthetic_cluster(30, seed=0)
    cost = CostModel(cluster)
    result = milp(cluster, cost=cost, time_limit=3.0)
    assert placement_problems(cluster, result.placement) == []
    assert 0 < result.throughput <= result.upper_bound * (1 + 1e-9)
