"""LLaMPS' GMA and AHP-based OPA, and the Petals and SWARM baselines."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
from swarmnode.planner.algorithms.petals import choose_best_start, petals_order, petals_orders
from swarmnode.planner.algorithms.swarm_baseline import swarm_stage_size, swarm_stages

HELIX = ["helix-single-24", "helix-geo-24", "helix-hetero-42"]
HELIX_LAYOUTS = Path(__file__).parent / "data" / "helix_layouts"


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
    from swarmnode.planner.algorithms.ahp import criteria_values

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


def helix_layout(cluster: str, method: str) -> dict:
    """A placement Helix published, converted by ``scripts/convert_helix_layouts.py``."""
    return json.loads((HELIX_LAYOUTS / f"{cluster}.{method}.json").read_text())


class KindRates:
    """A cost object whose nodes hold their ``max_blocks`` and run at one rate per GPU kind, whatever
    they hold: the interface of :class:`CostModel` that Petals and SWARM use."""

    def __init__(self, cluster, rates: dict[str, float]) -> None:
        self.cluster = cluster
        self.rates = rates
        self.capacity = {n: cluster.node(n).max_blocks for n in cluster.node_ids}
        self.table = {n: (0.0, *[rates[cluster.node(n).gpu]] * self.capacity[n]) for n in cluster.node_ids}

    def feasible_sizes(self, node_id: str) -> list[int]:
        return list(range(1, self.capacity[node_id] + 1))

    def throughput(self, node_id: str, blocks: int) -> float:
        return self.table[node_id][blocks] if 0 < blocks <= self.capacity[node_id] else 0.0


#: Output tokens/s at full size in the proportions of Helix's profiled model (planner/costs/helix_profiled.py
#: gives an A100 with 12 layers 234, a T4 with 4 182, an L4 with 7 128 on these clusters): the
#: per-block sums Petals' window rule compares then order as they did in Helix's run.
HELIX_RATES = {"A100-40G": 234.0, "T4": 182.0, "L4": 128.0}


def test_window_rule_is_petals_choose_best_start():
    # Petals' _choose_best_start: min over (sorted(throughputs[i:i + n]), i)
    assert choose_best_start([0.0, 5.0, 1.0, 1.0], 2) == 0  # [0, 5] < [1, 1] sorted, though 5 > 2 summed
    assert choose_best_start([1.0, 2.0, 2.0, 1.0], 2) == 0  # [1, 2] twice: the earliest
    assert choose_best_start([3.0, 1.0, 2.0, 1.0, 3.0], 2) == 1  # [1, 2] at 1 and 2: the earliest
    assert choose_best_start([4.0, 0.0, 0.0, 9.0, 0.0, 0.0], 3) == 0  # two unserved blocks beat one
    assert choose_best_start([2.0, 2.0, 1.0, 3.0, 3.0], 2) == 1  # [1, 2] < [1, 3]: second smallest decides
    assert choose_best_start([5.0, 6.0], 4) == 0  # a window longer than the model is the whole model
    with pytest.raises(PlannerError, match="at least one block"):
        choose_best_start([1.0], 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=12), st.integers(1, 12))
def test_window_rule_picks_the_smallest_sorted_window(per_block, size):
    size = min(size, len(per_block))
    start = choose_best_start([float(v) for v in per_block], size)
    best = sorted(per_block[start : start + size])
    for i in range(len(per_block) - size + 1):
        other = sorted(per_block[i : i + size])
        assert best < other or (best == other and start <= i)


def test_petals_order_is_seeded_like_helix():
    cluster = load_shared_cluster("helix-geo-24")
    assert petals_order(cluster, 0) == petals_order(cluster, 0)
    orders = {tuple(petals_order(cluster, seed)) for seed in range(5)}
    assert len(orders) == 5 and all(sorted(o) == sorted(cluster.node_ids) for o in orders)
    # Helix: random.seed(seed); random.shuffle(nodes in index order); helix-geo-24 lists them in that order
    indices = list(range(len(cluster.node_ids)))
    state = random.getstate()
    random.seed(3)
    random.shuffle(indices)
    random.setstate(state)
    assert petals_order(cluster, 3) == [cluster.node_ids[i] for i in indices]
    assert petals(cluster, seed=0) == petals(cluster, seed=0)
    assert petals(cluster, seed=0) != petals(cluster, seed=1)


@pytest.mark.parametrize("name", ["helix-single-24", "helix-geo-24"])
def test_petals_reproduces_helix_published_layout(name):
    """Helix's seed-0 join order and window rule, with Helix's ordering of node rates, give exactly the
    placement in its artifact (``layout_*/petals/petals_sol.ini``)."""
    cluster = load_shared_cluster(name)
    published = helix_layout(name, "petals")
    ids = published["helix_node_ids"]  # our id of Helix's node i
    indices = list(range(len(ids)))
    random.Random(0).shuffle(indices)
    order = [ids[i] for i in indices]
    cost = KindRates(cluster, HELIX_RATES)
    assert dict(petals(cluster, cost=cost, order=order).items()) == {
        n: tuple(r) for n, r in published["placement"].items()
    }
    if name == "helix-geo-24":  # the spec lists the nodes in Helix's order: seed 0 is Helix's order
        assert petals_order(cluster, 0) == order
        assert petals(cluster, cost=cost, seed=0) == petals(cluster, cost=cost, order=order)


def test_petals_windows_and_order():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    for seed in (None, 0, 7):
        placement = petals(cluster, cost=cost, seed=seed)
        for node_id in cluster.node_ids:  # every server takes as many blocks as its memory holds
            assert placement.size(node_id) == cost.capacity[node_id]
    # in the spec's order the first servers fill the model from the front: the unserved blocks come first
    in_spec_order = petals(cluster, cost=cost, seed=None)
    assert in_spec_order["a100-0"] == (0, 12) and in_spec_order["a100-1"] == (12, 24)
    # the first server of a seeded order starts the model
    first = petals_order(cluster, 7)[0]
    assert petals(cluster, cost=cost, seed=7)[first] == (0, cost.capacity[first])
    # an explicit order wins over the seed; it must name the cluster's nodes, once each
    reverse = list(reversed(cluster.node_ids))
    assert petals(cluster, cost=cost, seed=3, order=reverse) == petals(cluster, cost=cost, order=reverse)
    with pytest.raises(PlannerError, match="not in cluster"):
        petals(cluster, cost=cost, order=["nope"])
    with pytest.raises(PlannerError, match="twice"):
        petals(cluster, cost=cost, order=["a100-0", "a100-0"])


class ZeroRate:
    """A cost object under which server ``s0`` adds no throughput to the blocks it holds."""

    capacity = {"s0": 6, "s1": 4, "s2": 4}

    def feasible_sizes(self, node_id: str) -> list[int]:
        return [self.capacity[node_id]]

    def throughput(self, node_id: str, blocks: int) -> float:
        return 0.0 if node_id == "s0" else 1.0


def test_petals_rebalances_only_when_asked():
    cluster = cpu_cluster([(20, 4), (20, 4), (20, 4)])  # ten blocks
    cost = ZeroRate()
    # s0 adds nothing, so s1 and s2 see every block unserved and fill [0, 8); Helix's code stops there
    with pytest.raises(CannotPlaceError, match=r"blocks 8\.\.9 are left unserved.*rebalance=True"):
        petals(cluster, cost=cost, order=["s0", "s1", "s2"])
    placement = petals(cluster, cost=cost, order=["s0", "s1", "s2"], rebalance=True)
    assert placement_problems(cluster, placement) == [] and placement["s0"] == (4, 10)
    # with every server adding throughput the join pass serves every block: rebalancing changes nothing
    real = load_shared_cluster("helix-hetero-42")
    for seed in range(3):
        assert petals(real, seed=seed, rebalance=True) == petals(real, seed=seed)


def test_petals_orders_sweeps_seeds():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    runs = petals_orders(cluster, [0, 1, 2], cost=cost)
    assert [r.seed for r in runs] == [0, 1, 2]
    assert runs[0].placement == petals(cluster, cost=cost, seed=0)
    assert list(runs[1].order) == petals_order(cluster, 1)
    assert all(r.throughput > 0 and placement_problems(cluster, r.placement) == [] for r in runs)


def test_petals_registry_options():
    from swarmnode.planner import plan
    from swarmnode.planner.registry import REGISTRY

    entry = REGISTRY["petals"]
    assert entry.applies("seed") and entry.applies("rebalance") and not REGISTRY["swarm"].applies("seed")
    cluster = load_shared_cluster("helix-single-24")
    result = plan(cluster, "petals", seed=5)
    assert result.placement == petals(cluster, seed=5) and result.details["seed"] == 5
    assert plan(cluster, "petals").placement == petals(cluster, seed=0)


def test_swarm_equal_stages():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    placement = swarm(cluster, cost=cost)
    stages = swarm_stages(80, 4)
    assert len(stages) == 20
    assert sorted(set(placement.values())) == stages  # equal stages, each with at least one node
    assert len(placement) == 24
    assert swarm_stages(10, 4) == [(0, 4), (4, 7), (7, 10)]
    # Helix's stage size: the largest divisor of L the weakest node holds (70B: 20 x 4; 30B: 10 x 6)
    assert swarm_stage_size(80, 4) == 4 and swarm_stage_size(60, 8) == 6 and swarm_stage_size(80, 7) == 5
    thirty = load_shared_cluster("helix-single-24-llama30b")
    assert sorted(set(swarm(thirty).values())) == swarm_stages(60, 6)


@pytest.mark.parametrize("name", ["helix-single-24", "helix-geo-24"])
def test_swarm_reproduces_helix_published_layout(name):
    """Strongest first (A100, then L4, then T4 at 4 layers; equal nodes the later first) into the stage of
    least throughput: Helix's ``layout_*/swarm/swarm_sol.ini`` exactly."""
    cluster = load_shared_cluster(name)
    published = helix_layout(name, "swarm")
    placement = swarm(cluster, cost=CostModel(cluster))
    assert dict(placement.items()) == {n: tuple(r) for n, r in published["placement"].items()}
    # the first four stages hold one A100 each, the last four one T4 each (Helix §6.6's bottleneck)
    last = [n for n, r in placement.items() if r[0] >= 64]
    assert sorted(cluster.node(n).gpu for n in last) == ["T4"] * 4


@pytest.mark.parametrize("name", ["helix-single-24", "helix-geo-24"])
@pytest.mark.parametrize("method", ["ilp", "petals", "swarm"])
def test_helix_published_layouts_are_valid(name, method):
    cluster = load_shared_cluster(name)
    layout = helix_layout(name, method)
    assert layout["cluster"] == name and layout["method"] == method and layout["problems"] == []
    assert layout["source"]["repository"] == "Thesys-lab/Helix-ASPLOS25"
    assert layout["source"]["commit"].startswith("148b733") and layout["source"]["file"].endswith("_sol.ini")
    assert sorted(layout["helix_node_ids"]) == sorted(cluster.node_ids)
    placement = {n: tuple(r) for n, r in layout["placement"].items()}
    assert placement_problems(cluster, placement) == []
    for node_id, (start, end) in placement.items():
        assert 0 <= start < end <= 80 and end - start <= cluster.node(node_id).max_blocks
    covered = set().union(*(range(s, e) for s, e in placement.values()))
    assert covered == set(range(cluster.model.num_blocks))


def test_too_little_memory_is_an_error():
    cluster = cpu_cluster([(7, 4), (7, 8)])  # 2 blocks each, 10 needed
    for algorithm in (gma, ahp, petals, swarm):
        with pytest.raises(CannotPlaceError) as caught:
            algorithm(cluster)
        assert caught.value.code == "cannot_place" and "add nodes" in str(caught.value)
    assert AHPError.code != PlannerError.code and issubclass(AHPError, PlannerError)
