"""HexGen-2: the graph-partition primitives, per-group strategies, the flow graph with KV edges, the
Appendix E case study against exhaustive search, and simulating a disaggregated plan."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from swarmnode.planner.algorithms.hexgen2 import _initial, exhaustive_hexgen2, plan_hexgen2, workload_task
from swarmnode.planner.algorithms.hexgen2_flow import DECODE, PREFILL, _evaluate, _Scorer
from swarmnode.planner.cluster.shipped import load_shared_cluster
from swarmnode.planner.costs.hexgen_gpus import HexGenParams, stage_max_batch
from swarmnode.planner.search.partition import (
    coarsen,
    cut_weight,
    imbalance,
    kernighan_lin,
    max_cut_bipartition,
    spectral_partition,
)
from swarmnode.planner.simulator.engine import simulate
from swarmnode.planner.simulator.metrics import SimConfig
from swarmnode.planner.simulator.serving import serving_from_disaggregated
from swarmnode.planner.simulator.trace import poisson_trace


@pytest.fixture(scope="module")
def case_study():
    return load_shared_cluster("hexgen2-case-study-8")


def _two_cliques(n: int = 4, strong: float = 100.0, weak: float = 1.0) -> np.ndarray:
    w = np.full((2 * n, 2 * n), weak)
    w[:n, :n] = strong
    w[n:, n:] = strong
    np.fill_diagonal(w, 0.0)
    return w


def test_spectral_partition_and_kernighan_lin():
    w = _two_cliques()
    labels = spectral_partition(w, 2, seed=0)
    assert len(set(labels[:4])) == 1 and len(set(labels[4:])) == 1 and labels[0] != labels[4]
    # start from a bad cut: KL must find the planted one and keep memory balanced
    bad = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    mem = np.ones(8)
    fixed = kernighan_lin(w, bad, mem, tolerance=0.0)
    assert cut_weight(w, fixed) == pytest.approx(cut_weight(w, labels))
    assert cut_weight(w, fixed) < cut_weight(w, bad)
    assert imbalance(fixed, mem) == 0.0
    # with unequal memory KL first moves nodes to balance within the tolerance
    mem2 = np.array([4, 1, 1, 1, 1, 1, 1, 1], dtype=float)
    balanced = kernighan_lin(w, labels, mem2, tolerance=0.2)
    assert imbalance(balanced, mem2) <= 0.2 + 1e-9


def test_max_cut_bipartition_is_exact_on_small_graphs():
    rng = np.random.default_rng(1)
    w = rng.uniform(0, 10, size=(7, 7))
    w = (w + w.T) / 2
    np.fill_diagonal(w, 0)
    mask = max_cut_bipartition(w)
    best = max(
        w[np.ix_(np.array(bits, bool), ~np.array(bits, bool))].sum()
        for bits in itertools.product([False, True], repeat=7)
    )
    assert w[np.ix_(mask, ~mask)].sum() == pytest.approx(best)
    coarse, groups = coarsen(_two_cliques(2), [0, 0, 1, 1])
    assert groups == [0, 1] and coarse[0, 1] == pytest.approx(4.0) and coarse[0, 0] == 0


def test_case_study_initial_partition_matches_appendix_e(case_study):
    scorer = _Scorer(case_study, workload_task(case_study, None), HexGenParams())
    groups, masks, info = _initial(scorer, kv_batch=32, seed=0)
    # E.1 step 1: four groups of two GPUs of one type
    assert info["k"] == 4 and sorted(groups) == [(0, 2), (0, 2), (2, 0), (2, 0)]
    # E.1 steps 2-3: each side gets one H100 pair and one A100 pair (wide intra-machine links between sides)
    for mask in masks:
        sides = {True: [], False: []}
        for g, m in zip(groups, mask, strict=True):
            sides[bool(m)].append(g)
        assert sorted(sides[True]) == sorted(sides[False]) == [(0, 2), (2, 0)]


def test_case_study_prefill_is_latency_optimal_tensor_parallel(case_study):
    scorer = _Scorer(case_study, workload_task(case_study, None), HexGenParams())
    h100_pair = (2, 0)
    prefill = scorer.strategy(h100_pair, PREFILL)
    assert prefill is not None and prefill.tp_pp == (2, 1)  # E.2: prefill replicas use TP=2, PP=1
    decode = scorer.strategy(h100_pair, DECODE)
    best = 0.0
    for stages in scorer._stage_sets(h100_pair):
        stages = scorer._order(stages)
        layers = scorer._memory_split(stages)
        b = min(
            stage_max_batch(scorer.sc, scorer.classes[k], t, n)
            for (k, t), n in zip(stages, layers, strict=True)
        )
        lat = sum(scorer._decode_stage(k, t, n, b) for (k, t), n in zip(stages, layers, strict=True))
        lat += sum(scorer._pp(a[0], c[0], b, 0.0, scorer.task.s_out) for a, c in itertools.pairwise(stages))
        best = max(best, b / lat)
    assert decode is not None and decode.capacity == pytest.approx(best)


@pytest.mark.parametrize("workload", [None, "LPLD", "LPHD", "HPLD", "HPHD"])
def test_case_study_matches_exhaustive_search(case_study, workload):
    plan = plan_hexgen2(case_study, workload=workload)
    exhaustive = exhaustive_hexgen2(case_study, workload=workload)
    assert exhaustive.iterations > 50  # it did enumerate a space
    assert plan.value == pytest.approx(exhaustive.value, rel=1e-9)
    # flow conservation and capacities of the KV routing
    assert sum(plan.kv_routing.values()) == pytest.approx(plan.value)
    assert sum(plan.source_flow) == pytest.approx(plan.value)
    for (p, d), f in plan.kv_routing.items():
        assert f > 0 and 0 <= p < len(plan.prefill) and 0 <= d < len(plan.decode)
    assert all(r.num_layers == 80 for r in (*plan.prefill, *plan.decode))
    data = plan.to_json()
    assert data["algorithm"] == "hexgen2" and data["throughput"] == pytest.approx(
        plan.value * plan.task.s_out
    )
    assert {g["role"] for g in data["groups"]} == {"prefill", "decode"}
    assert sum(k["weight"] for k in data["kv_routing"]) == pytest.approx(1.0)


def test_flow_graph_needs_both_roles_and_memory(case_study):
    scorer = _Scorer(case_study, workload_task(case_study, "LPLD"), HexGenParams())
    assert _evaluate(scorer, [(2, 0), (0, 2)], [PREFILL, PREFILL]) is None
    assert _evaluate(scorer, [(1, 0), (1, 2)], [PREFILL, DECODE]) is None  # one H100 cannot hold 70B
    ev = _evaluate(scorer, [(2, 0), (2, 4)], [PREFILL, DECODE])
    assert ev is not None and ev.value > 0
    kv_cap = ev.capacity[("prefill-0", "decode-1")]
    assert ev.flow["prefill-0"]["decode-1"] <= kv_cap * (1 + 1e-9)


def test_larger_setting_plans_and_simulates():
    cluster = load_shared_cluster("hexgen2-setting-4")
    plan = plan_hexgen2(cluster, workload="LPLD", time_limit=60.0)
    assert plan.prefill and plan.decode
    for r in (*plan.prefill, *plan.decode):
        for stage in r.stages:
            assert len(stage.machines) == 1 and len(stage.gpu_types) == 1
    gpu_ids = [g.id for r in (*plan.prefill, *plan.decode) for g in r.gpus]
    assert len(gpu_ids) == len(set(gpu_ids)) <= 12
    assert plan.history == tuple(sorted(plan.history))  # refinement only accepts improvements
    model = serving_from_disaggregated(cluster, plan.prefill, plan.decode, plan.source_flow, plan.kv_routing)
    s_in, s_out = int(plan.task.s_in), int(plan.task.s_out)
    rate = 0.3 * plan.value
    trace = poisson_trace(rate, 40.0, s_in, s_out, seed=0)
    result = simulate(model, trace, SimConfig(warmup=10.0, window_end=30.0, drain=120.0))
    assert result.completed == result.requests
    assert result.throughput == pytest.approx(rate * s_out, rel=0.15)
    assert result.prompt_latency_mean is not None and result.decode_latency_mean is not None


def test_workload_names_and_errors(case_study):
    assert workload_task(case_study, "hpld").s_in > 512 and workload_task(case_study, "HPLD").s_out <= 128
    assert workload_task(case_study, (100, 10)).s_out == 10
    with pytest.raises(ValueError, match="unknown workload"):
        workload_task(case_study, "XXXX")
    with pytest.raises(ValueError):
        plan_hexgen2(case_study, kv_batch=-1)
