"""Cost model: block capacity, node throughput T_j, link capacity, latency.

References (files in ``shared/seeds/``):

* HexGen (ICML 2024), Appendix B, Eqs. 4-7 — computation time (Eq. 4: a memory-scan term and a FLOP
  term), tensor-parallel communication (Eq. 5, BSP AllReduce over an alpha-beta model), pipeline-parallel
  communication (Eq. 6, the fastest link between two stages), and per-GPU memory (Eq. 7: weights, KV
  cache and four reusable activation buffers). HexGen counts ``12 H^2`` parameters and ``2 H`` KV values
  per token and layer (a GPT layer); here the real shapes are used when the spec gives them: grouped-query
  attention (``num_key_value_heads``) shrinks the KV cache and the K/V projections, and a gated (SwiGLU)
  MLP with ``intermediate_size`` has three matrices.
* Helix (ASPLOS 2025) §4.3-4.4 — ``T_j``: the tokens per second a node sustains while holding ``j``
  layers (the capacity of its in->out edge in the flow graph, "the minimum of the node's compute and
  network throughput", profiled at the node's typical batch); link capacity = bandwidth / bytes per
  transmission, where node-to-node links carry activations (``hidden_size x dtype_bytes``) and
  coordinator links carry token ids (``token_bytes``); §5.1-5.2 — per-request pipelines with dynamic
  batching, and requests admitted while their KV cache fits.
* LLaMPS (ICPE 2024) §5.1 — a CPU node gains little past 8 cores (the knee): its compute and memory
  bandwidth are modelled from ``min(cores, knee)``.

Units. Every capacity here is in *output tokens per second* for requests of a workload's average
lengths (:class:`RequestShape`; by default the cluster's ``workload``, else Helix §6.2's 763 prompt /
232 output tokens), the unit of the serving throughput Helix reports (§6.2, decode throughput) and of the
simulator's. A request's prompt costs compute and crosses every link once, so both a node's ``T_j`` and a
link's capacity count the prompt's share per output token; the flow graph, the MILP and the simulator
then measure the same thing.

All times are seconds, sizes bytes, throughputs (output) tokens per second. Nothing here touches a
network or a GPU: functions take plain numbers or the dataclasses of :mod:`planner.cluster.spec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cluster.spec import COORDINATOR, Cluster, LinkSpec, ModelSpec, NodeSpec, Workload
from ..errors import PlannerError

__all__ = [
    "CostModel",
    "CostParams",
    "RequestShape",
    "activation_bytes",
    "batch_time",
    "block_capacity",
    "compute_time",
    "concurrent_requests",
    "decode_step_time",
    "flow_link_capacity",
    "helix_upper_bound",
    "kv_bytes_per_token",
    "kv_capacity",
    "kv_free_bytes",
    "link_capacity",
    "node_compute_flops",
    "node_memory_bandwidth",
    "node_throughput",
    "params_per_block",
    "pass_latency",
    "per_gpu_memory",
    "pp_comm_time",
    "prefill_time",
    "tp_comm_time",
    "typical_batch",
]


@dataclass(frozen=True)
class CostParams:
    """Knobs of the cost model; the defaults are documented in ``docs/planner.md``."""

    #: Largest batch (sequences) a node runs (vLLM's default ``max_num_seqs``).
    max_batch: int = 256
    #: Bytes every GPU loses before any weight or KV cache: CUDA context, cuBLAS and NCCL workspaces.
    runtime_reserve_bytes: int = 1 << 30
    #: Share of peak FLOPS and of peak memory bandwidth reached (HexGen's Eq. 4 uses the peaks).
    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    #: Read the KV cache once per decode step in the memory-scan term (HexGen drops it since b << H;
    #: with long prompts it is not negligible).
    kv_scan: bool = True
    #: HexGen Eq. 7: number of activation buffers of ``b (s_in + s_out) H`` elements per GPU.
    activation_buffers: int = 4
    #: CPU nodes (LLaMPS §5.1): FLOPS and memory bandwidth per core, the node's memory bandwidth when the
    #: spec has none, and the knee past which more cores do not help.
    cpu_core_gflops: float = 50.0
    cpu_core_bandwidth_gbs: float = 5.0
    cpu_memory_bandwidth_gbs: float = 40.0
    cpu_core_knee: int = 8
    #: Link between the GPUs of one multi-GPU node when the spec has no ``intra_machine`` (PCIe 4 x16).
    intra_node_link: LinkSpec = field(
        default_factory=lambda: LinkSpec(bandwidth_mbps=128_000.0, latency_ms=0.01)
    )


# ---------------------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------------------


def _kv_dim(model: ModelSpec) -> float:
    if model.num_attention_heads and model.num_key_value_heads:
        return model.hidden_size * model.num_key_value_heads / model.num_attention_heads
    return float(model.hidden_size)


def params_per_block(model: ModelSpec) -> float:
    """Weights of one block. HexGen Eq. 4: ``12 H^2`` for a GPT block (4 ``H x H`` attention matrices,
    a ``4H`` two-matrix MLP). With real shapes: ``2 H^2 + 2 H kv_dim`` for attention (GQA shrinks K and V)
    plus ``3 H I`` for a gated (SwiGLU) MLP when ``intermediate_size`` is given."""
    h = model.hidden_size
    if model.intermediate_size is None:
        return 12.0 * h * h
    return 2.0 * h * h + 2.0 * h * _kv_dim(model) + 3.0 * h * model.intermediate_size


def kv_bytes_per_token(model: ModelSpec) -> float:
    """KV-cache bytes one token adds to one block: HexGen Eq. 7's ``2 H B_type``, with ``H`` replaced by
    the key/value width ``H * n_kv_heads / n_heads`` under grouped-query attention."""
    return 2.0 * _kv_dim(model) * model.dtype_bytes


def activation_bytes(model: ModelSpec) -> int:
    """Bytes of one token's activation between pipeline stages (Helix §4.3: ``hidden_size x dtype``)."""
    return model.hidden_size * model.dtype_bytes


# ---------------------------------------------------------------------------------------------------
# HexGen Eqs. 4-7 in their general (per device) form
# ---------------------------------------------------------------------------------------------------


def compute_time(
    layers: int,
    flops: Sequence[float],
    bandwidths: Sequence[float],
    *,
    hidden_size: int,
    dtype_bytes: int,
    batch: float,
    s_in: float,
    s_out: float,
    params_per_layer: float | None = None,
    weight_bytes_per_layer: float | None = None,
) -> float:
    """HexGen Eq. 4: time for a stage of ``layers`` layers, tensor-parallel over ``|d|`` devices, to serve
    ``batch`` requests of ``s_in`` prompt and ``s_out`` output tokens.

    ``max_d (P B / (|d| m_d)) s_out l + max_d (2 P b (s_in + s_out) / (|d| c_d)) l`` with ``P = 12 H^2``
    unless ``params_per_layer`` is given; ``flops`` (c_d, FLOP/s) and ``bandwidths`` (m_d, bytes/s) list
    one entry per device of the stage.
    """
    tp = len(flops)
    if tp == 0 or tp != len(bandwidths):
        raise PlannerError(
            "flops and bandwidths need one entry per device of the stage", code="bad_arguments"
        )
    params = 12.0 * hidden_size**2 if params_per_layer is None else params_per_layer
    weight_bytes = params * dtype_bytes if weight_bytes_per_layer is None else weight_bytes_per_layer
    scan = max(weight_bytes * s_out / (tp * m) for m in bandwidths)
    matmul = max(2.0 * params * batch * (s_in + s_out) / (tp * c) for c in flops)
    return (scan + matmul) * layers


def tp_comm_time(
    layers: int,
    alpha: Sequence[Sequence[float]],
    beta: Sequence[Sequence[float]],
    *,
    hidden_size: int,
    dtype_bytes: int,
    batch: float,
    s_in: float,
    s_out: float,
) -> float:
    """HexGen Eq. 5: tensor-parallel communication of a stage over devices ``d`` (BSP model, two AllReduce
    per layer, each a ReduceScatter and an AllGather superstep, hence the factor 4).

    ``alpha[d][d']`` is the latency (s) and ``beta[d][d']`` the bandwidth (bytes/s) between devices;
    one device gives 0."""
    tp = len(alpha)
    if tp <= 1:
        return 0.0

    def superstep(tokens: float) -> float:
        return max(
            sum(
                alpha[d][e] + tokens * hidden_size * dtype_bytes / (tp * beta[d][e])
                for e in range(tp)
                if e != d
            )
            for d in range(tp)
        )

    return superstep(batch * s_in) * 4 * layers + superstep(batch) * 4 * s_out * layers


def _node_tp_time(cluster: Cluster, node: NodeSpec, params: CostParams, blocks: int, batch: float, *,
                  s_in: float, s_out: float) -> float:
    """HexGen Eq. 5's AllReduce time of a node whose GPUs run its blocks tensor-parallel (0 otherwise)."""
    if node.device != "gpu" or node.gpus <= 1:
        return 0.0
    alpha, beta = _tp_matrices(node, _intra_node_link(cluster, params))
    model = cluster.model
    return tp_comm_time(blocks, alpha, beta, hidden_size=model.hidden_size, dtype_bytes=model.dtype_bytes,
                        batch=batch, s_in=s_in, s_out=s_out)


def pp_comm_time(
    pairs: Sequence[tuple[float, float]],
    *,
    hidden_size: int,
    dtype_bytes: int,
    batch: float,
    s_in: float,
    s_out: float,
) -> float:
    """HexGen Eq. 6: activations between two consecutive stages over their fastest link.

    ``pairs`` lists ``(alpha, beta)`` (s, bytes/s) for every device pair across the two stages;
    ``min(alpha + b s_in H B / beta) + min(alpha + b H B / beta) s_out``."""
    if not pairs:
        raise PlannerError("pp_comm_time needs at least one device pair", code="bad_arguments")
    prefill = min(a + batch * s_in * hidden_size * dtype_bytes / b for a, b in pairs)
    decode = min(a + batch * hidden_size * dtype_bytes / b for a, b in pairs)
    return prefill + decode * s_out


def per_gpu_memory(
    layers: int,
    tp: int,
    *,
    hidden_size: int,
    dtype_bytes: int,
    batch: float,
    s_in: float,
    s_out: float,
    weight_bytes_per_layer: float | None = None,
    kv_bytes_per_token_layer: float | None = None,
    activation_buffers: int = 4,
) -> float:
    """HexGen Eq. 7: bytes one GPU of a ``tp``-way stage needs:
    ``(W / |d| + b (s_in + s_out) KV / |d|) l + 4 b (s_in + s_out) H B``, with ``W = 12 H^2 B`` and
    ``KV = 2 H B`` unless the real per-layer weight and per-token KV bytes are given."""
    weights = (
        12.0 * hidden_size**2 * dtype_bytes if weight_bytes_per_layer is None else weight_bytes_per_layer
    )
    kv = 2.0 * hidden_size * dtype_bytes if kv_bytes_per_token_layer is None else kv_bytes_per_token_layer
    tokens = batch * (s_in + s_out)
    return (
        weights / tp + tokens * kv / tp
    ) * layers + activation_buffers * tokens * hidden_size * dtype_bytes


# ---------------------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------------------


def block_capacity(cluster: Cluster, node: NodeSpec) -> int:
    """Blocks a node can hold: ``floor((memory x weight_memory_fraction - overhead) / block_bytes)``
    (LLaMPS Alg. 1-2 step 2: leftover memory over block size), capped by ``max_blocks``."""
    leftover = node.memory_bytes * cluster.weight_memory_fraction - cluster.overhead_bytes
    count = 0 if leftover <= 0 else math.floor(leftover / cluster.model.block_bytes + 1e-09)
    if node.max_blocks is not None:
        count = min(count, node.max_blocks)
    return max(0, count)


def _required(node: NodeSpec, field: str) -> float:
    """The node's ``field``, which the cost model cannot do without for this kind of node; a spec that
    leaves it out is incomplete."""
    value = getattr(node, field)
    if value is None:
        raise PlannerError(f"node {node.id!r} has no {field}", code="incomplete_spec")
    return value


def node_compute_flops(node: NodeSpec, params: CostParams = CostParams()) -> float:
    """Peak FLOP/s of the whole node: ``gpus x tflops`` for GPUs; for CPUs ``min(cores, knee)`` cores
    (LLaMPS §5.1) at ``cpu_core_gflops`` each. Scaled by ``compute_efficiency``."""
    if node.device == "gpu":
        peak = node.gpus * _required(node, "tflops") * 1e12
    else:
        peak = min(_required(node, "cores"), params.cpu_core_knee) * params.cpu_core_gflops * 1e9
    return peak * params.compute_efficiency


def node_memory_bandwidth(node: NodeSpec, params: CostParams = CostParams()) -> float:
    """Memory bandwidth (bytes/s) of the whole node: ``gpus x memory_bandwidth_gbs`` for GPUs; for CPUs
    the bandwidth ``min(cores, knee)`` cores can draw, at most the node's (LLaMPS §5.1)."""
    if node.device == "gpu":
        peak = node.gpus * _required(node, "memory_bandwidth_gbs") * 1e9
    else:
        cores = _required(node, "cores")
        total = node.memory_bandwidth_gbs or params.cpu_memory_bandwidth_gbs
        peak = min(total, min(cores, params.cpu_core_knee) * params.cpu_core_bandwidth_gbs) * 1e9
    return peak * params.bandwidth_efficiency


def _intra_node_link(cluster: Cluster, params: CostParams) -> LinkSpec:
    return cluster.network.intra_machine or params.intra_node_link


def _tp_matrices(node: NodeSpec, link: LinkSpec) -> tuple[list[list[float]], list[list[float]]]:
    g = node.gpus
    alpha = [[link.latency_s] * g for _ in range(g)]
    beta = [[link.bytes_per_second] * g for _ in range(g)]
    return alpha, beta


def batch_time(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    tokens: float,
    context: float = 0.0,
    params: CostParams = CostParams(),
) -> float:
    """Seconds for ``blocks`` blocks of the node to run one batch of ``tokens`` new tokens (prompt tokens
    plus one per decode sequence) that read ``context`` cached tokens in all: one weight scan and
    ``2 P tokens`` FLOPs per block (HexGen Eq. 4 for one step), the KV-cache reads when ``params.kv_scan``,
    and HexGen Eq. 5's AllReduce supersteps over the node's GPUs for ``tokens`` tokens. With a measured
    ``block_throughput``: ``tokens x blocks / rate`` (a decode batch; a prompt's tokens cost less,
    :func:`prefill_time` and :meth:`CostModel.batch_seconds` price them at the measured prefill rate). The
    simulator's batches take exactly this (:class:`planner.costs.hexgen_gpus.ServerTiming`)."""
    if blocks <= 0:
        return 0.0
    if node.block_throughput is not None:
        return tokens * blocks / node.block_throughput
    model = cluster.model
    flops = node_compute_flops(node, params)
    bandwidth = node_memory_bandwidth(node, params)
    scan = model.block_bytes + (context * kv_bytes_per_token(model) if params.kv_scan else 0.0)
    t = blocks * (scan / bandwidth + 2.0 * params_per_block(model) * tokens / flops)
    t += _node_tp_time(cluster, node, params, blocks, 1.0, s_in=tokens, s_out=0.0)
    return t


def prefill_time(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    tokens: float,
    batch: float = 1.0,
    params: CostParams = CostParams(),
) -> float:
    """Seconds for ``blocks`` blocks of the node to prefill ``batch`` prompts of ``tokens`` tokens
    (:func:`batch_time` with ``batch x tokens`` new tokens and no cache to read; a node with measured speeds
    at its measured ``prefill_throughput``, :func:`measured_seconds`)."""
    if node.block_throughput is not None:
        return measured_seconds(node, blocks, batch * tokens, 0.0)
    return batch_time(cluster, node, blocks, batch * tokens, 0.0, params)


def measured_seconds(node: NodeSpec, blocks: int, prompt_tokens: float, decode_tokens: float) -> float:
    """A batch on a node with a measured ``block_throughput``: decode tokens at that rate, prompt tokens at
    the measured ``prefill_throughput`` (a long prompt's tokens/s through one block, many times the decode
    rate on CPUs; the decode rate when the node did not measure it)."""
    if blocks <= 0:
        return 0.0
    rate = node.block_throughput
    assert rate is not None  # callers pass only nodes that measured it
    prefill = node.prefill_throughput or rate
    return blocks * (decode_tokens / rate + prompt_tokens / prefill)


def decode_step_time(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    batch: float = 1.0,
    context: float | None = None,
    params: CostParams = CostParams(),
) -> float:
    """Seconds for one decode step of ``batch`` sequences of ``context`` cached tokens each through
    ``blocks`` blocks (:func:`batch_time` with ``batch`` new tokens); ``context`` defaults to the
    workload's mean, ``s_in + s_out / 2``."""
    if context is None:
        context = cluster.workload.avg_input_tokens + cluster.workload.avg_output_tokens / 2.0
    return batch_time(cluster, node, blocks, batch, batch * context, params)


# ---------------------------------------------------------------------------------------------------
# Requests: what one average request asks of a stage
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestShape:
    """The passes of an average request of ``s_in`` prompt and ``s_out`` output tokens through one stage.

    Helix Fig. 3: the prompt pass yields the first output token, then every further token is one decode
    pass through the same pipeline, so a request makes ``s_out`` passes and each yields one output token.
    Through every layer of its pipeline it brings ``s_in + s_out - 1`` new tokens (the prompt, then one per
    decode pass), its decode passes read ``(s_out - 1)(s_in + s_out / 2)`` cached tokens in all, and it
    keeps ``s_in + s_out`` tokens of KV cache per layer until it ends (Helix §5.2 reserves for the average
    output length). Between two stages each new token is one activation, and on the coordinator's links
    one token id (Helix §4.3), so a link carries ``(s_in + s_out - 1) / s_out`` transmissions per output
    token, except the last stage's link back to the coordinator, which carries one token id per pass.
    """

    s_in: float
    s_out: float

    def __post_init__(self) -> None:
        if not (self.s_in >= 0 and self.s_out >= 1 and math.isfinite(self.s_in) and math.isfinite(self.s_out)):
            raise PlannerError(
                f"a workload needs avg_input_tokens >= 0 and avg_output_tokens >= 1, got {self.s_in} and "
                f"{self.s_out}; fix the spec's workload",
                code="bad_workload",
            )

    @classmethod
    def of(cls, workload: Workload) -> RequestShape:
        return cls(float(workload.avg_input_tokens), float(workload.avg_output_tokens))

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per pass (per output token): ``(s_in + s_out - 1) / s_out``."""
        return (self.s_in + self.s_out - 1.0) / self.s_out

    @property
    def context_per_pass(self) -> float:
        """Cached tokens read per pass: ``(s_out - 1)(s_in + s_out / 2) / s_out``."""
        return (self.s_out - 1.0) * (self.s_in + self.s_out / 2.0) / self.s_out

    @property
    def kv_tokens(self) -> float:
        """KV-cache tokens a request keeps per layer: ``s_in + s_out``."""
        return self.s_in + self.s_out


# ---------------------------------------------------------------------------------------------------
# Node throughput T_j
# ---------------------------------------------------------------------------------------------------


def kv_free_bytes(cluster: Cluster, node: NodeSpec, blocks: int, params: CostParams = CostParams()) -> float:
    """Bytes of a node's memory left for KV cache next to ``blocks`` blocks: its memory less the spec's
    ``overhead_bytes`` (the framework), :attr:`CostParams.runtime_reserve_bytes` per GPU (CUDA context and
    workspaces, which no KV cache can use) and the weights; never negative. The one definition of a node's
    KV room: the cost model, the simulator and the request router's KV estimate (Helix §5.2) all use it."""
    gpu_reserve = params.runtime_reserve_bytes * node.gpus if node.device == "gpu" else 0
    reserve = cluster.overhead_bytes + gpu_reserve
    return max(0.0, node.memory_bytes - reserve - blocks * cluster.model.block_bytes)


def kv_capacity(cluster: Cluster, node: NodeSpec, blocks: int, params: CostParams = CostParams()) -> float:
    """Token-layers of KV cache a node holds next to ``blocks`` blocks: :func:`kv_free_bytes` over the KV
    bytes of one token in one layer (HexGen Eq. 7's KV term). The simulator admits requests by it (Helix
    §5.2)."""
    return kv_free_bytes(cluster, node, blocks, params) / kv_bytes_per_token(cluster.model)


def concurrent_requests(
    cluster: Cluster, node: NodeSpec, blocks: int, shape: RequestShape, params: CostParams = CostParams()
) -> int:
    """Average requests whose KV cache fits next to ``blocks`` blocks: ``floor(kv_capacity / (j (s_in +
    s_out)))`` (Helix §5.2: a node takes requests until its KV estimate reaches the high-water mark), and at
    least one: a node that holds its blocks serves one request at a time (LLaMPS Eq. 1 counts a request's
    attention cache in the framework overhead ``P_o``, which a spec's ``overhead_bytes`` or a swarm node's
    memory offer already leaves out). The simulator reserves KV explicitly and rejects the requests that fit
    nowhere."""
    if blocks <= 0:
        return 0
    return max(1, int(kv_capacity(cluster, node, blocks, params) / (blocks * shape.kv_tokens) + 1e-9))


def nic_capacity(cluster: Cluster, node: NodeSpec) -> float:
    """Activations per second the node's NIC carries each way (``hidden_size x dtype`` bytes each);
    infinite when the spec gives no ``nic_mbps``."""
    if node.nic_mbps is None:
        return math.inf
    return node.nic_mbps * 1e6 / 8.0 / activation_bytes(cluster.model)


def pass_latency(cluster: Cluster, node: NodeSpec, blocks: int) -> float:
    """Seconds of network latency in one pass's round trip through a pipeline that holds ``blocks`` blocks on
    this node: to and from the coordinator (Helix Fig. 3: every token returns to it before the next pass)
    and one hop between each two of the pipeline's about ``L / j`` stages, at the latency of the node's own
    region."""
    stages = max(1.0, cluster.model.num_blocks / blocks)
    coordinator = cluster.link(COORDINATOR, node.id).latency_s
    own = cluster.network.intra_region.latency_s
    region_link = cluster.region_link(node.region, node.region)
    if region_link is not None:
        own = region_link.latency_s
    return 2.0 * coordinator + (stages - 1.0) * own


def typical_batch(
    cluster: Cluster, node: NodeSpec, blocks: int, shape: RequestShape, params: CostParams = CostParams()
) -> float:
    """Passes in the typical batch of a node holding ``j = blocks`` of the model's ``L`` blocks inside a
    pipeline, at most ``max_batch``.

    Helix profiles ``T_j`` at a node's typical batch (§4.3), not at the largest one that fits: in a
    per-request pipeline (§5.1) a request is at one stage at a time, so of the ``N`` requests whose KV cache
    fits on the node (:func:`concurrent_requests`) only those now at the node share its batch. Each passes
    the node once per round trip ``R``, and the node runs ``R / B`` batches per round trip, so a batch holds
    ``n = N B(n) / R`` passes (Little's law over the loop of Helix Fig. 3). The round trip is the pipeline's
    ``L / j`` stages of about the node's batch time each (a max-flow placement balances its stages) plus the
    network latency of a pass (:func:`pass_latency`): ``R = (L / j) B(n) + lat``. With ``B(n) = a + b n``
    (:func:`batch_time`) ``n`` is the positive root of ``(L/j) b n^2 + ((L/j) a + lat - N b) n - N a = 0``;
    without latency ``n = N j / L``, the node's ``j / L`` share of the requests."""
    requests = concurrent_requests(cluster, node, blocks, shape, params)
    if requests < 1:  # no blocks
        return 0.0
    a = batch_time(cluster, node, blocks, 0.0, 0.0, params)
    b = batch_time(cluster, node, blocks, shape.tokens_per_pass, shape.context_per_pass, params) - a
    depth = cluster.model.num_blocks / blocks
    latency = pass_latency(cluster, node, blocks)
    if b <= 0:  # a measured rate: no weight scan, the batch time grows with the passes only
        n = requests / depth
    else:
        p = depth * a + latency - requests * b
        n = (-p + math.sqrt(p * p + 4.0 * depth * b * requests * a)) / (2.0 * depth * b)
    return min(float(params.max_batch), n)


def node_throughput(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    params: CostParams = CostParams(),
    workload: Workload | None = None,
) -> float:
    """Helix's ``T_j`` for ``j = blocks``: output tokens per second the node sustains through all ``j``
    blocks, the minimum of its compute and its NIC throughput (Helix §4.3), for requests of the
    ``workload``'s average lengths (default: the cluster's).

    Compute: a batch of ``n`` passes of the average request (:class:`RequestShape`) takes ``B(n)``
    (:func:`batch_time` over their new tokens and cached context: HexGen Eqs. 4-5 for one step) and yields
    ``n`` output tokens, so the node gives ``n / B(n)`` tokens per second at its typical batch ``n``
    (:func:`typical_batch`). Below one pass per batch the node runs single passes part of the time:
    ``n / B(1)``.

    NIC: ``nic / ((s_in + s_out - 1) / s_out)`` (activations per output token). With a measured
    ``block_throughput`` (tokens through one block per second, measured while serving):
    ``block_throughput / j``. 0 when the node cannot hold ``j`` blocks.
    """
    if blocks <= 0 or blocks > block_capacity(cluster, node):
        return 0.0
    shape = RequestShape.of(workload or cluster.workload)
    nic = nic_capacity(cluster, node) / shape.tokens_per_pass
    if node.block_throughput is not None:
        return min(node.block_throughput / blocks, nic)
    n = typical_batch(cluster, node, blocks, shape, params)
    passes = max(n, 1.0)
    seconds = batch_time(cluster, node, blocks, passes * shape.tokens_per_pass, passes * shape.context_per_pass, params)
    return min(n / seconds, nic)


# ---------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------


def link_capacity(cluster: Cluster, a: str, b: str) -> float:
    """Helix §4.3: transmissions per second a link carries. Between compute nodes a transmission is an
    activation of ``hidden_size x dtype_bytes`` bytes; on a coordinator link it is a token id of
    ``token_bytes`` (Fig. 2: 80 Mbps / 4 B = 2.5M tokens/s, 60 Mbps / 16 KiB = 458 tokens/s)."""
    link = cluster.link(a, b)
    size = cluster.token_bytes if COORDINATOR in (a, b) else activation_bytes(cluster.model)
    return link.bytes_per_second / size


def flow_link_capacity(cluster: Cluster, a: str, b: str, workload: Workload | None = None) -> float:
    """Output tokens per second the directed link ``a -> b`` carries: :func:`link_capacity` over the
    transmissions per output token of :class:`RequestShape` — ``(s_in + s_out - 1) / s_out`` (every prompt
    crosses each link once, then one activation per decode pass), or one token id on a last stage's link
    back to the coordinator. Helix §4.3 counts a token per transmission; the flow graph counts output
    tokens, the unit of its node capacities ``T_j`` and of the serving throughput (Helix §6.2 reports
    decode throughput)."""
    shape = RequestShape.of(workload or cluster.workload)
    per_token = 1.0 if b == COORDINATOR else shape.tokens_per_pass
    return link_capacity(cluster, a, b) / per_token


def helix_upper_bound(table: Mapping[str, Sequence[float]], num_blocks: int) -> float:
    """Helix §4.5: the max flow never exceeds ``sum_i max_j (j T_ij) / L`` — every token must pass
    ``L`` layers, and node ``i`` processes at most ``max_j j T_ij`` layer-tokens per second."""
    total = sum(max((j * t for j, t in enumerate(row)), default=0.0) for row in table.values())
    return total / num_blocks


# ---------------------------------------------------------------------------------------------------
# A cluster's cost model, cached
# ---------------------------------------------------------------------------------------------------


class CostModel:
    """The cost model bound to one cluster and workload: capacities, ``T_j`` table and link capacities,
    cached, all in output tokens per second.

    ``workload`` gives the average request lengths every capacity is computed for; by default the
    cluster's (``workload`` in the spec, else Helix §6.2's 763 prompt / 232 output tokens).
    ``table[node_id][j]`` is ``T_j`` (``table[node_id][0] == 0``) for ``j`` up to the node's capacity.
    """

    def __init__(
        self, cluster: Cluster, params: CostParams | None = None, workload: Workload | None = None
    ) -> None:
        self.cluster = cluster
        self.params = params or CostParams()
        self.workload = workload or cluster.workload
        self.shape = RequestShape.of(self.workload)
        self.capacity: dict[str, int] = {n.id: block_capacity(cluster, n) for n in cluster.nodes}
        self.table: dict[str, tuple[float, ...]] = {
            n.id: tuple(
                [0.0]
                + [
                    node_throughput(cluster, n, j, self.params, self.workload)
                    for j in range(1, self.capacity[n.id] + 1)
                ]
            )
            for n in cluster.nodes
        }
        self._links: dict[tuple[str, str], float] = {}

    @property
    def num_blocks(self) -> int:
        return self.cluster.model.num_blocks

    def throughput(self, node_id: str, blocks: int) -> float:
        row = self.table[node_id]
        if blocks <= 0 or blocks >= len(row):
            return 0.0
        return row[blocks]

    def feasible_sizes(self, node_id: str) -> list[int]:
        """Block counts the node can hold with a positive throughput."""
        row = self.table[node_id]
        return [j for j in range(1, len(row)) if row[j] > 0]

    def best_layer_rate(self, node_id: str) -> float:
        """``max_j j T_j``: layer-tokens per second at the node's best block count."""
        row = self.table[node_id]
        return max((j * t for j, t in enumerate(row)), default=0.0)

    def link_capacity(self, a: str, b: str) -> float:
        """Output tokens per second over the directed link ``a -> b`` (:func:`flow_link_capacity`)."""
        key = (a, b)
        cap = self._links.get(key)
        if cap is None:
            cap = flow_link_capacity(self.cluster, a, b, self.workload)
            self._links[key] = cap
        return cap

    def link_latency(self, a: str, b: str) -> float:
        return self.cluster.link(a, b).latency_s

    def upper_bound(self) -> float:
        return helix_upper_bound(self.table, self.num_blocks)

    #: The name a spec's ``cost_model`` gives this model (:data:`planner.cluster.spec.COST_MODEL_NAMES`).
    name = "roofline"

    def batch_seconds(
        self, node_id: str, blocks: int, prompt_tokens: float, decode_tokens: float, context: float = 0.0
    ) -> float:
        """Seconds for ``blocks`` blocks of the node to run one batch of ``prompt_tokens`` prompt tokens and
        ``decode_tokens`` decode sequences reading ``context`` cached tokens in all (:func:`batch_time`): the batch time
        behind this model's ``T_j``, for a serving simulator to share one model of a node with the flow
        graph."""
        node = self.cluster.node(node_id)
        if node.block_throughput is not None:
            return measured_seconds(node, blocks, prompt_tokens, decode_tokens)
        tokens = prompt_tokens + decode_tokens
        return batch_time(self.cluster, node, blocks, tokens, context, self.params)

    def kv_token_layers(self, node_id: str, blocks: int) -> float:
        """Token-layers of KV cache the node holds next to ``blocks`` blocks (:func:`kv_capacity`): what
        a serving simulator admits requests by (Helix §5.2)."""
        return kv_capacity(self.cluster, self.cluster.node(node_id), blocks, self.params)

    def batch_limits(self, node_id: str, blocks: int) -> tuple[float, float] | None:
        """``(max prompt tokens, max decode sequences)`` one batch of the node may hold, or None when only
        :attr:`CostParams.max_batch` limits it (the roofline model has no measured caps)."""
        return None

    def sources(self) -> dict[str, str]:
        """Where each node's figures come from (``roofline``, ``measured``, or a profile's name)."""
        return {
            n.id: "measured" if n.block_throughput is not None else "roofline" for n in self.cluster.nodes
        }

    def token_latency(self, node_id: str, blocks: int) -> float:
        """Seconds one token spends in ``blocks`` blocks of the node (a batch-1 decode step)."""
        if blocks <= 0:
            return 0.0
        context = self.shape.s_in + self.shape.s_out / 2.0
        return decode_step_time(self.cluster, self.cluster.node(node_id), blocks, 1.0, context, self.params)
