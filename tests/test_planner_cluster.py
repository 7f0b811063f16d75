"""Cluster specs: the shipped files load, plain dicts validate, bad specs fail with useful messages."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from swarmnode.planner import (
    COORDINATOR,
    SpecError,
    cluster_from_dict,
    cluster_to_dict,
    list_shared_clusters,
    load_cluster,
    load_shared_cluster,
    resolve_cluster,
    shared_clusters_dir,
)
from swarmnode.planner.cluster.shipped import CLUSTERS_DIR_ENV
from swarmnode.planner.costs.roofline import block_capacity
from swarmnode.planner.errors import PlannerError

EXPECTED_SPECS = {
    "helix-single-24": 24,
    "helix-geo-24": 24,
    "helix-hetero-42": 42,
    "helix-single-24-llama30b": 24,
    "llamps-bloom3b-3server": 5,
}


def small_spec() -> dict:
    return {
        "name": "tiny",
        "model": {"name": "m", "num_blocks": 4, "hidden_size": 64, "dtype_bytes": 2, "block_bytes": 1000},
        "nodes": [
            {
                "id": "a",
                "region": "r1",
                "device": "gpu",
                "memory_bytes": 4000,
                "tflops": 10,
                "memory_bandwidth_gbs": 100,
                "nic_mbps": 1000,
            },
            {"id": "b", "region": "r2", "device": "cpu", "memory_bytes": 3000, "cores": 4},
        ],
        "network": {
            "intra_region": {"bandwidth_mbps": 1000, "latency_ms": 1},
            "inter_region": {"bandwidth_mbps": 100, "latency_ms": 20},
            "coordinator_region": "r1",
        },
    }


def test_shared_specs_load():
    names = list_shared_clusters()
    for name, count in EXPECTED_SPECS.items():
        assert name in names
        cluster = load_shared_cluster(name)
        assert len(cluster.nodes) == count
    for name in names:  # every shared spec is valid
        assert load_shared_cluster(name).nodes


def test_helix_layer_caps_from_memory():
    # Helix keeps half of VRAM for KV cache: LLaMA-2 70B blocks per GPU type
    cluster = load_shared_cluster("helix-hetero-42")
    caps = {}
    for node in cluster.nodes:
        caps.setdefault((node.gpu, node.gpus), block_capacity(cluster, node))
    assert caps[("A100-40G", 1)] == 12
    assert caps[("L4", 1)] == 7
    assert caps[("T4", 1)] == 4
    assert caps[("V100-16G", 1)] == 4
    assert caps[("L4", 2)] == 14
    assert caps[("T4", 2)] == 9
    assert caps[("T4", 4)] == 18


def test_yaml_matches_json(tmp_path):
    src = shared_clusters_dir() / "helix-geo-24.json"
    data = json.loads(src.read_text())
    path = tmp_path / "geo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cluster_to_dict(load_cluster(path)) == cluster_to_dict(load_cluster(src))


def test_dict_round_trip():
    cluster = cluster_from_dict(small_spec())
    again = cluster_from_dict(cluster_to_dict(cluster))
    assert cluster_to_dict(again) == cluster_to_dict(cluster)
    assert cluster.link("a", "b").bandwidth_mbps == 100
    assert cluster.coordinator_link("a").bandwidth_mbps == 1000
    assert cluster.coordinator_link("b").bandwidth_mbps == 100


def test_link_resolution_order():
    spec = small_spec()
    spec["nodes"].append(dict(spec["nodes"][0], id="c", machine="box"))
    spec["nodes"][0]["machine"] = "box"
    spec["network"]["intra_machine"] = {"bandwidth_mbps": 50000, "latency_ms": 0.01}
    spec["network"]["region_links"] = [{"a": "r2", "b": "r1", "bandwidth_mbps": 300, "latency_ms": 5}]
    spec["network"]["links"] = [{"a": "b", "b": COORDINATOR, "bandwidth_mbps": 7, "latency_ms": 9}]
    cluster = cluster_from_dict(spec)
    assert cluster.link("a", "c").bandwidth_mbps == 50000  # same machine
    assert cluster.link("a", "b").bandwidth_mbps == 300  # region pair
    assert cluster.coordinator_link("b").bandwidth_mbps == 7  # node pair wins
    assert cluster.coordinator_link("c").bandwidth_mbps == 1000


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(nodes=[]), "no nodes"),
        (lambda s: s["nodes"][0].update(memory_bytes=-5), "negative"),
        (lambda s: s["nodes"][1].update(id="a"), "duplicate node id"),
        (
            lambda s: s["network"].update(links=[{"a": "a", "b": "zz", "bandwidth_mbps": 1}]),
            "unknown node 'zz'",
        ),
        (lambda s: s["nodes"][0].update(memory_byte=5), "did you mean 'memory_bytes'"),
        (lambda s: s["network"].pop("inter_region"), "no link between regions"),
        (lambda s: s["nodes"][0].update(id=COORDINATOR), "reserved"),
        (lambda s: s.update(weight_memory_fraction=1.5), "weight_memory_fraction"),
        (lambda s: s["nodes"][0].update(device="tpu"), "device must be"),
        (lambda s: s["nodes"][0].pop("tflops"), "needs tflops"),
        (lambda s: s["nodes"][1].pop("cores"), "needs cores"),
        (lambda s: s["model"].update(num_blocks=0), "num_blocks"),
        (lambda s: s.pop("model"), "missing required key 'model'"),
        (lambda s: s["network"]["intra_region"].update(bandwidth_mbps=0), "greater than 0"),
    ],
)
def test_bad_specs_are_refused(mutate, message):
    spec = copy.deepcopy(small_spec())
    mutate(spec)
    with pytest.raises(SpecError, match=message):
        cluster_from_dict(spec)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_cluster(bad)
    with pytest.raises(SpecError, match="no such file"):
        load_cluster(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="no cluster spec"):
        load_shared_cluster("no-such-cluster")


def test_clusters_dir_override(tmp_path, monkeypatch):
    (tmp_path / "mine.json").write_text(json.dumps(small_spec()))
    monkeypatch.setenv(CLUSTERS_DIR_ENV, str(tmp_path))
    assert shared_clusters_dir() == tmp_path.resolve()
    assert list_shared_clusters() == ["mine"]
    assert load_shared_cluster("mine").name == "tiny"


def test_specs_ship_with_the_planner(monkeypatch):
    monkeypatch.delenv(CLUSTERS_DIR_ENV, raising=False)
    import swarmnode.planner

    assert shared_clusters_dir() == (Path(swarmnode.planner.__file__).parent / "clusters").resolve()
    assert set(EXPECTED_SPECS) <= set(list_shared_clusters())


def test_resolve_cluster_by_path_or_name(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(small_spec()))
    assert resolve_cluster(path).name == "tiny" and resolve_cluster(str(path)).name == "tiny"
    assert resolve_cluster("helix-single-24") == load_shared_cluster("helix-single-24")
    for spec, message in ((tmp_path, "is a directory"), (tmp_path / "nope.json", "no such file")):
        with pytest.raises(SpecError, match=message) as caught:
            resolve_cluster(spec)
        assert isinstance(caught.value, PlannerError) and caught.value.code == "bad_spec"
