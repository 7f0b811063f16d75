"""Write a local Hugging Face Llama checkpoint as a GGUF file, the way llama.cpp would, without llama.cpp.

Tests and benchmarks of GGUF serving need GGUF files of a checkpoint they control (tiny random models, a
random 1B one) in every format users download: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K_M and Q6_K.
`write_gguf` makes one from a checkpoint folder (config.json, safetensors weights, possibly sharded, and a
GPT-2-style byte-level BPE tokenizer) laid out as llama.cpp's `convert_hf_to_gguf.py` followed by
`llama-quantize` lays it out:

* metadata under the keys llama.cpp writes for architecture "llama" (hyperparameters, `general.file_type` as
  llama.cpp's `LlamaFileType`, `general.quantization_version` 2) and the tokenizer as `_set_vocab_gpt2` writes it
  (tokens by id padded to the config's vocabulary with `[PAD{i}]`, token types, merges, special ids,
  `add_bos_token`, the chat template) through `gguf.SpecialVocab`, which the converter itself uses;
* tensors under llama.cpp's names, with the rows of `attn_q` / `attn_k` permuted as `LlamaModel.permute` does
  (llama.cpp's rotary embedding pairs neighbouring elements, Hugging Face's pairs the two halves of a head),
  1-D tensors (norms, llama3 `rope_freqs`) in F32, and `output.weight` only for untied embeddings;
* each 2-D tensor in the type `llama_tensor_get_type` (src/llama-quant.cpp) picks for the file type: the output
  (or tied token embedding) in Q6_K for Q4_0/Q4_1/Q5_0/Q4_K_M/Q6_K and Q8_0 for Q8_0; for Q4_K_M, Q6_K on
  `attn_v` and `ffn_down` of the layers `use_more_bits` selects; and the shape fallbacks (a row length not a
  multiple of 256 turns Q4_K into Q5_0, Q6_K into Q8_0, Q5_K into Q5_1; not a multiple of 32, F16);
* tensors in the order this llama.cpp writes them (non-block tensors by name, then each block's by name).

Simplified relative to llama.cpp:

* Q8_0, Q4_0, Q4_1, Q5_0 and BF16 come from `gguf.quants.quantize`, the gguf package's numpy port of ggml's
  reference quantizers. Q4_K and Q6_K are quantized here, with the byte layouts of ggml's `block_q4_K` and
  `block_q6_K`, but without the iterative scale search of `quantize_row_q4_K_ref` / `quantize_row_q6_K_ref`
  (`make_qkx2_quants`, `make_qx_quants`): Q4_K takes each 32-wide sub-block's min/max range, Q6_K each
  16-wide sub-block's largest magnitude, and both then quantize their sub-block scales as ggml does. The
  values differ slightly from llama.cpp's (a little more error), the format does not. No importance matrix.
* Only the type rules that concern a dense Llama of these file types are kept (no experts, no 70B rule, no
  IQ/Q2/Q3/Q5_K_M mixtures); the `tokenizer.ggml.pre` name is recognised for a few known pre-tokenizers
  (SmolLM, Llama 3, GPT-2) and is "default" otherwise, where llama.cpp's converter refuses.
* `general.*` naming metadata is reduced to `general.type` and `general.name`.
* `tokenizer.ggml.add_bos_token` is always written: where the tokenizer files do not say (the converter then
  leaves it out), it records whether the Hugging Face tokenizer prepends its BOS token.

The conversion goes tensor by tensor: the header comes from the safetensors headers, then each tensor is
read, converted and written before the next is read, so a 1B model never sits in memory twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import numpy as np

__all__ = ["FILE_TYPES", "write_gguf"]

#: The file types `write_gguf` writes.
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M", "Q6_K")

QK_K = 256  # super-block width of the K-quants

# The text llama.cpp's converter encodes to recognise a pre-tokenizer, and the hashes of the encodings it knows
# (convert_hf_to_gguf.py, `get_vocab_base_pre`), for the few this writer names.
_CHKTXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
_PRE_BY_HASH = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}

# Hugging Face tensor names within a block and their llama.cpp names.
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(checkpoint_dir: Path, out_file: Path, file_type: str) -> Path:
    """Write the Llama checkpoint in `checkpoint_dir` as a GGUF file of `file_type` (one of `FILE_TYPES`)
    at `out_file`, as llama.cpp's converter and quantizer would lay it out, and return `out_file`."""
    from gguf import GGUFWriter, LlamaFileType
    from gguf.quants import quant_shape_to_byte_shape

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    checkpoint_dir, out_file = Path(checkpoint_dir), Path(out_file)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"write_gguf converts Llama checkpoints only (model_type 'llama'); "
                         f"{checkpoint_dir} has model_type {config.get('model_type')!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("write_gguf does not convert Llama checkpoints with attention or MLP biases")

    ftype = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
             "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
             "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
             "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K}[file_type]
    n_layer = int(config["num_hidden_layers"])
    n_head = int(config["num_attention_heads"])
    n_head_kv = int(config.get("num_key_value_heads") or n_head)
    tied = bool(config.get("tie_word_embeddings", False))
    sources = _index_weights(checkpoint_dir)
    plan = _plan_tensors(sources, config, tied)
    types = _choose_types(plan, file_type, n_layer, tied)

    out_file.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out_file, "llama")
    try:
        _add_metadata(writer, checkpoint_dir, config, int(ftype))
        for item in plan:
            qtype = types[item.name]
            writer.add_tensor_info(item.name, quant_shape_to_byte_shape(item.shape, qtype), np.dtype(np.uint8),
                                   _nbytes(item.shape, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item, data in _load_tensors(plan, sources, n_head, n_head_kv, config):
            writer.write_tensor_data(_convert(data, types[item.name]))
            del data
    finally:
        writer.close()
    return out_file


# ---------------------------------------------------------------------------------------------------------------
# Tensors: where they are, what they become, in which type


@dataclass(frozen=True)
class _Planned:
    """One tensor of the GGUF file: its llama.cpp name, numpy shape, source tensor (None when computed) and
    block index (None outside blocks)."""

    name: str
    shape: tuple[int, ...]
    source: str | None
    block: int | None


def _index_weights(checkpoint_dir: Path) -> dict[str, Path]:
    """Map each tensor name of the checkpoint to its safetensors file."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint_dir / file for name, file in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {checkpoint_dir}")
    from safetensors import safe_open

    sources: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            sources.update(dict.fromkeys(f.keys(), file))
    return sources


def _shapes(sources: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every source tensor's shape, read from the safetensors headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in sources.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _plan_tensors(sources: dict[str, Path], config: dict, tied: bool) -> list[_Planned]:
    """The GGUF file's tensors in llama.cpp's order: non-block tensors by name, then blocks in order, each
    block's tensors by name."""
    shapes = _shapes(sources)
    top: list[_Planned] = []
    blocks: list[_Planned] = []
    block_re = re.compile(r"model\.layers\.(\d+)\.(.+)")
    for name, shape in shapes.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tied:
            continue  # the converter drops a tied output; llama.cpp reuses token_embd
        if name in _TOP_NAMES:
            top.append(_Planned(_TOP_NAMES[name], shape, name, None))
            continue
        match = block_re.fullmatch(name)
        if match is None or match.group(2) not in _BLOCK_NAMES:
            raise ValueError(f"write_gguf cannot map checkpoint tensor {name!r} to a llama.cpp tensor")
        bid = int(match.group(1))
        blocks.append(_Planned(f"blk.{bid}.{_BLOCK_NAMES[match.group(2)]}", shape, name, bid))
    if _rope_freqs(config) is not None:
        head_dim = _head_dim(config)
        top.append(_Planned("rope_freqs.weight", (head_dim // 2,), None, None))
    if "token_embd.weight" not in {t.name for t in top}:
        raise ValueError("the checkpoint has no model.embed_tokens.weight")
    top.sort(key=lambda t: t.name)
    blocks.sort(key=lambda t: (t.block, t.name))
    return top + blocks


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the *_M mixtures."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(qtype, ncols: int):
    """llama.cpp's `tensor_type_fallback`: a type whose blocks do not tile a row becomes one that does."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    if ncols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    replacement = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(qtype, qtype)
    if ncols % GGML_QUANT_SIZES[replacement][0] != 0:
        replacement = T.F16
    return replacement


def _choose_types(plan: list[_Planned], file_type: str, n_layer: int, tied: bool
                  ) -> dict[str, GGMLQuantizationType]:
    """The GGML type of each tensor, as `llama_tensor_get_type` picks it for a dense Llama."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    default = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16, "Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_1": T.Q4_1,
               "Q5_0": T.Q5_0, "Q4_K_M": T.Q4_K, "Q6_K": T.Q6_K}[file_type]
    types: dict[str, T] = {}
    i_attention_wv = 0
    n_attention_wv = sum(1 for t in plan if t.name.endswith(".attn_v.weight"))
    for item in plan:
        if len(item.shape) < 2:
            types[item.name] = T.F32  # norms and rope factors are never quantized
            continue
        if default in (T.F32, T.F16, T.BF16):
            types[item.name] = default  # convert_hf_to_gguf --outtype: every matrix in that type
            continue
        ncols = item.shape[-1]
        qtype = default
        if item.name == "output.weight" or (tied and item.name == "token_embd.weight"):
            if ncols % GGML_QUANT_SIZES[qtype][0] != 0:
                qtype = T.Q8_0
            elif qtype != T.Q8_0:
                qtype = T.Q6_K
        elif item.name.endswith(".attn_v.weight"):
            if file_type == "Q4_K_M" and _use_more_bits(i_attention_wv, n_attention_wv):
                qtype = T.Q6_K
            i_attention_wv += 1
        elif (item.name.endswith(".ffn_down.weight") and file_type == "Q4_K_M" and item.block is not None
              and _use_more_bits(item.block, n_layer)):
            qtype = T.Q6_K
        types[item.name] = _fallback(qtype, ncols)
    return types


def _nbytes(shape: tuple[int, ...], qtype) -> int:
    """Bytes of a tensor of `shape` in `qtype`."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope_parameters(config: dict) -> dict:
    """The rope settings of either config style (transformers 5's `rope_parameters`, or `rope_theta` plus
    `rope_scaling`)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def _rope_freqs(config: dict) -> np.ndarray | None:
    """llama.cpp's `rope_freqs.weight` for llama3 rope scaling (the converter's `generate_extra_tensors`)."""
    params = _rope_parameters(config)
    if str(params.get("rope_type", "")).lower() != "llama3":
        return None
    base = float(params["rope_theta"])
    dim = _head_dim(config)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = params.get("factor", 8.0)
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context_len = params.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute`: within each head, interleave the rows of its two halves, so that llama.cpp's
    rotary embedding (which rotates neighbouring pairs) matches Hugging Face's (which rotates the halves)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _load_tensors(plan: list[_Planned], sources: dict[str, Path], n_head: int, n_head_kv: int,
                  config: dict) -> Iterator[tuple[_Planned, np.ndarray]]:
    """Each planned tensor as float32 numpy, in plan order, q/k permuted, read one at a time."""
    import torch
    from safetensors import safe_open

    for item in plan:
        if item.source is None:
            freqs = _rope_freqs(config)
            assert freqs is not None
            yield item, freqs
            continue
        with safe_open(sources[item.source], framework="pt") as f:
            data = f.get_tensor(item.source).to(torch.float32).numpy()
        if item.name.endswith(".attn_q.weight"):
            data = _permute(data, n_head)
        elif item.name.endswith(".attn_k.weight"):
            data = _permute(data, n_head_kv)
        yield item, np.ascontiguousarray(data)


def _convert(data: np.ndarray, qtype) -> np.ndarray:
    """`data` (float32) in `qtype`, as the bytes GGUF stores, converted in row chunks to bound the memory."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if qtype == T.F32:
        return data.astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return data.astype(np.float16).view(np.uint8)
    quantizer = {T.Q4_K: _quantize_q4_k, T.Q6_K: _quantize_q6_k}.get(qtype)
    rows = data.reshape(-1, data.shape[-1])
    chunk = max(1, (1 << 22) // rows.shape[1])
    parts = [quantizer(rows[i:i + chunk]) if quantizer is not None else quantize(rows[i:i + chunk], qtype)
             for i in range(0, rows.shape[0], chunk)]
    out = np.concatenate(parts, axis=0)
    return out.reshape(*data.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------------------------------------------------------
# K-quants (ggml's block_q4_K and block_q6_K layouts)


def _quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Rows (a multiple of 256 wide) as ggml `block_q4_K`s: per 256 values, fp16 `d` and `dmin`, 12 bytes of
    eight 6-bit sub-block scales and mins, 128 bytes of 4-bit quants; x ~= d*sc*q - dmin*m.

    Each 32-wide sub-block takes its [min(x, 0), max(x)] range (ggml's reference searches for a better one)."""
    n_rows, n_cols = rows.shape
    x = rows.astype(np.float32).reshape(-1, 8, 32)  # super-blocks x sub-blocks x values
    mins = np.minimum(x.min(axis=-1), 0.0)
    scales = (x.max(axis=-1) - mins) / 15.0
    neg_mins = -mins  # ggml stores the min as a positive value that is subtracted
    max_scale = scales.max(axis=-1, keepdims=True)
    max_min = neg_mins.max(axis=-1, keepdims=True)
    inv_scale = np.where(max_scale > 0, 63.0 / np.where(max_scale > 0, max_scale, 1), 0.0)
    inv_min = np.where(max_min > 0, 63.0 / np.where(max_min > 0, max_min, 1), 0.0)
    ls = np.clip(np.rint(scales * inv_scale), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(neg_mins * inv_min), 0, 63).astype(np.uint8)
    d = (max_scale / 63.0).astype(np.float16)
    dmin = (max_min / 63.0).astype(np.float16)
    # Quantize with the scales as they will be read back (fp16 super-scales times 6-bit sub-scales).
    sub_d = d.astype(np.float32) * ls
    sub_m = dmin.astype(np.float32) * lm
    safe = np.where(sub_d > 0, sub_d, 1.0)
    q = np.where(sub_d[..., None] > 0, np.rint((x + sub_m[..., None]) / safe[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 256)

    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4]
    packed[:, 4:8] = lm[:, 0:4]
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    # 64 values per 32 bytes: low nibbles the first 32, high nibbles the next 32.
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs],
                            axis=1)
    return blocks.reshape(n_rows, (n_cols // QK_K) * 144)


def _quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Rows (a multiple of 256 wide) as ggml `block_q6_K`s: per 256 values, 128 bytes of low 4 bits, 64 bytes of
    high 2 bits, sixteen int8 sub-block scales and an fp16 `d`; x ~= d*sc*(q - 32).

    Each 16-wide sub-block's scale maps its largest-magnitude value to -32, as the first guess of ggml's
    `make_qx_quants` does (the reference then searches nearby scales)."""
    n_rows, n_cols = rows.shape
    x = rows.astype(np.float32).reshape(-1, 16, 16)
    idx = np.abs(x).argmax(axis=-1)
    extreme = np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    scales = extreme / -32.0
    idx_max = np.abs(scales).argmax(axis=-1)
    max_scale = np.take_along_axis(scales, idx_max[..., None], axis=-1)  # keeps its sign, as ggml's does
    nonzero = max_scale != 0
    iscale = np.where(nonzero, -128.0 / np.where(nonzero, max_scale, 1), 0.0)
    sc = np.clip(np.rint(iscale * scales), -128, 127).astype(np.int8)
    d = np.where(nonzero, 1.0 / np.where(nonzero, iscale, 1), 0.0).astype(np.float16)
    sub = d.astype(np.float32) * sc
    safe = np.where(sub != 0, sub, 1.0)
    q = np.where(sub[..., None] != 0, np.rint(x / safe[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128, quarters of 32

    ql = ((q[:, :, 0:2, :] & 0xF) | ((q[:, :, 2:4, :] & 0xF) << 4)).reshape(-1, 128)
    qh = ((q[:, :, 0, :] >> 4) | ((q[:, :, 1, :] >> 4) << 2) | ((q[:, :, 2, :] >> 4) << 4)
          | ((q[:, :, 3, :] >> 4) << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(n_rows, (n_cols // QK_K) * 210)


# ---------------------------------------------------------------------------------------------------------------
# Metadata


def _add_metadata(writer, checkpoint_dir: Path, config: dict, ftype: int) -> None:
    """The general, hyperparameter and tokenizer keys llama.cpp's converter writes for a Llama."""
    from gguf import GGML_QUANT_VERSION, RopeScalingType

    name = str(config.get("_name_or_path") or checkpoint_dir.name).rstrip("/").split("/")[-1] or "model"
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(int(config["num_hidden_layers"]))
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(int(n_ctx))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    rope = _rope_parameters(config)
    rope_type = str(rope.get("rope_type") or "default")
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type not in ("default", "llama3"):
        raise ValueError(f"write_gguf does not convert rope type {rope_type!r}")
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    writer.add_file_type(ftype)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_rope_dimension_count(_head_dim(config))
    _add_tokenizer(writer, checkpoint_dir, config)
    writer.add_quantization_version(GGML_QUANT_VERSION)


def _add_tokenizer(writer, checkpoint_dir: Path, config: dict) -> None:
    """The tokenizer as the converter's `LlamaModel.set_vocab` -> `_set_vocab_gpt2` writes a byte-level BPE."""
    from gguf import Keys, SpecialVocab, TokenType
    from transformers import AutoTokenizer

    if not (checkpoint_dir / "tokenizer.json").is_file():
        raise ValueError(f"write_gguf needs a tokenizer.json (a GPT-2-style byte-level BPE) in {checkpoint_dir}")
    tokenizer_config_file = checkpoint_dir / "tokenizer_config.json"
    if tokenizer_config_file.is_file():
        tokenizer_config = json.loads(tokenizer_config_file.read_text())
        if (add_prefix_space := tokenizer_config.get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(bool(add_prefix_space))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    vocab: dict[str, int] = tokenizer.get_vocab()
    vocab_size = int(config.get("vocab_size") or len(vocab))
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids beyond the config's vocab_size {vocab_size}")
    reverse = {i: token for token, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    token_types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            token_types.append(int(TokenType.UNUSED))
            continue
        token = reverse[i]
        if token in added:
            if not added_decoder[i].normalized:
                token = str(tokenizer.decode(tokenizer.encode(token, add_special_tokens=False)))
            if added_decoder[i].special or _looks_special(token):
                token_types.append(int(TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                token_types.append(int(TokenType.USER_DEFINED))
        else:
            token_types.append(int(TokenType.NORMAL))
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    chkhsh = sha256(str(tokenizer.encode(_CHKTXT)).encode()).hexdigest()
    writer.add_tokenizer_pre(_PRE_BY_HASH.get(chkhsh, "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    SpecialVocab(checkpoint_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    if Keys.Tokenizer.ADD_BOS not in writer.kv_data[0]:
        # The converter leaves the key out when the tokenizer files do not say; llama.cpp then guesses from the
        # pre-tokenizer. Say what the Hugging Face tokenizer does, so that every reader agrees.
        bos = tokenizer.bos_token_id
        writer.add_add_bos_token(bos is not None and tokenizer.encode("a")[:1] == [bos])
    if vocab_size == 49152:  # llama.cpp's converter does this for every Llama of this vocabulary (SmolLM)
        writer.kv_data[0].pop(Keys.Tokenizer.ADD_BOS, None)
        writer.add_add_bos_token(False)


def _looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`: added tokens that are control tokens though not marked so."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))
