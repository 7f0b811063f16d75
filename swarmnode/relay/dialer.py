"""Calling peers that are reached through a relay (`relay.service`), as if they were dialled directly.

A `RelayDialer` wraps a hivemind `P2P` and offers the same two calls every RPC of the project goes through
(`call_protobuf_handler`, `iterate_protobuf_handler`). For a peer with a known relay, the call goes to the
relay's `RELAY` (unary) or `RELAY_STREAM` (stream) RPC, the node and RPC named in the request's `uid`
(`messages.relay_address`); every other call goes straight to the peer. Which peers are relayed, and by whom,
comes from their records (`learn`), or for one call from whoever names the relay (`through`: a push target).
Everything else is the wrapped `P2P`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from swarmnode import messages, rpc

MAX_KNOWN_RELAYS = 4096


class RelayDialer:
    """A `P2P` that reaches relayed peers through their relays (see the module's docstring)."""

    def __init__(self, p2p, via: dict[str, str] | None = None, override: tuple[str, str | None] | None = None):
        self.p2p = p2p
        self.via: dict[str, str] = {} if via is None else via  # peer id -> the peer id of its relay
        self.override = override  # (peer, its relay or None) that wins over `via`, for `through`

    def __getattr__(self, name: str):
        return getattr(self.p2p, name)

    def learn(self, relays: Mapping[str, str | None]) -> None:
        """Take peers' relays from their records: a peer with None is dialled directly again."""
        for peer, relay in relays.items():
            if relay is None or relay == peer:
                self.via.pop(peer, None)
            elif len(self.via) < MAX_KNOWN_RELAYS or peer in self.via:
                self.via[peer] = relay

    def relay_of(self, peer_id: str) -> str | None:
        peer = str(peer_id)
        if self.override is not None and self.override[0] == peer:
            return self.override[1]
        return self.via.get(peer)

    def through(self, peer_id: str, relay: str | None) -> RelayDialer:
        """A dialer that reaches `peer_id` through `relay` (directly when None), for calls of its own; it
        shares this one's table (a push on every decode step copies nothing)."""
        return RelayDialer(self.p2p, self.via, (peer_id, relay))

    async def call_protobuf_handler(self, peer_id: PeerID, name: str, input, output_protobuf_type):
        if isinstance(input, AsyncIterable):  # a stream that ends without its reply is an EOFError (`rpc.call_single`)
            return await rpc.call_single(self, peer_id, name, input, output_protobuf_type)
        relay = self.relay_of(peer_id)
        if relay is None:
            return await self.p2p.call_protobuf_handler(peer_id, name, input, output_protobuf_type)
        return await self.p2p.call_protobuf_handler(PeerID.from_base58(relay), rpc.RPC_RELAY,
                                                    _addressed(input, str(peer_id), name), output_protobuf_type)

    async def iterate_protobuf_handler(self, peer_id: PeerID, name: str, input, output_protobuf_type):
        relay = self.relay_of(peer_id)
        if relay is None:
            return await self.p2p.iterate_protobuf_handler(peer_id, name, input, output_protobuf_type)
        requests = input if isinstance(input, AsyncIterable) else as_aiter(input)

        async def addressed():
            first = True
            async for request in requests:
                yield _addressed(request, str(peer_id), name) if first else request
                first = False

        return await self.p2p.iterate_protobuf_handler(PeerID.from_base58(relay), rpc.RPC_RELAY_STREAM,
                                                       addressed(), output_protobuf_type)


def _addressed(request: runtime_pb2.ExpertRequest, peer_id: str, rpc: str) -> runtime_pb2.ExpertRequest:
    """A copy of `request` that names the relayed node and RPC (the caller's own object is left as it was)."""
    copy = runtime_pb2.ExpertRequest()
    copy.CopyFrom(request)
    copy.uid = messages.relay_address(peer_id, rpc)
    return copy
