"""Reading a swarm's state the way any peer can: DHT records and a node's `info` RPC.

:class:`SwarmReader` is one client-mode DHT peer (with its P2P replica) on a background loop. Local swarms
(`swarmnode.testing.local_swarm`) keep one for their whole life and wait on it, so readiness is what the
swarm itself says (a node's state and spans, the coordinator's lease, the placement), never the wording of
a log. The plain functions below read the `swarmnode status --json` dict (`SwarmReader.status`, or
:func:`client_status` through a client's own DHT peer) and say whether a planned swarm has settled and
which blocks survive a node's loss.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarmnode import rpc
from swarmnode.client.errors import TRANSPORT_ERRORS
from swarmnode.naming import short_id
from swarmnode.relay.dialer import RelayDialer
from swarmnode.testing.errors import NodeInfoError, SwarmTimeoutError

if TYPE_CHECKING:
    from hivemind import DHT

    from swarmnode.client.loop import LoopThread

__all__ = [
    "UNREACHABLE",
    "SwarmReader",
    "can_lose",
    "client_status",
    "node_info",
    "serving_replicas",
    "settled",
    "wait_cache_free",
]


# What a P2P call raises while the peer is not up yet (or no longer): no daemon route to it, a refused
# stream, an unregistered handler, a timeout. Callers that poll catch these and try again.
UNREACHABLE = (*TRANSPORT_ERRORS, asyncio.TimeoutError)


class SwarmReader:
    """A client-mode DHT peer of the swarm serving `model`, for reading its records and calling `info`.

    Started once and shut down with :meth:`close`; every call is bounded by a timeout. `trusted` are the
    coordinator keys whose placements and leases count (a local swarm's own key).
    """

    def __init__(self, model, initial_peers: list[str], trusted: frozenset[str], *, dht_prefix: str | None = None,
                 timeout: float = 60.0, admission=None):
        from swarmnode.client.loop import LoopThread
        from swarmnode.dht import start_dht
        from swarmnode.records import model_prefix
        from swarmnode.runtime.sources import open_checkpoint

        checkpoint = open_checkpoint(model)
        self.num_blocks = checkpoint.num_blocks
        self.prefix = dht_prefix or model_prefix(checkpoint.name)
        self.trusted = trusted
        self.loop: LoopThread | None = None
        self.p2p: RelayDialer | None = None
        # the DHT process is forked before this process starts the loop's thread, as the client does
        # in a private swarm (`admission`: the owner's, in tests) the reader is a member; `members` filters records
        self.dht: DHT | None = start_dht(list(initial_peers), client_mode=True, startup_timeout=timeout,
                                         admission=admission,
                                         key=admission.identity.key if admission is not None else None)
        self.members = None
        try:
            self.loop = loop = LoopThread("swarmnode-testing-reader")
            self.p2p = RelayDialer(loop.run(self.dht.replicate_p2p(), timeout))
            if admission is not None:
                from swarmnode.membership import Membership

                self.members = Membership(self.dht, admission, admission.identity.key)
                loop.run(self.members.start(), timeout)
                # published and read every heartbeat while the reader lives (the future keeps the task referenced)
                self._members_run = asyncio.run_coroutine_threadsafe(self.members.run(), loop.loop)
        except BaseException:
            self.close()
            raise

    def _open(self) -> tuple[LoopThread, RelayDialer, DHT]:
        """The loop, P2P client and DHT peer, which the reader holds from `__init__` until `close`."""
        assert self.loop is not None and self.p2p is not None and self.dht is not None, "the reader is closed"
        return self.loop, self.p2p, self.dht

    # --- DHT records ---------------------------------------------------------------------------------
    def state(self, timeout: float = 60.0):
        """A :class:`swarmnode.swarm_state.SwarmState` snapshot: nodes, servers, placement, leases, reports."""
        from swarmnode.swarm_state import read_state

        loop, _, dht = self._open()
        if self.members is not None:
            loop.run(self.members.refresh(), timeout)
        return loop.run(read_state(dht, self.prefix, self.num_blocks, self.trusted, self.members), timeout)

    def status(self, timeout: float = 60.0) -> dict:
        """The `swarmnode status --json` dict of the swarm: placement, leases, every node's record, replicas."""
        loop, _, dht = self._open()
        return _status(loop, dht, self.prefix, self.num_blocks, self.trusted, timeout, self.members)

    def placement(self, trusted: frozenset[str] | None = None, timeout: float = 30.0):
        """The newest placement signed by one of `trusted` (default: the reader's keys), or None."""
        from swarmnode.swarm_state import read_placement

        keys = self.trusted if trusted is None else trusted
        loop, _, dht = self._open()
        return loop.run(read_placement(dht, self.prefix, keys), timeout)

    def lease_holders(self, timeout: float = 30.0) -> list[str]:
        """Peer ids holding an unexpired trusted coordinator lease, newest term first."""
        from swarmnode.swarm_state import read_leases

        loop, _, dht = self._open()
        return [s.lease.holder for s in loop.run(read_leases(dht, self.prefix, self.trusted), timeout)]

    # --- a node's own answer -------------------------------------------------------------------------
    def info(self, peer_id: str, timeout: float = 10.0) -> dict:
        """The node's `info` reply (`swarmnode.messages.InfoReply` as a dict: state, spans, cache tokens).
        Raises one of :data:`UNREACHABLE` while the node is not reachable, :class:`NodeInfoError` when it
        answers with an error. A node behind NAT is asked through the relay its record names."""
        from swarmnode.swarm_state import read_nodes

        loop, p2p, dht = self._open()
        records = loop.run(read_nodes(dht, self.prefix), timeout)
        p2p.learn({p: r.relay for p, r in records.items()})
        return loop.run(_call_info(p2p, peer_id, timeout), timeout + 5)

    def try_info(self, peer_id: str, timeout: float = 5.0) -> dict | None:
        """:meth:`info`, or None while the node cannot be reached (not up yet, or gone)."""
        try:
            return self.info(peer_id, timeout)
        except UNREACHABLE:
            return None

    def maddrs(self, peer_id: str, timeout: float = 10.0) -> list[str]:
        """Multiaddrs (with `/p2p/ID`) at which this reader's daemon reached `peer_id`; empty when it has no
        connection to it (call :meth:`info` first to make one)."""

        loop, p2p, _ = self._open()

        async def addresses() -> list[str]:
            for peer in await p2p.list_peers():
                if peer.peer_id.to_base58() == peer_id:
                    return [f"{addr}/p2p/{peer_id}" for addr in peer.addrs]
            return []

        return loop.run(addresses(), timeout)

    # --- waiting -------------------------------------------------------------------------------------
    def wait_status(self, check: Callable[[dict], bool], timeout: float = 120.0, period: float = 0.5) -> dict:
        """Read :meth:`status` until `check(status)` holds and return that status; raise
        :class:`SwarmTimeoutError` with the last status read when it does not within `timeout` s."""
        return wait_until_status(self.status, check, timeout, period)

    def close(self) -> None:
        """Shut the P2P replica, the DHT peer (and its p2pd) and the loop down; safe to call twice."""
        if self.p2p is not None:
            assert self.loop is not None, "the P2P client runs on the loop"
            try:
                self.loop.run(self.p2p.shutdown(), timeout=10)
            except UNREACHABLE:  # the daemon is already gone: nothing left to close
                pass
            self.p2p = None
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


async def _call_info(p2p, peer_id: str, timeout: float) -> dict:
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from swarmnode import messages

    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), rpc.RPC_INFO, runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse),
        timeout)
    error = messages.response_error(response)
    if error is not None:
        raise NodeInfoError(f"info from {short_id(peer_id)} failed: {error}")
    return messages.unpack_metadata(response.metadata, messages.InfoReply).model_dump()


def _as_json(data: dict) -> dict:
    """`data` exactly as `swarmnode status --json` prints it (tuples become lists)."""
    return json.loads(json.dumps(data))


def wait_until_status(read: Callable[[], dict], check: Callable[[dict], bool], timeout: float,
                      period: float) -> dict:
    """Call `read()` until `check` holds on what it returns (bounded by `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        status = read()
        if check(status):
            return status
        if time.monotonic() > deadline:
            raise SwarmTimeoutError(f"the swarm did not reach the expected state in {timeout:.0f} s: "
                                    f"{json.dumps(status)[:3000]}")
        time.sleep(period)


# --- through a client's own DHT peer --------------------------------------------------------------------


def client_status(remote, timeout: float = 60.0) -> dict:
    """The `swarmnode status --json` dict, read through the DHT peer of `remote` (a
    `DistributedModelForCausalLM`): cheap enough to poll while clients generate."""
    view = remote.swarm
    return _status(view.loop, view.dht, view.prefix, view.num_blocks, view.config.trusted_coordinators, timeout)


def _status(loop, dht, prefix: str, num_blocks: int, trusted: frozenset[str], timeout: float,
            members=None) -> dict:
    """The swarm's records read through `dht`, in the `swarmnode status --json` shape (in a private swarm, as
    its `members` see them)."""
    from swarmnode.swarm_state import read_state, state_dict

    state = loop.run(read_state(dht, prefix, num_blocks, trusted, members), timeout)
    return _as_json(state_dict(state, num_blocks, prefix))


def node_info(remote, peer_id: str, timeout: float = 30.0) -> dict:
    """A node's `info` reply (state, spans, `cache_tokens`, `free_cache_tokens`, ...) through the P2P of
    `remote`, a `DistributedModelForCausalLM`."""
    return remote.swarm.loop.run(_call_info(remote.swarm.p2p, peer_id, timeout), timeout + 5)


def wait_cache_free(remote, expected: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
    """Poll the nodes' `free_cache_tokens` until each equals `expected[peer]` (peers free a closed session's
    cache asynchronously) or `timeout` s pass; the last values read."""
    deadline = time.monotonic() + timeout
    while True:
        free = {peer: node_info(remote, peer)["free_cache_tokens"] for peer in expected}
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.25)


# --- reading a planned swarm's state (`status` dicts) ----------------------------------------------------


def settled(status: dict[str, Any], peers: set[str]) -> bool:
    """Every node in `peers` is assigned by the placement and serves exactly its assignment, which is within
    what it offers (`max_blocks`: else the coordinator re-plans it), no block is uncovered, and the placement
    assigns no one else."""
    placement = status["placement"]
    if placement is None or status["uncovered_blocks"]:
        return False
    for peer in peers:
        node = status["nodes"].get(peer)
        if node is None or peer not in placement["assignments"]:
            return False
        start, end = placement["assignments"][peer]
        if node["serving"] != [placement["assignments"][peer]] or end - start > node["max_blocks"]:
            return False
    return set(placement["assignments"]) <= peers


def serving_replicas(status: dict[str, Any], peers: set[str]) -> list[int]:
    """Replicas per block counting only the online nodes in `peers` (records of a node that died stay in the
    DHT until they expire: pass the peers known to be alive)."""
    replicas = [0] * status["num_blocks"]
    for peer in peers:
        node = status["nodes"].get(peer)
        if node is None or node["state"] != "online":
            continue
        served: set[int] = set()
        for start, end in node["serving"]:
            served.update(range(start, end))
        for block in served:
            replicas[block] += 1
    return replicas


def can_lose(status: dict[str, Any], peers: set[str], victim: str) -> bool:
    """Whether every block keeps an online replica among `peers` without `victim`: losing it leaves the swarm
    able to serve the whole model while the coordinator re-plans."""
    return min(serving_replicas(status, peers - {victim}), default=0) > 0
