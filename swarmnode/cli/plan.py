"""`swarmnode plan`: place a model on a cluster spec and print the placement, throughput and flows.

Node-placement algorithms go through :func:`planner.plan` (``all``: :func:`planner.plan_all`, every one
of them); ``hexgen`` and ``hexgen2`` plan model *replicas* through :func:`planner.plan_replicas`: groups of
GPUs, each a pipeline of tensor-parallel stages (HexGen-2: each group prefills or decodes). The choices
and which option applies to which algorithm come from :mod:`planner.registry`; the tables from
:mod:`planner.tables`. See ``docs/plans_and_simulator.md``.
"""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from swarmnode.planner.registry import ALGORITHMS, PLACEMENT, PLACEMENT_ALGORITHMS, REGISTRY
from swarmnode.planner.trace import HEXGEN2_WORKLOADS

WORKLOADS = list(HEXGEN2_WORKLOADS)
_POSITIVE = click.FloatRange(min=0.0, min_open=True)
# click parameter -> the planner option it sets (the same name unless listed)
_PLANNER_OPTION = {"workload": "lengths", "input_tokens": "lengths", "output_tokens": "lengths"}
_CHECKED = ["gap", "formulation", "partial_inference", "seed", "workload", "input_tokens", "output_tokens",
            "generations", "population", "rate", "slo_scale", "sim_duration", "max_stages", "kv_batch",
            "max_iterations"]


def _applies_to(param: str) -> set[str]:
    """The --algorithm values a parameter applies to (``all`` when it applies to a placement algorithm)."""
    option = _PLANNER_OPTION.get(param, param)
    names = {n for n, a in REGISTRY.items() if a.applies(option)}
    return names | ({"all"} if names & set(PLACEMENT_ALGORITHMS) else set())


def _workload(ctx, param, value: str | None) -> str | None:
    if value is not None and value.upper() not in WORKLOADS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(WORKLOADS)} (any case)")
    return None if value is None else value.upper()


def _check_options(ctx, algorithm: str, replica: dict) -> None:
    for name in _CHECKED:
        allowed = _applies_to(name)
        if algorithm not in allowed and ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            param = next(p for p in ctx.command.params if p.name == name)
            flag = "/".join(param.opts + param.secondary_opts)
            raise click.UsageError(
                f"{flag} applies to --algorithm {' / '.join(sorted(allowed - {'all'}))}, not {algorithm}", ctx
            )
    lengths = (replica["input_tokens"], replica["output_tokens"])
    if replica["workload"] is not None and lengths != (None, None):
        raise click.UsageError("give --workload or --input-tokens/--output-tokens, not both", ctx)


def _progress(event) -> None:
    click.echo(
        f"  [{event.elapsed:6.1f}s] {event.phase:<10} best {event.best:10.1f}  bound {event.bound:10.1f}"
        + (f"  {event.message}" if event.message else ""),
        err=True,
    )


@click.command("plan")
@click.argument("spec")
@click.option("--algorithm", "-a", type=click.Choice([*ALGORITHMS, "all"]), default="milp", show_default=True,
              help="Placement algorithm; hexgen / hexgen2 plan tensor/pipeline-parallel replica groups "
                   "(hexgen2: prefill and decode groups); 'all' runs every node-placement algorithm.")
@click.option("--time-limit", type=_POSITIVE, default=60.0, show_default=True,
              help="Seconds the MILP, HexGen's genetic search or HexGen-2's refinement may run.")
@click.option("--gap", type=float, default=0.05, show_default=True,
              help="Stop the MILP once within this fraction of the upper bound.")
@click.option("--formulation", type=click.Choice(["auto", "coverage", "typed", "per-node"]), default="auto",
              show_default=True, help="MILP formulation (see docs/planner.md).")
@click.option("--partial-inference/--no-partial-inference", default=True, show_default=True,
              help="Let a request enter a node in the middle of its blocks (Helix §4.4).")
@click.option("--seed", type=int, default=None, help="[hexgen, hexgen2] Seed of the search.  [default: 0]")
@click.option("--workload", metavar=f"[{'|'.join(WORKLOADS)}]", callback=_workload, default=None,
              help="[hexgen, hexgen2] HexGen-2 workload class for the planning task (HPLD 1024/64, "
                   "HPHD 1024/256, LPHD 256/256, LPLD 256/64 prompt/output tokens).  "
                   "[default: the spec's average lengths]")
@click.option("--input-tokens", type=click.IntRange(min=1), default=None,
              help="[hexgen, hexgen2] Prompt tokens of the planning task.  [default: the spec's average]")
@click.option("--output-tokens", type=click.IntRange(min=1), default=None,
              help="[hexgen, hexgen2] Output tokens of the planning task.  [default: the spec's average]")
@click.option("--generations", type=click.IntRange(min=0), default=None,
              help="[hexgen] Generations of the genetic search.  [default: 30]")
@click.option("--population", type=click.IntRange(min=1), default=None,
              help="[hexgen] Groupings kept per generation.  [default: 8]")
@click.option("--rate", type=_POSITIVE, default=None,
              help="[hexgen] Requests/s of the fitness trace.  "
                   "[default: 75% of the best initial grouping's capacity]")
@click.option("--slo-scale", type=_POSITIVE, default=None,
              help="[hexgen] SLO = this many times a request's latency alone on one A100.  [default: 5]")
@click.option("--sim-duration", type=_POSITIVE, default=None,
              help="[hexgen] Seconds of arrivals in each fitness simulation.  [default: 30]")
@click.option("--max-stages", type=click.IntRange(min=1), default=None,
              help="[hexgen] Most pipeline stages per replica.  [default: 8]")
@click.option("--kv-batch", type=click.IntRange(min=0), default=None,
              help="[hexgen2] Requests whose KV cache a group must hold when choosing the number of groups.  "
                   "[default: 32]")
@click.option("--max-iterations", type=click.IntRange(min=0), default=None,
              help="[hexgen2] Refinement iterations.  [default: 50]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with --algorithm all).")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.pass_context
def command(ctx, spec, algorithm, time_limit, gap, formulation, partial_inference, as_json, quiet, **replica):
    """Plan which blocks each node of the cluster SPEC serves (a spec file, or a named spec shipped with
    the planner).

    With --algorithm hexgen or hexgen2, plan model replicas instead: groups of GPUs, each a pipeline of
    tensor-parallel stages with its layer range (hexgen2: each group prefills or decodes).
    """
    from swarmnode.planner import PlannerError, plan, plan_all, plan_replicas, resolve_cluster
    from swarmnode.planner.tables import placement_table
    from swarmnode.planner.trace import request_lengths

    _check_options(ctx, algorithm, replica)
    try:
        cluster = resolve_cluster(spec)
    except PlannerError as exc:
        raise click.ClickException(str(exc)) from None
    names = list(PLACEMENT_ALGORITHMS) if algorithm == "all" else [algorithm]
    if not quiet:
        for name in names:
            if "time_limit" in REGISTRY[name].options:
                click.echo(f"{name}: {REGISTRY[name].summary}, up to {time_limit:g} s ...", err=True)
    entry = REGISTRY.get(algorithm)
    try:
        if entry is not None and entry.kind != PLACEMENT:
            options = {k: v for k, v in replica.items() if v is not None and entry.applies(k)}
            lengths = request_lengths(cluster.workload, replica["workload"], replica["input_tokens"],
                                      replica["output_tokens"])
            result = plan_replicas(cluster, algorithm, time_limit=time_limit, lengths=lengths, **options)
            click.echo(json.dumps(result.to_json()) if as_json else entry.table(cluster, result))
            return
        options = {"time_limit": time_limit, "gap": gap, "formulation": formulation,
                   "partial_inference": partial_inference, "progress": None if quiet else _progress}
        if algorithm == "all":
            def failed(name: str, exc: PlannerError) -> None:
                click.echo(f"{name}: {exc}", err=True)

            results = plan_all(cluster, names, on_error=failed, **options)
        else:
            results = [plan(cluster, algorithm, **options)]
    except PlannerError as exc:
        raise click.ClickException(f"{algorithm}: {exc}") from None
    if as_json:
        payload = [r.to_dict() for r in results]
        click.echo(json.dumps(payload if algorithm == "all" else payload[0]))
        return
    for result in results:
        click.echo(placement_table(cluster, result) + "\n")
