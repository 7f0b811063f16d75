"""Request traces for the serving simulator.

A trace is a tuple of :class:`Request` sorted by arrival time. HexGen §5.1 and Helix §6.2 drive their systems
with Poisson arrivals (exponential inter-arrival times) at a given rate; HexGen-2 §5.1 names four workload
classes by their prompt and output lengths (heavy prefill = prompt over 512 tokens, heavy decoding = output over
128 tokens). Traces can also be given explicitly as ``(arrival_s, input_tokens, output_tokens)`` rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cluster.spec import Workload
from ..errors import PlannerError

__all__ = [
    "HEXGEN2_WORKLOADS",
    "Request",
    "TraceError",
    "load_trace",
    "poisson_trace",
    "request_lengths",
    "trace_from_rows",
]


class TraceError(PlannerError):
    """A request trace, or the parameters of a generated one, that cannot be used; the message says why."""

    code = "bad_trace"


@dataclass(frozen=True)
class Request:
    """One inference request: arrives at ``arrival`` seconds, ``input_tokens`` prompt, ``output_tokens`` to generate."""

    rid: int
    arrival: float
    input_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival) or self.arrival < 0:
            raise TraceError(f"request {self.rid}: arrival must be a finite time >= 0, got {self.arrival}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise TraceError(
                f"request {self.rid}: input and output lengths must be >= 1, "
                f"got {self.input_tokens} and {self.output_tokens}"
            )


# HexGen-2 §5.1: heavy prefill = prompt > 512 tokens, heavy decoding = output > 128 tokens. The paper samples
# the Azure Conversation trace; these are representative lengths inside each class.
HEXGEN2_WORKLOADS: dict[str, tuple[int, int]] = {
    "HPLD": (1024, 64),
    "HPHD": (1024, 256),
    "LPHD": (256, 256),
    "LPLD": (256, 64),
}


def request_lengths(
    average: Workload,
    workload: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
) -> tuple[int, int]:
    """The ``(prompt, output)`` tokens of the request a plan or a simulation is made for: a HexGen-2
    workload class (§5.1, :data:`HEXGEN2_WORKLOADS`), else the lengths given, each defaulting to the
    ``average`` request (a spec's :class:`~planner.cluster.spec.Workload`, rounded, at least 1)."""
    if workload is not None:
        key = workload.upper()
        if key not in HEXGEN2_WORKLOADS:
            raise TraceError(f"unknown workload {workload!r}; choose one of {', '.join(HEXGEN2_WORKLOADS)}")
        if input_tokens is not None or output_tokens is not None:
            raise TraceError("give a workload class or prompt/output lengths, not both")
        return HEXGEN2_WORKLOADS[key]
    s_in = input_tokens if input_tokens is not None else max(1, round(average.avg_input_tokens))
    s_out = output_tokens if output_tokens is not None else max(1, round(average.avg_output_tokens))
    if s_in < 1 or s_out < 1:
        raise TraceError(f"prompt and output lengths must be at least 1 token, got {s_in} and {s_out}")
    return int(s_in), int(s_out)


def trace_from_rows(rows: Iterable[Sequence[float]]) -> tuple[Request, ...]:
    """Build a trace from ``(arrival_s, input_tokens, output_tokens)`` rows (any order; sorted by arrival)."""
    out = []
    for i, row in enumerate(rows):
        if len(row) != 3:
            raise TraceError(f"trace row {i} must be (arrival, input_tokens, output_tokens), got {row!r}")
        arrival, n_in, n_out = row
        if int(n_in) != n_in or int(n_out) != n_out:
            raise TraceError(f"trace row {i}: token counts must be integers, got {row!r}")
        out.append((float(arrival), int(n_in), int(n_out)))
    out.sort(key=lambda r: r[0])
    if not out:
        raise TraceError("a trace needs at least one request")
    return tuple(Request(i, a, n_in, n_out) for i, (a, n_in, n_out) in enumerate(out))


def load_trace(path: str | Path) -> tuple[Request, ...]:
    """Read a trace file: a JSON list of ``[arrival_s, input_tokens, output_tokens]`` rows, or CSV with those columns."""
    p = Path(path)
    text = p.read_text()
    if p.suffix.lower() == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise TraceError(f"{p}: a JSON trace must be a list of [arrival, input, output] rows")
        return trace_from_rows(rows)
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [x.strip() for x in line.split(",")]
        try:
            rows.append([float(parts[0]), float(parts[1]), float(parts[2])])
        except (ValueError, IndexError):
            if line_no == 1:  # header
                continue
            raise TraceError(f"{p}:{line_no}: expected 'arrival,input_tokens,output_tokens'") from None
    return trace_from_rows(rows)


def poisson_trace(
    rate: float,
    duration: float,
    input_tokens: int,
    output_tokens: int,
    *,
    spread: float = 0.0,
    seed: int = 0,
) -> tuple[Request, ...]:
    """Poisson arrivals at ``rate`` requests/s over ``[0, duration)`` (HexGen §5.1, Helix §6.2).

    Lengths are ``input_tokens`` and ``output_tokens``; with ``spread`` in ``[0, 1)`` each is drawn uniformly
    from ``[mean * (1 - spread), mean * (1 + spread)]`` (rounded, at least 1), keeping the mean.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise TraceError(f"rate must be a positive number of requests per second, got {rate}")
    if not (duration > 0 and math.isfinite(duration)):
        raise TraceError(f"duration must be positive seconds, got {duration}")
    if input_tokens < 1 or output_tokens < 1:
        raise TraceError("input_tokens and output_tokens must be >= 1")
    if not 0 <= spread < 1:
        raise TraceError(f"spread must be in [0, 1), got {spread}")
    rng = np.random.default_rng(seed)
    expected = rate * duration
    gaps = rng.exponential(1.0 / rate, size=int(expected + 10 * math.sqrt(expected) + 20))
    arrivals = np.cumsum(gaps)
    while arrivals[-1] < duration:  # pragma: no cover - the margin above makes this vanishingly rare
        arrivals = np.concatenate([arrivals, arrivals[-1] + np.cumsum(rng.exponential(1.0 / rate, size=100))])
    arrivals = arrivals[arrivals < duration]

    def lengths(mean: int) -> np.ndarray:
        if spread == 0:
            return np.full(len(arrivals), mean, dtype=int)
        draw = rng.uniform(mean * (1 - spread), mean * (1 + spread), size=len(arrivals))
        return np.maximum(1, np.rint(draw)).astype(int)

    ins, outs = lengths(input_tokens), lengths(output_tokens)
    return tuple(Request(i, float(a), int(ins[i]), int(outs[i])) for i, a in enumerate(arrivals))
