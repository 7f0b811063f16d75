"""Choosing a route of (peer, blocks) hops through the swarm: shortest estimated latency.

Pure functions on plain data, as Petals does it: a graph whose vertices are block boundaries 0..L and
whose edges are "peer p runs blocks [a, b)" for every sub-range of p's span (so a route may enter a peer
in the middle of its span), weighted by the estimated time of that hop: the measured round trip to the
peer plus (b - a) over its announced per-block throughput. Dijkstra gives the fastest route.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from swarmnode.errors import SwarmError

DEFAULT_RTT = 0.010  # seconds, for a peer not measured yet
HOP_OVERHEAD = 0.002  # seconds a hop costs beyond RTT and compute (serialisation, queueing)


@dataclass(frozen=True)
class PeerSpan:
    peer_id: str
    start: int
    end: int
    throughput: float  # tokens/s through one block
    free_cache_tokens: int
    cache_tokens: int = 0  # the peer's whole budget for this span (0: unknown)
    kind: str = "float32"  # what the peer computes in (`records.served_kind`)


@dataclass(frozen=True)
class Hop:
    """One hop of a client's route: the live peer ``peer_id`` runs blocks ``[start, end)`` of the model
    (a sub-range of what it serves). The planner's counterpart is :class:`swarmnode.planner.flow_graph.Stage`
    (a node of a placement and the blocks it runs for one request)."""

    peer_id: str
    start: int
    end: int


class NoRouteError(SwarmError, RuntimeError):
    """No chain of live peers covers the blocks a request needs.

    `permanent`: the peers that serve the missing block could never hold the session's cache, even empty,
    so waiting for sessions to end or peers to return would not help."""

    code = "no_route"

    def __init__(self, message: str, *, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


def hop_cost(span: PeerSpan, start: int, end: int, rtt: float) -> float:
    compute = (end - start) / max(span.throughput, 1e-6)
    return rtt + compute + HOP_OVERHEAD


def shortest_route(spans: Iterable[PeerSpan], start: int, end: int, *, rtts: dict[str, float] | None = None,
                   banned: frozenset[str] = frozenset(), min_cache_tokens: int = 0) -> list[Hop]:
    """The fastest chain of hops covering blocks `[start, end)`; raises NoRouteError naming the gap."""
    rtts = rtts or {}
    spans = list(spans)
    usable = [s for s in spans if s.peer_id not in banned and s.free_cache_tokens >= min_cache_tokens]
    short_of_cache = sum(1 for s in spans if s.peer_id not in banned and s.free_cache_tokens < min_cache_tokens)
    best = {start: 0.0}
    previous: dict[int, tuple[int, Hop]] = {}
    queue = [(0.0, start)]
    while queue:
        cost, block = heapq.heappop(queue)
        if block == end:
            break
        if cost > best.get(block, float("inf")):
            continue
        for span in usable:
            if not span.start <= block < span.end:
                continue
            for stop in range(block + 1, min(span.end, end) + 1):
                new_cost = cost + hop_cost(span, block, stop, rtts.get(span.peer_id, DEFAULT_RTT))
                if new_cost < best.get(stop, float("inf")):
                    best[stop] = new_cost
                    previous[stop] = (block, Hop(span.peer_id, block, stop))
                    heapq.heappush(queue, (new_cost, stop))
    if end not in best:
        reached = max(best)
        serving = [s for s in spans if s.start <= reached < s.end]
        covering = [s for s in serving if s.peer_id not in banned]
        full = [s for s in covering if s.free_cache_tokens < min_cache_tokens]
        permanent = bool(covering) and all(0 < s.cache_tokens < min_cache_tokens for s in covering)
        needed = f"needed blocks [{start}, {end})"
        if covering and len(full) == len(covering):
            most = max(s.free_cache_tokens for s in full)
            if permanent:
                biggest = max(s.cache_tokens for s in covering)
                message = (
                    f"the {len(covering)} peer(s) serving block {reached} ({needed}) can never hold this "
                    f"session's {min_cache_tokens} cache tokens (the largest cache there is {biggest} tokens): "
                    f"ask for a shorter session (fewer or shorter prompts, fewer new tokens) or start a node "
                    f"with more memory for these blocks"
                )
            else:
                message = (
                    f"every peer serving block {reached} is full ({len(full)} peer(s), {needed}; the most "
                    f"free cache is {most} tokens, this session needs {min_cache_tokens}): wait for other "
                    f"sessions to end (raise route_wait), ask for a shorter session, or start another node"
                )
        elif serving and not covering:
            message = (
                f"every peer serving block {reached} ({len(serving)} of them, {needed}) is banned by this "
                f"client after failing or answering wrongly: wait for the bans to lapse or start a node for it"
            )
        else:
            detail = f"{len(usable)} usable spans, {len(banned)} banned peers"
            if short_of_cache:
                detail += f", {short_of_cache} peers without {min_cache_tokens} free cache tokens"
            message = (
                f"no live peer serves block {reached} ({needed}; {detail}): start a node for it, wait for "
                f"one, or ask for a shorter session"
            )
        raise NoRouteError(message, permanent=permanent)
    hops: list[Hop] = []
    block = end
    while block != start:
        block, hop = previous[block]
        hops.append(hop)
    return hops[::-1]
