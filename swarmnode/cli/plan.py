"""`swarmnode plan`: place a model on a cluster spec and print the placement, throughput and flows.

The node-level algorithms (``milp``, ``ahp``, ``gma``, ``petals``, ``swarm``; ``all`` runs these five) go
through :func:`planner.plan`. ``hexgen`` and ``hexgen2`` plan model *replicas* instead
(:func:`planner.hexgen.plan_hexgen`, :func:`planner.hexgen2.plan_hexgen2`): groups of GPUs, each a pipeline of
tensor-parallel stages; HexGen-2 also gives every group a role, prefill or decode. See
``docs/plans_and_simulator.md``.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import click
from click.core import ParameterSource

PLACEMENT_ALGORITHMS = ["milp", "ahp", "gma", "petals", "swarm"]
REPLICA_ALGORITHMS = ["hexgen", "hexgen2"]
ALGORITHM_CHOICES = [*PLACEMENT_ALGORITHMS, *REPLICA_ALGORITHMS, "all"]
WORKLOADS = ["HPLD", "HPHD", "LPHD", "LPLD"]

# option (click parameter name) -> the --algorithm values it applies to; giving it with another is an error
_APPLIES_TO = {
    "gap": set(PLACEMENT_ALGORITHMS) | {"all"},
    "formulation": set(PLACEMENT_ALGORITHMS) | {"all"},
    "partial_inference": set(PLACEMENT_ALGORITHMS) | {"all"},
    "seed": {"hexgen", "hexgen2"},
    "workload": {"hexgen", "hexgen2"},
    "input_tokens": {"hexgen", "hexgen2"},
    "output_tokens": {"hexgen", "hexgen2"},
    "generations": {"hexgen"},
    "population": {"hexgen"},
    "rate": {"hexgen"},
    "slo_scale": {"hexgen"},
    "sim_duration": {"hexgen"},
    "max_stages": {"hexgen"},
    "kv_batch": {"hexgen2"},
    "max_iterations": {"hexgen2"},
}


def _load(spec: str):
    from swarmnode.planner import SpecError, load_cluster, load_shared_cluster

    path = Path(spec)
    if path.is_dir():
        raise SpecError(f"{spec}: is a directory, not a cluster spec file")
    if path.exists():
        try:
            return load_cluster(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"{spec}: cannot read it ({exc})") from None
    try:
        return load_shared_cluster(spec)
    except SpecError as exc:
        raise SpecError(f"{spec}: no such file, and not a shared cluster name ({exc})") from None


def _table(cluster, result) -> str:
    lines = [
        f"{result.algorithm}: throughput {result.throughput:.1f} tokens/s, upper bound {result.upper_bound:.1f} "
        f"(gap {100 * result.gap:.1f}%), solved in {result.solve_seconds:.2f} s"
        + (f", best pipeline {1000 * result.latency:.1f} ms/token" if result.latency is not None else ""),
    ]
    header = f"{'node':<24} {'range':>12} {'blocks':>6} {'capacity':>10} {'flow':>10}"
    lines.append(header)
    lines.append("-" * len(header))
    capacity = {n: 0.0 for n in result.placement}
    from swarmnode.planner import CostModel

    cost = CostModel(cluster)
    for node_id, (start, end) in sorted(result.placement.items(), key=lambda item: (item[1], item[0])):
        capacity[node_id] = cost.throughput(node_id, end - start)
        lines.append(
            f"{node_id:<24} {f'[{start}, {end})':>12} {end - start:>6} {capacity[node_id]:>10.1f} "
            f"{result.node_flows.get(node_id, 0.0):>10.1f}"
        )
    idle = [n for n in cluster.node_ids if n not in result.placement]
    if idle:
        lines.append(f"unused: {', '.join(idle)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# HexGen / HexGen-2 tables
# ---------------------------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _gpu_mix(gpus) -> str:
    kinds: dict[str, int] = {}
    for g in gpus:
        kinds[g.gpu_type] = kinds.get(g.gpu_type, 0) + 1
    mix = ", ".join(f"{n}x {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{_plural(len(gpus), 'GPU')} ({mix})"


def _memory_verdict(cluster, replica, task) -> tuple[str, list[str]]:
    """HexGen Eq. 7 on every GPU of the replica for one request of the planning task."""
    from swarmnode.planner.hexgen import memory_problems

    problems = memory_problems(
        cluster, [([g.id for g in s.gpus], s.layers) for s in replica.stages], task=task
    )
    return ("fits" if not problems else "OUT OF MEMORY"), problems


def _request_latency(cluster, replica, task) -> float:
    """HexGen Eq. 2 for one replica: compute (Eq. 4) and tensor-parallel (Eq. 5) time of every stage plus the
    pipeline hops (Eq. 6), seconds for one request of the planning task (prefill and every decode step)."""
    from swarmnode.planner.hexgen_cost import StageCost, gpu_classes, link_between

    cls_of = {g.id: c for c in gpu_classes(cluster) for g in c.gpus}
    sc = StageCost(cluster, task)
    seconds = 0.0
    for stage in replica.stages:
        cls = cls_of[stage.gpus[0].id]
        seconds += sc.compute(cls, stage.tp, stage.layers) + sc.tensor_parallel(cls, stage.tp, stage.layers)
    for a, b in itertools.pairwise(replica.stages):
        seconds += sc.pipeline_hop(link_between(cluster, a.gpus, b.gpus))
    return seconds


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _stage_lines(replica) -> list[str]:
    width = max(len(s.id) for s in replica.stages)
    lines = []
    for j, s in enumerate(replica.stages):
        kinds = "/".join(sorted(s.gpu_types))
        lines.append(
            f"    stage {j}  {s.id:<{width}}  {kinds}  TP {s.tp}  layers [{s.start}, {s.end}) "
            f"({_plural(s.layers, 'layer')})"
        )
    return lines


def _group_lines(cluster, name, replica, task, figures: str) -> list[str]:
    verdict, problems = _memory_verdict(cluster, replica, task)
    lines = [
        f"{name}  {replica.role:<7}  {_gpu_mix(replica.gpus)}  TP {'/'.join(map(str, replica.strategy))}, "
        f"PP {len(replica.stages)}  {figures}  memory {verdict}"
    ]
    lines.extend(_stage_lines(replica))
    lines.extend(f"    ! {p}" for p in problems)
    return lines


def _hexgen_table(cluster, result) -> str:
    task, fit = result.task, result.fitness
    lines = [
        f"hexgen: {_plural(len(result.replicas), 'replica group')}, "
        f"capacity {result.throughput:.1f} tokens/s (cost model), upper bound {result.upper_bound:.1f}, "
        f"solved in {result.solve_seconds:.2f} s ({_plural(result.generations, 'generation')}, "
        f"{_plural(result.evaluations, 'grouping')} simulated)",
        f"task {task.s_in:g} prompt / {task.s_out:g} output tokens; fitness trace {result.rate:.2f} requests/s: "
        f"SLO attainment {100 * fit.slo_attainment:.1f}% (scale {result.slo_scale:g}), "
        f"simulated {fit.throughput:.1f} tokens/s, prompt latency {_seconds(fit.prompt_latency_mean)}, "
        f"decode {_seconds(fit.decode_latency_mean)}/token, end to end {_seconds(fit.latency_mean)}",
        "capacity: output tokens/s at the largest batch that fits; latency: HexGen Eq. 2 for one request; "
        "memory: Eq. 7 per GPU",
    ]
    for i, r in enumerate(result.replicas):
        figures = f"capacity {r.capacity:.1f} tokens/s, latency {_request_latency(cluster, r, task):.3f} s"
        lines.extend(_group_lines(cluster, f"replica-{i}", r, task, figures))
    used = {g.node for r in result.replicas for g in r.gpus}
    idle = [n.id for n in cluster.nodes if n.gpus and n.id not in used]
    if idle:
        lines.append(f"unused: {', '.join(idle)}")
    return "\n".join(lines)


def _hexgen2_table(cluster, result) -> str:
    task = result.task
    decode_capacity = sum(r.capacity for r in result.decode)
    lines = [
        f"hexgen2: {len(result.prefill)} prefill + {len(result.decode)} decode groups, max flow "
        f"{result.value:.2f} requests/s = {result.throughput:.1f} tokens/s (decode capacity "
        f"{decode_capacity:.1f} tokens/s), solved in {result.solve_seconds:.2f} s "
        f"({_plural(result.iterations, 'refinement iteration')}, {_plural(len(result.moves), 'move')} applied)",
        f"task {task.s_in:g} prompt / {task.s_out:g} output tokens; prefill capacity in prompts/s (latency = "
        "one prompt), decode in output tokens/s; routed = max-flow requests/s; memory: Eq. 7 per GPU",
    ]
    for i, r in enumerate(result.prefill):
        routed = result.source_flow[i] if i < len(result.source_flow) else 0.0
        latency = 1.0 / r.capacity if r.capacity > 0 else float("inf")
        figures = f"capacity {r.capacity:.2f} prompts/s, latency {latency:.3f} s, routed {routed:.2f} req/s"
        lines.extend(_group_lines(cluster, f"prefill-{i}", r, task, figures))
    for j, r in enumerate(result.decode):
        routed = sum(f for (_, jj), f in result.kv_routing.items() if jj == j)
        figures = f"capacity {r.capacity:.1f} tokens/s, routed {routed:.2f} req/s"
        lines.extend(_group_lines(cluster, f"decode-{j}", r, task, figures))
    routes = [(key, f) for key, f in sorted(result.kv_routing.items()) if f > 0]
    if routes:
        lines.append("KV routing:")
        for (i, j), f in routes:
            share = f / result.value if result.value else 0.0
            lines.append(f"    prefill-{i} -> decode-{j}  {f:.2f} requests/s ({100 * share:.1f}%)")
    if result.moves:
        lines.append(f"moves: {'; '.join(result.moves)}")
    used = {g.node for r in (*result.prefill, *result.decode) for g in r.gpus}
    idle = [n.id for n in cluster.nodes if n.gpus and n.id not in used]
    if idle:
        lines.append(f"unused: {', '.join(idle)}")
    return "\n".join(lines)


def _task_lengths(cluster, workload, input_tokens, output_tokens) -> tuple[int, int] | str | None:
    """``None`` (the spec's averages), a HexGen-2 workload name, or explicit ``(s_in, s_out)``."""
    if workload is not None:
        return workload.upper()
    if input_tokens is None and output_tokens is None:
        return None
    w = cluster.workload
    s_in = input_tokens if input_tokens is not None else max(1, round(w.avg_input_tokens))
    s_out = output_tokens if output_tokens is not None else max(1, round(w.avg_output_tokens))
    return int(s_in), int(s_out)


def _run_replica_planner(cluster, algorithm, options, quiet):
    from swarmnode.planner.hexgen_cost import Task
    from swarmnode.planner.trace import HEXGEN2_WORKLOADS

    lengths = options.pop("lengths")
    if algorithm == "hexgen":
        from swarmnode.planner.hexgen import plan_hexgen

        if lengths is not None:
            s_in, s_out = HEXGEN2_WORKLOADS[lengths] if isinstance(lengths, str) else lengths
            options["task"] = Task(1.0, float(s_in), float(s_out))
        if not quiet:
            click.echo(
                f"hexgen: genetic search, up to {_plural(options.get('generations', 30), 'generation')} "
                f"or {options['time_limit']:g} s ...",
                err=True,
            )
        return plan_hexgen(cluster, **options)
    from swarmnode.planner.hexgen2 import plan_hexgen2

    if lengths is not None:
        options["workload"] = lengths
    if not quiet:
        click.echo(f"hexgen2: partition and refinement, up to {options['time_limit']:g} s ...", err=True)
    return plan_hexgen2(cluster, **options)


# ---------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------

_POSITIVE = click.FloatRange(min=0.0, min_open=True)


def _workload(ctx, param, value: str | None) -> str | None:
    if value is None:
        return None
    if value.upper() not in WORKLOADS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(WORKLOADS)} (any case)")
    return value.upper()


@click.command("plan")
@click.argument("spec")
@click.option(
    "--algorithm",
    "-a",
    type=click.Choice(ALGORITHM_CHOICES),
    default="milp",
    show_default=True,
    help="Placement algorithm; hexgen / hexgen2 plan tensor/pipeline-parallel replica groups "
    "(hexgen2: prefill and decode groups); 'all' runs the five placement algorithms.",
)
@click.option(
    "--time-limit",
    type=_POSITIVE,
    default=60.0,
    show_default=True,
    help="Seconds the MILP, HexGen's genetic search or HexGen-2's refinement may run.",
)
@click.option(
    "--gap",
    type=float,
    default=0.05,
    show_default=True,
    help="Stop the MILP once within this fraction of the upper bound.",
)
@click.option(
    "--formulation",
    type=click.Choice(["auto", "coverage", "typed", "per-node"]),
    default="auto",
    show_default=True,
    help="MILP formulation (see docs/planner.md).",
)
@click.option(
    "--partial-inference/--no-partial-inference",
    default=True,
    show_default=True,
    help="Let a request enter a node in the middle of its blocks (Helix §4.4).",
)
@click.option("--seed", type=int, default=None, help="[hexgen, hexgen2] Seed of the search.  [default: 0]")
@click.option(
    "--workload",
    metavar=f"[{'|'.join(WORKLOADS)}]",
    callback=_workload,
    default=None,
    help="[hexgen, hexgen2] HexGen-2 workload class for the planning task (HPLD 1024/64, HPHD 1024/256, "
    "LPHD 256/256, LPLD 256/64 prompt/output tokens).  [default: the spec's average lengths]",
)
@click.option(
    "--input-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="[hexgen, hexgen2] Prompt tokens of the planning task.  [default: the spec's average]",
)
@click.option(
    "--output-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="[hexgen, hexgen2] Output tokens of the planning task.  [default: the spec's average]",
)
@click.option(
    "--generations",
    type=click.IntRange(min=0),
    default=None,
    help="[hexgen] Generations of the genetic search.  [default: 30]",
)
@click.option(
    "--population",
    type=click.IntRange(min=1),
    default=None,
    help="[hexgen] Groupings kept per generation.  [default: 8]",
)
@click.option(
    "--rate",
    type=_POSITIVE,
    default=None,
    help="[hexgen] Requests/s of the fitness trace.  [default: 75% of the best initial grouping's capacity]",
)
@click.option(
    "--slo-scale",
    type=_POSITIVE,
    default=None,
    help="[hexgen] SLO = this many times a request's latency alone on one A100.  [default: 5]",
)
@click.option(
    "--sim-duration",
    type=_POSITIVE,
    default=None,
    help="[hexgen] Seconds of arrivals in each fitness simulation.  [default: 30]",
)
@click.option(
    "--max-stages",
    type=click.IntRange(min=1),
    default=None,
    help="[hexgen] Most pipeline stages per replica.  [default: 8]",
)
@click.option(
    "--kv-batch",
    type=click.IntRange(min=0),
    default=None,
    help="[hexgen2] Requests whose KV cache a group must hold when choosing the number of groups.  "
    "[default: 32]",
)
@click.option(
    "--max-iterations",
    type=click.IntRange(min=0),
    default=None,
    help="[hexgen2] Refinement iterations.  [default: 50]",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with --algorithm all).")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.pass_context
def command(ctx, spec, algorithm, time_limit, gap, formulation, partial_inference, as_json, quiet, **replica):
    """Plan which blocks each node of the cluster SPEC serves (a spec file, or a shared cluster's name).

    With --algorithm hexgen or hexgen2, plan model replicas instead: groups of GPUs, each a pipeline of
    tensor-parallel stages with its layer range (hexgen2: each group prefills or decodes).
    """
    from swarmnode.planner import ALGORITHMS, PlacementError, SpecError, plan

    for name, allowed in _APPLIES_TO.items():
        if algorithm not in allowed and ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            flag = next(p for p in ctx.command.params if p.name == name).opts[-1]
            if name == "partial_inference":
                flag = "--partial-inference/--no-partial-inference"
            raise click.UsageError(
                f"{flag} applies to --algorithm {' / '.join(sorted(allowed - {'all'}))}, not {algorithm}", ctx
            )
    if replica["workload"] is not None and (
        replica["input_tokens"] is not None or replica["output_tokens"] is not None
    ):
        raise click.UsageError("give --workload or --input-tokens/--output-tokens, not both", ctx)

    try:
        cluster = _load(spec)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None

    if algorithm in REPLICA_ALGORITHMS:
        options = {"time_limit": time_limit}
        options.update({k: v for k, v in replica.items() if v is not None and _APPLIES_TO[k] >= {algorithm}})
        for key in ("workload", "input_tokens", "output_tokens"):
            options.pop(key, None)
        options["lengths"] = _task_lengths(
            cluster, replica["workload"], replica["input_tokens"], replica["output_tokens"]
        )
        try:
            result = _run_replica_planner(cluster, algorithm, options, quiet)
        except (PlacementError, ValueError) as exc:  # SpecError is a ValueError
            raise click.ClickException(f"{algorithm}: {exc}") from None
        if as_json:
            click.echo(json.dumps(result.to_json()))
        elif algorithm == "hexgen":
            click.echo(_hexgen_table(cluster, result))
        else:
            click.echo(_hexgen2_table(cluster, result))
        return

    def progress(event) -> None:
        if quiet:
            return
        click.echo(
            f"  [{event.elapsed:6.1f}s] {event.phase:<10} best {event.best:10.1f}  bound {event.bound:10.1f}"
            + (f"  {event.message}" if event.message else ""),
            err=True,
        )

    algorithms = list(ALGORITHMS) if algorithm == "all" else [algorithm]
    results = []
    for name in algorithms:
        if not quiet and name == "milp":
            click.echo(f"milp: searching for up to {time_limit:g} s ...", err=True)
        try:
            options = {"time_limit": time_limit, "gap": gap, "partial_inference": partial_inference}
            if name == "milp":
                options.update(progress=progress, formulation=formulation)
            results.append(plan(cluster, name, **options))
        except (PlacementError, ValueError) as exc:
            if algorithm != "all":
                raise click.ClickException(f"{name}: {exc}") from exc
            click.echo(f"{name}: {exc}", err=True)
    if as_json:
        payload = [r.to_dict() for r in results]
        json.dump(payload if algorithm == "all" else payload[0], sys.stdout)
        sys.stdout.write("\n")
        return
    for result in results:
        click.echo(_table(cluster, result))
        click.echo("")
