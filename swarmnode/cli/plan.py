"""`swarmnode plan`: place a model on a cluster spec and print the placement, throughput and flows.

Node-placement algorithms go through :func:`planner.plan` (``all``: :func:`planner.plan_all`, every one
of them); ``hexgen`` and ``hexgen2`` plan model *replicas* through :func:`planner.plan_replicas`: groups of
GPUs, each a pipeline of tensor-parallel stages (HexGen-2: each group prefills or decodes). The choices
and which option applies to which algorithm come from :mod:`planner.registry`; the tables from
:mod:`planner.tables`. See ``docs/plans_and_simulator.md``.

``--placement FILE`` plans nothing: it scores a given placement (:func:`planner.score`) and prints what a
planned one prints. ``--cost-model`` picks the cost model of every node placement and score
(:mod:`planner.costs.factory`; default: the spec's). ``--min-replicas N`` asks node placements for a
redundancy floor (:mod:`planner.search.redundancy`): every block on at least N nodes where the offers allow it;
the output lists the blocks left on fewer (``single_points`` in the JSON). With ``--json`` stdout holds
the JSON alone (the MILP's solver writes nothing, :mod:`planner.search.milp_model`); progress and notes go to
stderr.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click
from click.core import ParameterSource

from swarmnode.planner.costs.factory import COST_MODELS
from swarmnode.planner.registry import ALGORITHMS, PLACEMENT, PLACEMENT_ALGORITHMS, PLAN_OPTIONS, REGISTRY
from swarmnode.planner.simulator.trace import HEXGEN2_WORKLOADS

WORKLOADS = list(HEXGEN2_WORKLOADS)
_POSITIVE = click.FloatRange(min=0.0, min_open=True)
# click parameter -> the planner option it sets (the same name unless listed)
_PLANNER_OPTION = {"workload": "lengths", "input_tokens": "lengths", "output_tokens": "lengths"}
_CHECKED = ["gap", "formulation", "partial_inference", "seed", "rebalance", "workload", "input_tokens", "output_tokens",
            "generations", "population", "rate", "slo_scale", "sim_duration", "max_stages", "kv_batch",
            "max_iterations", "cost_model"]
#: What ``--placement`` does instead of an algorithm (the ``algorithm`` of its result).
GIVEN = "given"


class PlacementFileError(click.ClickException):
    """A ``--placement`` file that cannot be scored: one ``Error:`` line, exit status 2 like a usage
    error, nothing on stdout."""

    exit_code = 2


def _applies_to(param: str) -> set[str]:
    """The --algorithm values a parameter applies to (``all`` when it applies to a placement algorithm;
    ``given``, i.e. ``--placement``, for the options of scoring: partial inference and the cost model)."""
    if param == "cost_model":
        return {*PLACEMENT_ALGORITHMS, "all", GIVEN}
    option = _PLANNER_OPTION.get(param, param)
    names = {n for n, a in REGISTRY.items() if a.applies(option)}
    return (
        names
        | ({"all"} if names & set(PLACEMENT_ALGORITHMS) else set())
        | ({GIVEN} if option in PLAN_OPTIONS else set())
    )


def _workload(ctx, param, value: str | None) -> str | None:
    if value is not None and value.upper() not in WORKLOADS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(WORKLOADS)} (any case)")
    return None if value is None else value.upper()


def _flag(ctx, name: str) -> str:
    param = next(p for p in ctx.command.params if p.name == name)
    return "/".join(param.opts + param.secondary_opts)


def _given(ctx, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def _check_options(ctx, algorithm: str, replica: dict) -> None:
    """Options that do not apply to ``algorithm`` (``given`` with ``--placement``) are usage errors."""
    if algorithm == GIVEN:
        if _given(ctx, "algorithm"):
            raise click.UsageError("--placement scores the placement it is given: drop --algorithm", ctx)
        if _given(ctx, "time_limit"):
            raise click.UsageError("--time-limit applies to planning, not to --placement", ctx)
    for name in _CHECKED:
        allowed = _applies_to(name)
        if algorithm not in allowed and _given(ctx, name):
            where = " / ".join(sorted(allowed - {"all", GIVEN})) + (" or --placement" if GIVEN in allowed else "")
            what = "--placement" if algorithm == GIVEN else algorithm
            raise click.UsageError(f"{_flag(ctx, name)} applies to --algorithm {where}, not {what}", ctx)
    if _given(ctx, "min_replicas") and algorithm in REGISTRY and REGISTRY[algorithm].kind != PLACEMENT:
        raise click.UsageError(
            f"--min-replicas applies to node placements (--algorithm {' / '.join(PLACEMENT_ALGORITHMS)}, "
            f"all, or --placement), not {algorithm}",
            ctx,
        )
    lengths = (replica["input_tokens"], replica["output_tokens"])
    if replica["workload"] is not None and lengths != (None, None):
        raise click.UsageError("give --workload or --input-tokens/--output-tokens, not both", ctx)


def _read_placement(path: str, node_ids: list[str]) -> dict:
    """The JSON object ``{node_id: [start, end]}`` in ``path`` (or the ``placement`` of a ``plan --json``
    result); the ranges themselves are checked by :func:`planner.score`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlacementFileError(f"--placement {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PlacementFileError(
            f"--placement {path}: not JSON ({exc}); write an object {{node_id: [start, end], ...}}"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("placement"), dict) and "placement" not in node_ids:
        data = data["placement"]  # the output of `swarmnode plan --json`
    if not isinstance(data, dict):
        raise PlacementFileError(
            f"--placement {path}: a placement is a JSON object {{node_id: [start, end], ...}}, "
            f"not {type(data).__name__ if data is not None else 'null'}"
        )
    if not data:
        raise PlacementFileError(f"--placement {path}: the placement is empty; give each node's [start, end]")
    return data


def _cost_summary(result) -> str:
    """``cost model: helix (helix:a100 x4, roofline x2)`` for the text output."""
    counts = Counter(result.cost_sources.values())
    sources = ", ".join(f"{src} x{n}" for src, n in sorted(counts.items()))
    return f"cost model: {result.cost_model}" + (f" ({sources})" if sources else "")


def _size_summary(size: dict) -> str:
    """The MILP's size (Helix Table 8) for the text output."""
    unpruned, pruned = size["unpruned"], size["pruned"]
    partial = "with" if size["partial_inference"] else "without"
    return (
        f"Helix per-node MILP ({partial} partial inference): {unpruned['columns']} columns x "
        f"{unpruned['rows']} rows unpruned, {pruned['columns']} x {pruned['rows']} keeping "
        f"{size['link_degree']} links per node"
    )


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
@click.option("--cost-model", type=click.Choice(list(COST_MODELS)), default=None,
              help="Cost model of node placements and --placement: roofline (HexGen's equations on each "
                   "node's specs) or helix (Helix's measured GPU profiles; roofline for the nodes it did not "
                   "profile).  [default: the spec's cost_model, else roofline]")
@click.option("--placement", "placement_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE",
              help="Plan nothing: score this placement, a JSON object {node_id: [start, end]} of half-open "
                   "block ranges (or a `plan --json` result), and print what a plan prints.")
@click.option("--seed", type=int, default=None,
              help="[petals, hexgen, hexgen2] Seed of Petals' join order (Helix's seeded shuffle) or of the "
                   "search.  [default: 0]")
@click.option("--rebalance", is_flag=True, default=False,
              help="[petals] After every node joined, let nodes choose again until every block is served "
                   "(Petals' periodic rebalancing; Helix's Petals baseline has none).")
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
@click.option("--min-replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Redundancy floor: keep every block on at least this many nodes where the nodes' capacities "
                   "allow it (else as many blocks as they allow, every block once); milp, petals and swarm "
                   "place for it, every placement lists the blocks left on fewer nodes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with --algorithm all).")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.pass_context
def command(ctx, spec, algorithm, time_limit, gap, formulation, partial_inference, cost_model, placement_file,
            min_replicas, as_json, quiet, **replica):
    """Plan which blocks each node of the cluster SPEC serves (a spec file, or a named spec shipped with
    the planner).

    With --algorithm hexgen or hexgen2, plan model replicas instead: groups of GPUs, each a pipeline of
    tensor-parallel stages with its layer range (hexgen2: each group prefills or decodes).

    With --placement FILE, score that placement instead of planning one.
    """
    from swarmnode.planner import PlannerError, resolve_cluster

    _check_options(ctx, GIVEN if placement_file is not None else algorithm, replica)
    try:
        cluster = resolve_cluster(spec)
    except PlannerError as exc:
        raise click.ClickException(str(exc)) from None
    if placement_file is not None:
        _score(cluster, placement_file, cost_model, partial_inference, as_json, min_replicas)
        return
    _plan(cluster, algorithm, time_limit, gap, formulation, partial_inference, cost_model, as_json, quiet,
          replica, min_replicas)


def _floor_summary(result) -> str:
    """The blocks below the redundancy floor for the text output (empty for a floor of 1)."""
    if result.min_replicas <= 1:
        return ""
    r = result.min_replicas
    if not result.single_points:
        return f"redundancy floor: every block on at least {r} nodes"
    runs = ", ".join(f"[{s}, {e})" for s, e in result.single_points)
    floor = result.details.get("floor") or {}
    allowed = floor.get("blocks_at_floor")
    why = ""
    if allowed is not None and allowed < result.num_blocks:
        why = f" (the nodes' capacities let {allowed} of {result.num_blocks} blocks reach {r})"
    return f"single points of failure: blocks {runs} on fewer than {r} nodes{why}"


def _score(cluster, path: str, cost_model: str | None, partial_inference: bool, as_json: bool,
           min_replicas: int = 1) -> None:
    """``--placement``: score the file's placement with the chosen cost model."""
    from swarmnode.planner import PlacementError, PlannerError, score
    from swarmnode.planner.tables import placement_table

    given = _read_placement(path, cluster.node_ids)
    try:
        result = score(cluster, given, cost_model=cost_model, partial_inference=partial_inference,
                       min_replicas=min_replicas)
    except PlacementError as exc:
        raise PlacementFileError(f"--placement {path}: {exc}") from None
    except PlannerError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(_cost_summary(result))
    click.echo(placement_table(cluster, result))
    unserved = result.details.get("unserved_blocks")
    if unserved:
        click.echo("blocks nobody serves: " + ", ".join(f"[{s}, {e})" for s, e in unserved))
    floor = _floor_summary(result)
    if floor:
        click.echo(floor)


def _options_of(name: str, flags: dict):
    """The options of the node placement ``name`` (:mod:`planner.options`) from the flags given (None: not given)
    that its options type has: :func:`_check_options` has refused the flags that apply to no algorithm asked for,
    and with ``--algorithm all`` each flag goes to the algorithms that take it (``--gap`` to the MILP alone)."""
    entry = REGISTRY[name]
    return entry.options(**{k: v for k, v in flags.items() if v is not None and k in entry.accepts})


def _plan(cluster, algorithm, time_limit, gap, formulation, partial_inference, cost_model, as_json, quiet,
          replica, min_replicas: int = 1) -> None:
    """Plan with ``algorithm`` (``all``: every node-placement algorithm) and print the result(s)."""
    from swarmnode.planner import PlannerError, plan, plan_all, plan_replicas
    from swarmnode.planner.simulator.trace import request_lengths
    from swarmnode.planner.tables import placement_table

    names = list(PLACEMENT_ALGORITHMS) if algorithm == "all" else [algorithm]
    if not quiet:
        for name in names:
            if "time_limit" in REGISTRY[name].tunable:
                click.echo(f"{name}: {REGISTRY[name].summary}, up to {time_limit:g} s ...", err=True)
    entry = REGISTRY.get(algorithm)
    try:
        if entry is not None and entry.kind != PLACEMENT:
            flags = {k: v for k, v in replica.items() if v is not None and entry.applies(k)}
            lengths = request_lengths(cluster.workload, replica["workload"], replica["input_tokens"],
                                      replica["output_tokens"])
            result = plan_replicas(cluster, algorithm, entry.options(time_limit=time_limit, lengths=lengths, **flags))
            click.echo(json.dumps(result.to_json()) if as_json else entry.table(cluster, result))
            return
        flags = {"time_limit": time_limit, "gap": gap, "formulation": formulation,
                 "partial_inference": partial_inference, "min_replicas": min_replicas,
                 "progress": None if quiet else _progress, "seed": replica["seed"],
                 "rebalance": replica["rebalance"] or None}
        options = {name: _options_of(name, flags) for name in names}
        shared = {"cost_model": cost_model, "partial_inference": partial_inference, "min_replicas": min_replicas}
        if algorithm == "all":
            def failed(name: str, exc: PlannerError) -> None:
                click.echo(f"{name}: {exc}", err=True)

            results = plan_all(cluster, names, on_error=failed, options=options, **shared)
        else:
            results = [plan(cluster, algorithm, options=options[algorithm], **shared)]
    except PlannerError as exc:
        raise click.ClickException(f"{algorithm}: {exc}") from None
    if as_json:
        payload = [r.to_dict() for r in results]
        click.echo(json.dumps(payload if algorithm == "all" else payload[0]))
        return
    if results:
        click.echo(_cost_summary(results[0]))
    for result in results:
        table = placement_table(cluster, result)
        if result.model_size is not None:
            table += "\n" + _size_summary(result.model_size)
        floor = _floor_summary(result)
        if floor:
            table += "\n" + floor
        click.echo(table + "\n")
