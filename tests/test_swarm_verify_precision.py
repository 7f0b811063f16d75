"""Verification at the precision nodes serve: a lying bfloat16 peer is caught and banned while honest bfloat16
and int8 peers serve on, checked on every step.

The swarm: three bfloat16 nodes serving all 30 blocks, one of them started with `--inject-fault
corrupt-outputs` (`swarmnode.testing.faults`: it returns every output with 8.0 added to its first 64
dimensions, consistently, from `forward` and from its stream), and two `--quantize int8` nodes. A verifying
client in bfloat16 compares each check with the low-precision rule (`client.agreement`), against replicas of
the checked peer's own kind. Routes are steered by presetting the client's measured round trips.

- The liar on the route: its prefill is checked against the two honest bfloat16 replicas, which agree with
  each other; it is banned and reported, its hop fails over, and the text equals what an honest bfloat16
  route gives.
- Honest bfloat16 and int8 routes, every step checked: every check agrees, nobody is banned, and the text
  equals what the same route gives without verification.
"""

from __future__ import annotations

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.client.agreement import tolerance_for
from swarmnode.client.verify import Outcome
from swarmnode.testing.faults import ALLOW_ENV
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

NEW_TOKENS = 12
BF16 = ["--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("swarm-verify-precision"),
                    env={ALLOW_ENV: "1"}) as swarm:
        swarm.start_bootstrap()
        swarm.nodes = {
            "bf16-a": swarm.start_node(0, 30, name="bf16-a", wait=False, extra=BF16),
            "bf16-b": swarm.start_node(0, 30, name="bf16-b", wait=False, extra=BF16),
            "bf16-liar": swarm.start_node(0, 30, name="bf16-liar", wait=False,
                                          extra=[*BF16, "--inject-fault", "corrupt-outputs"]),
            "int8-a": swarm.start_node(0, 30, name="int8-a", wait=False, extra=[*BF16, "--quantize", "int8"]),
            "int8-b": swarm.start_node(0, 30, name="int8-b", wait=False, extra=[*BF16, "--quantize", "int8"]),
        }
        for node in swarm.nodes.values():
            swarm.wait_serving(node)
        yield swarm


def _peer(swarm, name: str) -> str:
    return swarm.nodes[name].peer_id


def _client(swarm, model_dir, first: str, **settings):
    """A bfloat16 client whose route starts on node `first` (its measured round trip preset lowest)."""
    remote = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         dtype=torch.bfloat16, **settings)
    remote.swarm.rtts.update({peer: 1.0 for peer in (p.peer_id for p in swarm.nodes.values())})
    remote.swarm.rtts[_peer(swarm, first)] = 0.001
    return remote


def _generate(remote, input_ids):
    with remote.inference_session(max_length=input_ids.shape[1] + NEW_TOKENS) as session:
        output = remote.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        peers = {h.hop.peer_id for h in session.hops}
    return output, session, peers


def test_a_lying_bfloat16_peer_is_caught_banned_and_the_text_is_exact(swarm, model_dir, chat_prompts):
    liar = _peer(swarm, "bf16-liar")
    honest = {_peer(swarm, "bf16-a"), _peer(swarm, "bf16-b")}
    with _client(swarm, model_dir, "bf16-liar", verify=0.25, verify_seed=3,
                 exclude_peers=frozenset({_peer(swarm, "int8-a"), _peer(swarm, "int8-b")})) as remote:
        output, session, peers = _generate(remote, chat_prompts[0])
        results = session.verifier.results
        assert results[0].hop.peer_id == liar and results[0].outcome == Outcome.WRONG, results[0]
        assert results[0].blamed == [liar] and results[0].max_diff > tolerance_for("bfloat16", 30)
        assert set(p for o in results[0].opinions for p in o) == {liar, *honest}
        assert all(r.outcome == Outcome.AGREED and not r.blamed for r in results[1:]), results
        assert peers <= honest and liar in remote.swarm.banned() and set(remote.swarm.diverged) == {liar}
        assert remote.swarm.reports_stored == 1
    with _client(swarm, model_dir, "bf16-a",
                 exclude_peers=frozenset({liar, _peer(swarm, "int8-a"), _peer(swarm, "int8-b")})) as remote:
        honest_text, _, _ = _generate(remote, chat_prompts[0])
    assert torch.equal(output, honest_text)
    report = swarm.status()["reports"][liar]
    assert report["reporters"] == 1 and report["tolerance"] == tolerance_for("bfloat16", 30)


@pytest.mark.parametrize("first,kind", [("bf16-a", "bfloat16"), ("int8-a", "bfloat16+int8")])
def test_honest_low_precision_peers_pass_every_check(swarm, model_dir, chat_prompts, first, kind):
    liar = _peer(swarm, "bf16-liar")
    with _client(swarm, model_dir, first, verify=1.0, exclude_peers=frozenset({liar})) as remote:
        output, session, peers = _generate(remote, chat_prompts[1])
        results = session.verifier.results
        assert peers == {_peer(swarm, first)}
        assert len(results) == NEW_TOKENS  # the prefill and every later step
        assert all(r.outcome == Outcome.AGREED and not r.blamed for r in results), results
        assert all(r.max_diff <= tolerance_for(kind, 30) for r in results)
        assert not remote.swarm.banned() - {liar} and not remote.swarm.diverged
    with _client(swarm, model_dir, first, exclude_peers=frozenset({liar})) as remote:
        unverified, _, _ = _generate(remote, chat_prompts[1])
    assert torch.equal(output, unverified)
