"""Starting a DHT peer the way every swarmnode process does: with the record signature validator.

Bootstrap peers, nodes, coordinators and clients all validate signed records (`swarmnode.identity`), so
a forged or overwritten record is refused where it is stored and again where it is read.
"""

from __future__ import annotations

import hivemind
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.identity import make_validator


def start_dht(initial_peers: list[str] | None = None, *, host: str = "127.0.0.1", port: int = 0,
              announce_host: str | None = None, identity_path: str | None = None, client_mode: bool = False,
              key: RSAPrivateKey | None = None, **kwargs) -> hivemind.DHT:
    host_maddrs = None if client_mode else [f"/ip4/{host}/tcp/{port}"]
    announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and not client_mode else None
    options = dict(num_workers=2)
    options.update(kwargs)
    peers = list(initial_peers or [])
    try:
        return hivemind.DHT(
            initial_peers=peers, start=True, host_maddrs=host_maddrs, announce_maddrs=announce,
            identity_path=identity_path, client_mode=client_mode, record_validators=[make_validator(key)], **options,
        )
    except P2PDaemonError as exc:
        raise DHTStartError(_explain(str(exc), peers, host_maddrs)) from None


class DHTStartError(RuntimeError):
    """The DHT peer could not start: the message says why and what to do (no initial peer answered, the
    address is taken, the daemon did not come up)."""


def _explain(message: str, initial_peers: list[str], host_maddrs: list[str] | None) -> str:
    if "failed to connect to bootstrap peers" in message:
        return (f"could not reach any initial peer ({', '.join(initial_peers)}): check the address (the one "
                f"`swarmnode bootstrap` printed) and that the peer is running and reachable from here")
    if "address already in use" in message.lower():
        return f"cannot listen on {', '.join(host_maddrs or [])}: the address is in use; pick another --port"
    return f"the P2P daemon could not start: {message}"
