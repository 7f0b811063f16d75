"""Whether two computations of one hop agree: the comparison a verifying client (`client.verify`) makes, one
rule per precision.

- float32 (`records.FULL_PRECISION`): `max_difference`, the largest element difference relative to its
  token's largest magnitude, within `ClientConfig.verify_tolerance` (float32 replicas differ only by the
  order of their sums; `verify.DEFAULT_TOLERANCE` has the measurements).
- bfloat16, float16 and quantized kinds: `trimmed_distance`, per token the relative L2 difference without
  the few largest elements, within `tolerance_for(kind, blocks)`: 0.005 a block of the hop.

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

#: The largest `trimmed_distance` that still agrees, per block of the hop and per kind: honest rounding piles up
#: block after block. Measured by `scripts/bench_verification.py` on SmolLM2-135M (`docs/operations.md`,
#: "Verifying peers", has the figures): on 10-block hops no honest check of 11,190 per kind exceeded 0.041
#: (bfloat16), 0.034 (+int8), 0.034 (+int4); on the whole-model hop [0, 30), 0.10 for a prompt and 0.124 for
#: a decode step (+int8; one token, through the quantized kernels, against the verifier's dense product).
PER_BLOCK_TOLERANCES: dict[str, float] = {
    "bfloat16": 0.005,
    "float16": 0.005,
    "bfloat16+int8": 0.005,
    "bfloat16+int4": 0.005,
}
#: Kinds not in `PER_BLOCK_TOLERANCES` (float16 with a quantization, ggml's formats): the loosest measured one.
DEFAULT_PER_BLOCK_TOLERANCE = max(PER_BLOCK_TOLERANCES.values())


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


def tolerance_for(kind: str, blocks: int) -> float:
    """The `trimmed_distance` within which two outputs of a `blocks`-block hop serving `kind` agree (`kind` as
    `records.served_kind` names it); float32 is compared with `max_difference` instead."""
    if kind == FULL_PRECISION:
        raise ValueError("float32 outputs are compared with max_difference and verify_tolerance")
    if blocks < 1:
        raise ValueError(f"a hop holds at least one block, got {blocks}")
    return PER_BLOCK_TOLERANCES.get(kind, DEFAULT_PER_BLOCK_TOLERANCE) * blocks


@dataclass(frozen=True)
class Rule:
    """How one check compares outputs of hops serving `kind`: `distance(a, b)`, agreeing within `tolerance`;
    `name` for messages."""

    name: str
    distance: Callable[[torch.Tensor, torch.Tensor], float]
    tolerance: float
    kind: str = FULL_PRECISION


def rule_for(kind: str, dtype: torch.dtype, float32_tolerance: float, blocks: int) -> Rule:
    """The rule for outputs of a `blocks`-block hop serving `kind` that reach the client in `dtype`:
    `max_difference` within `float32_tolerance` when both are float32, else `trimmed_distance` within the
    kind's tolerance for that many blocks (a float32 hop whose outputs travel in bfloat16 is rounded as a
    bfloat16 one is)."""
    if kind == FULL_PRECISION and dtype == torch.float32:
        return Rule("max_difference", max_difference, float32_tolerance, kind)
    rounded_as = str(dtype).removeprefix("torch.") if kind == FULL_PRECISION else kind
    return Rule("trimmed_distance", trimmed_distance, tolerance_for(rounded_as, blocks), kind)
