"""Proof, before a node serves or a client generates, that this project's path through a family is `transformers`'.

The path is this project's own composition of the library's parts: blocks built from the family's layer classes
with checkpoint tensors converted tensor by tensor (`runtime.blocks`, `runtime.conversion`), attention masks,
rotary embeddings and per-session caches of this project's making (`runtime.kv_cache`), and the model's two ends
around remote blocks (`runtime.model_ends`). Any of them can be wrong for a family in a way no error shows (a
cache write of another shape, an embedding scale left out), and a swarm that answers wrongly is worse than one
that refuses. So :func:`check_family` builds a tiny random model of the same config (the same classes, a few
layers, small widths: well under a second on a CPU), stores it in the checkpoint format with the library's own
reverse conversion, runs a padded prompt and cached decode steps through this project's path, and compares the
logits with the library's own full-model forward. A difference beyond :data:`TOLERANCE` of the logits' scale
raises :class:`FamilyMismatchError`, one line naming the family and the difference.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from functools import cached_property

import torch

from swarmnode.runtime.family import FamilyError, ModelFamily, one_line

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "FamilyCheck", "FamilyMismatchError", "MemoryCheckpoint", "check_family", "tiny_config_like"]

#: Largest difference allowed between this project's logits and transformers', relative to the largest logit, in
#: float32 (where the two paths agree to about 1e-6).
TOLERANCE = 1e-3
# Layers of the tiny model (more when the family's first dense blocks need them to reach a block of each kind).
_TINY_LAYERS = 4
# Tiny widths, for the config attributes that set a model's widths; every other attribute keeps its value.
_TINY_WIDTHS = {
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4, "head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 256, "query_pre_attn_scalar": 16,
}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# Largest model the check builds at a config's own widths (few layers), when its widths cannot shrink.
_FULL_WIDTH_LIMIT = 300_000_000
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


class FamilyMismatchError(FamilyError):
    """This project's path through a family does not give `transformers`' logits: nothing of it is served."""

    code = "family_mismatch"


@dataclass(frozen=True)
class FamilyCheck:
    """A passed check: the family, the largest relative difference seen, and how long it took."""

    family: str
    difference: float
    seconds: float


class MemoryCheckpoint:
    """A model held in memory in the checkpoint format (`weight source` of `runtime.blocks.WeightSource`)."""

    def __init__(self, config, state: dict[str, torch.Tensor]):
        self.config = config
        self.state = state
        self.name = f"tiny-{config.model_type}"

    @cached_property
    def family(self) -> ModelFamily:
        return ModelFamily(self.config)

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def block_prefix(self, index: int) -> str:
        return f"{self.family.base_prefix}.layers.{index}."

    def lazy_tensors(self, prefix: str, device: str = "cpu", *, copy: bool = True):
        def reader(tensor):
            def read(dtype=None):
                cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                return tensor.to(device=device, dtype=cast, copy=True)
            return read

        return [(name, reader(tensor)) for name, tensor in self.state.items() if name.startswith(prefix)]


def tiny_config_like(config, num_layers: int = _TINY_LAYERS, *, widths: bool = True):
    """A copy of `config` with few layers and (with `widths`) small widths: the same model classes and options
    (attention kind, windows, soft-caps, experts, latent attention) at a size that runs in milliseconds."""
    tiny = copy.deepcopy(config)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    layers = min(int(config.num_hidden_layers), max(num_layers, min(first_dense, 1) + 2))
    if not widths:
        tiny.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            tiny.layer_types = list(config.layer_types[:layers])
        if first_dense:
            tiny.first_k_dense_replace = 1
        return tiny
    for name, value in _TINY_WIDTHS.items():
        if getattr(tiny, name, None) is not None:
            setattr(tiny, name, value)
    heads, kv_heads = int(config.num_attention_heads), getattr(config, "num_key_value_heads", None)
    if kv_heads is not None:
        tiny.num_key_value_heads = 4 if kv_heads >= heads else 1 if kv_heads == 1 else 2
    if getattr(config, "qk_rope_head_dim", None) is not None and getattr(config, "head_dim", None) is not None:
        tiny.head_dim = tiny.qk_rope_head_dim  # latent attention: the rotary part is the "head" size
    for name in _EXPERT_COUNTS:
        if getattr(config, name, None):
            setattr(tiny, name, min(int(getattr(config, name)), 8))
    if getattr(config, "num_experts_per_tok", None):
        tiny.num_experts_per_tok = min(int(config.num_experts_per_tok), 2)
    if getattr(config, "n_group", None):
        tiny.n_group = min(int(config.n_group), 2)
        tiny.topk_group = min(int(getattr(config, "topk_group", 1) or 1), tiny.n_group)
    if first_dense:
        tiny.first_k_dense_replace = 1
    if getattr(config, "mlp_only_layers", None):
        tiny.mlp_only_layers = [i for i in config.mlp_only_layers if i < layers]
    if getattr(config, "sliding_window", None):
        tiny.sliding_window = 4  # shorter than the check's prompt, so that windows matter
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kept = list(layer_types[:layers])
        for kind in dict.fromkeys(layer_types):  # every kind the model has, in the tiny one too
            if kind not in kept:
                kept[-1] = kind
        tiny.layer_types = kept
    tiny.num_hidden_layers = layers
    for name in _TOKEN_IDS:
        token_ids = getattr(tiny, name, None)
        if isinstance(token_ids, int) and token_ids >= tiny.vocab_size:
            setattr(tiny, name, tiny.vocab_size - 1)
        elif isinstance(token_ids, list):
            setattr(tiny, name, [v for v in token_ids if v < tiny.vocab_size] or None)
    return tiny


_PASSED: dict[str, FamilyCheck] = {}


def check_family(config) -> FamilyCheck:
    """Check this project's path through the family of `config` against transformers' forward (see the module
    docstring); once per config in a process. Raises :class:`FamilyMismatchError` (or :class:`FamilyError` for a
    family that cannot be served at all)."""
    key = config.to_json_string(use_diff=False)
    if key in _PASSED:
        return _PASSED[key]
    ModelFamily(copy.deepcopy(config))  # a family refused outright says why before anything is built
    began = time.perf_counter()
    differences = []
    for seed in (0, 1):  # a near tie in an MoE router may flip on rounding alone: a real fault fails both seeds
        differences.append(_difference(config, seed))
        if differences[-1] <= TOLERANCE:
            break
    difference = min(differences)
    name = str(getattr(config, "model_type", type(config).__name__))
    if difference > TOLERANCE:
        raise FamilyMismatchError(
            f"{name}: this project's path through the model differs from transformers' own forward by "
            f"{difference:.2g} of the logits' scale on a tiny random model of the same config (tolerance "
            f"{TOLERANCE:g}), so it is not served; report the family and the transformers version")
    check = FamilyCheck(name, difference, time.perf_counter() - began)
    logger.info("%s: the node's and client's path through the model equals transformers' forward on a tiny random "
                "model of its config (difference %.1e, checked in %.2f s)", name, difference, check.seconds)
    _PASSED[key] = check
    return check


def _tiny_model(config):
    """A tiny random float32 model of `config`'s family: small widths, or, for a config whose widths this module
    cannot shrink consistently, its own widths with few layers when that stays under :data:`_FULL_WIDTH_LIMIT`
    parameters."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(tiny_config_like(config), dtype=torch.float32).eval()
        with torch.inference_mode():
            model(torch.zeros(1, 2, dtype=torch.long))  # widths that build may still not run together
        return model
    except Exception as exc:
        failure = exc
    few_layers = tiny_config_like(config, widths=False)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(few_layers).parameters())
    if size > _FULL_WIDTH_LIMIT:
        raise FamilyMismatchError(f"{config.model_type}: cannot build a small model of this config to check the "
                                  f"family with ({one_line(failure)})")
    return AutoModelForCausalLM.from_config(few_layers, dtype=torch.float32).eval()


@torch.inference_mode()
def _difference(config, seed: int) -> float:
    """Largest |ours - transformers'| over the real tokens of a padded prompt and two cached decode steps, relative
    to the largest logit."""
    from transformers.core_model_loading import revert_weight_conversion

    from swarmnode.runtime.blocks import BlockStack
    from swarmnode.runtime.model_ends import ModelEnds

    torch.manual_seed(seed)
    model = _tiny_model(config)
    tiny = model.config
    for param in model.parameters():
        param.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed + param.numel()))
    state = revert_weight_conversion(model, {k: v for k, v in model.state_dict().items()})
    source = MemoryCheckpoint(model.config, state)
    layers = source.num_blocks
    stack = BlockStack(source, 0, layers)
    ends = ModelEnds(source)
    generator = torch.Generator().manual_seed(seed)
    vocab = int(tiny.vocab_size)
    ids = torch.randint(3, vocab, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    cache = stack.new_session_cache(0, layers, 2, 16)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ours = ends.logits(lambda h: stack.step([cache], 0, layers, h, positions, mask.bool()), input_ids=ids,
                       position_ids=positions)
    truth = model(ids, attention_mask=mask).logits
    worst = (ours - truth)[mask.bool()].abs().max()
    scale = truth[mask.bool()].abs().max()
    for _ in range(2):
        new = torch.randint(3, vocab, (2, 1), generator=generator)
        ids, mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        position = (mask.cumsum(-1) - 1)[:, -1:]
        def blocks(h: torch.Tensor, p: torch.Tensor = position) -> torch.Tensor:
            return stack.step([cache], 0, layers, h, p, torch.ones(2, 1, dtype=torch.bool))

        step = ends.logits(blocks, input_ids=new, position_ids=position)
        full = model(ids, attention_mask=mask).logits[:, -1:]
        worst = torch.maximum(worst, (step - full).abs().max())
        scale = torch.maximum(scale, full.abs().max())
    return float(worst / scale.clamp(min=1e-6)) if torch.isfinite(worst) else float("inf")
