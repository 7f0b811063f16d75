"""`swarmnode revoke`: the owner of a private swarm takes peers' admission back, swarm-wide, within a heartbeat."""

from __future__ import annotations

import json

import click

from swarmnode.cli.options import initial_peers_option, validate_maddrs


@click.command("revoke")
@click.argument("peer_ids", nargs=-1)
@initial_peers_option(required=True)
@click.option("--owner-key", default=None, type=click.Path(dir_okay=False),
              help="The swarm's owner key (PEM; default: this machine's swarm key).")
@click.option("--restore", is_flag=True, default=False,
              help="Take the listed peers off the revocation list instead (their invitations count again).")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print one JSON object.")
def command(peer_ids, initial_peers, owner_key, restore, as_json):
    """Revoke PEER_IDS: every member refuses their calls and ignores their records from its next heartbeat,
    and clients move open sessions off them. With no PEER_IDS, print the revocation list. The list is kept
    beside the owner key (`KEY.revoked.json`) too: a bootstrap started with that key stores it again every
    heartbeat, so it outlives the peers that held it."""
    import asyncio

    from swarmnode.admission import Admission, Role
    from swarmnode.dht import start_dht
    from swarmnode.identity import default_swarm_key_path
    from swarmnode.messages import check_peer_id

    for peer in peer_ids:
        try:
            check_peer_id(peer)
        except ValueError as exc:
            raise click.BadParameter(f"{peer!r}: {exc}", param_hint="PEER_IDS") from None
    peers = validate_maddrs(initial_peers)
    path = owner_key or str(default_swarm_key_path())
    admission = Admission.load(Role.COORDINATOR, owner_key=path)
    assert admission is not None and admission.owner_key is not None, "an owner key gives an admission"
    dht = start_dht(peers, client_mode=True, admission=admission, key=admission.owner_key)
    try:
        revoked = asyncio.run(_update(dht, admission, set(peer_ids), restore))
    finally:
        dht.shutdown()
    data = {"revoked": sorted(revoked), "changed": sorted(peer_ids), "restored": restore}
    if as_json:
        click.echo(json.dumps(data))
    else:
        click.echo(f"{len(revoked)} peers revoked" + "".join(f"\n  {p}" for p in sorted(revoked)))


async def _update(dht, admission, peer_ids: set[str], restore: bool) -> frozenset[str]:
    """The revocation list with `peer_ids` added (or taken off), from the newest of the owner's local copy and
    the swarm's; written to both (the swarm's copy is kept stored by the owner's bootstrap)."""
    import os

    from hivemind.utils import get_dht_time

    from swarmnode.errors import SwarmError
    from swarmnode.identity import owner_marker
    from swarmnode.membership import Membership
    from swarmnode.records import REVOCATION_TTL, RevocationRecord, revoked_key

    members = Membership(dht, admission, admission.owner_key)
    await members.refresh()
    if not peer_ids:
        return members.revoked
    revoked = (members.revoked - peer_ids) if restore else (members.revoked | peer_ids)
    record = RevocationRecord(peers=sorted(revoked), updated=max(get_dht_time(), members.revoked_updated + 1e-3))
    path = admission.revocations_file
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(record.to_dict()))
    temporary.chmod(0o600)
    temporary.replace(path)
    stored = await dht.store(revoked_key(members.swarm), subkey=owner_marker(admission.owner_key),
                             value=record.to_dict(), expiration_time=get_dht_time() + REVOCATION_TTL,
                             return_future=True)
    if not stored:
        raise SwarmError(f"no peer of the swarm stored the revocation list (kept in {path}): check --initial-peers "
                         f"and run the command again", code="revoke_failed")
    return frozenset(revoked)
