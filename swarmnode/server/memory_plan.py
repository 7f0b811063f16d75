"""A node's memory plan: how its offer splits into runtime overhead, block weights and KV cache.

Every byte budget of a node comes from one `MemoryPlan`, built once from the offer (`--leftover-mem`), each
block's own weight bytes in the served dtype and quantization (`runtime.quantize`: an int8 block takes about half
of its bfloat16 size, scales included; a model's blocks may differ, as DeepSeek's dense first blocks before its
mixture-of-experts ones do), KV bytes per token as the family's layers write them (`runtime.family`: latent
attention keeps far less than keys and values per head), and the runtime overhead. The
overhead is measured: a node starts with the `RUNTIME_OVERHEAD_BYTES` estimate, and once its processes run
(the DHT process and `p2pd` included) and before it loads any block, replaces it with their memory
(`runtime.footprint.tree_pss`) plus the compute workspace of a step (`workspace_bytes`), see
`MemoryPlan.with_overhead`. What the processes take keeps growing a little once the node serves (`p2pd`'s
buffers after link probes and DHT traffic, the handler's arenas: 25-33 MiB on the test model between the
first measurement and the first range loaded); `SERVING_RESERVE_BYTES` keeps room for that growth in
`max_blocks`, and each later measurement (`MemoryPlan.grown`) pays what the overhead grew by out of it:

- how many blocks fit (`max_blocks`: each block with room for `MIN_CACHE_TOKENS` of KV cache, so a
  placement that fits the offer can still serve sessions; the coordinator plans with it as the node's
  layer capacity, and Helix §5.2 likewise keeps KV room for the requests a node is sent). Counted with the
  largest block, so any range of `max_blocks` blocks fits wherever the coordinator places it, and after
  the serving reserve, so such a range keeps that cache once the node's processes have grown;
- the KV-cache budget of a range when it is all the node holds (`cache_tokens`), or when another range
  stays loaded beside it (`cache_tokens_beside`);
- whether a move from one range to another can load the new range before dropping the old one
  (`side_by_side`), and how the cache is then shared between the two.

Weights of blocks held by two ranges at once (a move to an overlapping range) are counted once: the new
range shares the old one's tensors (`BlockStack(reuse=...)`). Budgets are in whole-span tokens, the unit
`CacheBudget` and clients reason in; the plan does no I/O after it is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarmnode.errors import SwarmError
from swarmnode.runtime import quantize
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.sizes import format_size

__all__ = [
    "MAX_CACHE_TOKENS",
    "MIN_CACHE_TOKENS",
    "RUNTIME_OVERHEAD_BYTES",
    "SERVING_RESERVE_BYTES",
    "TRANSITION_CACHE_TOKENS",
    "WORKSPACE_TOKENS",
    "MemoryPlan",
    "OfferTooSmallError",
    "SideBySide",
    "block_bytes",
    "loading_bytes",
    "workspace_bytes",
]

# Memory a node process takes before any block: interpreter, torch, hivemind, buffers.
RUNTIME_OVERHEAD_BYTES = 400 * 2**20
# What a node's processes grow by once it serves, beyond the overhead measured before (p2pd's buffers after
# link probes and DHT traffic, the handler's arenas): measured 25-33 MiB on the test model on loopback.
SERVING_RESERVE_BYTES = 40 * 2**20
# KV cache each planned block must keep room for (tokens), so an assignment that fits can serve.
MIN_CACHE_TOKENS = 2048
# Largest KV budget of one range (tokens), whatever the offer: a bound on the budget's bookkeeping.
MAX_CACHE_TOKENS = 1 << 20
# KV budget (tokens) of a range served only for a moment while the node moves to another range, and the
# least cache a new range must get for the move to load it beside the old one.
TRANSITION_CACHE_TOKENS = 256
# Tokens of one step whose scratch memory the measured overhead includes (`workspace_bytes`).
WORKSPACE_TOKENS = 512


class OfferTooSmallError(SwarmError, ValueError):
    """The offered memory does not hold what was asked of it (a block, or a range and any KV cache)."""

    code = "offer_too_small"


@dataclass(frozen=True)
class SideBySide:
    """KV budgets (whole-span tokens) of the old and the new range while a node serves both during a move."""

    old_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class MemoryPlan:
    """The byte arithmetic of one node, from plain numbers.

    `block_bytes[i]`: bytes of block i's weights in the served dtype; `kv_bytes_per_block_token`: bytes of
    one token's keys and values in one block; `fixed_cache_tokens`: a KV budget the operator set by hand
    (`--cache-tokens`), which then replaces every derived one; `serving_reserve`: bytes the overhead is
    still expected to grow by once the node serves, kept free in `max_blocks` (see `grown`).
    """

    offer: int
    block_bytes: tuple[int, ...]
    kv_bytes_per_block_token: int
    overhead: int = RUNTIME_OVERHEAD_BYTES
    fixed_cache_tokens: int | None = None
    serving_reserve: int = 0

    def __post_init__(self):
        if not self.block_bytes or self.kv_bytes_per_block_token <= 0:
            raise ValueError("a memory plan needs at least one block and a positive KV size per token")

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, dtype: torch.dtype, offer: int, *, quantization: str = "none",
                        overhead: int = RUNTIME_OVERHEAD_BYTES, fixed_cache_tokens: int | None = None) -> MemoryPlan:
        """The plan of a node serving `checkpoint` in `dtype` (and `quantization`) with `offer` bytes (weight
        sizes from the model's own blocks built on the meta device, no tensor loaded)."""
        family = checkpoint.family
        return cls(offer=offer,
                   block_bytes=tuple(checkpoint.loaded_block_bytes(i, dtype, quantization)
                                     for i in range(family.num_layers)),
                   kv_bytes_per_block_token=family.kv_bytes_per_token(dtype), overhead=overhead,
                   fixed_cache_tokens=fixed_cache_tokens)

    def with_overhead(self, overhead: int, *, serving_reserve: int | None = None) -> MemoryPlan:
        """This plan with a measured overhead in place of the estimate it was built with (and with
        `serving_reserve` kept for what it will grow by, when given)."""
        reserve = self.serving_reserve if serving_reserve is None else int(serving_reserve)
        return dataclasses.replace(self, overhead=int(overhead), serving_reserve=max(0, reserve))

    def grown(self, overhead: int) -> MemoryPlan:
        """This plan once the overhead, measured again, is `overhead` (the plan itself when it has not grown):
        the growth is paid out of the serving reserve first, so `max_blocks` stays what it was while the
        growth stays within the reserve, and falls only by what goes beyond it."""
        growth = int(overhead) - self.overhead
        if growth <= 0:
            return self
        return dataclasses.replace(self, overhead=int(overhead), serving_reserve=max(0, self.serving_reserve - growth))

    # --- sizes ---------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def block_size(self) -> int:
        """Weight bytes of one block as announced to the coordinator: the largest block's, so that a count of blocks
        that fits holds wherever the range starts."""
        return max(self.block_bytes)

    def weight_bytes(self, blocks: Iterable[int]) -> int:
        """Weight bytes of a set of blocks, each counted once."""
        return sum(self.block_bytes[b] for b in set(blocks))

    def span_weight_bytes(self, start: int, end: int) -> int:
        return self.weight_bytes(range(start, end))

    def kv_bytes_per_token(self, start: int, end: int) -> int:
        """KV bytes one whole-span token takes in blocks [start, end)."""
        return self.kv_bytes_per_block_token * (end - start)

    def cache_bytes(self, start: int, end: int, tokens: int) -> int:
        """Bytes of a KV budget of `tokens` whole-span tokens over blocks [start, end)."""
        return tokens * self.kv_bytes_per_token(start, end)

    def held_bytes(self, spans: Iterable[tuple[int, int]], cache_block_tokens: int) -> int:
        """Bytes held by ranges `spans` (shared blocks once) and `cache_block_tokens` block-tokens of KV cache."""
        blocks: set[int] = set()
        for start, end in spans:
            blocks.update(range(start, end))
        return self.weight_bytes(blocks) + cache_block_tokens * self.kv_bytes_per_block_token

    # --- what fits -----------------------------------------------------------------------------------
    @property
    def max_blocks(self) -> int:
        """Blocks that fit once the overhead and the serving reserve are paid, each with room for
        `MIN_CACHE_TOKENS` of KV cache."""
        per_block = self.block_size + self.kv_bytes_per_block_token * MIN_CACHE_TOKENS
        return int(max(0, min(self.num_blocks, (self.offer - self.overhead - self.serving_reserve) // per_block)))

    def check_holds_a_block(self) -> None:
        """Raise `OfferTooSmallError` when the offer holds no block at all (nothing to place on the node)."""
        if self.max_blocks < 1:
            raise OfferTooSmallError(
                f"the offer of {format_size(self.offer)} holds no block ({format_size(self.block_size)} each plus "
                f"KV cache for {MIN_CACHE_TOKENS} tokens, after {format_size(self.overhead)} of runtime overhead"
                f"{self._reserve_text()}): "
                f"offer more with --leftover-mem"
            )

    def _reserve_text(self) -> str:
        return f" and {format_size(self.serving_reserve)} kept for its growth" if self.serving_reserve else ""

    def cache_tokens(self, start: int, end: int) -> int:
        """The KV budget (tokens) of range [start, end) when it is all the node holds.

        Raises `OfferTooSmallError` when the range's weights and the overhead leave no room for one token.
        """
        if self.fixed_cache_tokens is not None:
            return self._capped(self.fixed_cache_tokens)
        weights = self.span_weight_bytes(start, end)
        tokens = (self.offer - weights - self.overhead) // self.kv_bytes_per_token(start, end)
        if tokens < 1:
            raise OfferTooSmallError(
                f"the offer of {format_size(self.offer)} does not hold blocks [{start}, {end}) "
                f"({format_size(weights)}) plus {format_size(self.overhead)} of runtime overhead and any KV cache: "
                f"offer more memory (--leftover-mem) or serve fewer blocks"
            )
        return self._capped(tokens)

    def cache_tokens_beside(self, target: tuple[int, int], other: tuple[int, int], other_tokens: int) -> int:
        """The KV budget of `target` while range `other` (whose blocks `target` shares) keeps a budget of
        `other_tokens`: what `target` would get alone, less the other budget's bytes (at least one token)."""
        if self.fixed_cache_tokens is not None:
            return self._capped(self.fixed_cache_tokens)
        per_token = self.kv_bytes_per_token(*target)
        alone = self.cache_tokens(*target) * per_token
        return self._capped(max(1, (alone - self.cache_bytes(*other, other_tokens)) // per_token))

    def side_by_side(self, held: Iterable[tuple[int, int]], used_block_tokens: int, old: tuple[int, int],
                     old_used_block_tokens: int, target: tuple[int, int]) -> SideBySide | None:
        """Whether a move from range `old` to `target` can load `target` before dropping `old`, and with
        what budgets; None when it cannot (then the node drops what `target` does not need first).

        `held`: every range the node holds now, `used_block_tokens` the KV cache its sessions use in all
        (block-tokens), `old_used_block_tokens` the part of it on `old`. Both ranges fit when the offer, less
        the overhead, what is held and in use, and the weights `target` does not share with `old`, leaves
        cache for `TRANSITION_CACHE_TOKENS` tokens on `target`. The old range then keeps what its sessions
        use plus half of that room, and the new one gets the other half. A node with a fixed budget
        (`--cache-tokens`) never loads two ranges side by side: its budget cannot be split.
        """
        if self.fixed_cache_tokens is not None:
            return None
        new_only = [b for b in range(*target) if not old[0] <= b < old[1]]  # the rest is shared with `old`
        room = self.offer - self.overhead - self.held_bytes(held, used_block_tokens) - self.weight_bytes(new_only)
        if room < self.cache_bytes(*target, TRANSITION_CACHE_TOKENS):
            return None
        old_used = old_used_block_tokens * self.kv_bytes_per_block_token
        return SideBySide(old_tokens=self._capped((old_used + room // 2) // self.kv_bytes_per_token(*old)),
                          new_tokens=self._capped((room // 2) // self.kv_bytes_per_token(*target)))

    @staticmethod
    def _capped(tokens: int) -> int:
        return int(min(max(tokens, 1), MAX_CACHE_TOKENS))


def block_bytes(family, index: int, dtype: torch.dtype, quantization: str = "none") -> int:
    """Bytes block `index` of `family` (a `runtime.family.ModelFamily`) takes once loaded in `dtype` with
    `quantization`, from its meta-device layer (no memory, no checkpoint read)."""
    return quantize.block_bytes(family.new_layer(index), quantization, dtype,
                                lambda name: family.tensor_dtype(index, name, dtype))


def loading_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """Bytes loading holds beside the range it has built: a block's largest tensor as the checkpoint stores it,
    or, for a family whose checkpoints store experts one by one, the fused tensor being built (in `dtype`) beside
    its sources."""
    infos = checkpoint.tensor_info(checkpoint.block_prefix(0)).values()
    stored = max((info.numel * (info.torch_dtype or torch.float32).itemsize for info in infos), default=0)
    family = checkpoint.family
    if not family.conversion.converts:
        return stored
    block = family.largest_block
    fused = max(math.prod(shape) * family.tensor_dtype(block, name, dtype).itemsize
                for name, (shape, _) in family.block_tensors(block).items())
    return max(stored, 2 * fused)


def workspace_bytes(config, dtype: torch.dtype, tokens: int = WORKSPACE_TOKENS) -> int:
    """Scratch memory of one step of `tokens` tokens through a block (an estimate; nodes also measure it): the
    hidden states in and out and the residual, the MLP's three intermediate activations (a mixture of experts'
    routed ones), and attention's query/key/value projections and score matrix (float32). A longer prompt runs in
    chunks of `--prefill-chunk` tokens (256, `runtime.scheduler`), so beyond its own inputs and outputs it needs
    one chunk's scratch; `WORKSPACE_TOKENS` covers a chunk. A quantized node's prompt steps also unpack one
    weight matrix at a time (`runtime.quantize.dequantize`), which the node's measured workspace includes."""
    element = torch.empty((), dtype=dtype).element_size()
    hidden = int(config.hidden_size)
    # a mixture of experts runs each token through `num_experts_per_tok` experts of its own width
    routed = int(getattr(config, "num_experts_per_tok", 0) or 0) * int(getattr(config, "moe_intermediate_size", 0) or 0)
    inter = max(int(getattr(config, "intermediate_size", 0) or 0), routed, hidden)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    activations = tokens * (4 * hidden + 3 * inter + (heads + 2 * kv_heads) * head_dim) * element
    scores = heads * tokens * tokens * 4
    return activations + scores
