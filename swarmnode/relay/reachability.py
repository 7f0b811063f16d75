"""Whether peers on other machines can dial this node, asked of the swarm before the node joins it.

A node behind NAT (or a firewall) can dial out but cannot be dialled: it must serve through a relay
(`relay.keeper`) and run its DHT peer in client mode, or other peers would keep trying to reach it. As Petals
does, the node asks: a short-lived libp2p peer listens where the node will listen (same address, same port)
and asks the initial peers (`REACH_CHECK`, `relay.service`) to open a TCP connection to the addresses the node
would announce. Reachable when any initial peer got through; not reachable when every one that answered
could not; unknown when none answered (peers of a version without the check): the node then serves directly
and says so. A swarm on one machine (initial peers on loopback) is reachable without asking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from swarmnode import messages, rpc

logger = logging.getLogger(__name__)

CHECK_TIMEOUT = 10.0  # seconds for the whole check


@dataclass(frozen=True)
class Reachability:
    reachable: bool | None  # None: nobody could say
    detail: str  # what the peers answered, for the log
    seconds: float


def peer_ids(maddrs: list[str]) -> list[str]:
    """The peer ids of multiaddrs that end in `/p2p/ID`, in order, once each."""
    ids = []
    for maddr in maddrs:
        peer = str(maddr).rsplit("/p2p/", 1)[-1] if "/p2p/" in str(maddr) else None
        if peer and peer not in ids:
            ids.append(peer)
    return ids


def check(initial_peers: list[str], *, host: str, port: int, announce: list[str]) -> Reachability:
    """Ask the initial peers whether `announce` (hosts) at `port` can be dialled (see the module's docstring);
    a peer listens on `host`:`port` meanwhile, so `port` must be free and not 0."""
    from swarmnode.dht import is_loopback, maddr_host

    began = time.monotonic()
    hosts = [maddr_host(m) for m in initial_peers]
    if hosts and all(h is not None and is_loopback(h) for h in hosts):
        return Reachability(True, "the swarm is on this machine", 0.0)
    try:
        return asyncio.run(asyncio.wait_for(_ask(initial_peers, host, port, announce, began), CHECK_TIMEOUT))
    except asyncio.TimeoutError:
        return Reachability(None, f"no answer within {CHECK_TIMEOUT:.0f} s", time.monotonic() - began)
    except Exception as exc:  # safe: an unknown answer; joining the DHT right after reports a real problem
        return Reachability(None, f"{type(exc).__name__}: {exc}", time.monotonic() - began)
    finally:
        _wait_free(host, port)


def _wait_free(host: str, port: int, timeout: float = 5.0) -> None:
    """Wait until the check's daemon has let go of `port`, which the node listens on next."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError:
                time.sleep(0.1)


async def _ask(initial_peers: list[str], host: str, port: int, announce: list[str], began: float) -> Reachability:
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import runtime_pb2

    temp = await P2P.create(initial_peers=initial_peers, host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                            announce_maddrs=[f"/ip4/{a}/tcp/{port}" for a in announce], use_relay=False,
                            auto_nat=False, nat_port_map=False, dht_mode="client")
    try:
        request = runtime_pb2.ExpertRequest(metadata=messages.pack_metadata(messages.ReachCheck(
            maddrs=[f"/ip4/{a}/tcp/{port}" for a in announce][: messages.MAX_REACH_ADDRESSES])))

        async def ask(peer: str) -> messages.ReachReply | str:
            try:
                response = await temp.call_protobuf_handler(PeerID.from_base58(peer), rpc.RPC_REACH_CHECK,
                                                            request, runtime_pb2.ExpertResponse)
                error = messages.response_error(response)
                return error if error is not None else messages.unpack_metadata(response.metadata,
                                                                                messages.ReachReply)
            except Exception as exc:  # safe: that peer could not say; the others may
                return f"{type(exc).__name__}: {str(exc)[:200]}"

        peers = peer_ids(initial_peers)
        answers = await asyncio.gather(*(ask(p) for p in peers))
    finally:
        await temp.shutdown()
    seconds = time.monotonic() - began
    replies = [a for a in answers if isinstance(a, messages.ReachReply)]
    detail = "; ".join(f"{p[-8:]}: " + (("reached " + (a.address or "")) if isinstance(a, messages.ReachReply)
                                         and a.reachable else (a.why_not or "") if isinstance(a, messages.ReachReply)
                                         else a) for p, a in zip(peers, answers))
    if any(r.reachable for r in replies):
        return Reachability(True, detail, seconds)
    if replies:
        return Reachability(False, detail, seconds)
    return Reachability(None, detail, seconds)
