"""`swarmnode plan --algorithm hexgen|hexgen2`: tables, JSON, options and readable errors.

Runs the real command on the real shared cluster specs (located like the other planner tests, through
``planner.cluster.shipped``). Each plan takes well under a second on these 8-GPU clusters; results are shared per module.
"""

from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.planner import shared_clusters_dir

HEXGEN_CLUSTER = "hexgen-case-study-8"  # 8 single-GPU nodes: one 8-stage pipeline, ~0.3 s
HEXGEN2_CLUSTER = "hexgen2-case-study-8"  # 4 H100 + 4 A100: two prefill and two decode groups, ~0.1 s


def run(*args):
    return CliRunner().invoke(main, ["plan", *args])


def ok(result):
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def hexgen_json():
    path = shared_clusters_dir() / f"{HEXGEN_CLUSTER}.json"  # a spec path, not a name
    return json.loads(ok(run(str(path), "-a", "hexgen", "--json", "-q", "--generations", "2")).stdout)


@pytest.fixture(scope="module")
def hexgen2_json():
    return json.loads(ok(run(HEXGEN2_CLUSTER, "-a", "hexgen2", "--json", "-q")).stdout)


def stage_ids(payload):
    return [s["id"] for g in payload["groups"] for s in g["stages"]]


def test_hexgen_json_has_groups_covering_the_model(hexgen_json):
    assert hexgen_json["algorithm"] == "hexgen" and hexgen_json["cluster"] == HEXGEN_CLUSTER
    assert hexgen_json["groups"] and hexgen_json["replicas"] == len(hexgen_json["groups"])
    assert hexgen_json["generations"] == 2
    for group in hexgen_json["groups"]:
        assert group["role"] == "replica" and group["capacity"] > 0
        ranges = [s["layers"] for s in group["stages"]]
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert [s["tp"] for s in group["stages"]] == group["strategy"]
    assert sorted(stage_ids(hexgen_json)) == sorted(hexgen_json["placement"])
    assert hexgen_json["throughput"] > 0


def test_hexgen_table_names_every_group_and_stage(hexgen_json):
    result = ok(run(HEXGEN_CLUSTER, "-a", "hexgen", "--generations", "2"))
    out = result.stdout
    assert out.startswith("hexgen: ")
    assert "tokens/s" in out and "SLO attainment" in out and "latency" in out
    for i, group in enumerate(hexgen_json["groups"]):
        assert f"replica-{i} " in out
        assert f"PP {len(group['stages'])}" in out
        for stage in group["stages"]:
            start, end = stage["layers"]
            assert stage["id"] in out and f"[{start}, {end})" in out
    assert "memory fits" in out
    assert "hexgen: genetic search" in result.stderr  # progress on stderr, not in the table


def test_hexgen2_json_distinguishes_prefill_and_decode(hexgen2_json):
    assert hexgen2_json["algorithm"] == "hexgen2"
    groups = hexgen2_json["groups"]
    roles = {g["id"]: g["role"] for g in groups}
    assert {"prefill", "decode"} <= set(roles.values())
    for gid, role in roles.items():
        assert gid.startswith(f"{role}-")
    for route in hexgen2_json["kv_routing"]:
        assert roles[route["prefill"]] == "prefill" and roles[route["decode"]] == "decode"
    assert abs(sum(r["weight"] for r in hexgen2_json["kv_routing"]) - 1.0) < 1e-6
    gpus = [gpu for s in (st for g in groups for st in g["stages"]) for gpu in s["gpus"]]
    assert len(gpus) == len(set(gpus)) == 8  # every GPU serves one group


def test_hexgen2_table_names_every_group_with_its_role(hexgen2_json):
    out = ok(run(HEXGEN2_CLUSTER, "-a", "hexgen2", "-q")).stdout
    assert out.startswith("hexgen2: ") and "KV routing:" in out
    lines = out.splitlines()
    for group in hexgen2_json["groups"]:
        header = next(line for line in lines if line.startswith(f"{group['id']} "))
        assert group["role"] in header and f"TP {group['tp_pp']['tp']}" in header and "memory fits" in header
        for stage in group["stages"]:
            assert stage["id"] in out
    assert "prompts/s" in out  # prefill capacity
    for route in hexgen2_json["kv_routing"]:
        assert f"{route['prefill']} -> {route['decode']}" in out


def test_task_options_reach_the_planners():
    hexgen = json.loads(
        ok(
            run(
                HEXGEN_CLUSTER,
                *("-a", "hexgen", "--json", "-q", "--generations", "0", "--seed", "1"),
                *("--input-tokens", "100", "--output-tokens", "20", "--sim-duration", "5"),
            )
        ).stdout
    )
    assert hexgen["task"] == {"batch": 1.0, "s_in": 100.0, "s_out": 20.0} and hexgen["generations"] == 0
    args = ("-a", "hexgen2", "--json", "-q", "--workload", "lpld", "--max-iterations", "0")
    hexgen2 = json.loads(ok(run(HEXGEN2_CLUSTER, *args)).stdout)
    assert hexgen2["task"] == {"s_in": 256.0, "s_out": 64.0} and hexgen2["iterations"] == 0


def test_bad_spec_gives_a_clear_error(tmp_path):
    missing = run(str(tmp_path / "nope.json"), "-a", "hexgen")
    assert missing.exit_code == 1 and "no such file" in missing.output
    assert "Traceback" not in missing.output and isinstance(missing.exception, SystemExit)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad = run(str(broken), "-a", "hexgen2")
    assert bad.exit_code == 1 and bad.output.startswith("Error: ") and "Traceback" not in bad.output
    folder = run(str(tmp_path), "-a", "hexgen2")
    assert folder.exit_code == 1 and "is a directory" in folder.output


def test_planner_errors_become_click_errors():
    no_gpus = run("llamps-bloom3b-3server", "-a", "hexgen2")
    assert no_gpus.exit_code == 1 and "hexgen2: " in no_gpus.output and "GPU" in no_gpus.output
    assert isinstance(no_gpus.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("-a", "milp", "--generations", "3"), "--generations applies to --algorithm hexgen"),
        (("-a", "hexgen2", "--rate", "2"), "--rate applies to --algorithm hexgen"),
        (("-a", "hexgen", "--gap", "0.1"), "--gap applies to"),
        (("-a", "milp", "--seed", "1"), "--seed applies to --algorithm hexgen / hexgen2 / petals"),
        (("-a", "swarm", "--rebalance"), "--rebalance applies to --algorithm petals"),
        (("-a", "hexgen", "--rate", "-1"), "--rate"),
        (("-a", "hexgen", "--population", "0"), "--population"),
        (("-a", "hexgen2", "--workload", "XX"), "--workload"),
        (("-a", "hexgen2", "--workload", "LPLD", "--input-tokens", "5"), "not both"),
    ],
)
def test_options_are_validated_before_planning(args, message):
    result = run(HEXGEN_CLUSTER, *args)
    assert result.exit_code == 2 and message in result.output
