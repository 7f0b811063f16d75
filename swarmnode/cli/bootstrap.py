"""`swarmnode bootstrap`: run a DHT-only peer and print its multiaddr."""

import click

from swarmnode.cli.options import validate_maddrs


@click.command("bootstrap")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=31337, type=click.IntRange(0, 65535), show_default=True, help="TCP port.")
@click.option("--announce-host", default=None, help="Address other peers should dial, if not --host.")
@click.option("--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
              help="Private key file that keeps the peer id stable across restarts (created if missing).")
@click.option("--initial-peers", multiple=True, metavar="MADDR", help="Other bootstrap peers to link up with.")
def command(host, port, announce_host, identity_path, initial_peers):
    """Run a DHT-only peer; pass the printed multiaddr to `join`, `generate` and clients."""
    from swarmnode.bootstrap.peer import run_bootstrap
    from swarmnode.logs import setup_logging

    setup_logging()
    run_bootstrap(host, port, identity_path, validate_maddrs(initial_peers), announce_host)
