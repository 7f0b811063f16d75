"""`swarmnode join`: serve a range of a model's blocks to the swarm."""

from __future__ import annotations

import click

from swarmnode.cli.options import SIZE, SPAN, initial_peers_option, validate_maddrs


@click.command("join")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Folder of the model's Hugging Face checkpoint (see `swarmnode prepare-model`).")
@initial_peers_option(required=False)
@click.option("--blocks", type=SPAN, required=True, help="Blocks to serve, as A:B (half-open).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=0, type=click.IntRange(0, 65535), show_default=True,
              help="TCP port to listen on (0: any free port).")
@click.option("--announce-host", default=None, help="Address other peers should dial, if not --host.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--num-threads", default=None, type=click.IntRange(1, 1024), help="Torch threads for compute.")
@click.option("--public-name", default=None, help="A name shown to users of the swarm.")
@click.option("--leftover-mem", type=SIZE, default=None,
              help="Memory this node may use (e.g. 40G): weights plus KV cache. Default: what is free now, less a margin.")
@click.option("--cache-tokens", type=click.IntRange(1, None), default=None,
              help="KV-cache budget in tokens (overrides the one derived from --leftover-mem).")
@click.option("--max-session-length", type=click.IntRange(1, None), default=None,
              help="Longest session in tokens (default: the model's max_position_embeddings).")
@click.option("--step-timeout", type=click.FloatRange(0.1, None), default=120.0, show_default=True,
              help="Seconds one step may take before the session gets an error.")
@click.option("--idle-timeout", type=click.FloatRange(0.1, None), default=60.0, show_default=True,
              help="Seconds a session may wait for the client's next step before its cache is freed.")
@click.option("--dht-prefix", default=None, help="DHT prefix of the model (default: from the folder name).")
@click.option("--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
              help="Private key file for a stable peer id (created if missing).")
def command(model, initial_peers, blocks, host, port, announce_host, device, dtype, num_threads, public_name,
            leftover_mem, cache_tokens, max_session_length, step_timeout, idle_timeout, dht_prefix, identity_path):
    """Serve blocks A:B of MODEL to the swarm reached through --initial-peers."""
    from swarmnode.logs import setup_logging
    from swarmnode.resources import check_offer
    from swarmnode.runtime.checkpoint import Checkpoint, CheckpointError
    from swarmnode.server.handler import SessionLimits
    from swarmnode.server.node import Node, NodeConfig, NodeConfigError

    setup_logging()
    peers = validate_maddrs(initial_peers)
    try:
        offered = check_offer(leftover_mem, device)
        max_positions = int(getattr(Checkpoint(model).config, "max_position_embeddings", 8192))
    except (ValueError, CheckpointError) as exc:
        raise click.ClickException(str(exc)) from exc
    limits = SessionLimits(step_timeout=step_timeout, idle_timeout=idle_timeout,
                           max_length=min(max_session_length or max_positions, max_positions))
    config = NodeConfig(
        model=model, start=blocks[0], end=blocks[1], initial_peers=peers, host=host, port=port,
        announce_host=announce_host, device=device, dtype=dtype, num_threads=num_threads, public_name=public_name,
        leftover_mem=offered, cache_tokens=cache_tokens, dht_prefix=dht_prefix, identity_path=identity_path,
        limits=limits,
    )
    try:
        Node(config).run()
    except (NodeConfigError, CheckpointError) as exc:
        raise click.ClickException(str(exc)) from exc
