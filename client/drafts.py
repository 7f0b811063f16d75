"""Drafts for speculative decoding through the swarm: `transformers`' own candidate generators, bounded and paced.

Assisted generation (`generate(assistant_model=...)` or `generate(prompt_lookup_num_tokens=...)`) asks a
candidate generator for draft tokens, runs them through the model as one pass and keeps the ones the model
agrees with (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; prompt lookup:
Saxena 2023). Through the swarm a pass of k drafts costs every node k + 1 tokens of compute and each hop one
round trip, so `SwarmDrafts` wraps prompt lookup's generator with two rules (a draft model's generator
already keeps within the length and paces itself, by `num_assistant_tokens_schedule`):

- **Bounded**: no draft reaches past `max_length - 1` tokens (the bonus token of the pass fills the last
  place). Prompt lookup may otherwise propose tokens past the generation's end, which no session has room
  for (its nodes reserved the cache for `max_length` tokens) and which would be thrown away anyway.
- **Paced**: after a pass whose drafts were all accepted the next may draft 2 more,
  up to `prompt_lookup_num_tokens`; after a rejection it drafts one more than were accepted. On text where
  lookups are rarely right (open chat) passes shrink to one draft, so a wrong guess costs a node one token of
  compute, not k.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.generation.candidate_generator import CandidateGenerator, PromptLookupCandidateGenerator


class SwarmDrafts(CandidateGenerator):
    """Prompt lookup's drafts (`inner`), bounded to `max_length` and paced by how many were accepted (see the
    module's docstring)."""

    def __init__(self, inner: PromptLookupCandidateGenerator, max_length: int):
        self.inner = inner
        self.max_length = max_length
        self.most = inner.num_output_tokens
        self.limit = self.most  # how many the next pass may draft
        self.drafted = 0  # how many the last pass drafted

    # the supertype says a Tensor of draft logits; prompt lookup has none, and generation takes None for it
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor]:
        candidates, logits = self.inner.get_candidates(input_ids, **kwargs)
        length = input_ids.shape[1]
        keep = min(candidates.shape[1] - length, max(self.max_length - 1 - length, 0), self.limit)
        if keep < candidates.shape[1] - length:
            candidates = cast(torch.LongTensor, candidates[:, :length + keep])
        self.drafted = candidates.shape[1] - length
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)
        if not self.drafted:
            return
        if int(num_matches) >= self.drafted:
            self.limit = min(self.most, self.limit + 2)
        else:
            self.limit = max(1, int(num_matches) + 1)
