"""A contiguous range of transformer blocks, built from `transformers`' own layer classes.

One generic path for every decoder-only family whose model keeps its blocks in `model.layers`: the layer
class and the rotary-embedding class are taken from a weightless (meta-device) skeleton of the model, each
block is instantiated with its global `layer_idx`, and its tensors are read from the checkpoint alone. No
model code is copied here, so Llama, Mistral, Qwen2, Qwen3 and their relatives run the library's code.

Attention masks follow `transformers.masking_utils`: causal over cache positions, padding masked out, an
optional sliding window per layer; when nothing needs masking the mask is `None`, as the library does, so
that the same attention kernels run and outputs equal local `transformers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from swarmnode.runtime.checkpoint import Checkpoint, CheckpointError
from swarmnode.runtime.kv_cache import BatchedCacheView, SessionCache
from swarmnode.runtime.memory import release_free_memory

logger = logging.getLogger(__name__)



def _skeleton(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise CheckpointError(
            f"{type(model).__name__} does not keep its blocks in model.layers with a shared rotary embedding; "
            f"this architecture is not supported"
        )
    return base


class BlockStack:
    """Blocks `[start, end)` of a checkpoint, loaded on `device` in `dtype`.

    `quantization`: "none", or a weight-only mode of `runtime.quantize` applied to each block's linear layers
    right after that block is read, so the range is never held in full precision (at most one block is).
    `reuse`: another stack of the same dtype, quantization and device whose layers this one shares instead of
    loading them again (a node moving to an overlapping range keeps the overlap in memory once).
    `random_weights`: random tensors of the checkpoint's shapes instead of its weights (no shard is read), for
    measuring speed, which does not depend on the values.
    """

    def __init__(self, checkpoint: Checkpoint, start: int, end: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", quantization: str = "none", progress: Callable[[int, int], None] | None = None,
                 reuse: BlockStack | None = None, random_weights: bool = False):
        if not 0 <= start < end <= checkpoint.num_blocks:
            raise ValueError(
                f"blocks {start}:{end} are outside the model's 0:{checkpoint.num_blocks}; pick A:B with "
                f"0 <= A < B <= {checkpoint.num_blocks}"
            )
        self.checkpoint, self.start, self.end = checkpoint, start, end
        self.dtype, self.device, self.quantization = dtype, torch.device(device), quantization
        config = checkpoint.config
        skeleton = _skeleton(config)
        layer_cls = type(skeleton.layers[0])
        self.rotary = type(skeleton.rotary_emb)(config=config).to(self.device)
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
            with torch.device("meta"):
                layer = layer_cls(config, layer_idx=index)
            if random_weights:
                tensors = iter(_random_state(checkpoint, index, dtype, str(self.device)).items())
            else:
                tensors = checkpoint.iter_tensors(checkpoint.block_prefix(index), dtype=dtype, device=str(self.device),
                                                  copy=quantization == "none")
            _fill(layer, tensors, quantization, dtype, index)
            release_free_memory()  # what reading and converting this block freed goes back now, not at the end
            self.layers[index] = layer.eval().requires_grad_(False)
            if progress is not None:
                progress(done + 1, end - start)
        self.windows = {i: self._sliding_window(config, i) for i in range(start, end)}

    @staticmethod
    def _sliding_window(config, index: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[index] == "sliding_attention" else None
        if getattr(config, "use_sliding_window", True) is False:
            return None
        return window

    def new_session_cache(self, start: int, end: int, batch_size: int, max_length: int) -> SessionCache:
        ckpt = self.checkpoint
        return SessionCache(start, end, batch_size, max_length, ckpt.num_kv_heads, ckpt.head_dim,
                            self.dtype, self.device)

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
        masks = {w: self._mask(caches, n, w) for w in set(self.windows[i] for i in range(start, end))}
        position_embeddings = self.rotary(hidden, position_ids)
        for index in range(start, end):
            hidden = self.layers[index](
                hidden,
                attention_mask=masks[self.windows[index]],
                position_ids=position_ids,
                past_key_values=view,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        for cache in caches:
            cache.length += n
        return hidden

    def _mask(self, caches: list[SessionCache], n: int, window: int | None) -> torch.Tensor | None:
        """Boolean (rows, 1, n, K) mask: True where a query may attend a key; None when nothing is masked."""
        total = max(c.length for c in caches) + n
        if len(caches) == 1:
            cache = caches[0]
            no_padding = bool(cache.valid[:, : cache.length + n].all())
            window_unused = window is None or total <= window
            if no_padding and window_unused and (n == 1 or cache.length == 0):
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
        return torch.cat(parts)[:, None]


def _fill(layer: torch.nn.Module, tensors, quantization: str, dtype: torch.dtype, index: int) -> None:
    """Put the checkpoint's tensors into a meta-device `layer` one at a time; with a quantization, each linear
    is quantized as soon as its weight (and bias, if it has one) has arrived, so the block's full-precision
    weights are never all in memory, only the tensor being read. Raises `CheckpointError` for a tensor the
    layer has no place for, or a place no tensor filled."""
    from swarmnode.runtime.quantize import QuantizedLinear

    unexpected = []
    for name, tensor in tensors:
        module_name, _, attr = name.rpartition(".")
        try:
            module = layer.get_submodule(module_name) if module_name else layer
        except AttributeError:
            unexpected.append(name)
            continue
        quantized = quantization != "none" and isinstance(module, torch.nn.Linear)
        if quantization != "none" and not quantized and tensor.device.type == "cpu":
            tensor = tensor.clone()  # read without a copy for the quantizer; everything else is the node's own
        place = module._parameters.get(attr, module._buffers.get(attr))
        if place is None:
            unexpected.append(name)
            continue
        if tuple(place.shape) != tuple(tensor.shape):
            raise CheckpointError(f"block {index}: {name} has shape {tuple(tensor.shape)} in the checkpoint, the "
                                  f"model's config makes it {tuple(place.shape)}: the weights do not match the config")
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
        tensor = None
        if quantized and not any(t.is_meta for t in module.parameters(recurse=False)):
            parent_name, _, child = module_name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, QuantizedLinear.from_linear(module, quantization, dtype))
            module.weight = module.bias = None  # the full-precision tensors go now
    if unexpected:
        raise CheckpointError(f"block {index}: the checkpoint has tensors this layer has no place for: {unexpected}")
    leftover = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"block {index} has tensors the checkpoint does not hold: {leftover}")


def _random_state(checkpoint: Checkpoint, index: int, dtype: torch.dtype, device: str) -> dict:
    """Block `index`'s tensors with the checkpoint's names and shapes and random values (small normal for
    matrices, ones for norm weights), read from the headers only."""
    prefix = checkpoint.block_prefix(index)
    generator = torch.Generator().manual_seed(index)
    state = {}
    for name, shape in checkpoint.tensor_shapes(prefix).items():
        if len(shape) >= 2:
            tensor = torch.empty(tuple(shape), dtype=dtype).normal_(0.0, 0.02, generator=generator)
        else:
            tensor = torch.ones(tuple(shape), dtype=dtype)
        state[name[len(prefix):]] = tensor.to(device)
    return state


def measure_block_throughput(stack: BlockStack, *, repeats: int = 8) -> float:
    """Tokens/s of one block for decode-sized steps, measured on this node's first block."""
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
    cache), measured on this node's first block: the prefill rate a two-phase plan gives prefill nodes."""
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
