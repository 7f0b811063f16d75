"""`swarmnode api`: an OpenAI-compatible HTTP API (and dashboard, and Prometheus metrics) over the swarm."""

from __future__ import annotations

from pathlib import Path

import click

from swarmnode.cli.options import (
    admission_options,
    initial_peers_option,
    load_admission,
    model_options,
    validate_maddrs,
)
from swarmnode.records import DTYPE_NAMES


@click.command("api")
@initial_peers_option(required=True)
@model_options("embeddings, norm, head and tokenizer; the model id is the folder's or Hub name")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", *DTYPE_NAMES]),
              help="Dtype of the server's embeddings, norm and head and of the hidden states it sends (auto: the "
                   "checkpoint's).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), show_default=True,
              help="TCP port (0: any free port; the bound one is printed as `API http://HOST:PORT`).")
@click.option("--trusted-coordinator", "trusted", multiple=True, metavar="KEY|FILE",
              help="Follow placements signed by this coordinator key (default: this machine's swarm key).")
@click.option("--workers", default=4, type=click.IntRange(1, 256), show_default=True,
              help="Generations run at once (each has its own inference session).")
@click.option("--default-max-tokens", default=256, type=click.IntRange(1, None), show_default=True,
              help="max_tokens of a chat completion that names none.")
@click.option("--verify", default=0.0, type=click.FloatRange(0.0, 1.0), show_default=True,
              help="Share of steps re-run on another replica to catch wrong answers (>0 also checks every "
                   "first step); peers found wrong are banned and reported. See docs/operations.md.")
@click.option("--prompt-lookup", default=0, type=click.IntRange(0, 64), show_default=True, metavar="N",
              help="Speculative decoding for requests that name no `prompt_lookup` of their own: draft up to N "
                   "tokens a pass from the prompt (0: off). Same greedy output; faster where answers reuse the prompt.")
@click.option("--api-keys", "api_keys", default=None, type=click.Path(dir_okay=False, path_type=Path),
              metavar="FILE", help="Admit only callers with a key of FILE (one 'NAME KEY|sha256:HEX [sessions=N] "
                                   "[tokens_per_minute=N]' per line; read again when it changes; `swarmnode api-key` "
                                   "makes keys). Without it, anyone who reaches --host may call.")
@admission_options()
def command(initial_peers, model, model_name, dtype, host, port, trusted, workers, default_max_tokens, verify,
            prompt_lookup, api_keys, invitation, owner_key, identity_path):
    """Serve /v1/models, /v1/completions and /v1/chat/completions (OpenAI's API), /metrics and a dashboard at /."""
    import signal
    import socket
    import sys

    import uvicorn

    from swarmnode.admission import Role
    from swarmnode.api.app import create_app
    from swarmnode.api.engine import Engine
    from swarmnode.identity import KeyFileError, load_trusted_keys
    from swarmnode.logs import setup_logging

    setup_logging()
    peers = validate_maddrs(initial_peers)
    admission = load_admission(Role.CLIENT, invitation, identity_path, owner_key)
    keys = None
    if api_keys is not None:
        from swarmnode.api.keys import KeyFileError, KeyRing

        try:
            keys = KeyRing(api_keys)
        except KeyFileError as exc:
            raise click.ClickException(f"{exc} (--api-keys)") from exc
    try:
        trusted_keys = load_trusted_keys(list(trusted), create=False) if trusted else None
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from exc
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc
    engine = Engine.load(model, peers, model_name=model_name, dtype=dtype, trusted=trusted_keys, workers=workers, default_max_tokens=default_max_tokens,
                         verify=verify, prompt_lookup=prompt_lookup, admission=admission)
    try:
        app = create_app(engine, keys)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        access = f"{len(keys)} API keys from {api_keys}" if keys is not None else "no API keys: open to all"
        click.echo(f"API http://{shown}:{bound}  (OpenAI base_url http://{shown}:{bound}/v1, model "
                   f"{engine.model_id!r}, dashboard at /, metrics at /metrics; {access})", nl=True)
        sys.stdout.flush()
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: make that a clean exit
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            pass
    finally:
        engine.shutdown()
        sock.close()
