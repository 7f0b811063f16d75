"""Nodes in every dtype and quantization a user may pick, in one real swarm, each checked end to end.

- A bfloat16 route (three `--dtype bfloat16` nodes, a bfloat16 client) generates greedy text equal to local
  `transformers` run in bfloat16, for the suite's chat prompts and a left-padded batch.
- A mixed route (bfloat16, float32, bfloat16 nodes; a float32 client) works: hidden states travel in the
  client's float32 and each node casts at its edge; `status` says which dtype each node serves.
- `--quantize int8`, `int4` (PyTorch's kernels) and `q8_0`, `q4_0`, `q4_1`, `bf16` (ggml's formats and kernels)
  nodes generate text equal to local `transformers` whose decoder layers were quantized the same way
  (`runtime.quantize.quantize_block`), and announce quantized block sizes; so does a float32 `--quantize bf16`
  node, whose blocks decode through the C step of `runtime.ggml.decode_step`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

BF16 = ["--dtype", "bfloat16"]
#: quantizations into ggml's block formats (`runtime.quantize.GGML_MODES`), multiplied by `runtime.ggml`'s kernels
GGML_MODES = ("q8_0", "q4_0", "q4_1", "bf16")


@pytest.fixture(scope="module")
def dtype_swarm(model_dir, tmp_path_factory):
    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("dtype-swarm")) as swarm:
        swarm.start_bootstrap()
        nodes = {
            "bf16-a": swarm.launch_node(0, 10, name="bf16-a", extra=BF16),
            "bf16-b": swarm.launch_node(10, 20, name="bf16-b", extra=BF16),
            "bf16-c": swarm.launch_node(20, 30, name="bf16-c", extra=BF16),
            "fp32-b": swarm.launch_node(10, 20, name="fp32-b"),
            "int8": swarm.launch_node(0, 30, name="int8", extra=[*BF16, "--quantize", "int8"]),
            "int4": swarm.launch_node(0, 30, name="int4", extra=[*BF16, "--quantize", "int4"]),
            **{mode: swarm.launch_node(0, 30, name=mode, extra=[*BF16, "--quantize", mode]) for mode in GGML_MODES},
            "bf16-rows": swarm.launch_node(0, 30, name="bf16-rows", extra=["--quantize", "bf16"]),  # float32
        }
        for node in nodes.values():
            swarm.wait_serving(node, 300)
        swarm.nodes = nodes
        yield swarm


def _client(swarm, model_dir, *, only: set[str], dtype):
    """A client whose routes may use only the nodes named in `only`."""
    excluded = frozenset(p.peer_id for name, p in swarm.nodes.items() if name not in only)
    return DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers, dtype=dtype,
                                                       exclude_peers=excluded)


@pytest.fixture(scope="module")
def local_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def _quantized(model, mode: str):
    from swarmnode.runtime.quantize import quantize_block

    quantized = copy.deepcopy(model)
    for layer in quantized.model.layers:
        quantize_block(layer, mode, torch.bfloat16)
    return quantized


def test_bfloat16_swarm_equals_local_bfloat16(dtype_swarm, model_dir, local_bf16, chat_prompts, tokenizer):
    with _client(dtype_swarm, model_dir, only={"bf16-a", "bf16-b", "bf16-c"}, dtype=torch.bfloat16) as remote:
        assert remote.embed_tokens.weight.dtype == remote.lm_head.weight.dtype == torch.bfloat16
        for input_ids in chat_prompts:
            kwargs = dict(max_new_tokens=32, min_new_tokens=24, do_sample=False)
            assert torch.equal(remote.generate(input_ids, **kwargs), local_bf16.generate(input_ids, **kwargs))
        tokenizer.padding_side = "left"
        batch = tokenizer(["The capital of France is", "Once upon a time, in a small village by the sea,",
                           "def fibonacci(n):"], return_tensors="pt", padding=True)
        ours = remote.generate(**batch, max_new_tokens=24, do_sample=False)
        assert torch.equal(ours, local_bf16.generate(**batch, max_new_tokens=24, do_sample=False))
        with remote.inference_session(max_length=8) as session:
            remote(torch.tensor([[1, 2, 3]]))
            names = {p.peer_id: n for n, p in dtype_swarm.nodes.items()}
            assert [names[h.hop.peer_id] for h in session.hops] == ["bf16-a", "bf16-b", "bf16-c"]


def test_mixed_route_works_and_status_shows_each_nodes_dtype(dtype_swarm, model_dir, local_model, chat_prompts):
    input_ids = chat_prompts[0]
    with _client(dtype_swarm, model_dir, only={"bf16-a", "fp32-b", "bf16-c"}, dtype="float32") as remote:
        with remote.inference_session(max_length=input_ids.shape[1] + 1) as session:
            logits = remote(input_ids).logits[0, -1]
            names = {p.peer_id: n for n, p in dtype_swarm.nodes.items()}
            assert [names[h.hop.peer_id] for h in session.hops] == ["bf16-a", "fp32-b", "bf16-c"]
        assert logits.dtype == torch.float32
        truth = local_model(input_ids).logits[0, -1]
        assert torch.nn.functional.cosine_similarity(logits, truth, dim=0) > 0.99
        assert int(logits.argmax()) == int(truth.argmax())
        out = remote.generate(input_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.shape[1] == input_ids.shape[1] + 16
    nodes = dtype_swarm.status()["nodes"]
    served = {name: (nodes[p.peer_id]["dtype"], nodes[p.peer_id]["quantization"])
              for name, p in dtype_swarm.nodes.items()}
    assert served == {"bf16-a": ("bfloat16", "none"), "bf16-b": ("bfloat16", "none"), "bf16-c": ("bfloat16", "none"),
                      "fp32-b": ("float32", "none"), "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
                      **{mode: ("bfloat16", mode) for mode in GGML_MODES}, "bf16-rows": ("float32", "bf16")}


@pytest.mark.parametrize("mode", ["int8", "int4", *GGML_MODES])
def test_quantized_node_equals_local_quantized(dtype_swarm, model_dir, local_bf16, chat_prompts, mode):
    local = _quantized(local_bf16, mode)
    with _client(dtype_swarm, model_dir, only={mode}, dtype=torch.bfloat16) as remote:
        for input_ids in chat_prompts[:2]:
            kwargs = dict(max_new_tokens=24, min_new_tokens=16, do_sample=False)
            assert torch.equal(remote.generate(input_ids, **kwargs), local.generate(input_ids, **kwargs))
    nodes = dtype_swarm.status()["nodes"]
    quantized = nodes[dtype_swarm.nodes[mode].peer_id]["block_bytes"]
    bf16 = nodes[dtype_swarm.nodes["bf16-a"].peer_id]["block_bytes"]
    assert quantized < {"int8": 0.6, "q8_0": 0.6, "bf16": 1.01}.get(mode, 0.4) * bf16, (quantized, bf16)


def test_float32_node_of_16_bit_rows_equals_local(dtype_swarm, model_dir, local_model, chat_prompts):
    """`--quantize bf16` at the node's default float32: the weights as 16-bit rows, each block's decode step in C
    (`runtime.ggml.decode_step`). The text equals local `transformers` in float32 with the same rows
    (`quantize_block`, which gives its blocks the same step), token for token."""
    from swarmnode.runtime.quantize import quantize_block

    local = copy.deepcopy(local_model)
    for layer in local.model.layers:
        quantize_block(layer, "bf16", torch.float32)
    with _client(dtype_swarm, model_dir, only={"bf16-rows"}, dtype="float32") as remote:
        for input_ids in chat_prompts[:2]:
            kwargs = dict(max_new_tokens=24, min_new_tokens=16, do_sample=False)
            assert torch.equal(remote.generate(input_ids, **kwargs), local.generate(input_ids, **kwargs))


@pytest.mark.parametrize("only,mode", [({"bf16-a", "bf16-b", "bf16-c"}, None), ({"int8"}, "int8"),
                                       ({"q4_0"}, "q4_0")])
def test_speculative_passes_on_bfloat16_and_quantized_nodes(dtype_swarm, model_dir, local_bf16, tokenizer, only,
                                                           mode):
    """Prompt lookup through bfloat16 and quantized nodes: passes of several tokens are verified and rolled
    back there as in float32, and the text is local `transformers`' assisted generation with the same drafts
    and the same precision (bfloat16, or the same quantization). In bfloat16 a pass of several tokens may
    round differently from one-token steps, so that is the truth here, not plain greedy text (on one of these
    passages they part within 32 tokens)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from swarmnode.client.drafts import SwarmDrafts
    from swarmnode.testing.workload import passage_inputs

    local = copy.copy(local_bf16) if mode is None else _quantized(local_bf16, mode)
    plain_generator = local._get_candidate_generator

    def swarm_drafts(generation_config, *args, **kwargs):  # the drafts the swarm's client makes
        inner = plain_generator(generation_config, *args, **kwargs)
        return SwarmDrafts(inner, max_length=generation_config.max_length,
                           paced=isinstance(inner, PromptLookupCandidateGenerator))

    local._get_candidate_generator = swarm_drafts
    with _client(dtype_swarm, model_dir, only=only, dtype=torch.bfloat16) as remote:
        for ids in passage_inputs(tokenizer, 2):
            kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, prompt_lookup_num_tokens=10)
            with remote.inference_session(max_length=ids.shape[1] + 32) as session:
                ours = remote.generate(ids, **kwargs)
            assert torch.equal(ours, local.generate(ids, **kwargs))
            assert session.steps - 1 < 24, session.steps  # several tokens a pass
