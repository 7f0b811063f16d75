"""`swarmnode identity`: make (or read) a peer's identity file and print its peer id and public key."""

from __future__ import annotations

import json

import click


@click.command("identity")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, default=False, help="Print one JSON object.")
def command(path, as_json):
    """Make the identity file PATH when it does not exist (an RSA key: a peer started with `--identity PATH`
    keeps its peer id), and print its peer id and public key: what a private swarm's owner invites
    (`swarmnode invite --for`)."""
    from swarmnode.identity import PeerIdentity, public_key_text

    identity = PeerIdentity.load_or_create(path)
    data = {"path": path, "peer_id": identity.peer_id, "public_key": public_key_text(identity.key)}
    if as_json:
        click.echo(json.dumps(data))
    else:
        click.echo(f"peer id     {data['peer_id']}\npublic key  {data['public_key']}\n"
                   f"(the owner of a private swarm invites it with: swarmnode invite --for {path} --role ROLE)")
