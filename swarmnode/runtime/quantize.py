"""Weight-only quantization of a block's linear layers, for nodes that serve blocks on CPU.

A node that quantizes keeps each ``torch.nn.Linear`` of its blocks as low-bit integers plus scales and
multiplies activations against them directly, so a block's linears take half (``int8``) or a third
(``int4``) of their bfloat16 memory, and decoding, which on CPU is bound by how many weight bytes are read
per token, gets faster too. Activations, norms, attention and the KV cache keep the node's dtype.

Modes (:data:`QUANTIZATIONS`):

* ``"none"``: the blocks stay as loaded.
* ``"int8"``: per-output-channel symmetric int8, ``w ≈ q * scale[n]``; one bfloat16 scale per output row.
* ``"int4"``: groupwise asymmetric 4-bit over :data:`INT4_GROUP_SIZE` input columns,
  ``w ≈ (q - 8) * scale[g, n] + zero[g, n]`` with ``q`` in 0..15; bfloat16 scales and zeros.
* ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"bf16"`` (:data:`GGML_MODES`): llama.cpp's formats, multiplied by
  `runtime.ggml`'s kernels; ``bf16`` keeps 16-bit rows (a bfloat16 checkpoint's weights as they are) and, at the
  node's default float32, decodes through the C step of `runtime.ggml.decode_step` at GGUF F16 speed, where
  ``--dtype bfloat16`` runs `transformers`' layers in bfloat16 for its bits.

Kernels. Both modes run PyTorch's own CPU ATen kernels, the ones optimum-quanto and torchao themselves
dispatch to on CPU: ``torch._weight_int8pack_mm`` and ``torch._convert_weight_to_int4pack_for_cpu`` +
``torch._weight_int4pack_mm_for_cpu``. They were picked by measurement (``scripts/bench_quantize.py``:
torch 2.13, 2 threads of a shared 2-core AVX2 AMD EPYC without AVX-512; time of a block's seven linears
over M input rows, relative to bfloat16 ``nn.Linear`` timed in turns in the same run, medians of 7):

    ==============================  =====  =====  =====
    1B Llama block (2048 / 5632)    M=1    M=8    M=512
    ==============================  =====  =====  =====
    float32 nn.Linear               1.80   0.81   0.15
    int8                            0.60   0.30   0.32
    int4                            0.71   0.32   0.35
    int8, float32 in and out        0.56   0.34   0.28
    ==============================  =====  =====  =====

and for the SmolLM2-135M block (576 / 1536), where per-call overhead weighs more: float32 1.27 / 0.46 /
0.12, int8 0.77 / 0.34 / 0.25, int4 0.92 / 0.37 / 0.25, int8 with float32 in and out 1.03 / 0.32 / 0.24.
Decoding is faster than bfloat16 in both modes (with float32 activations, faster than float32). Prefill is 3-4x faster than
bfloat16 (whose GEMM is slow on CPUs without AVX-512 BF16) but about 2x slower than float32.

The alternatives, on the 1B block's 5632x2048 linear in the same kind of run (M=1 / 8 / 512; these
kernels there: int8 0.47 / 0.28 / 0.25, int4 0.76 / 0.40 / 0.27): optimum-quanto 0.2.7 qint8 0.70 /
0.29 / 0.31 and qint4 0.77 / 0.31 / 0.27, and torchao 0.18.0's prototype int4 (it imports and runs with
torch 2.13; its stable ``Int4WeightOnlyConfig`` no longer has the CPU layout) 0.79 / 0.40 / 0.25: the same
ATen kernels underneath. torchao's ``Int8WeightOnlyConfig`` 2.1 / 1.2 / 1.0; bitsandbytes 0.50.2's CPU
backend 15 / 5.7 / 1.07 (int8) and 20 / 2.5 / 1.06 (nf4); hqq 0.2.8 4.3 / 2.4 / 0.84 (8-bit) and 8.8 /
1.5 / 0.95 (4-bit). Nothing is faster than PyTorch's kernels, so the project takes no new dependency.

Prompts run dense. The integer kernels above are bound by their arithmetic once many rows share the weight: on
a CPU with AMX (2-core Xeon, 2 threads) a 1B Llama block ran 512-token prompts at 1,157 (int8) and 1,142 (int4)
tokens/s through them, against 5,586 in bfloat16 through oneDNN's GEMM. From :data:`DENSE_ROWS` rows a product
therefore unpacks its weight into the dtype this CPU multiplies fastest (`dtypes.dense_compute_dtype`:
bfloat16 with AVX-512 BF16 or AMX, else float32), one matrix at a time and for that call only (nothing
dequantized is held), and runs the GEMM: the same block then prefilled 4,226 (int8) and 2,712 (int4) tokens/s,
its decode steps unchanged (unpacking an int4 matrix costs about as much as multiplying it by 256 rows; int8's
costs a quarter of that). The dense product multiplies the same quantized values (a bfloat16 rounding of each,
against the kernels' float32): outputs differ from the kernels' by about 0.3% of their norm, the size of one
bfloat16 rounding. :data:`DENSE_ROWS` lies above the scheduler's largest batch of decode steps, so a session's
decode results never depend on how many others share its batch.

Quality on SmolLM2-135M-Instruct (464 tokens of English prose, ``tests/test_quantization.py``):
perplexity bfloat16 16.33, float32 16.30, int8 16.29, int4 16.43; mean cosine of the logits against
bfloat16: int8 0.9991, int4 0.9996. This checkpoint is de-quantized from a Q4_1 GGUF file, whose weights
lie on a 4-bit grid of 32-column blocks, which int4 groups of 32 reproduce: one more reason for groups of
32 (groups of 64 give perplexity 20.65, mean cosine 0.90 there). Memory of a block's linears relative to
bfloat16: int8 50.1%, int4 31.2% (0.625 bytes a weight).

What the kernels require, and so what this module checks (:func:`check_supported`, :func:`quantize_linears`):

* On x86 both kernels are vectorized for bfloat16 activations only; float32 (and float16) inputs fall to
  a scalar loop 6-10x slower than bfloat16. Inputs of any floating dtype are therefore cast to bfloat16
  for the product and the result cast back: a float32 node gets outputs rounded to bfloat16 precision by
  its quantized linears (an error of the order of the int8 weights' own rounding), at bfloat16 speed.
* ``int8``: ``in_features`` a multiple of 16 (the AVX2 and AVX-512 loops read 8 / 16 columns at a time
  and give wrong sums otherwise); activation rows 32-byte aligned (the kernel uses aligned loads and
  crashes otherwise: inputs are copied when a view is not aligned).
* ``int4``: ``out_features`` a multiple of 16 and ``in_features`` a multiple of the group size (the
  kernel takes groups of 32, 64, 128 or 256 columns; 32 is used, see above). The packed layout depends on
  the CPU's vector width: it is built on the node that uses it and never stored or sent.
* CPU tensors only.

Experts. Mixtures of experts keep each projection of all a block's experts as one 3-D parameter
(``mlp.experts.gate_up_proj``: experts x out x in, or experts x in x out where the family stores it transposed,
as gpt-oss does), not as ``nn.Linear``; they are most of an MoE block's bytes. :class:`QuantizedExperts` holds
such a parameter quantized expert by expert, in the same two modes and kernels (an expert's matrix is quantized
exactly as a linear of its shape would be), and the experts module then runs :func:`quantized_experts_forward`,
registered with ``transformers``' experts interface (``ExpertsInterface``): the family's own gating
(``_apply_gate``: SwiGLU, or gpt-oss' clamped GLU with its biases), routing weights and sums stay the library's,
and only the experts a token was routed to are read. Routers stay in the node's dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from swarmnode.errors import SwarmError
from swarmnode.records import GGUF_QUANTIZATION, QUANTIZE_CHOICES
from swarmnode.runtime.dtypes import dense_compute_dtype
from swarmnode.runtime.ggml.formats import FORMATS, GGMLType

__all__ = [
    "INT4_GROUP_SIZE",
    "QUANTIZATIONS",
    "QUANTIZED_EXPERTS",
    "QuantizationError",
    "QuantizedExperts",
    "QuantizedLinear",
    "block_bytes",
    "check_supported",
    "dequantize",
    "expert_weights",
    "quantize_block",
    "quantize_experts",
    "quantized_experts_forward",
    "quantized_linear",
    "quantized_tensor_bytes",
    "stored_tensors",
]

# the modes this module applies as blocks load (`records.QUANTIZE_CHOICES`; a GGUF file's are `runtime.ggml`'s)
QUANTIZATIONS = QUANTIZE_CHOICES
# Input columns sharing one int4 scale and zero (see the module docstring for why 32).
INT4_GROUP_SIZE = 32
# The dtype the CPU kernels are vectorized for: activations, scales and zeros are passed in it.
_KERNEL_DTYPE = torch.bfloat16
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What to suggest when a mode cannot handle a model.
_FALLBACK = {"int4": "int8 or none", "int8": "none", "q4_0": "int4 or none", "q4_1": "int4 or none",
             "q8_0": "int8 or none", "bf16": "none"}
#: Modes that store each linear in one of ggml's formats (`runtime.ggml`), quantized as llama.cpp's quantizer does
#: it, and multiply with ggml's arithmetic: for the 32-weight blocks, activations quantized to 8 bits per block;
#: for bf16 (16-bit rows, the weights of a bfloat16 checkpoint exactly), float32 products of the bfloat16 weights.
GGML_MODES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "bf16": "BF16"}
# Rows quantized at a time, so that the float32 working copies stay small for large linears.
_ROW_CHUNK = 256
#: Rows (tokens) from which a quantized product runs dense: the weight is unpacked into the dtype this CPU
#: multiplies fastest (`dtypes.dense_compute_dtype`) for the call only, and multiplied by oneDNN's GEMM (see
#: the module docstring). Above the scheduler's largest batch of decode steps (64 rows), so a session's decode
#: results never depend on how many others share its batch.
DENSE_ROWS = 96


class QuantizationError(SwarmError, ValueError):
    """A quantization mode that is unknown, or that cannot handle a model's (or a layer's) shapes; the
    message says what is wrong and what to do."""

    code = "bad_quantization"


def _check_mode(mode: str) -> None:
    if mode not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown quantization {mode!r}; pick one of {', '.join(QUANTIZATIONS)}"
        )


def _shape_problem(out_features: int, in_features: int, mode: str,
                   group_size: int = INT4_GROUP_SIZE) -> str | None:
    """Why the kernel of `mode` cannot run a linear of this shape, or None when it can."""
    if mode in GGML_MODES and in_features % (block := FORMATS[GGMLType[GGML_MODES[mode]]].block_elems):
        return f"its in_features {in_features} is not a multiple of {block}, the block of {GGML_MODES[mode]}"
    if mode == "int8" and in_features % 16:
        return f"its in_features {in_features} is not a multiple of 16, which the int8 kernel needs"
    if mode == "int4":
        if out_features % 16:
            return f"its out_features {out_features} is not a multiple of 16, which the int4 kernel needs"
        if in_features % group_size:
            return f"its in_features {in_features} is not a multiple of the int4 group size {group_size}"
    return None


def _matrices(layer: torch.nn.Module):
    """(name, out_features, in_features) of every weight matrix of `layer` that a quantized node holds as integers:
    each ``nn.Linear``'s weight, and each expert's matrix of a fused experts parameter (:func:`expert_weights`)."""
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield name, module.out_features, module.in_features
        for attr, weight in expert_weights(module).items():
            out_features, in_features = _expert_matrix_shape(module, weight.shape)
            yield f"{name}.{attr}" if name else attr, out_features, in_features


def check_supported(family, mode: str, *, device: str | torch.device = "cpu") -> None:
    """Raise :class:`QuantizationError` when blocks of `family` (a `runtime.family.ModelFamily`) cannot be
    quantized in `mode` on `device`: so a node fails at start, before it loads anything. Every block's linears and
    expert matrices are checked on meta-device layers (no memory)."""
    _check_mode(mode)
    if mode == "none":
        return
    if torch.device(device).type != "cpu":
        raise QuantizationError(
            f"quantization {mode!r} runs on CPU only, not on {device}; serve on cpu or use quantization none"
        )
    seen = set()
    for index in range(family.num_layers):
        if mode in GGML_MODES and any(expert_weights(m) for m in family.new_layer(index).modules()):
            raise QuantizationError(f"this model cannot be quantized to {mode}: block {index} holds experts, which "
                                    f"only int8 and int4 quantize; use quantization {_FALLBACK[mode]}")
        for name, out_features, in_features in _matrices(family.new_layer(index)):
            if (name, out_features, in_features) in seen:
                continue
            seen.add((name, out_features, in_features))
            problem = _shape_problem(out_features, in_features, mode)
            if problem is not None:
                raise QuantizationError(
                    f"this model cannot be quantized to {mode}: block {index}'s {name} ({out_features}x{in_features}) "
                    f"{problem}; use quantization {_FALLBACK[mode]}"
                )


class QuantizedLinear(torch.nn.Module):
    """A drop-in for ``torch.nn.Linear`` holding its weight quantized (``int8`` or ``int4``).

    Buffers: ``qweight`` (int8 ``[out, in]``, or the int4 kernel's packed uint8 ``[out, in / 2]``),
    ``scales`` (bfloat16: ``[out]`` for int8, ``[in / group, out, 2]`` scales and zeros for int4) and
    ``bias`` (the compute dtype) or None. ``forward`` takes and returns the input's dtype.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, mode: str, qweight: torch.Tensor,
                 scales: torch.Tensor, bias: torch.Tensor | None, group_size: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, mode: str, compute_dtype: torch.dtype, *,
                    group_size: int = INT4_GROUP_SIZE) -> QuantizedLinear:
        """Quantize `linear`'s weight (it is left untouched; drop it to free it). `group_size` is for int4
        only, and is there to compare group sizes: nodes use :data:`INT4_GROUP_SIZE`."""
        if mode not in ("int8", "int4"):
            raise QuantizationError(f"quantization {mode!r} has no quantized linear; pick int8 or int4")
        if mode == "int4" and group_size not in (32, 64, 128, 256):
            raise QuantizationError(f"int4 group size {group_size} is not one of 32, 64, 128, 256")
        problem = _shape_problem(linear.out_features, linear.in_features, mode, group_size)
        if problem is not None:
            raise QuantizationError(
                f"cannot quantize a {linear.out_features}x{linear.in_features} linear to {mode}: {problem}"
            )
        weight = linear.weight.detach()
        if mode == "int8":
            qweight, scales = _quantize_int8(weight)
        else:
            qweight, scales = _quantize_int4(weight, group_size)
        bias = None if linear.bias is None else linear.bias.detach().to(compute_dtype, copy=True)
        return cls(linear.in_features, linear.out_features, mode, qweight, scales, bias,
                   group_size if mode == "int4" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _packed_matmul(x.reshape(-1, self.in_features), self.mode, self.qweight, self.scales, self.group_size)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{group}, "
                f"bias={self.bias is not None}")


def _packed_matmul(x: torch.Tensor, mode: str, qweight: torch.Tensor, scales: torch.Tensor,
                   group_size: int | None) -> torch.Tensor:
    """``x @ W.T`` for rows `x` (tokens x in) and a weight quantized in `mode`, in `x`'s dtype: through the CPU
    kernel (bfloat16 in and out, rows 64-byte aligned; see the module docstring) for fewer than
    :data:`DENSE_ROWS` rows, else as a dense product with the weight unpacked for the call
    (:func:`dequantize`)."""
    if x.shape[0] >= DENSE_ROWS and (mode == "int8" or _int4_layout() is not None):
        dense = dense_compute_dtype()
        weight = dequantize(mode, qweight, scales, group_size, x.shape[-1], dense)
        y = torch.nn.functional.linear(x if x.dtype == dense else x.to(dense), weight)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    a = x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)
    if not a.is_contiguous() or a.data_ptr() % 64:  # the int8 kernel loads rows with aligned loads
        a = a.clone(memory_format=torch.contiguous_format)
    if mode == "int8":
        y = torch._weight_int8pack_mm(a, qweight, scales)
    else:
        assert group_size is not None, "int4 weights are quantized in groups"
        y = torch._weight_int4pack_mm_for_cpu(a, qweight, group_size, scales)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def dequantize(mode: str, qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The (out x in) matrix a quantized weight stands for, in `dtype`: ``q * scale[n]`` for int8, ``(q - 8) *
    scale[g, n] + zero[g, n]`` for int4 (read out of the kernel's packed layout, :func:`_int4_layout`)."""
    if mode == "int8":
        return qweight.to(dtype).mul_(scales.to(dtype)[:, None])
    assert group_size is not None, "int4 weights are quantized in groups"
    codes = _unpack_int4(qweight, qweight.shape[0], in_features)
    out_features, groups = qweight.shape[0], in_features // group_size
    weight = codes.view(out_features, groups, group_size).to(dtype).sub_(8)
    scale_zero = scales.to(dtype).transpose(0, 1)  # out x groups x 2
    weight.mul_(scale_zero[..., 0, None]).add_(scale_zero[..., 1, None])
    return weight.view(out_features, in_features)


@functools.cache
def _int4_layout() -> int | None:
    """The row block of the CPU int4 kernel's packed layout on this CPU (it depends on the vector width), found by
    packing a probe and reading it back; None when no known layout reads back (prompts then use the kernel).

    Within each full block of B rows, byte ``k * B/2 + j`` holds column k of row j (low nibble) and of row
    ``j + B/2`` (high nibble); the last ``out % B`` rows, when any, hold rows ``2j`` and ``2j + 1`` in byte
    ``k * rows/2 + j``."""
    probe = torch.randint(0, 16, (112, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 2)
    for block in (64, 32, 16):
        if torch.equal(_unpack_int4(packed, 112, 64, block).to(torch.int32), probe):
            return block
    return None


def _unpack_int4(packed: torch.Tensor, out_features: int, in_features: int, block: int | None = None) -> torch.Tensor:
    """The (out x in) 0..15 codes of an int4 weight in the CPU kernel's packed layout (:func:`_int4_layout`)."""
    block = block or _int4_layout()
    assert block is not None, "the int4 kernel's packed layout on this CPU is unknown"
    flat = packed.reshape(-1)
    codes = torch.empty(out_features, in_features, dtype=torch.uint8)
    full = out_features // block * block
    if full:
        blocks = flat[: full * in_features // 2].view(full // block, in_features, block // 2).transpose(1, 2)
        halves = codes[:full].view(full // block, 2, block // 2, in_features)
        torch.bitwise_and(blocks, 15, out=halves[:, 0])
        torch.bitwise_right_shift(blocks, 4, out=halves[:, 1])
    if full < out_features:
        rows = out_features - full
        tail = flat[full * in_features // 2:].view(in_features, rows // 2).t()
        pairs = codes[full:].view(rows // 2, 2, in_features)
        torch.bitwise_and(tail, 15, out=pairs[:, 0])
        torch.bitwise_right_shift(tail, 4, out=pairs[:, 1])
    return codes


def _quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: ``q = round(w / s)`` with ``s = max|w_row| / 127`` (in bfloat16)."""
    out_features = weight.shape[0]
    qweight = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(out_features, dtype=_KERNEL_DTYPE)
    for start in range(0, out_features, _ROW_CHUNK):
        rows = weight[start:start + _ROW_CHUNK].float()
        scale = (rows.abs().amax(dim=1) / 127).clamp_(min=1e-12).to(_KERNEL_DTYPE)
        scales[start:start + _ROW_CHUNK] = scale
        # quantize with the rounded scale the kernel will use
        qweight[start:start + _ROW_CHUNK] = rows.div_(scale.float()[:, None]).round_().clamp_(-128, 127)
    return qweight, scales


def _quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric groupwise 4-bit over `group_size` input columns, packed for the CPU int4 kernel.

    Per group: ``scale = (max - min) / 15`` and ``zero = min + 8 * scale`` (both in bfloat16), so that
    ``(q - 8) * scale + zero`` spans the group's range with ``q = round((w - zero) / scale) + 8`` in 0..15.
    """
    out_features, in_features = weight.shape
    groups = in_features // group_size
    codes = torch.empty(weight.shape, dtype=torch.int32)
    scales_and_zeros = torch.empty(groups, out_features, 2, dtype=_KERNEL_DTYPE)
    for start in range(0, out_features, _ROW_CHUNK):
        rows = weight[start:start + _ROW_CHUNK].float().reshape(-1, groups, group_size)
        low, high = rows.amin(dim=-1), rows.amax(dim=-1)
        scale = ((high - low) / 15).clamp_(min=1e-12).to(_KERNEL_DTYPE).float()
        zero = (low + 8 * scale).to(_KERNEL_DTYPE).float()
        q = rows.sub_(zero[..., None]).div_(scale[..., None]).round_().add_(8).clamp_(0, 15)
        codes[start:start + _ROW_CHUNK] = q.reshape(-1, in_features)
        scales_and_zeros[:, start:start + _ROW_CHUNK] = torch.stack([scale, zero], dim=-1).transpose(0, 1)
    # innerKTiles is unused by the CPU packing; 2 is the smallest value the op accepts.
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    return packed, scales_and_zeros


def quantize_block(module: torch.nn.Module, mode: str, compute_dtype: torch.dtype) -> None:
    """Quantize every ``torch.nn.Linear`` and every fused experts parameter inside `module` (a decoder block, or a
    whole model's layers) in place: linears become :class:`QuantizedLinear`, experts' 3-D weights
    :class:`QuantizedExperts`, each taking and returning `compute_dtype` tensors shaped as before; biases are kept
    (in `compute_dtype`).

    Every shape is checked before anything changes, so a :class:`QuantizationError` leaves `module` as it was.
    The full-precision weights are released as each one is replaced: once the caller drops its own references to
    the loaded tensors, they are freed, so a node quantizing each block right after loading it never holds more
    than one block in full precision. A Llama block quantized into ggml's blocks (`GGML_MODES`) gets the C decode
    step nodes give it (`runtime.ggml.decode_step`), so a local reference computes as the nodes do.
    """
    _check_mode(mode)
    if compute_dtype not in _COMPUTE_DTYPES:
        raise QuantizationError(
            f"compute dtype {compute_dtype} is not supported by quantized linears; use float32 or bfloat16"
        )
    if mode == "none":
        return
    if isinstance(module, torch.nn.Linear):
        raise QuantizationError("quantize_block replaces the linears inside a module: pass the block holding it")
    for name, out_features, in_features in _matrices(module):
        problem = _shape_problem(out_features, in_features, mode)
        if problem is not None:
            raise QuantizationError(
                f"cannot quantize {name} ({out_features}x{in_features}) to {mode}: {problem}; "
                f"use quantization {_FALLBACK[mode]}"
            )
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "cpu":
            raise QuantizationError(
                f"the block is on {tensor.device}; quantization {mode!r} runs on CPU only: load the blocks on cpu "
                f"or use quantization none"
            )
    for name in [name for name, _ in module.named_modules()]:
        quantize_ready(module, name, mode, compute_dtype)
    if mode in GGML_MODES:  # the decode step a node gives such blocks (`runtime.ggml.decode_step`): the same bits
        from swarmnode.runtime.ggml import decode_step

        for inner in list(module.modules()):
            decode_step.attach(inner)


def quantize_ready(layer: torch.nn.Module, module_name: str, mode: str, compute_dtype: torch.dtype) -> None:
    """Quantize what of module `module_name` of `layer` has arrived whole: a linear once its weight (and bias) are
    there, an experts module's fused weight as soon as it is there; a block being filled tensor by tensor calls
    this after each tensor, so each weight's full-precision copy goes at once (an experts module never holds two
    of them: gpt-oss' fused weights are most of a block). A GGUF block ("gguf") arrives quantized already."""
    if mode in ("none", GGUF_QUANTIZATION):
        return
    module = layer.get_submodule(module_name) if module_name else layer
    if isinstance(module, torch.nn.Linear):
        if any(t.is_meta for t in module.parameters(recurse=False)):
            return
        parent_name, _, child = module_name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, quantized_linear(module, mode, compute_dtype))
        # the full-precision tensors go now (as `module.weight = module.bias = None` does, which torch's stubs refuse)
        module.register_parameter("weight", None)
        module.register_parameter("bias", None)
    elif any(not w.is_meta for w in expert_weights(module).values()):
        if mode in GGML_MODES:
            raise QuantizationError(f"{module_name} holds experts, which {mode} does not quantize: use int8 or int4")
        quantize_experts(module, mode, compute_dtype)


def quantized_linear(linear: torch.nn.Linear, mode: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """`linear` quantized in `mode`: a :class:`QuantizedLinear` (int8, int4) or a ggml-blocks linear (`GGML_MODES`);
    `linear` is left untouched."""
    if mode in GGML_MODES:
        return _ggml_linear(linear, mode, compute_dtype)
    return QuantizedLinear.from_linear(linear, mode, compute_dtype)


def _ggml_linear(linear: torch.nn.Linear, mode: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """`linear` with its weight in ggml's block format of `mode` (`GGML_MODES`), as llama.cpp's quantizer writes it
    (`gguf.quants`, the same arithmetic as ggml's `quantize_row_*_ref`), as a `runtime.ggml.weights.GGMLLinear`."""
    from swarmnode.runtime.ggml.formats import GGMLType
    from swarmnode.runtime.ggml.weights import GGMLLinear, quantize_weight

    problem = _shape_problem(linear.out_features, linear.in_features, mode)
    if problem is not None:
        raise QuantizationError(f"cannot quantize a {linear.out_features}x{linear.in_features} linear to {mode}: "
                                f"{problem}")
    weight = quantize_weight(linear.weight.detach(), GGMLType[GGML_MODES[mode]])
    bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(compute_dtype, copy=True),
                                                                  requires_grad=False)
    return GGMLLinear(weight, bias)


def quantized_tensor_bytes(name: str, shape: tuple[int, ...], mode: str, dtype: torch.dtype) -> int:
    """Bytes a block's tensor takes once loaded in `dtype` and quantized in `mode`, without loading it.

    `name` is relative to the block (``self_attn.q_proj.weight``, ``input_layernorm.weight``). Two-dimensional
    ``weight`` tensors are linears' weights and take their quantized size (packed weight plus bfloat16
    scales, and zeros for int4); every other tensor, biases included, takes ``numel * dtype size``.
    Equals the bytes of the tensors :func:`quantize_block` leaves behind for a dense block. Raises
    :class:`QuantizationError` for a linear's shape that `mode` cannot handle, as quantizing it would.
    """
    _check_mode(mode)
    numel = math.prod(shape)
    if mode == "none" or len(shape) != 2 or name.rpartition(".")[2] != "weight":
        return numel * dtype.itemsize
    return _matrix_bytes(shape[0], shape[1], mode, name)


def _matrix_bytes(out_features: int, in_features: int, mode: str, name: str) -> int:
    """Bytes of one weight matrix quantized in `mode`: the packed integers and their bfloat16 scales (and zeros)."""
    problem = _shape_problem(out_features, in_features, mode)
    if problem is not None:
        raise QuantizationError(f"cannot quantize {name} ({out_features}x{in_features}) to {mode}: {problem}")
    if mode in GGML_MODES:
        from swarmnode.runtime.ggml.formats import GGMLType, row_bytes

        return out_features * row_bytes(GGMLType[GGML_MODES[mode]], in_features)
    scale_bytes = _KERNEL_DTYPE.itemsize
    if mode == "int8":
        return out_features * in_features + out_features * scale_bytes
    groups = in_features // INT4_GROUP_SIZE
    return out_features * in_features // 2 + groups * out_features * 2 * scale_bytes


def block_bytes(layer: torch.nn.Module, mode: str, dtype: torch.dtype,
                dtype_for: Callable[[str], torch.dtype] | None = None) -> int:
    """Bytes a decoder block takes once loaded in `dtype` and quantized in `mode`, from `layer` on the meta device
    (no memory): its linears' and experts' matrices at their quantized size, every other parameter and persistent
    buffer at ``numel * dtype size`` (floating ones cast to `dtype`, or to what `dtype_for(name)` says for a
    tensor the family keeps at another precision, as loading casts them). Equals what :func:`quantize_block`
    leaves behind."""
    _check_mode(mode)

    def size(name: str, tensor: torch.Tensor) -> int:
        if not tensor.is_floating_point():
            return tensor.numel() * tensor.dtype.itemsize
        return tensor.numel() * (dtype_for(name) if dtype_for is not None else dtype).itemsize

    total = 0
    quantized: set[int] = set()
    if mode != "none":
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                total += _matrix_bytes(module.out_features, module.in_features, mode, name)
                quantized.add(id(module.weight))
            for attr, weight in expert_weights(module).items():
                out_features, in_features = _expert_matrix_shape(module, weight.shape)
                total += weight.shape[0] * _matrix_bytes(out_features, in_features, mode, f"{name}.{attr}")
                quantized.add(id(weight))
    return total + sum(size(name, tensor) for name, tensor in stored_tensors(layer).items()
                       if id(tensor) not in quantized)


def stored_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of `module` by name: what a checkpoint stores of it (non-persistent
    buffers, such as rotary tables, are computed instead)."""
    found: dict[str, torch.Tensor] = dict(module.named_parameters())
    for module_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found[f"{module_name}.{name}" if module_name else name] = buffer
    return found


# --- experts ------------------------------------------------------------------------------------------------
#: The name :func:`quantized_experts_forward` is registered under in transformers' experts interface.
QUANTIZED_EXPERTS = "swarmnode_quantized"
# The fused experts parameters a transformers experts module may hold (`integrations.moe`).
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def expert_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fused 3-D expert weights of `module` by attribute name, when it is an experts module of transformers'
    experts interface (``@use_experts_implementation``); else empty."""
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        return {}
    found: dict[str, torch.Tensor] = {}
    for attr in _EXPERT_WEIGHTS:
        weight = module._parameters.get(attr)
        if weight is not None and weight.dim() == 3:
            found[attr] = weight
    return found


def _expert_matrix_shape(module: torch.nn.Module, shape) -> tuple[int, int]:
    """(out_features, in_features) of one expert's matrix of a fused parameter of `shape`."""
    _, first, second = shape
    return (second, first) if module.is_transposed else (first, second)


class QuantizedExperts(torch.nn.Module):
    """One fused experts projection (experts x out x in), quantized expert by expert in ``int8`` or ``int4``.

    Buffers: ``qweight`` (int8 ``[experts, out, in]``, or the int4 kernel's packed ``[experts, out, in / 2]``) and
    ``scales`` (``[experts, out]`` bfloat16, or ``[experts, in / group, out, 2]`` scales and zeros for int4): each
    expert's slice is what :class:`QuantizedLinear` would hold for a linear of that matrix.
    """

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, mode: str, qweight: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int):
        super().__init__()
        self.mode, self.out_features, self.in_features = mode, out_features, in_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, mode: str, *, transposed: bool) -> QuantizedExperts:
        """Quantize a fused experts weight (`transposed`: stored experts x in x out)."""
        experts = weight.shape[0]
        out_features, in_features = (weight.shape[2], weight.shape[1]) if transposed else weight.shape[1:]
        problem = _shape_problem(out_features, in_features, mode)
        if problem is not None:
            raise QuantizationError(f"cannot quantize a {out_features}x{in_features} expert matrix to {mode}: {problem}")
        packed: torch.Tensor | None = None
        scales: torch.Tensor | None = None
        for expert in range(experts):  # one expert's working copies at a time, written into the result
            matrix = weight[expert].t() if transposed else weight[expert]
            q, s = _quantize_int8(matrix) if mode == "int8" else _quantize_int4(matrix, INT4_GROUP_SIZE)
            if packed is None or scales is None:
                packed = torch.empty((experts, *q.shape), dtype=q.dtype)
                scales = torch.empty((experts, *s.shape), dtype=s.dtype)
            packed[expert], scales[expert] = q, s
        assert packed is not None and scales is not None, "a fused experts weight holds at least one expert"
        return cls(mode, packed, scales, out_features, in_features)

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W[expert].T`` for rows `x` (tokens x in), in `x`'s dtype."""
        return _packed_matmul(x, self.mode, self.qweight[expert], self.scales[expert], INT4_GROUP_SIZE)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"mode={self.mode}")


class _QuantizedExpertsConfig:
    """An experts module's view of its model config that names :data:`QUANTIZED_EXPERTS` as its experts
    implementation (the model's own config, shared with every other module, is left as it is)."""

    _experts_implementation = QUANTIZED_EXPERTS

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def quantize_experts(module: torch.nn.Module, mode: str, compute_dtype: torch.dtype) -> None:
    """Replace the fused expert weights of experts module `module` that are loaded (not on the meta device) by
    :class:`QuantizedExperts` and route its forward to :func:`quantized_experts_forward`; biases are kept in
    `compute_dtype`. Called again as more of the module's weights arrive, it quantizes those."""
    _register_experts_forward()
    for attr, weight in expert_weights(module).items():
        if weight.is_meta:
            continue
        quantized = QuantizedExperts.from_weight(weight.detach(), mode, transposed=bool(module.is_transposed))
        del module._parameters[attr]
        del weight  # the full-precision tensor goes now
        setattr(module, attr, quantized)
    for name, tensor in list(module._parameters.items()):
        if tensor is not None and not tensor.is_meta and tensor.is_floating_point() and tensor.dtype != compute_dtype:
            module._parameters[name] = torch.nn.Parameter(tensor.detach().to(compute_dtype), requires_grad=False)
    if not isinstance(module.config, _QuantizedExpertsConfig):
        # nn.Module.__setattr__ is typed for tensors and modules only; any value is allowed at runtime
        module.config = _QuantizedExpertsConfig(module.config)  # type: ignore[assignment]


def quantized_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward of transformers' experts interface (`integrations.moe`) for quantized experts: each
    expert a token was routed to runs its two products through the integer kernels, with the family's own gate
    (``self._apply_gate``), biases and post-expert norm; outputs are weighted and summed over the top-k as
    transformers' grouped forward sums them."""
    num_tokens, hidden_dim = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    token_of = torch.arange(num_tokens, device=hidden_states.device).repeat_interleave(top_k)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    out = hidden_states.new_zeros(num_tokens * top_k, hidden_dim)
    first = 0
    for expert, count in enumerate(counts[: self.num_experts]):
        if not count:
            continue
        rows = order[first:first + count]
        first += count
        h = up.matmul(expert, hidden_states[token_of[rows]])
        if up_bias is not None:
            h = h + up_bias[expert]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = self.down_proj.matmul(expert, h)
        if self.has_bias:
            y = y + self.down_proj_bias[expert]
        if self.has_post_expert_norm:
            y = self.post_expert_norm(y)
        out[rows] = y.to(out.dtype)
    weighted = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return weighted.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


_REGISTERED = False


def _register_experts_forward() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(QUANTIZED_EXPERTS, quantized_experts_forward)
        _REGISTERED = True
