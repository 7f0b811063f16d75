"""Whether two computations of one hop agree: the comparison a verifying client (`client.verify`) makes, one
rule per precision.

- float32 (`records.FULL_PRECISION`): `max_difference`, the largest element difference relative to its
  token's largest magnitude, within `ClientConfig.verify_tolerance` (float32 replicas differ only by the
  order of their sums; `verify.DEFAULT_TOLERANCE` has the measurements).
- bfloat16, float16 and quantized kinds: `trimmed_distance`, per token the relative L2 difference without
  the few largest elements, within `tolerance_for(kind)`.

In lower precision an honest cached stream and an honest stateless forward of the same hop part by far more
than in float32: about 2% of each element on SmolLM2-135M's 10-block hops in bfloat16, and up to 8% of a
token's largest element, at a few elements (`max_difference`). `scripts/bench_verification.py` measured the
candidate statistics side by side on honest pairs and on tampered peers (a block skipped, a cheaper
quantization, another model, noise, one element moved, the tests' fault): the trimmed L2 distance caught
more kinds of tampering at a threshold above every honest value than the element-wise maximum, TOPLOC's
top-k comparison (Ong et al., ICML'25, §3), a median or a mean distance. The thresholds below are its
figures; the docs have the table (`docs/operations.md`, "Verifying peers").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmnode.records import FULL_PRECISION

#: The largest `trimmed_distance` that still agrees, per kind. Measured by `scripts/bench_verification.py` on
#: SmolLM2-135M, hops [0, 10), [10, 20), [20, 30), 10,410 honest checks per kind (a cached stream against a
#: stateless forward of the same kind): the largest honest values were 0.041 (bfloat16), 0.034 (+int8) and
#: 0.034 (+int4) against a forward of the whole sequence, 0.018-0.025 against a forward of exactly the
#: checked prefix, as the verifier runs it; no honest check exceeded 0.05. Tampered prefills start at 0.054
#: (a cheaper quantization served in the kind's place), 0.059 (weights 5% off), 0.065 (noise of 3% of a
#: token's RMS), 0.084 (one element moved by its token's RMS) and 0.31 (a block skipped). float16 keeps more
#: mantissa than bfloat16, so bfloat16's figure holds for it.
TOLERANCES: dict[str, float] = {
    "bfloat16": 0.05,
    "float16": 0.05,
    "bfloat16+int8": 0.05,
    "bfloat16+int4": 0.05,
}
#: Kinds not in `TOLERANCES` (float16 with a quantization, float32 with one): the loosest measured one.
DEFAULT_LOW_PRECISION_TOLERANCE = max(TOLERANCES.values())


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two float32 outputs (..., tokens, hidden) are: the largest difference of one element
    relative to its token's scale, max over t, h of |a[t, h] - b[t, h]| / (1 + max over h of max(|a[t, h]|,
    |b[t, h]|)).

    Relative to each token's largest element because rounding errors are: residual streams hold a few huge
    elements (SmolLM2-135M reaches ~25,000 in middle blocks, ~50 at the last), and float32 replicas differ
    by ~1e-7 of the magnitudes they add up, so one absolute tolerance would be too loose at the last block
    or too tight in the middle. Symmetric; inf when the shapes differ."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a, b = a.float(), b.float()
    scale = 1.0 + torch.maximum(a.abs().amax(-1, keepdim=True), b.abs().amax(-1, keepdim=True))
    return float(((a - b).abs() / scale).max())


def trimmed_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two outputs (..., tokens, hidden) are in low precision: per token, the L2 norm of a - b over
    the L2 norm of (|a| + |b|) / 2, both without the `trimmed(hidden)` elements of largest magnitude in the
    token; the largest over the tokens. Symmetric; inf when the shapes differ, 0 for no tokens.

    The L2 norm sees a change wherever it is, in a few elements or spread over all of them. The residual
    stream's few massive elements (SmolLM2-135M's reach ~25,000 where the rest are ~1) are left out: their own
    rounding, tiny relative to them, would otherwise set the norm and hide a change in everything else."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    size = (a.abs() + b.abs()) / 2
    keep = size.topk(a.shape[-1] - trimmed(a.shape[-1]), largest=False).indices
    difference = (a - b).gather(-1, keep).norm(dim=-1)
    scale = size.gather(-1, keep).norm(dim=-1).clamp_min(1e-12)
    return float((difference / scale).max())


def trimmed(hidden: int) -> int:
    """How many of a token's `hidden` elements `trimmed_distance` leaves out: 1/64 of them, at least 4 (massive
    activations are a handful of dimensions in the models measured)."""
    return max(4, hidden // 64)


def tolerance_for(kind: str) -> float:
    """The `trimmed_distance` within which two outputs of `kind` agree (`kind` as `records.served_kind` names
    it); float32 is compared with `max_difference` instead."""
    if kind == FULL_PRECISION:
        raise ValueError("float32 outputs are compared with verify.max_difference and verify_tolerance")
    return TOLERANCES.get(kind, DEFAULT_LOW_PRECISION_TOLERANCE)


@dataclass(frozen=True)
class Rule:
    """How one check compares outputs: `distance(a, b)`, agreeing within `tolerance`; `name` for messages."""

    name: str
    distance: Callable[[torch.Tensor, torch.Tensor], float]
    tolerance: float

    def agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return self.distance(a, b) <= self.tolerance


def rule_for(kind: str, dtype: torch.dtype, float32_tolerance: float) -> Rule:
    """The rule for outputs of a hop serving `kind` that reach the client in `dtype`: `max_difference` within
    `float32_tolerance` when both are float32, else `trimmed_distance` within the kind's tolerance (a float32
    hop whose outputs travel in bfloat16 is rounded as a bfloat16 one is)."""
    if kind == FULL_PRECISION and dtype == torch.float32:
        return Rule("max_difference", max_difference, float32_tolerance)
    if kind == FULL_PRECISION:
        kind = str(dtype).removeprefix("torch.")
    return Rule("trimmed_distance", trimmed_distance, tolerance_for(kind))
