"""Helix's flow graph: valid edges, capacities, max flow, flows and the best pipeline."""

from __future__ import annotations

import itertools
import random

import pytest
from test_planner_cost_model import fig2_cluster

from swarmnode.planner import (
    SINK,
    SOURCE,
    CostModel,
    Placement,
    PlacementError,
    Workload,
    build_flow_graph,
    cluster_from_dict,
    evaluate,
    load_shared_cluster,
)
from swarmnode.planner.flow_graph import valid_edges
from swarmnode.planner.search.coverage import coverage_profile

FIG2_PLACEMENT = Placement({"A100": (0, 2), "T4-1": (0, 1), "T4-2": (2, 3)})


def test_fig2_graph_and_max_flow():
    cluster = fig2_cluster()
    # Helix Fig. 2 counts one transmission per token: requests whose every pass carries one new token
    # (a one-token prompt) make output tokens and transmissions the same unit
    fig2 = CostModel(cluster, workload=Workload(1, 16))
    graph = build_flow_graph(cluster, FIG2_PLACEMENT, cost=fig2)
    cap = lambda u, v: graph[u][v]["capacity"]  # noqa: E731
    assert cap(("A100", "in"), ("A100", "out")) == pytest.approx(1500)  # 3000 tokens/s per block, 2 blocks
    assert cap(("T4-1", "in"), ("T4-1", "out")) == pytest.approx(1000)
    assert cap(SOURCE, ("A100", "in")) == pytest.approx(2.5e6)
    assert cap(SOURCE, ("T4-1", "in")) == pytest.approx(1.25e6)
    assert cap(("T4-2", "out"), SINK) == pytest.approx(625e3)
    assert round(cap(("A100", "out"), ("T4-2", "in"))) == 458
    assert round(cap(("T4-1", "out"), ("A100", "in"))) == 687  # partial inference: A100 runs block 1 only
    assert not graph.has_edge(("T4-1", "out"), ("T4-2", "in"))  # T4-2 needs block 1 done first
    ev = evaluate(cluster, FIG2_PLACEMENT, cost=fig2)
    assert ev.throughput == pytest.approx(7.5e6 / 16384)  # the 60 Mbps link is the bottleneck
    # Helix's 763 / 232 requests: every output token brings (763 + 231) / 232 activations over that link
    helix = evaluate(cluster, FIG2_PLACEMENT)
    assert helix.throughput == pytest.approx(7.5e6 / 16384 * 232 / 994)
    assert sum(ev.flows[SOURCE].values()) == pytest.approx(ev.throughput)
    assert ev.flows["A100"]["T4-2"] == pytest.approx(ev.throughput)
    assert ev.node_flows["T4-2"] == pytest.approx(ev.throughput)
    assert [s.node for s in ev.pipeline] in (["A100", "T4-2"], ["T4-1", "A100", "T4-2"])
    assert ev.latency > 0
    # without partial inference the T4-1 -> A100 connection is not valid
    strict = build_flow_graph(cluster, FIG2_PLACEMENT, cost=fig2, partial_inference=False)
    assert not strict.has_edge(("T4-1", "out"), ("A100", "in"))


def test_valid_edges_rules():
    placement = {"a": (0, 3), "b": (2, 5), "c": (3, 6), "d": (5, 6)}
    partial = set(valid_edges(placement, 6))
    strict = set(valid_edges(placement, 6, partial_inference=False))
    assert (SOURCE, "a") in strict and (SOURCE, "b") not in partial
    assert ("a", "c") in strict and ("a", "b") in partial and ("a", "b") not in strict
    assert ("b", "d") in strict and ("c", SINK) in strict and ("d", SINK) in strict
    assert ("c", "d") not in partial  # d would redo nothing: e_c = 6 is not < e_d


def test_flows_respect_capacities_and_conservation():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    from swarmnode.planner import petals

    placement = petals(cluster, cost=cost)
    ev = evaluate(cluster, placement, cost=cost)
    for node, flow in ev.node_flows.items():
        inflow = sum(t.get(node, 0.0) for t in ev.flows.values())
        outflow = sum(ev.flows.get(node, {}).values())
        assert inflow == pytest.approx(flow) and outflow == pytest.approx(flow)
        assert flow <= cost.throughput(node, placement.size(node)) * (1 + 1e-9)
    assert sum(ev.flows[SOURCE].values()) == pytest.approx(ev.throughput)
    stages = ev.pipeline
    assert stages[0].start == 0 and stages[-1].end == 80
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))


def test_evaluate_rejects_bad_placements():
    cluster = load_shared_cluster("helix-single-24")
    with pytest.raises(PlacementError, match="memory allows 12"):
        evaluate(cluster, {"a100-0": (0, 13)})
    with pytest.raises(PlacementError, match="not in cluster"):
        evaluate(cluster, {"h100-9": (0, 1)})
    with pytest.raises(PlacementError, match="not inside"):
        evaluate(cluster, {"a100-0": (75, 81)})
    assert evaluate(cluster, {"a100-0": (0, 12)}).throughput == 0  # blocks 12.. unserved: no flow


def _uniform_cluster(seed: int):
    rng = random.Random(seed)
    nodes = []
    for i in range(rng.randint(2, 6)):
        nodes.append(
            {
                "id": f"n{i}",
                "region": "r",
                "device": "gpu",
                "memory_bytes": rng.randint(1, 6) * 10**9,
                "block_throughput": rng.choice([100.0, 250.0, 400.0, 800.0]),
            }
        )
    return cluster_from_dict(
        {
            "model": {
                "name": "m",
                "num_blocks": rng.randint(2, 8),
                "hidden_size": 64,
                "dtype_bytes": 2,
                "block_bytes": 10**9,
            },
            "nodes": nodes,
            "network": {"intra_region": {"bandwidth_mbps": 10**5, "latency_ms": 1}},
        }
    )


@pytest.mark.parametrize("seed", range(30))
def test_max_flow_equals_min_coverage_with_partial_inference(seed):
    """With partial inference and fast links, the nodes holding a block form the minimum cut."""
    cluster = _uniform_cluster(seed)
    cost = CostModel(cluster)
    rng = random.Random(seed + 1000)
    L = cluster.model.num_blocks
    for _ in range(5):
        ranges = {}
        for n in cluster.node_ids:
            sizes = [k for k in cost.feasible_sizes(n) if k <= L]
            k = rng.choice(sizes)
            s = rng.randrange(L - k + 1)
            ranges[n] = (s, s + k)
        flow = evaluate(cluster, ranges, cost=cost).throughput
        assert flow == pytest.approx(min(coverage_profile(cost, ranges, L)), rel=1e-9, abs=1e-9)
        strict = evaluate(cluster, ranges, cost=cost, partial_inference=False).throughput
        assert strict <= flow + 1e-9
