"""Scoring a given placement (`planner.score`, `swarmnode plan --placement`): the same figures as the plan
that produced it, every cost model, and one clear error line (exit status 2) for a file that cannot be
scored."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.planner import (
    CostModel,
    PlacementError,
    PlannerError,
    load_shared_cluster,
    plan,
    score,
)


def run(*args):
    return CliRunner().invoke(main, ["plan", *args])


def write(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize(("spec", "algorithm"), [("helix-single-24", "petals"), ("helix-geo-24", "swarm"),
                                                 ("llamps-bloom3b-3server", "milp")])
def test_scoring_a_plan_gives_its_figures(spec, algorithm, partial):
    cluster = load_shared_cluster(spec)
    limit = {"time_limit": 2} if algorithm == "milp" else {}  # the one of them with a time limit
    planned = plan(cluster, algorithm, partial_inference=partial, **limit)
    scored = score(cluster, planned.placement.to_dict(), partial_inference=partial)
    assert scored.algorithm == "given" and scored.model_size is None
    assert scored.placement == planned.placement
    assert scored.throughput == pytest.approx(planned.throughput, rel=1e-9)
    assert scored.helix_bound == pytest.approx(planned.helix_bound)
    assert scored.node_flows == pytest.approx(planned.node_flows)  # the same graph, built in the same order
    assert scored.latency == pytest.approx(planned.latency)
    assert scored.upper_bound >= scored.throughput and 0 <= scored.gap <= 1
    assert scored.details["bound_name"] in scored.details["bounds"]


def test_cli_scores_a_plan_it_printed(tmp_path):
    planned = run("helix-single-24", "-a", "petals", "--json")
    assert planned.exit_code == 0, planned.output
    payload = json.loads(planned.stdout)
    for given in (write(tmp_path, "plan.json", planned.stdout), write(tmp_path, "p.json", payload["placement"])):
        result = run("helix-single-24", "--placement", given, "--json")
        assert result.exit_code == 0, result.output
        scored = json.loads(result.stdout)
        assert scored["algorithm"] == "given" and scored["model_size"] is None
        assert scored["throughput"] == pytest.approx(payload["throughput"], rel=1e-9)
        assert scored["flows"] == payload["flows"]  # the same graph, built in the same order
        assert scored["cost_model"] == "roofline" and scored["placement"] == payload["placement"]
        for key in ("upper_bound", "gap", "helix_bound", "gap_to_helix_bound", "node_flows", "latency"):
            assert key in scored


def test_cli_scores_in_text(tmp_path):
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    given = write(tmp_path, "p.json", {"S1": [0, 14], "S2": [14, 24], "S3": [24, 30]})
    result = run("llamps-bloom3b-3server", "--placement", given)
    assert result.exit_code == 0, result.output
    expected = score(cluster, {"S1": [0, 14], "S2": [14, 24], "S3": [24, 30]})
    assert result.stdout.startswith("cost model: roofline")
    assert f"given: throughput {expected.throughput:.1f} tokens/s" in result.stdout
    assert "S1" in result.stdout and "[0, 14)" in result.stdout
    gap = write(tmp_path, "gap.json", {"S1": [0, 14], "S3": [24, 30]})
    partial = run("llamps-bloom3b-3server", "--placement", gap)
    assert partial.exit_code == 0, partial.output
    assert "blocks nobody serves: [14, 24)" in partial.stdout and "unused: S2" in partial.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ("[[0, 4]]", "a placement is a JSON object"),
        ("null", "a placement is a JSON object"),
        ({}, "the placement is empty"),
        ({"a100-0": [0, 10], "gpu-x": [0, 4]}, "node(s) 'gpu-x' not in cluster 'helix-single-24'"),
        ({"a100-0": [70, 81]}, "range [70, 81) is not inside [0, 80)"),
        ({"a100-0": [-1, 4]}, "range [-1, 4) is not inside [0, 80)"),
        ({"a100-0": [5, 5]}, "range [5, 5) is empty"),
        ({"a100-0": [6, 2]}, "range [6, 2) is empty"),
        ({"t4-0": [0, 5]}, "holds 5 blocks but can hold at most 4 under the roofline cost model"),
        ({"a100-0": [0, 2.5]}, "a range is [start, end] (two integers)"),
        ({"a100-0": "0-4"}, "a range is [start, end] (two integers)"),
        ({"a100-0": [0, 4, 8]}, "a range is [start, end] (two integers)"),
    ],
)
def test_bad_placement_files(tmp_path, content, message):
    path = write(tmp_path, "bad.json", content)
    result = run("helix-single-24", "--placement", path, "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: --placement {path}: ")
    assert message in lines[0]


def test_every_problem_in_one_line(tmp_path):
    path = write(tmp_path, "bad.json", {"zz": [0, 1], "a100-0": [0, 13], "l4-0": [4, 2]})
    result = run("helix-single-24", "--placement", path)
    assert result.exit_code == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert "'zz'" in line and "holds 13 blocks" in line and "[4, 2) is empty" in line
    missing = run("helix-single-24", "--placement", str(tmp_path / "missing.json"))
    assert missing.exit_code == 2 and "cannot read it" in missing.stderr and missing.stdout == ""


def test_placement_excludes_planning_options(tmp_path):
    path = write(tmp_path, "p.json", {"S1": [0, 14], "S2": [14, 24], "S3": [24, 30]})
    for extra in (["--algorithm", "gma"], ["-a", "milp"], ["--gap", "0.1"], ["--time-limit", "3"],
                  ["--formulation", "typed"], ["--seed", "3"]):
        result = run("llamps-bloom3b-3server", "--placement", path, *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert "--placement" in result.output
    allowed = run("llamps-bloom3b-3server", "--placement", path, "--no-partial-inference", "--cost-model",
                  "roofline", "--json")
    assert allowed.exit_code == 0, allowed.output


def test_score_api_errors_and_unserved_blocks():
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    with pytest.raises(PlacementError, match="not in cluster") as caught:
        score(cluster, {"S9": (0, 30)})
    assert caught.value.code == "invalid_placement"
    with pytest.raises(PlannerError, match="pass one of them"):
        score(cluster, {"S1": (0, 14)}, cost=CostModel(cluster), cost_model="helix")
    gap = score(cluster, {"S1": (0, 14), "S3": (24, 30)})
    assert gap.throughput == 0.0 and gap.details["unserved_blocks"] == [[14, 24]]
    assert list(score(cluster, {"S3": (24, 30), "S1": (0, 14)}).placement) == ["S3", "S1"]  # order kept


def test_score_with_the_helix_cost_model(tmp_path):
    cluster = load_shared_cluster("helix-single-24")
    planned = plan(cluster, "petals", cost_model="helix")
    scored = score(cluster, planned.placement, cost_model="helix")
    assert scored.cost_model == "helix" and scored.cost_sources["t4-0"] == "helix:t4"
    assert scored.throughput == pytest.approx(planned.throughput, rel=1e-9)
    path = write(tmp_path, "p.json", planned.placement.to_dict())
    result = run("helix-single-24", "--placement", path, "--cost-model", "helix", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["throughput"] == pytest.approx(planned.throughput, rel=1e-9)
    roofline = score(cluster, planned.placement, cost_model="roofline")
    assert roofline.cost_model == "roofline" and roofline.throughput != pytest.approx(scored.throughput)
