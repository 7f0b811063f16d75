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
  network throughput"); link capacity = bandwidth / bytes per token, where node-to-node links carry
  activations (``hidden_size x dtype_bytes``) and coordinator links carry token ids (``token_bytes``).
* LLaMPS (ICPE 2024) §5.1 — a CPU node gains little past 8 cores (the knee): its compute and memory
  bandwidth are modelled from ``min(cores, knee)``.

All times are seconds, sizes bytes, throughputs tokens per second. Nothing here touches a network or a
GPU: functions take plain numbers or the dataclasses of :mod:`planner.cluster`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cluster import COORDINATOR, Cluster, LinkSpec, ModelSpec, NodeSpec

__all__ = [
    "CostModel",
    "CostParams",
    "activation_bytes",
    "block_capacity",
    "compute_time",
    "decode_step_time",
    "helix_upper_bound",
    "kv_bytes_per_token",
    "link_capacity",
    "node_compute_flops",
    "node_memory_bandwidth",
    "node_throughput",
    "params_per_block",
    "per_gpu_memory",
    "pp_comm_time",
    "prefill_time",
    "tp_comm_time",
]


@dataclass(frozen=True)
class CostParams:
    """Knobs of the cost model; the defaults are documented in ``docs/planner.md``."""

    #: Largest decode batch a node runs (vLLM's default ``max_num_seqs``).
    max_batch: int = 256
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
        raise ValueError("flops and bandwidths need one entry per device of the stage")
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
        raise ValueError("pp_comm_time needs at least one device pair")
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


def node_compute_flops(node: NodeSpec, params: CostParams = CostParams()) -> float:
    """Peak FLOP/s of the whole node: ``gpus x tflops`` for GPUs; for CPUs ``min(cores, knee)`` cores
    (LLaMPS §5.1) at ``cpu_core_gflops`` each. Scaled by ``compute_efficiency``."""
    if node.device == "gpu":
        if node.tflops is None:
            raise ValueError(f"node {node.id!r} has no tflops")
        peak = node.gpus * node.tflops * 1e12
    else:
        if node.cores is None:
            raise ValueError(f"node {node.id!r} has no cores")
        peak = min(node.cores, params.cpu_core_knee) * params.cpu_core_gflops * 1e9
    return peak * params.compute_efficiency


def node_memory_bandwidth(node: NodeSpec, params: CostParams = CostParams()) -> float:
    """Memory bandwidth (bytes/s) of the whole node: ``gpus x memory_bandwidth_gbs`` for GPUs; for CPUs
    the bandwidth ``min(cores, knee)`` cores can draw, at most the node's (LLaMPS §5.1)."""
    if node.device == "gpu":
        if node.memory_bandwidth_gbs is None:
            raise ValueError(f"node {node.id!r} has no memory_bandwidth_gbs")
        peak = node.gpus * node.memory_bandwidth_gbs * 1e9
    else:
        if node.cores is None:
            raise ValueError(f"node {node.id!r} has no cores")
        total = node.memory_bandwidth_gbs or params.cpu_memory_bandwidth_gbs
        peak = min(total, min(node.cores, params.cpu_core_knee) * params.cpu_core_bandwidth_gbs) * 1e9
    return peak * params.bandwidth_efficiency


def _intra_node_link(cluster: Cluster, params: CostParams) -> LinkSpec:
    return cluster.network.intra_machine or params.intra_node_link


def _tp_matrices(node: NodeSpec, link: LinkSpec) -> tuple[list[list[float]], list[list[float]]]:
    g = node.gpus
    alpha = [[link.latency_s] * g for _ in range(g)]
    beta = [[link.bytes_per_second] * g for _ in range(g)]
    return alpha, beta


def max_batch(cluster: Cluster, node: NodeSpec, blocks: int, params: CostParams = CostParams()) -> int:
    """Largest decode batch whose KV cache and activation buffers fit next to ``blocks`` blocks on each
    GPU of the node (HexGen Eq. 7 solved for ``b``), capped by ``params.max_batch``; 0 if none fits."""
    model = cluster.model
    w = cluster.workload
    g = node.gpus
    per_gpu = (node.memory_bytes - cluster.overhead_bytes) / g
    weights = blocks * model.block_bytes / g
    per_request = per_gpu_memory(
        blocks,
        g,
        hidden_size=model.hidden_size,
        dtype_bytes=model.dtype_bytes,
        batch=1.0,
        s_in=w.avg_input_tokens,
        s_out=w.avg_output_tokens,
        weight_bytes_per_layer=0.0,
        kv_bytes_per_token_layer=kv_bytes_per_token(model),
        activation_buffers=params.activation_buffers,
    )
    free = per_gpu - weights
    if free <= 0 or per_request <= 0:
        return 0
    return int(min(params.max_batch, math.floor(free / per_request)))


def _batch_time(cluster: Cluster, node: NodeSpec, blocks: int, batch: float, params: CostParams) -> float:
    """Seconds for ``blocks`` blocks of the node to serve ``batch`` whole requests (prefill + decode):
    HexGen Eq. 4 with the real block shapes, plus the KV-cache reads of each decode step when
    ``params.kv_scan``, plus HexGen Eq. 5 across the node's GPUs."""
    model = cluster.model
    w = cluster.workload
    flops = node_compute_flops(node, params)
    bandwidth = node_memory_bandwidth(node, params)
    t = compute_time(
        blocks,
        [flops],
        [bandwidth],
        hidden_size=model.hidden_size,
        dtype_bytes=model.dtype_bytes,
        batch=batch,
        s_in=w.avg_input_tokens,
        s_out=w.avg_output_tokens,
        params_per_layer=params_per_block(model),
        weight_bytes_per_layer=float(model.block_bytes),
    )
    if params.kv_scan:
        mean_context = w.avg_input_tokens + w.avg_output_tokens / 2.0
        t += blocks * w.avg_output_tokens * batch * mean_context * kv_bytes_per_token(model) / bandwidth
    t += _node_tp_time(cluster, node, params, blocks, batch, s_in=w.avg_input_tokens, s_out=w.avg_output_tokens)
    return t


def nic_capacity(cluster: Cluster, node: NodeSpec) -> float:
    """Tokens/s the node's NIC can carry each way (activations of ``hidden_size x dtype`` bytes);
    infinite when the spec gives no ``nic_mbps``."""
    if node.nic_mbps is None:
        return math.inf
    return node.nic_mbps * 1e6 / 8.0 / activation_bytes(cluster.model)


def node_throughput(
    cluster: Cluster, node: NodeSpec, blocks: int, params: CostParams = CostParams()
) -> float:
    """Helix's ``T_j`` for ``j = blocks``: generated tokens per second the node sustains through all
    ``blocks`` blocks, the minimum of its compute throughput and its NIC throughput (Helix §4.3).

    Compute throughput: with a measured ``block_throughput``, ``block_throughput / j``. Otherwise the
    typical batch ``b`` is the largest that fits in the memory left for KV cache (:func:`max_batch`), and
    ``T_j = b s_out / t(b)`` where ``t(b)`` is the time to serve ``b`` requests through ``j`` blocks
    (:func:`_batch_time`: HexGen Eq. 4 with prefill compute amortised over the output tokens, plus
    KV-cache reads and Eq. 5's tensor-parallel traffic); at least one request is assumed to fit. 0 when
    the node cannot hold ``j`` blocks.
    """
    if blocks <= 0 or blocks > block_capacity(cluster, node):
        return 0.0
    nic = nic_capacity(cluster, node)
    if node.block_throughput is not None:
        return min(node.block_throughput / blocks, nic)
    # at least one request: a node that fits its blocks serves one at a time (LLaMPS Eq. 1 counts the
    # attention cache of a request in the framework overhead P_o already)
    batch = max(1, max_batch(cluster, node, blocks, params))
    t = _batch_time(cluster, node, blocks, batch, params)
    return min(batch * cluster.workload.avg_output_tokens / t, nic)


def prefill_time(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    tokens: float,
    batch: float = 1.0,
    params: CostParams = CostParams(),
) -> float:
    """Seconds for ``blocks`` blocks of the node to prefill ``batch`` prompts of ``tokens`` tokens:
    one weight scan plus ``2 P b s_in`` FLOPs per block (HexGen Eq. 4, prefill part) plus Eq. 5's prefill
    AllReduce traffic across the node's GPUs. With a measured ``block_throughput``: ``b s blocks / rate``."""
    model = cluster.model
    if node.block_throughput is not None:
        return batch * tokens * blocks / node.block_throughput
    flops = node_compute_flops(node, params)
    bandwidth = node_memory_bandwidth(node, params)
    t = blocks * (model.block_bytes / bandwidth + 2.0 * params_per_block(model) * batch * tokens / flops)
    t += _node_tp_time(cluster, node, params, blocks, batch, s_in=tokens, s_out=0.0)
    return t


def decode_step_time(
    cluster: Cluster,
    node: NodeSpec,
    blocks: int,
    batch: float = 1.0,
    context: float | None = None,
    params: CostParams = CostParams(),
) -> float:
    """Seconds for one decode step of ``batch`` sequences of ``context`` cached tokens through ``blocks``
    blocks: a weight scan, the KV-cache scan, ``2 P b`` FLOPs per block (HexGen Eq. 4, one output token)
    and Eq. 5's per-token AllReduce traffic. With a measured ``block_throughput``: ``b blocks / rate``."""
    model = cluster.model
    if node.block_throughput is not None:
        return batch * blocks / node.block_throughput
    if context is None:
        context = cluster.workload.avg_input_tokens + cluster.workload.avg_output_tokens / 2.0
    flops = node_compute_flops(node, params)
    bandwidth = node_memory_bandwidth(node, params)
    scan = model.block_bytes + batch * context * kv_bytes_per_token(model)
    t = blocks * (scan / bandwidth + 2.0 * params_per_block(model) * batch / flops)
    t += _node_tp_time(cluster, node, params, blocks, batch, s_in=0.0, s_out=1.0)
    return t


# ---------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------


def link_capacity(cluster: Cluster, a: str, b: str) -> float:
    """Helix §4.3: tokens/s a link carries. Between compute nodes a token is an activation of
    ``hidden_size x dtype_bytes`` bytes; on a coordinator link it is a token id of ``token_bytes``
    (Fig. 2: 80 Mbps / 4 B = 2.5M tokens/s, 60 Mbps / 16 KiB = 458 tokens/s)."""
    link = cluster.link(a, b)
    size = cluster.token_bytes if COORDINATOR in (a, b) else activation_bytes(cluster.model)
    return link.bytes_per_second / size


def helix_upper_bound(table: dict[str, Sequence[float]], num_blocks: int) -> float:
    """Helix §4.5: the max flow never exceeds ``sum_i max_j (j T_ij) / L`` — every token must pass
    ``L`` layers, and node ``i`` processes at most ``max_j j T_ij`` layer-tokens per second."""
    total = sum(max((j * t for j, t in enumerate(row)), default=0.0) for row in table.values())
    return total / num_blocks


# ---------------------------------------------------------------------------------------------------
# A cluster's cost model, cached
# ---------------------------------------------------------------------------------------------------


class CostModel:
    """The cost model bound to one cluster: capacities, ``T_j`` table and link capacities, cached.

    ``table[node_id][j]`` is ``T_j`` (``table[node_id][0] == 0``) for ``j`` up to the node's capacity.
    """

    def __init__(self, cluster: Cluster, params: CostParams | None = None) -> None:
        self.cluster = cluster
        self.params = params or CostParams()
        self.capacity: dict[str, int] = {n.id: block_capacity(cluster, n) for n in cluster.nodes}
        self.table: dict[str, tuple[float, ...]] = {
            n.id: tuple(
                [0.0]
                + [node_throughput(cluster, n, j, self.params) for j in range(1, self.capacity[n.id] + 1)]
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
        key = (a, b) if a <= b else (b, a)
        cap = self._links.get(key)
        if cap is None:
            cap = link_capacity(self.cluster, a, b)
            self._links[key] = cap
        return cap

    def link_latency(self, a: str, b: str) -> float:
        return self.cluster.link(a, b).latency_s

    def upper_bound(self) -> float:
        return helix_upper_bound(self.table, self.num_blocks)

    def token_latency(self, node_id: str, blocks: int) -> float:
        """Seconds one token spends in ``blocks`` blocks of the node (a batch-1 decode step)."""
        if blocks <= 0:
            return 0.0
        return decode_step_time(self.cluster, self.cluster.node(node_id), blocks, 1.0, None, self.params)
