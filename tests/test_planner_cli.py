"""`swarmnode plan`: table and JSON output, every algorithm, readable errors; the algorithm registry."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.planner import (
    PLACEMENT_ALGORITHMS,
    PlannerError,
    load_shared_cluster,
    plan,
    plan_all,
    shared_clusters_dir,
)


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
    offered |= {"join": list(PLACEMENT_ALGORITHMS), "coordinate": list(PLACEMENT_ALGORITHMS)}
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
    assert plan(cluster, "gma", time_limit=1).algorithm == "gma"  # another placement algorithm's option
