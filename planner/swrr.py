"""Smooth weighted round-robin: the pick rule of Helix's interleaved weighted round-robin (IWRR, §5.1).

Every allowed candidate gains its weight, the one with the largest running value wins and pays back the
total weight of the round (nginx's smooth weighted round-robin). Candidates come up in proportion to their
weights and interleaved, without bursts. Ties go to the candidate listed first, so a scheduler built from
the same weights in the same order makes the same picks wherever it runs: the client's router
(:mod:`planner.routing`) and the simulator (:mod:`planner.simulator.routers`) share this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from typing import Generic, TypeVar

from .errors import PlannerError

__all__ = ["IWRR", "smooth_pick"]

#: A candidate of a round-robin pick: a node id, a replica's index, ...
_C = TypeVar("_C", bound=Hashable)


def smooth_pick(
    weights: Mapping[_C, float],
    current: MutableMapping[_C, float],
    allowed: Callable[[_C], bool] | None = None,
) -> _C | None:
    """One smooth weighted round-robin pick among ``weights``' keys (candidates with weight <= 0 or failing
    ``allowed`` sit the round out); ``current`` holds the running values and is updated. None when no
    candidate may be picked."""
    total = 0.0
    winner: tuple[_C, float] | None = None  # (candidate, its running value)
    for candidate, weight in weights.items():
        if weight <= 0 or (allowed is not None and not allowed(candidate)):
            continue
        value = current.get(candidate, 0.0) + weight
        current[candidate] = value
        total += weight
        if winner is None or value > winner[1]:
            winner = (candidate, value)
    if winner is None:
        return None
    best, best_value = winner
    current[best] = best_value - total
    return best


class IWRR(Generic[_C]):
    """One interleaved weighted round-robin scheduler with its own running values: picks ``candidates``
    (distinct, hashable) in proportion to ``weights``; candidates failing ``allowed`` are skipped for that
    pick (Helix §5.1, §5.2: masked nodes)."""

    def __init__(self, candidates: Sequence[_C], weights: Sequence[float]) -> None:
        if len(candidates) != len(weights):
            raise PlannerError("IWRR needs one weight per candidate", code="bad_weights")
        if any(w < 0 or not math.isfinite(w) for w in weights):
            raise PlannerError("IWRR weights must be finite and non-negative", code="bad_weights")
        if len(set(candidates)) != len(candidates):
            raise PlannerError("IWRR candidates must be distinct", code="bad_weights")
        self.candidates: list[_C] = list(candidates)
        self.weights: dict[_C, float] = {c: float(w) for c, w in zip(candidates, weights, strict=True)}
        self.current: dict[_C, float] = {}

    def pick(self, allowed: Callable[[_C], bool] | None = None) -> _C | None:
        """The next candidate, or None when every candidate with weight fails ``allowed``."""
        return smooth_pick(self.weights, self.current, allowed)
