"""Model families in one process: blocks and ends of every family against local `transformers`, the refusals, the
family check, latent attention's cache, blocks of different sizes and quantized experts.

The swarm-level proof (two real nodes per family) is `test_swarm_architectures.py`; these tests pin each part
on its own: what `runtime.family` reads from transformers, how `runtime.conversion` loads per-expert checkpoint
tensors, what `runtime.family_check` accepts and refuses, and what `runtime.quantize` does to experts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.family import FamilyError, LayerCache, ModelFamily
from swarmnode.runtime.family_check import FamilyMismatchError, check_family
from swarmnode.runtime.model_ends import ModelEnds
from swarmnode.runtime.quantize import QuantizedExperts, check_supported, quantize_block
from swarmnode.server.memory_plan import MemoryPlan
from swarmnode.tiny_models import (
    TINY_FAMILIES,
    TINY_MOE_FAMILIES,
    TINY_REFUSED_FAMILIES,
    make_tiny_checkpoint,
    tiny_config,
)

# Published configs of the models users name, at full size (only meta-device layers are built from them).
REAL_CONFIGS = {
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, vocab_size=201088, sliding_window=128)),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936)),
    "DeepSeek-V3": ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
                                        topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
                                        vocab_size=129280)),
    "Mixtral-8x7B": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000)),
}


def _real(name: str):
    model_type, settings = REAL_CONFIGS[name]
    return AutoConfig.for_model(model_type, **settings)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-models")
    return {family: make_tiny_checkpoint(family, root / family, seed=10 + i) for i, family in enumerate(TINY_FAMILIES)}


def _ours(checkpoint, dtype=torch.float32, quantization="none"):
    """Prefill of a left-padded batch and two cached decode steps through this project's blocks and ends; returns
    the logits of each step with the (input ids, attention mask) they were computed for."""
    blocks = checkpoint.num_blocks
    stack = BlockStack(checkpoint, 0, blocks, dtype=dtype, quantization=quantization)
    ends = ModelEnds(checkpoint, dtype)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (2, 24), generator=generator)  # longer than every tiny family's window
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    cache = stack.new_session_cache(0, blocks, 2, 32)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = [(ends.logits(lambda h: stack.step([cache], 0, blocks, h, positions, mask.bool()), input_ids=ids,
                          position_ids=positions), ids, mask)]
    for _ in range(2):
        new = torch.randint(3, 500, (2, 1), generator=generator)
        ids, mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        position = (mask.cumsum(-1) - 1)[:, -1:]
        logits = ends.logits(lambda h, p=position: stack.step([cache], 0, blocks, h, p, torch.ones(2, 1).bool()),
                             input_ids=new, position_ids=position)
        steps.append((logits, ids, mask))
    return steps


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_blocks_and_ends_equal_local_transformers(tiny_models, family):
    checkpoint = Checkpoint(tiny_models[family])
    local = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32).eval()
    for i, (logits, ids, mask) in enumerate(_ours(checkpoint)):
        with torch.no_grad():
            truth = local(ids, attention_mask=mask).logits
        if i:
            truth = truth[:, -1:]
        else:
            logits, truth = logits[mask.bool()], truth[mask.bool()]
        torch.testing.assert_close(logits, truth, atol=1e-4, rtol=0)


def test_attention_implementation_is_the_one_transformers_picks():
    picked = {f: ModelFamily(tiny_config(f)).attn_implementation for f in ("gpt_oss", "gemma2", "llama", "qwen3_moe")}
    assert picked == {"gpt_oss": "eager", "gemma2": "eager", "llama": "sdpa", "qwen3_moe": "sdpa"}


@pytest.mark.parametrize("family", TINY_REFUSED_FAMILIES)
def test_recurrent_families_are_refused_in_one_line(family):
    with pytest.raises(FamilyError) as info:
        ModelFamily(tiny_config(family))
    message = str(info.value)
    assert message.startswith(f"{family} cannot be served: its layer ") and "\n" not in message
    assert "state" in message and info.value.code == "unsupported_family"


def test_a_pre_quantized_checkpoint_is_refused_in_one_line():
    """gpt-oss' own Hub checkpoints store experts in MXFP4 and DeepSeek V3's in FP8: refused, with what to do."""
    model_type, settings = REAL_CONFIGS["gpt-oss-20b"]
    config = AutoConfig.for_model(model_type, **settings, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(FamilyError, match=r"^gpt_oss cannot be served from this checkpoint: its weights are stored "
                                          r"pre-quantized \(mxfp4\); serve a bfloat16"):
        ModelFamily(config)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_the_check_passes_for_real_configs_of_the_models_users_name(name):
    check = check_family(_real(name))
    assert check.difference < 1e-5 and check.seconds < 10


def test_the_check_refuses_a_path_that_differs_from_transformers(monkeypatch):
    """A node whose masks ignore padding and sliding windows (the kind of fault no exception shows) is caught and
    named with the size of the difference, in one line."""
    from swarmnode.runtime import family_check

    config = tiny_config("gemma2")
    config.sliding_window = 6  # a fresh config: not among those checked already in this process
    monkeypatch.setattr(BlockStack, "_mask", lambda self, caches, n, window: None if n == 1 else _causal(n))
    with pytest.raises(FamilyMismatchError) as info:
        family_check.check_family(config)
    message = str(info.value)
    assert message.startswith("gemma2: this project's path through the model differs from transformers' own "
                              "forward by ") and "\n" not in message
    difference = float(message.split(" by ")[1].split(" ")[0])
    assert difference > family_check.TOLERANCE and info.value.code == "family_mismatch"


def test_a_config_whose_widths_do_not_shrink_is_checked_at_its_own_widths(monkeypatch):
    """A family with a width the check does not know how to shrink consistently (here: heads that do not divide
    the hidden size) is checked with few layers at its own widths rather than refused."""
    from transformers import LlamaConfig

    from swarmnode.runtime import family_check

    monkeypatch.setitem(family_check._TINY_WIDTHS, "num_attention_heads", 5)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=8, vocab_size=300)
    model = family_check._tiny_model(config)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (256, 4)
    assert family_check.check_family(config).difference < 1e-5


def _causal(n: int) -> torch.Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]


def test_latent_attention_caches_its_compressed_latent():
    """DeepSeek V3 keeps one 512-wide latent and one 64-wide rotary key per token (transformers' own cache), 1/71
    of keys and values for its 128 heads; the node's KV accounting uses that."""
    family = ModelFamily(_real("DeepSeek-V3"))
    assert set(family.layer_caches) == {LayerCache(1, 512, 1, 64)}
    assert family.kv_bytes_per_token(torch.bfloat16) == (512 + 64) * 2
    assert family.kv_bytes_per_token(torch.bfloat16) * 71 < 2 * 128 * (128 + 64) * 2


def test_blocks_of_different_sizes_are_planned_with_their_own_bytes(tiny_models):
    """DeepSeek's dense first block is smaller than its MoE blocks: the plan holds each block's own bytes, counts
    capacity with the largest, and gives a range of small blocks more cache."""
    checkpoint = Checkpoint(tiny_models["deepseek_v3"])
    plan = MemoryPlan.from_checkpoint(checkpoint, torch.float32, 64 * 2**20, overhead=0)
    assert plan.block_bytes[0] < plan.block_bytes[1] == plan.block_size == max(plan.block_bytes)
    stack = BlockStack(checkpoint, 0, 2)
    for index in (0, 1):
        held = sum(t.numel() * t.element_size() for t in [*stack.layers[index].parameters(),
                                                           *stack.layers[index].buffers()])
        assert held == plan.block_bytes[index]
    assert plan.cache_tokens(0, 1) > plan.cache_tokens(1, 2)


def test_per_expert_checkpoints_load_from_their_own_shards(tiny_models):
    """Qwen3-MoE checkpoints store one tensor per expert and projection; a node reads only its blocks' shards and
    holds the experts fused, as transformers does."""
    checkpoint = Checkpoint(tiny_models["qwen3_moe"])
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in checkpoint.weight_map)
    stack = BlockStack(checkpoint, 2, 4)
    experts = stack.layers[2].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)
    held = {shard for name, shard in checkpoint.weight_map.items() if name.startswith(("model.layers.2.",
                                                                                        "model.layers.3."))}
    assert checkpoint.opened_shards == held


@pytest.fixture(scope="module")
def bf16_locals(tiny_models):
    return {f: AutoModelForCausalLM.from_pretrained(tiny_models[f], dtype=torch.bfloat16).eval()
            for f in TINY_MOE_FAMILIES}


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", TINY_MOE_FAMILIES)
def test_quantized_experts(tiny_models, bf16_locals, family, mode):
    """Experts are quantized too: a node's blocks equal local transformers quantized the same way, hold what the
    plan says (int8 about half of bfloat16, int4 about a third), and stay close to bfloat16."""
    checkpoint = Checkpoint(tiny_models[family])
    check_supported(checkpoint.family, mode)
    local = copy.deepcopy(bf16_locals[family])
    for layer in local.model.layers:
        quantize_block(layer, mode, torch.bfloat16)
    assert any(isinstance(m, QuantizedExperts) for m in local.modules())
    # an unpadded prompt in one step runs the same kernels on the same shapes: the logits are bit for bit equal
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(5))
    stack = BlockStack(checkpoint, 0, checkpoint.num_blocks, dtype=torch.bfloat16, quantization=mode)
    cache = stack.new_session_cache(0, checkpoint.num_blocks, 1, 20)
    positions = torch.arange(20)[None]
    ours = ModelEnds(checkpoint, torch.bfloat16).logits(
        lambda h: stack.step([cache], 0, checkpoint.num_blocks, h, positions, torch.ones(1, 20).bool()),
        input_ids=ids, position_ids=positions)
    with torch.no_grad():
        assert torch.equal(ours, local(ids).logits)
    # padding and cached decoding round differently in bfloat16 than a full recompute (and a router may then pick
    # another expert for a token): close on average, and near bfloat16
    for i, (logits, ids, mask) in enumerate(_ours(checkpoint, torch.bfloat16, mode)):
        with torch.no_grad():
            truth = local(ids, attention_mask=mask).logits
            full = bf16_locals[family](ids, attention_mask=mask).logits
        if i:
            truth, full = truth[:, -1:], full[:, -1:]
        else:
            logits, truth, full = logits[mask.bool()], truth[mask.bool()], full[mask.bool()]
        same = torch.nn.functional.cosine_similarity(logits.float(), truth.float(), dim=-1).mean()
        assert same > 0.995, float(same)
        cosine = torch.nn.functional.cosine_similarity(logits.float(), full.float(), dim=-1).mean()
        assert cosine > (0.99 if mode == "int8" else 0.85), float(cosine)
    none = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, 2**30)
    plan = MemoryPlan.from_checkpoint(checkpoint, torch.bfloat16, 2**30, quantization=mode)
    stack = BlockStack(checkpoint, 1, 3, dtype=torch.bfloat16, quantization=mode)
    held = sum(t.numel() * t.element_size() for layer in stack.layers.values()
               for t in [*layer.parameters(), *layer.buffers()])
    assert held == plan.span_weight_bytes(1, 3)
    ratio = plan.block_size / none.block_size
    assert (0.5 < ratio < 0.56) if mode == "int8" else (0.3 < ratio < 0.36), ratio
