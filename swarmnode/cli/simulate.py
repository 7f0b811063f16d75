"""`swarmnode simulate`: plan a cluster with one algorithm and score the plan in the serving simulator."""

from __future__ import annotations

import json
from pathlib import Path

import click

_ALGORITHM_HELP = (
    "gma, ahp, petals, swarm, milp, hexgen, hexgen2, or expected:NAME (a placement the spec lists)"
)


def _load(spec: str):
    from swarmnode.planner.cluster import SpecError, load_cluster
    from swarmnode.planner.specs import load_shared_cluster

    path = Path(spec)
    try:
        if path.is_file():
            return load_cluster(path)
        return load_shared_cluster(spec)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("simulate")
@click.argument("spec")
@click.option("--algorithm", "-a", required=True, help=f"Planner algorithm: {_ALGORITHM_HELP}.")
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
    type=click.Choice(["HPLD", "HPHD", "LPHD", "LPLD"], case_sensitive=False),
    default=None,
    help="HexGen-2 workload class instead of --input-tokens/--output-tokens.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the arrivals and of the planners."
)
@click.option("--milp-time-limit", type=float, default=60.0, show_default=True, help="Seconds for the MILP.")
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
    as_json,
):
    """Plan SPEC (a cluster spec file or a shared spec name) and simulate serving it."""
    from swarmnode.planner.cluster import Workload
    from swarmnode.planner.hexgen_cost import Task
    from swarmnode.planner.placement import PlacementError
    from swarmnode.planner.scoring import plan_for_simulation, score
    from swarmnode.planner.trace import HEXGEN2_WORKLOADS, load_trace

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
    cluster = _load(spec)
    w = cluster.workload
    if workload is not None:
        s_in, s_out = HEXGEN2_WORKLOADS[workload.upper()]
    else:
        s_in = input_tokens if input_tokens is not None else max(1, round(w.avg_input_tokens))
        s_out = output_tokens if output_tokens is not None else max(1, round(w.avg_output_tokens))
    task = Task(1.0, float(s_in), float(s_out))
    trace = None
    if trace_file is not None:
        try:
            trace = load_trace(trace_file)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    options = {"seed": seed, "task": task}
    if rate is not None:
        options["rate"] = rate
    options2 = {"seed": seed, "workload": (int(s_in), int(s_out))}
    try:
        planned = plan_for_simulation(
            cluster,
            algorithm,
            milp_time_limit=milp_time_limit,
            hexgen_options=options,
            hexgen2_options=options2,
            workload=Workload(float(s_in), float(s_out)),  # node placements plan for the simulated lengths
        )
        result = score(
            planned, rate=rate, duration=duration, trace=trace, task=task, slo_scale=slo_scale, seed=seed
        )
    except (ValueError, PlacementError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(
            json.dumps({"plan": planned.plan, "rate": rate, "simulation": result.to_json()}, sort_keys=True)
        )
        return
    plan = planned.plan
    click.echo(
        f"cluster {cluster.name}: {algorithm} plan in {plan['solve_seconds']:.2f} s, "
        f"planner throughput {plan['throughput']:.1f} tokens/s"
    )
    if "groups" in plan:
        for group in plan["groups"]:
            stages = ", ".join(
                f"{s['id']} tp{s['tp']} [{s['layers'][0]}, {s['layers'][1]})" for s in group["stages"]
            )
            click.echo(f"  {group.get('id', group['role'])}: {stages}")
    else:
        for node, (start, end) in plan["placement"].items():
            click.echo(f"  {node}: [{start}, {end})")
    arrivals = f"{rate:g} requests/s for {duration:g} s" if trace is None else f"trace {trace_file}"
    click.echo(f"simulated {result.requests} requests ({arrivals}), lengths {int(s_in)}/{int(s_out)}:")

    def fmt(value):
        return "-" if value is None else f"{value:.3f} s"

    click.echo(f"  throughput            {result.throughput:.1f} tokens/s ({result.completed} completed)")
    click.echo(
        f"  prompt latency        mean {fmt(result.prompt_latency_mean)}, p95 {fmt(result.prompt_latency_p95)}"
    )
    click.echo(
        f"  decode latency/token  mean {fmt(result.decode_latency_mean)}, p95 {fmt(result.decode_latency_p95)}"
    )
    click.echo(f"  SLO attainment        {100 * result.slo_attainment:.1f}% at SLO scale {slo_scale:g}")
