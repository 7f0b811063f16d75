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

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    `reuse`: another stack of the same dtype and device whose layers this one shares instead of loading
    them again (a node moving to an overlapping range keeps the overlap in memory once).
    """

    def __init__(self, checkpoint: Checkpoint, start: int, end: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", progress: Callable[[int, int], None] | None = None,
                 reuse: BlockStack | None = None):
        if not 0 <= start < end <= checkpoint.num_blocks:
            raise ValueError(
                f"blocks {start}:{end} are outside the model's 0:{checkpoint.num_blocks}; pick A:B with "
                f"0 <= A < B <= {checkpoint.num_blocks}"
            )
        self.checkpoint, self.start, self.end = checkpoint, start, end
        self.dtype, self.device = dtype, torch.device(device)
        config = checkpoint.config
        skeleton = _skeleton(config)
        layer_cls = type(skeleton.layers[0])
        self.rotary = type(skeleton.rotary_emb)(config=config).to(self.device)
        self.layers: dict[int, torch.nn.Module] = {}
        shared = reuse if reuse is not None and reuse.dtype == dtype and reuse.device == self.device else None
        for done, index in enumerate(range(start, end)):
            if shared is not None and index in shared.layers:  # already in memory: share, do not reload
                self.layers[index] = shared.layers[index]
                if progress is not None:
                    progress(done + 1, end - start)
                continue
            with torch.device("meta"):
                layer = layer_cls(config, layer_idx=index)
            state = checkpoint.load_tensors(checkpoint.block_prefix(index), dtype=dtype, device=str(self.device))
            missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
            if missing or unexpected:
                raise CheckpointError(f"block {index}: missing tensors {missing}, unexpected {unexpected}")
            leftover = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
            if leftover:
                raise CheckpointError(f"block {index} has tensors the checkpoint does not hold: {leftover}")
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
