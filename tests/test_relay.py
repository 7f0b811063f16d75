"""Relays for nodes behind NAT (`swarmnode.relay`), with real hivemind peers on loopback, in this process.

The REAL `BlockHandler` of `test_handler_fuzz` (a tiny random llama, blocks [0, 2)) is served by a real `p2pd`
peer (the *node*), which reserves with a relay peer (`RelayService`) through `RelayKeeper`; a third peer (the
*client*) calls it through the relay with a `RelayDialer`. On loopback the client could dial the node itself:
the relay's counters and the caller the node sees show that the calls went through the relay. Checked: unary
calls and a whole inference stream give what the node gives directly; the node sees the client, not the
relay, as the caller (so kept outputs stay the client's); a caller that leaves mid-stream frees the node's
session; calls for a node without a reservation, malformed addresses and relay RPCs are refused with a reason;
a reachability check tells a libp2p listener from a closed port and from another program; a node whose relay
dies reserves with the next one, and is reached through it.
"""

# ruff: noqa: F401, F811  (`node` is test_handler_fuzz's fixture, imported for pytest to find: tests take it by name)
from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from test_handler_fuzz import (
    ANY_SMALL,
    FUZZ,
    GARBAGE_BYTES,
    SERVED,
    assert_at_rest,
    broken_map,
    check_session,
    context,
    node,
    opening,
    pack,
    peer,
    request,
    session_requests,
)

from swarmnode import messages, rpc
from swarmnode.relay.dialer import RelayDialer
from swarmnode.relay.keeper import RelayKeeper
from swarmnode.relay.service import ERROR_NOT_RELAYED, RelayService


async def _peer(initial: list[str] | None = None) -> P2P:
    return await P2P.create(initial_peers=initial or [], host_maddrs=["/ip4/127.0.0.1/tcp/0"])


async def _maddrs(p2p: P2P) -> list[str]:
    return [f"{m}/p2p/{p2p.peer_id}" if "/p2p/" not in str(m) else str(m) for m in await p2p.get_visible_maddrs()]


@contextlib.asynccontextmanager
async def bed(node, relays: int = 1):
    """Relay peers, a node peer serving `node.handler` and reserved with the first relay, and a client peer
    that reaches the node through it: (relays as (p2p, service)), node p2p, keeper, client dialer)."""
    peers = []
    try:
        services = []
        for _ in range(relays):
            p2p = await _peer()
            peers.append(p2p)
            service = RelayService()
            await service.register(p2p)
            services.append((p2p, service))
        first = await _maddrs(services[0][0])
        node_p2p = await _peer(first)
        peers.append(node_p2p)
        await node.handler.register(node_p2p)

        def changed(relay):
            node.handler.relay = relay

        keeper = RelayKeeper(node_p2p, _listing([str(p.peer_id) for p, _ in services]), on_change=changed, renew=0.3)
        assert await keeper.acquire() == str(services[0][0].peer_id)
        client_p2p = await _peer(first)
        peers.append(client_p2p)
        client = RelayDialer(client_p2p)
        client.learn({str(node_p2p.peer_id): keeper.relay})
        yield services, node_p2p, keeper, client
    finally:
        node.handler.relay = None
        for p2p in peers:
            with contextlib.suppress(Exception):
                await p2p.shutdown()


def _listing(peers: list[str]):
    async def candidates() -> list[str]:
        return list(peers)

    return candidates


def _info(response: runtime_pb2.ExpertResponse) -> messages.InfoReply:
    assert messages.response_error(response) is None, messages.response_error(response)
    return messages.unpack_metadata(response.metadata, messages.InfoReply)


def test_unary_and_stream_calls_go_through_the_relay_as_the_caller(node):
    chunks = [[torch.randn(1, 5, 64), torch.arange(5)[None], torch.ones(1, 5, dtype=torch.int64)],
              [torch.randn(1, 1, 64), torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.int64)]]
    sid = "relayed-session"

    async def run():
        async with bed(node) as ([(_, service)], node_p2p, _keeper, client):
            target = node_p2p.peer_id
            info = _info(await client.call_protobuf_handler(target, rpc.RPC_INFO, runtime_pb2.ExpertRequest(),
                                                            runtime_pb2.ExpertResponse))
            assert service.forwarded == 1 and info.spans[0].start == SERVED[0]
            seen = {}
            queue: asyncio.Queue = asyncio.Queue()
            for item in session_requests(opening(sid, SERVED, 1, 16), chunks, carry_first=True):
                queue.put_nowait(item)

            async def requests():
                while (item := await queue.get()) is not None:
                    yield item

            stream = await client.iterate_protobuf_handler(target, rpc.RPC_INFERENCE, requests(),
                                                           runtime_pb2.ExpertResponse)
            replies = [await anext(stream), await anext(stream)]
            seen["caller"] = node.handler.sessions[sid].caller  # open: the node names its opener
            queue.put_nowait(None)
            replies += [r async for r in stream]
            return replies, seen, str(client.p2p.peer_id), service

    replies, seen, client_id, service = asyncio.run(run())
    check_session(node, SERVED, chunks, replies)
    assert seen["caller"] == client_id  # not the relay's id: kept outputs stay the client's
    assert service.forwarded == 2 and service.streams == {}
    assert_at_rest(node)


def test_caller_leaving_a_relayed_stream_frees_the_node_session(node):
    async def run():
        async with bed(node) as (_, node_p2p, _keeper, client):
            hold = asyncio.Event()

            async def requests():
                yield request({"session": opening("left", SERVED, 1, 16)})
                await hold.wait()

            stream = await client.iterate_protobuf_handler(node_p2p.peer_id, rpc.RPC_INFERENCE, requests(),
                                                           runtime_pb2.ExpertResponse)
            reader = asyncio.create_task(anext(stream))
            for _ in range(100):
                if "left" in node.handler.sessions:
                    break
                await asyncio.sleep(0.05)
            assert "left" in node.handler.sessions
            reader.cancel()  # the caller goes away
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await stream.aclose()
            for _ in range(100):
                if not node.handler.sessions:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(run())
    assert_at_rest(node)


def test_relay_refuses_what_it_must_not_forward(node):
    async def run():
        async with bed(node) as ([(relay_p2p, service)], node_p2p, _keeper, client):
            raw = client.p2p
            relay = relay_p2p.peer_id

            async def unary(uid: str, metadata: bytes = b"") -> runtime_pb2.ExpertResponse:
                return await raw.call_protobuf_handler(relay, rpc.RPC_RELAY, runtime_pb2.ExpertRequest(
                    uid=uid, metadata=metadata), runtime_pb2.ExpertResponse)

            stranger = str(raw.peer_id)  # a well-formed peer id with no reservation at this relay
            out = {
                "no reservation": await unary(messages.relay_address(stranger, rpc.RPC_PING)),
                "no address": await unary(""),
                "not a peer id": await unary("notapeer swarmnode.ping"),
                "relay rpc": await unary(messages.relay_address(str(node_p2p.peer_id), rpc.RPC_RELAY)),
                "stream rpc as unary": await unary(messages.relay_address(str(node_p2p.peer_id),
                                                                          rpc.RPC_INFERENCE)),
            }
            async def stream(uid: str) -> list[runtime_pb2.ExpertResponse]:
                return [r async for r in await raw.iterate_protobuf_handler(
                    relay, rpc.RPC_RELAY_STREAM, runtime_pb2.ExpertRequest(uid=uid), runtime_pb2.ExpertResponse)]

            # a refused stream is read to its end before it closes: the reason is never lost to a reset
            streamed = [await stream(messages.relay_address(stranger, rpc.RPC_INFERENCE)) for _ in range(30)]
            service.max_streams = 0
            full = await stream(messages.relay_address(str(node_p2p.peer_id), rpc.RPC_INFERENCE))
            service.max_streams = 256
            bad_ttl = await raw.call_protobuf_handler(relay, rpc.RPC_RELAY_RESERVE, runtime_pb2.ExpertRequest(
                metadata=messages.pack_metadata({"ttl": 10_000.0})), runtime_pb2.ExpertResponse)
            return out, streamed, full, bad_ttl, service.forwarded

    out, streamed, full, bad_ttl, forwarded = asyncio.run(run())
    assert forwarded == 0
    assert messages.response_error_code(out["no reservation"]) == ERROR_NOT_RELAYED
    assert "holds no reservation" in messages.response_error(out["no reservation"])
    assert "must name the peer" in messages.response_error(out["no address"])
    assert "is not a libp2p peer id" in messages.response_error(out["not a peer id"])
    for case in ("relay rpc", "stream rpc as unary"):
        assert "is not an RPC this relay forwards this way" in messages.response_error(out[case]), case
    for replies in streamed:
        assert len(replies) == 1 and messages.response_error_code(replies[0]) == ERROR_NOT_RELAYED
    assert len(full) == 1 and "0 relayed streams are open to" in messages.response_error(full[0])
    assert "ttl" in messages.response_error(bad_ttl)


def test_a_node_sees_its_relay_callers_only_through_its_relay():
    relay, client, other = (str(PeerID(b"\x00$\x08\x01\x12 " + bytes([i]) * 32)) for i in (1, 2, 3))
    assert messages.relayed_caller(relay, client, relay) == client  # named by its own relay: trusted
    assert messages.relayed_caller(other, client, relay) == other  # anyone else naming a caller: ignored
    assert messages.relayed_caller(relay, "", relay) == relay
    assert messages.relayed_caller(other, client, None) == other  # a node with no relay trusts no uid


def test_reach_check_tells_a_libp2p_listener_from_a_closed_port_and_another_program():
    async def run():
        helper, asker = await _peer(), None
        try:
            service = RelayService()
            await service.register(helper)
            asker = await _peer(await _maddrs(helper))
            listening = [str(m) for m in await asker.get_visible_maddrs()]
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                closed_port = closed.getsockname()[1]  # bound, never listening: connections are refused
                other = await asyncio.start_server(lambda r, w: (w.write(b"HTTP/1.1 400 Bad\r\n\r\n"), w.close()),
                                                   "127.0.0.1", 0)
                other_port = other.sockets[0].getsockname()[1]

                async def check(maddrs) -> runtime_pb2.ExpertResponse:
                    return await asker.call_protobuf_handler(
                        helper.peer_id, rpc.RPC_REACH_CHECK,
                        runtime_pb2.ExpertRequest(metadata=messages.pack_metadata({"maddrs": maddrs})),
                        runtime_pb2.ExpertResponse)

                replies = {
                    "listener": await check(listening),
                    "closed": await check([f"/ip4/127.0.0.1/tcp/{closed_port}"]),
                    "other": await check([f"/ip4/127.0.0.1/tcp/{other_port}"]),
                    "bad": await check(["/dns/example.com/tcp/80"]),
                    "unspecified": await check(["/ip4/0.0.0.0/tcp/80"]),
                }
                other.close()
            more = [await check(listening) for _ in range(3)]  # 7 checks in a minute: the last is refused
            return replies, more
        finally:
            for p2p in (helper, asker):
                if p2p is not None:
                    await p2p.shutdown()

    replies, more = asyncio.run(run())

    def reach(reply) -> messages.ReachReply:
        assert messages.response_error(reply) is None, messages.response_error(reply)
        return messages.unpack_metadata(reply.metadata, messages.ReachReply)

    assert reach(replies["listener"]).reachable is True
    closed = reach(replies["closed"])
    assert closed.reachable is False and "refused" in closed.why_not.lower(), closed
    other = reach(replies["other"])
    assert other.reachable is False and "not a libp2p peer" in other.why_not, other
    for case in ("bad", "unspecified"):
        assert "is not an address to dial" in messages.response_error(replies[case]), case
    assert "slow down" in messages.response_error(more[-1])


def test_node_whose_relay_dies_reserves_with_the_next_and_is_reached_through_it(node):
    async def run():
        async with bed(node, relays=2) as ([(first, _), (second, second_service)], node_p2p, keeper, client):
            changes = []
            keeper.on_change = lambda relay: (changes.append(relay), setattr(node.handler, "relay", relay))
            await _peer_connect(node_p2p, second)
            stop = asyncio.Event()
            running = asyncio.create_task(keeper.run(stop))
            await first.shutdown()  # the relay goes away
            for _ in range(100):
                if keeper.relay == str(second.peer_id):
                    break
                await asyncio.sleep(0.1)
            client.learn({str(node_p2p.peer_id): keeper.relay})  # as a client reading the node's new record
            await _peer_connect(client.p2p, second)
            info = _info(await client.call_protobuf_handler(node_p2p.peer_id, rpc.RPC_INFO,
                                                            runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse))
            stop.set()
            await running
            return changes, str(second.peer_id), second_service.forwarded, info

    changes, second_id, forwarded, info = asyncio.run(run())
    assert changes == [None, second_id]
    assert forwarded == 1 and info.spans[0].end == SERVED[1]


async def _peer_connect(p2p: P2P, other: P2P) -> None:
    """Make sure `p2p` knows how to dial `other` (peers of this test find each other by address only)."""
    from hivemind.utils.multiaddr import Multiaddr

    addresses = [Multiaddr(str(m).split("/p2p/")[0]) for m in await other.get_visible_maddrs()]
    await p2p._client.connect(other.peer_id, addresses)


# --- every field of the relay's RPCs, fuzzed at the edge ---------------------------------------------------

UIDS = st.one_of(
    st.text(max_size=80),
    st.builds(lambda p, rpc: f"{p} {rpc}", st.text(max_size=140), st.sampled_from(sorted(
        rpc.RELAYED_UNARY | rpc.RELAYED_STREAM | {rpc.RPC_RELAY, rpc.RPC_RELAY_STREAM, "x"}))),
    st.builds(lambda i, rpc: f"{peer(i)} {rpc}", st.integers(1, 50), st.text(max_size=30)),
)


@settings(max_examples=150, **FUZZ)
@given(data=st.data())
def test_relay_handlers_refuse_malformed_requests_with_a_reason(data):
    """Reservations with broken metadata, reachability checks with broken or hostile addresses, and relayed
    calls with any `uid` are answered with an error naming what was wrong; nothing is reserved or forwarded."""
    service = RelayService()
    service.reservations[str(peer(7))] = float("inf")  # one reserved node, reached through a P2P that is None
    kind = data.draw(st.sampled_from(["reserve", "reach", "relay", "relay_stream"]))
    caller = peer(data.draw(st.integers(100, 200)))
    if kind == "reserve":
        meta = data.draw(st.one_of(
            broken_map({"ttl": 10.0}),
            st.builds(lambda v: pack({"ttl": v}), st.one_of(ANY_SMALL, st.floats(allow_nan=True), st.just(1e9),
                                                            st.just(0.0), st.just(-1.0), st.just(float("inf"))))))
        if meta == pack({"ttl": 10.0}) or (isinstance(meta, bytes) and _valid_ttl(meta)):
            return
        reply = asyncio.run(service.rpc_reserve(request(meta), context(rpc.RPC_RELAY_RESERVE, caller)))
        assert messages.response_error(reply), reply
        assert str(caller) not in service.reservations
    elif kind == "reach":
        maddrs = data.draw(st.one_of(
            st.lists(st.text(max_size=40), max_size=10),
            st.lists(st.sampled_from(["/ip4/0.0.0.0/tcp/1", "/ip4/224.0.0.1/tcp/80", "/ip4/1.2.3.4/tcp/0",
                                      "/ip4/1.2.3.4/tcp/70000", "/ip6/::1/tcp/80", "/ip4/1.2.3/tcp/80",
                                      "ip4/1.2.3.4/tcp/80"]), min_size=1, max_size=3),
            st.lists(st.just("/ip4/127.0.0.1/tcp/9"), min_size=9, max_size=12)))
        meta = data.draw(st.one_of(st.just(pack({"maddrs": maddrs})), broken_map({"maddrs": ["/ip4/127.0.0.1/tcp/9"]})))
        reply = asyncio.run(service.rpc_reach_check(request(meta), context(rpc.RPC_REACH_CHECK, caller)))
        assert messages.response_error(reply), reply  # nothing here is dialled: every case is refused up front
    else:
        uid = data.draw(UIDS)
        stream = kind == "relay_stream"
        allowed = rpc.RELAYED_STREAM if stream else rpc.RELAYED_UNARY
        try:
            target, _rpc = messages.parse_relay_address(uid, allowed)
            if target == str(peer(7)):
                return  # a well-formed call for the reserved node: forwarded (the p2p is None here)
        except messages.ProtocolError:
            pass
        message = runtime_pb2.ExpertRequest(uid=uid, metadata=data.draw(GARBAGE_BYTES))
        if stream:
            async def one():
                yield message

            replies = asyncio.run(_collect(service.rpc_relay_stream(one(), context(rpc.RPC_RELAY_STREAM,
                                                                                    caller))))
            assert len(replies) == 1 and messages.response_error(replies[0]), replies
        else:
            reply = asyncio.run(service.rpc_relay(message, context(rpc.RPC_RELAY, caller)))
            assert messages.response_error(reply), reply
        assert service.forwarded == 0 and service.streams == {}


def _valid_ttl(meta: bytes) -> bool:
    try:
        messages.unpack_metadata(meta, messages.RelayReserve)
        return True
    except messages.ProtocolError:
        return False


async def _collect(stream) -> list:
    return [item async for item in stream]
