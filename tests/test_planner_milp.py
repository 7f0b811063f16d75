"""Helix's MILP: the brute-force optimum on small clusters, never below the heuristics; its upper bounds
never below the brute-force optimum; the flow beam's placements carry the flow they were built for."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest

from swarmnode.planner import (
    CannotPlaceError,
    CostModel,
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
from swarmnode.planner.algorithms.milp import (
    coverage_is_exact,
    interchangeable_groups,
    model_size,
    per_node_size,
)
from swarmnode.planner.cluster.spec import Workload
from swarmnode.planner.cluster.synthetic import synthetic_cluster
from swarmnode.planner.search.bounds import coordinator_bound, coverage_bound, helix_bound, throughput_types
from swarmnode.planner.search.flow_beam import flow_beam, link_regions, region_orders, search_flows
from swarmnode.planner.search.milp_model import ModelSize, SparseModel, recording

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


def exact_milp(cluster, cost, partial: bool, **options):
    """The MILP asked to prove optimality (no gap), as the brute-force comparisons need."""
    return milp(cluster, time_limit=30, gap=0.0, mip_rel_gap=1e-7, partial_inference=partial, cost=cost, **options)


@functools.cache
def case(seed: int, slow_links: bool, partial: bool):
    """``random_cluster(seed)``, its cost model and its brute-force optimum (computed once per session)."""
    cluster, cost = random_cluster(seed, slow_links=slow_links)
    return cluster, cost, brute_force(cluster, cost, partial)


@pytest.mark.parametrize(("seed", "slow_links", "partial"), CASES)
def test_milp_reaches_brute_force_optimum(seed, slow_links, partial):
    cluster, cost, optimum = case(seed, slow_links, partial)
    result = exact_milp(cluster, cost, partial)
    assert result.throughput >= optimum * (1 - 1e-6) - 1e-9
    assert result.throughput <= optimum * (1 + 1e-6) + 1e-9  # it is the true max flow of a placement
    assert result.upper_bound >= result.throughput - 1e-9
    for name, bound in result.bounds.items():  # every bound it proved holds
        assert bound >= optimum * (1 - 1e-6) - 1e-9, name
    assert placement_problems(cluster, result.placement) == []


@pytest.mark.parametrize("seed", range(4))
def test_per_node_formulation_alone(seed):
    cluster, cost = random_cluster(seed + 100, slow_links=seed % 2 == 1)
    for partial in (True, False):
        optimum = brute_force(cluster, cost, partial)
        result = exact_milp(cluster, cost, partial, formulation="per-node")
        assert result.throughput == pytest.approx(optimum, rel=1e-6, abs=1e-9)
        assert "per-node" in result.formulation or result.throughput >= result.upper_bound * (1 - 1e-7)


def test_typed_formulation_without_partial_inference():
    cluster, cost = random_cluster(7, slow_links=False)
    optimum = brute_force(cluster, cost, False)
    result = exact_milp(cluster, cost, False, formulation="typed")
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
    # the search stops for one of its two reasons: within the gap of a proven bound, or a phase used up
    # the time it was given
    timed_out = [p for p in result.phases if p.get("status") == "Time limit reached"]
    assert result.gap <= 0.05 + 1e-9 or timed_out, result.phases
    assert result.throughput <= result.upper_bound <= result.helix_bound + 1e-6
    assert 0 <= result.gap < 1
    assert events[-1].phase == "done" and events[0].phase == "heuristics"
    assert all(e.best <= e.bound + 1e-6 for e in events)


def test_single_24_ratios_to_baselines():
    """Helix Fig. 9a measured 1.23x Petals and 2.10x Swarm on this cluster, serving its trace (763 prompt /
    232 output tokens on average). In max-flow terms, with ``T_j`` profiled at a node's typical batch inside
    a pipeline (`planner.costs.roofline`), the best placement cannot reach 1.2x Petals for that workload: the
    proven bound itself is below it (`scripts/bench_planner.py` reports both); the simulator, serving the
    placements at the same offered load, does reach it (`tests/test_simulator.py`, Fig. 9 direction). For
    short requests, where prompts weigh little on nodes and links, max flow shows the paper's margins."""
    cluster = load_shared_cluster("helix-single-24")
    short = CostModel(cluster, workload=Workload(16, 16))
    # generous time limits: each search ends once it is within its gap of the proven bound (the coverage
    # beams reach 7% within seconds on this cluster, and 6% for the trace workload, where closing the gap
    # to 5% takes a minute more and finds nothing better)
    result = milp(cluster, time_limit=120, gap=0.07, cost=short)
    assert result.throughput >= 1.2 * plan(cluster, "petals", cost=short).throughput
    assert result.throughput >= 2.0 * plan(cluster, "swarm", cost=short).throughput
    trace = milp(cluster, time_limit=120, gap=0.1)  # the paper's workload: milp still ahead of both
    assert trace.gap <= 0.1, trace.phases
    assert trace.throughput >= 1.1 * plan(cluster, "petals").throughput
    assert trace.throughput >= 2.0 * plan(cluster, "swarm").throughput


def test_early_stop_and_errors():
    cluster = load_shared_cluster("helix-single-24")
    loose = milp(cluster, time_limit=60, gap=0.5)
    # the best heuristic is already within 50% of Helix's bound: no search phase runs
    assert loose.formulation == "heuristics" and loose.phases == ()
    assert loose.gap <= 0.5 and loose.throughput >= 0.5 * loose.upper_bound
    with pytest.raises(ValueError, match="formulation"):
        milp(cluster, formulation="simplex")
    with pytest.raises(ValueError, match="coverage formulation"):
        milp(load_shared_cluster("helix-geo-24"), formulation="coverage", time_limit=1)
    two_nodes = cluster.with_nodes(cluster.nodes[:2])  # 24 of 80 blocks
    with pytest.raises(CannotPlaceError, match="cannot hold") as caught:
        milp(two_nodes, time_limit=1)
    assert caught.value.code == "cannot_place"


@pytest.mark.parametrize("seed", range(8))
def test_bounds_never_below_brute_force_optimum(seed):
    """Every bound holds for every placement: none is below the best placement found by brute force. With
    slow links the typed relaxation (exact pair counts) is network-aware: solved to optimality it is
    below the coverage bound whenever the links, not the nodes, decide the optimum. (Without partial
    inference the bounds are checked by ``test_milp_reaches_brute_force_optimum``.)"""
    partial = True
    cluster, cost, optimum = case(seed, True, partial)
    tolerance = optimum * 1e-6 + 1e-9
    assert helix_bound(cost) >= optimum - tolerance
    assert coordinator_bound(cluster, cost) >= optimum - tolerance
    covered = coverage_bound(cluster, cost, time_limit=20)
    assert covered.bound is not None and covered.bound >= optimum - tolerance
    assert covered.bound >= covered.value - tolerance
    typed = milp(
        cluster,
        time_limit=30,
        gap=0.0,
        mip_rel_gap=1e-7,
        partial_inference=partial,
        cost=cost,
        formulation="typed",
    )
    assert typed.bounds["solver"] >= optimum - tolerance
    assert typed.upper_bound >= optimum - tolerance
    assert typed.bound_name in typed.bounds
    assert typed.upper_bound == pytest.approx(max(min(typed.bounds.values()), typed.throughput))
    if optimum < covered.bound * (1 - 1e-4):  # the network decides
        assert typed.bounds["solver"] < covered.bound * (1 - 1e-4)


def test_coordinator_bound_is_the_coordinator_cut():
    """With slow coordinator links the flow cannot exceed what the links to and from the coordinator carry,
    and two nodes each holding every block reach exactly that."""
    spec = {
        "model": {"name": "m", "num_blocks": 4, "hidden_size": 64, "dtype_bytes": 2, "block_bytes": 10**9},
        "nodes": [
            {
                "id": f"n{i}",
                "region": "r0",
                "device": "gpu",
                "memory_bytes": 4 * 10**9,
                "block_throughput": 4000.0,
            }
            for i in range(2)
        ],
        "network": {
            "intra_region": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0},
            "inter_region": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0},
            "coordinator_region": "r0",
            "links": [
                {"a": "coordinator", "b": f"n{i}", "bandwidth_mbps": 0.01, "latency_ms": 1.0}
                for i in range(2)
            ],
        },
    }
    cluster = cluster_from_dict(spec)
    cost = CostModel(cluster)
    bound = coordinator_bound(cluster, cost)
    links = sum(
        min(cost.link_capacity("coordinator", n), cost.link_capacity(n, "coordinator")) for n in ("n0", "n1")
    )
    assert bound == pytest.approx(links)
    assert bound < helix_bound(cost)
    best = evaluate(cluster, {"n0": (0, 4), "n1": (0, 4)}, cost=cost).throughput
    assert best == pytest.approx(bound)
    result = milp(cluster, time_limit=10, cost=cost)
    assert result.throughput == pytest.approx(bound) and result.upper_bound == pytest.approx(bound)
    assert result.bound_name == "coordinator" and result.gap == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    ("seed", "partial"), [(seed, partial) for seed in range(8) for partial in (True, False)]
)
def test_flow_beam_placements_carry_their_target(seed, partial):
    """The beam commits a feasible flow of the target, so every placement it returns has at least that max
    flow; half the optimum is always found on these small clusters."""
    cluster, cost, optimum = case(seed, True, partial)
    groups = interchangeable_groups(cluster, cost)
    found_half = False
    for fraction in (0.5, 0.8, 1.0):
        target = fraction * optimum
        ranges = flow_beam(cost, groups, cluster.model.num_blocks, target, partial_inference=partial)
        if ranges is None:
            continue
        assert placement_problems(cluster, ranges) == []
        value = evaluate(cluster, ranges, cost=cost, partial_inference=partial, with_latency=False).throughput
        assert value >= target * (1 - 1e-9) - 1e-9
        assert value <= optimum * (1 + 1e-9) + 1e-9
        found_half = found_half or fraction == 0.5
    assert found_half


def _declared_regions(cluster) -> list[list[str]]:
    """The node ids of each region the spec declares, sorted, for comparing with ``link_regions``."""
    by_region = {}
    for node in cluster.nodes:
        by_region.setdefault(node.region, set()).add(node.id)
    return sorted(map(sorted, by_region.values()))


def test_region_orders_follow_the_slow_links():
    cluster = load_shared_cluster("helix-geo-24")
    cost = CostModel(cluster)
    regions = link_regions(cost, interchangeable_groups(cluster, cost))
    assert sorted(map(sorted, regions)) == _declared_regions(cluster)
    orders = region_orders(regions)
    assert orders[0] is None and len(orders) == 1 + 12  # ordered partitions of 3 regions, one part excluded
    single = load_shared_cluster("helix-single-24")
    single_cost = CostModel(single)
    assert len(link_regions(single_cost, interchangeable_groups(single, single_cost))) == 1
    assert len(throughput_types(cluster, cost)) == 3  # A100, L4, T4: regions do not matter to coverage


def test_geo_24_flow_search_beats_the_heuristics_and_bounds_are_named():
    """On the geo-distributed cluster the flow beam finds placements far above the heuristics' (their
    inter-region pipelines are limited by single node pairs), and the coverage bound is proven."""
    cluster = load_shared_cluster("helix-geo-24")
    cost = CostModel(cluster)
    groups = interchangeable_groups(cluster, cost)
    heuristic = max(
        evaluate(cluster, p, cost=cost).throughput
        for p in (petals(cluster, cost=cost), swarm(cluster, cost=cost), gma(cluster))
    )
    found, value = search_flows(
        cluster,
        cost,
        groups,
        low=0.0,
        high=helix_bound(cost),
        time_limit=10,
        score=lambda r: evaluate(cluster, r, cost=cost, with_latency=False).throughput,
    )
    assert found is not None and value >= 1.5 * heuristic
    covered = coverage_bound(cluster, cost, time_limit=3, start=found)
    assert covered.bound is not None and value <= covered.bound <= helix_bound(cost) * (1 + 1e-9)


@pytest.mark.parametrize(
    ("name", "partial", "columns", "rows"),
    [
        ("helix-single-24", False, 1376, 1848),  # Helix Table 8, 24 nodes without pruning
        ("helix-hetero-42", False, 4004, 5502),  # Helix Table 8, 42 nodes without pruning
        ("helix-single-24", True, 2480, 2400),  # + aux1, aux2 per node pair, 3 validity rows instead of 2
    ],
)
def test_per_node_size_is_helix_table_8(name, partial, columns, rows):
    """Helix Tables 5-6 over the complete graph: per node s_i and b_i^k (152 sizes on the 24-node
    cluster), per connection f and d (24 + 24 + 24 x 23 connections); per node 4 rows, per connection
    f <= d C and its validity rows (Helix's Gurobi log: "1848 rows, 1376 columns")."""
    cluster = load_shared_cluster(name)
    assert per_node_size(cluster, partial_inference=partial) == ModelSize(columns, rows)


def test_pruning_shrinks_the_per_node_model():
    """Pruning drops links only where a node's links differ (here the slow inter-region ones); the model
    size reports it, with the phases' solved sizes."""
    cluster, cost = random_cluster(1, slow_links=True)
    full = per_node_size(cluster, cost, partial_inference=False)
    pruned = per_node_size(cluster, cost, partial_inference=False, link_degree=1)
    assert pruned.columns < full.columns and pruned.rows < full.rows
    n = len(cluster.nodes)
    removed = (full.columns - pruned.columns) // 2  # f and d per directed connection
    assert full.rows - pruned.rows == 3 * removed  # f <= d C and two validity rows each
    assert removed > 0 and (full.columns - pruned.columns) % 2 == 0
    assert full.columns == n + sum(len(cost.feasible_sizes(m)) for m in cluster.node_ids) + 2 * (2 * n + n * (n - 1))
    result = milp(cluster, time_limit=5, cost=cost, partial_inference=False, formulation="per-node", gap=0.0)
    size = model_size(cluster, cost, partial_inference=False, link_degree=1, phases=result.phases)
    assert size["unpruned"] == full.to_dict() and size["pruned"] == pruned.to_dict()
    solved = [p for p in size["solved"] if p["formulation"] == "per-node"]
    assert solved and solved[0]["models"] == 1 and solved[0]["columns"] == full.columns  # default degree keeps all


def test_recording_logs_every_model_solved():
    model = SparseModel()
    x = model.var(0, 3, integer=True, obj=1.0)
    model.row([(x, 1.0)], -math.inf, 2.5)
    with recording() as outer:
        model.solve(time_limit=1)
        with recording() as inner:
            assert model.solve(time_limit=1).objective == pytest.approx(2.0)
    assert outer == [ModelSize(1, 1)] and inner == [ModelSize(1, 1)]
    model.solve(time_limit=1)  # outside any recording: nothing logged, nothing fails
    assert len(outer) == 1


def test_weak_nodes_do_not_join_regions():
    """CPU nodes are slower than the links between regions, so every link suits them; they still belong
    to their own region, and the regions of a synthetic cluster are its declared regions."""
    cluster = synthetic_cluster(30, seed=0, regions=3)
    cost = CostModel(cluster)
    regions = link_regions(cost, interchangeable_groups(cluster, cost))
    assert sorted(map(sorted, regions)) == _declared_regions(cluster)
    alone = synthetic_cluster(30, seed=0, regions=1)
    alone_cost = CostModel(alone)
    assert len(link_regions(alone_cost, interchangeable_groups(alone, alone_cost))) == 1


def test_regions_alone_on_a_synthetic_cluster():
    """With slow links between regions the search places each region on its own first: the union is a
    valid placement, scored exactly, at least each region's coverage added up (pipelines that never cross
    a slow link), and above the heuristics; the bounds stay above it."""
    cluster = synthetic_cluster(30, seed=0, regions=2)
    cost = CostModel(cluster)
    result = milp(cluster, time_limit=4, cost=cost)
    assert "regions" in result.formulation
    phase = next(p for p in result.phases if p["formulation"] == "regions alone")
    assert phase["regions"] == 2 and len(phase["coverage"]) == 2
    assert placement_problems(cluster, result.placement) == []
    value = evaluate(cluster, result.placement, cost=cost, with_latency=False).throughput
    assert value == pytest.approx(result.throughput)
    assert value >= sum(phase["coverage"]) * (1 - 1e-6)
    heuristic = evaluate(cluster, petals(cluster, cost=cost), cost=cost, with_latency=False).throughput
    assert value >= heuristic
    assert all(value <= b * (1 + 1e-9) for b in result.bounds.values())
