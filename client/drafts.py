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
  after a pass whose drafts were all accepted the next may draft 2 more,
  up to `prompt_lookup_num_tokens`; after a rejection it drafts one more than were accepted. On text where
  lookups are rarely right (open chat) passes shrink to one draft, so a wrong guess costs a node one token of
  compute, not k.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    CandidateGenerator,
    MTPCandidateGenerator,
)


class SwarmDrafts(CandidateGenerator):
    """`inner`'s drafts, bounded to `max_length` and, with `paced` (prompt lookup), paced by how many were
    accepted (see the module's docstring)."""

    def __init__(self, inner: CandidateGenerator, max_length: int, *, paced: bool):
        self.inner = inner
        self.max_length = max_length
        self.requires_model_outputs = inner.requires_model_outputs
        self.most: int | None = getattr(inner, "num_output_tokens", None) if paced else None
        self.limit = self.most  # how many the next pass may draft (None: as many as `inner` gives)
        self.drafted = 0  # how many the last pass drafted

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
        if self.limit is not None:
            keep = min(keep, self.limit)
        if keep < candidates.shape[1] - length:
            candidates = cast(torch.LongTensor, candidates[:, :length + keep])
            if logits is not None:
                logits = logits[:, :keep]
        self.drafted = candidates.shape[1] - length
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)
        if self.most is None or self.limit is None or not self.drafted:
            return
        if int(num_matches) >= self.drafted:
            self.limit = min(self.most, self.limit + 2)
        else:
            self.limit = max(1, int(num_matches) + 1)

    def keep_schedule(self) -> None:
        """After a generation: a draft model on `transformers`' heuristic schedule keeps the draft length it
        reached for the next call, as `transformers` does when its own generator is not wrapped."""
        inner = self.inner
        if isinstance(inner, AssistedCandidateGenerator) and not isinstance(inner, MTPCandidateGenerator) \
                and inner.assistant_model.generation_config.num_assistant_tokens_schedule == "heuristic":
            inner.assistant_model.generation_config.num_assistant_tokens = inner.num_assistant_tokens
