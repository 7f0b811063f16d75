"""HexGen: Eq. 7 out-of-memory checks, Algorithm 1 against brute force, the GA's operators, and the
paper's case study (§3.1) and heterogeneous full-price setup (App. F, Table 4)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from swarmnode.planner.algorithms.hexgen import (
    _MUTATIONS,
    _Planner,
    best_layout,
    max_replicas,
    memory_problems,
    pipeline_dp,
    plan_hexgen,
)
from swarmnode.planner.cluster.shipped import load_shared_cluster
from swarmnode.planner.cluster.spec import SpecError, cluster_from_dict
from swarmnode.planner.costs.hexgen_gpus import HexGenParams, StageCost, Task, cluster_gpus, gpu_classes
from swarmnode.planner.search.partition import elbow, kmeans

CASE_TASK = Task(1.0, 128.0, 64.0)  # HexGen §3.1: input 128, output 64


@pytest.fixture(scope="module")
def case_study():
    return load_shared_cluster("hexgen-case-study-8")


def test_case_study_symmetric_layouts_are_out_of_memory(case_study):
    ids = [g.id for g in cluster_gpus(case_study)]
    pure_tp = memory_problems(case_study, [(ids, 80)], task=CASE_TASK)
    even_pp = memory_problems(case_study, [([gid], 10) for gid in ids], task=CASE_TASK)
    # §3.1: "A4000-16G cannot host the evenly partitioned parameter shards" / "cannot hold 10 layers"
    assert pure_tp and all("a4000" in p for p in pure_tp)
    assert even_pp and {p.split("GPU ")[1].split()[0] for p in even_pp} == {"a4000-0", "a4000-1"}
    # the A6000s alone could hold the even split: the failure is the small GPUs, not the total
    assert not memory_problems(case_study, [([i], 27) for i in ids[:2]] + [([ids[2]], 26)], task=CASE_TASK)


def test_case_study_hexgen_plan_is_feasible_and_asymmetric(case_study):
    result = plan_hexgen(case_study, task=CASE_TASK, generations=4, sim_duration=15.0, seed=1)
    assert result.replicas
    for replica in result.replicas:
        stages = [([g.id for g in s.gpus], s.layers) for s in replica.stages]
        assert memory_problems(case_study, stages, task=CASE_TASK) == []
        assert replica.num_layers == 80
    layers = {s.layers for r in result.replicas for s in r.stages}
    assert len(layers) > 1  # stages hold different numbers of layers
    data = result.to_json()
    assert set(data) >= {
        "algorithm",
        "placement",
        "throughput",
        "upper_bound",
        "solve_seconds",
        "flows",
        "groups",
    }
    assert data["algorithm"] == "hexgen" and data["groups"][0]["role"] == "replica"
    assert 0.0 <= result.fitness.slo_attainment <= 1.0


def test_full_price_plan_keeps_tp_in_machines_groups_in_regions_and_fills_memory():
    cluster = load_shared_cluster("hexgen-full-price-58")
    assert (
        max_replicas(cluster, task=CASE_TASK) == 12
    )  # App. F: "a maximum of 12 LLAMA-2 (70B) model replicas"
    result = plan_hexgen(
        cluster,
        task=CASE_TASK,
        rate=60.0,
        generations=3,
        population=6,
        offspring=3,
        sim_duration=10.0,
        seed=0,
    )
    for replica in result.replicas:
        assert len({g.region for g in replica.gpus}) == 1
        for stage in replica.stages:
            assert len(stage.machines) == 1 and len({g.node for g in stage.gpus}) == 1
            assert len(stage.gpu_types) == 1
    assert len(result.replicas) == 12
    used = sum(len(r.gpus) for r in result.replicas)
    assert used <= 58


def _brute_force(planner: _Planner, group: tuple[int, ...], layers: list[int]) -> float:
    """All ordered ways to cut ``group`` into ``len(layers)`` single-class stages of TP degree in the set."""
    best = math.inf
    options = [(k, t) for k, n in enumerate(group) if n for t in planner.tp_options(k)]
    for combo in itertools.product(options, repeat=len(layers)):
        used = [0] * len(group)
        for k, t in combo:
            used[k] += t
        if tuple(used) != tuple(group):
            continue
        cost = 0.0
        for j, ((k, t), n) in enumerate(zip(combo, layers, strict=True)):
            cost += planner.stage_cost(k, t, n)
            if j:
                cost += planner.hop[combo[j - 1][0]][k]
        best = min(best, cost)
    return best


def test_algorithm_1_matches_brute_force():
    cluster = load_shared_cluster("hexgen2-case-study-8")  # 4 H100 + 4 A100 in two machines
    planner = _Planner(cluster, CASE_TASK, HexGenParams(), max_stages=8, beam=10**6)
    for group, layers in [
        ((2, 2), [40, 40]),
        ((4, 0), [20, 20, 40]),
        ((1, 3), [30, 20, 30]),
        ((3, 2), [20, 20, 20, 20]),
    ]:
        layout = pipeline_dp(planner, group, layers)
        expected = _brute_force(planner, group, layers)
        if math.isinf(expected):
            assert layout is None
        else:
            assert layout is not None and layout.cost == pytest.approx(expected)
            assert [n for _, _, n in layout.stages] == layers
            assert sum(t for _, t, _ in layout.stages) == sum(group)


def test_layer_resplit_puts_more_layers_on_bigger_stages(case_study):
    planner = _Planner(case_study, CASE_TASK, HexGenParams(), max_stages=8, beam=10**6)
    classes = planner.classes
    group = tuple(1 for _ in classes)  # one GPU of each of the 8 single-GPU nodes
    layout = best_layout(planner, group)
    assert layout is not None
    by_memory = sorted(((classes[k].memory_bytes, n) for k, _, n in layout.stages))
    assert by_memory[0][1] < by_memory[-1][1]  # A4000 stages hold fewer layers than A6000 stages
    sc = StageCost(case_study, CASE_TASK)
    assert all(sc.fits(classes[k], t, n) for k, t, n in layout.stages)


def test_mutations_follow_hexgen_definitions(case_study):
    planner = _Planner(case_study, CASE_TASK, HexGenParams(), max_stages=8, beam=1000)
    n = len(planner.classes)
    one = tuple([1] * n)
    rng = random.Random(0)
    split = _MUTATIONS["split"]((tuple([3] + [0] * (n - 1)),), rng, planner)
    assert sorted(g[0] for g in split) == [1, 2]  # floor and ceil of 3 / 2
    merged = _MUTATIONS["merge"](
        (one[: n // 2] + (0,) * (n - n // 2), (0,) * (n // 2) + one[n // 2 :]), rng, planner
    )
    assert merged == (one,)
    a, b = (2,) + (0,) * (n - 1), (0, 2) + (0,) * (n - 2)
    swapped = _MUTATIONS["swap"]((a, b), rng, planner)
    assert sum(map(sum, swapped)) == 4 and sorted(map(sum, swapped)) == [1, 3]
    # early pruning: a single A4000 cannot hold the weights
    small = tuple(1 if c.gpu_type == "A4000" else 0 for c in planner.classes)
    assert not planner.can_hold_model(small) and best_layout(planner, small) is None


def test_kmeans_and_elbow_find_planted_clusters():
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = np.vstack([c + rng.normal(scale=0.3, size=(20, 2)) for c in centers])
    labels, _ = kmeans(points, 3, seed=0)
    assert len(set(labels[:20])) == len(set(labels[20:40])) == len(set(labels[40:])) == 1
    assert len(set(labels)) == 3
    assert elbow(points, 8, seed=0) == 3


def test_max_replicas_and_errors(case_study):
    assert max_replicas(case_study, task=CASE_TASK) == 2
    cpu_only = cluster_from_dict(
        {
            "model": {"num_blocks": 2, "hidden_size": 64, "dtype_bytes": 2, "block_bytes": 1000},
            "nodes": [{"id": "c", "region": "r", "device": "cpu", "memory_bytes": 10**9, "cores": 4}],
            "network": {"intra_region": {"bandwidth_mbps": 100, "latency_ms": 1}},
        }
    )
    with pytest.raises(SpecError, match="GPU"):
        gpu_classes(cpu_only)
    with pytest.raises(ValueError):
        plan_hexgen(case_study, rate=-1.0, generations=0)
    with pytest.raises(SpecError, match="unknown GPU"):
        memory_problems(case_study, [(["nope"], 80)])
