"""The call helpers of `swarmnode.rpc` over two real libp2p peers on 127.0.0.1.

A stream RPC whose peer ends the stream without its reply (it died or dropped the call half-way) must raise
`EOFError`, one of the client's `TRANSPORT_ERRORS` that a session fails over on; hivemind itself raises a bare
`ValueError` from `asingle` there, which once failed a request outright when a node was killed during a push.
The same holds through a `RelayDialer` (the client's and the nodes' way of calling peers), and a stream that
answers twice is refused the same way. A stream that answers once returns its reply.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarmnode import rpc
from swarmnode.client.errors import TRANSPORT_ERRORS
from swarmnode.relay.dialer import RelayDialer

SILENT, TWICE, ECHO = "test.silent", "test.twice", "test.echo"


@pytest.fixture(scope="module")
def peers():
    """A caller and a peer with three stream handlers: one that ends without a reply, one that answers twice,
    one that echoes the request's uid."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(60)

    async def silent(requests, context):
        async for _ in requests:
            break
        return
        yield  # an async generator that yields nothing

    async def twice(requests, context):
        async for request in requests:
            yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())
            yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())
            return

    async def echo(requests, context):
        async for request in requests:
            yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())
            return

    callee = run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    for name, handler in ((SILENT, silent), (TWICE, twice), (ECHO, echo)):
        run(callee.add_protobuf_handler(name, handler, runtime_pb2.ExpertRequest, stream_input=True,
                                        stream_output=True))
    caller = run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            initial_peers=[str(a) for a in run(callee.get_visible_maddrs())]))
    try:
        yield run, caller, callee
    finally:
        run(caller.shutdown())
        run(callee.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def _one(request):
    yield request


@pytest.mark.parametrize("name", [SILENT, TWICE])
@pytest.mark.parametrize("through", ["p2p", "dialer"])
def test_a_stream_without_exactly_one_reply_is_a_transport_error(peers, name, through):
    run, caller, callee = peers
    p2p = caller if through == "p2p" else RelayDialer(caller)
    with pytest.raises(EOFError, match="the peer stopped or dropped the call") as caught:
        if through == "p2p":
            run(rpc.call_streamed(p2p, str(callee.peer_id), name, runtime_pb2.ExpertRequest(uid="x")))
        else:
            run(p2p.call_protobuf_handler(callee.peer_id, name, _one(runtime_pb2.ExpertRequest(uid="x")),
                                          runtime_pb2.ExpertResponse))
    assert isinstance(caught.value, TRANSPORT_ERRORS)
    expected = "0 replies" if name == SILENT else "2 replies"  # it stops reading at the second
    assert expected in str(caught.value)


def test_a_stream_with_one_reply_returns_it(peers):
    run, caller, callee = peers
    reply = run(rpc.call_streamed(caller, str(callee.peer_id), ECHO, runtime_pb2.ExpertRequest(uid="hello")))
    assert reply.metadata == b"hello"
    reply = run(RelayDialer(caller).call_protobuf_handler(callee.peer_id, ECHO,
                                                          _one(runtime_pb2.ExpertRequest(uid="again")),
                                                          runtime_pb2.ExpertResponse))
    assert reply.metadata == b"again"
