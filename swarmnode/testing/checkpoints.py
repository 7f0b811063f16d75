"""Tiny random-weight checkpoints of every supported architecture family, for tests.

Architecture tests need a real checkpoint of each family (Llama, Mistral with its sliding window, Qwen2,
Qwen3 with its explicit head size) that loads in well under a second: these are built from small configs
(hidden size 64, 4 heads, 2 KV heads) with random weights and written in several shards, so that a node
reads only the shards of its blocks exactly as it does for a real model. Their outputs mean nothing; tests
compare the swarm with local `transformers` on the same weights.
"""

from __future__ import annotations

from pathlib import Path

from swarmnode.errors import SwarmError
from swarmnode.model_prep import is_prepared, mark_prepared

__all__ = ["TINY_FAMILIES", "UnknownFamilyError", "make_tiny_checkpoint", "tiny_config"]

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class UnknownFamilyError(SwarmError, ValueError):
    """A tiny checkpoint of a family this module does not know was asked for."""

    code = "unknown_family"


def tiny_config(family: str, num_layers: int = 6):
    """A small config of `family` (hidden 64, 4 heads, 2 KV heads) for architecture tests."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise UnknownFamilyError(f"unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
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
    """Write a random-weight checkpoint of `family` with several shards into `out_dir` and return it (once:
    a folder already made is returned as it is)."""
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
    mark_prepared(out_dir, f"tiny {family} seed={seed}")
    return out_dir
