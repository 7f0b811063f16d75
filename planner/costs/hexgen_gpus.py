"""GPU-level view of a cluster and HexGen's per-stage costs, built on :mod:`planner.costs.roofline`.

The base cost model (:mod:`planner.costs.roofline`) holds HexGen's Eqs. 4-7 in their general per-device form
and works on whole nodes. HexGen (000_7037da9499fcd439.txt) and HexGen-2 (002_ac42bb48b964a3e9.txt) plan
at the level of single GPUs: a pipeline stage is a tensor-parallel group of ``t`` GPUs of one type inside
one machine (HexGen §4.2's heuristic), and a multi-GPU node may give some of its GPUs to one stage and the
rest to another. This module adds what that needs and nothing else:

- :func:`cluster_gpus` splits every GPU node into its GPUs and :func:`gpu_classes` groups interchangeable
  GPUs (same machine, region and hardware): HexGen's GPU-type vector ``tau`` counts GPUs per class.
- :func:`gpu_link` gives the alpha-beta link between two GPUs (inside a node: ``network.intra_machine`` or
  :attr:`CostParams.intra_node_link`).
- :class:`StageCost` evaluates Eq. 4 (compute), Eq. 5 (tensor-parallel AllReduce), Eq. 7 (memory per GPU)
  for a stage and Eq. 6 (pipeline hop) between two stages, with the real block shapes of the spec, by
  calling the functions of :mod:`planner.costs.roofline`.
- :class:`ServerTiming` turns the same terms into the time of one batch of the serving simulator (a mix
  of prefill tokens and decode steps), consistent with :func:`planner.costs.roofline.prefill_time` and
  :func:`planner.costs.roofline.decode_step_time`.
- :func:`kv_transfer_time` is HexGen-2's KV-cache communication cost (HexGen-2 Table 1, last row).

Memory: besides Eq. 7 every GPU keeps :attr:`CostParams.runtime_reserve_bytes` for the CUDA context,
cuBLAS and NCCL workspaces (plus its share of the spec's ``overhead_bytes``), and weights may use at most
``weight_memory_fraction`` of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cluster.spec import COORDINATOR, Cluster, LinkSpec, ModelSpec, SpecError
from ..errors import PlannerError
from .roofline import (
    CostParams,
    compute_time,
    kv_bytes_per_token,
    params_per_block,
    per_gpu_memory,
    pp_comm_time,
    tp_comm_time,
)

__all__ = [
    "Gpu",
    "GpuClass",
    "HexGenParams",
    "ServerTiming",
    "StageCost",
    "Task",
    "cluster_gpus",
    "gpu_classes",
    "gpu_link",
    "kv_transfer_time",
    "link_between",
    "pipeline_capacity",
    "stage_batch_time",
    "stage_compute_time",
    "stage_max_batch",
]


@dataclass(frozen=True)
class Task:
    """HexGen's inference task ``t``: batch ``b_t`` of requests with ``s_in`` prompt and ``s_out`` output tokens."""

    batch: float = 1.0
    s_in: float = 128.0
    s_out: float = 64.0

    def __post_init__(self) -> None:
        if self.batch <= 0 or self.s_in <= 0 or self.s_out <= 0:
            raise PlannerError(f"a task needs positive batch, s_in and s_out, got {self}", code="bad_task")


@dataclass(frozen=True)
class HexGenParams:
    """Knobs of the GPU-level cost model shared by :mod:`planner.algorithms.hexgen`, :mod:`planner.algorithms.hexgen2` and the simulator."""

    #: Tensor-parallel degrees considered (HexGen §4.2: "limiting the degree of tensor model parallelism to a
    #: smaller candidate set, e.g. {1, 2, 4, 8}").
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    #: Base cost-model knobs (efficiencies, the intra-node link when the spec has no ``intra_machine``).
    cost: CostParams = field(default_factory=CostParams)

    @property
    def runtime_reserve_bytes(self) -> int:
        """Bytes every GPU loses before any weight (:attr:`CostParams.runtime_reserve_bytes`)."""
        return self.cost.runtime_reserve_bytes


@dataclass(frozen=True)
class Gpu:
    """One GPU of a GPU node: ``id`` is the node id for single-GPU nodes, else ``node#index``."""

    id: str
    node: str
    index: int
    machine: str
    region: str
    gpu_type: str
    memory_bytes: float
    flops: float
    bandwidth: float
    weight_fraction: float
    reserve_bytes: float


@dataclass(frozen=True)
class GpuClass:
    """Interchangeable GPUs: same machine, region and hardware (HexGen §4.2's GPU type, kept per machine so
    that a tensor-parallel group never leaves a machine)."""

    index: int
    machine: str
    region: str
    gpu_type: str
    gpus: tuple[Gpu, ...]
    tp_link: LinkSpec

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def memory_bytes(self) -> float:
        return self.gpus[0].memory_bytes

    @property
    def flops(self) -> float:
        return self.gpus[0].flops

    @property
    def bandwidth(self) -> float:
        return self.gpus[0].bandwidth

    @property
    def label(self) -> str:
        return f"{self.gpu_type}@{self.machine}"


def stage_compute_time(model: ModelSpec, cls: GpuClass, t: int, layers: int, *, batch: float, s_in: float,
                       s_out: float) -> float:
    """HexGen Eq. 4 for a ``t``-way tensor-parallel stage of GPU class ``cls`` holding ``layers`` layers:
    ``batch`` requests of ``s_in`` prompt and ``s_out`` output tokens, with the model's per-layer
    parameters and weight bytes (:func:`planner.costs.roofline.compute_time`). HexGen prices a whole request
    with it; HexGen-2 (Table 1) prices each phase, prefill with ``s_out = 0`` and decode with ``s_in = 0``."""
    return compute_time(
        layers,
        [cls.flops] * t,
        [cls.bandwidth] * t,
        hidden_size=model.hidden_size,
        dtype_bytes=model.dtype_bytes,
        batch=batch,
        s_in=s_in,
        s_out=s_out,
        params_per_layer=params_per_block(model),
        weight_bytes_per_layer=float(model.block_bytes),
    )


def cluster_gpus(cluster: Cluster, params: HexGenParams | None = None) -> list[Gpu]:
    """Every GPU of the cluster's GPU nodes, in spec order. A node's ``machine`` defaults to its own id.

    Raises :class:`SpecError` for a cluster without GPU nodes that have ``tflops`` and
    ``memory_bandwidth_gbs`` (HexGen's Eq. 4 needs ``c_d`` and ``m_d``)."""
    params = params or HexGenParams()
    out = []
    for node in cluster.nodes:
        if node.device != "gpu":
            continue
        if node.tflops is None or node.memory_bandwidth_gbs is None:
            raise SpecError(
                f"node {node.id!r}: HexGen's cost model needs tflops and memory_bandwidth_gbs per GPU "
                "(a measured block_throughput alone is not enough)"
            )
        per_gpu = node.memory_bytes / node.gpus
        for k in range(node.gpus):
            out.append(
                Gpu(
                    id=node.id if node.gpus == 1 else f"{node.id}#{k}",
                    node=node.id,
                    index=k,
                    machine=node.machine or node.id,
                    region=node.region,
                    gpu_type=node.gpu or "gpu",
                    memory_bytes=per_gpu,
                    flops=node.tflops * 1e12 * params.cost.compute_efficiency,
                    bandwidth=node.memory_bandwidth_gbs * 1e9 * params.cost.bandwidth_efficiency,
                    weight_fraction=cluster.weight_memory_fraction,
                    reserve_bytes=params.runtime_reserve_bytes + cluster.overhead_bytes / node.gpus,
                )
            )
    if not out:
        raise SpecError(f"cluster {cluster.name!r} has no GPU nodes; HexGen and HexGen-2 plan GPUs only")
    return out


def gpu_link(cluster: Cluster, a: Gpu, b: Gpu, params: HexGenParams | None = None) -> LinkSpec:
    """The link between two GPUs: inside one node the machine's link (``network.intra_machine``, else
    :attr:`CostParams.intra_node_link`), otherwise the spec's link between their nodes."""
    params = params or HexGenParams()
    if a.node == b.node:
        return cluster.network.intra_machine or params.cost.intra_node_link
    return cluster.link(a.node, b.node)


def link_between(
    cluster: Cluster, a: Sequence[Gpu], b: Sequence[Gpu], params: HexGenParams | None = None
) -> LinkSpec:
    """The fastest link between two GPU sets (HexGen Eq. 6 uses the fastest pair between two stages)."""
    best = None
    for x in a:
        for y in b:
            if x.id == y.id:
                continue
            link = gpu_link(cluster, x, y, params)
            if best is None or (link.bandwidth_mbps, -link.latency_ms) > (
                best.bandwidth_mbps,
                -best.latency_ms,
            ):
                best = link
    if best is None:
        raise PlannerError("link_between needs two non-empty, distinct GPU sets", code="bad_arguments")
    return best


def coordinator_link(cluster: Cluster, gpus: Sequence[Gpu]) -> LinkSpec:
    """The fastest link from the coordinator to any GPU of the set."""
    links = [cluster.link(COORDINATOR, g.node) for g in gpus]
    return max(links, key=lambda link: (link.bandwidth_mbps, -link.latency_ms))


def gpu_classes(cluster: Cluster, params: HexGenParams | None = None) -> list[GpuClass]:
    """Group the cluster's GPUs into classes of interchangeable GPUs (same machine, region, hardware)."""
    params = params or HexGenParams()
    gpus = cluster_gpus(cluster, params)
    groups: dict[tuple, list[Gpu]] = {}
    for g in gpus:
        key = (g.machine, g.region, g.gpu_type, g.memory_bytes, g.flops, g.bandwidth, g.reserve_bytes)
        groups.setdefault(key, []).append(g)
    classes = []
    for i, members in enumerate(groups.values()):
        worst = None
        for x in members:
            for y in members:
                if x.id >= y.id:
                    continue
                link = gpu_link(cluster, x, y, params)
                if worst is None or (link.bandwidth_mbps, -link.latency_ms) < (
                    worst.bandwidth_mbps,
                    -worst.latency_ms,
                ):
                    worst = link
        tp_link = worst or cluster.network.intra_machine or params.cost.intra_node_link
        first = members[0]
        classes.append(
            GpuClass(
                index=i,
                machine=first.machine,
                region=first.region,
                gpu_type=first.gpu_type,
                gpus=tuple(members),
                tp_link=tp_link,
            )
        )
    return classes


class StageCost:
    """HexGen Table 1 / Eqs. 4-7 for stages made of ``t`` GPUs of one class, for one cluster and task.

    ``layers`` is ``l_{i,j}``; all times are seconds for the whole task (prefill plus ``s_out`` decode
    steps), as in HexGen Eq. 2, whose sum over a pipeline is the task's end-to-end latency.
    """

    def __init__(self, cluster: Cluster, task: Task, params: HexGenParams | None = None) -> None:
        self.cluster = cluster
        self.task = task
        self.params = params or HexGenParams()
        m = cluster.model
        self.model = m
        self.weight_bytes = float(m.block_bytes)
        self.kv_bytes = kv_bytes_per_token(m)
        self._mem_cache: dict[tuple[int, int], int] = {}

    # Eq. 4 -----------------------------------------------------------------------------------------
    def compute(self, cls: GpuClass, t: int, layers: int) -> float:
        """HexGen Eq. 4 (memory scan for every output token plus the FLOPs of prefill and decode)."""
        task = self.task
        return stage_compute_time(self.model, cls, t, layers, batch=task.batch, s_in=task.s_in, s_out=task.s_out)

    # Eq. 5 -----------------------------------------------------------------------------------------
    def tensor_parallel(self, cls: GpuClass, t: int, layers: int) -> float:
        """HexGen Eq. 5 (two AllReduce per layer in the BSP model over the class's intra-machine link)."""
        if t <= 1:
            return 0.0
        link = cls.tp_link
        alpha = [[link.latency_s] * t for _ in range(t)]
        beta = [[link.bytes_per_second] * t for _ in range(t)]
        m, task = self.model, self.task
        return tp_comm_time(
            layers,
            alpha,
            beta,
            hidden_size=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            batch=task.batch,
            s_in=task.s_in,
            s_out=task.s_out,
        )

    # Eq. 6 -----------------------------------------------------------------------------------------
    def pipeline_hop(self, link: LinkSpec) -> float:
        """HexGen Eq. 6 over the fastest link between two consecutive stages."""
        m, task = self.model, self.task
        return pp_comm_time(
            [(link.latency_s, link.bytes_per_second)],
            hidden_size=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            batch=task.batch,
            s_in=task.s_in,
            s_out=task.s_out,
        )

    # Eq. 7 -----------------------------------------------------------------------------------------
    def memory_per_gpu(self, t: int, layers: int) -> float:
        """HexGen Eq. 7 with the real block and KV sizes (bytes one GPU of the stage needs, without the reserve)."""
        m, task = self.model, self.task
        return per_gpu_memory(
            layers,
            t,
            hidden_size=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            batch=task.batch,
            s_in=task.s_in,
            s_out=task.s_out,
            weight_bytes_per_layer=self.weight_bytes,
            kv_bytes_per_token_layer=self.kv_bytes,
            activation_buffers=self.params.cost.activation_buffers,
        )

    def fits(self, cls: GpuClass, t: int, layers: int) -> bool:
        """Eq. 7's memory limit ``C_mem <= M_d`` for every GPU of a ``t``-way stage of ``cls``."""
        g = cls.gpus[0]
        usable = g.memory_bytes - g.reserve_bytes
        if layers * self.weight_bytes / t > g.memory_bytes * g.weight_fraction - g.reserve_bytes:
            return False
        return self.memory_per_gpu(t, layers) <= usable

    def max_layers(self, cls: GpuClass, t: int) -> int:
        """Most layers a ``t``-way stage of ``cls`` holds under Eq. 7 (0 if not even one)."""
        key = (cls.index, t)
        cached = self._mem_cache.get(key)
        if cached is not None:
            return cached
        lo, hi = 0, self.model.num_blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(cls, t, mid):
                lo = mid
            else:
                hi = mid - 1
        self._mem_cache[key] = lo
        return lo

    def stage(self, cls: GpuClass, t: int, layers: int) -> float:
        """``C_comp + C_comm-tp`` of a stage (infinite when Eq. 7 is violated)."""
        if not self.fits(cls, t, layers):
            return math.inf
        return self.compute(cls, t, layers) + self.tensor_parallel(cls, t, layers)


@dataclass(frozen=True)
class ServerTiming:
    """Batch time of one serving stage (a TP group of ``tp`` GPUs, or a whole node), per layer it runs.

    A batch that runs ``layers`` layers over ``tokens`` new tokens (prompt tokens plus one per decode
    sequence) that attend to ``context`` cached tokens in total takes

    ``layers * (scan + tokens * flop + context * kv + tp_alpha + tokens * tp_token)``

    with ``scan = block_bytes / (tp m)`` and ``flop = 2 P / (tp c)`` from HexGen Eq. 4, ``kv`` the KV-cache
    read of :attr:`CostParams.kv_scan`, and ``tp_alpha = 4 (tp - 1) alpha``, ``tp_token = 4 (tp - 1) H B /
    (tp beta)`` from HexGen Eq. 5 (one superstep pair per batch). A node with a measured ``block_throughput``
    takes ``tokens * layers / block_throughput`` instead. A pure prefill batch matches
    :func:`planner.costs.roofline.prefill_time` and a pure decode batch :func:`planner.costs.roofline.decode_step_time`.
    """

    scan: float
    flop: float
    kv: float
    tp_alpha: float
    tp_token: float
    measured_rate: float | None = None

    def batch_time(self, layers: int, tokens: float, context: float) -> float:
        if layers <= 0:
            return 0.0
        if self.measured_rate is not None:
            return tokens * layers / self.measured_rate
        return layers * (self.scan + tokens * (self.flop + self.tp_token) + context * self.kv + self.tp_alpha)

    @classmethod
    def for_gpus(
        cls, cluster: Cluster, flops: float, bandwidth: float, tp: int, tp_link: LinkSpec, params: CostParams
    ) -> ServerTiming:
        """Timing of ``tp`` GPUs of ``flops`` FLOP/s and ``bandwidth`` bytes/s each, joined by ``tp_link``."""
        m = cluster.model
        kv = kv_bytes_per_token(m) / (tp * bandwidth) if params.kv_scan else 0.0
        if tp > 1:
            tp_alpha = 4.0 * (tp - 1) * tp_link.latency_s
            tp_token = 4.0 * (tp - 1) * m.hidden_size * m.dtype_bytes / (tp * tp_link.bytes_per_second)
        else:
            tp_alpha = tp_token = 0.0
        return cls(
            scan=m.block_bytes / (tp * bandwidth),
            flop=2.0 * params_per_block(m) / (tp * flops),
            kv=kv,
            tp_alpha=tp_alpha,
            tp_token=tp_token,
        )


def kv_transfer_time(
    cluster: Cluster,
    s_in: float,
    segments: Sequence[tuple[Sequence[Gpu], Sequence[Gpu], int]],
    params: HexGenParams | None = None,
    batch: float = 1.0,
) -> float:
    """HexGen-2 Table 1 (KV cache communication ``alpha + 2 b s_in H B / beta``) over layer-matched GPU pairs.

    ``segments`` lists ``(prefill GPUs, decode GPUs, layers)``: the prefill stage's GPUs hold those layers'
    KV cache and send it to the decode stage's GPUs that hold the same layers (HexGen-2 §3.3). A segment
    moves ``b s_in KV layers`` bytes (``KV`` = the real per-token, per-layer size) over ``min(t_p, t_d)``
    parallel GPU pairs; segments that share a GPU are serialised on it, the rest run in parallel, so the
    transfer takes the largest per-GPU sum of segment times.
    """
    kv = kv_bytes_per_token(cluster.model)
    load: dict[str, float] = {}
    for senders, receivers, layers in segments:
        if layers <= 0:
            continue
        same = {g.id for g in senders} & {g.id for g in receivers}
        if same and len(same) == len(senders) == len(receivers):
            continue  # the same GPUs keep their own cache
        link = link_between(cluster, senders, receivers, params)
        pairs = max(1, min(len(senders), len(receivers)))
        seconds = link.latency_s + batch * s_in * kv * layers / (pairs * link.bytes_per_second)
        for g in list(senders) + list(receivers):
            load[g.id] = load.get(g.id, 0.0) + seconds
    return max(load.values(), default=0.0)


def stage_max_batch(sc: StageCost, cls: GpuClass, t: int, layers: int) -> int:
    """Largest batch ``b`` (at most :attr:`CostParams.max_batch`) for which Eq. 7 fits on every GPU of a
    ``t``-way stage of ``cls`` holding ``layers`` layers; 0 when not even one request fits."""
    if layers <= 0 or not sc.fits(cls, t, layers):
        return 0
    task = sc.task
    probe = StageCost(sc.cluster, Task(1.0, task.s_in, task.s_out), sc.params)
    g = cls.gpus[0]
    usable = g.memory_bytes - g.reserve_bytes

    def fits(b: int) -> bool:
        probe.task = Task(float(b), task.s_in, task.s_out)
        return probe.memory_per_gpu(t, layers) <= usable

    if not fits(1):
        return 0
    lo, hi = 1, max(1, sc.params.cost.max_batch)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def stage_batch_time(sc: StageCost, cls: GpuClass, t: int, layers: int, batch: int) -> float:
    """Seconds a ``t``-way stage needs to serve ``batch`` whole requests of the task: Eq. 4 + Eq. 5 with
    ``b = batch`` plus the KV-cache reads of every decode step (:attr:`CostParams.kv_scan`)."""
    task = sc.task
    probe = StageCost(sc.cluster, Task(float(batch), task.s_in, task.s_out), sc.params)
    seconds = probe.compute(cls, t, layers) + probe.tensor_parallel(cls, t, layers)
    if sc.params.cost.kv_scan:
        mean_context = task.s_in + task.s_out / 2.0
        seconds += layers * task.s_out * batch * mean_context * sc.kv_bytes / (t * cls.bandwidth)
    return seconds


def pipeline_capacity(
    sc: StageCost, stages: Sequence[tuple[GpuClass, int, int]], hops: Sequence[LinkSpec] = ()
) -> float:
    """Output tokens/s of a pipeline replica (HexGen-2 App. A: "the product of the maximum available batch
    size and the time period divided by the latency"): ``b`` is the largest batch every stage fits (Eq. 7),
    the latency the sum of the stages' batch times (:func:`stage_batch_time`) and of Eq. 6 over ``hops``
    for ``b`` requests. 0 when a stage cannot hold one request."""
    if not stages:
        return 0.0
    b = min(stage_max_batch(sc, cls, t, layers) for cls, t, layers in stages)
    if b < 1:
        return 0.0
    seconds = sum(stage_batch_time(sc, cls, t, layers, b) for cls, t, layers in stages)
    if hops:
        probe = StageCost(sc.cluster, Task(float(b), sc.task.s_in, sc.task.s_out), sc.params)
        seconds += sum(probe.pipeline_hop(link) for link in hops)
    return b * sc.task.s_out / seconds
