"""Why an initial peer could not be joined: dial it once with a bare libp2p daemon and read the daemon's reason.

A DHT peer's `p2pd` that reaches none of its initial peers stops with one sentence, "failed to connect to
bootstrap peers", whatever the cause. The causes call for different answers: an address whose `/p2p/` id is
not the id of the peer listening there, or a port where another program answers, are the user's to fix and
no retry helps; a peer that answers but was too busy to finish the handshake in time (a loaded machine, 28
nodes starting at once on 2 cores) is worth trying again. `dial` starts a `p2pd` with no initial peers of its
own (about 0.3 s), asks it to connect to the address, and sorts the daemon's error into a `DialOutcome`.
"""

from __future__ import annotations

import asyncio
import enum
import re
import threading
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

DIAL_TIMEOUT = 20.0  # seconds for the whole dial, the daemon's own start included

_MISMATCH = re.compile(r"peer id mismatch: expected \S+, but remote key matches (\S+)")


class DialOutcome(enum.Enum):
    """What dialing an initial peer's address found."""

    CONNECTED = "connected"  # the named peer answered: an earlier failure was passing (load, a slow start)
    WRONG_PEER = "wrong_peer"  # a libp2p peer answers there, but with another peer id than the address names
    NOT_A_PEER = "not_a_peer"  # something answers on the port, but does not speak libp2p's handshake
    REFUSED = "refused"  # nothing listens on the port, or the host cannot be reached
    TIMED_OUT = "timed_out"  # no answer in time: a busy peer, or a network that drops packets
    INVALID = "invalid"  # the address has no `/p2p/` peer id, or cannot be parsed


@dataclass(frozen=True)
class DialResult:
    """A dial's outcome; `peer_id` is the id that answered when it is not the one the address names."""

    address: str
    outcome: DialOutcome
    detail: str = ""
    peer_id: str | None = None


def dial(address: str, timeout: float = DIAL_TIMEOUT) -> DialResult:
    """Dial `address` (`/ip4/A/tcp/P/p2p/ID`) from a fresh `p2pd` and say what answered.

    Runs its own event loop in a thread of its own, so it may be called from any thread, one with a running
    loop included."""
    box: list[DialResult] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(_dial(address, timeout))),
                              name="swarmnode-peer-dial", daemon=True)
    thread.start()
    thread.join(timeout + 10)
    return box[0] if box else DialResult(address, DialOutcome.TIMED_OUT, "the dial did not finish")


async def _dial(address: str, timeout: float) -> DialResult:
    try:
        maddr = Multiaddr(address)
        peer_id = PeerID.from_base58(maddr.value_for_protocol("p2p"))
        target = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
    except Exception as exc:  # safe: any parse failure is the address's, and is reported as such
        return DialResult(address, DialOutcome.INVALID, str(exc))
    p2p = await P2P.create(dht_mode="client")
    try:
        await asyncio.wait_for(p2p._client.connect(peer_id, [target]), timeout)
        return DialResult(address, DialOutcome.CONNECTED)
    except asyncio.TimeoutError:
        return DialResult(address, DialOutcome.TIMED_OUT, f"no answer within {timeout:.0f} s")
    except Exception as exc:  # safe: the daemon's ControlFailure; its text is sorted below
        return classify(address, str(exc))
    finally:
        await p2p.shutdown()


def classify(address: str, error: str) -> DialResult:
    """Sort a `p2pd` dial error's text into a `DialOutcome` (go-libp2p's wording, as `p2pd` passes it on)."""
    mismatch = _MISMATCH.search(error)
    if mismatch:
        return DialResult(address, DialOutcome.WRONG_PEER, error, peer_id=mismatch.group(1))
    lowered = error.lower()
    if "timeout" in lowered or "deadline exceeded" in lowered:
        return DialResult(address, DialOutcome.TIMED_OUT, error)
    if "failed to negotiate security protocol" in lowered or "protocols not supported" in lowered:
        return DialResult(address, DialOutcome.NOT_A_PEER, error)
    return DialResult(address, DialOutcome.REFUSED, error)
