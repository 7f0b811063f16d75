"""A Llama block's decode step in the C kernels: one new token a row through the whole block in two calls.

A decode step through `transformers`' `LlamaDecoderLayer` runs some sixty framework ops between the block's
matmuls, and after each matmul has streamed megabytes of weights through the caches every one of them starts cold:
on a 2-core CPU they took a quarter of a 1B model's step (`docs/architecture.md`, "The CPU runtime"). For a block
whose linears are all ggml matrices (`weights.GGMLLinear`: a GGUF file's, or `--quantize q8_0/q4_0/q4_1/bf16`'s),
:func:`attach` gives the layer a decode step done in C (`kernels.c`, "decode step of a Llama block"):

1. ``sn_llama_attn_in``: RMSNorm, the query/key/value projections (one grouped matmul for a single row), rotary;
2. the cache's own ``update`` with the new keys and values, called as the layer's attention calls it;
3. ``sn_llama_attn_out``: attention over the cached keys and values, the output projection, the residual,
   RMSNorm, gate/up, SiLU, down and the residual.

It takes 1 to `DENSE_ROWS` - 1 rows of one new token each (a session's step, or a batch of sessions') with no mask
or a boolean (SDPA) one; a row attends only the keys its mask shows it, in order, so it decodes as it would alone.
Everything else (prompts, additive masks that mask something, other dtypes, training mode) takes the layer's own
forward, unchanged.

Arithmetic: the matmuls are the kernels' (`kernels.matmul`'s bits); the rotary embedding and the residual adds are
`transformers`' float operations exactly; RMSNorm's sum of squares, the softmax and SiLU are float32 like torch's
but summed in another order (`kernels.c` gives it), so they differ from the layer's own forward by float32
rounding. Nodes (`runtime.blocks`), the local GGUF reference (`local_model.load_gguf_model`) and `quantize_block`
attach the same step, so a swarm and its local reference still compute the same bits.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from swarmnode.runtime.ggml import kernels
from swarmnode.runtime.ggml.weights import GGMLLinear
from swarmnode.runtime.quantize import DENSE_ROWS

__all__ = ["LlamaDecodeStep", "attach", "why_not"]

logger = logging.getLogger(__name__)

#: attention implementations whose math the step reproduces (softmax of scaled dot products, no extras)
_ATTENTION = ("sdpa", "eager")


def _llama_classes():
    from transformers.models.llama import modeling_llama as llama

    return llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm


def why_not(layer: Any) -> str | None:
    """Why `layer` cannot take the C decode step, or None when it can: it must be `transformers`' Llama decoder
    layer (its attention, MLP and RMSNorm classes) with SiLU, every linear a bias-free `GGMLLinear`, float32
    norms, an attention implementation in :data:`_ATTENTION`, consistent shapes, and the C kernels built."""
    layer_cls, attention_cls, mlp_cls, norm_cls = _llama_classes()
    if type(layer) is not layer_cls:
        return f"{type(layer).__name__} is not LlamaDecoderLayer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not attention_cls or type(mlp) is not mlp_cls:
        return "its attention or MLP is not Llama's"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not norm_cls for n in norms):
        return "its norms are not LlamaRMSNorm"
    config = attn.config
    if getattr(config, "_attn_implementation", None) not in _ATTENTION:
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(isinstance(m, GGMLLinear) and m.bias is None for m in linears):
        return "not every linear is a bias-free GGUF matrix"
    if not all(m.qweight.is_contiguous() and m.qweight.device.type == "cpu" for m in linears):
        return "its matrices are not contiguous CPU tensors"
    hidden, d = layer.hidden_size, attn.head_dim
    if any(n.weight.dtype != torch.float32 or tuple(n.weight.shape) != (hidden,) for n in norms):
        return "its norms are not float32 vectors of the hidden size"
    if any(n.weight.device.type != "cpu" for n in norms):
        return "it is not on the CPU"
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    if d <= 0 or d % 2 or q.out_features % d or k.out_features % d or k.out_features != v.out_features:
        return f"head size {d} does not divide its projections"
    nq, nkv = q.out_features // d, k.out_features // d
    if nkv == 0 or nq % nkv:
        return f"{nq} query heads do not share {nkv} key/value heads evenly"
    if {q.in_features, k.in_features, v.in_features, mlp.gate_proj.in_features, mlp.up_proj.in_features,
            o.out_features, mlp.down_proj.out_features} != {hidden} or o.in_features != nq * d:
        return "its projections do not match the hidden size"
    if mlp.gate_proj.out_features != mlp.up_proj.out_features or mlp.down_proj.in_features != mlp.up_proj.out_features:
        return "its MLP's widths do not match"
    if kernels.decode_step_kernels() is None:
        return "the C kernels are not built (no compiler)"
    return None


class LlamaDecodeStep:
    """The C decode step of one Llama decoder layer (see the module docstring): its tensors laid out for the
    kernels once. :meth:`run` takes one token, or returns None for anything it does not do (the caller then runs
    the layer's own forward; nothing has been changed)."""

    def __init__(self, layer: Any):
        reason = why_not(layer)
        if reason is not None:
            raise ValueError(f"this layer cannot take the C decode step: {reason}")
        attn, mlp = layer.self_attn, layer.mlp
        linears = {name: getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        linears.update({name: getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")})
        self.tensors = {"norm_in": layer.input_layernorm.weight, "norm_post": layer.post_attention_layernorm.weight,
                        **{name: linear.qweight for name, linear in linears.items()}}
        self.types = {name: int(linear.ggml_type) for name, linear in linears.items()}
        self.layer_idx = attn.layer_idx
        self.hidden, self.head_dim = layer.hidden_size, attn.head_dim
        self.heads, self.kv_heads = attn.q_proj.out_features // self.head_dim, attn.k_proj.out_features // self.head_dim
        self.inter = mlp.up_proj.out_features
        self.scale = float(attn.scaling)
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)
        self._lay_out()

    def _lay_out(self) -> None:
        t, ptr = self.types, {name: tensor.data_ptr() for name, tensor in self.tensors.items()}
        qkv, mlp = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
        self._qkv_types = (ctypes.c_int * 3)(*(t[n] for n in qkv))
        self._qkv_ptrs = (ctypes.c_void_p * 3)(*(ptr[n] for n in qkv))
        d = self.head_dim
        self._qkv_rows = (ctypes.c_int64 * 3)(self.heads * d, self.kv_heads * d, self.kv_heads * d)
        self._mlp_types = (ctypes.c_int * 2)(*(t[n] for n in mlp))
        self._mlp_ptrs = (ctypes.c_void_p * 2)(*(ptr[n] for n in mlp))
        self._ptr = ptr

    # a copy (a deep copy of the layer, a pickle) lays out its own tensors
    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if not key.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lay_out()

    def run(self, hidden: torch.Tensor, attention_mask, cache, position_embeddings, update_kwargs: dict
            ) -> torch.Tensor | None:
        """The layer's output for one new token a row (`hidden` (rows, 1, H) float32, fewer than `DENSE_ROWS` rows:
        one session's, or a batch of sessions'), their keys and values added to `cache`; None (and nothing done)
        for anything else: a prompt, no cache, a mask other than a boolean one (or an additive one that masks
        nothing). A row attends the keys its mask shows it, in order, whatever the other rows are."""
        functions = kernels.decode_step_kernels()
        rows = hidden.shape[0] if hidden.dim() == 3 else 0
        if (functions is None or cache is None or position_embeddings is None or hidden.dtype != torch.float32
                or not 0 < rows < DENSE_ROWS or hidden.shape[1:] != (1, self.hidden) or hidden.device.type != "cpu"):
            return None
        takes, seen = _keys_seen(attention_mask, rows)
        if not takes:
            return None
        cos, sin = (_per_row(t, rows, self.head_dim) for t in position_embeddings)
        if cos is None or sin is None:
            return None
        attn_in, attn_out = functions
        d = self.head_dim
        x = hidden.contiguous()
        if any(tensor.data_ptr() != self._ptr[name] for name, tensor in self.tensors.items()):
            if any(t.dtype != torch.float32 for t in (self.tensors["norm_in"], self.tensors["norm_post"])):
                return None  # the layer was cast since: its own forward
            self._lay_out()  # its tensors were moved (same values, new storage)
        q = torch.empty(rows, self.heads * d, dtype=torch.float32)
        k = torch.empty(rows, self.kv_heads * d, dtype=torch.float32)
        v = torch.empty(rows, self.kv_heads * d, dtype=torch.float32)
        if attn_in(rows, x.data_ptr(), self._ptr["norm_in"], self.eps_in, self.hidden, self._qkv_types,
                   self._qkv_ptrs, self._qkv_rows, cos.data_ptr(), sin.data_ptr(), d, q.data_ptr(), k.data_ptr(),
                   v.data_ptr()):
            raise MemoryError("out of memory for a decode step's activations")
        keys, values = cache.update(k.view(rows, self.kv_heads, 1, d), v.view(rows, self.kv_heads, 1, d),
                                    self.layer_idx, kwargs=update_kwargs)
        keys, values = _rows_of(keys, d), _rows_of(values, d)
        length = keys.shape[2]
        if keys.shape != (rows, self.kv_heads, length, d) or values.shape != keys.shape:
            raise RuntimeError(f"the cache gave keys {tuple(keys.shape)} and values {tuple(values.shape)} for "
                               f"{rows} rows of {self.kv_heads} heads of {d}")
        mask = None
        if seen is not None:
            if seen.shape[-1] < length:
                raise RuntimeError(f"the attention mask covers {seen.shape[-1]} positions, the cache {length}")
            mask = seen[:, :length].to(torch.uint8).contiguous()
        out = torch.empty_like(x)
        t = self.types
        if attn_out(rows, x.data_ptr(), q.data_ptr(), keys.data_ptr(), values.data_ptr(), length, keys.stride(0),
                    keys.stride(1), values.stride(0), values.stride(1), None if mask is None else mask.data_ptr(),
                    self.heads, self.kv_heads, d, self.scale, t["o_proj"], self._ptr["o_proj"],
                    self._ptr["norm_post"], self.eps_post, self._mlp_types, self._mlp_ptrs, self.inter,
                    t["down_proj"], self._ptr["down_proj"], self.hidden, out.data_ptr()):
            raise MemoryError("out of memory for a decode step's activations")
        return out


def _keys_seen(mask: torch.Tensor | None, rows: int) -> tuple[bool, torch.Tensor | None]:
    """Whether the step takes a one-query attention `mask`, and which keys each row may see: None (all of them) or
    a (rows, length) boolean tensor. It takes None, a boolean (SDPA) mask of shape (rows or 1, 1, 1, length), and
    an additive mask that masks nothing."""
    if mask is None:
        return True, None
    if mask.dtype != torch.bool:
        return bool((mask == 0).all()), None
    if mask.dim() != 4 or mask.shape[0] not in (1, rows) or mask.shape[1] != 1 or mask.shape[2] != 1:
        return False, None
    if bool(mask.all()):
        return True, None
    return True, mask[:, 0, 0, :].expand(rows, -1)


def _per_row(table: torch.Tensor, rows: int, d: int) -> torch.Tensor | None:
    """A rotary cos or sin table as (rows, d) contiguous float32: one row each, or one for all; None otherwise."""
    if table.dtype != torch.float32 or table.numel() not in (d, rows * d) or table.shape[-1] != d:
        return None
    return table.reshape(-1, d).expand(rows, d).contiguous()


def _rows_of(states: torch.Tensor, d: int) -> torch.Tensor:
    """`states` (rows, heads, length, d) float32 with each head's rows of d floats contiguous (a view when they
    are)."""
    if states.dtype != torch.float32:
        states = states.float()
    if states.stride(-1) != 1 or states.stride(-2) != d:
        states = states.contiguous()
    return states


class _DecodeForward:
    """`forward` of a layer with a C decode step: one token its step takes goes through it, everything else
    through the layer's class's own forward."""

    def __init__(self, layer: Any, step: LlamaDecodeStep):
        self.layer, self.step = layer, step

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        layer = self.layer
        if not args and not layer.training:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            update_kwargs = {key: value for key, value in kwargs.items()
                             if key not in ("attention_mask", "cache", "past_key_values", "position_embeddings")}
            out = self.step.run(hidden_states, kwargs.get("attention_mask"), cache,
                                kwargs.get("position_embeddings"), update_kwargs)
            if out is not None:
                return out
        return type(layer).forward(layer, hidden_states, *args, **kwargs)


def attach(layer: Any) -> bool:
    """Give `layer` the C decode step when it can take one (:func:`why_not`); returns whether it did. Its own
    forward still runs everything the step does not take."""
    own = layer.__dict__.get("forward")
    if isinstance(own, _DecodeForward):
        return True
    reason = "its forward is replaced already (a hook)" if own is not None else why_not(layer)
    if reason is not None:
        logger.debug("block keeps its own decode step: %s", reason)
        return False
    layer.forward = _DecodeForward(layer, LlamaDecodeStep(layer))
    return True
