"""`swarmnode plan`: table and JSON output (JSON alone on stdout, in a fresh process too), every
algorithm, the cost model it names, the MILP's size, readable errors; the algorithm registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.planner import (
    PLACEMENT_ALGORITHMS,
    CostModel,
    PlannerError,
    cluster_from_dict,
    cluster_to_dict,
    load_shared_cluster,
    plan,
    plan_all,
    shared_clusters_dir,
)
from swarmnode.planner.costs.factory import make_cost_model


def run(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_plan_json_gma_matches_llamps():
    result = run("llamps-bloom3b-3server", "--algorithm", "gma", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["algorithm"] == "gma"
    assert payload["placement"] == {"S1": [0, 14], "S2": [14, 24], "S3": [24, 30]}
    for key in ("throughput", "upper_bound", "solve_seconds", "flows"):
        assert key in payload
    assert payload["throughput"] > 0 and payload["upper_bound"] >= payload["throughput"]
    assert (
        abs(sum(payload["flows"]["source"].values()) - payload["throughput"]) < 1e-6 * payload["throughput"]
    )


def test_plan_all_lists_every_algorithm():
    path = shared_clusters_dir() / "helix-single-24.json"
    result = run(str(path), "-a", "all", "--time-limit", "5", "--json", "-q")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [p["algorithm"] for p in payload] == ["milp", "ahp", "gma", "petals", "swarm"]
    best = max(p["throughput"] for p in payload)
    assert payload[0]["throughput"] == best


def test_plan_table_and_progress():
    result = run("helix-single-24", "--time-limit", "5")
    assert result.exit_code == 0, result.output
    assert "milp: throughput" in result.stdout and "a100-0" in result.stdout and "[" in result.stdout
    assert "done" in result.stderr  # progress of the MILP on stderr


def test_plan_errors_are_readable(tmp_path):
    missing = run(str(tmp_path / "nope.json"))
    assert missing.exit_code != 0 and "no such file" in missing.output
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "model": {"num_blocks": 2, "hidden_size": 8, "dtype_bytes": 2, "block_bytes": 10},
                "nodes": [],
                "network": {},
            }
        )
    )
    result = run(str(bad))
    assert result.exit_code != 0 and "no nodes" in result.output
    unknown = run("helix-single-24", "--algorithm", "nope")
    assert unknown.exit_code != 0


def test_every_command_offers_the_registry_algorithms():
    import click

    from swarmnode.planner.registry import ALGORITHMS, PLACEMENT_ALGORITHMS, REPLICA_ALGORITHMS

    assert set(PLACEMENT_ALGORITHMS) | set(REPLICA_ALGORITHMS) == set(ALGORITHMS)
    offered = {"plan": [*ALGORITHMS, "all"], "simulate": list(ALGORITHMS)}
    live = [*PLACEMENT_ALGORITHMS, "hexgen2"]  # a coordinator also plans HexGen-2's two phases for a live swarm
    offered |= {"join": live, "coordinate": live}
    for name, choices in offered.items():
        command = main.get_command(click.Context(main), name)
        param = next(p for p in command.params if p.name == "algorithm")
        assert list(param.type.choices) == choices, name


def test_plan_all_warm_starts_the_milp_and_reports_failures():
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    failed = []
    results = plan_all(cluster, time_limit=5, on_error=lambda n, e: failed.append(n))
    assert [r.algorithm for r in results] == [n for n in PLACEMENT_ALGORITHMS if n not in failed]
    milp = next(r for r in results if r.algorithm == "milp")
    assert milp.details["start_algorithm"] == "given"  # the best heuristic's placement, passed in
    tiny = cluster.with_nodes(cluster.nodes[:1])  # one node cannot hold the model
    assert plan_all(tiny, ["gma", "milp"], time_limit=1, on_error=lambda n, e: failed.append((n, e))) == []
    assert [n for n, _ in failed[-2:]] == ["gma", "milp"] and failed[-2][1].code == "cannot_place"
    assert milp.throughput >= max(r.throughput for r in results) * (1 - 1e-9)


def test_plan_refuses_unknown_algorithms_and_options():
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    with pytest.raises(PlannerError, match="choose one of milp") as caught:
        plan(cluster, "hexgen")
    assert caught.value.code == "unknown_algorithm"
    with pytest.raises(PlannerError, match="unknown option") as caught:
        plan(cluster, "gma", generations=3)
    assert caught.value.code == "bad_option"
    with pytest.raises(PlannerError, match=r"gma: unknown option.* time_limit; gma takes no options") as caught:
        plan(cluster, "gma", time_limit=1)  # another placement algorithm's option is not dropped silently
    assert caught.value.code == "bad_option"
    with pytest.raises(PlannerError, match=r"milp: unknown option.* rebalance; milp takes .*time_limit"):
        plan(cluster, "milp", rebalance=True)


def plan_process(*args: str) -> subprocess.CompletedProcess:
    """`swarmnode plan` in a fresh interpreter: what a shell pipe to `python -m json.tool` sees (HiGHS
    prints its banner once per process, so only a new process shows whether stdout stays clean)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "swarmnode", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_json_stdout_is_json_alone_in_a_fresh_process():
    milp = plan_process("helix-single-24", "--algorithm", "milp", "--time-limit", "2", "--json")
    assert milp.returncode == 0, milp.stderr
    payload = json.loads(milp.stdout)
    assert payload["algorithm"] == "milp" and payload["throughput"] > 0
    assert "HiGHS" not in milp.stdout + milp.stderr  # the solver's banner and log are off
    assert "done" in milp.stderr  # progress goes to stderr
    every = plan_process("helix-single-24", "--algorithm", "all", "--time-limit", "2", "--json")
    assert every.returncode == 0, every.stderr
    assert [p["algorithm"] for p in json.loads(every.stdout)] == list(PLACEMENT_ALGORITHMS)


@pytest.mark.parametrize("algorithm", ["hexgen", "hexgen2"])
def test_replica_json_stdout_is_json_alone(algorithm):
    result = run("hexgen-case-study-8", "-a", algorithm, "--time-limit", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["algorithm"] == algorithm
    assert "up to 1 s" in result.stderr


def test_milp_json_reports_helix_table_8_sizes():
    """Helix Table 8: 1376 variables and 1848 constraints for the 24-node cluster without pruning (Helix's
    run had no partial inference); the pruned size and what each phase solved are reported too."""
    result = run("helix-single-24", "--time-limit", "2", "--no-partial-inference", "--json", "-q")
    assert result.exit_code == 0, result.output
    size = json.loads(result.stdout)["model_size"]
    assert size["formulation"] == "per-node" and size["partial_inference"] is False
    assert size["unpruned"] == {"columns": 1376, "rows": 1848}
    # every link ties with the 12th fastest on this single-region cluster: pruning keeps them all
    assert size["link_degree"] == 12 and size["pruned"] == size["unpruned"]
    assert size["solved"], "the search handed at least one model to HiGHS"
    for phase in size["solved"]:
        assert phase["models"] >= 1 and phase["columns"] > 0 and phase["rows"] > 0
    heuristic = json.loads(run("helix-single-24", "-a", "gma", "--json").stdout)
    assert heuristic["model_size"] is None


def test_milp_text_reports_its_size():
    result = run("llamps-bloom3b-3server", "--time-limit", "1", "-q")
    assert result.exit_code == 0, result.output
    assert "cost model: roofline" in result.stdout
    assert "Helix per-node MILP (with partial inference)" in result.stdout and "columns" in result.stdout


def test_cost_model_option_and_spec_field():
    result = run("llamps-bloom3b-3server", "-a", "gma", "--cost-model", "roofline", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["cost_model"] == "roofline"
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    assert payload["cost_sources"] == {n: "roofline" for n in cluster.node_ids}  # placed or not
    wrong = run("llamps-bloom3b-3server", "-a", "gma", "--cost-model", "nope")
    assert wrong.exit_code == 2 and "nope" in wrong.output
    replicas = run("hexgen-case-study-8", "-a", "hexgen", "--cost-model", "roofline")
    assert replicas.exit_code == 2 and "--cost-model applies to" in replicas.output


def test_plan_takes_a_cost_model_by_name():
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    named = plan(cluster, "petals", cost_model="roofline")
    assert named.cost_model == "roofline"
    assert named.throughput == pytest.approx(plan(cluster, "petals").throughput)
    cost = CostModel(cluster)
    assert plan(cluster, "petals", cost=cost, cost_model="roofline").throughput == pytest.approx(named.throughput)
    with pytest.raises(PlannerError, match="unknown cost model") as caught:
        plan(cluster, "petals", cost_model="nope")
    assert caught.value.code == "bad_option"
    results = plan_all(cluster, ["gma", "petals"], cost_model="roofline")
    assert [r.cost_model for r in results] == ["roofline", "roofline"]


def test_cost_and_cost_model_must_agree():
    cluster = load_shared_cluster("helix-single-24")
    with pytest.raises(PlannerError, match="pass one of them") as caught:
        plan(cluster, "swarm", cost=CostModel(cluster), cost_model="helix")
    assert caught.value.code == "bad_option"
    with pytest.raises(PlannerError, match="pass one of them"):
        plan_all(cluster, ["swarm"], cost=CostModel(cluster), cost_model="helix")


def test_helix_cost_model_by_option_and_by_spec(tmp_path):
    """``--cost-model helix`` and a spec's ``"cost_model": "helix"`` both score with Helix's profiles."""
    result = run("helix-single-24", "-a", "petals", "--cost-model", "helix", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["cost_model"] == "helix"
    assert {s.split(":")[0] for s in payload["cost_sources"].values()} == {"helix"}
    assert payload["cost_sources"]["a100-0"] == "helix:a100"
    cluster = load_shared_cluster("helix-single-24")
    expected = plan(cluster, "petals", cost=make_cost_model(cluster, "helix"))
    assert payload["throughput"] == pytest.approx(expected.throughput)
    spec = tmp_path / "helix-spec.json"
    spec.write_text(json.dumps({**cluster_to_dict(cluster), "cost_model": "helix"}))
    assert cluster_from_dict(json.loads(spec.read_text())).cost_model == "helix"
    by_spec = json.loads(run(str(spec), "-a", "petals", "--json").stdout)
    assert by_spec["cost_model"] == "helix" and by_spec["throughput"] == pytest.approx(expected.throughput)
    overridden = json.loads(run(str(spec), "-a", "petals", "--cost-model", "roofline", "--json").stdout)
    assert overridden["cost_model"] == "roofline"


def test_helix_cost_model_milp():
    cluster = load_shared_cluster("helix-single-24")
    result = plan(cluster, "milp", cost_model="helix", time_limit=2, partial_inference=False)
    assert result.cost_model == "helix" and result.throughput > 0
    assert result.model_size["unpruned"] == {"columns": 1376, "rows": 1848}  # sizes alike: 1..max blocks
