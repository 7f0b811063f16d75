"""A node's measured speed: the decode throughput of one block of the model on this machine.

The coordinator plans from measurements, not guesses (Helix §4.3: a node's `T_j` is profiled, not
modelled): a node times one block of the model at its own thread count, device and dtype (decode-sized
steps, the shape that dominates serving), and caches the figure per (model, device, dtype, quantization,
threads) in
`~/.cache/swarmnode/throughput.json`, so a restart does not pay for it again. What fits in the node's
memory is `server.memory_plan`'s business.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from swarmnode.records import served_kind
from swarmnode.runtime.blocks import (
    PREFILL_PROBE_TOKENS,
    BlockStack,
    measure_block_throughput,
    measure_prefill_throughput,
)
from swarmnode.runtime.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

CACHE_FILE_ENV = "SWARMNODE_THROUGHPUT_CACHE"


def _cache_path() -> Path:
    return Path(os.environ.get(CACHE_FILE_ENV) or Path.home() / ".cache" / "swarmnode" / "throughput.json")


def _model_fingerprint(checkpoint: Checkpoint) -> str:
    config = (checkpoint.path / "config.json").read_bytes()
    return f"{checkpoint.name}-{hashlib.sha256(config).hexdigest()[:12]}"


def _cache_key(checkpoint: Checkpoint, device: str, dtype: str, quantization: str, threads: int) -> str:
    return f"{_model_fingerprint(checkpoint)}|{device}|{served_kind(dtype, quantization)}|{threads}"


class BlockSpeed(NamedTuple):
    """One block's measured speed here: decode steps (one token each) and a prompt's prefill, in tokens/s."""

    decode: float
    prefill: float


def measured_block_throughput(checkpoint: Checkpoint, *, device: str, dtype_name: str, dtype: torch.dtype,
                              threads: int, quantization: str = "none", remeasure: bool = False) -> BlockSpeed:
    """Tokens/s of one block of this model here, for decode steps and for a prompt's prefill; measured once,
    then read from the cache file."""
    path = _cache_path()
    key = _cache_key(checkpoint, device, dtype_name, quantization, threads)
    cached: dict = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            logger.warning("ignoring an unreadable throughput cache at %s", path)
    entry = cached.get(key)
    if not remeasure and isinstance(entry, dict) and all(
            isinstance(entry.get(k), (int, float)) and entry[k] > 0 for k in ("tokens_per_s", "prefill_tokens_per_s")):
        logger.info("block throughput %.0f tokens/s decoding, %.0f prefilling (measured %s, cached in %s)",
                    entry["tokens_per_s"], entry["prefill_tokens_per_s"],
                    time.strftime("%Y-%m-%d", time.localtime(entry.get("measured_at", 0))), path)
        return BlockSpeed(float(entry["tokens_per_s"]), float(entry["prefill_tokens_per_s"]))
    logger.info("measuring the throughput of one block on %s (%s, quantization %s, %d threads)", device, dtype_name,
                quantization, threads)
    began = time.perf_counter()
    # random weights of the model's shapes: the speed is the same, and no shard has to be read or fetched
    block = checkpoint.family.largest_block  # the slowest block: the figure holds for any block the node serves
    stack = BlockStack(checkpoint, block, block + 1, dtype=dtype, device=device, quantization=quantization,
                       random_weights=True)
    figures = sorted(measure_block_throughput(stack, repeats=16) for _ in range(3))
    prefill = measure_prefill_throughput(stack)
    del stack
    tokens_per_s = figures[1]  # the median of three runs
    logger.info("block throughput %.0f tokens/s decoding, %.0f prefilling a %d-token prompt (measured in %.1f s)",
                tokens_per_s, prefill, PREFILL_PROBE_TOKENS, time.perf_counter() - began)
    cached[key] = {"tokens_per_s": tokens_per_s, "prefill_tokens_per_s": prefill, "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the throughput in %s: %s", path, exc)
    return BlockSpeed(tokens_per_s, prefill)
