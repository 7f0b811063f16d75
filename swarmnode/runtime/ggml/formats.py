"""ggml's block formats for the GGUF tensor types a node serves as they are: sizes, and what is refused.

A GGUF tensor of a quantized type is a sequence of fixed-size blocks along each row (the last dim): a
block of ``block_elems`` weights takes ``block_bytes`` bytes (ggml's ``ggml_type_traits[t].blck_size``
and ``.type_size``; ``gguf.GGML_QUANT_SIZES`` in Python). The values of :class:`GGMLType` are ggml's
``enum ggml_type`` numbers (the same as ``gguf.GGMLQuantizationType``), so a type read from a file can be
passed straight in. Only the types the C kernels in :mod:`swarmnode.runtime.ggml.kernels` implement are
listed; every other type raises :class:`UnsupportedFormatError`, which says what to do instead.

No torch import here: the GGUF reader and the planner size tensors with this module alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from swarmnode.errors import SwarmError

__all__ = [
    "FORMATS",
    "BlockFormat",
    "GGMLType",
    "UnsupportedFormatError",
    "as_type",
    "is_quantized",
    "row_bytes",
    "tensor_bytes",
]


class GGMLType(IntEnum):
    """The ggml tensor types the kernels serve; values are ggml's (``gguf.GGMLQuantizationType``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True)
class BlockFormat:
    """One ggml type's block: ``block_elems`` weights of a row stored in ``block_bytes`` bytes."""

    type: GGMLType
    block_elems: int
    block_bytes: int


FORMATS: dict[GGMLType, BlockFormat] = {
    f.type: f
    for f in (
        BlockFormat(GGMLType.F32, 1, 4),
        BlockFormat(GGMLType.F16, 1, 2),
        BlockFormat(GGMLType.BF16, 1, 2),
        BlockFormat(GGMLType.Q4_0, 32, 18),  # fp16 d, 16 bytes of nibbles
        BlockFormat(GGMLType.Q4_1, 32, 20),  # fp16 d, fp16 m, 16 bytes of nibbles
        BlockFormat(GGMLType.Q5_0, 32, 22),  # fp16 d, 4 bytes of high bits, 16 bytes of nibbles
        BlockFormat(GGMLType.Q5_1, 32, 24),  # fp16 d, fp16 m, 4 bytes of high bits, 16 bytes of nibbles
        BlockFormat(GGMLType.Q8_0, 32, 34),  # fp16 d, 32 int8
        BlockFormat(GGMLType.Q4_K, 256, 144),  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 nibbles
        BlockFormat(GGMLType.Q5_K, 256, 176),  # as Q4_K plus 32 bytes of high bits
        BlockFormat(GGMLType.Q6_K, 256, 210),  # 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
    )
}

_SUPPORTED = ", ".join(t.name for t in FORMATS)


class UnsupportedFormatError(SwarmError, ValueError):
    """A GGUF tensor type (or row length) the kernels cannot serve; the message says what to do."""

    code = "unsupported_gguf_type"


def _type_name(t: object) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(int(t)).name} ({int(t)})"  # type: ignore[call-overload]
    except Exception:
        return repr(t)


def as_type(t: GGMLType | int) -> GGMLType:
    """`t` as a :class:`GGMLType`, or :class:`UnsupportedFormatError` naming it and what to do."""
    if isinstance(t, GGMLType):
        return t
    try:
        return GGMLType(int(t))
    except (ValueError, TypeError):
        raise UnsupportedFormatError(
            f"GGUF tensor type {_type_name(t)} is not supported; supported types are {_SUPPORTED}. "
            "Re-quantize the file to one of them (e.g. Q8_0, Q4_K_M, Q5_K_M or Q6_K) with llama.cpp's "
            "llama-quantize, or use a GGUF published in one of those types."
        ) from None


def is_quantized(t: GGMLType | int) -> bool:
    """Whether `t` is a block-quantized type (not F32, F16 or BF16)."""
    return FORMATS[as_type(t)].block_elems > 1


def row_bytes(t: GGMLType | int, k: int) -> int:
    """Bytes of one row of `k` weights of type `t`; `k` must be a whole number of blocks."""
    fmt = FORMATS[as_type(t)]
    if k < 0 or k % fmt.block_elems:
        raise UnsupportedFormatError(
            f"a row of {k} weights is not a whole number of {fmt.type.name} blocks of "
            f"{fmt.block_elems}; ggml cannot store such a tensor in {fmt.type.name}. Re-quantize the "
            "file so this tensor uses a type whose block divides its row length (llama-quantize "
            "falls back to such a type itself), e.g. Q8_0 or F16."
        )
    return k // fmt.block_elems * fmt.block_bytes


def tensor_bytes(t: GGMLType | int, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `shape` (torch order: the last dim is the row) stored as type `t`."""
    if not shape:
        return row_bytes(t, 1)
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    return rows * row_bytes(t, int(shape[-1]))
