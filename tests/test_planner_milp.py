"""Helix's MILP: the brute-force optimum on small clusters, and never below the heuristics."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from swarmnode.planner import (
    CostModel,
    PlacementError,
    cluster_from_dict,
    evaluate,
    gma,
    load_shared_cluster,
    milp,
    petals,
    placement_problems,
    plan,
    swarm,
)
from swarmnode.planner.milp import coverage_is_exact, interchangeable_groups

MAX_PLACEMENTS = 250_000
MIN_PLACEMENTS = 2_000


def random_cluster(seed: int, *, slow_links: bool):
    """Up to 6 nodes of two or three kinds, up to 12 blocks; with ``slow_links`` two regions joined by a
    link slower than the nodes, so that the network decides the flow."""
    rng = random.Random(seed)
    while True:
        num_blocks = rng.randint(4, 12)
        kinds = [
            (rng.randint(1, min(num_blocks, 4)), rng.choice([150.0, 300.0, 500.0, 900.0]))
            for _ in range(rng.randint(2, 3))
        ]
        nodes = []
        for i in range(rng.randint(3, 6)):
            blocks, rate = rng.choice(kinds)
            region = "r0" if not slow_links or i % 2 == 0 else "r1"
            nodes.append(
                {
                    "id": f"n{i}",
                    "region": region,
                    "device": "gpu",
                    "memory_bytes": blocks * 10**9,
                    "block_throughput": rate,
                }
            )
        spec = {
            "model": {
                "name": "m",
                "num_blocks": num_blocks,
                "hidden_size": 64,
                "dtype_bytes": 2,
                "block_bytes": 10**9,
            },
            "nodes": nodes,
            "network": {
                "intra_region": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0},
                # 0.2 Mbps carries 195 activations of 128 bytes per second
                "inter_region": {"bandwidth_mbps": rng.choice([0.1, 0.2, 0.4]), "latency_ms": 30.0},
                "coordinator_region": "r0",
            },
        }
        cluster = cluster_from_dict(spec)
        cost = CostModel(cluster)
        if sum(max(cost.feasible_sizes(n)) for n in cluster.node_ids) < num_blocks:
            continue
        count = math.prod(sum(num_blocks - k + 1 for k in cost.feasible_sizes(n)) for n in cluster.node_ids)
        if MIN_PLACEMENTS <= count <= MAX_PLACEMENTS:
            return cluster, cost


def brute_force(cluster, cost, partial_inference: bool) -> float:
    """The best max flow over every contiguous placement (every node holds at least one block). Placements
    are scored by `evaluate` in decreasing order of their block-coverage bound (the flow through a block
    never exceeds the throughput of the nodes holding it) until the bound cannot beat the best."""
    L = cluster.model.num_blocks
    nodes = cluster.node_ids
    options = []
    profiles = []
    for n in nodes:
        opts = [(s, s + k) for k in cost.feasible_sizes(n) for s in range(L - k + 1)]
        options.append(opts)
        prof = np.zeros((len(opts), L))
        for i, (s, e) in enumerate(opts):
            prof[i, s:e] = cost.throughput(n, e - s)
        profiles.append(prof)
    cov = np.zeros((1, L))
    for prof in profiles:
        cov = (cov[:, None, :] + prof[None, :, :]).reshape(-1, L)
    bound = cov.min(axis=1)
    best = 0.0
    radix = [len(o) for o in options]
    for index in np.argsort(-bound, kind="stable"):
        if bound[index] <= best * (1 + 1e-12):
            break
        rest = int(index)
        ranges = {}
        for n, opts, r in zip(reversed(nodes), reversed(options), reversed(radix), strict=True):
            rest, digit = divmod(rest, r)
            ranges[n] = opts[digit]
        value = evaluate(cluster, ranges, cost=cost, partial_inference=partial_inference, with_latency=False)
        best = max(best, value.throughput)
    return best


CASES = [(seed, slow, partial) for seed in range(8) for slow in (False, True) for partial in (True, False)]


@pytest.mark.parametrize(("seed", "slow_links", "partial"), CASES)
def test_milp_reaches_brute_force_optimum(seed, slow_links, partial):
    cluster, cost = random_cluster(seed, slow_links=slow_links)
    optimum = brute_force(cluster, cost, partial)
    result = milp(cluster, time_limit=30, gap=0.0, mip_rel_gap=1e-7, partial_inference=partial, cost=cost)
    assert result.throughput >= optimum * (1 - 1e-6) - 1e-9
    assert result.throughput <= optimum * (1 + 1e-6) + 1e-9  # it is the true max flow of a placement
    assert result.upper_bound >= result.throughput - 1e-9
    assert placement_problems(cluster, result.placement) == []


@pytest.mark.parametrize("seed", range(4))
def test_per_node_formulation_alone(seed):
    cluster, cost = random_cluster(seed + 100, slow_links=seed % 2 == 1)
    for partial in (True, False):
        optimum = brute_force(cluster, cost, partial)
        result = milp(
            cluster,
            time_limit=30,
            gap=0.0,
            mip_rel_gap=1e-7,
            partial_inference=partial,
            cost=cost,
            formulation="per-node",
        )
        assert result.throughput == pytest.approx(optimum, rel=1e-6, abs=1e-9)
        assert "per-node" in result.formulation or result.throughput >= result.upper_bound * (1 - 1e-7)


def test_typed_formulation_without_partial_inference():
    cluster, cost = random_cluster(7, slow_links=False)
    optimum = brute_force(cluster, cost, False)
    result = milp(
        cluster,
        time_limit=30,
        gap=0.0,
        mip_rel_gap=1e-7,
        partial_inference=False,
        cost=cost,
        formulation="typed",
    )
    assert result.throughput == pytest.approx(optimum, rel=1e-6, abs=1e-9)


def test_interchangeable_groups():
    cluster = load_shared_cluster("helix-geo-24")
    groups = interchangeable_groups(cluster)
    sizes = sorted(len(g) for g in groups)
    assert sizes == [2, 4, 4, 6, 8]  # GPU type x region
    assert coverage_is_exact(
        load_shared_cluster("helix-single-24"), CostModel(load_shared_cluster("helix-single-24"))
    )
    assert not coverage_is_exact(cluster, CostModel(cluster))


@pytest.mark.parametrize(
    ("name", "seconds"), [("helix-single-24", 10), ("helix-geo-24", 10), ("helix-hetero-42", 20)]
)
def test_milp_beats_heuristics_on_helix_clusters(name, seconds):
    cluster = load_shared_cluster(name)
    cost = CostModel(cluster)
    events = []
    result = milp(cluster, time_limit=seconds, cost=cost, progress=events.append)
    assert placement_problems(cluster, result.placement) == []
    value = evaluate(cluster, result.placement, cost=cost).throughput
    assert value == pytest.approx(result.throughput)
    for heuristic in (petals(cluster, cost=cost), swarm(cluster, cost=cost), gma(cluster)):
        assert placement_problems(cluster, heuristic) == []
        assert value >= evaluate(cluster, heuristic, cost=cost).throughput - 1e-6
    assert result.solve_seconds <= seconds + 5
    assert result.throughput <= result.upper_bound <= result.helix_bound + 1e-6
    assert 0 <= result.gap < 1
    assert events[-1].phase == "done" and events[0].phase == "heuristics"
    assert all(e.best <= e.bound + 1e-6 for e in events)


def test_single_24_ratios_to_baselines():
    """Helix Fig. 9a measured 1.23x Petals and 2.10x Swarm on this cluster."""
    cluster = load_shared_cluster("helix-single-24")
    result = plan(cluster, "milp", time_limit=20)
    assert result.throughput >= 1.2 * plan(cluster, "petals").throughput
    assert result.throughput >= 2.0 * plan(cluster, "swarm").throughput


def test_early_stop_and_errors():
    cluster = load_shared_cluster("helix-single-24")
    loose = milp(cluster, time_limit=60, gap=0.5)
    assert loose.solve_seconds < 5 and loose.throughput >= 0.5 * loose.upper_bound
    with pytest.raises(ValueError, match="formulation"):
        milp(cluster, formulation="simplex")
    with pytest.raises(ValueError, match="coverage formulation"):
        milp(load_shared_cluster("helix-geo-24"), formulation="coverage", time_limit=1)
    two_nodes = cluster.with_nodes(cluster.nodes[:2])  # 24 of 80 blocks
    with pytest.raises(PlacementError, match="cannot hold"):
        milp(two_nodes, time_limit=1)
