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
"""

from __future__ import annotations

import math

import torch

from swarmnode.errors import SwarmError
from swarmnode.records import QUANTIZATION_NAMES

__all__ = [
    "INT4_GROUP_SIZE",
    "QUANTIZATIONS",
    "QuantizationError",
    "QuantizedLinear",
    "check_supported",
    "linear_shapes",
    "quantize_linears",
    "quantized_tensor_bytes",
]

QUANTIZATIONS = QUANTIZATION_NAMES  # the names records and the CLI carry (`records.QUANTIZATION_NAMES`)
# Input columns sharing one int4 scale and zero (see the module docstring for why 32).
INT4_GROUP_SIZE = 32
# The dtype the CPU kernels are vectorized for: activations, scales and zeros are passed in it.
_KERNEL_DTYPE = torch.bfloat16
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What to suggest when a mode cannot handle a model.
_FALLBACK = {"int4": "int8 or none", "int8": "none"}
# Rows quantized at a time, so that the float32 working copies stay small for large linears.
_ROW_CHUNK = 256


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
    if mode == "int8" and in_features % 16:
        return f"its in_features {in_features} is not a multiple of 16, which the int8 kernel needs"
    if mode == "int4":
        if out_features % 16:
            return f"its out_features {out_features} is not a multiple of 16, which the int4 kernel needs"
        if in_features % group_size:
            return f"its in_features {in_features} is not a multiple of the int4 group size {group_size}"
    return None


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """The ``(out_features, in_features)`` of a decoder block's attention and dense-MLP linears, by name
    relative to the block, derived from a `transformers` config (its text config for multimodal ones)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
    }
    intermediate = getattr(text, "intermediate_size", None)
    if intermediate:
        shapes["mlp.gate_proj"] = (intermediate, hidden)
        shapes["mlp.up_proj"] = (intermediate, hidden)
        shapes["mlp.down_proj"] = (hidden, intermediate)
    return shapes


def check_supported(config, mode: str, *, device: str | torch.device = "cpu") -> None:
    """Raise :class:`QuantizationError` when blocks of the model described by `config` cannot be quantized
    in `mode` on `device`: so a node fails at start, before it loads anything.

    Checks the attention and dense-MLP shapes the config names; :func:`quantize_linears` checks every
    linear it meets again (a model with other linears fails there, at its first block, before changing it).
    """
    _check_mode(mode)
    if mode == "none":
        return
    if torch.device(device).type != "cpu":
        raise QuantizationError(
            f"quantization {mode!r} runs on CPU only, not on {device}; serve on cpu or use quantization none"
        )
    for name, (out_features, in_features) in linear_shapes(config).items():
        problem = _shape_problem(out_features, in_features, mode)
        if problem is not None:
            raise QuantizationError(
                f"this model cannot be quantized to {mode}: {name} ({out_features}x{in_features}) {problem}; "
                f"use quantization {_FALLBACK[mode]}"
            )


class QuantizedLinear(torch.nn.Module):
    """A drop-in for ``torch.nn.Linear`` holding its weight quantized (``int8`` or ``int4``).

    Buffers: ``qweight`` (int8 ``[out, in]``, or the int4 kernel's packed uint8 ``[out, in / 2]``),
    ``scales`` (bfloat16: ``[out]`` for int8, ``[in / group, out, 2]`` scales and zeros for int4) and
    ``bias`` (the compute dtype) or None. ``forward`` takes and returns the input's dtype.
    """

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
        a = x.reshape(-1, self.in_features)
        if a.dtype != _KERNEL_DTYPE:
            a = a.to(_KERNEL_DTYPE)
        if not a.is_contiguous() or a.data_ptr() % 64:  # the int8 kernel loads rows with aligned loads
            a = a.clone(memory_format=torch.contiguous_format)
        if self.mode == "int8":
            y = torch._weight_int8pack_mm(a, self.qweight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(a, self.qweight, self.group_size, self.scales)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{group}, "
                f"bias={self.bias is not None}")


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


def quantize_linears(module: torch.nn.Module, mode: str, compute_dtype: torch.dtype) -> None:
    """Replace every ``torch.nn.Linear`` inside `module` (a decoder block) in place by a
    :class:`QuantizedLinear` of `mode`, whose forward takes and returns `compute_dtype` tensors shaped as
    the original's; biases are kept (in `compute_dtype`).

    Every linear's shape is checked before anything changes, so a :class:`QuantizationError` leaves
    `module` as it was. The full-precision weights are released as each linear is replaced: once the
    caller drops its own references to the loaded tensors (a state dict, say), they are freed, so a node
    quantizing each block right after loading it never holds more than one block in full precision.
    """
    _check_mode(mode)
    if compute_dtype not in _COMPUTE_DTYPES:
        raise QuantizationError(
            f"compute dtype {compute_dtype} is not supported by quantized linears; use float32 or bfloat16"
        )
    if mode == "none":
        return
    if isinstance(module, torch.nn.Linear):
        raise QuantizationError("quantize_linears replaces the linears inside a module: pass the block holding it")
    linears = [(name, child) for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)]
    for name, linear in linears:
        if linear.weight.device.type != "cpu":
            raise QuantizationError(
                f"{name} is on {linear.weight.device}; quantization {mode!r} runs on CPU only: load the "
                f"blocks on cpu or use quantization none"
            )
        problem = _shape_problem(linear.out_features, linear.in_features, mode)
        if problem is not None:
            raise QuantizationError(
                f"cannot quantize {name} ({linear.out_features}x{linear.in_features}) to {mode}: {problem}; "
                f"use quantization {_FALLBACK[mode]}"
            )
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, QuantizedLinear.from_linear(linear, mode, compute_dtype))
        # drop the full-precision tensors now, not when the last name for the old module goes away
        linear.weight = None
        linear.bias = None


def quantized_tensor_bytes(name: str, shape: tuple[int, ...], mode: str, dtype: torch.dtype) -> int:
    """Bytes a block's tensor takes once loaded in `dtype` and quantized in `mode`, without loading it.

    `name` is relative to the block (``self_attn.q_proj.weight``, ``input_layernorm.weight``). Two-dimensional
    ``weight`` tensors are linears' weights and take their quantized size (packed weight plus bfloat16
    scales, and zeros for int4); every other tensor, biases included, takes ``numel * dtype size``.
    Equals the bytes of the tensors :func:`quantize_linears` leaves behind. Raises
    :class:`QuantizationError` for a linear's shape that `mode` cannot handle, as quantizing it would.
    """
    _check_mode(mode)
    numel = math.prod(shape)
    if mode == "none" or len(shape) != 2 or name.rpartition(".")[2] != "weight":
        return numel * dtype.itemsize
    out_features, in_features = shape
    problem = _shape_problem(out_features, in_features, mode)
    if problem is not None:
        raise QuantizationError(f"cannot quantize {name} ({out_features}x{in_features}) to {mode}: {problem}")
    scale_bytes = _KERNEL_DTYPE.itemsize
    if mode == "int8":
        return numel + out_features * scale_bytes
    groups = in_features // INT4_GROUP_SIZE
    return numel // 2 + groups * out_features * 2 * scale_bytes
