"""A Hugging Face checkpoint folder, read tensor by tensor: a node never loads more than its blocks.

Works with sharded safetensors (`model.safetensors.index.json`) and single-file checkpoints, for any
decoder-only architecture whose blocks `transformers` keeps as a list of layers (`model.layers.{i}.`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from swarmnode.errors import SwarmError

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<index>\d+)\.")


class CheckpointError(SwarmError, ValueError):
    """The folder is not a checkpoint this project can serve; the message says what is missing."""

    code = "bad_checkpoint"


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        if not (self.path / "config.json").is_file():
            raise CheckpointError(
                f"{self.path} has no config.json: pass the folder of a Hugging Face checkpoint "
                f"(run `swarmnode prepare-model` to make the test model)"
            )
        index_file = self.path / "model.safetensors.index.json"
        single_file = self.path / "model.safetensors"
        if index_file.is_file():
            self.weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        elif single_file.is_file():
            with safe_open(single_file, framework="pt") as f:
                self.weight_map = {name: single_file.name for name in f.keys()}  # noqa: SIM118
        else:
            raise CheckpointError(f"{self.path} holds no safetensors weights (model.safetensors[.index.json])")
        prefixes = {m.group("prefix") for name in self.weight_map if (m := _LAYER_RE.match(name))}
        if len(prefixes) != 1:
            raise CheckpointError(f"cannot find one list of transformer layers in {self.path}: {sorted(prefixes)}")
        self.layer_prefix = prefixes.pop()

    @cached_property
    def config(self):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path)
        config._attn_implementation = "sdpa"
        return config

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    def kv_bytes_per_token(self, dtype: torch.dtype, num_blocks: int = 1) -> int:
        """KV-cache bytes one token takes in `num_blocks` blocks: keys and values of every KV head."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_kv_heads * self.head_dim * element * num_blocks

    def block_prefix(self, index: int) -> str:
        return f"{self.layer_prefix}{index}."

    def block_param_bytes(self, index: int, dtype: torch.dtype) -> int:
        """Bytes of block `index`'s weights once cast to `dtype` (read from the headers only)."""
        element = torch.empty((), dtype=dtype).element_size()
        total = 0
        prefix = self.block_prefix(index)
        for shard, names in self._names_by_shard(prefix).items():
            with safe_open(self.path / shard, framework="pt") as f:
                for name in names:
                    shape = f.get_slice(name).get_shape()
                    numel = 1
                    for dim in shape:
                        numel *= dim
                    total += numel * element
        return total

    def load_tensors(self, prefix: str, dtype: torch.dtype | None = None, device: str = "cpu") -> dict:
        """Tensors whose names start with `prefix`, with the prefix stripped, read shard by shard."""
        tensors = {}
        for shard, names in self._names_by_shard(prefix).items():
            with safe_open(self.path / shard, framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[name[len(prefix):]] = tensor.to(device)
        if not tensors:
            raise CheckpointError(f"no tensors named {prefix}* in {self.path}")
        return tensors

    def _names_by_shard(self, prefix: str) -> dict[str, list[str]]:
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in self.weight_map.items():
            if name.startswith(prefix):
                by_shard[shard].append(name)
        return by_shard
