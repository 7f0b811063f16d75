"""Speculative decoding through the run's shared 3-node swarm: `transformers`' assisted generation, with drafts
from prompt lookup or a draft model verified several tokens a pass, rejected drafts taken back on every node,
and the output of plain decoding (greedy) or of local assisted generation (sampling); with prompt lookup, passes
pipelined (`client.speculative`): several in flight, those behind a rejection given up and rolled back on every
node, and the output of plain decoding (greedy, and sampling with one seed)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarmnode.client import DistributedModelForCausalLM, SessionError
from swarmnode.client.errors import ClientConfigError
from swarmnode.client.speculative import PipelinedDecoding
from swarmnode.client.swarm import ClientConfig
from swarmnode.testing.workload import passage_inputs

pytestmark = pytest.mark.swarm

NEW = 48


@pytest.fixture(scope="module")
def passages(tokenizer):
    return passage_inputs(tokenizer, 3)


@pytest.fixture(scope="module")
def wrong_draft(local_model):
    """A draft model of the same vocabulary whose drafts are (almost) never right: one random block."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=local_model.config.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, eos_token_id=local_model.config.eos_token_id)
    return LlamaForCausalLM(config).eval()


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def test_prompt_lookup_gives_plain_greedy_output_in_fewer_passes(remote, local_model, passages):
    for ids in passages[:2]:
        truth = _greedy(local_model, ids)
        with remote.inference_session(max_length=ids.shape[1] + NEW) as session:
            ours = _greedy(remote, ids, prompt_lookup_num_tokens=10)
        assert torch.equal(ours, truth)
        # the prompt's pass, then fewer passes than tokens: several drafted tokens accepted per pass
        assert session.steps - 1 < NEW * 0.6, (session.steps, session.rewound)
        assert session.sent_ahead > 0, "passes were pipelined (ClientConfig.speculative_passes defaults to 2)"


def test_a_draft_model_of_the_same_tokens_is_accepted_whole(remote, local_model, passages):
    """The target's own float32 weights as the draft: every draft is right, so each pass adds the drafted
    tokens and a bonus one, and nothing is taken back."""
    ids = passages[1]
    with remote.inference_session(max_length=ids.shape[1] + NEW) as session:
        ours = _greedy(remote, ids, assistant_model=local_model)
    assert torch.equal(ours, _greedy(local_model, ids))
    assert session.rewound == 0 and session.steps - 1 <= NEW // 3, (session.steps, session.rewound)


def test_a_draft_rejected_every_time_leaves_the_output_unchanged(remote, local_model, wrong_draft, chat_prompts):
    """On `transformers`' heuristic schedule the draft model drafts one fewer after each rejection, and keeps
    the length it reached for its next call, as with a local target."""
    ids = chat_prompts[0]
    config = wrong_draft.generation_config
    before = config.num_assistant_tokens_schedule, config.num_assistant_tokens
    config.num_assistant_tokens_schedule, config.num_assistant_tokens = "heuristic", 6
    try:
        with remote.inference_session(max_length=ids.shape[1] + NEW) as session:
            ours = _greedy(remote, ids, assistant_model=wrong_draft)
        assert config.num_assistant_tokens < 6, config.num_assistant_tokens  # kept, and lowered by rejections
    finally:
        config.num_assistant_tokens_schedule, config.num_assistant_tokens = before
    assert torch.equal(ours, _greedy(local_model, ids))
    assert session.rewound >= NEW // 2, session.rewound  # its drafts were taken back pass after pass


def test_sampling_with_a_draft_model_is_local_assisted_sampling(remote, local_model, wrong_draft, passages):
    """Sampling keeps `transformers`' speculative sampling (the draft's and the target's probabilities,
    Leviathan et al. 2023, algorithm 1): with one seed the swarm draws what local assisted generation draws."""
    ids = passages[2]
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50)
    for draft in (local_model, wrong_draft):
        torch.manual_seed(7)
        ours = remote.generate(ids, assistant_model=draft, **kwargs)
        torch.manual_seed(7)
        truth = local_model.generate(ids, assistant_model=draft, **kwargs)
        assert torch.equal(ours, truth)


def test_speculative_passes_relayed_through_the_client(swarm3, model_dir, local_model, passages):
    ids = passages[0]
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm3.initial_peers,
                                                     push=False) as relayed, \
            relayed.inference_session(max_length=ids.shape[1] + NEW) as session:
        ours = _greedy(relayed, ids, prompt_lookup_num_tokens=10)
        assert not session.push
    assert torch.equal(ours, _greedy(local_model, ids))
    assert session.steps - 1 < NEW * 0.6


def test_a_session_rewound_continues_as_the_new_sequence(remote, local_model, chat_prompts):
    """What assisted generation does, by hand: tokens are taken back (`InferenceSession.rewind`) and other
    ones sent; the logits are those of the new sequence, from every node's rolled-back cache."""
    ids = chat_prompts[1]
    other = torch.tensor([[504, 2444, 282, 4649, 314]])
    changed = torch.cat([ids[:, :-3], other], dim=1)
    with torch.no_grad():
        truth = local_model(changed).logits
    with remote.inference_session(max_length=changed.shape[1] + 4) as session:
        remote(ids)
        assert session.position == ids.shape[1]
        for bad in (ids.shape[1] + 1, -1, 2.0, True):
            with pytest.raises(SessionError, match="cannot rewind") as refused:
                session.rewind(bad)
            assert refused.value.code == "bad_request"
        session.rewind(ids.shape[1] - 3)
        assert session.position == ids.shape[1] - 3 and session.rewound == 3
        logits = remote(changed[:, -other.shape[1]:]).logits
        assert session.position == changed.shape[1]
    torch.testing.assert_close(logits, truth[:, -other.shape[1]:], atol=1e-4, rtol=0)


def test_generate_refuses_a_cache_of_its_own(remote, chat_prompts):
    from transformers import DynamicCache

    with pytest.raises(ClientConfigError, match="nodes hold this model's KV cache"):
        remote.generate(chat_prompts[0], max_new_tokens=2, cache=DynamicCache())


def test_generate_command_with_prompt_lookup(swarm3, model_dir, local_model, tokenizer):
    import os
    import subprocess
    import sys

    from swarmnode.testing.workload import PASSAGES

    prompt = f"Repeat the following passage exactly, word for word:\n\n{PASSAGES[1]}"
    result = subprocess.run(
        [sys.executable, "-m", "swarmnode", "generate", "--model", str(model_dir), "--max-new-tokens", "32",
         "--prompt-lookup", "10", "--speculative-passes", "3", *[arg for peer in swarm3.initial_peers for arg in ("--initial-peers", peer)],
         prompt], capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    local = local_model.generate(ids, max_new_tokens=32, do_sample=False)
    assert result.stdout.strip() == tokenizer.decode(local[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert "tokens/s" in result.stderr


def test_a_cache_implementation_is_set_aside(remote, local_model, chat_prompts):
    """The nodes hold the KV cache, so a `cache_implementation` (Gemma's generation configs name "hybrid")
    makes no local cache: passed as an argument, in a generation config or in the model's own, generation
    goes on as without it."""
    from transformers import GenerationConfig

    ids = chat_prompts[0]
    truth = local_model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(remote.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static"), truth)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, cache_implementation="static",
                              eos_token_id=local_model.generation_config.eos_token_id)
    assert torch.equal(remote.generate(ids, generation_config=config), truth)
    assert config.cache_implementation == "static"  # the caller's config is left as it was
    remote.generation_config.cache_implementation = "static"
    assert torch.equal(remote.generate(ids, max_new_tokens=6, do_sample=False), truth)


def test_continuing_a_session_that_holds_the_whole_prompt_is_refused_clearly(remote, chat_prompts):
    ids = chat_prompts[2]
    with remote.inference_session(max_length=ids.shape[1] + 16):
        remote(ids)
        for extra in ({}, {"prompt_lookup_num_tokens": 4}):
            with pytest.raises(SessionError, match=r"already in the session|new to the session") as refused:
                remote.generate(ids, max_new_tokens=4, do_sample=False, **extra)
            assert refused.value.code == "bad_request"


def _pipelined(remote, ids, truth, drafter, *, passes, most=6):
    """`PipelinedDecoding` in a session of the shared swarm with `drafter`'s drafts, as `_greedy` decodes (the
    end-of-text token held back until `NEW` tokens); the output and the session."""
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor, StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    length = truth.shape[1]

    def first(candidates, keep):
        return remote(input_ids=candidates, attention_mask=torch.ones_like(candidates), logits_to_keep=keep).logits

    with remote.inference_session(max_length=length) as session:
        decoding = PipelinedDecoding(remote.ends, session, drafter, most=most, passes=passes, max_length=length,
                                     logits_processor=LogitsProcessorList([MinNewTokensLengthLogitsProcessor(
                                         ids.shape[1], NEW, remote.generation_config.eos_token_id)]),
                                     stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(length)]),
                                     do_sample=False)
        ours = decoding.run(ids, first)
        position = session.position
    return ours, session, position


def _drafts_of(truth, wrong_every: int | None):
    """Drafts that continue `truth` where the sequence so far is a prefix of it, each `wrong_every`-th position
    (counted from the start) a wrong token; nothing where the sequence left `truth`."""
    row = truth[0].tolist()

    def drafter(sequence, limit):
        seq = sequence[0].tolist()
        if seq != row[:len(seq)]:
            return []
        drafts = row[len(seq):len(seq) + limit]
        return [(t + 1) % 49152 if wrong_every and (len(seq) + i) % wrong_every == 0 else t
                for i, t in enumerate(drafts)]

    return drafter


def test_pipelined_passes_with_right_drafts_run_ahead_and_none_is_given_up(remote, local_model, passages):
    """Drafts that are always right: passes are sent before the ones ahead are verified, up to `passes` at once,
    none is given up, and the output is plain greedy's."""
    ids = passages[0]
    truth = _greedy(local_model, ids)
    for passes in (2, 4):
        ours, session, position = _pipelined(remote, ids, truth, _drafts_of(truth, None), passes=passes)
        assert torch.equal(ours, truth)
        assert session.discarded == 0 and session.rewound == 0, (session.discarded, session.rewound)
        assert session.sent_ahead >= passes and session.steps - 1 <= NEW // 4, (session.sent_ahead, session.steps)
        assert position == truth.shape[1] - 1  # every token but the last in the cache, as transformers leaves it


def test_pipelined_passes_behind_a_wrong_draft_are_given_up_and_rolled_back(remote, local_model, passages):
    """Drafts right but for every 13th position: the pass that holds the wrong one is cut there and every pass in
    flight behind it is given up; the nodes, which ran them, roll their caches back on the next pass, and the
    output is plain greedy's."""
    ids = passages[1]
    truth = _greedy(local_model, ids)
    ours, session, _ = _pipelined(remote, ids, truth, _drafts_of(truth, 13), passes=3, most=4)
    assert torch.equal(ours, truth)
    assert session.discarded > 0 and session.rewound > 0, (session.discarded, session.rewound)


def test_pipelined_drafts_rejected_every_time_leave_the_output_unchanged(remote, local_model, chat_prompts):
    """Every draft wrong: each pass takes the model's token instead, and the pace falls back to passes without
    drafts for a while (`DraftPace`)."""
    ids = chat_prompts[1]
    truth = _greedy(local_model, ids)
    ours, session, _ = _pipelined(remote, ids, truth, _drafts_of(truth, 1), passes=3)
    assert torch.equal(ours, truth)
    assert session.rewound > 0 and session.steps - 1 >= NEW - 1, (session.rewound, session.steps)
    assert session.rewound < NEW // 2, session.rewound  # backed off: most passes carried no draft


def test_pipelined_logits_processors_see_the_accepted_tokens(remote, local_model, passages):
    """A repetition penalty and a ban on repeated 3-grams, on the tokens accepted before each position: the
    output is local plain greedy's with the same processors."""
    ids = passages[2]
    kwargs = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    with remote.inference_session(max_length=ids.shape[1] + NEW) as session:
        ours = _greedy(remote, ids, prompt_lookup_num_tokens=10, **kwargs)
    assert torch.equal(ours, _greedy(local_model, ids, **kwargs))
    assert session.steps - 1 < NEW, session.steps


def test_pipelined_sampling_draws_what_plain_sampling_draws(remote, local_model, passages):
    """One draw of the random generator a token, as plain sampling: with one seed, the swarm's pipelined prompt
    lookup samples the tokens local plain sampling samples (so their distribution is plain sampling's)."""
    kwargs = dict(max_new_tokens=32, do_sample=True, temperature=0.7, top_k=40)
    for seed, ids in ((3, passages[0]), (11, passages[1])):
        torch.manual_seed(seed)
        with remote.inference_session(max_length=ids.shape[1] + 32) as session:
            ours = remote.generate(ids, prompt_lookup_num_tokens=10, **kwargs)
        torch.manual_seed(seed)
        truth = local_model.generate(ids, **kwargs)
        assert torch.equal(ours, truth)
        assert session.steps - 1 < 32, session.steps


def test_steps_sent_ahead_are_validated(remote, chat_prompts):
    ids = chat_prompts[0]
    hidden = torch.zeros(1, 1, remote.config.hidden_size)
    positions, mask = torch.tensor([[ids.shape[1]]]), torch.ones(1, 1, dtype=torch.long)
    with remote.inference_session(max_length=ids.shape[1] + 2) as session:
        with pytest.raises(SessionError, match="route that has run") as refused:
            session.send_ahead(hidden, positions, mask)  # nothing has run yet
        assert refused.value.code == "bad_request"
        with pytest.raises(SessionError, match="no step sent ahead"):
            session.collect()
        remote(ids)
        session.send_ahead(hidden, positions, mask)
        with pytest.raises(SessionError, match="discard them"):
            session.rewind(1)
        with pytest.raises(SessionError, match="cannot take 2 more tokens"):
            session.send_ahead(torch.zeros(1, 2, remote.config.hidden_size), positions.repeat(1, 2), mask.repeat(1, 2))
        assert session.collect().shape == (1, 1, remote.config.hidden_size)
        assert session.position == ids.shape[1] + 1


def test_speculative_passes_are_validated(remote, chat_prompts):
    for bad in (0, 5, 2.0, True, "2"):
        with pytest.raises(ClientConfigError, match="speculative_passes"):
            remote.generate(chat_prompts[0], max_new_tokens=2, prompt_lookup_num_tokens=4, speculative_passes=bad)
        with pytest.raises(ClientConfigError, match="speculative_passes"):
            ClientConfig(speculative_passes=bad)


def test_a_generation_interrupted_with_passes_in_flight_leaves_the_session_usable(remote, local_model, passages):
    """A streamer raises while pipelined passes are on their way: nothing sent ahead counts afterwards, and the
    session, taken back to the prompt, generates plain greedy's tokens again."""
    from transformers.generation.streamers import BaseStreamer

    class Interrupt(BaseStreamer):
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts > 2 and remote.active_session.tokens_ahead:
                raise KeyboardInterrupt

        def end(self):
            pass

    ids = passages[0]
    with remote.inference_session(max_length=ids.shape[1] + NEW) as session:
        with pytest.raises(KeyboardInterrupt):
            _greedy(remote, ids, prompt_lookup_num_tokens=10, speculative_passes=3, streamer=Interrupt())
        assert session.tokens_ahead == 0 and session.position > ids.shape[1]
        session.rewind(ids.shape[1] - 1)
        ours = _greedy(remote, ids, prompt_lookup_num_tokens=10, speculative_passes=3)
    assert torch.equal(ours, _greedy(local_model, ids))
