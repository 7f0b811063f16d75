"""What a simulation is asked to measure and what it reports: :class:`SimConfig` (the measurement
window, the drain after the last arrival, the SLO's scale and reference GPU, the batch bound),
:func:`reference_latency` (the execution latency an SLO is a multiple of) and :class:`SimResult` (the
metrics).

The metrics are those of the module docstring of :mod:`planner.simulator.engine`: output tokens per second inside
the window, prompt latency (arrival to first token), per-token decode latency, end-to-end latency and SLO
attainment, the share of requests finishing within ``slo_scale`` times their latency alone on the
reference GPU (HexGen §5.1 scales the SLO to multiples of the A100 execution latency; here one A100-80G,
HexGen Eq. 4, without memory limits).

Why apart from the event loop: these are the simulator's inputs and outputs, which callers (the scoring,
HexGen's fitness, the benchmarks) construct and read without running or knowing the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster.spec import Cluster
from ..costs.roofline import CostParams, compute_time, params_per_block
from ..errors import PlannerError

__all__ = ["SimConfig", "SimResult", "reference_latency"]


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
        if self.max_batch < 1:
            raise PlannerError(
                f"max_batch must be at least 1 sequence per batch, got {self.max_batch}", code="bad_config"
            )


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
