"""Uneven spans, overlapping replicas, mid-span entry, and a node killed in the middle of a generation."""

from __future__ import annotations

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
    """Kills the peer that serves the first hop once `after` new tokens have been streamed."""

    def __init__(self, remote, swarm, after: int):
        self.remote, self.swarm, self.after = remote, swarm, after
        self.seen = -1  # the first put() is the prompt
        self.killed: str | None = None

    def put(self, value):
        self.seen += 1
        if self.seen == self.after and self.killed is None:
            peer = self.remote.active_session.hops[0].hop.peer_id
            victim = next(p for p in self.swarm.processes if p.peer_id == peer)
            self.swarm.kill(victim)
            victim.popen.wait(10)
            self.killed = peer

    def end(self):
        pass


def test_node_killed_mid_generation_output_unchanged(swarm, model_dir, local_model, chat_prompts):
    input_ids = chat_prompts[2]
    truth = local_model.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    with _client(swarm, model_dir, request_timeout=20.0) as remote:
        streamer = _KillAfter(remote, swarm, after=12)
        with remote.inference_session(max_length=input_ids.shape[1] + 40) as session:
            ours = remote.generate(input_ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   streamer=streamer)
            survivors = {h.hop.peer_id for h in session.hops}
        assert streamer.killed is not None
        assert session.retries >= 1
        assert streamer.killed not in survivors
    assert torch.equal(ours, truth)
