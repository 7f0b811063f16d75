"""`swarmnode plan`: table and JSON output, every algorithm, readable errors."""

from __future__ import annotations

import json

from click.testing import CliRunner
from swarmnode.planner import shared_clusters_dir

from swarmnode.cli import main


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
