"""Smooth weighted round-robin: the pick rule of Helix's interleaved weighted round-robin (IWRR, §5.1).

Every allowed candidate gains its weight, the one with the largest running value wins and pays back the
total weight of the round (nginx's smooth weighted round-robin). Candidates come up in proportion to their
weights and interleaved, without bursts. Ties go to the candidate listed first, so a scheduler built from
the same weights in the same order makes the same picks wherever it runs: the client's router
(:mod:`planner.routing`) and the simulator (:mod:`planner.sim_routing`) share this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from typing import Any

from .errors import PlannerError

__all__ = ["IWRR", "smooth_pick"]


def smooth_pick(
    weights: Mapping[Any, float],
    current: MutableMapping[Any, float],
    allowed: Callable[[Any], bool] | None = None,
) -> Any | None:
    """One smooth weighted round-robin pick among ``weights``' keys (candidates with weight <= 0 or failing
    ``allowed`` sit the round out); ``current`` holds the running values and is updated. None when no
    candidate may be picked."""
    total = 0.0
    found = False
    best: Any = None
    best_value = 0.0
    for candidate, weight in weights.items():
        if weight <= 0 or (allowed is not None and not allowed(candidate)):
            continue
        value = current.get(candidate, 0.0) + weight
        current[candidate] = value
        total += weight
        if not found or value > best_value:
            found, best, best_value = True, candidate, value
    if not found:
        return None
    current[best] = best_value - total
    return best


class IWRR:
    """One interleaved weighted round-robin scheduler with its own running values: picks ``candidates``
    (distinct, hashable) in proportion to ``weights``; candidates failing ``allowed`` are skipped for that
    pick (Helix §5.1, §5.2: masked nodes)."""

    def __init__(self, candidates: Sequence[Hashable], weights: Sequence[float]) -> None:
        if len(candidates) != len(weights):
            raise PlannerError("IWRR needs one weight per candidate", code="bad_weights")
        if any(w < 0 or not math.isfinite(w) for w in weights):
            raise PlannerError("IWRR weights must be finite and non-negative", code="bad_weights")
        if len(set(candidates)) != len(candidates):
            raise PlannerError("IWRR candidates must be distinct", code="bad_weights")
        self.candidates = list(candidates)
        self.weights = {c: float(w) for c, w in zip(candidates, weights, strict=True)}
        self.current: dict[Any, float] = {}

    def pick(self, allowed: Callable[[Any], bool] | None = None) -> Any | None:
        """The next candidate, or None when every candidate with weight fails ``allowed``."""
        return smooth_pick(self.weights, self.current, allowed)
