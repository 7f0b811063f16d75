"""The relay service a peer that others can dial offers to nodes that nobody can dial (behind NAT).

Why not libp2p's circuit relays: the `p2pd` that hivemind 1.1.12 bundles runs circuit relay v2 with its
default limits, 128 KiB and 2 minutes per relayed connection, which a prompt's hidden states or a long
session exceed (the connection is reset mid-call), and it never announces a `/p2p-circuit` address for a
node on a private range. So the relay is the project's own, one level up: a node behind NAT opens a
connection to a relay (`RELAY_RESERVE`, renewed by `relay.keeper`), and the relay forwards calls for that
node over that connection, where libp2p lets it open streams back to the node.

- `RELAY_RESERVE`: a reservation for `ttl` s (at most `messages.RELAY_MAX_TTL`), for at most
  `max_reservations` nodes at once; a renewal extends it.
- `RELAY` / `RELAY_STREAM`: a call for a reserved node. The request (a stream's first message) names the node
  and RPC in its `uid`; only the node RPCs of `rpc.RELAYED_UNARY` / `RELAYED_STREAM` are forwarded, and
  the `uid` the node receives is the caller's peer id (the node trusts it from its relay only). A stream is
  relayed message by message both ways until either side ends it; when the caller goes away the relayed
  stream to the node is closed too. At most `max_streams` streams per node are open at once.
- `REACH_CHECK`: a TCP connection to each of the caller's addresses, which must answer as a libp2p listener
  does (multistream-select's header): whether the caller can be dialled (`relay.reachability`). At most
  `REACH_RATE` checks a minute per caller, each address tried for `REACH_TIMEOUT` s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import AsyncIterator

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.admission import AdmissionError
from swarmnode.errors import SwarmError
from swarmnode.messages import (
    ReachCheck,
    ReachReply,
    RelayReply,
    RelayReserve,
    error_response,
    pack_metadata,
    unpack_metadata,
)
from swarmnode.naming import short_id

logger = logging.getLogger(__name__)

ERROR_NOT_RELAYED = "not_relayed"
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p TCP listener sends first
REACH_TIMEOUT = 3.0
REACH_RATE = 6  # checks a minute per caller


class RelayRefused(SwarmError, RuntimeError):
    """A relayed call this relay does not forward: the node holds no reservation here, or too many calls
    are open to it."""

    code = ERROR_NOT_RELAYED


class RelayService:
    """Reservations and forwarding for nodes behind NAT, and reachability checks (see the module's docstring)."""

    def __init__(self, *, max_reservations: int = 64, max_streams: int = 256):
        self.max_reservations = max_reservations
        self.max_streams = max_streams
        self.reservations: dict[str, float] = {}  # node peer id -> when its reservation lapses (monotonic)
        self.streams: dict[str, int] = {}  # node peer id -> relayed streams open to it
        self.forwarded = 0  # calls forwarded, unary and streams
        self._checks: dict[str, list[float]] = {}  # caller -> times of its recent reachability checks
        self.p2p: P2P | None = None  # set by `register`, before any call comes
        self.gate: rpc.Gate | None = None  # a private swarm's: callers need the roles of the RPC they have forwarded

    async def register(self, p2p: P2P, gate: rpc.Gate | None = None) -> None:
        """Offer the service on `p2p` (a plain hivemind `P2P`: forwarded calls go straight to the node); in a
        private swarm only to callers `gate` admits."""
        self.p2p, self.gate = p2p, gate
        await rpc.register(p2p, self, rpc.RELAY_RPCS, gate=gate)

    # --- reservations --------------------------------------------------------------------------------
    def reserved(self) -> list[str]:
        now = time.monotonic()
        for peer in [p for p, until in self.reservations.items() if until <= now]:
            del self.reservations[peer]
            logger.info("reservation of %s lapsed: no longer relaying for it", short_id(peer))
        return list(self.reservations)

    async def rpc_reserve(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            ask = unpack_metadata(request.metadata, RelayReserve)
        except messages.ProtocolError as exc:
            return error_response(str(exc), exc.code)
        peer = str(context.remote_id)
        if peer not in self.reserved() and len(self.reservations) >= self.max_reservations:
            return error_response(f"this relay serves {self.max_reservations} nodes already: reserve with another",
                                  ERROR_NOT_RELAYED)
        if peer not in self.reservations:
            logger.info("relaying for %s (reserved for %.0f s)", short_id(peer), ask.ttl)
        self.reservations[peer] = time.monotonic() + ask.ttl
        return runtime_pb2.ExpertResponse(metadata=pack_metadata(RelayReply(ttl=ask.ttl)))

    async def _target(self, uid: str, allowed: frozenset[str], caller: str) -> tuple[str, str]:
        peer, name = messages.parse_relay_address(uid, allowed)
        if peer not in self.reserved():
            raise RelayRefused(f"peer {short_id(peer)} holds no reservation at this relay: read its records again "
                               f"(it may have moved to another relay)")
        if self.gate is not None:  # the node trusts this relay's word: the relay checks the caller's roles for it
            reason = await self.gate.refusal(caller, rpc.ROLES_BY_NAME[name])
            if reason is not None:
                raise AdmissionError(reason)
        return peer, name

    def _registered(self) -> P2P:
        """The P2P the service was registered on: calls come only through it."""
        assert self.p2p is not None, "calls come once `register` has run"
        return self.p2p

    # --- forwarding ----------------------------------------------------------------------------------
    async def rpc_relay(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            peer, name = await self._target(request.uid, rpc.RELAYED_UNARY, str(context.remote_id))
        except SwarmError as exc:
            return error_response(str(exc), exc.code)
        forwarded = runtime_pb2.ExpertRequest()
        forwarded.CopyFrom(request)
        forwarded.uid = str(context.remote_id)
        self.forwarded += 1
        try:
            return await self._registered().call_protobuf_handler(PeerID.from_base58(peer), name, forwarded,
                                                        runtime_pb2.ExpertResponse)
        except Exception as exc:  # safe: whatever failed on the way to the node is reported to the caller
            return error_response(f"the relay could not reach {short_id(peer)}: {type(exc).__name__}: {exc}",
                                  ERROR_NOT_RELAYED)

    async def rpc_relay_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                               context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        try:
            peer, name = await self._target(first.uid, rpc.RELAYED_STREAM, str(context.remote_id))
            if self.streams.get(peer, 0) >= self.max_streams:
                raise RelayRefused(f"{self.max_streams} relayed streams are open to {short_id(peer)} already")
        except SwarmError as exc:
            yield error_response(str(exc), exc.code)
            await rpc.read_to_end(requests)  # the refusal is not lost to a reset stream
            return
        first.uid = str(context.remote_id)

        async def forwarded():
            yield first
            async for request in requests:
                request.uid = ""  # only the first message names the caller
                yield request

        self.streams[peer] = self.streams.get(peer, 0) + 1
        self.forwarded += 1
        responses = None
        try:
            responses = await self._registered().iterate_protobuf_handler(PeerID.from_base58(peer), name, forwarded(),
                                                                          runtime_pb2.ExpertResponse)
            async for response in responses:
                yield response
        except Exception as exc:  # safe: the node's stream broke; the caller gets why, then the end
            yield error_response(f"the relayed stream to {short_id(peer)} broke: {type(exc).__name__}: {exc}",
                                 ERROR_NOT_RELAYED)
        finally:
            self.streams[peer] -= 1
            if not self.streams[peer]:
                del self.streams[peer]
            if responses is not None:
                await responses.aclose()  # closes the stream to the node, also when the caller went away

    # --- reachability --------------------------------------------------------------------------------
    async def rpc_reach_check(self, request: runtime_pb2.ExpertRequest,
                              context: P2PContext) -> runtime_pb2.ExpertResponse:
        caller = str(context.remote_id)
        now = time.monotonic()
        recent = [t for t in self._checks.get(caller, []) if now - t < 60.0]
        if len(recent) >= REACH_RATE:
            return error_response(f"more than {REACH_RATE} reachability checks a minute: slow down")
        self._checks[caller] = [*recent, now]
        if len(self._checks) > 1024:
            for stale in list(self._checks)[: len(self._checks) - 1024]:
                del self._checks[stale]
        try:
            ask = unpack_metadata(request.metadata, ReachCheck)
            addresses = [_tcp_address(m) for m in ask.maddrs]
        except messages.ProtocolError as exc:
            return error_response(str(exc), exc.code)
        errors = []
        for (host, port), maddr in zip(addresses, ask.maddrs):
            error = await libp2p_answers(host, port, REACH_TIMEOUT)
            if error is None:
                return runtime_pb2.ExpertResponse(metadata=pack_metadata(ReachReply(reachable=True, address=maddr)))
            errors.append(f"{host}:{port}: {error}")
        return runtime_pb2.ExpertResponse(metadata=pack_metadata(ReachReply(reachable=False,
                                                                            why_not="; ".join(errors)[:1000])))


def _tcp_address(maddr: str) -> tuple[str, int]:
    """(host, port) of an `/ip4/A/tcp/P[/p2p/ID]` multiaddr; ProtocolError for anything else."""
    parts = str(maddr).split("/")
    try:
        if len(parts) < 5 or parts[0] or parts[1] != "ip4" or parts[3] != "tcp":
            raise ValueError
        host, port = ipaddress.IPv4Address(parts[2]), int(parts[4])
        if not 0 < port < 65536 or host.is_unspecified or host.is_multicast:
            raise ValueError
    except ValueError:
        raise messages.ProtocolError(f"{str(maddr)[:80]!r} is not an address to dial: /ip4/A/tcp/PORT") from None
    return str(host), port


async def libp2p_answers(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to host:port opens within `timeout` s and a libp2p listener answers there
    (it sends multistream-select's header first); else what happened instead."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        header = await asyncio.wait_for(reader.read(len(MULTISTREAM_HEADER)), timeout)
    except asyncio.TimeoutError:
        return "no answer"
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    return None if header == MULTISTREAM_HEADER else "something answers, but not a libp2p peer"
