"""Per-request pipelines: Helix's IWRR request scheduler with KV-cache high-water masking.

Helix (ASPLOS 2025) §5.1: every vertex of the topology graph (the coordinator and each node) gets a
weighted round-robin scheduler over its successors, weighted by the flow on each connection in the max
flow solution; a request's pipeline is built hop by hop from the coordinator until the last block is
done, so requests follow the max flow without bursts. Picks use the smooth weighted round-robin of
:mod:`planner.swrr`, the rule the simulator uses too (successors in name order, ties to the first), so
the simulator routes the same requests the same way.

§5.2: the scheduler estimates each node's KV-cache use from the requests it has sent there (input length
plus the average output length) and masks nodes above a high-water mark until requests finish. A node is
also skipped when no unmasked path leads from it to the last block.

Everything is plain data: build a :class:`RoutingTable` from a placement and its max-flow
:class:`~planner.flow_graph.Evaluation`, keep a :class:`RouterState` (and optionally a
:class:`KVTracker`), and call :func:`route` per request. No I/O; the network client wraps this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .cluster.spec import Cluster
from .costs.roofline import CostParams, kv_bytes_per_token, kv_free_bytes
from .errors import PlannerError
from .flow_graph import SINK, SOURCE, Evaluation, Stage
from .swrr import smooth_pick

__all__ = [
    "DEFAULT_HIGH_WATER",
    "KVTracker",
    "RouterState",
    "RoutingTable",
    "kv_capacity_bytes",
    "next_hop",
    "route",
]

DEFAULT_HIGH_WATER = 0.9
_EPS = 1e-9


@dataclass(frozen=True)
class RoutingTable:
    """Next-hop weights per vertex (:data:`SOURCE` or a node id -> {node id or :data:`SINK`: weight})
    and each node's block range. The order of a vertex's successors is the order its picks break ties
    in (:meth:`from_flows` sorts them by name)."""

    weights: Mapping[str, Mapping[str, float]]
    ranges: Mapping[str, tuple[int, int]]
    num_blocks: int

    @classmethod
    def from_flows(
        cls,
        placement: Mapping[str, tuple[int, int]],
        flows: Mapping[str, Mapping[str, float]],
        num_blocks: int,
    ) -> RoutingTable:
        weights = {
            u: {v: float(f) for v, f in sorted(targets.items()) if f > _EPS}
            for u, targets in flows.items()
            if any(f > _EPS for f in targets.values())
        }
        return cls(weights=weights, ranges={n: (r[0], r[1]) for n, r in placement.items()}, num_blocks=num_blocks)

    @classmethod
    def from_evaluation(
        cls, placement: Mapping[str, tuple[int, int]], evaluation: Evaluation, num_blocks: int
    ) -> RoutingTable:
        return cls.from_flows(placement, evaluation.flows, num_blocks)

    def to_dict(self) -> dict:
        return {
            "weights": {u: dict(t) for u, t in self.weights.items()},
            "ranges": {n: list(r) for n, r in self.ranges.items()},
            "num_blocks": self.num_blocks,
        }

    def reachable(self, masked: Iterable[str] = ()) -> set[str]:
        """Vertices from which :data:`SINK` can be reached without entering a masked node."""
        masked = set(masked)
        preds: dict[str, list[str]] = {}
        for u, targets in self.weights.items():
            for v in targets:
                preds.setdefault(v, []).append(u)
        seen = {SINK}
        stack = [SINK]
        while stack:
            v = stack.pop()
            for u in preds.get(v, ()):
                if u not in seen and u not in masked:
                    seen.add(u)
                    stack.append(u)
        return seen


@dataclass
class RouterState:
    """Smooth weighted round-robin counters, one map per vertex (mutated by :func:`next_hop`)."""

    current: dict[str, dict[str, float]] = field(default_factory=dict)


def next_hop(
    table: RoutingTable, state: RouterState, at: str, *, allowed: Iterable[str] | None = None
) -> str | None:
    """Pick the next vertex after ``at`` by smooth weighted round-robin over its successors (only those
    in ``allowed`` when given); None when no successor is allowed."""
    candidates = table.weights.get(at, {})
    if not candidates:
        return None
    ok = None if allowed is None else set(allowed).__contains__
    return smooth_pick(candidates, state.current.setdefault(at, {}), ok)


def route(
    table: RoutingTable,
    state: RouterState,
    *,
    kv_load: Mapping[str, float] | None = None,
    high_water: float = DEFAULT_HIGH_WATER,
) -> list[Stage] | None:
    """Build one request's pipeline from the coordinator to the last block.

    ``kv_load`` maps nodes to their estimated KV-cache use as a fraction of capacity (e.g.
    :meth:`KVTracker.load`); nodes above ``high_water`` are masked. Returns the stages (node and the
    blocks ``[start, end)`` it runs for this request), or None when every path crosses a masked node
    (the request should wait for running requests to finish)."""
    masked = {n for n, load in (kv_load or {}).items() if load > high_water}
    alive = table.reachable(masked)
    if SOURCE not in alive:
        return None
    stages: list[Stage] = []
    at = SOURCE
    position = 0
    for _ in range(len(table.ranges) + 1):
        nxt = next_hop(table, state, at, allowed=alive)
        if nxt is None:
            return None
        if nxt == SINK:
            return stages if position >= table.num_blocks else None
        end = table.ranges[nxt][1]
        stages.append(Stage(node=nxt, start=position, end=end))
        position = end
        at = nxt
    return None


def kv_capacity_bytes(
    cluster: Cluster, placement: Mapping[str, tuple[int, int]], params: CostParams = CostParams()
) -> dict[str, float]:
    """Bytes each placed node has for KV cache next to its blocks (:func:`~planner.costs.roofline.kv_free_bytes`:
    the same room the cost model and the simulator count)."""
    return {n: kv_free_bytes(cluster, cluster.node(n), e - s, params) for n, (s, e) in placement.items()}


@dataclass
class KVTracker:
    """Helix §5.2's KV-cache estimate: a request reserves ``(input + average output) x KV bytes per token
    x blocks it runs`` on every node of its pipeline until :meth:`release`."""

    capacity: dict[str, float]
    kv_bytes_per_token_block: float
    avg_output_tokens: float
    used: dict[str, float] = field(default_factory=dict)
    requests: dict[str, list[tuple[str, float]]] = field(default_factory=dict)

    @classmethod
    def for_cluster(
        cls, cluster: Cluster, placement: Mapping[str, tuple[int, int]], params: CostParams = CostParams()
    ) -> KVTracker:
        return cls(
            capacity=kv_capacity_bytes(cluster, placement, params),
            kv_bytes_per_token_block=kv_bytes_per_token(cluster.model),
            avg_output_tokens=cluster.workload.avg_output_tokens,
        )

    def admit(self, request_id: str, pipeline: Iterable[Stage], input_tokens: int) -> None:
        if request_id in self.requests:
            raise PlannerError(f"request {request_id!r} is already admitted", code="already_admitted")
        tokens = input_tokens + self.avg_output_tokens
        held = []
        for stage in pipeline:
            amount = tokens * self.kv_bytes_per_token_block * (stage.end - stage.start)
            self.used[stage.node] = self.used.get(stage.node, 0.0) + amount
            held.append((stage.node, amount))
        self.requests[request_id] = held

    def release(self, request_id: str) -> None:
        for node, amount in self.requests.pop(request_id, []):
            self.used[node] = max(0.0, self.used.get(node, 0.0) - amount)

    def load(self) -> dict[str, float]:
        """Estimated KV use per node as a fraction of its capacity (inf for a node with none)."""
        return {
            n: (self.used.get(n, 0.0) / cap if cap > 0 else float("inf")) for n, cap in self.capacity.items()
        }
