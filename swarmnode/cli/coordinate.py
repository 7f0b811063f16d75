"""`swarmnode coordinate`: plan where blocks go from the nodes' live offers and publish the placement."""

from __future__ import annotations

import click
from click.core import ParameterSource

from swarmnode.cli.options import (
    address_options,
    admission_options,
    check_addresses,
    initial_peers_option,
    load_admission,
    model_options,
    validate_maddrs,
)
from swarmnode.planner.options import AlgorithmOptions
from swarmnode.planner.registry import COORDINATOR_ALGORITHMS, MIN_REPLICAS, PLACEMENT, lookup


@click.command("coordinate")
@model_options("its config and sizes; no weights are loaded")
@initial_peers_option(required=True)
@click.option("--algorithm", default="milp", show_default=True,
              type=click.Choice(COORDINATOR_ALGORITHMS),
              help="Placement algorithm; hexgen2 also splits the nodes into prefill and decode nodes (HexGen-2).")
@click.option("--time-limit", default=10.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds the MILP (or hexgen2) may take per plan; about half of it bounds the search for a "
                   "placement that moves few blocks.")
@click.option("--improvement", default=0.2, show_default=True, type=click.FloatRange(0.0, 10.0),
              help="Move blocks only when a fresh plan beats keeping the current one by this share.")
@click.option("--min-replicas", default=2, show_default=True, type=click.IntRange(1, 16),
              help="Keep every block on at least this many nodes where the offers allow it (a node lost is "
                   "then no gap); blocks the offers cannot replicate are shown as single points of failure.")
@click.option("--workload", default=None, metavar="PROMPT:OUTPUT", callback=lambda ctx, param, value: _workload(value),
              help="The average request to plan for, in prompt and output tokens (default: Helix's trace, 763:232). "
                   "Every link carries each prompt once, so long prompts make slow links count for more.")
@click.option("--debounce", default=3.0, show_default=True, type=click.FloatRange(0.0, 600),
              help="Seconds of quiet after a change before re-planning.")
@click.option("--key", "key_path", default=None, type=click.Path(dir_okay=False),
              help="Private key the placements are signed with (created if missing; default: this machine's "
                   "swarm key). Nodes follow it if they trust its public half.")
@click.option("--trusted-coordinator", "trusted", multiple=True, metavar="KEY|FILE",
              help="Other coordinators' keys whose leases and placements this one respects; repeatable.")
@click.option("--print-key", is_flag=True, default=False, help="Print the public key to trust and exit.")
@address_options()
@click.option("--dht-prefix", default=None, help="DHT prefix of the model (default: from the model's name).")
@click.option("--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
              help="Private key file for a stable peer id (created if missing); in a private swarm, the identity "
                   "the --invitation was issued for.")
@admission_options(identity=False)
@click.pass_context
def command(ctx, model, model_name, initial_peers, algorithm, time_limit, improvement, min_replicas, workload, debounce, key_path,
            trusted, print_key, host, port, announce_host, dht_prefix, identity_path, invitation, owner_key):
    """Coordinate the swarm serving MODEL: hold the lease, plan, publish versioned signed placements.

    Several coordinators may run: one holds the lease, the others stand by and take over when it lapses.
    """
    import asyncio
    import logging
    import signal

    from swarmnode.identity import (
        KeyFileError,
        default_swarm_key_path,
        load_or_create_private_key,
        load_trusted_keys,
        public_key_text,
    )
    from swarmnode.logs import setup_logging
    from swarmnode.records import TAKEOVER_BOUND, model_prefix
    from swarmnode.runtime.checkpoint import CheckpointError
    from swarmnode.runtime.sources import open_checkpoint

    options = algorithm_options(ctx, algorithm, time_limit, min_replicas)
    setup_logging()
    try:
        key = load_or_create_private_key(key_path or default_swarm_key_path())
        if print_key:
            click.echo(public_key_text(key))
            return
        trusted_keys = load_trusted_keys(list(trusted)) if trusted else frozenset()
        checkpoint = open_checkpoint(model, model_name=model_name)
        prefix = dht_prefix or model_prefix(checkpoint.name)
    except (KeyFileError, CheckpointError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    peers = validate_maddrs(initial_peers)
    check_addresses(host, announce_host, port)

    from swarmnode.coordinator.service import Coordinator, CoordinatorConfig, model_info_from_checkpoint
    from swarmnode.dht import start_dht

    config = CoordinatorConfig(algorithm=algorithm, time_limit=time_limit, improvement=improvement, debounce=debounce,
                               min_replicas=min_replicas, workload=workload, options=options)
    from swarmnode.admission import Role

    admission = load_admission(Role.COORDINATOR, invitation, identity_path, owner_key)
    dht = start_dht(peers, host=host, port=port, announce_host=announce_host,
                    identity_path=admission.identity.path if admission else identity_path, key=key, admission=admission)
    logging.getLogger("swarmnode.coordinator").info(
        "joined the DHT as %s, listening on %s", dht.peer_id.to_base58(), ", ".join(str(a) for a in dht.get_visible_maddrs()))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        members = reading = None
        if admission is not None:  # a private swarm: plan only nodes admitted as nodes
            from swarmnode.membership import Membership

            members = Membership(dht, admission, key)
            await members.start()
            reading = asyncio.get_running_loop().create_task(members.run(stop))  # referenced while it runs
        coordinator = Coordinator(dht, prefix, model_info_from_checkpoint(checkpoint), key, trusted_keys, config,
                                  members=members)
        print(f"COORDINATOR {coordinator.peer_id} takeover bound {TAKEOVER_BOUND:.0f}s", flush=True)
        await coordinator.run(stop)
        if reading is not None:
            reading.cancel()

    try:
        asyncio.run(main())
    finally:
        dht.shutdown()


def algorithm_options(ctx: click.Context, algorithm: str, time_limit: float,
                      min_replicas: int) -> AlgorithmOptions:
    """The options of the fresh plans with `algorithm` (`planner.options`), from the flags it takes: `--time-limit`
    for an algorithm with a time limit (milp, hexgen2), `--min-replicas` for one that places for a floor (milp,
    petals, swarm; for the others it only bounds what the coordinator keeps and reports). `--time-limit` given for
    an algorithm without one is a usage error rather than a flag quietly ignored."""
    entry = lookup(algorithm)
    raw: dict[str, float | int] = {}
    if "time_limit" in entry.accepts:
        raw["time_limit"] = time_limit
    elif ctx.get_parameter_source("time_limit") not in (None, ParameterSource.DEFAULT):
        timed = [n for n in COORDINATOR_ALGORITHMS if "time_limit" in lookup(n).accepts]
        raise click.UsageError(f"--time-limit applies to --algorithm {' / '.join(timed)}, not {algorithm} "
                               f"(it has no time limit): drop it", ctx)
    if entry.kind == PLACEMENT and MIN_REPLICAS in entry.accepts:
        raw[MIN_REPLICAS] = min_replicas
    return entry.options(**raw)


def _workload(value: str | None) -> tuple[float, float] | None:
    """`--workload PROMPT:OUTPUT` as (prompt tokens, output tokens)."""
    if value is None:
        return None
    try:
        prompt, output = (float(part) for part in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not PROMPT:OUTPUT (average tokens, e.g. 4096:32)") from None
    if not 0 <= prompt < 1e7 or not 1 <= output < 1e7:
        raise click.BadParameter(f"{value!r}: prompt tokens must be from 0 and output tokens from 1, each under "
                                 f"10 million")
    return prompt, output
