"""The floating-point dtypes a node computes in and hidden states travel in, by their protocol names.

The names are part of the records and the CLI (`records.DTYPE_NAMES`); this maps them to torch. Both the
wire (`messages.WIRE_DTYPES`) and the nodes' compute dtypes come from this one table.
"""

from __future__ import annotations

import functools

import torch

from swarmnode.records import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol name of a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX-512 BF16 or AMX), so that oneDNN's bfloat16
    GEMM runs 3x faster than float32's; without it PyTorch converts every element and bfloat16 GEMMs run several
    times slower than float32 ones."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def dense_compute_dtype() -> torch.dtype:
    """The dtype a dense matrix product of many rows (a prompt) runs fastest in on this CPU: bfloat16 with
    native support (`native_bfloat16`), else float32."""
    return torch.bfloat16 if native_bfloat16() else torch.float32
