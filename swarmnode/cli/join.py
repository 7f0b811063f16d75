"""`swarmnode join`: offer this machine's leftover capacity to the swarm and serve what it is given."""

from __future__ import annotations

import click

from swarmnode.cli.options import (
    SIZE,
    SPAN,
    address_options,
    admission_options,
    check_addresses,
    initial_peers_option,
    load_admission,
    model_options,
    validate_maddrs,
)
from swarmnode.planner.registry import COORDINATOR_ALGORITHMS
from swarmnode.records import DTYPE_NAMES, PHASE_NAMES, QUANTIZE_CHOICES, Phase
from swarmnode.relay import REACHABILITY


@click.command("join")
@model_options("this node reads only the shards that hold its blocks")
@initial_peers_option(required=False)
@click.option("--blocks", type=SPAN, default=None,
              help="Serve exactly blocks A:B (half-open) instead of following the coordinator's placement.")
@click.option("--leftover-cores", type=click.IntRange(1, 4096), default=None,
              help="CPU cores this node may use (default: all torch sees); sets the compute threads.")
@click.option("--trusted-coordinator", "trusted", multiple=True, metavar="KEY|FILE",
              help="Follow placements signed by this coordinator key (`ssh-rsa ...`, a .pub file or a key file); "
                   "repeatable. Default: this machine's swarm key (see `swarmnode coordinate`).")
@click.option("--coordinator", "run_coordinator", is_flag=True, default=False,
              help="Also run a coordinator in this process (it competes for the lease with the others).")
@click.option("--coordinator-key", default=None, type=click.Path(dir_okay=False),
              help="Key the in-process coordinator signs with (default: this machine's swarm key).")
@click.option("--algorithm", default="milp", show_default=True,
              type=click.Choice(COORDINATOR_ALGORITHMS), help="In-process coordinator's planner.")
@click.option("--min-replicas", default=2, show_default=True, type=click.IntRange(1, 16),
              help="In-process coordinator: keep every block on at least this many nodes where the offers allow it.")
@click.option("--remeasure", is_flag=True, default=False, help="Measure block throughput again, ignoring the cache.")
@address_options()
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPE_NAMES),
              help="Dtype the blocks compute in (hidden states travel in the client's dtype, cast at the edge).")
@click.option("--quantize", "quantization", default="none", show_default=True, type=click.Choice(QUANTIZE_CHOICES),
              help="Weight-only quantization of the blocks' linear layers as they load (CPU): int8 holds about "
                   "twice as many blocks as bfloat16 in the same memory. int8/int4: PyTorch's kernels (experts "
                   "too); q8_0/q4_0/q4_1: llama.cpp's block formats and ggml's arithmetic, faster decode "
                   "(linears only); bf16: the weights as 16-bit rows, computed in float32 by the same kernels "
                   "(a bfloat16 checkpoint's weights exactly, at GGUF F16 decode speed). A GGUF --model brings "
                   "its own.")
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
@click.option("--shutdown-grace", type=click.FloatRange(0.0, 3600.0), default=10.0, show_default=True,
              help="Seconds open sessions may go on after SIGTERM before the node exits.")
@click.option("--dht-prefix", default=None, help="DHT prefix of the model (default: from the model's name).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port). Default: off.")
@click.option("--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
              help="Private key file for a stable peer id (created if missing); in a private swarm, the identity "
                   "the --invitation was issued for.")
@admission_options(identity=False)
@click.option("--reachability", type=click.Choice(REACHABILITY), default="auto", show_default=True,
              help="auto: ask the initial peers whether they can dial this node, and serve through a relay when "
                   "they cannot (behind NAT); direct: others can dial it (no check); relay: always through a relay.")
@click.option("--relay-service/--no-relay-service", default=True, show_default=True,
              help="When others can dial this node, relay calls for nodes behind NAT.")
@click.option("--phase", type=click.Choice(PHASE_NAMES), default=None,
              help="Serve requests' prompts only (prefill), their generation only (decode: KV caches are handed "
                   "over to it), or both (HexGen-2's split; clients split requests when both kinds serve). Default: "
                   "both, or the phase a two-phase placement (coordinate --algorithm hexgen2) gives the node; a phase "
                   "given here is kept.")
@click.option("--prefill-chunk", type=click.IntRange(0, 1 << 20), default=None,
              help="Run a longer prompt this many tokens at a time, with other sessions' decode steps between its "
                   "chunks, so that they wait for at most one chunk (0: run every prompt whole). Default: "
                   "swarmnode.runtime.scheduler.DEFAULT_PREFILL_CHUNK (256).")
def command(model, model_name, initial_peers, blocks, leftover_cores, trusted, run_coordinator, coordinator_key, algorithm,
            min_replicas, remeasure, host, port, announce_host, device, dtype, quantization, num_threads, public_name,
            leftover_mem, cache_tokens, max_session_length, step_timeout, idle_timeout, shutdown_grace, dht_prefix,
            identity_path, invitation, owner_key, reachability, relay_service, phase, prefill_chunk, metrics_port):
    """Offer this machine's leftover memory (and cores) to the swarm reached through --initial-peers.

    Without --blocks the node measures itself, announces its offer and serves the range a trusted
    coordinator's placement gives it, following later placements as peers come and go.
    """
    from swarmnode.admission import Role
    from swarmnode.identity import KeyFileError, load_trusted_keys
    from swarmnode.logs import setup_logging
    from swarmnode.resources import check_cores, check_offer
    from swarmnode.runtime.checkpoint import CheckpointError
    from swarmnode.runtime.scheduler import DEFAULT_PREFILL_CHUNK
    from swarmnode.runtime.sources import open_checkpoint
    from swarmnode.server.config import (
        MemoryConfig,
        ModelConfig,
        NetworkConfig,
        NodeConfig,
        NodeConfigError,
        ServingConfig,
    )
    from swarmnode.server.handler import SessionLimits
    from swarmnode.server.node import EmbeddedCoordinator, Node

    setup_logging()
    peers = validate_maddrs(initial_peers)
    check_addresses(host, announce_host, port)
    admission = load_admission(Role.NODE, invitation, identity_path, owner_key)
    try:  # checks --reachability beside the addresses, before anything is measured or opened
        network = NetworkConfig(initial_peers=peers, host=host, port=port, announce_host=announce_host,
                                identity_path=admission.identity.path if admission else identity_path,
                                reachability=reachability, relay_service=relay_service, dht_prefix=dht_prefix,
                                public_name=public_name, metrics_port=metrics_port, admission=admission)
    except NodeConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        offered = check_offer(leftover_mem, device)
        cores = check_cores(leftover_cores)
        trusted_keys = load_trusted_keys(list(trusted)) if blocks is None or run_coordinator else frozenset()
        checkpoint = open_checkpoint(model, model_name=model_name)
        max_positions = int(getattr(checkpoint.config, "max_position_embeddings", 8192))
    except (ValueError, CheckpointError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    limits = SessionLimits(step_timeout=step_timeout, idle_timeout=idle_timeout,
                           max_length=min(max_session_length or max_positions, max_positions))
    try:
        config = NodeConfig(
            model=ModelConfig(model=model, model_name=model_name, blocks=blocks, device=device, dtype=dtype,
                              quantization=quantization),
            memory=MemoryConfig(leftover_mem=offered, cache_tokens=cache_tokens),
            network=network,
            serving=ServingConfig(limits=limits,
                                  prefill_chunk=DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk,
                                  phase=Phase(phase or Phase.BOTH), phase_pinned=phase is not None,
                                  num_threads=num_threads, cores=cores, remeasure=remeasure,
                                  shutdown_grace=shutdown_grace, trusted_keys=trusted_keys),
        )
        embedded = None
        if run_coordinator:
            from swarmnode.coordinator.service import CoordinatorConfig
            from swarmnode.identity import default_swarm_key_path, load_or_create_private_key

            embedded = EmbeddedCoordinator(load_or_create_private_key(coordinator_key or default_swarm_key_path()),
                                           CoordinatorConfig(algorithm=algorithm, min_replicas=min_replicas))
        node = Node(config, checkpoint=checkpoint, coordinator=embedded)
        node.run()
    except (NodeConfigError, CheckpointError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from exc
