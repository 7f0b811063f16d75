"""The client's route and the seam between transports and the session, without a swarm.

A transport is built over a `Route` and a `RouteOwner` (`client.transports`), nothing else of the session:
these tests drive one over a fake owner and fake hop streams, and check that `InferenceSession` offers every
member the owner protocol names (mypy cannot see across the `swarmnode.client` package mapping).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from swarmnode import messages
from swarmnode.client.errors import RemoteError, SessionError
from swarmnode.client.hops import Attempts, Chunk, HopStream
from swarmnode.client.route import Route
from swarmnode.client.routing import Hop
from swarmnode.client.session import InferenceSession
from swarmnode.client.swarm import ClientConfig
from swarmnode.client.transports import PrefillSplit, RelayTransport, RouteOwner


def _chunk(tokens: int, first: int = 0, value: float = 1.0) -> Chunk:
    return Chunk(torch.full((1, tokens, 4), value), torch.arange(first, first + tokens)[None],
                 torch.ones(1, tokens, dtype=torch.int64))


class FakeHop(HopStream):
    """A hop whose peer adds the number of its blocks to every hidden state; `fail` makes its next step fail."""

    def __init__(self, peer: str, start: int, end: int, fail: bool = False, full: bool = False):
        super().__init__(Hop(peer, start, end), f"session-{peer}", 16, 1)
        self.fail = fail
        self.full = full  # its cache has no room: it refuses to open the session
        self.calls: list[tuple[int, int]] = []  # (tokens sent, prefix length)
        self.closed = False

    async def step(self, p2p, chunk: Chunk, prefix_length: int, config) -> torch.Tensor:
        self.steps_sent += 1
        self.calls.append((chunk.hidden.shape[1], prefix_length))
        if self.fail:
            raise RemoteError(self.hop.peer_id, "killed")
        if self.full:
            raise RemoteError(self.hop.peer_id, "KV cache full", code=messages.ERROR_CACHE_FULL)
        return chunk.hidden + (self.hop.end - self.hop.start)

    async def close(self) -> None:
        self.closed = True


class FakeOwner:
    """A `RouteOwner` that replaces a failed hop by one named in `spares`, and records what it was asked."""

    def __init__(self, spares: dict[str, FakeHop] | None = None, splits: bool = False,
                 fresh: list[FakeHop] | None = None, route: Route | None = None, **config):
        self.p2p = None
        self.fresh = fresh or []  # the hops of a route made anew (`start_over`)
        self.route = route
        self.started_over: list[str] = []
        self.config = ClientConfig(**config)
        self.traffic = {"up": 0, "down": 0}
        self.spares = spares or {}
        self._splits = splits
        self.banned: list[str] = []
        self.checked: list[bool] = []

    def dropped(self, peer_id: str):
        return None

    def wants_check(self, first: bool) -> bool:
        self.checked.append(first)
        return False

    async def verify(self, hop, inputs, output) -> None:
        raise AssertionError("wants_check said no")

    async def fail_over(self, hop, exc, attempts: Attempts):
        attempts.failures += 1
        self.banned.append(hop.hop.peer_id)
        await hop.close()
        return [self.spares.pop(hop.hop.peer_id)]

    async def start_over(self, hop, exc, attempts: Attempts):
        self.started_over.append(hop.hop.peer_id)
        assert self.route is not None
        for each in self.route.take():
            await each.close()
        return self.fresh

    async def reroute(self, start, end, cause):
        raise AssertionError("not asked in these tests")

    def ban(self, peer_id, reason) -> None:
        self.banned.append(peer_id)

    def hold_off(self, peer_id, reason) -> None:
        pass

    def splits(self) -> bool:
        return self._splits

    async def prefill_hops(self, start, end, min_cache_tokens):
        raise AssertionError("not asked in these tests")


def test_route_names_the_next_hop_replaces_one_and_finds_those_covering_a_range():
    a, b, c = FakeHop("a", 0, 3), FakeHop("b", 3, 6), FakeHop("c", 6, 10)
    route = Route(0, 10, [a, b, c])
    assert len(route) == 3 and list(route) == [a, b, c] and route[1] is b and route.opened
    assert route.after(0) is b and route.after(2) is None and route.is_last(2) and not route.is_last(1)
    assert route.covering(2, 7) == [a, b, c] and route.covering(3, 6) == [b] and route.covering(6, 8) == [c]
    b1, b2 = FakeHop("b1", 3, 5), FakeHop("b2", 5, 6)
    route.replace(1, [b1, b2])
    assert list(route) == [a, b1, b2, c] and route.after(1) is b2
    route.keep_outputs()
    assert [h.keep_outputs for h in route] == [True, True, True, False]
    assert route.unrun()
    for hop in route:
        hop.filled = True
    assert not route.unrun()
    assert route.take() == [a, b1, b2, c] and not route.opened and len(route) == 0


def test_route_sequence_is_every_kept_input_then_this_step():
    route = Route(0, 2)
    route.inputs += [_chunk(3), _chunk(1, 3, 2.0)]
    whole = route.sequence(_chunk(2, 4, 3.0))
    assert whole.hidden.shape == (1, 6, 4) and whole.positions.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert whole.hidden[0, :, 0].tolist() == [1, 1, 1, 2, 3, 3]
    alone = _chunk(2)
    assert Route(0, 2).sequence(alone) is alone


def test_relay_transport_over_a_route_replays_a_failed_hop_into_its_replacement():
    """RelayTransport works on a Route and its owner alone: a hop that fails on the second step is replaced
    by the owner, the replacement is fed the whole sequence, and the output is the same as without failure."""
    a, b, spare = FakeHop("a", 0, 2), FakeHop("b", 2, 5), FakeHop("spare", 2, 5)
    route = Route(0, 5, [a, b])
    owner = FakeOwner({"b": spare})
    transport = RelayTransport(route, owner)

    prompt = _chunk(3)
    out = asyncio.run(transport.step(prompt, 0))
    assert torch.equal(out, prompt.hidden + 5)
    route.position += 3  # what the session does after a step

    b.fail = True
    token = _chunk(1, 3, 7.0)
    out = asyncio.run(transport.step(token, 0))
    assert torch.equal(out, token.hidden + 5)
    assert list(route) == [a, spare] and b.closed and owner.banned == ["b"]
    assert spare.calls == [(4, 0)]  # the three cached tokens replayed with this step's, from position 0
    assert spare.cached == 4 and a.calls == [(3, 0), (1, 3)]
    assert owner.checked == [True, True, False, True]  # each first step, a later one, the replay


def test_a_full_cache_on_the_first_step_gives_back_every_hop_s_room_and_starts_over():
    """A hop without room on the session's first step: the hops before it, which reserved room, are not kept
    while the session waits (sessions holding room the others wait for deadlock); the owner closes them all and
    routes the blocks anew, and the step runs on the new route from its start."""
    a, b = FakeHop("a", 0, 2), FakeHop("b", 2, 5, full=True)
    a2, b2 = FakeHop("a2", 0, 3), FakeHop("b2", 3, 5)
    route = Route(0, 5, [a, b])
    owner = FakeOwner(fresh=[a2, b2], route=route)
    prompt = _chunk(3)
    out = asyncio.run(RelayTransport(route, owner).step(prompt, 0))
    assert torch.equal(out, prompt.hidden + 5)
    assert owner.started_over == ["b"] and a.closed and b.closed and list(route) == [a2, b2]
    assert a2.calls == [(3, 0)] and b2.calls == [(3, 0)] and owner.banned == []


def test_a_full_cache_after_the_first_step_fails_that_hop_over_alone():
    """Once the session holds tokens, its hops' caches are worth keeping: a full replacement peer is one hop's
    failover, not a new route."""
    a, b, spare = FakeHop("a", 0, 2), FakeHop("b", 2, 5), FakeHop("spare", 2, 5)
    route = Route(0, 5, [a, b])
    owner = FakeOwner({"b": spare}, route=route)
    transport = RelayTransport(route, owner)
    asyncio.run(transport.step(_chunk(3), 0))
    route.position += 3
    b.full = True
    token = _chunk(1, 3, 7.0)
    assert torch.equal(asyncio.run(transport.step(token, 0)), token.hidden + 5)
    assert owner.started_over == [] and not a.closed and list(route) == [a, spare]


def test_prefill_split_asks_the_owner_whether_the_swarm_splits():
    route = Route(0, 4, [FakeHop("d", 0, 4)])
    assert not PrefillSplit(route, FakeOwner(splits=False)).wanted()
    assert PrefillSplit(route, FakeOwner(splits=True)).wanted()
    assert not PrefillSplit(route, FakeOwner(splits=True, disaggregate=False)).wanted()
    with pytest.raises(SessionError) as refused:
        PrefillSplit(route, FakeOwner(splits=False, disaggregate=True)).wanted()
    assert refused.value.code == "no_route"


def _members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def test_the_session_offers_everything_a_transport_may_ask():
    members = _members(RouteOwner)
    assert {"p2p", "config", "traffic", "fail_over", "reroute", "verify"} <= set(members)
    for name, value in members.items():
        if name == "traffic":  # a plain attribute of the session
            continue
        assert hasattr(InferenceSession, name), f"InferenceSession lacks RouteOwner.{name}"
        ours = getattr(InferenceSession, name)
        assert isinstance(ours, property) == isinstance(value, property), name
        if not isinstance(value, property):
            assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(value), name
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(value).parameters), name
