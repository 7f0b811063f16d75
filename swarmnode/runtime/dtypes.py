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


#: oneDNN's `ONEDNN_MAX_CPU_ISA` values under which it still multiplies bfloat16 in hardware; a lower cap (AVX2,
#: AVX512_CORE, ...) makes oneDNN run bfloat16 GEMMs as a CPU without AVX-512 BF16 or AMX would.
_BF16_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
              "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"}


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX-512 BF16 or AMX, and oneDNN not capped below
    them by `ONEDNN_MAX_CPU_ISA`), so that oneDNN's bfloat16 GEMM runs 3x faster than float32's; without it a
    bfloat16 GEMM of a 256-token prompt ran 3-6x slower than the same product in float32 (measured on a 2-core
    Xeon with oneDNN capped to AVX512_CORE and AVX2: 112 and 270 ms against 37 and 41 ms for a 256x2048 by
    2048x5632 product, the weight converted for the call included)."""
    import os

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in _BF16_ISAS:
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def dense_compute_dtype() -> torch.dtype:
    """The dtype a dense matrix product of many rows (a prompt) runs fastest in on this CPU: bfloat16 with
    native support (`native_bfloat16`), else float32."""
    return torch.bfloat16 if native_bfloat16() else torch.float32
