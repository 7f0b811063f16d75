"""A DHT-only peer with a stable identity: the address other peers pass as `--initial-peers`.

It serves no blocks; it only keeps the DHT reachable. With `--identity FILE` its peer id survives
restarts, so the multiaddr handed to operators stays valid.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


def run_bootstrap(host: str, port: int, identity_path: str | None = None, initial_peers: list[str] | None = None,
                  announce_host: str | None = None) -> None:
    from swarmnode.dht import start_dht

    dht = start_dht(initial_peers or [], host=host, port=port, announce_host=announce_host,
                    identity_path=identity_path)
    stop = threading.Event()

    def on_signal(signum, _frame):
        logger.info("%s received: stopping the bootstrap peer", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        logger.info("bootstrap peer %s is up", dht.peer_id)
        for maddr in maddrs:
            print(f"--initial-peers {maddr}", flush=True)
        stop.wait()
    finally:
        dht.shutdown()
