"""`swarmnode simulate`: plan a cluster with one algorithm and score the plan in the serving simulator.

The algorithm choices come from :mod:`planner.registry`, plus ``expected:NAME`` (a placement the spec
lists); planning and scoring are :func:`planner.simulator.scoring.plan_for_simulation` and
:func:`planner.simulator.scoring.score`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from swarmnode.planner.costs.factory import COST_MODELS
from swarmnode.planner.registry import ALGORITHMS, REGISTRY
from swarmnode.planner.simulator.scoring import EXPECTED_PREFIX, is_simulable
from swarmnode.planner.simulator.trace import HEXGEN2_WORKLOADS
from swarmnode.planner.tables import seconds_text


class _AlgorithmChoice(click.Choice):
    """A registered algorithm, or ``expected:NAME``."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and is_simulable(value):
            return value
        return super().convert(value, param, ctx)


@click.command("simulate")
@click.argument("spec")
@click.option("--algorithm", "-a", required=True, type=_AlgorithmChoice(ALGORITHMS),
              help=f"Planner algorithm: {', '.join(ALGORITHMS)}, or {EXPECTED_PREFIX}NAME "
                   "(a placement the spec lists).")
@click.option("--rate", type=float, default=None, help="Poisson arrival rate, requests per second.")
@click.option("--duration", type=float, default=60.0, show_default=True, help="Seconds of arrivals.")
@click.option(
    "--slo-scale",
    type=float,
    default=5.0,
    show_default=True,
    help="SLO = this many times the request's latency alone on one A100.",
)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Request trace instead of --rate: JSON list or CSV of (arrival_s, input_tokens, output_tokens).",
)
@click.option("--input-tokens", type=int, default=None, help="Prompt length (default: the spec's average).")
@click.option("--output-tokens", type=int, default=None, help="Output length (default: the spec's average).")
@click.option(
    "--workload",
    type=click.Choice(list(HEXGEN2_WORKLOADS), case_sensitive=False),
    default=None,
    help="HexGen-2 workload class instead of --input-tokens/--output-tokens.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the arrivals and of the planners."
)
@click.option("--milp-time-limit", type=float, default=60.0, show_default=True, help="Seconds for the MILP.")
@click.option(
    "--cost-model",
    type=click.Choice(list(COST_MODELS)),
    default=None,
    help="Cost model of a node placement's plan and of its simulated nodes (default: the spec's, else "
    "roofline): roofline (HexGen Eqs. 4-7 on the specs) or helix (Helix's measured GPU profiles).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (plan and simulation).")
def command(
    spec,
    algorithm,
    rate,
    duration,
    slo_scale,
    trace_file,
    input_tokens,
    output_tokens,
    workload,
    seed,
    milp_time_limit,
    cost_model,
    as_json,
):
    """Plan SPEC (a cluster spec file, or a named spec shipped with the planner) and simulate serving it."""
    from swarmnode.planner import PlannerError, resolve_cluster
    from swarmnode.planner.cluster.spec import Workload
    from swarmnode.planner.costs.hexgen_gpus import Task
    from swarmnode.planner.simulator.scoring import plan_for_simulation, score
    from swarmnode.planner.simulator.trace import load_trace, request_lengths

    if trace_file is None and rate is None:
        raise click.UsageError("give --rate R (requests per second) or --trace FILE")
    if rate is not None and rate <= 0:
        raise click.BadParameter("must be a positive number of requests per second", param_hint="--rate")
    if duration <= 0:
        raise click.BadParameter("must be positive seconds", param_hint="--duration")
    if slo_scale <= 0:
        raise click.BadParameter("must be positive", param_hint="--slo-scale")
    for name, value in (("--input-tokens", input_tokens), ("--output-tokens", output_tokens)):
        if value is not None and value < 1:
            raise click.BadParameter("must be at least 1", param_hint=name)
    try:
        cluster = resolve_cluster(spec)
        if cost_model is not None:
            cluster = dataclasses.replace(cluster, cost_model=cost_model)
        if workload is not None:
            input_tokens = output_tokens = None  # the workload class sets both lengths
        s_in, s_out = request_lengths(cluster.workload, workload, input_tokens, output_tokens)
        trace = None if trace_file is None else load_trace(trace_file)
        # a replica algorithm plans for the simulated request with the simulation's seed; HexGen's fitness trace
        # (its `rate` option; HexGen-2 has none) runs at the simulated rate
        replica_options = {"seed": seed, "lengths": (s_in, s_out)}
        if rate is not None and algorithm in REGISTRY and "rate" in REGISTRY[algorithm].accepts:
            replica_options["rate"] = rate
        planned = plan_for_simulation(
            cluster,
            algorithm,
            milp_time_limit=milp_time_limit,
            replica_options=replica_options,
            workload=Workload(float(s_in), float(s_out)),  # node placements plan for the simulated lengths
        )
        task = Task(1.0, float(s_in), float(s_out))
        result = score(
            planned, rate=rate, duration=duration, trace=trace, task=task, slo_scale=slo_scale, seed=seed
        )
    except PlannerError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(
            json.dumps({"plan": planned.plan, "rate": rate, "simulation": result.to_json()}, sort_keys=True)
        )
        return
    arrivals = f"{rate:g} requests/s for {duration:g} s" if trace is None else f"trace {trace_file}"
    click.echo(_report(cluster.name, planned.plan, result, arrivals, (s_in, s_out), slo_scale))


def _report(cluster_name: str, plan: dict, result, arrivals: str, lengths: tuple[int, int], slo_scale: float) -> str:
    """The plan (ranges or groups) and the simulated throughput, latencies and SLO attainment."""
    lines = [
        f"cluster {cluster_name}: {plan['algorithm']} plan in {plan['solve_seconds']:.2f} s, "
        f"planner throughput {plan['throughput']:.1f} tokens/s"
    ]
    if "groups" in plan:
        for group in plan["groups"]:
            stages = ", ".join(
                f"{s['id']} tp{s['tp']} [{s['layers'][0]}, {s['layers'][1]})" for s in group["stages"]
            )
            lines.append(f"  {group.get('id', group['role'])}: {stages}")
    else:
        lines += [f"  {node}: [{start}, {end})" for node, (start, end) in plan["placement"].items()]
    p50, p95 = seconds_text(result.prompt_latency_mean), seconds_text(result.prompt_latency_p95)
    d50, d95 = seconds_text(result.decode_latency_mean), seconds_text(result.decode_latency_p95)
    lines += [
        f"simulated {result.requests} requests ({arrivals}), lengths {lengths[0]}/{lengths[1]}:",
        f"  throughput            {result.throughput:.1f} tokens/s ({result.completed} completed)",
        f"  prompt latency        mean {p50}, p95 {p95}",
        f"  decode latency/token  mean {d50}, p95 {d95}",
        f"  SLO attainment        {100 * result.slo_attainment:.1f}% at SLO scale {slo_scale:g}",
    ]
    return "\n".join(lines)
