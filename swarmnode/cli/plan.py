"""`swarmnode plan`: place a model on a cluster spec and print the placement, throughput and flows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

ALGORITHM_CHOICES = ["milp", "ahp", "gma", "petals", "swarm", "all"]


def _load(spec: str):
    from swarmnode.planner import SpecError, load_cluster, load_shared_cluster

    path = Path(spec)
    if path.exists():
        return load_cluster(path)
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


@click.command("plan")
@click.argument("spec")
@click.option(
    "--algorithm",
    "-a",
    type=click.Choice(ALGORITHM_CHOICES),
    default="milp",
    show_default=True,
    help="Placement algorithm, or 'all' to run every one.",
)
@click.option("--time-limit", type=float, default=60.0, show_default=True, help="Seconds the MILP may run.")
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with --algorithm all).")
@click.option("--quiet", "-q", is_flag=True, help="No MILP progress on stderr.")
def command(spec, algorithm, time_limit, gap, formulation, partial_inference, as_json, quiet):
    """Plan which blocks each node of the cluster SPEC serves (a spec file, or a shared cluster's name)."""
    from swarmnode.planner import ALGORITHMS, PlacementError, SpecError, plan

    try:
        cluster = _load(spec)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from exc

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
