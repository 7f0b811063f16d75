"""`swarmnode bootstrap`: run a DHT-only peer and print its multiaddr."""

import click

from swarmnode.cli.options import (
    address_options,
    admission_options,
    check_addresses,
    load_admission,
    validate_maddrs,
)


@click.command("bootstrap")
@address_options(default_port=31337)
@click.option("--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
              help="Private key file that keeps the peer id stable across restarts (created if missing); in a "
                   "private swarm, the identity the --invitation was issued for.")
@admission_options(identity=False)
@click.option("--initial-peers", multiple=True, metavar="MADDR", help="Other bootstrap peers to link up with.")
@click.option("--relay-service/--no-relay-service", default=True, show_default=True,
              help="Relay calls for nodes behind NAT (they reserve with this peer and are reached through it).")
def command(host, port, announce_host, identity_path, invitation, owner_key, initial_peers, relay_service):
    """Run a DHT-only peer; pass a printed multiaddr to `join`, `coordinate`, `generate` and clients (on all
    interfaces, the default: one per address of this machine, loopback last). With --owner-key (or an
    invitation) the swarm is private: it answers only peers its owner invited (`swarmnode invite`)."""
    from swarmnode.bootstrap.peer import run_bootstrap
    from swarmnode.logs import setup_logging

    peers = validate_maddrs(initial_peers)
    check_addresses(host, announce_host, port)
    from swarmnode.admission import Role

    setup_logging()
    admission = load_admission(Role.NODE, invitation, identity_path, owner_key)
    run_bootstrap(host, port, admission.identity.path if admission else identity_path, peers, announce_host,
                  relay_service, admission)
