"""Each algorithm's options are one frozen dataclass (planner/options.py), named by its registry entry, checked when
built; an option an algorithm does not take is an error naming the algorithm and what it takes, never dropped."""

from __future__ import annotations

import dataclasses
import re

import pytest
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.coordinator.service import CoordinatorConfig
from swarmnode.planner import PlannerError, load_shared_cluster, plan, plan_all, plan_replicas
from swarmnode.planner.live.sticky import decide, fresh_options
from swarmnode.planner.options import GmaOptions, HexGen2Options, MilpOptions, PetalsOptions, SwarmOptions
from swarmnode.planner.registry import REGISTRY

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"


def test_every_entry_names_a_frozen_options_type_with_defaults():
    for name, entry in REGISTRY.items():
        options = entry.options()
        assert type(options) is entry.options_type and options.algorithm == name
        assert dataclasses.is_dataclass(options) and entry.tunable <= entry.accepts
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.algorithm_field = 1  # type: ignore[attr-defined]
    assert REGISTRY["milp"].tunable == {"time_limit", "gap", "formulation", "partial_inference", "min_replicas"}
    assert REGISTRY["milp"].accepts - REGISTRY["milp"].tunable == {
        "link_degree", "mip_rel_gap", "warm_start", "seed", "progress"}
    assert REGISTRY["gma"].accepts == frozenset()


@pytest.mark.parametrize(("build", "message"), [
    (lambda: MilpOptions(gap=1.5), "milp option gap: must be a number from 0 and below 1, got 1.5"),
    (lambda: MilpOptions(time_limit=0), "milp option time_limit: must be a number above 0, got 0"),
    (lambda: MilpOptions(formulation="dense"), "milp option formulation: must be one of auto, coverage"),
    (lambda: MilpOptions(partial_inference="yes"), "must be True or False"),
    (lambda: PetalsOptions(min_replicas=0), "petals option min_replicas: must be a whole number from 1, got 0"),
    (lambda: SwarmOptions(min_replicas=True), "swarm option min_replicas"),
    (lambda: HexGen2Options(lengths=(0, 5)), "hexgen2 option lengths: must be a workload name"),
])
def test_options_are_checked_when_built(build, message):
    with pytest.raises(PlannerError, match=re.escape(message)) as caught:
        build()
    assert caught.value.code == "bad_option"


def test_unknown_or_foreign_options_are_refused_not_dropped():
    with pytest.raises(PlannerError, match=r"petals: unknown option.* gap; petals takes min_replicas, .*seed"):
        REGISTRY["petals"].options(gap=0.1)
    with pytest.raises(PlannerError, match="gma takes GmaOptions, not MilpOptions"):
        REGISTRY["gma"].checked(MilpOptions())
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    with pytest.raises(PlannerError, match="pass options= or keyword options"):
        plan(cluster, "petals", options=PetalsOptions(), seed=3)
    with pytest.raises(PlannerError, match=r"min_replicas=2 and PetalsOptions.min_replicas=1 disagree"):
        plan(cluster, "petals", options=PetalsOptions(), min_replicas=2)
    with pytest.raises(PlannerError, match=r"unknown option.* generations"):
        plan_all(cluster, ["gma", "petals"], generations=3)
    with pytest.raises(PlannerError, match="options for milp, not planned here"):
        plan_all(cluster, ["gma"], options={"milp": MilpOptions()})
    with pytest.raises(PlannerError, match=r"hexgen2: unknown option.* rate; hexgen2 takes"):
        plan_replicas(cluster, "hexgen2", rate=1.0)


def test_plan_takes_an_options_object_or_keywords_alike():
    cluster = load_shared_cluster("helix-single-24")
    by_object = plan(cluster, "petals", options=PetalsOptions(seed=5, min_replicas=2))
    by_keywords = plan(cluster, "petals", seed=5, min_replicas=2)
    assert by_object.placement == by_keywords.placement and by_object.min_replicas == 2
    assert plan(cluster, "gma", options=GmaOptions(), min_replicas=2).min_replicas == 2


def test_live_replans_pass_each_algorithm_only_its_options():
    assert fresh_options("milp", 3.0, 2) == MilpOptions(time_limit=3.0, min_replicas=2)
    assert fresh_options("gma", 3.0, 2) == GmaOptions()
    assert fresh_options("petals", 3.0, 2) == PetalsOptions(min_replicas=2)
    cluster = load_shared_cluster("llamps-bloom3b-3server")
    assert decide(cluster, None, algorithm="gma", time_limit=1.0).placement
    with pytest.raises(PlannerError, match="gma takes GmaOptions"):
        decide(cluster, None, algorithm="gma", options=MilpOptions())
    with pytest.raises(ValueError, match="milp takes MilpOptions, not PetalsOptions"):
        CoordinatorConfig(algorithm="milp", options=PetalsOptions())
    with pytest.raises(ValueError, match="min_replicas is 2 but the milp options say 1"):
        CoordinatorConfig(algorithm="milp", options=MilpOptions())
    assert CoordinatorConfig(algorithm="gma", options=GmaOptions()).options == GmaOptions()


def test_coordinate_refuses_a_time_limit_for_an_algorithm_without_one(model_dir):
    result = CliRunner().invoke(main, ["coordinate", "--model", str(model_dir), "--initial-peers", PEER,
                                       "--algorithm", "gma", "--time-limit", "5"])
    assert result.exit_code == 2
    assert "--time-limit applies to --algorithm milp / hexgen2, not gma" in result.output, result.output
