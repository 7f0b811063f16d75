"""A node's memory plan: blocks that fit, KV budgets per range, and moves that load before they drop.

First on plain numbers, where every figure can be checked by hand (MiB-sized blocks, a KiB of KV cache per
block-token), then on the real SmolLM2 checkpoint, whose sizes come from its safetensors headers.
"""

from __future__ import annotations

import pytest
import torch

from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.server.memory_plan import (
    MAX_CACHE_TOKENS,
    MIN_CACHE_TOKENS,
    RUNTIME_OVERHEAD_BYTES,
    TRANSITION_CACHE_TOKENS,
    MemoryPlan,
    OfferTooSmallError,
    SideBySide,
)

MIB = 2**20
KIB = 2**10


def _plan(offer_mib: int, *, blocks: int = 10, fixed: int | None = None) -> MemoryPlan:
    """Blocks of 8 MiB, 1 KiB of KV cache per block-token, 100 MiB of overhead."""
    return MemoryPlan(offer=offer_mib * MIB, block_bytes=(8 * MIB,) * blocks, kv_bytes_per_block_token=KIB,
                      overhead=100 * MIB, fixed_cache_tokens=fixed)


def test_blocks_that_fit_leave_each_block_room_for_its_cache():
    # one block with its MIN_CACHE_TOKENS of cache: 8 MiB + 2048 KiB = 10 MiB
    assert MIN_CACHE_TOKENS * KIB == 2 * MIB
    assert _plan(100).max_blocks == 0
    assert _plan(109).max_blocks == 0
    assert _plan(110).max_blocks == 1
    assert _plan(145).max_blocks == 4
    assert _plan(10_000).max_blocks == 10  # never more than the model has
    with pytest.raises(OfferTooSmallError, match="holds no block") as caught:
        _plan(109).check_holds_a_block()
    assert caught.value.code == "offer_too_small" and isinstance(caught.value, ValueError)
    _plan(110).check_holds_a_block()


def test_serving_reserve_keeps_room_for_growth_and_is_paid_out_of_first():
    # 145 MiB: 4 blocks with their cache; a 12 MiB reserve leaves room for 3 (100 + 12 + 3 * 10 = 142)
    plan = _plan(145).with_overhead(100 * MIB, serving_reserve=12 * MIB)
    assert plan.max_blocks == 3
    with pytest.raises(OfferTooSmallError, match="kept for its growth"):
        _plan(110).with_overhead(100 * MIB, serving_reserve=MIB).check_holds_a_block()
    # the overhead measured again grows by 8 MiB: paid out of the reserve, the offer still holds 3 blocks
    grown = plan.grown(108 * MIB)
    assert (grown.overhead, grown.serving_reserve, grown.max_blocks) == (108 * MIB, 4 * MIB, 3)
    # a range of max_blocks blocks keeps its MIN_CACHE_TOKENS while the growth stays within the reserve
    assert grown.cache_tokens(0, grown.max_blocks) >= MIN_CACHE_TOKENS
    # growth beyond the reserve: max_blocks falls so that each block keeps its cache again
    beyond = grown.grown(118 * MIB)
    assert (beyond.serving_reserve, beyond.max_blocks) == (0, 2)
    assert beyond.cache_tokens(0, 3) < MIN_CACHE_TOKENS <= beyond.cache_tokens(0, beyond.max_blocks)
    # a smaller measurement changes nothing; a new measurement of the estimate keeps the reserve
    assert grown.grown(90 * MIB) is grown
    assert plan.with_overhead(120 * MIB).serving_reserve == 12 * MIB


def test_cache_budget_of_a_range_is_what_its_weights_and_the_overhead_leave():
    plan = _plan(200)
    # blocks [0, 4): 32 MiB of weights; 200 - 100 - 32 = 68 MiB left, at 4 KiB per whole-span token
    assert plan.span_weight_bytes(0, 4) == 32 * MIB
    assert plan.kv_bytes_per_token(0, 4) == 4 * KIB
    assert plan.cache_tokens(0, 4) == 68 * MIB // (4 * KIB) == 17408
    assert plan.cache_bytes(0, 4, 17408) == 68 * MIB
    # blocks [0, 12) would not exist; blocks [0, 10) need 80 MiB + overhead: 20 MiB left for 10 KiB tokens
    assert plan.cache_tokens(0, 10) == 20 * MIB // (10 * KIB)
    with pytest.raises(OfferTooSmallError, match=r"does not hold blocks \[0, 10\)"):
        _plan(180).cache_tokens(0, 10)
    # a huge offer is capped; a fixed budget (--cache-tokens) wins over the derived one
    assert _plan(10**7).cache_tokens(0, 1) == MAX_CACHE_TOKENS
    assert _plan(180, fixed=64).cache_tokens(0, 10) == 64


def test_held_bytes_count_shared_blocks_once():
    plan = _plan(200)
    # [0, 4) and [2, 6) share blocks 2 and 3: six blocks in memory, plus 1000 block-tokens of cache
    assert plan.held_bytes([(0, 4), (2, 6)], 1000) == 6 * 8 * MIB + 1000 * KIB


def test_a_move_loads_the_new_range_first_when_memory_holds_both():
    plan = _plan(200)
    # serving [0, 4) with 1024 block-tokens in use; moving to [2, 6) needs blocks 4 and 5 (16 MiB) more.
    # room: 200 - 100 - (32 MiB + 1 MiB in use) - 16 MiB = 51 MiB, far more than the transition's cache
    both = plan.side_by_side([(0, 4)], 1024, (0, 4), 1024, (2, 6))
    room = 51 * MIB
    assert both == SideBySide(old_tokens=(1024 * KIB + room // 2) // (4 * KIB), new_tokens=(room // 2) // (4 * KIB))
    # the two budgets and what is held fit the offer
    spent = (plan.overhead + plan.weight_bytes(range(0, 6)) + plan.cache_bytes(0, 4, both.old_tokens)
             + plan.cache_bytes(2, 6, both.new_tokens))
    assert spent <= plan.offer


def test_a_move_drops_first_when_memory_does_not_hold_both():
    # 100 + 32 + 16 (new blocks) = 148 MiB; the transition needs 256 tokens x 4 KiB = 1 MiB of cache more
    need = TRANSITION_CACHE_TOKENS * 4 * KIB
    assert need == MIB
    assert _plan(149).side_by_side([(0, 4)], 0, (0, 4), 0, (2, 6)) is not None
    assert _plan(148).side_by_side([(0, 4)], 0, (0, 4), 0, (2, 6)) is None
    # cache in use counts against the room too
    assert _plan(149).side_by_side([(0, 4)], 1024, (0, 4), 1024, (2, 6)) is None
    # a fixed budget is never split between two ranges
    assert _plan(10_000, fixed=64).side_by_side([(0, 4)], 0, (0, 4), 0, (2, 6)) is None


def test_a_range_loaded_beside_a_kept_one_gets_what_is_left():
    plan = _plan(200)
    # [2, 6) alone: 200 - 100 - 32 = 68 MiB of cache; the kept overlap [2, 4) holds 256 tokens x 2 KiB
    alone = plan.cache_tokens(2, 6)
    assert plan.cache_tokens_beside((2, 6), (2, 4), 256) == (alone * 4 * KIB - 256 * 2 * KIB) // (4 * KIB)
    assert plan.cache_tokens_beside((2, 6), (2, 4), 10**9) == 1  # never below one token
    assert _plan(200, fixed=64).cache_tokens_beside((2, 6), (2, 4), 256) == 64


def test_plan_of_the_real_checkpoint(model_dir):
    checkpoint = Checkpoint(model_dir)
    plan = MemoryPlan.from_checkpoint(checkpoint, torch.float32, 700 * MIB)
    config = checkpoint.config
    assert plan.num_blocks == config.num_hidden_layers == 30
    assert plan.overhead == RUNTIME_OVERHEAD_BYTES
    # every block's weights, counted from the tensors themselves
    for index in (0, 29):
        tensors = checkpoint.load_tensors(checkpoint.block_prefix(index), dtype=torch.float32)
        assert plan.block_bytes[index] == sum(t.numel() * t.element_size() for t in tensors.values())
    # keys and values of every KV head, float32
    head_dim = config.hidden_size // config.num_attention_heads
    assert plan.kv_bytes_per_block_token == 2 * config.num_key_value_heads * head_dim * 4
    # 300 MiB after the overhead: as many blocks as fit with MIN_CACHE_TOKENS of cache each
    per_block = plan.block_size + MIN_CACHE_TOKENS * plan.kv_bytes_per_block_token
    assert plan.max_blocks == (700 - 400) * MIB // per_block
    assert 0 < plan.max_blocks < 30
    # bfloat16 halves both sizes
    half = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, 700 * MIB)
    assert half.block_bytes[0] * 2 == plan.block_bytes[0]
    assert half.kv_bytes_per_block_token * 2 == plan.kv_bytes_per_block_token
    # the whole model does not fit 700 MiB in float32; a range of max_blocks does, with its cache
    with pytest.raises(OfferTooSmallError):
        plan.cache_tokens(0, 30)
    tokens = plan.cache_tokens(0, plan.max_blocks)
    assert tokens >= MIN_CACHE_TOKENS
    assert plan.overhead + plan.span_weight_bytes(0, plan.max_blocks) + plan.cache_bytes(
        0, plan.max_blocks, tokens) <= plan.offer


def test_quantized_blocks_are_planned_at_their_quantized_size(model_dir):
    """Records and capacities use the quantized size: the weights of an int8 block take about half of their
    bfloat16 bytes (int4 about a quarter), counted from the headers alone."""
    checkpoint = Checkpoint(model_dir)
    offer = 700 * MIB
    bf16 = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, offer)
    int8 = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, offer, quantization="int8")
    int4 = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, offer, quantization="int4")
    assert 0.5 < int8.block_size / bf16.block_size < 0.53
    assert 0.25 < int4.block_size / bf16.block_size < 0.33  # 4 bits + a scale and a zero per 32
    assert int8.kv_bytes_per_block_token == bf16.kv_bytes_per_block_token  # the KV cache keeps the node's dtype


def test_an_offer_holds_about_twice_as_many_int8_blocks_of_a_70b_model():
    """Llama-2-70B's block shapes (plain numbers, no checkpoint): a 40 GiB offer holds about twice as many int8
    blocks as bfloat16 ones, KV room for MIN_CACHE_TOKENS per block included."""
    from transformers import LlamaConfig

    from swarmnode.runtime.family import ModelFamily
    from swarmnode.runtime.quantize import block_bytes

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=32000)
    family = ModelFamily(config)
    assert family.kv_bytes_per_token(torch.bfloat16) == 2 * 8 * 128 * 2

    def plan(mode: str) -> MemoryPlan:
        size = block_bytes(family.new_layer(0), mode, torch.bfloat16)  # a meta-device layer: no memory
        return MemoryPlan(offer=40 * 2**30, block_bytes=(size,) * 80,
                          kv_bytes_per_block_token=family.kv_bytes_per_token(torch.bfloat16))

    bf16, int8 = plan("none"), plan("int8")
    assert bf16.block_size == 2 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672 + 2 * 8192)  # q, o; k, v; MLP
    assert 1.9 <= int8.max_blocks / bf16.max_blocks <= 2.1, (bf16.max_blocks, int8.max_blocks)  # 49 vs 24
