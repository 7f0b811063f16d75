"""Drafts for speculative decoding through the swarm: `transformers`' own candidate generators, bounded and paced.

Assisted generation (`generate(assistant_model=...)` or `generate(prompt_lookup_num_tokens=...)`) asks a
candidate generator for draft tokens, runs them through the model as one pass and keeps the ones the model
agrees with (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; prompt lookup:
Saxena 2023). Through the swarm a pass of k drafts costs every node k + 1 tokens of compute and each hop one
round trip, so `SwarmDrafts` wraps the generator `transformers` chose with two rules:

- **Bounded**: no draft reaches past `max_length - 1` tokens, the generation's length or the session's,
  whichever is smaller (the bonus token of the pass fills the last place). Prompt lookup may otherwise
  propose tokens past the generation's end, and a draft model past a session opened shorter than the
  generation may run: no session has room for them (its nodes reserved the cache for its `max_length`).
- **Paced** (prompt lookup; a draft model keeps `transformers`' own pace, `num_assistant_tokens_schedule`):
  `DraftPace`. After a pass whose drafts were all accepted the next may draft 2 more, up to
  `prompt_lookup_num_tokens`; after a rejection, one more than were accepted. Within that limit a pass drafts as
  many as pay for themselves: the pace keeps running estimates of what a pass costs (seconds without drafts, and
  per draft: on a CPU node every token of a pass is compute) and of how often a draft is accepted, and takes the
  number of drafts k that gives the most tokens a second, (1 + a + ... + a^k) / (t0 + k t1) for acceptance a
  (each draft kept only if the ones before it were). When that is none, or after two passes in a row whose
  drafts were all rejected, passes draft nothing for a while (2 passes, doubling up to 32 while it goes on), then
  one pass drafts again to see whether the text has changed. On text where lookups are rarely right (open chat)
  most passes then carry one token, as plain decoding does.
"""

from __future__ import annotations

import time
from typing import cast

import torch
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    CandidateGenerator,
    MTPCandidateGenerator,
)


class DraftPace:
    """How many drafts the next pass may take, from how the last ones fared and what passes cost (see the module's
    docstring)."""

    REST_FIRST = 2  # passes without drafts when drafting does not pay or two passes' drafts were all rejected
    REST_MOST = 32
    KEEP = 0.9  # the weight of the past in the running estimates, a pass at a time
    JUDGED_ENOUGH = 4.0  # drafts judged (decayed) before the acceptance estimate decides

    def __init__(self, most: int):
        self.most = max(1, most)
        self.limit = self.most
        self.misses = 0  # passes in a row whose drafts were all rejected
        self.rest = 0  # passes left that draft nothing
        self.rest_next = self.REST_FIRST
        self.probe = False  # the next pass drafts whatever the estimates say (a rest just ended)
        self.plain: float | None = None  # seconds of a pass without drafts
        self.per_draft: float | None = None  # seconds a draft adds to a pass
        self.kept = 0.0  # drafts accepted, decayed
        self.judged = 0.0  # drafts the model ruled on (accepted, or the first rejected one), decayed

    def allowed(self) -> int:
        """Drafts the next pass may take (none pays by the estimates: a rest begins)."""
        if self.rest > 0:
            return 0
        if self.probe or self.plain is None or self.per_draft is None or self.judged < self.JUDGED_ENOUGH:
            return self.limit
        best = self.best(self.limit)
        if best == 0:
            self._rest()
        return best

    def best(self, limit: int) -> int:
        """The number of drafts, up to `limit`, with the most tokens a second by the estimates."""
        assert self.plain is not None and self.per_draft is not None, "passes were timed"
        accept = self.kept / self.judged if self.judged else 0.0
        plain, per_draft = self.plain, self.per_draft

        def rate(k: int) -> float:
            return sum(accept ** i for i in range(k + 1)) / (plain + per_draft * k)

        return max(range(limit + 1), key=lambda k: (rate(k), -k))

    def timed(self, drafted: int, seconds: float) -> None:
        """A pass that carried `drafted` drafts took `seconds` (nothing else in flight meanwhile)."""
        if seconds <= 0:
            return
        if not drafted:
            self.plain = seconds if self.plain is None else self.KEEP * self.plain + (1 - self.KEEP) * seconds
        elif self.plain is not None:
            extra = max(0.0, seconds - self.plain) / drafted
            self.per_draft = extra if self.per_draft is None else self.KEEP * self.per_draft + (1 - self.KEEP) * extra

    def passed(self, drafted: int, accepted: int) -> None:
        """A pass that carried `drafted` drafts was verified and kept `accepted` of them."""
        if not drafted:
            if self.rest > 0:
                self.rest -= 1
                self.probe = self.rest == 0
            return
        self.probe = False
        self.kept = self.KEEP * self.kept + accepted
        self.judged = self.KEEP * self.judged + accepted + (accepted < drafted)
        if accepted >= drafted:
            self.limit = min(self.most, self.limit + 2)
        else:
            self.limit = max(1, accepted + 1)
        if accepted:
            self.misses, self.rest_next = 0, self.REST_FIRST
            return
        self.misses += 1
        if self.misses >= 2:
            self._rest()

    def _rest(self) -> None:
        self.misses, self.rest = 0, self.rest_next
        self.rest_next = min(self.REST_MOST, self.rest_next * 2)


class SwarmDrafts(CandidateGenerator):
    """`inner`'s drafts, bounded to `max_length` and, with `paced` (prompt lookup), paced by how many were
    accepted (see the module's docstring)."""

    def __init__(self, inner: CandidateGenerator, max_length: int, *, paced: bool):
        self.inner = inner
        self.max_length = max_length
        self.requires_model_outputs = inner.requires_model_outputs
        most: int | None = getattr(inner, "num_output_tokens", None) if paced else None
        self.pace = DraftPace(most) if most is not None else None  # None: as many as `inner` gives
        self.most = most
        self.drafted = 0  # how many the last pass drafted
        self.asked: float | None = None  # when the last pass's drafts were asked for (its pass began)
        self.passes = 0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a pass drafts (transformers 5.25 asks, to size what the cache records per pass)."""
        inner = getattr(self.inner, "num_drafting_tokens", None)
        return int(inner if inner is not None else self.most or 0)

    @property
    def model_kwargs_overrides(self):
        """What a generator that needs the model's outputs asks the model for (`requires_model_outputs`)."""
        return getattr(self.inner, "model_kwargs_overrides", {})

    # the supertype says a Tensor of draft logits; prompt lookup has none, and generation takes None for it
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor]:
        candidates, logits = self.inner.get_candidates(input_ids, **kwargs)
        length = input_ids.shape[1]
        keep = min(candidates.shape[1] - length, max(self.max_length - 1 - length, 0))
        if self.pace is not None:
            keep = min(keep, self.pace.allowed())
        if keep < candidates.shape[1] - length:
            candidates = cast(torch.LongTensor, candidates[:, :length + keep])
            if logits is not None:
                logits = logits[:, :keep]
        self.drafted = candidates.shape[1] - length
        self.passes += 1
        self.asked = time.perf_counter() if self.passes > 1 else None  # the first pass is the prompt's: not timed
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)
        if self.pace is not None:
            if self.asked is not None:
                self.pace.timed(self.drafted, time.perf_counter() - self.asked)
            self.pace.passed(self.drafted, min(int(num_matches), self.drafted))

    def keep_schedule(self) -> None:
        """After a generation: a draft model on `transformers`' heuristic schedule keeps the draft length it
        reached for the next call, as `transformers` does when its own generator is not wrapped."""
        inner = self.inner
        if isinstance(inner, AssistedCandidateGenerator) and not isinstance(inner, MTPCandidateGenerator) \
                and inner.assistant_model.generation_config.num_assistant_tokens_schedule == "heuristic":
            inner.assistant_model.generation_config.num_assistant_tokens = inner.num_assistant_tokens
