"""The simulator against Helix's max flow with Helix's own workload (763/232 tokens as its paper reports
it, 750/240 as its code uses it) under Helix's cost model, and the rules that make them agree: decode
steps first, long prompts prefilled in chunks that ride with them, batches bounded by a node's share of a
pipeline's requests, and Helix's KV expectation at admission (planner/simulator/engine.py's module docstring)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from swarmnode.planner.cluster.shipped import load_shared_cluster
from swarmnode.planner.cluster.spec import Workload, cluster_from_dict
from swarmnode.planner.costs.factory import make_cost_model
from swarmnode.planner.costs.roofline import CostModel, prefill_time
from swarmnode.planner.placement import Placement
from swarmnode.planner.simulator.engine import _Simulation
from swarmnode.planner.simulator.metrics import SimConfig
from swarmnode.planner.simulator.scoring import serve_at_load
from swarmnode.planner.simulator.serving import (
    EXPECTED_OUTPUT_SHARE,
    pipeline_batch,
    prefill_chunk,
    serving_from_placement,
)
from swarmnode.planner.simulator.trace import trace_from_rows

GIB = 1 << 30

#: The placement Helix's MILP finds on helix-single-24 with Helix's cost model: one pipeline of all 24
#: nodes, every node saturated by the max flow. Served in batches of everything waiting, its requests
#: travel in a few crowds and the nodes idle: 0.83 of the max flow, 0.29 before decode steps went first.
CHAIN_24 = Placement(
    {f"l4-{i}": (3 * i, 3 * i + 3) for i in range(8)}
    | {f"t4-{i}": (24 + 2 * i, 26 + 2 * i) for i in range(12)}
    | {f"a100-{i}": (48 + 8 * i, 56 + 8 * i) for i in range(4)}
)

#: The placement the MILP found on helix-single-24's 42-node sibling, helix-hetero-42 (Helix §6.1's high
#: heterogeneity), with Helix's cost model in 20 s (tests/data/placements/, with the command that made it):
#: one long pipeline of 30 stages, whose 2-layer V100s run out of KV room first.
HETERO_42 = Path(__file__).parent / "data" / "placements" / "helix-hetero-42.milp-helix.json"

LOAD = 1.1  # offered load, times the placement's max flow
#: Seconds of arrivals: a request lives for its 232 round trips of about a second, so the KV caches fill
#: and completions come at their steady rate after several minutes; the throughput is measured over the
#: second half.
DURATION = 600.0


def _agreement(cluster, placement, cost) -> float:
    """Simulated output tokens/s over the placement's max flow, at ``LOAD`` times that max flow, the cost
    model's lengths spread by 50% so that requests do not finish in lockstep
    (:func:`planner.simulator.scoring.serve_at_load`, which the planner benchmark compares placements with)."""
    ((flow, served),) = serve_at_load(cluster, {"placement": placement}, cost, load=LOAD, duration=DURATION).values()
    return served / flow


@pytest.mark.parametrize("lengths", [(763, 232), (750, 240)], ids=["paper-763-232", "code-750-240"])
def test_helix_cost_model_agrees_with_max_flow_on_helix_single_24(lengths):
    cluster = load_shared_cluster("helix-single-24")
    cost = make_cost_model(cluster, "helix", workload=Workload(*lengths))
    ratio = _agreement(cluster, CHAIN_24, cost)
    # at 1.1x the offered load the simulated throughput cannot sensibly pass 1.1x the max flow
    assert 0.85 <= ratio <= 1.15, ratio


# the paper's lengths only: the code's 750/240 is checked on helix-single-24 above, and each hetero-42 run
# simulates 42 nodes for 600 s (about a minute here)
@pytest.mark.parametrize("lengths", [(763, 232)], ids=["paper-763-232"])
def test_helix_cost_model_agrees_with_max_flow_on_helix_hetero_42(lengths):
    cluster = load_shared_cluster("helix-hetero-42")
    data = json.loads(HETERO_42.read_text())
    placement = Placement({n: tuple(r) for n, r in data["placement"].items()})
    cost = make_cost_model(cluster, "helix", workload=Workload(*lengths))
    ratio = _agreement(cluster, placement, cost)
    assert 0.85 <= ratio <= 1.15, ratio


def tiny_cluster(layers: int = 4):
    return cluster_from_dict(
        {
            "name": "tiny",
            "model": {"name": "m", "num_blocks": layers, "hidden_size": 1024, "dtype_bytes": 2,
                      "block_bytes": 10_000_000},
            "nodes": [{"id": "n0", "region": "r", "device": "gpu", "gpu": "G", "gpus": 1,
                       "memory_bytes": 4 * GIB, "tflops": 10, "memory_bandwidth_gbs": 100}],
            "network": {"intra_region": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0}},
            "workload": {"avg_input_tokens": 10, "avg_output_tokens": 20},
        }
    )


def _finish_times(model, rows):
    sim = _Simulation(model, trace_from_rows(rows), SimConfig(drain=100.0))
    sim.run()
    return [q.finish for q in sim.requests]


def test_decode_steps_overtake_a_long_prompt_prefilled_in_chunks():
    """A request with three tokens left when a 20000-token prompt reaches its node finishes long before
    that prompt's first token: the prompt is prefilled in chunks of at most the node's ``chunk`` tokens,
    one per batch, so each of its passes waits for at most two chunks. In one batch of
    everything waiting, the steps would wait for the whole prompt."""
    cluster = tiny_cluster()
    node = cluster.node("n0")
    model = serving_from_placement(cluster, Placement({"n0": (0, 4)}))
    server = model.servers["n0"]
    assert server.prompt_budget <= server.chunk == prefill_chunk(model.cost, "n0", 4, server.cap) < 20000
    chunk_seconds = server.seconds(4, server.chunk, 0, 0)
    # a chunk takes no longer than a batch of ``cap`` decode steps, unless it is the typical batch's prompt
    assert chunk_seconds <= server.seconds(4, 0, server.cap, server.cap * 25) * 1.01
    (alone,) = _finish_times(model, [(0.0, 10, 4)])
    short, long = _finish_times(model, [(0.0, 10, 4), (0.001, 20000, 1)])
    assert short < long
    # each of its four passes waits for at most the chunk running when it arrives and rides with another
    whole = prefill_time(cluster, node, 4, 20000)
    assert short <= alone + 4 * 2 * chunk_seconds + 1e-6 < whole, (short, alone, chunk_seconds, whole)
    # the chunks cost at least what the whole prompt costs through the node's four layers
    assert long >= 4 * prefill_time(cluster, node, 1, 20000)


def test_a_batch_holds_at_most_the_nodes_share_of_a_pipelines_requests():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster, workload=Workload(763, 232))
    model = serving_from_placement(cluster, CHAIN_24, cost=cost)
    for node_id, (start, end) in CHAIN_24.items():
        blocks = end - start
        share = cost.kv_token_layers(node_id, blocks) / (cluster.model.num_blocks * (763 + 232))
        assert model.servers[node_id].cap == pipeline_batch(cost, node_id, blocks) == math.ceil(share)
        assert model.servers[node_id].prompt_budget == pytest.approx(math.ceil(share) * 763 / 232)
    # the simulator's nodes take the cost model's KV room and entry layers
    assert model.servers["a100-0"].kv_capacity == cost.kv_token_layers("a100-0", 8)
    assert model.servers["a100-0"].entries == (0,)
    # and a request reserves KV for its prompt and half the average output (Helix's kv_expectation.py)
    assert model.reserve_output == EXPECTED_OUTPUT_SHARE * 232
