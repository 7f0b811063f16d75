"""A decoder-only model family as `transformers` defines it: what a node and a client need to know to run it.

Everything here is read from the library's own classes, never written per family in this project: a weightless
(meta-device) skeleton of the model gives the decoder-layer class, the rotary-embedding class and the attention
implementation `transformers` itself picks for the config (SDPA where the family supports it, eager where it
refuses SDPA, as gpt-oss and Gemma 2 do); `transformers.cache_utils.get_layer_types_and_kwargs` gives each layer's
kind of cache (full or sliding-window attention, or recurrent state); and one step of each layer on the meta
device, through a cache that records what the layer writes, gives the shape of what the layer keeps per token.
That last probe is what lets latent attention in: DeepSeek V2/V3 and Kimi K2 keep one compressed latent
(`kv_lora_rank` wide) and one shared rotary key per token instead of keys and values per head, and the node's
cache, its memory plan and the handover of caches follow the shapes the layer really writes.

Families whose layers keep recurrent state (linear attention, Mamba: Qwen3-Next, MiniMax, Jamba, Falcon-H1) are
refused when the family is read, with one line naming the family and why: their state is not a sequence of
per-token entries, so a session's cache could not be cut, handed over or replayed as the swarm does with KV
caches.
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from swarmnode.runtime.checkpoint import CheckpointError
from swarmnode.runtime.quantize import stored_tensors

if TYPE_CHECKING:
    from swarmnode.runtime.conversion import Conversion

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "FamilyError",
    "LayerCache",
    "MaskStyle",
    "ModelFamily",
    "one_line",
]

#: The kinds of layer cache (`get_layer_types_and_kwargs`) a node serves: attention over every earlier token, or
#: over the last `sliding_window` tokens. Anything else keeps state that is not a list of per-token entries.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Why each other kind of layer cache cannot be served, for the refusal's one line.
_RECURRENT = ("which a session could not cut, hand over or replay across nodes as it does a per-token KV cache")
_NOT_SERVED = {
    "linear_attention": f"keeps recurrent state (linear attention or Mamba) instead of a per-token KV cache, {_RECURRENT}",
    "conv": f"keeps convolution state instead of a per-token KV cache, {_RECURRENT}",
    "hybrid": f"keeps Mamba state beside its attention cache, {_RECURRENT}",
    "hybrid_sliding": f"keeps Mamba state beside its attention cache, {_RECURRENT}",
    "chunked_attention": "uses chunked attention, whose cache is not served yet",
    "dummy": "reads another layer's cache instead of keeping its own, which is not served yet",
}


class FamilyError(CheckpointError):
    """A model family (or one of its configs) that this project cannot serve; the message names the family and
    says why, in one line."""

    code = "unsupported_family"


class MaskStyle(enum.Enum):
    """The form of attention mask a family's attention implementation takes (`transformers.masking_utils`)."""

    #: SDPA: True where a query may attend a key; None when nothing needs masking (SDPA's own causal mask).
    BOOLEAN = "boolean"
    #: eager: 0 where a query may attend a key, the dtype's minimum elsewhere; always given.
    ADDITIVE = "additive"


@dataclass(frozen=True)
class LayerCache:
    """What one layer writes to its cache per token: `keys` and `values` of shape (heads, dim) each. For most
    families these are keys and values per KV head; for latent attention, a compressed latent and a shared
    rotary key (one "head" each, of different widths)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.elements_per_token * dtype.itemsize


class _Probed(Exception):
    """Raised by `_ProbeCache.update` to stop a layer's meta-device step once its cache write is seen."""


class _ProbeCache:
    """A cache that records the first `update` a layer makes and stops the step there (`_Probed`)."""

    is_compileable = False

    def __init__(self) -> None:
        self.written: tuple[torch.Size, torch.Size] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.written = (key_states.shape, value_states.shape)
        raise _Probed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _to_meta(value):
    """`value` (a tensor, a tuple of them, or None) on the meta device."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple):
        return tuple(_to_meta(v) for v in value)
    return value


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line (its type and the first line of its message) for a refusal."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _family_name(config) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


class ModelFamily:
    """The family of `config`, read from `transformers`: build it once per config and share it.

    Raises :class:`FamilyError` (one line) for a model that is not a decoder-only causal LM keeping its blocks in
    `model.layers`, or whose layers keep recurrent state. Building it sets the config's attention implementation
    (and experts implementation) to the ones `transformers` picks, as `from_pretrained` would.
    """

    def __init__(self, config) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.cache_utils import get_layer_types_and_kwargs

        self.config = config
        self.name = _family_name(config)
        self.num_layers = int(config.num_hidden_layers)
        quantized = getattr(config, "quantization_config", None)
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
            raise FamilyError(f"{self.name} cannot be served from this checkpoint: its weights are stored pre-quantized "
                              f"({method}); serve a bfloat16 or float32 copy of the model (nodes quantize it "
                              f"themselves with --quantize int8|int4)")
        layer_types, _ = get_layer_types_and_kwargs(config)
        kept = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
        if kept:
            index = next(i for i, t in enumerate(layer_types) if t == kept[0])
            why = _NOT_SERVED.get(kept[0], f"keeps a cache of kind {kept[0]!r}, which is not served")
            raise FamilyError(f"{self.name} cannot be served: its layer {index} {why} (the families served are "
                              f"listed in docs/architecture.md)")
        self.layer_types: tuple[str, ...] = tuple(layer_types)
        try:
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
        except ValueError as exc:  # not a causal LM transformers knows
            raise FamilyError(f"{self.name} cannot be served: transformers has no causal LM for it "
                              f"({one_line(exc)})") from None
        base = getattr(skeleton, getattr(skeleton, "base_model_prefix", "model"), None)
        layers = getattr(base, "layers", None)
        if base is None or not isinstance(layers, torch.nn.ModuleList) or len(layers) != self.num_layers:
            raise FamilyError(f"{self.name} cannot be served: {type(skeleton).__name__} does not keep its "
                              f"{self.num_layers} blocks in model.layers")
        self.skeleton = skeleton
        self.base = base
        self.base_prefix: str = skeleton.base_model_prefix
        self.attn_implementation: str = config._attn_implementation
        if self.attn_implementation not in ("sdpa", "eager"):  # a GPU-only kernel: take what runs everywhere
            self.attn_implementation = "sdpa" if skeleton._supports_sdpa else "eager"
            config._attn_implementation = self.attn_implementation
        self.mask_style = MaskStyle.BOOLEAN if self.attn_implementation == "sdpa" else MaskStyle.ADDITIVE
        rotary = getattr(base, "rotary_emb", None)
        self._rotary_class = type(rotary) if rotary is not None else None
        self.rotary_takes_layer_type = rotary is not None and "layer_type" in inspect.signature(
            rotary.forward).parameters
        layer_forward = inspect.signature(type(layers[0]).forward).parameters
        self.cache_keyword = "cache" if "cache" in layer_forward else "past_key_values"

    def __repr__(self) -> str:
        return f"ModelFamily({self.name}, {self.num_layers} layers, {self.attn_implementation})"

    @cached_property
    def conversion(self) -> Conversion:
        """`from_pretrained`'s conversion of this family's checkpoint tensors (`runtime.conversion`)."""
        from swarmnode.runtime.conversion import Conversion

        return Conversion(self.skeleton)

    def block_prefix(self, index: int) -> str:
        """The model's own name prefix of block `index`'s tensors (`model.layers.{index}.`)."""
        return f"{self.base_prefix}.layers.{index}."

    def tensor_dtype(self, index: int, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype tensor `name` of block `index` takes in a model served in `dtype` (float32 for what the family
        keeps in float32, see `Conversion.dtype_for`)."""
        return self.conversion.dtype_for(self.block_prefix(index) + name, dtype)

    # --- layers --------------------------------------------------------------------------------------
    def layer_class(self, index: int) -> type[torch.nn.Module]:
        return type(self.base.layers[index])

    def new_layer(self, index: int) -> torch.nn.Module:
        """Decoder layer `index` on the meta device (no memory), built as the model builds it."""
        with torch.device("meta"):
            return self.layer_class(index)(self.config, layer_idx=index)

    def initialise_buffers(self, module: torch.nn.Module, device: torch.device) -> None:
        """Give the buffers of `module` that no checkpoint holds (non-persistent ones: rotary tables, embedding
        scales) the values `transformers`' own `_init_weights` gives them when it loads a model; what was loaded
        is left as it is."""
        from transformers import initialization

        missing = [m for m in module.modules()
                   if any(b is not None and b.is_meta and name in m._non_persistent_buffers_set
                          for name, b in m.named_buffers(recurse=False))]
        if not missing:
            return
        for tensor in (*module.parameters(), *module.buffers()):
            if not tensor.is_meta:
                # transformers' own marker, set on tensors at runtime (`_init_weights` skips them)
                tensor._is_hf_initialized = True  # type: ignore[attr-defined]
        for owner in missing:
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None and buffer.is_meta and name in owner._non_persistent_buffers_set:
                    owner._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad(), initialization.guard_torch_init_functions():
            for owner in missing:
                self.skeleton._init_weights(owner)

    def sliding_window(self, index: int) -> int | None:
        """The window of layer `index`, in tokens, or None for attention over every earlier token."""
        if self.layer_types[index] != "sliding_attention":
            return None
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None

    # --- rotary embeddings ---------------------------------------------------------------------------
    def new_rotary(self, device: str | torch.device = "cpu") -> torch.nn.Module | None:
        """The model's rotary embedding (no weights: its frequencies come from the config), or None for a
        family whose layers take no position embeddings from the model."""
        if self._rotary_class is None:
            return None
        return self._rotary_class(config=self.config).to(device)

    def position_embeddings(self, rotary, hidden: torch.Tensor, position_ids: torch.Tensor,
                            layers: range) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Cos and sin for `position_ids`, by layer type, for the layers in `layers` (Gemma 3 computes them per
        layer type, with a rope of its own for sliding layers; other families share one)."""
        if rotary is None:
            return dict.fromkeys({self.layer_types[i] for i in layers})
        if not self.rotary_takes_layer_type:
            shared = rotary(hidden, position_ids)
            return dict.fromkeys({self.layer_types[i] for i in layers}, shared)
        return {kind: rotary(hidden, position_ids, kind) for kind in {self.layer_types[i] for i in layers}}

    # --- caches --------------------------------------------------------------------------------------
    @cached_property
    def layer_caches(self) -> tuple[LayerCache, ...]:
        """What each layer writes to its cache per token, probed by running one step of the layer on the meta
        device (no memory, no weights) through a cache that records the write. Raises :class:`FamilyError` for a
        layer that writes none."""
        rotary = self.new_rotary("cpu")
        positions = torch.zeros(1, 2, dtype=torch.long)
        hidden_cpu = torch.zeros(1, 2, int(self.config.hidden_size))
        embeddings = {kind: _to_meta(pe) for kind, pe in self.position_embeddings(
            rotary, hidden_cpu, positions, range(self.num_layers)).items()}
        found: dict[tuple[type, str], LayerCache] = {}
        caches = []
        for index in range(self.num_layers):
            kind = (self.layer_class(index), self.layer_types[index])
            if kind not in found:
                found[kind] = self._probe_layer(index, embeddings[self.layer_types[index]])
            caches.append(found[kind])
        return tuple(caches)

    def _probe_layer(self, index: int, position_embeddings) -> LayerCache:
        layer = self.new_layer(index)
        probe = _ProbeCache()
        hidden = torch.zeros(1, 2, int(self.config.hidden_size), device="meta")
        try:
            layer(hidden, attention_mask=None, position_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"),
                  position_embeddings=position_embeddings, use_cache=True, **{self.cache_keyword: probe})
        except _Probed:
            pass
        except Exception as exc:  # a layer the meta device cannot step before its cache write: say which
            raise FamilyError(f"{self.name} cannot be served: its layer {index} ({type(layer).__name__}) failed a "
                              f"shape probe before writing its cache ({one_line(exc)})") from None
        if probe.written is None:
            raise FamilyError(f"{self.name} cannot be served: its layer {index} ({type(layer).__name__}) keeps no "
                              f"per-token KV cache")
        keys, values = probe.written
        if len(keys) != 4 or len(values) != 4 or keys[2] != 2 or values[2] != 2:
            raise FamilyError(f"{self.name} cannot be served: its layer {index} writes a cache of shape "
                              f"{tuple(keys)} / {tuple(values)}, not (batch, heads, tokens, dim)")
        return LayerCache(int(keys[1]), int(keys[3]), int(values[1]), int(values[3]))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes in one block (the largest block's): the per-block-token unit of a node's
        KV budget."""
        return max(cache.bytes_per_token(dtype) for cache in self.layer_caches)

    # --- sizes ---------------------------------------------------------------------------------------
    def block_tensors(self, index: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every parameter and persistent buffer of block `index` as the model holds it
        (after checkpoint conversion: experts fused into 3-D parameters), by name relative to the block."""
        return {name: (tuple(t.shape), t.dtype) for name, t in stored_tensors(self.new_layer(index)).items()}

    def block_numel(self, index: int) -> int:
        return sum(math.prod(shape) for shape, _ in self.block_tensors(index).values())

    @cached_property
    def largest_block(self) -> int:
        """The index of the block with the most parameters (the first of equals): the one whose speed and memory a
        node measures, so that its figures hold for any block it is given."""
        sizes = [self.block_numel(i) for i in range(self.num_layers)]
        return sizes.index(max(sizes))
