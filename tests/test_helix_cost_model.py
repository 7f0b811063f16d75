"""The helix cost model against Helix's own code: ``T_j`` tables, profiles, KV room, batch caps.

``tests/data/helix_reference_tj.json`` holds what Helix's published code (Thesys-lab/Helix-ASPLOS25,
``get_typical_token_throughput``) computes for the machine mixes of the shipped Helix clusters, written by
``scripts/helix_reference_tj.py`` from a checkout of that repository.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from swarmnode.planner import PlannerError, Workload, cluster_from_dict, cluster_to_dict, load_shared_cluster
from swarmnode.planner.cluster.helix_profiles import model_profiles, profile_key
from swarmnode.planner.cluster.spec import SpecError
from swarmnode.planner.costs.factory import COST_MODELS, make_cost_model
from swarmnode.planner.costs.helix_profiled import HelixCostModel
from swarmnode.planner.costs.roofline import CostModel

REFERENCE = json.loads((Path(__file__).parent / "data" / "helix_reference_tj.json").read_text())
HELIX_LENGTHS = Workload(avg_input_tokens=750, avg_output_tokens=240)


@pytest.mark.parametrize("name", sorted(REFERENCE["cases"]))
def test_tables_equal_helix_code(name):
    case = REFERENCE["cases"][name]
    cluster = load_shared_cluster(name)
    cost = make_cost_model(cluster, "helix", workload=HELIX_LENGTHS)
    assert isinstance(cost, HelixCostModel)
    assert cost.typical_layers == case["typical_layers"]
    for kind, speed in case["speed"].items():
        assert cost.speed[kind] == pytest.approx(speed, rel=1e-9)
    seen = set()
    for node in cluster.nodes:
        kind = profile_key(node)
        expected = case["tokens_per_second"][kind]
        # the flow graph counts output tokens: Helix's tokens over the tokens a request brings per output
        got = [t * cost.shape.tokens_per_pass for t in cost.table[node.id][1:]]
        assert got == pytest.approx(expected, rel=1e-9), (node.id, kind)
        assert cost.capacity[node.id] == len(expected)
        seen.add(kind)
    assert seen == set(case["tokens_per_second"])


def test_paper_lengths_change_the_tables():
    """763/232 (the paper's trace) and 750/240 (Helix's code) give different, close tables."""
    cluster = load_shared_cluster("helix-single-24")
    paper = make_cost_model(cluster, "helix")
    code = make_cost_model(cluster, "helix", workload=HELIX_LENGTHS)
    assert paper.shape.s_in == 763 and paper.shape.s_out == 232
    a, b = paper.table["a100-0"][8], code.table["a100-0"][8]
    assert a != b and abs(a / b - 1) < 0.2


def test_layer_rate_falls_with_layers_unlike_the_roofline():
    """Under Helix's model a node's layer-tokens per second fall as it holds more layers (its KV share
    shrinks), which is why spreading layers beats holding as many as fit; the roofline model's do not
    fall as steeply."""
    cluster = load_shared_cluster("helix-single-24")
    helix, roofline = make_cost_model(cluster, "helix"), CostModel(cluster)
    for node in ("a100-0", "l4-0", "t4-0"):
        rates = [j * t for j, t in enumerate(helix.table[node])][1:]
        assert all(a > b for a, b in itertools.pairwise(rates)), node
        roof = [j * t for j, t in enumerate(roofline.table[node])][1:]
        assert rates[-1] / rates[0] < roof[-1] / roof[0]


def test_profile_interpolation_and_batch_figures():
    cluster = load_shared_cluster("helix-single-24")
    cost = make_cost_model(cluster, "helix")
    profile = cost.profile_of("a100-0")
    points = dict(profile.prompt_ms)
    assert profile.prompt_seconds(750) == pytest.approx(points[750] / 1000)
    mid = (points[500] + points[750]) / 2 / 1000
    assert profile.prompt_seconds(625) == pytest.approx(mid)
    last, before = profile.prompt_ms[-1], profile.prompt_ms[-2]
    slope = (last[1] - before[1]) / (last[0] - before[0])
    assert profile.prompt_seconds(last[0] + 100) == pytest.approx((last[1] + 100 * slope) / 1000)
    assert profile.prompt_seconds(0) == 0.0
    # j layers take j times one layer's prompt plus decode time
    want = 5 * (profile.prompt_seconds(300) + profile.decode_seconds(40))
    assert cost.batch_seconds("a100-0", 5, 300, 40) == pytest.approx(want)
    assert cost.kv_token_layers("a100-0", 5) == 16 * profile.vllm_blocks[5] * 5
    assert cost.batch_limits("a100-0", 12) == (
        profile.prompt_max_requests[12] * 2048,
        profile.decode_max_tokens[12],
    )
    assert cost.token_latency("a100-0", 4) == pytest.approx(4 * profile.decode_seconds(1))
    assert cost.sources()["a100-0"] == "helix:a100"


def _mixed_spec(**extra):
    base = json.loads(json.dumps(cluster_to_dict(load_shared_cluster("helix-single-24"))))
    base["nodes"] = [
        *base["nodes"][:6],
        {"id": "cpu-0", "region": base["nodes"][0]["region"], "device": "cpu", "cores": 32,
         "memory_bytes": 256 * 2**30},
        {"id": "h100-0", "region": base["nodes"][0]["region"], "device": "gpu", "gpu": "H100", "gpus": 1,
         "memory_bytes": 80 * 2**30, "tflops": 989, "memory_bandwidth_gbs": 3350, "nic_mbps": 10000},
    ]
    base.update(extra)
    return base


def test_unprofiled_nodes_keep_the_roofline():
    cluster = cluster_from_dict(_mixed_spec())
    helix, roofline = make_cost_model(cluster, "helix"), CostModel(cluster)
    sources = helix.sources()
    assert sources["cpu-0"] == "roofline" and sources["h100-0"] == "roofline"
    assert sources["a100-0"] == "helix:a100"
    for node in ("cpu-0", "h100-0"):
        assert helix.table[node] == roofline.table[node]
        assert helix.batch_limits(node, 1) is None
        assert helix.batch_seconds(node, 2, 100, 3, 50) == roofline.batch_seconds(node, 2, 100, 3, 50)
    assert helix.table["a100-0"] != roofline.table["a100-0"]


def test_model_without_profiles_is_refused():
    spec = _mixed_spec()
    spec["model"] = {"name": "tiny", "num_blocks": 30, "hidden_size": 576, "dtype_bytes": 2,
                     "block_bytes": 10_000_000}
    cluster = cluster_from_dict(spec)
    with pytest.raises(PlannerError, match=r"Helix profiled no model shaped like 'tiny'.*roofline"):
        make_cost_model(cluster, "helix")
    with pytest.raises(PlannerError, match="Helix profiled no model"):
        model_profiles(cluster.model)


def test_spec_field_selects_the_model():
    cluster = cluster_from_dict(_mixed_spec(cost_model="helix"))
    assert cluster.cost_model == "helix"
    assert make_cost_model(cluster).name == "helix"
    assert make_cost_model(cluster, "roofline").name == "roofline"
    again = cluster_from_dict(cluster_to_dict(cluster))
    assert again.cost_model == "helix"
    assert "cost_model" not in cluster_to_dict(load_shared_cluster("helix-single-24"))
    with pytest.raises(SpecError, match="cost_model must be one of roofline, helix, got 'gurobi'"):
        cluster_from_dict(_mixed_spec(cost_model="gurobi"))
    with pytest.raises(PlannerError, match="unknown cost model 'fast'"):
        make_cost_model(cluster, "fast")
    assert COST_MODELS == ("roofline", "helix")
