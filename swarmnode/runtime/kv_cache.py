"""KV-cache memory: a fixed budget per node, per-session storage, and the cache view the layers write to.

The budget is counted in block-tokens (one token's keys and values in one block), so a session that
covers only part of a node's span pays only for its blocks. `free_tokens` reports it in whole-span
tokens, the unit clients reason in. A session that would not fit is refused before anything is allocated.

`BatchedCacheView` is what `transformers` layers receive as `past_key_values`: their attention calls
`update(keys, values, layer_idx)`, and the view writes each session's new keys and values into that
session's preallocated storage and hands back the keys and values of every cached position, so concurrent
sessions with different lengths run through the library's own layer code as one batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from swarmnode.errors import ERROR_CACHE_FULL, SwarmError

if TYPE_CHECKING:
    from swarmnode.runtime.family import LayerCache


class CacheFullError(SwarmError, RuntimeError):
    """A session asks for more cache than the node has free now: not a failure, the client tries elsewhere."""

    code = ERROR_CACHE_FULL


class CacheBudget:
    def __init__(self, tokens: int, span_blocks: int):
        if tokens <= 0:
            raise ValueError(f"the KV-cache budget must hold at least one token, got {tokens}")
        self.tokens = tokens
        self.span_blocks = span_blocks
        self._capacity = tokens * span_blocks
        self._used = 0
        self._lock = threading.Lock()

    @property
    def free_tokens(self) -> int:
        with self._lock:
            return (self._capacity - self._used) // self.span_blocks

    @property
    def used_block_tokens(self) -> int:
        with self._lock:
            return self._used

    def resize(self, tokens: int) -> None:
        """Change the budget (e.g. when another range's memory is freed); never below what is in use."""
        with self._lock:
            self.tokens = max(1, tokens)
            self._capacity = max(self.tokens * self.span_blocks, self._used)

    def reserve(self, batch_size: int, max_length: int, num_blocks: int) -> int:
        need = batch_size * max_length * num_blocks
        with self._lock:
            free = self._capacity - self._used
            if need > free:
                raise CacheFullError(
                    f"session needs {batch_size} x {max_length} tokens in {num_blocks} blocks, but this node has "
                    f"cache for {free // num_blocks} tokens in that many blocks now ({self.tokens} in all): "
                    f"use a smaller max_length or batch, or route through another peer"
                )
            self._used += need
        return need

    def release(self, amount: int) -> None:
        with self._lock:
            self._used -= amount
            assert self._used >= 0, "cache accounting went negative"


class SessionCache:
    """Keys, values and key validity of one session for blocks `[start, end)`, preallocated to max_length.

    `layers[i]` is what block i writes per token (`runtime.family.LayerCache`): keys and values of its KV heads
    for most families; a compressed latent and a shared rotary key for latent attention.
    """

    def __init__(self, start: int, end: int, batch_size: int, max_length: int, layers: Sequence[LayerCache],
                 dtype: torch.dtype, device: torch.device | str):
        self.start, self.end = start, end
        self.batch_size, self.max_length = batch_size, max_length
        self.keys = {i: torch.zeros(batch_size, layers[i].key_heads, max_length, layers[i].key_dim, dtype=dtype,
                                    device=device) for i in range(start, end)}
        self.values = {i: torch.zeros(batch_size, layers[i].value_heads, max_length, layers[i].value_dim,
                                      dtype=dtype, device=device) for i in range(start, end)}
        self.valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self.length = 0

    def shapes(self, index: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of block `index`'s keys and values for `length` tokens (what a handover of them carries)."""
        keys, values = self.keys[index], self.values[index]
        return ((self.batch_size, keys.shape[1], length, keys.shape[3]),
                (self.batch_size, values.shape[1], length, values.shape[3]))

    def rewind(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot rewind to {length}: only {self.length} tokens are cached")
        self.valid[:, length:] = False
        self.length = length


class BatchedCacheView:
    """The `past_key_values` for one batched forward over several sessions (same blocks, same new length)."""

    is_compileable = False

    def __init__(self, caches: list[SessionCache], new_tokens: int):
        self.caches = caches
        self.new_tokens = new_tokens
        self.rows = []
        row = 0
        for cache in caches:
            self.rows.append((row, row + cache.batch_size))
            row += cache.batch_size
        self.total_length = max(c.length for c in caches) + new_tokens

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = self.new_tokens
        if len(self.caches) == 1:
            cache = self.caches[0]
            end = cache.length + n
            cache.keys[layer_idx][:, :, cache.length:end] = key_states
            cache.values[layer_idx][:, :, cache.length:end] = value_states
            return cache.keys[layer_idx][:, :, :end], cache.values[layer_idx][:, :, :end]
        batch, key_heads, _, key_dim = key_states.shape
        keys = key_states.new_zeros(batch, key_heads, self.total_length, key_dim)
        values = value_states.new_zeros(batch, value_states.shape[1], self.total_length, value_states.shape[3])
        for cache, (lo, hi) in zip(self.caches, self.rows):
            end = cache.length + n
            cache.keys[layer_idx][:, :, cache.length:end] = key_states[lo:hi]
            cache.values[layer_idx][:, :, cache.length:end] = value_states[lo:hi]
            keys[lo:hi, :, :end] = cache.keys[layer_idx][:, :, :end]
            values[lo:hi, :, :end] = cache.values[layer_idx][:, :, :end]
        return keys, values

    # transformers' layers may query these on the cache they are given
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.total_length - self.new_tokens
