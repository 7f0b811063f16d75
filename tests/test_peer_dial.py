"""Dialing an initial peer again says why it could not be joined (`swarmnode.peer_dial`), against real `p2pd`
daemons on loopback: the right peer, a peer with another id, another program, a closed port; and a node started
with a wrong peer id is refused at once with the id that answers there."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from hivemind.p2p import P2P

from swarmnode import dht
from swarmnode.peer_dial import DialOutcome, classify, dial
from swarmnode.testing.other_program import http_port


@pytest.fixture(scope="module")
def peer():
    """A running libp2p peer: its address, and another valid peer id that is not its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(60)

    listening = run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    stranger = run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    address = str(run(listening.get_visible_maddrs())[0])
    yield address, str(stranger.peer_id), str(listening.peer_id)
    run(stranger.shutdown())
    run(listening.shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture()
def other_program():
    """A TCP port where an HTTP server answers: something listens there, but not libp2p."""
    with http_port() as port:
        yield port


def _with_id(address: str, peer_id: str) -> str:
    return f"{address.rsplit('/p2p/', 1)[0]}/p2p/{peer_id}"


def test_the_named_peer_connects(peer):
    address, _, _ = peer
    assert dial(address).outcome is DialOutcome.CONNECTED


def test_another_peer_id_is_named_with_the_id_that_answers(peer):
    address, stranger, own = peer
    result = dial(_with_id(address, stranger))
    assert result.outcome is DialOutcome.WRONG_PEER, result
    assert result.peer_id == own, result


def test_another_program_and_a_closed_port_are_told_apart(peer, other_program):
    _, stranger, _ = peer
    assert dial(f"/ip4/127.0.0.1/tcp/{other_program}/p2p/{stranger}").outcome is DialOutcome.NOT_A_PEER
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # bound, then released: nothing listens there
    assert dial(f"/ip4/127.0.0.1/tcp/{port}/p2p/{stranger}").outcome is DialOutcome.REFUSED


@pytest.mark.parametrize("address", ["/ip4/127.0.0.1/tcp/4000", "not an address", "/ip4/127.0.0.1/tcp/1/p2p/xyz"])
def test_an_address_without_a_valid_peer_id_is_invalid(address):
    assert dial(address).outcome is DialOutcome.INVALID


def test_the_daemon_s_words_are_sorted():
    prefix = "Connect failed. msg=failed to dial: failed to dial Qm1: all dials failed\n  * [/ip4/10.0.0.1/tcp/1] "
    assert classify("a", prefix + "dial tcp4 10.0.0.1:1: i/o timeout").outcome is DialOutcome.TIMED_OUT
    assert classify("a", prefix + "context deadline exceeded").outcome is DialOutcome.TIMED_OUT
    assert classify("a", prefix + "dial tcp4 10.0.0.1:1: connect: no route to host").outcome is DialOutcome.REFUSED


def test_a_wrong_peer_id_fails_the_start_at_once_and_names_the_id_that_answers(peer):
    address, stranger, own = peer
    with pytest.raises(dht.DHTStartError) as raised:
        dht.start_dht([_with_id(address, stranger)])
    assert raised.value.code == "not_a_peer"
    assert own in str(raised.value) and "swarmnode bootstrap" in str(raised.value), str(raised.value)
