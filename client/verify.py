"""Verifying peers: re-running steps on other replicas and comparing the hidden states.

A client with `ClientConfig.verify` > 0 checks the first step of every hop it opens (the prefill, and the
replay into a replacement peer: a peer that corrupts everything would otherwise poison the first tokens
before a sampled check caught it) and a sampled share `verify` of later steps, drawn from a per-session
RNG (`verify_seed`, or a fresh seed the session logs, so a run can be reproduced). A check sends the hop's
whole input so far (every token the peer has cached plus this step's) to another replica, or a chain of
replicas covering the same blocks and excluding the checked peer, through the stateless `forward` RPC, and
compares the outputs at this step's tokens. Cost: one check is a prefill of the sequence so far on the
verifying replica, and the step waits for it.

The replicas asked serve the checked peer's own kind (`records.served_kind`: its dtype and quantization),
since another kind rounds differently, and the comparison is the kind's (`client.agreement.rule_for`):
- float32 hops whose outputs travel in float32: two outputs agree when no element differs by more than
  `verify_tolerance` relative to its token's scale (`agreement.max_difference`; float32 replicas differ only by
  the order of their sums: batching, cached against full attention; `DEFAULT_TOLERANCE` has the
  measurements);
- bfloat16, float16 and quantized hops (and float32 ones read in a lower precision): within the kind's
  tolerance of `agreement.trimmed_distance`, measured on honest pairs and tampered peers by
  `scripts/bench_verification.py`. Honest replicas of these kinds differ by about 2% of every element, so a
  change smaller than that (a slightly wrong weight) cannot be told from rounding by any one check.

On a mismatch the client asks further replicas, each run excluding every peer that gave an opinion so far,
until two independent opinions agree (at most `MAX_OPINIONS` in all), then `judge` decides:
- the answer two opinions agree on is right, and every opinion that differs from it is wrong;
- a wrong opinion from one peer blames that peer; a wrong chain of several peers is narrowed down hop by
  hop, re-running each hop's input on the winning side's peers (`Verifier._blame_chain`);
- blamed peers are banned for good and reported in the DHT (`SwarmView.report`). When the checked peer is
  wrong the session fails that hop over as for any failed peer, replaying its history into the
  replacement (whose first step is checked again), so the text produced stays the local one.
With no third opinion (two replicas that disagree and no other), outputs alone cannot say which is right.
The client then asks the checked peer to recompute the same input with `forward`: if that disagrees with
what its own stream returned, the peer contradicts itself (an honest peer's cached and stateless paths
agree within the tolerance) and the verifier's answer is preferred. Otherwise the step fails (`UNRESOLVED`,
an error naming both peers): the client never goes on with an answer it knows is disputed, and bans no one
it cannot show wrong.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from hivemind.utils import get_dht_time

from swarmnode.client.agreement import Rule, max_difference, rule_for
from swarmnode.client.errors import RemoteError
from swarmnode.client.routing import Hop, NoRouteError, shortest_route
from swarmnode.errors import SwarmError
from swarmnode.naming import short_id
from swarmnode.records import ReportRecord

if TYPE_CHECKING:
    from swarmnode.client.swarm import SwarmView

logger = logging.getLogger(__name__)

# The largest `max_difference` between two replicas' outputs that still counts as agreeing. Measured on
# SmolLM2-135M (float32, CPU, greedy chat generations of 24 tokens with every step checked: 1, 4 and 6
# concurrent sessions, a left-padded batch of 3, hops [0, 30) and [0, 12) + [12, 30)): honest replicas differ
# by at most 1.1e-5 (9.5e-4 absolute, at the last block whose elements reach ~50; middle blocks reach
# ~25,000). 1e-3 leaves a margin of ~90x; the fault-injection offset (`swarmnode.testing.faults`) scores
# ~1e-2 in the middle blocks and ~0.13 at the last. Lower precision or other models may need more
# (`ClientConfig.verify_tolerance`).
DEFAULT_TOLERANCE = 1e-3
MIXED = "mixed"  # a peer whose spans announce different kinds
MAX_OPINIONS = 4  # the checked peer's and up to three other replicas'
FORWARD_TOKEN_LIMIT = 4096  # batch x tokens a node runs in one stateless forward (SessionLimits.max_forward_tokens)
MAX_FORWARD_FAILURES = 3  # replicas that may fail to answer before one opinion is given up


class Outcome(str, enum.Enum):
    AGREED = "agreed"  # the checked output is right (other opinions found wrong are blamed and reported)
    WRONG = "wrong"  # the checked peer's output is wrong: it is banned and reported; re-run the step
    UNCHECKED = "unchecked"  # no other replica could check it (none serves these blocks, or all failed)
    UNRESOLVED = "unresolved"  # opinions disagree and none has an independent second: the step must fail


def should_check(rng: random.Random, share: float, first: bool) -> bool:
    """Check the first step of a hop always; a later one with probability `share` (one draw per later step,
    so the pattern depends only on the seed and the steps, not on failovers)."""
    if share <= 0:
        return False
    if first:
        return True
    return rng.random() < share


@dataclass(frozen=True)
class Verdict:
    """What a set of opinions says: `accepted` is an opinion at least one independent other agrees with
    (None: no such opinion, or two groups of equal support disagree), `wrong` the opinions that differ
    from it, `differences[i]` opinion i's largest difference from the accepted one."""

    accepted: int | None
    agreeing: tuple[int, ...]
    wrong: tuple[int, ...]
    differences: tuple[float, ...]


def judge(outputs: list[torch.Tensor], tolerance: float, distance=max_difference) -> Verdict:
    """Decide between opinions (independent computations of the same thing, index 0 the checked peer's).

    Opinion i's support is the opinions within `tolerance` of it (itself included). The best supported one
    is accepted when at least two opinions support it and no opinion outside its support has as much: two
    disjoint groups of equal size are a dispute, not a decision."""
    count = len(outputs)
    diff = [[0.0 if i == j else distance(outputs[i], outputs[j]) for j in range(count)] for i in range(count)]
    support = [tuple(j for j in range(count) if diff[i][j] <= tolerance) for i in range(count)]
    best = max(range(count), key=lambda i: (len(support[i]), -i)) if count else None
    undecided = Verdict(None, (), (), tuple(float("nan") for _ in range(count)))
    if best is None or len(support[best]) < 2:
        return undecided
    if any(len(support[i]) >= len(support[best]) for i in range(count) if i not in support[best]):
        return undecided
    wrong = tuple(i for i in range(count) if i not in support[best])
    return Verdict(best, support[best], wrong, tuple(diff[best]))


@dataclass
class Opinion:
    """One computation of a hop: the peers that made it, its output at the compared tokens, and for a
    chain run here every hop's (hop, input hidden states, output hidden states) to narrow blame down."""

    peers: tuple[str, ...]
    output: torch.Tensor
    trace: list[tuple[Hop, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class CheckResult:
    outcome: Outcome
    hop: Hop
    max_diff: float  # the checked output's largest difference from the accepted answer (or from the other)
    message: str = ""
    blamed: list[str] = field(default_factory=list)
    opinions: list[tuple[str, ...]] = field(default_factory=list)


# forward(peer_id, start, end, hidden, position_ids, attention_mask) -> output hidden states; raises
# RemoteError when the peer fails, refuses or does not answer (`client.hops.forward_rpc`)
Forward = Callable[[str, int, int, torch.Tensor, torch.Tensor, torch.Tensor], Awaitable[torch.Tensor]]


class Verifier:
    """Checks one session's steps (`check`) against other replicas reached through `forward`."""

    def __init__(self, swarm: SwarmView, forward: Forward, *, share: float, tolerance: float, seed: int):
        self.swarm = swarm
        self.forward = forward
        self.share = share
        self.tolerance = tolerance
        self.seed = seed
        self.rng = random.Random(seed)
        self.results: list[CheckResult] = []
        self.agreeing_diff = 0.0  # the largest difference between outputs judged to agree (honest noise)
        self._unchecked_logged: set[tuple[int, int]] = set()

    def wants(self, first: bool) -> bool:
        return should_check(self.rng, self.share, first)

    @property
    def checks(self) -> int:
        return sum(1 for r in self.results if r.outcome != Outcome.UNCHECKED)

    async def check(self, hop: Hop, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    output: torch.Tensor) -> CheckResult:
        """Check `output`, what `hop.peer_id` returned for the last `output.shape[1]` tokens of `hidden` (the
        hop's whole input so far). Blamed peers are banned and reported before this returns."""
        result = await self._check(hop, hidden, positions, mask, output)
        self.results.append(result)
        return result

    async def _check(self, hop, hidden, positions, mask, output) -> CheckResult:
        tokens = output.shape[1]
        if hidden.shape[0] * hidden.shape[1] > FORWARD_TOKEN_LIMIT:
            return self._unchecked(hop, f"{hidden.shape[0]} x {hidden.shape[1]} tokens exceed what one stateless "
                                        f"forward may carry ({FORWARD_TOKEN_LIMIT})")
        kind = self._kind(hop)
        if kind == MIXED:
            return self._unchecked(hop, f"{short_id(hop.peer_id)} announces these blocks in different kinds: no "
                                        f"replica of its kind can be told")
        if kind is None:
            return self._unchecked(hop, f"no record of {short_id(hop.peer_id)} serving these blocks is in view: its "
                                        f"kind (dtype, quantization) is unknown")
        rule = rule_for(kind, output.dtype, self.tolerance, hop.end - hop.start)
        opinions = [Opinion((hop.peer_id,), output)]
        used = {hop.peer_id}
        verdict = None
        while len(opinions) < MAX_OPINIONS:
            other = await self._opinion(hop.start, hop.end, hidden, positions, mask, used, kind)
            if other is None:
                break
            used.update(other.peers)
            other.output = other.output[:, -tokens:]
            opinions.append(other)
            verdict = judge([o.output for o in opinions], rule.tolerance, rule.distance)
            if verdict.accepted is not None:
                break
            logger.warning("blocks [%d, %d): outputs of %s differ by up to %.3g (%s, tolerance %.3g); asking "
                           "another replica", hop.start, hop.end, " / ".join(_names(o.peers) for o in opinions),
                           max(_pair_differences(opinions, rule)), rule.name, rule.tolerance)
        peers = [o.peers for o in opinions]
        if len(opinions) == 1:
            return self._unchecked(hop, f"no other replica of its kind ({kind}) serves these blocks")
        assert verdict is not None, "judged once a second opinion came"
        if verdict.accepted is None and len(opinions) == 2:
            return await self._two_disagree(hop, hidden, positions, mask, opinions, rule)
        if verdict.accepted is None:
            return CheckResult(Outcome.UNRESOLVED, hop, rule.distance(opinions[0].output, opinions[1].output),
                               f"blocks [{hop.start}, {hop.end}): {len(opinions)} replicas ({_list(peers)}) computed "
                               f"different hidden states and no two agree within {rule.tolerance:.3g} "
                               f"({rule.name}); stopping rather than going on with a disputed answer", opinions=peers)
        for i in verdict.agreeing:
            if i != verdict.accepted:
                self.agreeing_diff = max(self.agreeing_diff, verdict.differences[i])
        winners = {p for i in verdict.agreeing for p in opinions[i].peers}
        blamed = []
        for i in verdict.wrong:
            blamed += await self._blame(hop, opinions[i], verdict.differences[i], winners, hidden, positions, mask,
                                        rule)
        if 0 in verdict.wrong:
            return CheckResult(Outcome.WRONG, hop, verdict.differences[0],
                               f"returned hidden states for blocks [{hop.start}, {hop.end}) that differ by up to "
                               f"{verdict.differences[0]:.3g} from those of {_list([opinions[i].peers for i in verdict.agreeing])} "
                               f"({rule.name}, tolerance {rule.tolerance:.3g}): banned and reported", blamed, peers)
        return CheckResult(Outcome.AGREED, hop, verdict.differences[0], blamed=blamed, opinions=peers)

    def _unchecked(self, hop: Hop, why: str) -> CheckResult:
        if (hop.start, hop.end) not in self._unchecked_logged:
            self._unchecked_logged.add((hop.start, hop.end))
            logger.warning("cannot verify blocks [%d, %d) served by %s: %s; going on unverified", hop.start, hop.end,
                           short_id(hop.peer_id), why)
        return CheckResult(Outcome.UNCHECKED, hop, float("nan"), why)

    async def _two_disagree(self, hop, hidden, positions, mask, opinions: list[Opinion], rule: Rule) -> CheckResult:
        """Two replicas disagree and no third exists: prefer the other one only if the checked peer
        contradicts itself (its stateless forward of the same input disagrees with its stream's output)."""
        checked, other = opinions
        difference = rule.distance(checked.output, other.output)
        peers = [o.peers for o in opinions]
        try:
            again = await self.forward(hop.peer_id, hop.start, hop.end, hidden, positions, mask)
        except RemoteError as exc:
            again, failure = None, exc
        if again is not None:
            itself = rule.distance(again[:, -checked.output.shape[1]:], checked.output)
            if itself > rule.tolerance:
                blamed = await self._blame(hop, checked, difference, set(other.peers), hidden, positions, mask, rule,
                                           reason="outputs diverged (its own recomputation disagrees)")
                return CheckResult(Outcome.WRONG, hop, difference,
                                   f"returned hidden states for blocks [{hop.start}, {hop.end}) that differ by up to "
                                   f"{difference:.3g} from {_names(other.peers)}'s and by {itself:.3g} from its own "
                                   f"recomputation: banned and reported", blamed, peers)
            why = f"{_names(checked.peers)} recomputes its answer consistently"
        else:
            why = f"{_names(checked.peers)} could not recompute its answer ({failure})"
        return CheckResult(Outcome.UNRESOLVED, hop, difference,
                           f"blocks [{hop.start}, {hop.end}): {_names(checked.peers)} and {_names(other.peers)} "
                           f"computed hidden states that differ by up to {difference:.3g} ({rule.name}, tolerance "
                           f"{rule.tolerance:.3g}), no third replica can say which is right, and {why}; stopping "
                           f"rather than going on with a disputed answer: add a replica of these blocks"
                           f"{', or raise verify_tolerance if both peers are honest' if rule.name == 'max_difference' else ''}",
                           opinions=peers)

    def _kind(self, hop: Hop) -> str | None:
        """What the hop's peer computes its blocks in, as its records of spans covering them say (`MIXED` when
        they disagree, None when the view holds none: a kind is never assumed)."""
        kinds = {s.kind for s in self.swarm.spans.values()
                 if s.peer_id == hop.peer_id and s.start < hop.end and hop.start < s.end}
        return kinds.pop() if len(kinds) == 1 else MIXED if kinds else None

    async def _opinion(self, start: int, end: int, hidden, positions, mask, used: set[str],
                       kind: str) -> Opinion | None:
        """Blocks [start, end) run on a chain of peers serving `kind` (the checked peer's dtype and quantization:
        another kind rounds differently) outside `used`; None when no such chain answers."""
        failures = 0
        while failures < MAX_FORWARD_FAILURES:
            await self.swarm.refresh()
            try:
                replicas = [s for s in self.swarm.spans.values() if s.kind == kind]
                route = shortest_route(replicas, start, end, rtts=self.swarm.rtts,
                                       banned=self.swarm.banned() | frozenset(used))
            except NoRouteError:
                return None
            try:
                return await self._run_chain(route, hidden, positions, mask)
            except _ChainFailed as exc:
                failures += 1
                used.add(exc.peer)
                self.swarm.ban(exc.peer, f"did not answer a verification forward: {exc.cause}")
        return None

    async def _run_chain(self, route: list[Hop], hidden, positions, mask) -> Opinion:
        trace = []
        x = hidden
        for hop in route:
            try:
                out = await self.forward(hop.peer_id, hop.start, hop.end, x, positions, mask)
            except RemoteError as exc:
                raise _ChainFailed(hop.peer_id, exc) from exc
            trace.append((hop, x, out))
            x = out
        return Opinion(tuple(dict.fromkeys(h.peer_id for h in route)), x, trace)

    async def _blame(self, hop: Hop, opinion: Opinion, difference: float, winners: set[str], hidden, positions,
                     mask, rule: Rule, reason: str = "outputs diverged") -> list[str]:
        """Ban and report the peer(s) behind a wrong opinion; returns their ids."""
        if len(opinion.peers) == 1:
            culprits = [(opinion.peers[0], hop.start, hop.end, difference)]
        else:
            culprits = await self._blame_chain(opinion, winners, positions, mask, rule)
            if not culprits:
                logger.warning("blocks [%d, %d): the chain %s computed a wrong answer, but no single peer of it "
                               "could be shown wrong; banning none", hop.start, hop.end, _names(opinion.peers))
        for peer, start, end, diff in culprits:
            logger.warning("peer %s returned wrong hidden states for blocks [%d, %d) (%s %.3g > tolerance %.3g; %s "
                           "agree with each other): banning and reporting it", short_id(peer), start, end, rule.name,
                           diff, rule.tolerance, _names(tuple(winners)))
            record = ReportRecord(peer_id=peer, start=start, end=end, max_diff=min(diff, 1e30),
                                  tolerance=rule.tolerance, reason=reason, reporter=self.swarm.peer_id,
                                  witnesses=sorted(winners)[:8], created=get_dht_time())
            await self.swarm.report(record)
        return [c[0] for c in culprits]

    async def _blame_chain(self, opinion: Opinion, winners: set[str], positions, mask, rule: Rule):
        """The first hop of a wrong chain whose output differs from the recomputation of its input by the
        winners' spans of the rule's kind."""
        spans = [s for s in self.swarm.spans.values() if s.peer_id in winners and s.kind == rule.kind]
        for hop, x, out in opinion.trace:
            try:
                route = shortest_route(spans, hop.start, hop.end, rtts=self.swarm.rtts)
                reference = (await self._run_chain(route, x, positions, mask)).output
            except (NoRouteError, _ChainFailed) as exc:
                logger.warning("cannot re-run blocks [%d, %d) on the agreeing peers: %s", hop.start, hop.end, exc)
                return []
            diff = rule.distance(reference, out)
            if diff > rule.tolerance:
                return [(hop.peer_id, hop.start, hop.end, diff)]
        return []


class _ChainFailed(SwarmError):
    """A peer of a verifying chain failed to answer its `forward` (`cause`): that opinion is given up."""

    code = "verify_forward_failed"

    def __init__(self, peer: str, cause: Exception):
        super().__init__(f"peer {short_id(peer)}: {cause}")
        self.peer, self.cause = peer, cause


def _pair_differences(opinions: list[Opinion], rule: Rule) -> list[float]:
    """Every pair's distance (for logs)."""
    return [rule.distance(a.output, b.output) for i, a in enumerate(opinions) for b in opinions[i + 1:]]


def _names(peers: tuple[str, ...]) -> str:
    return "+".join(short_id(p) for p in peers)


def _list(groups) -> str:
    return ", ".join(_names(tuple(g)) for g in groups)
