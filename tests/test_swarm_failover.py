"""Uneven spans, overlapping replicas, mid-span entry, and a node killed or frozen in the middle of a generation."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from swarmnode.client import ClientConfig, DistributedModelForCausalLM, InferenceSession
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

SPANS = {"a": (0, 7), "b": (5, 19), "c": (19, 30), "full": (0, 30)}


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("swarm-failover")) as swarm:
        swarm.start_bootstrap()
        nodes = {name: swarm.start_node(a, b, name=name, wait=False) for name, (a, b) in SPANS.items()}
        for node in nodes.values():
            swarm.wait_serving(node)
        swarm.nodes = nodes
        yield swarm


def _client(swarm, model_dir, **config):
    return DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                       config=ClientConfig(**config))


def test_uneven_overlapping_spans_generate_exactly(swarm, model_dir, local_model, chat_prompts):
    without_full = frozenset({swarm.nodes["full"].peer_id})
    for exclude in (frozenset(), without_full):
        with _client(swarm, model_dir, exclude_peers=exclude) as remote:
            for input_ids in chat_prompts[:2]:
                ours = remote.generate(input_ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
                truth = local_model.generate(input_ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
                assert torch.equal(ours, truth)


def test_session_entering_a_node_in_the_middle_of_its_span(swarm, model_dir, local_model, chat_prompts):
    input_ids = chat_prompts[0]
    with torch.no_grad():
        states = local_model(input_ids, output_hidden_states=True).hidden_states
    exclude = frozenset({swarm.nodes["full"].peer_id, swarm.nodes["a"].peer_id})
    with _client(swarm, model_dir, exclude_peers=exclude) as remote:
        session = InferenceSession(remote.swarm, max_length=input_ids.shape[1], start=7, end=19)
        with session:
            positions = torch.arange(input_ids.shape[1])[None]
            out = session.step(states[7], positions, torch.ones_like(input_ids))
            hops = [(h.hop.peer_id, h.hop.start, h.hop.end) for h in session.hops]
    assert hops == [(swarm.nodes["b"].peer_id, 7, 19)]  # node b serves 5:19 and is entered at block 7
    torch.testing.assert_close(out, states[19], atol=1e-4, rtol=0)


class _KillAfter(BaseStreamer):
    """Sends `sig` to the process group of the peer that serves the first hop once `after` new tokens have
    been streamed (SIGKILL: a killed node; SIGSTOP: a frozen one, or one cut off, whose connections stay open
    while nothing answers); then times the gap to the next token."""

    def __init__(self, remote, swarm, after: int, sig: int = signal.SIGKILL, hop: int = 0, then=None,
                 ahead: bool = False):
        self.remote, self.swarm, self.after, self.sig = remote, swarm, after, sig
        self.hop, self.then = hop, then  # which hop's peer; what to do right after the signal
        self.ahead = ahead  # wait (from `after` on) for a moment when speculative passes are in flight
        self.seen = -1  # the first put() is the prompt
        self.killed: str | None = None
        self.victim = None
        self.gap: float | None = None  # seconds from the signal to the next token
        self._sent = 0.0

    def put(self, value):
        self.seen += 1
        if self.killed is not None and self.gap is None:
            self.gap = time.monotonic() - self._sent
        session = self.remote.active_session
        if self.seen >= self.after and self.killed is None and (not self.ahead or session.tokens_ahead):
            peer = self.remote.active_session.hops[self.hop].hop.peer_id
            self.victim = next(p for p in self.swarm.processes if p.peer_id == peer)
            self.swarm.kill(self.victim, self.sig)
            if self.sig == signal.SIGKILL:
                self.victim.popen.wait(10)
            self._sent = time.monotonic()
            self.killed = peer
            if self.then is not None:
                self.then()

    def end(self):
        pass


def test_frozen_node_noticed_by_keepalives_output_unchanged(swarm, model_dir, local_model, chat_prompts):
    """A node that stops answering with its connections open (SIGSTOP to it and its daemon: what a cut link or
    a hung machine looks like) is found silent by the keep-alive pings within `peer_silence` s and the session
    fails over, long before the 60 s step timeout; the output is unchanged. The node is let go on afterwards
    (SIGCONT), so the next test still has a replica of every block."""
    input_ids = chat_prompts[1]
    truth = local_model.generate(input_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    config = ClientConfig()
    with _client(swarm, model_dir) as remote:
        streamer = _KillAfter(remote, swarm, after=6, sig=signal.SIGSTOP)
        try:
            with remote.inference_session(max_length=input_ids.shape[1] + 24) as session:
                ours = remote.generate(input_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                       streamer=streamer)
                survivors = {h.hop.peer_id for h in session.hops}
        finally:
            if streamer.victim is not None:
                swarm.kill(streamer.victim, signal.SIGCONT)
        assert streamer.killed is not None and streamer.killed not in survivors
        silent = dict(session.silent_peers)
        assert streamer.killed in silent, f"the frozen peer was not found silent: {session.silent_peers}"
        # found by its silence, not by the step timeout: quiet for peer_silence s, plus at most one ping's wait
        assert config.peer_silence <= silent[streamer.killed] < config.peer_silence + 2 * config.keepalive_period
        assert streamer.gap is not None and streamer.gap < config.request_timeout / 2

        # it answers again (as a node restarted with its identity does) and is now the only one serving the
        # first blocks: the client lifts its ban at once rather than waiting the ban out (or failing)
        frozen = streamer.killed
        first_blocks = {n.peer_id for name, n in swarm.nodes.items() if SPANS[name][0] == 0} - {frozen}
        remote.swarm.config.exclude_peers = frozenset(first_blocks)
        remote.swarm.ban(frozen, "failed again (the test's ban: long enough to outlast the generation)")
        assert frozen in remote.swarm.banned()
        again = remote.generate(chat_prompts[0], max_new_tokens=8, do_sample=False)
        assert frozen not in remote.swarm.banned()
    assert torch.equal(ours, truth)
    assert torch.equal(again, local_model.generate(chat_prompts[0], max_new_tokens=8, do_sample=False))


def test_middle_hop_killed_with_push_output_unchanged(swarm, model_dir, local_model, chat_prompts):
    """Hidden states go node to node (push, the default) along a -> b -> c; b is SIGKILLed mid-generation. Its
    replacement (the full node, allowed back in at that moment) is fed a's kept outputs for the whole
    sequence, fetched by the client, and pushes the step on to c, which was waiting for it: the tokens are
    local transformers'. A node serving b's blocks is started again afterwards, for the next test."""
    input_ids = chat_prompts[0]
    truth = local_model.generate(input_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with _client(swarm, model_dir, exclude_peers=frozenset({swarm.nodes["full"].peer_id})) as remote:
        def allow_full():
            remote.swarm.config.exclude_peers = frozenset()

        streamer = _KillAfter(remote, swarm, after=8, hop=1, then=allow_full)
        with remote.inference_session(max_length=input_ids.shape[1] + 24) as session:
            assert session.push
            ours = remote.generate(input_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                   streamer=streamer)
            after = [h.hop.peer_id for h in session.hops]
        assert streamer.killed == swarm.nodes["b"].peer_id  # the middle hop of a -> b -> c (full excluded then)
        assert session.retries >= 1 and session.restarts == 0  # replaced from a's kept outputs, not rebuilt
        assert after == [swarm.nodes[n].peer_id for n in ("a", "full", "c")], after
    assert torch.equal(ours, truth)
    swarm.nodes["b"] = swarm.start_node(*SPANS["b"], name="b-again")


def test_middle_hop_killed_between_speculative_passes_output_unchanged(swarm, model_dir, local_model, tokenizer):
    """Prompt lookup drafts several tokens a pass along a -> b -> c (pushed node to node); b is SIGKILLed after
    the third pass. Its replacement is fed a's kept outputs for the tokens every hop kept (the rejected drafts
    of earlier passes were taken back on a too), and the generation goes on with the same tokens as plain
    greedy decoding. A node serving b's blocks is started again afterwards, for the next test."""
    from swarmnode.testing.workload import passage_inputs

    input_ids = passage_inputs(tokenizer, 1)[0]
    truth = local_model.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    with _client(swarm, model_dir, exclude_peers=frozenset({swarm.nodes["full"].peer_id})) as remote:
        def allow_full():
            remote.swarm.config.exclude_peers = frozenset()

        streamer = _KillAfter(remote, swarm, after=3, hop=1, then=allow_full)
        with remote.inference_session(max_length=input_ids.shape[1] + 40) as session:
            ours = remote.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   streamer=streamer, prompt_lookup_num_tokens=10)
        assert streamer.killed == swarm.nodes["b"].peer_id
        assert session.retries >= 1 and session.steps - 1 < 30, (session.retries, session.steps)
    assert torch.equal(ours, truth)
    swarm.nodes["b"] = swarm.start_node(*SPANS["b"], name="b-again-2")


def test_middle_hop_killed_with_speculative_passes_in_flight_output_unchanged(swarm, model_dir, local_model,
                                                                              tokenizer):
    """Prompt lookup with up to 4 passes in flight along a -> b -> c; b is SIGKILLed while passes sent ahead are on
    their way (the streamer runs between verifying one pass and sending the next). Those passes are lost with b:
    b is banned, the route rebuilt, the session's tokens replayed through it and the lost drafts sent again, and
    the output is plain greedy's. A node serving b's blocks is started again afterwards, for the next test."""
    from swarmnode.testing.workload import passage_inputs

    input_ids = passage_inputs(tokenizer, 1)[0]
    truth = local_model.generate(input_ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
    with _client(swarm, model_dir, exclude_peers=frozenset({swarm.nodes["full"].peer_id})) as remote:
        def allow_full():
            remote.swarm.config.exclude_peers = frozenset()

        streamer = _KillAfter(remote, swarm, after=1, hop=1, then=allow_full, ahead=True)
        with remote.inference_session(max_length=input_ids.shape[1] + 48) as session:
            ours = remote.generate(input_ids, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                                   streamer=streamer, prompt_lookup_num_tokens=10, speculative_passes=4)
            after = {h.hop.peer_id for h in session.hops or []}
        assert streamer.killed == swarm.nodes["b"].peer_id and streamer.killed not in after, after
        assert session.retries >= 1 and session.restarts >= 1 and session.discarded >= 1, \
            (session.retries, session.restarts, session.discarded)
    assert torch.equal(ours, truth)
    swarm.nodes["b"] = swarm.start_node(*SPANS["b"], name="b-again-3")


def test_node_killed_mid_generation_output_unchanged(swarm, model_dir, local_model, chat_prompts):
    input_ids = chat_prompts[2]
    truth = local_model.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    with _client(swarm, model_dir) as remote:  # the default 60 s step timeout: keep-alives notice the loss
        streamer = _KillAfter(remote, swarm, after=12)
        with remote.inference_session(max_length=input_ids.shape[1] + 40) as session:
            ours = remote.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   streamer=streamer)
            survivors = {h.hop.peer_id for h in session.hops}
        assert streamer.killed is not None
        assert session.retries >= 1
        assert streamer.killed not in survivors
    assert torch.equal(ours, truth)

