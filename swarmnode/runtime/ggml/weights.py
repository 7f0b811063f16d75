"""GGUF weights as modules: a linear layer and an embedding that hold a tensor in its ggml block format.

A GGUF tensor is kept exactly as the file stores it (`GGMLWeight`: its bytes, one row of ggml blocks per output
feature), and the modules that replace a layer's `nn.Linear` or `nn.Embedding` compute on it directly
(`runtime.ggml.kernels`), so a node holds its blocks at the file's size (Q4_K_M about 4.8 bits a weight) and no
dequantized copy of them.

How a product runs depends on its rows, as in `runtime.quantize`:

* up to :data:`~swarmnode.runtime.quantize.DENSE_ROWS` rows (decode steps, batched or not): ggml's own
  semantics (`kernels.matmul`): each activation row is quantized into the weight type's dot-product partner (Q8_0,
  Q8_1 or Q8_K) and multiplied in integers block by block, as llama.cpp's CPU backend does, so decoding reads
  the quantized weight once at memory speed. A row's result depends on that row alone (not on what else shares
  the batch);
* from :data:`DENSE_ROWS` rows (prompts): the weight is dequantized for the call only, into the dtype this CPU
  multiplies fastest (`dtypes.dense_compute_dtype`), and multiplied by oneDNN's GEMM; nothing dequantized is
  kept. Prompts so differ from ggml's arithmetic by the activations' quantization and, where the fast dtype is
  bfloat16, one bfloat16 rounding of the weights (`docs/architecture.md`, "GGUF weights").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarmnode.runtime.dtypes import dense_compute_dtype
from swarmnode.runtime.ggml import kernels
from swarmnode.runtime.ggml.formats import GGMLType, row_bytes
from swarmnode.runtime.quantize import DENSE_ROWS

__all__ = ["SHARED_INPUTS", "GGMLEmbedding", "GGMLLinear", "GGMLWeight", "SharedInput", "install", "quantize_weight",
           "share_inputs"]


@dataclass(frozen=True)
class GGMLWeight:
    """One 2-D GGUF tensor in its stored form: `data` is uint8 (rows, row bytes), `type` its ggml type, `shape`
    (rows, columns) in torch's order (the file lists it the other way round)."""

    data: torch.Tensor
    type: GGMLType
    shape: tuple[int, int]

    def __post_init__(self):
        rows, columns = self.shape
        expected = (rows, row_bytes(self.type, columns))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"a {self.type.name} weight of shape {self.shape} is uint8 {expected}, not "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return kernels.dequantize(self.data, self.type, self.shape[0], self.shape[1], dtype=dtype)


class GGMLLinear(torch.nn.Module):
    """`nn.Linear` over a GGUF weight (see the module docstring); `bias` as the replaced layer had it. Outputs come
    back in the input's dtype."""

    def __init__(self, weight: GGMLWeight, bias: torch.nn.Parameter | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ggml_type = weight.type
        self.qweight: torch.Tensor
        self.register_buffer("qweight", weight.data)
        self.bias = bias

    #: the linears this one shares its input with (`SharedInput`), and its place among them
    shared: SharedInput | None = None
    shared_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(self.in_features, 1)
        if rows == 1 and self.shared is not None:
            out = self.shared.product(self.shared_index, x)
        elif rows >= DENSE_ROWS:
            dense = kernels.dequantize(self.qweight, self.ggml_type, self.out_features, self.in_features,
                                       dtype=dense_compute_dtype())
            out = torch.nn.functional.linear(x.to(dense.dtype), dense)
            del dense
        else:
            out = kernels.matmul(x, self.qweight, self.ggml_type, self.out_features, self.in_features)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.ggml_type.name}"


#: Sibling linears that `transformers`' layers call one after another on the same input tensor: attention's
#: query, key and value projections, and a gated MLP's gate and up projections.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """GGUF linears of one block that take the same input, one after another (`SHARED_INPUTS`). For a single
    activation row (a decode step) the first of them to be called computes all their products in one call of
    the kernels (`kernels.matmul_group`: the row quantized once, one parallel region over all their weight
    rows), and the others take theirs when called with the same tensor; each product has the bits it has alone.
    What one thread computed is kept for that thread only, until every member has taken its product."""

    def __init__(self, members: list[GGMLLinear]):
        self.group = kernels.WeightGroup([(m.qweight, m.ggml_type, m.out_features) for m in members],
                                         members[0].in_features)
        self._local = threading.local()

    @property
    def weights(self) -> list[tuple[torch.Tensor, GGMLType, int]]:
        return self.group.weights

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self._local
        if getattr(state, "input", None) is not x:
            state.outputs = self.group.matmul(x)
            state.input, state.left = x, self.group.count
        out = state.outputs[index]
        if out is None:  # this member took its product of `x` already: each call gets a tensor of its own
            weight, type, n = self.weights[index]
            return kernels.matmul(x, weight, type, n, x.shape[-1])
        state.outputs[index] = None
        state.left -= 1
        if state.left <= 0:  # every member has its product: let go of the input
            state.input = state.outputs = None
        return out

    # a copy (a deep copy of the block, a pickle) starts with nothing computed
    def __getstate__(self) -> dict:
        return {"weights": self.weights, "k": self.group.k}

    def __setstate__(self, state: dict) -> None:
        self.group = kernels.WeightGroup(state["weights"], state["k"])  # pointers of the copy's own tensors
        self._local = threading.local()


def share_inputs(module: torch.nn.Module) -> int:
    """Join the GGUF linears inside `module` that take the same input (`SHARED_INPUTS`: all of a group's names
    present under one parent, all `GGMLLinear`, of one input width) into `SharedInput`s; returns how many groups."""
    groups = 0
    for parent in module.modules():
        for names in SHARED_INPUTS:
            members = [m for name in names if isinstance(m := getattr(parent, name, None), GGMLLinear)]
            if len(members) != len(names):
                continue
            if len({m.in_features for m in members}) != 1 or len(members) > kernels.MAX_GROUP:
                continue
            shared = SharedInput(members)
            for index, member in enumerate(members):
                member.shared, member.shared_index = shared, index
            groups += 1
    return groups


class GGMLEmbedding(torch.nn.Module):
    """`nn.Embedding` over a GGUF weight: the rows of the asked ids are dequantized, in `dtype`."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.ggml_type, self.dtype = weight.type, dtype
        self.qweight: torch.Tensor
        self.register_buffer("qweight", weight.data)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings}): got {int(flat.min())}.."
                             f"{int(flat.max())}")
        rows = kernels.dequantize(self.qweight[flat].contiguous(), self.ggml_type, flat.numel(), self.embedding_dim)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}"


def quantize_weight(weight: torch.Tensor, type: GGMLType, rows: int = 256) -> GGMLWeight:
    """`weight` (out x in, any float dtype) quantized into ggml's blocks of `type`, `rows` rows at a time, with the
    `gguf` package's quantizers: llama.cpp's own arithmetic (`quantize_row_*_ref`), so the bytes are those its
    `llama-quantize` writes for the same values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out_features, in_features = weight.shape
    data = torch.empty(out_features, row_bytes(type, in_features), dtype=torch.uint8)
    for start in range(0, out_features, rows):
        chunk = weight[start:start + rows].detach().to(torch.float32).numpy()
        blocks = np.ascontiguousarray(quantize(chunk, GGMLQuantizationType(int(type))))
        data[start:start + rows] = torch.from_numpy(blocks.view(np.uint8))  # F32/F16/BF16 come back as floats
    return GGMLWeight(data, type, (out_features, in_features))


def install(root: torch.nn.Module, module_name: str, weight: GGMLWeight, dtype: torch.dtype) -> torch.nn.Module:
    """Replace `root`'s `nn.Linear` or `nn.Embedding` named `module_name` by the GGUF module holding `weight`;
    returns the new module. A `ValueError` when the module is neither, or its shape is not the weight's."""
    old = root.get_submodule(module_name)
    if isinstance(old, torch.nn.Linear):
        expected = (old.out_features, old.in_features)
        new: torch.nn.Module = GGMLLinear(weight, old.bias)
    elif isinstance(old, torch.nn.Embedding):
        expected = (old.num_embeddings, old.embedding_dim)
        new = GGMLEmbedding(weight, dtype)
    else:
        raise ValueError(f"{module_name} is a {type(old).__name__}: a GGUF {weight.type.name} tensor can only be "
                         f"served in a linear layer or an embedding")
    if tuple(weight.shape) != expected:
        raise ValueError(f"{module_name} has shape {weight.shape} in the GGUF file, the model's config makes it "
                         f"{expected}: the file does not match its own metadata")
    parent_name, _, child = module_name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
    return new


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of the GGUF tensors `module` holds (its `GGMLLinear` and `GGMLEmbedding` submodules)."""
    return sum(int(m.qweight.numel()) for m in module.modules() if isinstance(m, (GGMLLinear, GGMLEmbedding)))
