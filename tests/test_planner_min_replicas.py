"""The redundancy floor (``min_replicas``): what the offers allow, the MILP's rows in both formulations,
sticky repair and trim, the Petals and SWARM baselines, the API, the CLI, and ``min_replicas=1`` leaving
everything as it was."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.planner import CostModel, PlannerError, cluster_from_dict, load_shared_cluster, milp, plan
from swarmnode.planner.algorithms.milp_formulations import (
    _per_node_model,
    _typed_model,
    interchangeable_groups,
)
from swarmnode.planner.algorithms.petals import petals
from swarmnode.planner.algorithms.swarm_baseline import swarm
from swarmnode.planner.live.sticky import Decision, decide
from swarmnode.planner.search.redundancy import (
    achievable_floor,
    check_min_replicas,
    floor_layout,
    floor_text,
    replica_counts,
    single_points,
)


def spec(nodes: list[tuple[str, int, float]], num_blocks: int) -> dict:
    """GPU nodes ``(id, blocks it holds, tokens/s through one block)`` on one fast switch: holding ``k``
    blocks, a node runs ``rate / k`` tokens/s."""
    return {
        "model": {"name": "m", "num_blocks": num_blocks, "hidden_size": 64, "dtype_bytes": 2, "block_bytes": 10**9},
        "nodes": [
            {"id": n, "region": "r0", "device": "gpu", "memory_bytes": cap * 10**9, "block_throughput": rate}
            for n, cap, rate in nodes
        ],
        "network": {"intra_region": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0}},
    }


def cluster(nodes: list[tuple[str, int, float]], num_blocks: int):
    return cluster_from_dict(spec(nodes, num_blocks))


#: One fast node and three slow ones of 4 blocks, 8 blocks: alone the fast node serves [0, 4) best (one
#: replica), under a floor of 2 a slow node must join it.
FAST_AND_SLOW = [("f", 4, 2000.0), ("s1", 4, 100.0), ("s2", 4, 100.0), ("s3", 4, 100.0)]
#: Three nodes of 4 blocks for 8 blocks: 12 block slots, two copies need 16; 4 blocks can have two.
TOO_SMALL = [("a", 4, 400.0), ("b", 4, 400.0), ("c", 4, 400.0)]


# ---------------------------------------------------------------------------------------------------
# Plain data
# ---------------------------------------------------------------------------------------------------


def test_counts_and_single_points():
    placement = {"a": (0, 4), "b": (2, 6), "c": (5, 8)}
    assert replica_counts(placement, 8) == [1, 1, 2, 2, 1, 2, 1, 1]
    assert single_points(placement, 8, 2) == [(0, 2), (4, 5), (6, 8)]
    assert single_points(placement, 8, 1) == []
    assert single_points(placement, 8, 3) == [(0, 8)]
    assert single_points({}, 3, 1) == [(0, 3)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_bad_min_replicas_rejected(bad):
    with pytest.raises(PlannerError) as err:
        check_min_replicas(bad)
    assert err.value.code == "bad_option"
    assert "min_replicas" in str(err.value)
    small = cluster(FAST_AND_SLOW, 8)
    for call in (
        lambda: plan(small, "petals", min_replicas=bad),
        lambda: decide(small, None, algorithm="petals", min_replicas=bad),
        lambda: milp(small, time_limit=1, min_replicas=bad),
        lambda: swarm(small, min_replicas=bad),
    ):
        with pytest.raises(PlannerError) as err:
            call()
        assert err.value.code == "bad_option"
    assert check_min_replicas(2) == 2


def brute_force_floor(caps: list[int], length: int, r: int) -> int:
    best = -1
    for starts in itertools.product(*[range(length - c + 1) for c in caps]):
        counts = [0] * length
        for s, c in zip(starts, caps, strict=True):
            for b in range(s, s + c):
                counts[b] += 1
        if min(counts) >= 1:
            best = max(best, sum(1 for c in counts if c >= r))
    return best


def test_achievable_floor_is_the_best_any_placement_reaches():
    rng = random.Random(7)
    checked = 0
    while checked < 40:
        length = rng.randint(3, 8)
        caps = [rng.randint(1, length) for _ in range(rng.randint(2, 5))]
        r = rng.choice([2, 2, 3])
        if sum(caps) < length:
            continue
        checked += 1
        floor = achievable_floor(caps, length, r)
        assert floor.blocks_at_floor == brute_force_floor(caps, length, r), (caps, length, r)
        layout = floor_layout({f"n{i}": c for i, c in enumerate(caps)}, length, r)
        assert floor.met_by(layout)
    # [6, 6] over 7 blocks: [0, 6) and [1, 7) hold 5 blocks twice (two rows would hold none)
    assert achievable_floor([6, 6], 7, 2).blocks_at_floor == 5
    assert achievable_floor([4, 4, 4], 8, 2).blocks_at_floor == 4
    assert achievable_floor([4, 4, 4, 4], 8, 2).everywhere


def test_floor_text_names_blocks_and_why():
    floor = achievable_floor([4, 4, 4], 8, 2)
    text = floor_text({"a": (0, 4), "b": (4, 8), "c": (0, 4)}, floor)
    assert text == "blocks 4-7 have one replica: the offers cannot hold two"
    everywhere = achievable_floor([4, 4, 4, 4], 8, 2)
    assert floor_text({"a": (0, 4), "b": (4, 8), "c": (0, 4)}, everywhere).endswith("below the floor of two")
    assert floor_text({"a": (0, 4), "b": (4, 8), "c": (0, 4), "d": (4, 8)}, everywhere) == ""


# ---------------------------------------------------------------------------------------------------
# The MILP
# ---------------------------------------------------------------------------------------------------


def model_counts(kind: str, r: int) -> tuple[list[int], float]:
    """Solve the typed or per-node model of FAST_AND_SLOW alone (no start, no repair): the holder
    counts of its solution and its objective."""
    small = cluster(FAST_AND_SLOW, 8)
    cost = CostModel(small)
    floor = achievable_floor([4] * 4, 8, r)
    groups = interchangeable_groups(small, cost)
    if kind == "typed":
        typed = _typed_model(small, cost, groups, True, floor)
        outcome = typed.model.solve(time_limit=20)
        ranges = [(s, s + k) for (t, s, k), v in typed.x.items() for _ in range(round(outcome.values[v]))]
    else:
        pn = _per_node_model(small, cost, groups, True, None, floor)
        outcome = pn.model.solve(time_limit=20)
        ranges = []
        for n in pn.nodes:
            s = round(outcome.values[pn.start[n]])
            k = next(kk for (nn, kk), v in pn.size.items() if nn == n and outcome.values[v] > 0.5)
            ranges.append((s, s + k))
    return replica_counts(dict(enumerate(ranges)), 8), outcome.objective


@pytest.mark.parametrize("kind", ["typed", "per-node"])
def test_formulations_carry_the_floor(kind):
    counts, value = model_counts(kind, 1)
    assert min(counts) == 1 and value == pytest.approx(75.0, rel=1e-4)  # the fast node alone on [0, 4)
    counts, value = model_counts(kind, 2)
    assert min(counts) >= 2 and value == pytest.approx(50.0, rel=1e-4)


@pytest.mark.parametrize("formulation", ["auto", "typed", "per-node"])
def test_milp_meets_the_floor(formulation):
    small = cluster(FAST_AND_SLOW, 8)
    free = milp(small, time_limit=10, formulation=formulation)
    assert min(replica_counts(free.placement, 8)) == 1
    held = milp(small, time_limit=10, formulation=formulation, min_replicas=2)
    assert min(replica_counts(held.placement, 8)) >= 2
    assert held.floor.min_replicas == 2 and held.floor.everywhere
    assert held.throughput == pytest.approx(50.0, rel=0.05)
    assert free.throughput > held.throughput


def test_infeasible_offers_cover_every_block_and_name_the_single_points():
    small = cluster(TOO_SMALL, 8)
    for algorithm in ("milp", "petals"):
        limit = {"time_limit": 5} if algorithm == "milp" else {}  # petals has no time limit
        result = plan(small, algorithm, min_replicas=2, **limit)
        counts = replica_counts(result.placement, 8)
        assert min(counts) >= 1
        assert sum(1 for c in counts if c >= 2) == 4  # as many as the offers allow
        expected = [(b, b + 1) for b, c in enumerate(counts) if c < 2]
        merged = [(s, e) for s, e in result.single_points for _ in range(1)]
        assert [(b, b + 1) for s, e in merged for b in range(s, e)] == expected
        assert result.single_points == tuple(single_points(result.placement, 8, 2))
        assert result.details["floor"] == {"min_replicas": 2, "blocks_at_floor": 4, "num_blocks": 8, "everywhere": False}
        payload = result.to_dict()
        assert payload["min_replicas"] == 2
        assert payload["single_points"] == [list(r) for r in result.single_points] != []


def test_helix_clusters_under_the_floor():
    hetero = load_shared_cluster("helix-hetero-42")
    result = plan(hetero, "milp", time_limit=4, min_replicas=2)
    assert min(replica_counts(result.placement, 80)) >= 2 and result.single_points == ()
    single = load_shared_cluster("helix-single-24")  # 152 block slots for 80 blocks: 72 can have two
    result = plan(single, "milp", time_limit=4, min_replicas=2)
    counts = replica_counts(result.placement, 80)
    assert min(counts) >= 1 and sum(1 for c in counts if c >= 2) >= 72
    assert result.details["floor"]["blocks_at_floor"] == 72
    assert sum(e - s for s, e in result.single_points) == 80 - sum(1 for c in counts if c >= 2)


# ---------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------


def test_petals_and_swarm_meet_the_floor_when_they_can():
    small = cluster(FAST_AND_SLOW, 8)
    for algorithm in (petals, swarm):
        assert min(replica_counts(algorithm(small), 8)) == 1  # as published: one replica somewhere
        assert min(replica_counts(algorithm(small, min_replicas=2), 8)) >= 2
    hetero = load_shared_cluster("helix-hetero-42")
    for algorithm in (petals, swarm):
        assert min(replica_counts(algorithm(hetero, min_replicas=2), 80)) >= 2


def test_min_replicas_1_leaves_plans_unchanged():
    hetero = load_shared_cluster("helix-hetero-42")
    assert petals(hetero) == petals(hetero, min_replicas=1)
    assert swarm(hetero) == swarm(hetero, min_replicas=1)
    small = cluster(FAST_AND_SLOW, 8)
    default = milp(small, time_limit=5)
    explicit = milp(small, time_limit=5, min_replicas=1)
    assert default.placement == explicit.placement
    assert default.formulation == explicit.formulation == "beam+coverage"
    assert all(p["formulation"] != "floor" for p in explicit.phases)
    result = plan(small, "petals")
    assert result.min_replicas == 1 and result.single_points == ()
    assert "floor" not in result.details


# ---------------------------------------------------------------------------------------------------
# Sticky replanning
# ---------------------------------------------------------------------------------------------------


def test_sticky_repair_restores_two_replicas_with_an_idle_node():
    previous = {"a": (0, 4), "c": (0, 4), "b": (4, 8), "d": (4, 8)}
    # d left; e joined, able to hold the whole model; b alone serves [4, 8) faster than a and c serve [0, 4)
    now = cluster([("a", 4, 400.0), ("b", 4, 4000.0), ("c", 4, 400.0), ("e", 8, 400.0)], 8)
    held = decide(now, previous, algorithm="petals", improvement=10.0, min_replicas=2, events=["node d left"])
    assert isinstance(held, Decision)
    assert min(replica_counts(held.placement, 8)) >= 2
    assert held.placement["e"] == (4, 8)  # the smallest move: the new node takes the window below the floor
    assert {n: held.placement[n] for n in "abc"} == {n: previous[n] for n in "abc"}
    assert held.single_points == () and held.min_replicas == 2 and held.moved_blocks == 4
    free = decide(now, previous, algorithm="petals", improvement=10.0, events=["node d left"])
    assert free.placement["e"][1] <= 4  # for throughput alone e serves [0, 4): [4, 8) keeps one replica
    assert replica_counts(free.placement, 8)[4:] == [1] * 4 and free.single_points == () and free.min_replicas == 1


def test_sticky_trim_never_goes_below_the_floor():
    # a holds everything slowly; trimming it to [4, 8) lifts the max flow but leaves [0, 4) on c alone
    now = cluster([("a", 8, 800.0), ("c", 4, 800.0), ("d", 4, 80.0)], 8)
    previous = {"a": (0, 8), "c": (0, 4), "d": (4, 8)}
    free = decide(now, previous, algorithm="petals", improvement=10.0)
    assert free.algorithm == "trim" and min(replica_counts(free.placement, 8)) == 1
    held = decide(now, previous, algorithm="petals", improvement=10.0, min_replicas=2)
    assert min(replica_counts(held.placement, 8)) >= 2
    assert held.single_points == ()


def test_sticky_names_single_points_when_the_offers_cannot_hold_two():
    small = cluster(TOO_SMALL, 8)
    first = decide(small, None, algorithm="petals", min_replicas=2)
    assert first.single_points and first.min_replicas == 2
    assert "have one replica: the offers cannot hold two" in first.reason
    again = decide(small, first.placement, algorithm="petals", min_replicas=2)
    assert not again.changed and again.single_points == first.single_points


def test_sticky_candidate_below_the_floor_loses_to_a_fresh_plan():
    # a placement with one replica of [0, 4), no idle node, and no node that can move without a gap
    now = cluster(FAST_AND_SLOW, 8)
    previous = {"f": (0, 4), "s1": (4, 8), "s2": (4, 8), "s3": (4, 8)}
    kept = decide(now, previous, algorithm="milp", improvement=10.0, time_limit=5)
    assert kept.algorithm == "keep"
    held = decide(now, previous, algorithm="milp", improvement=10.0, time_limit=5, min_replicas=2)
    assert min(replica_counts(held.placement, 8)) >= 2 and held.single_points == ()


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def test_cli_plan_min_replicas_json_names_single_points(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(spec(TOO_SMALL, 8)))
    run = CliRunner().invoke(
        main, ["plan", str(path), "--min-replicas", "2", "--json", "--time-limit", "2", "--quiet"]
    )
    assert run.exit_code == 0, run.output
    payload = json.loads(run.stdout)
    assert payload["min_replicas"] == 2
    counts = replica_counts({n: tuple(r) for n, r in payload["placement"].items()}, 8)
    assert payload["single_points"] == [list(r) for r in single_points(payload["placement"], 8, 2)]
    assert sum(e - s for s, e in payload["single_points"]) == sum(1 for c in counts if c < 2) == 4
    text = CliRunner().invoke(main, ["plan", str(path), "-a", "petals", "--min-replicas", "2"])
    assert text.exit_code == 0, text.output
    assert "single points of failure: blocks" in text.stdout
    assert "the nodes' capacities let 4 of 8 blocks reach 2" in text.stdout
    bad = CliRunner().invoke(main, ["plan", str(path), "--min-replicas", "0", "--json"])
    assert bad.exit_code == 2 and "--min-replicas" in bad.output and bad.stdout == ""
