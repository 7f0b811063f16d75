"""A discrete-event simulator of a placement serving a request trace.

It scores every kind of plan the planner makes with one set of rules:

- a plain :class:`~planner.placement.Placement` (node -> ``[start, end)``, the Helix/LLaMPS algorithms):
  each node is a server; a request's pipeline is chosen when it is admitted by walking Helix's flow graph
  from the coordinator with one interleaved weighted round-robin (IWRR) scheduler per vertex, weighted by
  the max-flow solution (Helix §5.1), and kept for all its tokens. With partial inference a node runs only
  the layers the request still needs (Helix §4.4);
- HexGen replicas (:class:`~planner.replicas.ReplicaPlan` with role ``replica``): each stage (a
  tensor-parallel GPU group) is a server and a request is sent to one whole pipeline, chosen by IWRR over
  the replicas' capacities (HexGen App. C: the task coordinator directs a request to a worker group);
- HexGen-2 disaggregated plans: a request is prefilled by a prefill replica, its KV cache is sent over the
  layer-matched GPU pairs to a decode replica (HexGen-2 §3.3), which generates the remaining tokens; both
  replicas are chosen by IWRR weighted by the max-flow assignment.

Per server: dynamic batching as in Helix §5.1 (a server idle with work starts a batch of everything queued,
i.e. what arrived during the previous batch); the batch takes
:meth:`~planner.hexgen_cost.ServerTiming.batch_time` (HexGen Eqs. 4-5 over the prompt tokens and decode
steps in it). Per link: transfers are serialised on the directed link and arrive one link latency after
they finish (the alpha-beta model of HexGen App. B); they also queue for the sender's NIC, which is busy
for the bytes at its own rate, so a fast NIC feeds several slow links at once. Tokens return to the
coordinator after the last stage, which sends the next decode step through the same pipeline (Helix
Fig. 3). KV cache: every server has room for a number of token-layers (its free memory over the per-token,
per-layer KV size: :func:`planner.cost_model.kv_capacity` for a node); a request reserves ``(s_in + s_out)`` tokens on each layer it runs (a prefill replica
of a disaggregated plan only ``s_in``, until its KV cache has been sent) and servers without room are
masked out of the IWRR choice (Helix §5.2); requests wait at the coordinator, first come first served.

Metrics: output tokens per second inside the measurement window, prompt latency (arrival to first token),
per-token decode latency ((finish - first token) / (s_out - 1)), end-to-end latency, and SLO attainment:
the share of requests that finish within ``slo_scale`` times their execution latency on a reference GPU
(HexGen §5.1 scales the SLO to multiples of the A100 execution latency; here one A100-80G alone, HexGen
Eq. 4, without memory limits).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cluster import COORDINATOR, Cluster, LinkSpec, Workload
from .cost_model import (
    CostModel,
    CostParams,
    compute_time,
    kv_bytes_per_token,
    kv_capacity,
    node_compute_flops,
    node_memory_bandwidth,
    params_per_block,
)
from .flow_graph import SINK, SOURCE, evaluate
from .hexgen_cost import Gpu, HexGenParams, ServerTiming, coordinator_link, link_between
from .placement import PlacementError
from .replicas import ReplicaPlan
from .trace import Request, poisson_trace

__all__ = [
    "IWRR",
    "Hop",
    "Server",
    "ServingModel",
    "SimConfig",
    "SimResult",
    "reference_latency",
    "serving_from_disaggregated",
    "serving_from_placement",
    "serving_from_replicas",
    "simulate",
    "simulate_rate",
]


# ---------------------------------------------------------------------------------------------------
# Servers, hops and routers
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A serving unit: a node, or a tensor-parallel GPU group of a HexGen stage.

    ``kv_capacity`` is in token-layers; ``node`` is the node that sends and receives for it (HexGen §3.2:
    the stage's leader GPU), ``nic`` its NIC in bytes/s (infinite when the spec gives none)."""

    id: str
    timing: ServerTiming
    kv_capacity: float
    node: str
    nic: float = math.inf
    gpus: tuple[Gpu, ...] = ()


@dataclass(frozen=True)
class Hop:
    """One stop of a request's pipeline: ``server`` runs ``layers`` layers."""

    server: str
    layers: int


class IWRR:
    """Interleaved (smooth) weighted round-robin: picks candidates with frequency proportional to their
    weights without bursts (Helix §5.1); candidates failing ``allowed`` are skipped for that pick."""

    def __init__(self, candidates: Sequence[Any], weights: Sequence[float]) -> None:
        if len(candidates) != len(weights):
            raise ValueError("IWRR needs one weight per candidate")
        if any(w < 0 or not math.isfinite(w) for w in weights):
            raise ValueError("IWRR weights must be finite and non-negative")
        self.candidates = list(candidates)
        self.weights = [float(w) for w in weights]
        self.current = [0.0] * len(self.candidates)

    def pick(self, allowed: Callable[[Any], bool] = lambda _c: True) -> Any | None:
        total = 0.0
        best = -1
        for i, c in enumerate(self.candidates):
            w = self.weights[i]
            if w <= 0 or not allowed(c):
                continue
            self.current[i] += w
            total += w
            if best < 0 or self.current[i] > self.current[best]:
                best = i
        if best < 0:
            return None
        self.current[best] -= total
        return self.candidates[best]


@dataclass(frozen=True)
class Route:
    """What a request does: prefill hops, decode hops (the same for colocated plans), and for disaggregated
    plans the KV-cache transfer segments ``(prefill server, decode server, layers)``."""

    prefill: tuple[Hop, ...]
    decode: tuple[Hop, ...]
    kv_segments: tuple[tuple[str, str, int], ...] = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not self.decode and self.prefill != self.decode

    def reservations(self, request: Request) -> tuple[dict[str, float], dict[str, float]]:
        """KV token-layers the request holds on each server: ``(until its KV cache has moved, until it ends)``."""
        total = request.input_tokens + request.output_tokens
        if not self.disaggregated:
            end: dict[str, float] = {}
            for h in self.decode:
                end[h.server] = end.get(h.server, 0.0) + total * h.layers
            return {}, end
        early: dict[str, float] = {}
        for h in self.prefill:
            early[h.server] = early.get(h.server, 0.0) + request.input_tokens * h.layers
        late: dict[str, float] = {}
        for h in self.decode:
            late[h.server] = late.get(h.server, 0.0) + total * h.layers
        return early, late


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free[s] >= v - 1e-6 for s, v in need.items())


class _PipelineRouter:
    """Whole fixed pipelines chosen by IWRR over their weights (HexGen replicas)."""

    def __init__(self, pipelines: Sequence[tuple[Hop, ...]], weights: Sequence[float]) -> None:
        self.pipelines = [tuple(p) for p in pipelines]
        self.iwrr = IWRR(list(range(len(self.pipelines))), weights)

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens

        def ok(i: int) -> bool:
            need: dict[str, float] = {}
            for h in self.pipelines[i]:
                need[h.server] = need.get(h.server, 0.0) + total * h.layers
            return _fits(free, need)

        i = self.iwrr.pick(ok)
        if i is None:
            return None
        p = self.pipelines[i]
        return Route(prefill=p, decode=p)


class _FlowRouter:
    """Helix §5.1: one IWRR per vertex of the flow graph, weighted by the max-flow edge flows."""

    def __init__(
        self, placement: Mapping[str, tuple[int, int]], flows: Mapping[str, Mapping[str, float]]
    ) -> None:
        self.placement = dict(placement)
        self.schedulers: dict[str, IWRR] = {}
        for u, targets in flows.items():
            items = sorted(targets.items())
            self.schedulers[u] = IWRR([v for v, _ in items], [f for _, f in items])
        if SOURCE not in self.schedulers:
            raise PlacementError("the placement carries no flow: no pipeline from the coordinator back to it")
        # flow edges go to nodes that end later: visiting by decreasing end is a reverse topological order
        self.order = sorted((u for u in self.schedulers if u != SOURCE), key=lambda u: -self.placement[u][1])
        self.size = {u: e - s for u, (s, e) in self.placement.items()}

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens
        # vertices that can still reach the sink through servers with room for their whole range
        alive = {SINK}
        for u in self.order:
            if free[u] >= total * self.size[u] - 1e-6 and any(
                v in alive for v in self.schedulers[u].candidates
            ):
                alive.add(u)
        hops: list[Hop] = []
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
                return Route(prefill=tuple(hops), decode=tuple(hops))
            end = placement[v][1]
            hops.append(Hop(v, end - position))
            position = end
            u = v
        return None


class _DisaggregatedRouter:
    """HexGen-2: a prefill replica by IWRR on the source flows, then a decode replica by that prefill
    replica's IWRR on its KV-edge flows."""

    def __init__(
        self,
        prefill: Sequence[tuple[Hop, ...]],
        decode: Sequence[tuple[Hop, ...]],
        source_weights: Sequence[float],
        kv_weights: Mapping[tuple[int, int], float],
        segments: Mapping[tuple[int, int], tuple[tuple[str, str, int], ...]],
    ) -> None:
        self.prefill = [tuple(p) for p in prefill]
        self.decode = [tuple(d) for d in decode]
        self.segments = dict(segments)
        self.first = IWRR(list(range(len(self.prefill))), source_weights)
        self.second = {}
        for p in range(len(self.prefill)):
            ds = [d for d in range(len(self.decode)) if kv_weights.get((p, d), 0.0) > 0]
            self.second[p] = IWRR(ds, [kv_weights[(p, d)] for d in ds])

    def route(self, request: Request, free: Mapping[str, float]) -> Route | None:
        total = request.input_tokens + request.output_tokens

        def need(hops: tuple[Hop, ...], tokens: float) -> dict[str, float]:
            out: dict[str, float] = {}
            for h in hops:
                out[h.server] = out.get(h.server, 0.0) + tokens * h.layers
            return out

        def decode_ok(d: int) -> bool:
            return _fits(free, need(self.decode[d], total))

        def prefill_ok(p: int) -> bool:
            if not _fits(free, need(self.prefill[p], request.input_tokens)):
                return False
            return any(decode_ok(d) for d in self.second[p].candidates)

        p = self.first.pick(prefill_ok)
        if p is None:
            return None
        d = self.second[p].pick(decode_ok)
        if d is None:  # pragma: no cover - prefill_ok checked that one decode replica has room
            return None
        return Route(prefill=self.prefill[p], decode=self.decode[d], kv_segments=self.segments[(p, d)])


@dataclass
class ServingModel:
    """Everything the simulator needs about a plan: its servers, how requests are routed, and the links."""

    cluster: Cluster
    servers: dict[str, Server]
    router: Any
    kind: str
    description: dict[str, Any] = field(default_factory=dict)
    #: The average request the plan was made for (a placement's cost-model workload); None: the cluster's.
    workload: Workload | None = None
    _links: dict[tuple[str, str], LinkSpec] = field(default_factory=dict)

    def link(self, a: str, b: str) -> LinkSpec:
        """Link between two servers or a server and :data:`COORDINATOR`."""
        key = (a, b)
        link = self._links.get(key)
        if link is None:
            c = self.cluster
            if a == COORDINATOR or b == COORDINATOR:
                server = self.servers[b if a == COORDINATOR else a]
                link = coordinator_link(c, server.gpus) if server.gpus else c.link(COORDINATOR, server.node)
            else:
                sa, sb = self.servers[a], self.servers[b]
                if sa.gpus and sb.gpus:
                    link = link_between(c, sa.gpus, sb.gpus)
                elif sa.node == sb.node:
                    link = c.network.intra_machine or HexGenParams().cost.intra_node_link
                else:
                    link = c.link(sa.node, sb.node)
            self._links[key] = link
        return link


def _kv_free_bytes(total_memory: float, reserve: float, weights: float) -> float:
    return max(0.0, total_memory - reserve - weights)


def serving_from_placement(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    *,
    cost: CostModel | None = None,
    params: HexGenParams | None = None,
    partial_inference: bool = True,
    flows: Mapping[str, Mapping[str, float]] | None = None,
) -> ServingModel:
    """Servers and Helix's flow routing for a node-level placement (the issue-B algorithms)."""
    params = params or HexGenParams()
    cost = cost or CostModel(cluster, params.cost)
    if flows is None:
        flows = evaluate(
            cluster, placement, cost=cost, partial_inference=partial_inference, with_latency=False
        ).flows
    servers = {}
    for node_id, (start, end) in placement.items():
        node = cluster.node(node_id)
        blocks = end - start
        if node.block_throughput is not None:
            timing = ServerTiming(0.0, 0.0, 0.0, 0.0, 0.0, measured_rate=node.block_throughput)
        elif node.device == "gpu":
            timing = ServerTiming.for_gpus(
                cluster,
                node_compute_flops(node, params.cost) / node.gpus,
                node_memory_bandwidth(node, params.cost) / node.gpus,
                node.gpus,
                cluster.network.intra_machine or params.cost.intra_node_link,
                params.cost,
            )
        else:
            timing = ServerTiming.for_gpus(
                cluster,
                node_compute_flops(node, params.cost),
                node_memory_bandwidth(node, params.cost),
                1,
                params.cost.intra_node_link,
                params.cost,
            )
        nic = node.nic_mbps * 1e6 / 8 if node.nic_mbps else math.inf
        servers[node_id] = Server(node_id, timing, kv_capacity(cluster, node, blocks, params.cost), node_id, nic)
    router = _FlowRouter(placement, flows)
    return ServingModel(
        cluster,
        servers,
        router,
        "placement",
        {"placement": {n: list(r) for n, r in placement.items()}},
        workload=cost.workload,
    )


def _stage_servers(
    cluster: Cluster, replicas: Sequence[ReplicaPlan], params: HexGenParams
) -> dict[str, Server]:
    kv = kv_bytes_per_token(cluster.model)
    servers: dict[str, Server] = {}
    for replica in replicas:
        for stage in replica.stages:
            g0 = stage.gpus[0]
            tp_link = (
                link_between(cluster, stage.gpus[:1], stage.gpus[1:], params)
                if stage.tp > 1
                else params.cost.intra_node_link
            )
            timing = ServerTiming.for_gpus(cluster, g0.flops, g0.bandwidth, stage.tp, tp_link, params.cost)
            memory = sum(g.memory_bytes for g in stage.gpus)
            reserve = sum(g.reserve_bytes for g in stage.gpus)
            free = _kv_free_bytes(memory, reserve, stage.layers * cluster.model.block_bytes)
            node = cluster.node(g0.node)
            nic = node.nic_mbps * 1e6 / 8 if node.nic_mbps else math.inf
            if stage.id in servers:
                raise ValueError(f"stage {stage.id!r} appears in two replicas")
            servers[stage.id] = Server(stage.id, timing, free / kv, g0.node, nic, stage.gpus)
    return servers


def _hops(replica: ReplicaPlan) -> tuple[Hop, ...]:
    return tuple(Hop(s.id, s.layers) for s in replica.stages)


def serving_from_replicas(
    cluster: Cluster, replicas: Sequence[ReplicaPlan], *, params: HexGenParams | None = None
) -> ServingModel:
    """Servers and routing for HexGen replicas (fixed per-request pipelines, IWRR over their capacities)."""
    params = params or HexGenParams()
    if not replicas:
        raise ValueError("a plan needs at least one replica")
    servers = _stage_servers(cluster, replicas, params)
    weights = [max(r.capacity, 1e-9) for r in replicas]
    router = _PipelineRouter([_hops(r) for r in replicas], weights)
    return ServingModel(cluster, servers, router, "replicas", {"replicas": len(replicas)})


def kv_segments(prefill: ReplicaPlan, decode: ReplicaPlan) -> tuple[tuple[str, str, int], ...]:
    """Layer-matched KV transfer segments (HexGen-2 §3.3): for every prefill stage and decode stage whose
    layer ranges overlap, the overlapping layers' KV moves from the first to the second."""
    out = []
    for p in prefill.stages:
        for d in decode.stages:
            lo, hi = max(p.start, d.start), min(p.end, d.end)
            if hi > lo:
                out.append((p.id, d.id, hi - lo))
    return tuple(out)


def serving_from_disaggregated(
    cluster: Cluster,
    prefill: Sequence[ReplicaPlan],
    decode: Sequence[ReplicaPlan],
    source_weights: Sequence[float],
    kv_weights: Mapping[tuple[int, int], float],
    *,
    params: HexGenParams | None = None,
) -> ServingModel:
    """Servers and routing for a HexGen-2 plan: ``kv_weights[(p, d)]`` is the max-flow on the KV edge from
    prefill replica ``p`` to decode replica ``d``; ``source_weights[p]`` the flow into prefill replica ``p``."""
    params = params or HexGenParams()
    if not prefill or not decode:
        raise ValueError("a disaggregated plan needs at least one prefill and one decode replica")
    servers = _stage_servers(cluster, list(prefill) + list(decode), params)
    segments = {(i, j): kv_segments(p, d) for i, p in enumerate(prefill) for j, d in enumerate(decode)}
    if not any(w > 0 for w in kv_weights.values()):
        raise ValueError("no KV-cache route carries flow between the prefill and decode replicas")
    router = _DisaggregatedRouter(
        [_hops(p) for p in prefill], [_hops(d) for d in decode], source_weights, kv_weights, segments
    )
    return ServingModel(
        cluster, servers, router, "disaggregated", {"prefill": len(prefill), "decode": len(decode)}
    )


# ---------------------------------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """Simulation knobs.

    ``warmup``: seconds at the start left out of the throughput window; ``window_end``: end of that window
    (default: the last arrival); ``drain``: how long after the last arrival the simulation may run to let
    requests finish (unfinished requests miss their SLO); ``reference_*``: the reference GPU of the SLO."""

    slo_scale: float = 5.0
    warmup: float = 0.0
    window_end: float | None = None
    drain: float = 600.0
    reference_tflops: float = 312.0
    reference_bandwidth_gbs: float = 2039.0
    max_events: int = 20_000_000
    max_batch: int = CostParams().max_batch

    def __post_init__(self) -> None:
        if not self.slo_scale > 0:
            raise ValueError(f"slo_scale must be positive, got {self.slo_scale}")
        if self.warmup < 0 or self.drain < 0:
            raise ValueError("warmup and drain must be >= 0 seconds")


def reference_latency(cluster: Cluster, s_in: float, s_out: float, config: SimConfig | None = None) -> float:
    """Execution latency of one request alone on the reference GPU: HexGen Eq. 4 for all layers with
    ``b = 1`` (a weight scan per output token plus the FLOPs of prompt and output)."""
    config = config or SimConfig()
    m = cluster.model
    return compute_time(
        m.num_blocks,
        [config.reference_tflops * 1e12],
        [config.reference_bandwidth_gbs * 1e9],
        hidden_size=m.hidden_size,
        dtype_bytes=m.dtype_bytes,
        batch=1.0,
        s_in=s_in,
        s_out=s_out,
        params_per_layer=params_per_block(m),
        weight_bytes_per_layer=float(m.block_bytes),
    )


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured. Latencies are seconds (``None`` when no request got that far)."""

    requests: int
    completed: int
    rejected: int
    window: tuple[float, float]
    throughput: float
    request_throughput: float
    prompt_latency_mean: float | None
    prompt_latency_p95: float | None
    decode_latency_mean: float | None
    decode_latency_p95: float | None
    latency_mean: float | None
    latency_p95: float | None
    slo_scale: float
    slo_attainment: float
    simulated_seconds: float
    server_utilisation: dict[str, float] = field(default_factory=dict)
    server_mean_batch: dict[str, float] = field(default_factory=dict)
    server_backlog: dict[str, int] = field(default_factory=dict)
    waiting: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "window": list(self.window),
            "throughput": self.throughput,
            "request_throughput": self.request_throughput,
            "prompt_latency_mean": self.prompt_latency_mean,
            "prompt_latency_p95": self.prompt_latency_p95,
            "decode_latency_mean": self.decode_latency_mean,
            "decode_latency_p95": self.decode_latency_p95,
            "latency_mean": self.latency_mean,
            "latency_p95": self.latency_p95,
            "slo_scale": self.slo_scale,
            "slo_attainment": self.slo_attainment,
            "simulated_seconds": self.simulated_seconds,
        }


# ---------------------------------------------------------------------------------------------------
# The event loop
# ---------------------------------------------------------------------------------------------------

_ARRIVE, _DELIVER, _DONE, _COORD, _KV = range(5)
_PREFILL, _DECODE = 0, 1


class _Req:
    __slots__ = (
        "dec_lay",
        "dec_srv",
        "disagg",
        "early",
        "finish",
        "first",
        "generated",
        "late",
        "n_in",
        "n_out",
        "pre_lay",
        "pre_srv",
        "r",
        "route",
        "slo",
    )

    def __init__(self, r: Request, slo: float) -> None:
        self.r = r
        self.n_in = r.input_tokens
        self.n_out = r.output_tokens
        self.route: Route | None = None
        self.pre_srv: tuple[str, ...] = ()
        self.pre_lay: tuple[int, ...] = ()
        self.dec_srv: tuple[str, ...] = ()
        self.dec_lay: tuple[int, ...] = ()
        self.disagg = False
        self.generated = 0
        self.first: float | None = None
        self.finish: float | None = None
        self.early: dict[str, float] = {}
        self.late: dict[str, float] = {}
        self.slo = slo


def simulate(model: ServingModel, trace: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run ``trace`` through ``model``; see the module docstring for the rules."""
    config = config or SimConfig()
    if not trace:
        raise ValueError("the trace has no requests")
    cluster = model.cluster
    act = cluster.model.hidden_size * cluster.model.dtype_bytes
    kv_tok = kv_bytes_per_token(cluster.model)
    token_bytes = cluster.token_bytes
    max_batch = config.max_batch
    servers = model.servers
    free = {s: srv.kv_capacity for s, srv in servers.items()}
    queue: dict[str, list] = {s: [] for s in servers}
    busy = dict.fromkeys(servers, False)
    busy_time = dict.fromkeys(servers, 0.0)
    batch_count = dict.fromkeys(servers, 0)
    item_count = dict.fromkeys(servers, 0)
    link_free: dict[tuple[str, str], float] = {}
    nic_free: dict[str, float] = {}
    events: list = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    ref_cache: dict[tuple[int, int], float] = {}

    def slo_of(r: Request) -> float:
        key = (r.input_tokens, r.output_tokens)
        v = ref_cache.get(key)
        if v is None:
            v = reference_latency(cluster, r.input_tokens, r.output_tokens, config)
            ref_cache[key] = v
        return config.slo_scale * v

    route_cache: dict[tuple[str, str], tuple[float, float, str | None, float]] = {}

    def link_params(src: str, dst: str) -> tuple[float, float, str | None, float]:
        """(bytes/s, latency s, sender NIC key or None, sender NIC bytes/s) of the directed link ``src -> dst``;
        the link's rate is capped by both ends' NICs."""
        link = model.link(src, dst)
        src_node = None if src == COORDINATOR else servers[src].node
        dst_node = None if dst == COORDINATOR else servers[dst].node
        rate = link.bytes_per_second
        nic_key = None
        nic_rate = math.inf
        if src_node != dst_node:
            if src_node is not None:
                nic_rate = servers[src].nic
                rate = min(rate, nic_rate)
                nic_key = src_node
            if dst_node is not None:
                rate = min(rate, servers[dst].nic)
        value = (rate, link.latency_s, nic_key, nic_rate)
        route_cache[(src, dst)] = value
        return value

    def send(now: float, src: str, dst: str, nbytes: float) -> float:
        """Serialise ``nbytes`` on the directed link and on the sender's NIC; return the arrival time.

        The sender's NIC is a FIFO queue in front of its links: the bytes hold it for ``nbytes`` at the
        NIC's own rate from when it is free; the transfer then holds the link from when both the NIC has
        started it and the link is free, for ``nbytes`` at the link's rate (capped by both NICs). A NIC
        faster than its links thus feeds several slow links at once (each link is its own alpha-beta
        channel, HexGen App. B), and one backlogged link delays only its own transfers."""
        key = (src, dst)
        params = route_cache.get(key)
        if params is None:
            params = link_params(src, dst)
        rate, latency, nic_key, nic_rate = params
        start = now
        if nic_key is not None:
            # the NIC is its own queue in front of the links: a transfer holds it only while its bytes
            # leave at the NIC's rate, so a backlog on one slow link never blocks the NIC's other links
            nic_start = nic_free.get(nic_key, 0.0)
            if nic_start < now:
                nic_start = now
            nic_free[nic_key] = nic_start + nbytes / nic_rate
            start = nic_start
        busy_until = link_free.get(key, 0.0)
        if busy_until > start:
            start = busy_until
        end = start + nbytes / rate
        link_free[key] = end
        return end + latency

    reqs = [_Req(r, slo_of(r)) for r in trace]
    for q in reqs:
        push(q.r.arrival, _ARRIVE, q)
    pending: deque[_Req] = deque()
    active = 0
    rejected = 0
    last_arrival = max(r.arrival for r in trace)
    horizon = last_arrival + config.drain
    window_start = config.warmup
    window_end = config.window_end if config.window_end is not None else last_arrival
    if window_end <= window_start:
        window_end = max(last_arrival, window_start) + 1e-9
    tokens_in_window = 0
    finished_in_window = 0

    def start_batch(now: float, sid: str) -> None:
        pending_items = queue[sid]
        if len(pending_items) > max_batch:
            items = pending_items[:max_batch]
            queue[sid] = pending_items[max_batch:]
        else:
            items = pending_items
            queue[sid] = []
        busy[sid] = True
        max_layers = 0
        token_layers = 0.0
        context_layers = 0.0
        for q, phase, idx in items:
            if phase:
                layers = q.dec_lay[idx]
                token_layers += layers
                context_layers += (q.n_in + q.generated) * layers
            else:
                layers = q.pre_lay[idx]
                token_layers += q.n_in * layers
            if layers > max_layers:
                max_layers = layers
        timing = servers[sid].timing
        if timing.measured_rate is not None:
            duration = token_layers / timing.measured_rate
        else:
            duration = (
                max_layers * (timing.scan + timing.tp_alpha)
                + token_layers * (timing.flop + timing.tp_token)
                + context_layers * timing.kv
            )
        busy_time[sid] += duration
        batch_count[sid] += 1
        item_count[sid] += len(items)
        push(now + duration, _DONE, (sid, items))

    def deliver(now: float, sid: str, items: list) -> None:
        queue[sid].extend(items)
        if not busy[sid]:
            start_batch(now, sid)

    def release(now: float, amounts: dict[str, float]) -> None:
        for s, v in amounts.items():
            free[s] += v

    def try_admit(now: float) -> None:
        nonlocal active, rejected
        while pending:
            q = pending[0]
            route = model.router.route(q.r, free)
            if route is None:
                if active == 0:
                    pending.popleft()  # can never fit, even on an empty cluster
                    rejected += 1
                    continue
                return
            pending.popleft()
            q.route = route
            q.pre_srv = tuple(h.server for h in route.prefill)
            q.pre_lay = tuple(h.layers for h in route.prefill)
            q.dec_srv = tuple(h.server for h in route.decode)
            q.dec_lay = tuple(h.layers for h in route.decode)
            q.disagg = route.disaggregated
            q.early, q.late = route.reservations(q.r)
            for s, v in q.early.items():
                free[s] -= v
            for s, v in q.late.items():
                free[s] -= v
            active += 1
            first = route.prefill[0].server
            at = send(now, COORDINATOR, first, q.r.input_tokens * token_bytes)
            push(at, _DELIVER, (first, [(q, _PREFILL, 0)]))

    def finish(now: float, q: _Req) -> None:
        nonlocal active, finished_in_window
        q.finish = now
        active -= 1
        release(now, q.early)
        q.early = {}
        release(now, q.late)
        if window_start <= now <= window_end:
            finished_in_window += 1
        try_admit(now)

    events_done = 0
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > horizon:
            break
        events_done += 1
        if events_done > config.max_events:
            raise RuntimeError(f"simulation exceeded {config.max_events} events; shorten the trace")
        if kind == _ARRIVE:
            pending.append(payload)
            try_admit(now)
        elif kind == _DELIVER:
            sid, items = payload
            deliver(now, sid, items)
        elif kind == _DONE:
            sid, items = payload
            busy[sid] = False
            outgoing: dict[str, list] = {}
            out_bytes: dict[str, float] = {}
            to_coord: list = []
            kv_starts: list = []
            for item in items:
                q, phase, idx = item
                srv = q.dec_srv if phase else q.pre_srv
                nxt = idx + 1
                if nxt < len(srv):
                    dst = srv[nxt]
                    batch = outgoing.get(dst)
                    if batch is None:
                        outgoing[dst] = batch = []
                        out_bytes[dst] = 0.0
                    batch.append((q, phase, nxt))
                    out_bytes[dst] += act if phase else q.n_in * act
                else:
                    to_coord.append(item)
                    if not phase and q.disagg and q.n_out > 1:
                        kv_starts.append(q)
            for dst, batch in outgoing.items():
                push(send(now, sid, dst, out_bytes[dst]), _DELIVER, (dst, batch))
            if to_coord:
                push(send(now, sid, COORDINATOR, len(to_coord) * token_bytes), _COORD, to_coord)
            for q in kv_starts:
                arrival = now
                for src, dst, layers in q.route.kv_segments:
                    if src == dst:
                        continue
                    arrival = max(arrival, send(now, src, dst, q.r.input_tokens * kv_tok * layers))
                push(arrival, _KV, q)
            if queue[sid]:
                start_batch(now, sid)
        elif kind == _COORD:
            for q, phase, _ in payload:
                q.generated += 1
                if window_start <= now <= window_end:
                    tokens_in_window += 1
                if q.first is None:
                    q.first = now
                if q.generated >= q.r.output_tokens:
                    finish(now, q)
                elif phase == _DECODE or not q.disagg:
                    first = q.dec_srv[0]
                    push(send(now, COORDINATOR, first, token_bytes), _DELIVER, (first, [(q, _DECODE, 0)]))
        elif kind == _KV:
            q = payload
            release(now, q.early)
            q.early = {}
            if q.finish is None:
                first = q.dec_srv[0]
                deliver(now, first, [(q, _DECODE, 0)])
            try_admit(now)

    end_time = min(now, horizon) if events else now
    prompt, decode_lat, e2e = [], [], []
    met = 0
    completed = 0
    for q in reqs:
        if q.first is not None:
            prompt.append(q.first - q.r.arrival)
        if q.finish is None:
            continue
        completed += 1
        latency = q.finish - q.r.arrival
        e2e.append(latency)
        if q.r.output_tokens > 1:
            decode_lat.append((q.finish - q.first) / (q.r.output_tokens - 1))
        if latency <= q.slo:
            met += 1
    span = window_end - window_start
    sim_span = max(end_time, 1e-9)
    return SimResult(
        requests=len(reqs),
        completed=completed,
        rejected=rejected,
        window=(window_start, window_end),
        throughput=tokens_in_window / span,
        request_throughput=finished_in_window / span,
        prompt_latency_mean=_mean(prompt),
        prompt_latency_p95=_percentile(prompt, 95),
        decode_latency_mean=_mean(decode_lat),
        decode_latency_p95=_percentile(decode_lat, 95),
        latency_mean=_mean(e2e),
        latency_p95=_percentile(e2e, 95),
        slo_scale=config.slo_scale,
        slo_attainment=met / len(reqs),
        simulated_seconds=end_time,
        server_utilisation={s: min(1.0, b / sim_span) for s, b in busy_time.items()},
        server_mean_batch={s: item_count[s] / batch_count[s] if batch_count[s] else 0.0 for s in servers},
        server_backlog={s: len(queue[s]) for s in servers},
        waiting=len(pending),
    )


def simulate_rate(
    model: ServingModel,
    rate: float,
    duration: float,
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    spread: float = 0.0,
    seed: int = 0,
    config: SimConfig | None = None,
) -> SimResult:
    """Simulate Poisson arrivals at ``rate`` requests/s for ``duration`` seconds with the average lengths
    the plan was made for (``model.workload``, else the cluster's), or the given ones."""
    w = model.workload or model.cluster.workload
    n_in = round(input_tokens if input_tokens is not None else w.avg_input_tokens)
    n_out = round(output_tokens if output_tokens is not None else w.avg_output_tokens)
    trace = poisson_trace(rate, duration, max(1, n_in), max(1, n_out), spread=spread, seed=seed)
    if not trace:
        raise ValueError(
            f"no request arrives in {duration} s at {rate} requests/s; raise the rate or the duration"
        )
    return simulate(model, trace, config)
