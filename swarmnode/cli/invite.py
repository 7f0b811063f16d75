"""`swarmnode invite`: the owner of a private swarm admits a peer's key, in some roles, until a time."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import click

from swarmnode.admission import Role

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `3600s`, `2w` in seconds."""
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a duration: write a positive number and a unit, e.g. 30d, 12h, "
                                 f"90m (s, m, h, d or w)", param_hint="--expires")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def invited_key(spec: str) -> str:
    """The public key `--for` names: an `ssh-rsa ...` line, an identity file, or a file holding one key line."""
    from swarmnode.identity import KeyFileError, load_identity_key, public_key_text

    spec = spec.strip()
    if spec.startswith("ssh-rsa "):
        return " ".join(spec.split()[:2])
    path = Path(spec)
    if not path.is_file():
        raise click.BadParameter(f"{spec!r} is neither an `ssh-rsa ...` public key nor a file",
                                 param_hint="--for")
    data = path.read_bytes()
    if data.lstrip().startswith(b"ssh-rsa "):
        return " ".join(data.decode(errors="replace").split()[:2])
    try:
        return public_key_text(load_identity_key(str(path)))
    except KeyFileError as exc:
        raise click.BadParameter(f"{spec}: {exc}", param_hint="--for") from None


@click.command("invite")
@click.option("--for", "for_", required=True, metavar="KEY|FILE",
              help="The invited peer's public key (`ssh-rsa ...`, as `swarmnode identity FILE` prints it), its "
                   "identity file, or a file holding the key line.")
@click.option("--role", "roles", multiple=True, required=True, type=click.Choice([r.value for r in Role]),
              help="What the peer may do: node (serve blocks), client (generate), coordinator (plan); repeatable.")
@click.option("--expires", default="30d", show_default=True, metavar="DURATION",
              help="How long the invitation lasts: 30d, 12h, 90m, 2w, ...")
@click.option("--owner-key", default=None, type=click.Path(dir_okay=False),
              help="The swarm's owner key (PEM; default: this machine's swarm key, created if missing).")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write the invitation to this file (mode 0600) instead of printing it.")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print one JSON object.")
def command(for_, roles, expires, owner_key, out, as_json):
    """Sign an invitation to this private swarm for one peer's key. Give it to the peer, which starts with
    `--invitation` and `--identity` (the identity file the key is from)."""
    from swarmnode.admission import Invitation
    from swarmnode.identity import default_swarm_key_path, load_or_create_private_key, load_private_key

    seconds = parse_duration(expires)
    public_key = invited_key(for_)
    key = load_private_key(owner_key) if owner_key else load_or_create_private_key(default_swarm_key_path())
    invitation = Invitation.issue(key, public_key, [Role(r) for r in roles], time.time() + seconds)
    text = invitation.text()
    if out:
        path = Path(out)
        path.write_text(text + "\n")
        path.chmod(0o600)
    data = {**invitation.describe(), **({"file": out} if out else {"invitation": text})}
    if as_json:
        click.echo(json.dumps(data))
        return
    if not out:
        click.echo(text)
    d = invitation.describe()
    click.echo(f"invited peer {d['peer_id']} as {', '.join(d['roles'])} until {d['expires']}"
               + (f"; written to {out}" if out else ""), err=True)
