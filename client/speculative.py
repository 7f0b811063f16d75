"""Speculative passes pipelined through the swarm: the next pass is sent while the one ahead of it is being verified.

`transformers`' assisted generation runs one verification pass at a time: draft, run the drafts through the model,
keep the ones it agrees with, draft again. Through a route of nodes each pass crosses every hop in turn, and while
the last node computes, the others wait for the next pass. `PipelinedDecoding` keeps them busy (PipeInfer: Butler et
al. 2024, "PipeInfer: Accelerating LLM Inference using Asynchronous Pipelined Speculation"; and the pipelined
verification chunks of decentralised speculative decoding): while drafts are being accepted whole, the client sends
the next pass before the one ahead of it is back, on drafts that continue the drafts in flight (prompt lookup reads
the text as it would be if they were right), up to `ClientConfig.speculative_passes` passes in flight. Each node
runs a session's passes in the order they came and pushes each on as soon as it is computed
(`client.transports.PipelinedPush`), so node 1 runs pass j + 1 while node 3 runs pass j.

When pass j comes back, its logits verify its own drafts and the first token of pass j + 1 (the one after pass j's
last). At the first draft the model does not choose, the model's token is taken instead, and every pass in flight
behind it is given up (`InferenceSession.discard_ahead`): the nodes still run it, its answers are dropped, and the
next pass continues from before its tokens, so every node rolls its KV cache back (as after `rewind`).

Output. Every token is chosen from the model's logits at its position as `transformers`' assisted generation
chooses it for drafts without draft probabilities (prompt lookup): the logits processors on the accepted tokens
before it, then the largest logit, or with `do_sample` a sample of the processed distribution; a draft is kept only
when it equals that choice. So greedy output is plain greedy output token for token, and sampled output is
distributed as plain sampling: each token takes one draw from the random generator, as in plain sampling, so with
the same seed (and the same logits) it is plain sampling's output token for token. The stopping criteria are checked after every token, so generation ends where plain
decoding ends (not a pass later).

Pacing. Drafts per pass are paced as `client.drafts.SwarmDrafts` paces `transformers`' loop (`DraftPace`: 2 more
after a pass accepted whole, up to `prompt_lookup_num_tokens`, one more than were accepted after a rejection, and
within that as many as pay for what they cost, by the passes timed alone in flight); passes are sent ahead only after a pass accepted whole, so on text where lookups are seldom right (open chat) one pass is in flight
and a wrong guess costs the nodes its tokens, not a pipeline of them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmnode.client.drafts import DraftPace
from swarmnode.client.session import InferenceSession
from swarmnode.runtime.model_ends import ModelEnds

logger = logging.getLogger(__name__)

#: Drafts `k` tokens after a sequence (1, L): a list of at most `k` token ids (none when nothing is found).
Drafter = Callable[[torch.Tensor, int], list[int]]


@dataclass
class _Pass:
    """A verification pass: the token ids it sends, from position `start` on, and how many of them are drafts
    (all of them for a pass sent ahead; all but the first, the last accepted token, for the first in flight)."""

    tokens: list[int]
    start: int
    drafts: int
    sent: float | None = None  # when it was sent, if nothing else was in flight then (its time is its cost)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its token ids and their positions, (1, n) each."""
        return (torch.tensor([self.tokens], dtype=torch.long),
                torch.arange(self.start, self.start + len(self.tokens)).unsqueeze(0))


class PipelinedDecoding:
    """One generation's decoding loop (see the module's docstring), batch size 1, in `session`."""

    def __init__(self, ends: ModelEnds, session: InferenceSession, drafter: Drafter, *, most: int, passes: int,
                 max_length: int, logits_processor, stopping_criteria, do_sample: bool, streamer=None):
        self.ends = ends
        self.session = session
        self.drafter = drafter
        self.pace = DraftPace(most)  # drafts the next pass may take
        self.passes = passes
        # tokens are sent at positions below this: their logits choose a token inside the generation and the session
        self.room = min(max_length - 1, session.max_length)
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.do_sample = do_sample
        self.streamer = streamer
        self.ids: list[int] = []  # the accepted tokens
        self.unverified: list[int] = []  # tokens sent after the accepted ones, not verified yet
        self.flight: deque[_Pass] = deque()  # passes sent ahead and not collected, oldest first
        self.whole = False  # the last pass verified was accepted whole: passes may be sent ahead
        self.done = False

    # --- the loop ----------------------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, first: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """Generate after `input_ids` (1, L). `first(candidates, keep)` runs the first pass (the prompt and its
        drafts) through the model and returns the logits of its last `keep` tokens: the model's own forward,
        which continues a session that holds part of the prompt and may hand the prompt to prefill nodes."""
        try:
            self._run(input_ids, first)
        except BaseException:
            # nothing sent ahead may count after a failure, a caller's exception (a streamer's, a stopping
            # criterion's) or an interrupt: a session continued later starts from what it holds
            self.session.discard_ahead()
            raise
        return torch.tensor([self.ids], dtype=torch.long)

    def _run(self, input_ids: torch.Tensor, first: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        self.ids = input_ids[0].tolist()
        drafts = self._draft(self.ids, self._fits(len(self.ids)))
        candidates = torch.tensor([self.ids + drafts], dtype=torch.long)
        logits = first(candidates, len(drafts) + 1)
        self.unverified = list(drafts)
        self._verify(logits[0], len(self.ids) - 1, len(drafts))
        while not self.done:
            self._fill()
            if self.done:
                break
            if not self.flight:  # nothing could be sent ahead (a route to replay first): one pass now
                self._pass_now()
                continue
            output = self.session.collect()
            sent = self.flight.popleft()
            if sent.sent is not None and output is not None and not self.flight:
                self.pace.timed(sent.drafts, time.perf_counter() - sent.sent)
            if output is None:  # lost to a failure with the others in flight: the route is rebuilt
                logger.info("speculative passes in flight were lost to a failure: sending them again")
                self.flight.clear()
                self.unverified = []
                continue
            self._verify(self._logits(sent, output), sent.start, sent.drafts)
        self._finish()

    def _fill(self) -> None:
        """Send passes until `passes` are in flight, or drafts run out, or the last pass was not accepted whole."""
        while len(self.flight) < self.passes and self.session.can_send_ahead():
            if not self.flight:
                sent = self._head()
            else:
                if not self.whole:
                    return
                start = len(self.ids) + len(self.unverified)
                drafts = self._draft(self.ids + self.unverified, self._fits(start))
                if not drafts:
                    return
                sent = _Pass(drafts, start, len(drafts))
            assert sent.start == self.session.position + self.session.tokens_ahead, "passes continue one another"
            if not self.flight and not self.session.steps_in_flight:
                sent.sent = time.perf_counter()
            ids, positions = sent.inputs()
            self.session.send_ahead(self.ends.hidden_in(input_ids=ids, position_ids=positions), positions,
                                    torch.ones_like(ids))
            self.flight.append(sent)
            self.unverified.extend(sent.tokens[len(sent.tokens) - sent.drafts:])

    def _head(self) -> _Pass:
        """A pass of the last accepted token, at the session's end, and drafts after it."""
        start = len(self.ids) - 1
        drafts = self._draft(self.ids, self._fits(start + 1))
        return _Pass([self.ids[-1], *drafts], start, len(drafts))

    def _pass_now(self) -> None:
        """The last accepted token and its drafts as one plain step (after a route was rebuilt: it replays the
        session's inputs first)."""
        sent = self._head()
        ids, positions = sent.inputs()
        output = self.session.step(self.ends.hidden_in(input_ids=ids, position_ids=positions), positions,
                                   torch.ones_like(ids))
        self.unverified = sent.tokens[1:]
        self._verify(self._logits(sent, output), sent.start, sent.drafts)

    # --- verification ------------------------------------------------------------------------------------------
    def _verify(self, logits: torch.Tensor, start: int, drafts: int) -> None:
        """Verify with `logits` (n, V), the logits at positions `start`, `start` + 1, ... of a pass that carried
        `drafts` drafts: each chooses the token after its position, and a token sent there is kept when it is
        that one (see the module's docstring). The last row verifies the first token of the next pass in flight,
        or chooses the token the next pass starts with."""
        new: list[int] = []
        accepted = 0
        rejected = False
        for row, position in enumerate(range(start, start + logits.shape[0])):
            assert position == len(self.ids) - 1, "a pass's logits are read from its first accepted token on"
            chosen = self._choose(logits[row])
            self.ids.append(chosen)
            new.append(chosen)
            if self.unverified and self.unverified[0] == chosen:
                self.unverified.pop(0)
                accepted += 1
            elif self.unverified:  # the model chose another token: whatever was sent after it is given up
                rejected = True
                self._reject()
            if self._stopped():
                self.done = True
                break
            if rejected:
                break
        # the drafts ruled on here: the pass's own after its first (a pass sent ahead had its first ruled on by
        # the pass before) and the next pass's first, each kept or, the first wrong one, rejected
        self.pace.passed(accepted + rejected, accepted)
        self.whole = bool(drafts or accepted) and not rejected
        if self.streamer is not None and new:
            self.streamer.put(torch.tensor(new, dtype=torch.long))

    def _reject(self) -> None:
        """Every token sent after the last accepted one is given up: the passes in flight are discarded and the
        session taken back to the accepted tokens but the last (which the next pass sends)."""
        self.unverified = []
        self.flight.clear()
        self.session.discard_ahead()
        keep = len(self.ids) - 1
        if self.session.position > keep:
            self.session.rewind(keep)

    def _choose(self, row: torch.Tensor) -> int:
        """The model's token after the accepted ones, from its logits there (`transformers`' assisted generation:
        the processors on the accepted prefix, then argmax or a sample)."""
        scores = row.to(torch.float32).unsqueeze(0)
        if len(self.logits_processor) > 0:
            scores = self.logits_processor(torch.tensor([self.ids], dtype=torch.long), scores)
        if self.do_sample:  # one draw a token, as plain sampling draws (`GenerationMixin._sample`)
            return int(torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1)[0, 0])
        return int(scores[0].argmax())

    def _stopped(self) -> bool:
        return bool(self.stopping_criteria(torch.tensor([self.ids], dtype=torch.long), None).all())

    def _finish(self) -> None:
        """Leave the session as `transformers`' loop does: every accepted token but the last in the cache, nothing
        in flight that counts."""
        self._reject()
        if self.streamer is not None:
            self.streamer.end()

    # --- drafts and logits -------------------------------------------------------------------------------------
    def _fits(self, position: int) -> int:
        """How many drafts fit from `position` on: the paced limit, within `room`."""
        return max(0, min(self.pace.allowed(), self.room - position))

    def _draft(self, sequence: list[int], limit: int) -> list[int]:
        if limit <= 0:
            return []
        return self.drafter(torch.tensor([sequence], dtype=torch.long), limit)[:limit]

    def _logits(self, sent: _Pass, output: torch.Tensor) -> torch.Tensor:
        """The logits (n, V) of a pass's tokens from the last block's output for them."""
        ids, positions = sent.inputs()
        return self.ends.logits(lambda _: output, input_ids=ids, position_ids=positions)[0]
