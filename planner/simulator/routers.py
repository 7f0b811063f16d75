"""How the simulator routes a request: the pipeline a request follows through a plan's servers.

Three routers, one per kind of plan, each answering ``route(request, free)`` with a :class:`Route` or None
when no server with room for the request's KV cache can take it now (Helix §5.2: servers without room are
masked out of the choice; the request waits at the coordinator):

- :class:`FlowRouter` (a node-level placement): one IWRR scheduler per vertex of Helix's flow graph,
  weighted by the max-flow edge flows, the pipeline built hop by hop from the coordinator (Helix §5.1);
- :class:`PipelineRouter` (HexGen replicas): a whole fixed pipeline chosen by IWRR over the replicas'
  capacities (HexGen App. C);
- :class:`DisaggregatedRouter` (HexGen-2): a prefill replica by IWRR on the source flows, then a decode
  replica by that prefill replica's IWRR on its KV-edge flows (HexGen-2 §3.3).

``free`` maps server ids to the KV token-layers they have left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..flow_graph import SINK, SOURCE
from ..placement import PlacementError
from ..swrr import IWRR
from .trace import Request

__all__ = ["DisaggregatedRouter", "FlowRouter", "PipelineRouter", "PipelineStep", "Route"]


@dataclass(frozen=True)
class PipelineStep:
    """One stop of a simulated request's pipeline: ``server`` runs ``layers`` layers of it (the server is
    a node or a HexGen stage; where in the model those layers are does not change the simulation)."""

    server: str
    layers: int


@dataclass(frozen=True)
class Route:
    """What a request does: prefill steps, decode steps (the same for colocated plans), and for
    disaggregated plans the KV-cache transfer segments ``(prefill server, decode server, layers)``."""

    prefill: tuple[PipelineStep, ...]
    decode: tuple[PipelineStep, ...]
    kv_segments: tuple[tuple[str, str, int], ...] = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not self.decode and self.prefill != self.decode

    def reservations(
        self, request: Request, output_tokens: float | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """KV token-layers the request holds on each server: ``(until its KV cache has moved, until it ends)``,
        for its prompt and ``output_tokens`` of output (default: its own output length)."""
        out = request.output_tokens if output_tokens is None else output_tokens
        total = request.input_tokens + out
        if not self.disaggregated:
            return {}, _need(self.decode, total)
        return _need(self.prefill, request.input_tokens), _need(self.decode, total)


def _need(steps: Sequence[PipelineStep], tokens: float) -> dict[str, float]:
    """KV token-layers ``tokens`` tokens take on each server of ``steps``."""
    out: dict[str, float] = {}
    for step in steps:
        out[step.server] = out.get(step.server, 0.0) + tokens * step.layers
    return out


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free[s] >= v - 1e-6 for s, v in need.items())


class PipelineRouter:
    """Whole fixed pipelines chosen by IWRR over their weights (HexGen replicas)."""

    def __init__(self, pipelines: Sequence[tuple[PipelineStep, ...]], weights: Sequence[float]) -> None:
        self.pipelines = [tuple(p) for p in pipelines]
        self.iwrr = IWRR(list(range(len(self.pipelines))), weights)

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens
        i = self.iwrr.pick(lambda i: _fits(free, _need(self.pipelines[i], total)))
        if i is None:
            return None
        p = self.pipelines[i]
        return Route(prefill=p, decode=p)


class FlowRouter:
    """Helix §5.1: one IWRR per vertex of the flow graph, weighted by the max-flow edge flows; a node is
    a candidate while it has room for the request's KV cache on every layer it would run and some
    successor with room leads on to the last block (§5.2)."""

    def __init__(
        self, placement: Mapping[str, tuple[int, int]], flows: Mapping[str, Mapping[str, float]]
    ) -> None:
        self.placement = dict(placement)
        self.schedulers: dict[str, IWRR[str]] = {}
        for u, targets in flows.items():
            items = sorted(targets.items())
            self.schedulers[u] = IWRR([v for v, _ in items], [f for _, f in items])
        if SOURCE not in self.schedulers:
            raise PlacementError("the placement carries no flow: no pipeline from the coordinator back to it")
        # flow edges go to nodes that end later: visiting by decreasing end is a reverse topological order
        self.order = sorted((u for u in self.schedulers if u != SOURCE), key=lambda u: -self.placement[u][1])
        self.size = {u: e - s for u, (s, e) in self.placement.items()}

    def _alive(self, total: int, free: Mapping[str, float]) -> set[str]:
        """Vertices that can still reach the sink through servers with room for their whole range."""
        alive = {SINK}
        for u in self.order:
            if free[u] >= total * self.size[u] - 1e-6 and any(
                v in alive for v in self.schedulers[u].candidates
            ):
                alive.add(u)
        return alive

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens
        alive = self._alive(total, free)
        steps: list[PipelineStep] = []
        position = 0
        u = SOURCE
        placement = self.placement
        for _ in range(len(placement) + 1):
            sched = self.schedulers.get(u)
            if sched is None:
                return None
            entry = position

            def ok(v: str, entry: int = entry) -> bool:
                if v == SINK:
                    return True
                return v in alive and free[v] >= total * (placement[v][1] - entry) - 1e-6

            v = sched.pick(ok)
            if v is None:
                return None
            if v == SINK:
                return Route(prefill=tuple(steps), decode=tuple(steps))
            end = placement[v][1]
            steps.append(PipelineStep(v, end - position))
            position = end
            u = v
        return None


class DisaggregatedRouter:
    """HexGen-2: a prefill replica by IWRR on the source flows, then a decode replica by that prefill
    replica's IWRR on its KV-edge flows."""

    def __init__(
        self,
        prefill: Sequence[tuple[PipelineStep, ...]],
        decode: Sequence[tuple[PipelineStep, ...]],
        source_weights: Sequence[float],
        kv_weights: Mapping[tuple[int, int], float],
        segments: Mapping[tuple[int, int], tuple[tuple[str, str, int], ...]],
    ) -> None:
        self.prefill = [tuple(p) for p in prefill]
        self.decode = [tuple(d) for d in decode]
        self.segments = dict(segments)
        self.first = IWRR(list(range(len(self.prefill))), source_weights)
        self.second: dict[int, IWRR[int]] = {}
        for p in range(len(self.prefill)):
            ds = [d for d in range(len(self.decode)) if kv_weights.get((p, d), 0.0) > 0]
            self.second[p] = IWRR(ds, [kv_weights[(p, d)] for d in ds])

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens

        def decode_ok(d: int) -> bool:
            return _fits(free, _need(self.decode[d], total))

        def prefill_ok(p: int) -> bool:
            if not _fits(free, _need(self.prefill[p], request.input_tokens)):
                return False
            return any(decode_ok(d) for d in self.second[p].candidates)

        p = self.first.pick(prefill_ok)
        if p is None:
            return None
        d = self.second[p].pick(decode_ok)
        if d is None:  # pragma: no cover - prefill_ok checked that one decode replica has room
            return None
        return Route(prefill=self.prefill[p], decode=self.decode[d], kv_segments=self.segments[(p, d)])
