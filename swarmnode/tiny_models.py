"""Tiny random-weight checkpoints of every supported model family (and of refused ones).

For users, `swarmnode prepare-model --tiny FAMILY --out DIR` makes one, to try a family's whole path through
a swarm (nodes, routing, the client's ends) in seconds and without downloading its weights. For the tests,
each family needs a real checkpoint that loads in well under a second: these are built from
small configs (hidden size 64, 4 heads, 2 KV heads, a few experts) with random weights and saved with
`save_pretrained` in many small shards, so that a node reads only the shards of its blocks exactly as it does
for a real model, and in the layout the Hub uses (`transformers` writes mixtures of experts back one tensor per
expert, as Qwen3-MoE and Mixtral checkpoints store them). Their outputs mean nothing; tests compare the swarm
with local `transformers` on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from swarmnode.errors import SwarmError
from swarmnode.model_prep import is_prepared, mark_prepared

__all__ = ["TINY_FAMILIES", "TINY_MOE_FAMILIES", "TINY_REFUSED_FAMILIES", "UnknownFamilyError", "make_tiny_checkpoint",
           "tiny_config"]

#: Families with a tiny checkpoint, each exercising something of its own: Mistral's sliding window, Qwen3's head
#: size, mixtures of experts (Qwen3-MoE per-expert checkpoint tensors, Mixtral's renamed ones, gpt-oss' fused
#: experts with biases, attention sinks and alternating sliding layers), DeepSeek V3's latent attention and dense
#: first block, Gemma 2's eager soft-capped attention and scaled embeddings, Gemma 3's per-layer-type rotary
#: embeddings, Granite's embedding and logit multipliers, Phi-3's fused projections, OLMo 2's norms.
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "gemma2",
                 "gemma3_text", "granite", "phi3", "olmo2")
#: The mixture-of-experts families among them.
TINY_MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
#: Families refused with one line (their layers keep recurrent state), with a tiny config each for tests.
TINY_REFUSED_FAMILIES = ("qwen3_next", "jamba", "falcon_h1", "minimax")

# Sizes every family shares; widths are multiples of 32 so that int8 and int4 kernels take every matrix.
_COMMON: dict[str, object] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# What each family sets beside them (small windows, so that tests of 24 tokens cross them).
_FAMILY: dict[str, dict[str, object]] = {
    "mistral": dict(sliding_window=16),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, head_dim=16, num_key_value_heads=4),
    "gemma2": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    "granite": dict(embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.25),
    "qwen3_next": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "jamba": dict(num_experts=2, num_experts_per_tok=1),
    "falcon_h1": dict(head_dim=16),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2),
}


class UnknownFamilyError(SwarmError, ValueError):
    """A tiny checkpoint of a family this module does not know was asked for."""

    code = "unknown_family"


def tiny_config(family: str, num_layers: int = 6):
    """A small config of `family` (hidden 64, 4 heads, 2 KV heads, a few experts) for architecture tests."""
    from transformers import AutoConfig

    known = (*TINY_FAMILIES, *TINY_REFUSED_FAMILIES)
    if family not in known:
        raise UnknownFamilyError(f"unknown tiny family {family!r}; choose one of {', '.join(known)}")
    settings: dict[str, object] = {**_COMMON, "num_hidden_layers": num_layers, **_FAMILY.get(family, {})}
    if "layer_types" in settings:
        settings["layer_types"] = list(cast(list[str], settings["layer_types"]))[:num_layers]
    return AutoConfig.for_model(family, **settings)


def make_tiny_checkpoint(family: str, out_dir: Path, seed: int = 0, num_layers: int = 6) -> Path:
    """Write a random-weight checkpoint of `family` with several shards into `out_dir` and return it (once:
    a folder already made is returned as it is)."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if is_prepared(out_dir):
        return out_dir
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir, max_shard_size="60KB")
    mark_prepared(out_dir, f"tiny {family} seed={seed}")
    return out_dir
