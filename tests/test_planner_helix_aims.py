"""Helix's results reproduced under Helix's own cost model (``--cost-model helix``).

Helix (ASPLOS 2025) §6.3 measured its MILP placement at 1.23x Petals and 2.10x Swarm on the single-region
24-node cluster, 1.49x Petals geo-distributed. Under the helix cost model (Helix's profiles and rules,
:mod:`planner.costs.helix_profiled`) this planner's MILP must reach those ratios within 10%, against Petals' seed-0
join order and the median of 20 orders, and Helix's own published layouts must rank as Helix measured them:
ILP above Petals above Swarm. Under the roofline model that ranking does not hold (the departures are listed in
``docs/planner.md``), which the last test records.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from swarmnode.planner import Placement, evaluate, load_shared_cluster, plan
from swarmnode.planner.algorithms.petals import petals_orders
from swarmnode.planner.costs.factory import make_cost_model
from swarmnode.planner.simulator.scoring import serve_at_load

LAYOUTS = Path(__file__).parent / "data" / "helix_layouts"
MARGIN = 0.9  # the paper's ratios, less 10%
#: Helix §6.3 (Fig. 6): its MILP placement over Petals and over Swarm, measured on real GPUs.
PAPER = {"helix-single-24": {"petals": 1.23, "swarm": 2.10}, "helix-geo-24": {"petals": 1.49, "swarm": 2.38}}


def _published(name: str) -> dict[str, Placement]:
    out = {}
    for kind in ("ilp", "petals", "swarm"):
        data = json.loads((LAYOUTS / f"{name}.{kind}.json").read_text())
        out[kind] = Placement({n: tuple(r) for n, r in data["placement"].items()})
    return out


@pytest.fixture(scope="module")
def helix_plans():
    """The MILP (warm-started from the best heuristic, as ``plan --algorithm all`` does), Petals over 20
    seeded join orders and Swarm, on both 24-node clusters under the helix cost model."""
    out = {}
    for name in PAPER:
        cluster = load_shared_cluster(name)
        cost = make_cost_model(cluster, "helix")
        runs = petals_orders(cluster, range(20), cost=cost)
        best = max(runs, key=lambda r: r.throughput)
        milp = plan(cluster, "milp", cost=cost, time_limit=20, gap=0.05, warm_start=best.placement)
        swarm = plan(cluster, "swarm", cost=cost)
        by_flow = sorted(runs, key=lambda r: r.throughput)
        out[name] = {
            "milp": milp.throughput,
            "petals_seed0": runs[0].throughput,
            "petals_median": statistics.median(r.throughput for r in runs),
            "swarm": swarm.throughput,
            "placements": {
                "milp": milp.placement,
                "petals_seed0": runs[0].placement,
                "petals_median": by_flow[(len(by_flow) - 1) // 2].placement,
                "swarm": swarm.placement,
            },
        }
    return out


@pytest.mark.parametrize("name", sorted(PAPER))
def test_milp_reaches_the_papers_ratio_over_petals(helix_plans, name):
    got = helix_plans[name]
    want = PAPER[name]["petals"] * MARGIN
    assert got["milp"] >= want * got["petals_seed0"], got
    assert got["milp"] >= want * got["petals_median"], got


def test_milp_reaches_the_papers_ratio_over_swarm(helix_plans):
    got = helix_plans["helix-single-24"]
    assert got["milp"] >= PAPER["helix-single-24"]["swarm"] * MARGIN * got["swarm"], got


def test_milp_reaches_the_papers_ratios_in_simulated_serving(helix_plans):
    """Helix Fig. 9a: at one offered load (1.1x the MILP's max flow) the simulator serves the MILP's
    placement at the paper's ratios over Petals' (seed 0 and the median order) and Swarm's, as their max
    flows say it should."""
    cluster = load_shared_cluster("helix-single-24")
    cost = make_cost_model(cluster, "helix")
    served = serve_at_load(cluster, helix_plans["helix-single-24"]["placements"], cost, load=1.1, duration=600)
    sim = {k: v[1] for k, v in served.items()}
    paper = PAPER["helix-single-24"]
    assert sim["milp"] >= paper["petals"] * MARGIN * sim["petals_seed0"], served
    assert sim["milp"] >= paper["petals"] * MARGIN * sim["petals_median"], served
    assert sim["milp"] >= paper["swarm"] * MARGIN * sim["swarm"], served
    # the MILP's placement serves what its max flow promised (item 4 of the reproduction)
    flow, got = served["milp"]
    assert 0.85 * flow <= got <= 1.15 * flow, served


@pytest.mark.parametrize("name", sorted(PAPER))
def test_published_layouts_rank_as_helix_measured(name):
    """Scored as an operator would: ``swarmnode plan SPEC --placement FILE --cost-model helix --json``."""
    tp = {}
    for kind in ("ilp", "petals", "swarm"):
        out = subprocess.run(
            [sys.executable, "-m", "swarmnode", "plan", name, "--placement", str(LAYOUTS / f"{name}.{kind}.json"),
             "--cost-model", "helix", "--json"],
            capture_output=True, text=True, timeout=120, check=True,
        )
        result = json.loads(out.stdout)
        assert result["algorithm"] == "given" and result["cost_model"] == "helix"
        tp[kind] = result["throughput"]
    assert tp["ilp"] > tp["petals"] > tp["swarm"] > 0, tp
    cluster = load_shared_cluster(name)
    cost = make_cost_model(cluster, "helix")
    assert tp["ilp"] == pytest.approx(evaluate(cluster, _published(name)["ilp"], cost=cost).throughput)


def test_roofline_model_reverses_helix_ranking():
    """The roofline model rewards holding as many blocks as fit, so Helix's published ILP layout scores
    below its Petals layout there: the reason the helix cost model exists."""
    cluster = load_shared_cluster("helix-single-24")
    cost = make_cost_model(cluster, "roofline")
    tp = {k: evaluate(cluster, p, cost=cost).throughput for k, p in _published("helix-single-24").items()}
    assert tp["ilp"] < tp["petals"], tp
