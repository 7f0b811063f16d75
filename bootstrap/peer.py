"""A DHT-only peer with a stable identity: the address other peers pass as `--initial-peers`.

It serves no blocks: it keeps the DHT reachable and relays calls for nodes behind NAT (`swarmnode.relay`). With `--identity FILE` its peer id survives
restarts, so the multiaddr handed to operators stays valid. On all interfaces (the default) it prints one
multiaddr per non-loopback address of this machine, for peers on other machines, then its loopback one,
for peers on this machine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

logger = logging.getLogger(__name__)


def run_bootstrap(host: str, port: int, identity_path: str | None = None, initial_peers: list[str] | None = None,
                  announce_host: str | None = None, relay_service: bool = True, admission=None) -> None:
    """Serve as a bootstrap peer until SIGINT/SIGTERM; `admission` (`swarmnode.admission.Admission`): of a
    private swarm, whose DHT messages and relay calls it then takes from admitted peers only."""
    from swarmnode.dht import start_dht

    dht = start_dht(initial_peers or [], host=host, port=port, announce_host=announce_host,
                    identity_path=identity_path, admission=admission, key=_records_key(admission))
    stop = threading.Event()

    def on_signal(signum, _frame):
        logger.info("%s received: stopping the bootstrap peer", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        logger.info("bootstrap peer %s is up", dht.peer_id)
        for maddr in printed_maddrs([str(a) for a in dht.get_visible_maddrs()], host):
            print(f"--initial-peers {maddr}", flush=True)
        if admission is not None:
            logger.info("private swarm: answering only peers admitted by owner key %s", admission.owner[:60])
        asyncio.run(_serve(dht, relay_service, stop, admission))
    finally:
        dht.shutdown()


async def _serve(dht, relay_service: bool, stop: threading.Event, admission=None) -> None:
    """Offer relay service to nodes behind NAT (`swarmnode.relay.service`) until `stop` is set; in a private
    swarm, keep its members' view (and publish this peer's invitation) meanwhile."""
    members = reading = None
    if admission is not None:
        from swarmnode.membership import Membership

        members = Membership(dht, admission, _records_key(admission))
        await members.start()
        reading = asyncio.get_running_loop().create_task(members.run())
    if relay_service and not stop.is_set():
        from swarmnode.relay.service import RelayService

        await RelayService().register(await dht.replicate_p2p(), gate=members)
        logger.info("relaying calls for nodes behind NAT (--no-relay-service turns it off)")
    while not stop.is_set():
        await asyncio.sleep(0.2)
    if reading is not None:
        reading.cancel()


def _records_key(admission):
    """The key a bootstrap signs its records with: the owner's when it holds it (it then keeps the owner's
    revocation list stored), else its identity's; None in a public swarm (a key of its own)."""
    if admission is None:
        return None
    return admission.owner_key if admission.owner_key is not None else admission.identity.key


def printed_maddrs(visible: list[str], host: str) -> list[str]:
    """What the bootstrap prints for its users: the addresses it announces (non-loopback first) and, when it
    listens on all interfaces, its loopback address last, which it listens on without announcing it."""
    from swarmnode.dht import ALL_INTERFACES, is_loopback, maddr_host

    def loopback(maddr: str) -> bool:
        address = maddr_host(maddr)
        return address is not None and is_loopback(address)

    result = [m for m in visible if not loopback(m)] + [m for m in visible if loopback(m)]
    if host == ALL_INTERFACES and visible and not any(loopback(m) for m in result):
        tail = visible[0].split("/", 3)[3]  # "tcp/PORT/p2p/ID"
        result.append(f"/ip4/127.0.0.1/{tail}")
    return result
