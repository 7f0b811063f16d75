"""Single-token products of a 16-bit node's linears through PyTorch's matrix-vector kernel, bit for bit.

Decoding one token multiplies every weight matrix of a block by one row of activations, so its speed is the
speed of reading the weights. For a bfloat16 row, ``F.linear`` (which ``nn.Linear`` calls) goes through
PyTorch's GEMM path and reads weights at about 60% of the memory bandwidth, while ``torch.mv`` / ``torch.addmv``
(the GEMV path, ``ReducedPrecisionFloatGemvFastPathKernel``) reads them at the bandwidth: measured on a 2-core
Xeon (AVX-512, AMX) with 2 threads over 16 distinct 5632x2048 bfloat16 matrices (so that no cache holds them),
15.6 GB/s against 26.0 GB/s, where summing a 1 GiB tensor reads 26.1 GB/s.

Both paths accumulate in float32 in the same order for rows of up to 6,080 columns on that machine, so their
bfloat16 results are the same bits (checked over 40 random rows of every Llama, SmolLM2 and gpt-oss matrix
shape; from 6,144 columns about 3 in 10,000 outputs round differently). A node therefore switches a linear to
the GEMV path only when its product with probe rows is bit-identical to ``F.linear``'s on this machine and
thread count (:func:`use_decode_linears`), so a bfloat16 node's output stays equal to local ``transformers``
in bfloat16. Rows beyond one (prompts, batches of sessions) keep ``F.linear``, which batches them well, except
prompts on a CPU without native bfloat16, which run in float32 (:func:`prompt_in_float32`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarmnode.runtime.dtypes import dense_compute_dtype

__all__ = ["MAX_IN_FEATURES", "PROMPT_ROWS", "DecodeLinear", "prompt_in_float32", "use_decode_linears"]

#: The widest input a linear may have to take the GEMV path (see the module docstring).
MAX_IN_FEATURES = 6080
#: Rows from which a product is a prompt's: float32 on CPUs without native bfloat16 (`prompt_in_float32`). The same
#: threshold as quantized products' dense path (`runtime.quantize.DENSE_ROWS`), above the scheduler's largest decode
#: batch, so decode steps never depend on how many sessions share a batch.
PROMPT_ROWS = 96
#: Random rows a linear's GEMV product must match ``F.linear`` on, bit for bit, before it is used.
PROBES = 4
_DTYPES = (torch.bfloat16,)


class DecodeLinear(torch.nn.Linear):
    """A bfloat16 CPU ``nn.Linear`` whose product with a single row runs ``torch.addmv`` / ``torch.mv`` where that
    gives ``F.linear``'s bits (`gemv`), and whose prompts run in float32 on a CPU without native bfloat16
    (:func:`prompt_in_float32`); the same parameters and state dict (:func:`use_decode_linears` makes them)."""

    gemv = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if x.numel() == self.in_features and self.gemv:
            return _gemv(self, x)
        if x.numel() >= PROMPT_ROWS * self.in_features and prompt_in_float32():
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def prompt_in_float32() -> bool:
    """Whether a bfloat16 node's prompt products run in float32: on CPUs without native bfloat16
    (`dtypes.native_bfloat16`), where a bfloat16 GEMM runs 3-6x slower than converting the weight for the call and
    multiplying in float32. What it costs in exactness: the products accumulate in float32 either way and are
    rounded to bfloat16 once, so they differ from ``F.linear``'s only by summation order (a bfloat16 rounding step
    in a few outputs), and a bfloat16 route on such a CPU equals local `transformers` in bfloat16 in its decode
    steps, not always bit for bit in its prompts."""
    return dense_compute_dtype() == torch.float32


def _gemv(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear` applied to the single row `x` through the GEMV kernel."""
    row = x.reshape(linear.in_features)
    out = torch.mv(linear.weight, row) if linear.bias is None else torch.addmv(linear.bias, linear.weight, row)
    return out.view(*x.shape[:-1], linear.out_features)


#: (out, in, bias, dtype, threads) -> whether the GEMV product gives `F.linear`'s bits: the summation order
#: depends on the shape and the thread count, not on the weights, so each is probed once per process.
_VERDICTS: dict[tuple[int, int, bool, torch.dtype, int], bool] = {}


def _same_bits(linear: torch.nn.Linear) -> bool:
    key = (linear.out_features, linear.in_features, linear.bias is not None, linear.weight.dtype,
           torch.get_num_threads())
    if key not in _VERDICTS:
        generator = torch.Generator().manual_seed(0)
        rows = [(torch.randn(1, 1, linear.in_features, generator=generator) * (0.5 + probe)).to(linear.weight.dtype)
                for probe in range(PROBES)]
        _VERDICTS[key] = all(torch.equal(_gemv(linear, row), F.linear(row, linear.weight, linear.bias))
                             for row in rows)
    return _VERDICTS[key]


@torch.inference_mode()
def use_decode_linears(module: torch.nn.Module) -> int:
    """Turn every plain bfloat16 CPU ``nn.Linear`` inside `module` whose GEMV product equals ``F.linear``'s bit
    for bit into a :class:`DecodeLinear`; returns how many were. Products are compared on :data:`PROBES`
    random rows, once per shape and thread count in a process."""
    switched = 0
    for linear in module.modules():
        if type(linear) is not torch.nn.Linear or linear.weight.dtype not in _DTYPES:
            continue
        if linear.weight.device.type != "cpu":
            continue
        same = linear.in_features <= MAX_IN_FEATURES and _same_bits(linear)
        if same or prompt_in_float32():
            linear.__class__ = DecodeLinear
            if not same:
                linear.gemv = False  # type: ignore[assignment]  # this one's single rows keep `F.linear`
            switched += same
    return switched
