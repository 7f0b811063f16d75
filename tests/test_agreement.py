"""The comparison a verifying client makes (`client.agreement`), on plain tensors: which rule a check uses, and
what the low-precision distance sees and ignores."""

from __future__ import annotations

import math

import pytest
import torch

from swarmnode.client.agreement import (
    DEFAULT_PER_BLOCK_TOLERANCE,
    PER_BLOCK_TOLERANCES,
    max_difference,
    rule_for,
    tolerance_for,
    trimmed,
    trimmed_distance,
)
from swarmnode.client.verify import DEFAULT_TOLERANCE, judge

HIDDEN = 576


def _stream(seed: int, tokens: int = 3) -> torch.Tensor:
    """Residual-stream-like outputs: elements about 1, and two massive ones per token."""
    out = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    out[..., 7] = 25_000.0
    out[..., 300] = -9_000.0
    return out


def _rounded(x: torch.Tensor, relative: float, seed: int) -> torch.Tensor:
    """`x` with every element off by about `relative` of itself (rounding-like noise)."""
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return x * (1 + relative * noise)


def test_the_rule_follows_the_hop_s_kind_its_length_and_the_dtype_outputs_travel_in():
    exact = rule_for("float32", torch.float32, DEFAULT_TOLERANCE, 30)
    assert exact.distance is max_difference and exact.tolerance == DEFAULT_TOLERANCE
    for kind in ("bfloat16", "bfloat16+int8", "bfloat16+int4"):
        short, whole = rule_for(kind, torch.bfloat16, DEFAULT_TOLERANCE, 10), rule_for(kind, torch.bfloat16, 1e-3, 30)
        assert short.distance is whole.distance is trimmed_distance and short.kind == whole.kind == kind
        assert short.tolerance == pytest.approx(10 * PER_BLOCK_TOLERANCES[kind])
        assert whole.tolerance == pytest.approx(3 * short.tolerance)  # rounding piles up block after block
    # a float32 hop whose outputs reach a bfloat16 client is rounded like a bfloat16 one, and asks float32 replicas
    rounded = rule_for("float32", torch.bfloat16, DEFAULT_TOLERANCE, 10)
    assert rounded.tolerance == tolerance_for("bfloat16", 10) and rounded.kind == "float32"
    assert tolerance_for("float16+q4_0", 4) == pytest.approx(4 * DEFAULT_PER_BLOCK_TOLERANCE)
    with pytest.raises(ValueError, match="max_difference"):
        tolerance_for("float32", 10)
    with pytest.raises(ValueError, match="at least one block"):
        tolerance_for("bfloat16", 0)


def test_the_massive_elements_rounding_is_left_out_and_a_change_anywhere_else_is_seen():
    a = _stream(0)
    assert trimmed(HIDDEN) == 9 and trimmed(64) == 4
    massive = a.clone()
    massive[..., 7] += 100.0  # 0.4% of 25,000: a bfloat16 rounding of it
    assert trimmed_distance(a, massive) == 0.0
    honest = _rounded(a, 0.01, 1)
    bound = trimmed_distance(a, honest)
    assert 0.005 < bound < 0.02
    one = a.clone()
    one[0, 1, 42] += 3.0  # one ordinary element moved by three times the typical size
    assert trimmed_distance(a, one) > 5 * bound
    spread = _rounded(a, 0.05, 2)  # every element off by 5%
    assert trimmed_distance(a, spread) > 3 * bound
    # max_difference, the float32 rule, does not see the moved element past the token's largest one
    assert max_difference(a, one) < 2e-4


def test_the_distance_is_symmetric_takes_the_worst_token_and_refuses_other_shapes():
    a, b = _stream(3), _stream(3)
    b[0, 2, 10:20] += 1.0
    assert trimmed_distance(a, b) == pytest.approx(trimmed_distance(b, a))
    assert trimmed_distance(a, b) == pytest.approx(trimmed_distance(a[:, 2:], b[:, 2:]))
    assert trimmed_distance(a[:, :2], b[:, :2]) == 0.0
    assert trimmed_distance(a, b[:, :2]) == math.inf
    assert trimmed_distance(a[:, :0], b[:, :0]) == 0.0


def test_judge_takes_the_low_precision_distance():
    truth = _stream(4)
    honest = _rounded(truth, 0.01, 5)
    wrong = truth.clone()
    wrong[..., :64] += 8.0  # what the tests' fault injection adds
    tolerance = tolerance_for("bfloat16", 10)
    verdict = judge([wrong, truth, honest], tolerance, trimmed_distance)
    assert verdict.accepted == 1 and verdict.wrong == (0,) and verdict.differences[0] > tolerance
    assert judge([truth, honest], tolerance, trimmed_distance).wrong == ()
