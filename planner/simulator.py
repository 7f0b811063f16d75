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

The routers are in :mod:`planner.sim_routing`; the event loop is :class:`_Simulation` below.

Per server: dynamic batching as in Helix §5.1 (a server idle with work starts a batch of everything queued,
i.e. what arrived during the previous batch); the batch takes
:meth:`~planner.hexgen_cost.ServerTiming.batch_time` (HexGen Eqs. 4-5 over the prompt tokens and decode
steps in it). Per link: transfers are serialised on the directed link and arrive one link latency after
they finish (the alpha-beta model of HexGen App. B); they also queue for the sender's NIC, which is busy
for the bytes at its own rate, so a fast NIC feeds several slow links at once. Tokens return to the
coordinator after the last stage, which sends the next decode step through the same pipeline (Helix
Fig. 3). KV cache: every server has room for a number of token-layers (its free memory over the per-token,
per-layer KV size: :func:`planner.cost_model.kv_capacity` for a node); a request reserves ``(s_in + s_out)``
tokens on each layer it runs (a prefill replica of a disaggregated plan only ``s_in``, until its KV cache
has been sent) and servers without room are
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
from .errors import PlannerError
from .flow_graph import evaluate
from .hexgen_cost import Gpu, HexGenParams, ServerTiming, coordinator_link, link_between
from .replicas import ReplicaPlan
from .sim_routing import DisaggregatedRouter, FlowRouter, PipelineRouter, PipelineStep, Route
from .trace import Request, poisson_trace

__all__ = [
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
# Servers and serving models
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


@dataclass
class ServingModel:
    """Everything the simulator needs about a plan: its servers, how requests are routed, and the links."""

    cluster: Cluster
    servers: dict[str, Server]
    router: FlowRouter | PipelineRouter | DisaggregatedRouter
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
    router = FlowRouter(placement, flows)
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
            # kv_free_bytes' rule for a group of GPUs: each GPU's reserve_bytes is its share of the node's
            # overhead_bytes plus runtime_reserve_bytes
            reserve = sum(g.reserve_bytes for g in stage.gpus)
            free = max(0.0, memory - reserve - stage.layers * cluster.model.block_bytes)
            node = cluster.node(g0.node)
            nic = node.nic_mbps * 1e6 / 8 if node.nic_mbps else math.inf
            if stage.id in servers:
                raise PlannerError(f"stage {stage.id!r} appears in two replicas", code="bad_plan")
            servers[stage.id] = Server(stage.id, timing, free / kv, g0.node, nic, stage.gpus)
    return servers


def _steps(replica: ReplicaPlan) -> tuple[PipelineStep, ...]:
    return tuple(PipelineStep(s.id, s.layers) for s in replica.stages)


def serving_from_replicas(
    cluster: Cluster, replicas: Sequence[ReplicaPlan], *, params: HexGenParams | None = None
) -> ServingModel:
    """Servers and routing for HexGen replicas (fixed per-request pipelines, IWRR over their capacities)."""
    params = params or HexGenParams()
    if not replicas:
        raise PlannerError("a plan needs at least one replica", code="bad_plan")
    servers = _stage_servers(cluster, replicas, params)
    weights = [max(r.capacity, 1e-9) for r in replicas]
    router = PipelineRouter([_steps(r) for r in replicas], weights)
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
        raise PlannerError(
            "a disaggregated plan needs at least one prefill and one decode replica", code="bad_plan"
        )
    servers = _stage_servers(cluster, list(prefill) + list(decode), params)
    segments = {(i, j): kv_segments(p, d) for i, p in enumerate(prefill) for j, d in enumerate(decode)}
    if not any(w > 0 for w in kv_weights.values()):
        raise PlannerError(
            "no KV-cache route carries flow between the prefill and decode replicas", code="bad_plan"
        )
    router = DisaggregatedRouter(
        [_steps(p) for p in prefill], [_steps(d) for d in decode], source_weights, kv_weights, segments
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
            raise PlannerError(f"slo_scale must be positive, got {self.slo_scale}", code="bad_config")
        if self.warmup < 0 or self.drain < 0:
            raise PlannerError("warmup and drain must be >= 0 seconds", code="bad_config")


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
    """A request in flight: its route (servers and layers per step, flattened for speed), tokens generated
    so far, first-token and finish times, and the KV token-layers it holds (``early``: until its KV cache
    has moved to the decode replica; ``late``: until it ends)."""

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

    def admit(self, route: Route) -> None:
        """Take ``route`` and the KV reservations it implies."""
        self.route = route
        self.pre_srv = tuple(h.server for h in route.prefill)
        self.pre_lay = tuple(h.layers for h in route.prefill)
        self.dec_srv = tuple(h.server for h in route.decode)
        self.dec_lay = tuple(h.layers for h in route.decode)
        self.disagg = route.disaggregated
        self.early, self.late = route.reservations(self.r)


#: A unit of work queued at a server: (request, _PREFILL or _DECODE, index of the step in that phase).
_Item = tuple[_Req, int, int]


class _Simulation:
    """The discrete-event loop behind :func:`simulate`; the module docstring states the rules.

    Events, each handled by one method: a request arrives at the coordinator (:meth:`on_arrival`), work
    reaches a server over a link (:meth:`on_delivery`), a server finishes a batch (:meth:`on_batch_done`),
    tokens reach the coordinator (:meth:`on_tokens`), and a disaggregated request's KV cache has reached its
    decode replica (:meth:`on_kv_moved`). Transfers are not events of their own: :meth:`transfer` books a
    transfer on the sender's NIC and the link and returns when it arrives."""

    def __init__(self, model: ServingModel, trace: Sequence[Request], config: SimConfig) -> None:
        cluster = model.cluster
        self.model = model
        self.config = config
        self.servers = model.servers
        self.activation_bytes = cluster.model.hidden_size * cluster.model.dtype_bytes
        self.kv_bytes_per_token = kv_bytes_per_token(cluster.model)
        self.token_bytes = cluster.token_bytes
        # per server: KV token-layers left, queued work, busy flag and the statistics of its batches
        self.free = {s: srv.kv_capacity for s, srv in self.servers.items()}
        self.queue: dict[str, list[_Item]] = {s: [] for s in self.servers}
        self.busy = dict.fromkeys(self.servers, False)
        self.busy_time = dict.fromkeys(self.servers, 0.0)
        self.batch_count = dict.fromkeys(self.servers, 0)
        self.item_count = dict.fromkeys(self.servers, 0)
        # per directed link and per sending NIC: when it is free again
        self.link_free: dict[tuple[str, str], float] = {}
        self.nic_free: dict[str, float] = {}
        self.link_cache: dict[tuple[str, str], tuple[float, float, str | None, float]] = {}
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        # the coordinator: requests waiting for room, requests admitted and not finished
        self.pending: deque[_Req] = deque()
        self.active = 0
        self.rejected = 0
        last_arrival = max(r.arrival for r in trace)
        self.horizon = last_arrival + config.drain
        self.window_start = config.warmup
        window_end = config.window_end if config.window_end is not None else last_arrival
        if window_end <= self.window_start:
            window_end = max(last_arrival, self.window_start) + 1e-9
        self.window_end = window_end
        self.tokens_in_window = 0
        self.finished_in_window = 0
        self.slo_cache: dict[tuple[int, int], float] = {}
        self.requests = [_Req(r, self.slo_of(r)) for r in trace]
        for q in self.requests:
            self.push(q.r.arrival, _ARRIVE, q)

    # --- bookkeeping ---------------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def slo_of(self, r: Request) -> float:
        """The request's SLO: ``slo_scale`` times its latency alone on the reference GPU."""
        key = (r.input_tokens, r.output_tokens)
        v = self.slo_cache.get(key)
        if v is None:
            v = reference_latency(self.model.cluster, r.input_tokens, r.output_tokens, self.config)
            self.slo_cache[key] = v
        return self.config.slo_scale * v

    def in_window(self, now: float) -> bool:
        return self.window_start <= now <= self.window_end

    # --- the network ---------------------------------------------------------------------------------

    def link_params(self, src: str, dst: str) -> tuple[float, float, str | None, float]:
        """(bytes/s, latency s, sender NIC key or None, sender NIC bytes/s) of the directed link
        ``src -> dst``; the link's rate is capped by both ends' NICs."""
        value = self.link_cache.get((src, dst))
        if value is not None:
            return value
        servers = self.servers
        link = self.model.link(src, dst)
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
        self.link_cache[(src, dst)] = value
        return value

    def transfer(self, now: float, src: str, dst: str, nbytes: float) -> float:
        """Serialise ``nbytes`` on the directed link and on the sender's NIC; return the arrival time.

        The sender's NIC is a FIFO queue in front of its links: the bytes hold it for ``nbytes`` at the
        NIC's own rate from when it is free; the transfer then holds the link from when both the NIC has
        started it and the link is free, for ``nbytes`` at the link's rate (capped by both NICs). A NIC
        faster than its links thus feeds several slow links at once (each link is its own alpha-beta
        channel, HexGen App. B), and one backlogged link delays only its own transfers."""
        rate, latency, nic_key, nic_rate = self.link_params(src, dst)
        start = now
        if nic_key is not None:
            nic_start = self.nic_free.get(nic_key, 0.0)
            if nic_start < now:
                nic_start = now
            self.nic_free[nic_key] = nic_start + nbytes / nic_rate
            start = nic_start
        busy_until = self.link_free.get((src, dst), 0.0)
        if busy_until > start:
            start = busy_until
        end = start + nbytes / rate
        self.link_free[(src, dst)] = end
        return end + latency

    # --- servers -------------------------------------------------------------------------------------

    def batch_duration(self, sid: str, items: Sequence[_Item]) -> float:
        """Seconds a batch of ``items`` takes on server ``sid`` (:class:`ServerTiming`: HexGen Eqs. 4-5 over
        its prompt tokens, decode steps and cached context, or a measured per-block rate)."""
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
        timing = self.servers[sid].timing
        if timing.measured_rate is not None:
            return token_layers / timing.measured_rate
        return (
            max_layers * (timing.scan + timing.tp_alpha)
            + token_layers * (timing.flop + timing.tp_token)
            + context_layers * timing.kv
        )

    def start_batch(self, now: float, sid: str) -> None:
        """Run everything queued at ``sid`` (at most ``max_batch`` items) as one batch (Helix §5.1)."""
        max_batch = self.config.max_batch
        queued = self.queue[sid]
        if len(queued) > max_batch:
            items = queued[:max_batch]
            self.queue[sid] = queued[max_batch:]
        else:
            items = queued
            self.queue[sid] = []
        self.busy[sid] = True
        duration = self.batch_duration(sid, items)
        self.busy_time[sid] += duration
        self.batch_count[sid] += 1
        self.item_count[sid] += len(items)
        self.push(now + duration, _DONE, (sid, items))

    def enqueue(self, now: float, sid: str, items: list[_Item]) -> None:
        self.queue[sid].extend(items)
        if not self.busy[sid]:
            self.start_batch(now, sid)

    # --- the coordinator -----------------------------------------------------------------------------

    def release(self, amounts: Mapping[str, float]) -> None:
        for s, v in amounts.items():
            self.free[s] += v

    def try_admit(self, now: float) -> None:
        """Admit waiting requests first come first served while a route with room exists; a request that
        fits nowhere even on an idle cluster is rejected."""
        pending = self.pending
        free = self.free
        while pending:
            q = pending[0]
            route = self.model.router.route(q.r, free)
            if route is None:
                if self.active == 0:
                    pending.popleft()  # can never fit, even on an empty cluster
                    self.rejected += 1
                    continue
                return
            pending.popleft()
            q.admit(route)
            for s, v in q.early.items():
                free[s] -= v
            for s, v in q.late.items():
                free[s] -= v
            self.active += 1
            first = route.prefill[0].server
            at = self.transfer(now, COORDINATOR, first, q.r.input_tokens * self.token_bytes)
            self.push(at, _DELIVER, (first, [(q, _PREFILL, 0)]))

    def finish(self, now: float, q: _Req) -> None:
        q.finish = now
        self.active -= 1
        self.release(q.early)
        q.early = {}
        self.release(q.late)
        if self.in_window(now):
            self.finished_in_window += 1
        self.try_admit(now)

    # --- events --------------------------------------------------------------------------------------

    def on_arrival(self, now: float, q: _Req) -> None:
        self.pending.append(q)
        self.try_admit(now)

    def on_delivery(self, now: float, payload: tuple[str, list[_Item]]) -> None:
        sid, items = payload
        self.enqueue(now, sid, items)

    def on_batch_done(self, now: float, payload: tuple[str, list[_Item]]) -> None:
        """Send each item's output on: activations to the next step's server (one transfer per
        destination), tokens to the coordinator, and after a disaggregated prefill the KV cache to the
        decode replica (HexGen-2 §3.3); then start the next batch if work is queued."""
        sid, items = payload
        self.busy[sid] = False
        act = self.activation_bytes
        outgoing: dict[str, list[_Item]] = {}
        out_bytes: dict[str, float] = {}
        to_coord: list[_Item] = []
        kv_starts: list[_Req] = []
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
            self.push(self.transfer(now, sid, dst, out_bytes[dst]), _DELIVER, (dst, batch))
        if to_coord:
            at = self.transfer(now, sid, COORDINATOR, len(to_coord) * self.token_bytes)
            self.push(at, _COORD, to_coord)
        for q in kv_starts:
            self.push(self.move_kv(now, q), _KV, q)
        if self.queue[sid]:
            self.start_batch(now, sid)

    def move_kv(self, now: float, q: _Req) -> float:
        """Send a prefilled request's KV cache over its layer-matched segments; return when all of it
        has arrived."""
        arrival = now
        for src, dst, layers in q.route.kv_segments:
            if src == dst:
                continue
            nbytes = q.r.input_tokens * self.kv_bytes_per_token * layers
            arrival = max(arrival, self.transfer(now, src, dst, nbytes))
        return arrival

    def on_tokens(self, now: float, items: list[_Item]) -> None:
        """Tokens reach the coordinator: count them, finish requests that are done, and send the next
        decode step of the others (Helix Fig. 3); a disaggregated request's first decode step waits for
        its KV cache instead."""
        for q, phase, _ in items:
            q.generated += 1
            if self.in_window(now):
                self.tokens_in_window += 1
            if q.first is None:
                q.first = now
            if q.generated >= q.r.output_tokens:
                self.finish(now, q)
            elif phase == _DECODE or not q.disagg:
                first = q.dec_srv[0]
                at = self.transfer(now, COORDINATOR, first, self.token_bytes)
                self.push(at, _DELIVER, (first, [(q, _DECODE, 0)]))

    def on_kv_moved(self, now: float, q: _Req) -> None:
        """A disaggregated request's KV cache is at its decode replica: the prefill replica's share is
        freed, and decoding starts there."""
        self.release(q.early)
        q.early = {}
        if q.finish is None:
            self.enqueue(now, q.dec_srv[0], [(q, _DECODE, 0)])
        self.try_admit(now)

    # --- the loop and its result ---------------------------------------------------------------------

    def run(self) -> SimResult:
        handlers: tuple[Callable[[float, Any], None], ...] = (
            self.on_arrival,
            self.on_delivery,
            self.on_batch_done,
            self.on_tokens,
            self.on_kv_moved,
        )
        events = self.events
        max_events = self.config.max_events
        events_done = 0
        now = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > self.horizon:
                break
            events_done += 1
            if events_done > max_events:
                raise PlannerError(
                    f"simulation exceeded {max_events} events; shorten the trace", code="too_many_events"
                )
            handlers[kind](now, payload)
        return self.result(min(now, self.horizon) if events else now)

    def result(self, end_time: float) -> SimResult:
        prompt, decode_lat, e2e = [], [], []
        met = 0
        completed = 0
        for q in self.requests:
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
        span = self.window_end - self.window_start
        sim_span = max(end_time, 1e-9)
        servers = self.servers
        return SimResult(
            requests=len(self.requests),
            completed=completed,
            rejected=self.rejected,
            window=(self.window_start, self.window_end),
            throughput=self.tokens_in_window / span,
            request_throughput=self.finished_in_window / span,
            prompt_latency_mean=_mean(prompt),
            prompt_latency_p95=_percentile(prompt, 95),
            decode_latency_mean=_mean(decode_lat),
            decode_latency_p95=_percentile(decode_lat, 95),
            latency_mean=_mean(e2e),
            latency_p95=_percentile(e2e, 95),
            slo_scale=self.config.slo_scale,
            slo_attainment=met / len(self.requests),
            simulated_seconds=end_time,
            server_utilisation={s: min(1.0, b / sim_span) for s, b in self.busy_time.items()},
            server_mean_batch={
                s: self.item_count[s] / self.batch_count[s] if self.batch_count[s] else 0.0 for s in servers
            },
            server_backlog={s: len(self.queue[s]) for s in servers},
            waiting=len(self.pending),
        )


def simulate(model: ServingModel, trace: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run ``trace`` through ``model``; see the module docstring for the rules."""
    if not trace:
        raise PlannerError("the trace has no requests", code="empty_trace")
    return _Simulation(model, trace, config or SimConfig()).run()


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
        raise PlannerError(
            f"no request arrives in {duration} s at {rate} requests/s; raise the rate or the duration",
            code="empty_trace",
        )
    return simulate(model, trace, config)
