"""Starting a DHT peer the way every swarmnode process does: with the record signature validator.

Bootstrap peers, nodes, coordinators and clients all validate signed records (`swarmnode.identity`), so
a forged or overwritten record is refused where it is stored and again where it is read.
"""

from __future__ import annotations

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.identity import make_validator


def start_dht(initial_peers: list[str] | None = None, *, host: str = "127.0.0.1", port: int = 0,
              announce_host: str | None = None, identity_path: str | None = None, client_mode: bool = False,
              key: RSAPrivateKey | None = None, **kwargs) -> hivemind.DHT:
    host_maddrs = None if client_mode else [f"/ip4/{host}/tcp/{port}"]
    announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and not client_mode else None
    options = dict(num_workers=2)
    options.update(kwargs)
    return hivemind.DHT(
        initial_peers=list(initial_peers or []), start=True, host_maddrs=host_maddrs, announce_maddrs=announce,
        identity_path=identity_path, client_mode=client_mode, record_validators=[make_validator(key)], **options,
    )
