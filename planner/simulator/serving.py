"""How a plan becomes what the simulator serves: its servers, the router that picks each request's
route, and the links between them (:class:`ServingModel`).

One builder per kind of plan, each the rule the module docstring of :mod:`planner.simulator.engine` states:

- :func:`serving_from_placement`: a node-level placement (Helix/LLaMPS). Every node is a server with the
  cost model's batch times, KV room and batch caps, the model the flow graph's ``T_j`` is made of, so the
  simulator and the max flow describe the same nodes; requests are routed by IWRR weighted by the max-flow
  solution (Helix §5.1), with partial inference's entry layers (Helix §4.4). :func:`pipeline_batch` and
  :func:`prefill_chunk` size a node's batches (a pipeline's share of requests; Sarathi-Serve's chunked
  prefills), and a request reserves its prompt and :data:`EXPECTED_OUTPUT_SHARE` of the average output
  (Helix's scheduler's KV expectation, §5.2);
- :func:`serving_from_replicas`: HexGen replicas, one server per tensor-parallel stage timed by HexGen
  Eqs. 4-5 (:class:`~planner.costs.hexgen_gpus.ServerTiming`), whole pipelines chosen by IWRR over their capacities
  (HexGen App. C), sending and receiving through the stage's leader GPU (HexGen §3.2);
- :func:`serving_from_disaggregated`: HexGen-2 plans, prefill and decode replicas joined by the
  layer-matched KV segments (:func:`kv_segments`, HexGen-2 §3.3), routed by the max flow's KV assignment.

Why apart from the event loop (:mod:`planner.simulator.engine`): this is the translation of a plan into servers,
which the scoring (:mod:`planner.simulator.scoring`), HexGen's fitness (:mod:`planner.algorithms.hexgen`) and benchmarks build
and inspect on their own; the loop only runs what it is given. The routers themselves are in
:mod:`planner.simulator.routers`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cluster.spec import COORDINATOR, Cluster, LinkSpec, Workload
from ..costs.factory import resolve_cost
from ..costs.hexgen_gpus import Gpu, HexGenParams, ServerTiming, coordinator_link, link_between
from ..costs.roofline import CostModel, kv_bytes_per_token
from ..errors import PlannerError
from ..flow_graph import evaluate
from ..replicas import ReplicaPlan
from .routers import DisaggregatedRouter, FlowRouter, PipelineRouter, PipelineStep

#: Helix's scheduler admits a request where its prompt plus half the average output fits the KV cache
#: (``EXPECTED_OUTPUT_LENGTH_RATIO = 0.5`` of ``AVG_OUTPUT_LEN`` in ``simulator/event_simulator/utils.py``,
#: applied in ``scheduler/global_maxflow/kv_expectation.py``): a request holds its prompt at once and its
#: output one token at a time, half of it on average over its life.
EXPECTED_OUTPUT_SHARE = 0.5

__all__ = [
    "EXPECTED_OUTPUT_SHARE",
    "BatchSeconds",
    "Server",
    "ServingModel",
    "kv_segments",
    "pipeline_batch",
    "prefill_chunk",
    "serving_from_disaggregated",
    "serving_from_placement",
    "serving_from_replicas",
]




#: Seconds one batch takes on a server: ``(layers, prompt tokens, decode sequences, cached context tokens)``.
BatchSeconds = Callable[[int, float, float, float], float]


@dataclass(frozen=True)
class Server:
    """A serving unit: a node, or a tensor-parallel GPU group of a HexGen stage.

    ``seconds(layers, prompt_tokens, decode_sequences, context)`` is the time of one batch through
    ``layers`` of its layers (a node's cost model's ``batch_seconds``, or HexGen's
    :class:`~planner.costs.hexgen_gpus.ServerTiming` for a stage); ``kv_capacity`` is in token-layers; ``node``
    is the node that sends and receives for it (HexGen §3.2: the stage's leader GPU), ``nic`` its NIC in
    bytes/s (infinite when the spec gives none). ``depth`` is the number of layers it holds, ``entries``
    the layer offsets (from its first layer) at which requests enter it (0, and with Helix's partial
    inference the ends of predecessors inside its range), ``limits`` the most prompt tokens and decode
    sequences one batch may hold (Helix's ``InferenceSettings``; None: only :attr:`SimConfig.max_batch`),
    ``cap`` the most decode steps one batch takes (a node's share of a pipeline's requests,
    :func:`pipeline_batch`; None for HexGen's stages), ``prompt_budget`` the prompt tokens of ``cap``
    average passes (the typical batch its ``T_j`` is made of; the least a chunk holds), and ``chunk`` the
    most prompt tokens one batch runs (:func:`prefill_chunk`: a longer prompt is prefilled in chunks, one
    per batch; infinite for HexGen's stages)."""

    id: str
    seconds: BatchSeconds
    kv_capacity: float
    node: str
    nic: float = math.inf
    gpus: tuple[Gpu, ...] = ()
    depth: int = 0
    entries: tuple[int, ...] = (0,)
    limits: tuple[float, float] | None = None
    cap: int | None = None
    prompt_budget: float = math.inf
    chunk: float = math.inf


def _stage_seconds(timing: ServerTiming) -> BatchSeconds:
    """A HexGen stage's batch time: :meth:`ServerTiming.batch_time` over its prompt tokens and decode
    sequences (HexGen Eqs. 4-5)."""

    def seconds(layers: int, prompt: float, decode: float, context: float) -> float:
        return timing.batch_time(layers, prompt + decode, context)

    return seconds


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
    #: The cost model a placement's servers take their batch times and KV room from (None: HexGen's).
    cost: CostModel | None = None
    #: Output tokens whose KV a request reserves when admitted; None: its own output length.
    reserve_output: float | None = None
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


def pipeline_batch(cost: CostModel, node_id: str, blocks: int) -> int:
    """The most decode steps a node holding ``blocks`` of the model's ``L`` blocks runs in one batch: the
    requests whose KV cache it holds, ``N = kv_token_layers / (j (s_in + s_out))``, spread over the ``L / j``
    stages of a pipeline, ``N j / L`` (the typical batch of :func:`planner.costs.roofline.typical_batch`
    without the network's share of the round trip), at least 1 and at most :attr:`CostParams.max_batch`.

    A node that found more decode steps waiting runs them as several batches, so that a crowd of requests
    that reached it together goes down the pipeline as a train of batches, one per stage, that keeps every
    stage busy as the max flow assumes; a batch of all of them would leave the stages behind it idle, and
    the crowds, which the stages ahead catch up with and absorb, would grow until a few of them carry all
    the requests (with everything waiting in one batch, nodes were busy a quarter of the time with
    Helix's 763/232 requests, :mod:`planner.simulator.engine`'s docstring)."""
    room = cost.kv_token_layers(node_id, blocks) / (cost.num_blocks * cost.shape.kv_tokens)
    return max(1, min(cost.params.max_batch, math.ceil(room - 1e-9)))


def prefill_chunk(cost: CostModel, node_id: str, blocks: int, cap: int) -> float:
    """The most prompt tokens a node holding ``blocks`` blocks runs in one batch: the prompt tokens of its
    typical batch (``cap`` average passes, ``cap s_in / s_out``), or, when more, the most prompt tokens
    whose prefill takes no longer than a batch of ``cap`` decode steps (at least one token).

    A prompt longer than that is prefilled in chunks, one per batch, each riding with the decode steps
    waiting there (Sarathi-Serve's chunked prefills, vLLM's ``enable_chunked_prefill``, which schedules
    decode steps first and gives prompt chunks what is left of a step's token budget): a step then takes
    at most about twice a decode batch, where a whole 763-token prompt holds a one-layer T4 for 49 ms, five
    of its decode batches, and every decode step that reaches it in the meantime. Prefill time is linear
    in the tokens in Helix's profiles (and compute-bound past a few hundred tokens in the roofline), so
    chunks cost what the whole prompt costs, less a weight scan per chunk where decode steps do not pay
    it already."""
    shape = cost.shape
    typical = cap * shape.s_in / shape.s_out
    limit = cost.batch_seconds(node_id, blocks, 0.0, float(cap), cap * shape.context_per_pass)
    if cost.batch_seconds(node_id, blocks, typical, 0.0, 0.0) >= limit:
        return max(1.0, typical)
    low, high = typical, max(2.0 * typical, 1.0)
    while cost.batch_seconds(node_id, blocks, high, 0.0, 0.0) < limit and high < 1e7:
        low, high = high, 2.0 * high
    for _ in range(40):
        mid = (low + high) / 2
        if cost.batch_seconds(node_id, blocks, mid, 0.0, 0.0) < limit:
            low = mid
        else:
            high = mid
    return max(1.0, float(math.floor(low)))


def serving_from_placement(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    *,
    cost: CostModel | None = None,
    cost_model: str | None = None,
    params: HexGenParams | None = None,
    partial_inference: bool = True,
    flows: Mapping[str, Mapping[str, float]] | None = None,
) -> ServingModel:
    """Servers and Helix's flow routing for a node-level placement (the issue-B algorithms).

    Every node takes its batch times, KV room and per-batch caps from ``cost`` (default: the cost model
    ``cost_model`` names, itself by default the spec's, :func:`planner.costs.factory.make_cost_model`):
    ``batch_seconds``, ``kv_token_layers`` and ``batch_limits``, the model the flow graph's ``T_j`` is
    made of, so the simulator and the max flow describe the same nodes."""
    params = params or HexGenParams()
    cost = resolve_cost(cluster, cost, cost_model, params.cost)
    if flows is None:
        flows = evaluate(
            cluster, placement, cost=cost, partial_inference=partial_inference, with_latency=False
        ).flows
    entries: dict[str, set[int]] = {n: {0} for n in placement}
    for u, targets in flows.items():
        for v in targets:
            if v in placement and u in placement:
                offset = placement[u][1] - placement[v][0]
                if 0 < offset < placement[v][1] - placement[v][0]:
                    entries[v].add(offset)
    servers = {}
    shape = cost.shape
    for node_id, (start, end) in placement.items():
        node = cluster.node(node_id)
        blocks = end - start
        nic = node.nic_mbps * 1e6 / 8 if node.nic_mbps else math.inf
        cap = pipeline_batch(cost, node_id, blocks)
        servers[node_id] = Server(
            node_id,
            functools.partial(cost.batch_seconds, node_id),
            cost.kv_token_layers(node_id, blocks),
            node_id,
            nic,
            depth=blocks,
            entries=tuple(sorted(entries[node_id])),
            limits=cost.batch_limits(node_id, blocks),
            cap=cap,
            prompt_budget=cap * shape.s_in / shape.s_out,
            chunk=prefill_chunk(cost, node_id, blocks, cap),
        )
    router = FlowRouter(placement, flows)
    return ServingModel(
        cluster,
        servers,
        router,
        "placement",
        {"placement": {n: list(r) for n, r in placement.items()}, "cost_model": cost.name},
        workload=cost.workload,
        cost=cost,
        reserve_output=EXPECTED_OUTPUT_SHARE * shape.s_out,
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
            servers[stage.id] = Server(
                stage.id, _stage_seconds(timing), free / kv, g0.node, nic, stage.gpus, depth=stage.layers
            )
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

