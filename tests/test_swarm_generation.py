"""Generation through a real 3-node swarm equals local `transformers`, token for token."""

from __future__ import annotations

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM

pytestmark = pytest.mark.swarm


def test_greedy_generation_equals_local(remote, local_model, chat_prompts):
    for input_ids in chat_prompts:
        ours = remote.generate(input_ids, max_new_tokens=40, min_new_tokens=32, do_sample=False)
        truth = local_model.generate(input_ids, max_new_tokens=40, min_new_tokens=32, do_sample=False)
        assert ours.shape[1] - input_ids.shape[1] >= 32
        assert torch.equal(ours, truth)


def test_route_uses_all_three_nodes(remote, swarm3):
    with remote.inference_session(max_length=8) as session:
        remote(torch.tensor([[1, 2, 3]]))
        hops = [(h.hop.peer_id, h.hop.start, h.hop.end) for h in session.hops]
    peers = {p.peer_id: p for p in swarm3.processes if p.peer_id}
    assert [(a, b) for _, a, b in hops] == [(0, 10), (10, 20), (20, 30)]
    assert all(peer in peers for peer, _, _ in hops)


def test_batch_of_prompts_of_different_lengths(remote, local_model, tokenizer):
    tokenizer.padding_side = "left"
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    ours = remote.generate(**batch, max_new_tokens=32, do_sample=False)
    truth = local_model.generate(**batch, max_new_tokens=32, do_sample=False)
    assert torch.equal(ours, truth)
    for row in range(len(texts)):  # and each row equals that prompt generated alone
        alone = tokenizer(texts[row], return_tensors="pt")
        single = local_model.generate(**alone, max_new_tokens=32, do_sample=False)
        n = single.shape[1]
        assert torch.equal(ours[row, -32:][: n - alone.input_ids.shape[1]], single[0, alone.input_ids.shape[1]:])


def test_processors_and_stopping_match_local(remote, local_model, chat_prompts):
    input_ids = chat_prompts[1]
    kwargs = dict(max_new_tokens=48, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    assert torch.equal(remote.generate(input_ids, **kwargs), local_model.generate(input_ids, **kwargs))
    # EOS stopping: the answer ends with <|im_end|> before max_new_tokens, as locally
    stop = dict(max_new_tokens=200, do_sample=False, eos_token_id=local_model.config.eos_token_id)
    ours, truth = remote.generate(chat_prompts[0], **stop), local_model.generate(chat_prompts[0], **stop)
    assert torch.equal(ours, truth)
    assert ours.shape[1] < chat_prompts[0].shape[1] + 200


def test_sampling_with_a_seed_matches_local(remote, local_model, chat_prompts):
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_k=40, top_p=0.9)
    torch.manual_seed(1234)
    ours = remote.generate(chat_prompts[2], **kwargs)
    torch.manual_seed(1234)
    truth = local_model.generate(chat_prompts[2], **kwargs)
    assert torch.equal(ours, truth)


def test_streamer_receives_every_token(remote, tokenizer, chat_prompts):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.chunks.append(None)

    streamer = Collect()
    out = remote.generate(chat_prompts[0], max_new_tokens=16, do_sample=False, streamer=streamer)
    assert streamer.chunks[-1] is None
    streamed = torch.cat([c.reshape(-1) for c in streamer.chunks[1:-1]])
    assert torch.equal(streamed, out[0, chat_prompts[0].shape[1]:])


def test_inference_session_continues_across_calls(remote, local_model, chat_prompts):
    input_ids = chat_prompts[2]
    truth = local_model.generate(input_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with remote.inference_session(max_length=input_ids.shape[1] + 24) as session:
        first = remote.generate(input_ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert session.position == first.shape[1] - 1  # the last token is not sent until the next step
        second = remote.generate(first, max_new_tokens=14, min_new_tokens=14, do_sample=False)
    assert torch.equal(second, truth)


def test_hidden_states_go_node_to_node(swarm3, remote, model_dir, local_model, chat_prompts):
    """By default each node pushes its output to the next hop's node: the client's link carries a step's
    input up once and, down, only the last token's output of each step (all that generation needs). With
    push=False every hop's output comes back through the client (three times the traffic over three hops),
    and the tokens are the same either way."""
    ids = chat_prompts[1]
    truth = local_model.generate(ids, max_new_tokens=12, do_sample=False)
    traffic = {}
    for push, model in ((True, remote), (False, None)):
        model = model or DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm3.initial_peers,
                                                                     push=False)
        try:
            with model.inference_session(max_length=ids.shape[1] + 12) as session:
                out = model.generate(ids, max_new_tokens=12, do_sample=False)
                assert session.push is push
                assert [(h.hop.start, h.hop.end) for h in session.hops] == [(0, 10), (10, 20), (20, 30)]
                traffic[push] = dict(session.traffic)
        finally:
            if model is not remote:
                model.shutdown()
        assert torch.equal(out, truth), push
    hidden_bytes = (ids.shape[1] + 11) * 576 * 4  # every token's float32 hidden state, once
    assert traffic[True]["down"] == 12 * 576 * 4, traffic  # one token's state per step: the prompt's last, then each new one
    assert traffic[False]["down"] >= 3 * hidden_bytes, traffic
    assert traffic[True]["up"] < 1.2 * hidden_bytes < traffic[False]["up"], traffic
