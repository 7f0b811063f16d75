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
in bfloat16. Rows beyond one (prompts, batches of sessions) keep ``F.linear``, which batches them well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_IN_FEATURES", "DecodeLinear", "use_decode_linears"]

#: The widest input a linear may have to take the GEMV path (see the module docstring).
MAX_IN_FEATURES = 6080
#: Random rows a linear's GEMV product must match ``F.linear`` on, bit for bit, before it is used.
PROBES = 4
_DTYPES = (torch.bfloat16,)


class DecodeLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose product with a single row runs ``torch.addmv`` / ``torch.mv``; the same parameters,
    state dict and results (:func:`use_decode_linears` decides which linears become one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return _gemv(self, x)


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
        if linear.weight.device.type != "cpu" or linear.in_features > MAX_IN_FEATURES:
            continue
        if _same_bits(linear):
            linear.__class__ = DecodeLinear
            switched += 1
    return switched
