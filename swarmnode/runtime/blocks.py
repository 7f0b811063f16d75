"""A contiguous range of transformer blocks, built from `transformers`' own layer classes.

One generic path for every decoder-only family `runtime.family` accepts: each block is its family's decoder layer
built with its global `layer_idx`, its tensors read from the checkpoint alone and converted as `from_pretrained`
converts them (`runtime.conversion`: per-expert checkpoint tensors fused into 3-D parameters, renames), and
buffers the checkpoint does not hold initialised by the library's own `_init_weights`. No model code is copied
here, so Llama, Qwen3-MoE, Mixtral, gpt-oss, DeepSeek V3, Gemma 2/3 and their relatives run the library's code,
with the attention implementation it picks for them (SDPA, or eager for gpt-oss' sinks and Gemma 2's
soft-capping).

Attention masks follow `transformers.masking_utils`: causal over cache positions, padding masked out, a sliding
window on the layers the family marks sliding; boolean for SDPA and additive (0 / the dtype's minimum) for eager.
When nothing needs masking an SDPA mask is `None`, as the library does, so that the same kernels run and outputs
equal local `transformers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from swarmnode.runtime import quantize
from swarmnode.runtime.checkpoint import CheckpointError
from swarmnode.runtime.conversion import LazyTensor
from swarmnode.runtime.decode_linear import use_decode_linears
from swarmnode.runtime.family import MaskStyle, ModelFamily, one_line
from swarmnode.runtime.ggml import decode_step
from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint
from swarmnode.runtime.ggml.weights import GGMLWeight, share_inputs
from swarmnode.runtime.ggml.weights import install as install_ggml
from swarmnode.runtime.kv_cache import BatchedCacheView, SessionCache
from swarmnode.runtime.memory import release_free_memory

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Where a stack's blocks come from: a checkpoint (`runtime.checkpoint.Checkpoint`), or a model held in memory
    in the checkpoint format (the family check of `runtime.family_check`)."""

    @property
    def config(self): ...

    @property
    def family(self) -> ModelFamily: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def block_prefix(self, index: int) -> str: ...

    def lazy_tensors(self, prefix: str, device: str = "cpu", *, copy: bool = True
                     ) -> list[tuple[str, LazyTensor]]: ...


class BlockStack:
    """Blocks `[start, end)` of a checkpoint, loaded on `device` in `dtype`.

    `quantization`: "none", or a weight-only mode of `runtime.quantize` applied to each block's linear layers and
    experts as soon as each has arrived, so the range is never held in full precision (at most one block's
    tensor being converted is). `reuse`: another stack of the same dtype, quantization and device whose layers
    this one shares instead of loading them again (a node moving to an overlapping range keeps the overlap in
    memory once). `random_weights`: random tensors of the blocks' shapes instead of their weights (no shard is
    read), for measuring speed, which does not depend on the values (a GGUF file's blocks are read as they are: their
    speed is that of their formats' kernels).
    """

    def __init__(self, checkpoint: WeightSource, start: int, end: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", quantization: str = "none", progress: Callable[[int, int], None] | None = None,
                 reuse: BlockStack | None = None, random_weights: bool = False):
        if not 0 <= start < end <= checkpoint.num_blocks:
            raise ValueError(
                f"blocks {start}:{end} are outside the model's 0:{checkpoint.num_blocks}; pick A:B with "
                f"0 <= A < B <= {checkpoint.num_blocks}"
            )
        self.checkpoint, self.start, self.end = checkpoint, start, end
        self.dtype, self.device, self.quantization = dtype, torch.device(device), quantization
        self.family = family = checkpoint.family
        self.rotary = family.new_rotary(self.device)
        self.layers: dict[int, torch.nn.Module] = {}
        same_kind = reuse is not None and (reuse.dtype, reuse.device, reuse.quantization) == (
            dtype, self.device, quantization)
        shared = reuse if same_kind else None
        for done, index in enumerate(range(start, end)):
            if shared is not None and index in shared.layers:  # already in memory: share, do not reload
                self.layers[index] = shared.layers[index]
                if progress is not None:
                    progress(done + 1, end - start)
                continue
            layer = family.new_layer(index)
            if random_weights and not isinstance(checkpoint, GGUFCheckpoint):  # a GGUF block's speed is its kernels'
                tensors = _random_tensors(family, layer, index, dtype, str(self.device))
            else:
                tensors = block_tensors(checkpoint, index, dtype, str(self.device), copy=quantization == "none")
            _fill(layer, tensors, quantization, dtype, index)
            family.initialise_buffers(layer, self.device)
            leftover = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
            if leftover:
                raise CheckpointError(f"block {index} has tensors the checkpoint does not hold: {leftover}")
            release_free_memory()  # what reading and converting this block freed goes back now, not at the end
            use_decode_linears(layer)  # bfloat16 decode steps at memory speed, the same bits (`runtime.decode_linear`)
            share_inputs(layer)  # ggml linears on one input multiply a decode row in one call (`runtime.ggml.weights`)
            decode_step.attach(layer)  # one token through a Llama block of GGUF matrices in two C calls
            self.layers[index] = layer.eval().requires_grad_(False)
            if progress is not None:
                progress(done + 1, end - start)
        self.windows = {i: family.sliding_window(i) for i in range(start, end)}

    def new_session_cache(self, start: int, end: int, batch_size: int, max_length: int) -> SessionCache:
        return SessionCache(start, end, batch_size, max_length, self.family.layer_caches, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, start: int, end: int, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Stateless run of blocks `[start, end)`: no cache, causal over the given tokens."""
        cache = self.new_session_cache(start, end, hidden.shape[0], hidden.shape[1])
        mask = attention_mask if attention_mask is not None else torch.ones(hidden.shape[:2], dtype=torch.bool)
        return self.step([cache], start, end, hidden, position_ids, mask)

    @torch.inference_mode()
    def step(self, caches: list[SessionCache], start: int, end: int, hidden: torch.Tensor,
             position_ids: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Run blocks `[start, end)` on the concatenated new tokens of `caches` (rows in cache order).

        `hidden` is (rows, n, H), `position_ids` and `new_mask` (rows, n). Each cache grows by n tokens.
        """
        n = hidden.shape[1]
        hidden = hidden.to(self.device, self.dtype)
        position_ids = position_ids.to(self.device)
        row = 0
        for cache in caches:
            if cache.length + n > cache.max_length:
                raise ValueError(
                    f"session would hold {cache.length + n} tokens, more than its max_length {cache.max_length}"
                )
            cache.valid[:, cache.length:cache.length + n] = new_mask[row:row + cache.batch_size].to(self.device)
            row += cache.batch_size
        view = BatchedCacheView(caches, n)
        family = self.family
        masks = {w: self._mask(caches, n, w) for w in set(self.windows[i] for i in range(start, end))}
        embeddings = family.position_embeddings(self.rotary, hidden, position_ids, range(start, end))
        for index in range(start, end):
            out = self.layers[index](
                hidden,
                attention_mask=masks[self.windows[index]],
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=embeddings[family.layer_types[index]],
                **{family.cache_keyword: view},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        for cache in caches:
            cache.length += n
        return hidden

    def _mask(self, caches: list[SessionCache], n: int, window: int | None) -> torch.Tensor | None:
        """(rows, 1, n, K) mask in the family's style (`MaskStyle`): where a query may attend a key; None when
        nothing is masked (for eager attention only a single new token can go unmasked)."""
        total = max(c.length for c in caches) + n
        additive = self.family.mask_style is MaskStyle.ADDITIVE
        if len(caches) == 1:
            cache = caches[0]
            no_padding = bool(cache.valid[:, : cache.length + n].all())
            window_unused = window is None or total <= window
            if no_padding and window_unused and (n == 1 or (cache.length == 0 and not additive)):
                return None
        parts = []
        keys = torch.arange(total, device=self.device)
        for cache in caches:
            queries = cache.length + torch.arange(n, device=self.device)  # cache index of each new token
            allowed = keys[None, :] <= queries[:, None]
            if window is not None:
                allowed &= keys[None, :] > queries[:, None] - window
            valid = torch.zeros(cache.batch_size, total, dtype=torch.bool, device=self.device)
            valid[:, : cache.length + n] = cache.valid[:, : cache.length + n]
            rows = allowed[None, :, :] & valid[:, None, :]
            # a padding query sees no key at all: let it see itself, so no row is all -inf (NaN in softmax)
            rows[:, torch.arange(n), queries] = True
            parts.append(rows)
        mask = torch.cat(parts)[:, None]
        if additive:
            return torch.where(mask, torch.zeros((), dtype=self.dtype, device=self.device),
                               torch.finfo(self.dtype).min)
        return mask


def block_tensors(checkpoint: WeightSource, index: int, dtype: torch.dtype, device: str, *,
                  copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name relative to the block, tensor) of block `index` as the model holds it: the checkpoint's tensors of
    that block read lazily and converted as `from_pretrained` converts them, one target at a time."""
    family = checkpoint.family
    ours = family.block_prefix(index)
    sources = checkpoint.lazy_tensors(checkpoint.block_prefix(index), device, copy=copy)
    if not sources:
        raise CheckpointError(f"the checkpoint holds no tensors of block {index} ({checkpoint.block_prefix(index)}*)")
    try:
        for name, tensor in family.conversion.convert(sources, dtype):
            if not name.startswith(ours):
                raise CheckpointError(f"block {index}'s checkpoint tensors convert to {name}, outside the block")
            yield name[len(ours):], tensor
    except CheckpointError as exc:
        raise CheckpointError(f"block {index}: {exc}", code=exc.code) from None
    except (RuntimeError, ValueError, KeyError) as exc:  # a conversion op that cannot take these tensors
        raise CheckpointError(f"block {index}: its checkpoint tensors do not convert as transformers converts "
                              f"them for {family.name} ({one_line(exc)})") from None


def _fill(layer: torch.nn.Module, tensors, quantization: str, dtype: torch.dtype, index: int) -> None:
    """Put the block's tensors into a meta-device `layer` one at a time; with a quantization, each linear and
    each experts module is quantized as soon as its weights (and biases) have arrived, so the block's
    full-precision weights are never all in memory, only the tensor being read. Raises `CheckpointError` for a
    tensor the layer has no place for, or one whose shape is not the config's."""
    unexpected = []
    for name, tensor in tensors:
        module_name, _, attr = name.rpartition(".")
        try:
            module = layer.get_submodule(module_name) if module_name else layer
        except AttributeError:
            unexpected.append(name)
            continue
        if isinstance(tensor, GGMLWeight):  # a GGUF matrix: served in its stored form (`runtime.ggml.weights`)
            if attr != "weight":
                unexpected.append(name)
                continue
            try:
                install_ggml(layer, module_name, tensor, dtype)
            except ValueError as exc:
                raise CheckpointError(f"block {index}: {exc}") from None
            continue
        place = module._parameters.get(attr, module._buffers.get(attr))
        if place is None:
            unexpected.append(name)
            continue
        if tuple(place.shape) != tuple(tensor.shape):
            raise CheckpointError(f"block {index}: {name} has shape {tuple(tensor.shape)} in the checkpoint, the "
                                  f"model's config makes it {tuple(place.shape)}: the weights do not match the config")
        quantized = quantization != "none" and (
            isinstance(module, torch.nn.Linear) or attr in quantize.expert_weights(module))
        if quantization != "none" and not quantized and tensor.device.type == "cpu":
            tensor = tensor.clone()  # read without a copy for the quantizer; everything else is the node's own
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
        tensor = None
        quantize.quantize_ready(layer, module_name, quantization, dtype)
    if unexpected:
        raise CheckpointError(f"block {index}: the checkpoint has tensors this layer has no place for: {unexpected}")


def _random_tensors(family: ModelFamily, layer: torch.nn.Module, index: int, dtype: torch.dtype, device: str):
    """Random tensors of every parameter and persistent buffer of meta-device `layer` (small normal for matrices,
    ones for vectors), one at a time: the values do not matter for measuring speed."""
    generator = torch.Generator().manual_seed(index)
    for name, meta in quantize.stored_tensors(layer).items():
        kind = family.tensor_dtype(index, name, dtype) if meta.is_floating_point() else meta.dtype
        if meta.dim() >= 2 and meta.is_floating_point():
            tensor = torch.empty(tuple(meta.shape), dtype=kind).normal_(0.0, 0.02, generator=generator)
        elif meta.is_floating_point():
            tensor = torch.ones(tuple(meta.shape), dtype=kind)
        else:
            tensor = torch.zeros(tuple(meta.shape), dtype=kind)
        yield name, tensor.to(device)


def measure_block_throughput(stack: BlockStack, *, repeats: int = 8) -> float:
    """Tokens/s of one block for decode-sized steps, measured on the stack's first block."""
    index = stack.start
    hidden = torch.zeros(1, 1, stack.checkpoint.hidden_size)
    cache = stack.new_session_cache(index, index + 1, 1, repeats + 2)
    positions = torch.zeros(1, 1, dtype=torch.long)
    mask = torch.ones(1, 1, dtype=torch.bool)
    stack.step([cache], index, index + 1, hidden, positions, mask)  # warm-up
    began = time.perf_counter()
    for step in range(repeats):
        stack.step([cache], index, index + 1, hidden, positions + step + 1, mask)
    elapsed = time.perf_counter() - began
    return repeats / max(elapsed, 1e-9)


#: The prompt length a node's prefill throughput is measured with (HexGen-2's prefill phase).
PREFILL_PROBE_TOKENS = 256


def measure_prefill_throughput(stack: BlockStack, *, tokens: int = PREFILL_PROBE_TOKENS, repeats: int = 2) -> float:
    """Prompt tokens/s of one block for a `tokens`-long prompt (one forward of the whole prompt into an empty
    cache), measured on the stack's first block: the prefill rate a two-phase plan gives prefill nodes."""
    index = stack.start
    hidden = torch.zeros(1, tokens, stack.checkpoint.hidden_size)
    positions = torch.arange(tokens, dtype=torch.long)[None]
    mask = torch.ones(1, tokens, dtype=torch.bool)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first is a warm-up
        cache = stack.new_session_cache(index, index + 1, 1, tokens)
        began = time.perf_counter()
        stack.step([cache], index, index + 1, hidden, positions, mask)
        if attempt:
            best = min(best, time.perf_counter() - began)
    return tokens / max(best, 1e-9)
