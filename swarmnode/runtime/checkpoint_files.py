"""What a checkpoint is made of on disk, and the error every checkpoint failure raises.

The safetensors formats a checkpoint is read through: the shard index (`model.safetensors.index.json`,
tensor name -> shard file), a shard's header (each tensor's dtype and shape, read without reading any
tensor) and the dtype names it uses. `runtime.checkpoint` (folders) and `runtime.hub` (Hub repos) both build
on this module, which imports neither.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmnode.errors import SwarmError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# the dtype names safetensors headers use, and the torch dtypes they stand for
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(SwarmError, ValueError):
    """The source is not a checkpoint this project can serve, or part of it cannot be had; the message
    says what is wrong and what to do."""

    code = "bad_checkpoint"


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's safetensors dtype name ("F32", "BF16", ...) and shape, as its file header says."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self.dtype)


def read_index(index_file: Path, source: str) -> dict[str, str]:
    try:
        weight_map = json.loads(Path(index_file).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{INDEX_FILE} of {source} is unreadable or has no weight_map: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{INDEX_FILE} of {source} has an empty or malformed weight_map")
    return weight_map


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Dtypes and shapes of a safetensors file's tensors, from its header (a few kB; no tensor is read)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"implausible header size {size}")
            header = json.loads(f.read(size))
        return {name: TensorInfo(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
