"""The two ends of a model around its blocks: what a client computes itself, with the family's own code.

A client holds no decoder block, only what comes before the first and after the last: the token embeddings and
any scaling the family applies to them (Gemma's sqrt(hidden), Granite's embedding multiplier), then the final
norm, the LM head and what the family does to logits (Gemma 2's soft-capping, Granite's and Cohere's logit
scales). Rather than copying those rules, :class:`ModelEnds` runs the family's own causal-LM class with its
decoder layers replaced by one stand-in: the first layer's place hands the hidden states to a callable (the
swarm, or a local `BlockStack` in the family check) and takes back the last block's output; the others pass it
through. Everything else in the forward is the library's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from swarmnode.runtime.blocks import WeightSource
from swarmnode.runtime.checkpoint import CheckpointError
from swarmnode.runtime.decode_linear import use_decode_linears
from swarmnode.runtime.ggml.weights import GGMLWeight
from swarmnode.runtime.ggml.weights import install as install_ggml

__all__ = ["Blocks", "ModelEnds"]

#: What runs the decoder blocks: hidden states (batch, tokens, hidden) in, the last block's output out.
Blocks = Callable[[torch.Tensor], torch.Tensor]


class _BlocksInPlace(torch.nn.Module):
    """Stands in for decoder layer `index`: the first one runs every block through the current `Blocks`; the
    others return their input (the blocks already ran)."""

    def __init__(self, index: int, ends: ModelEnds):
        super().__init__()
        self.index = index
        self._ends = [ends]  # a plain list: not a submodule

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.index:
            return hidden_states
        return self._ends[0]._run_blocks(hidden_states)


class _Captured(Exception):
    """Raised by `ModelEnds.hidden_in` to carry the first block's input out of the model (a signal, not an error)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("captured")
        self.hidden = hidden


class ModelEnds:
    """The family's causal LM from `source` (embeddings, final norm, head and whatever else lies outside
    `model.layers`, loaded and converted as `from_pretrained` would) in `dtype`, with its blocks run elsewhere."""

    def __init__(self, source: WeightSource, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        family = source.family
        self.family, self.dtype = family, dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source.config)
        base = getattr(model, family.base_prefix)
        base.layers = torch.nn.ModuleList(_BlocksInPlace(i, self) for i in range(family.num_layers))
        self.model = model
        self._local = threading.local()
        layers = f"{family.base_prefix}.layers."
        prefix = source.block_prefix(0).rpartition(".layers.")[0] + ".layers."
        sources = [(name, read) for name, read in source.lazy_tensors("") if not name.startswith(prefix)]
        for name, tensor in family.conversion.convert(sources, dtype):
            if name.startswith(layers):
                raise CheckpointError(f"the checkpoint's {name} lies inside the blocks, not in the model's ends")
            module_name, _, attr = name.rpartition(".")
            if isinstance(tensor, GGMLWeight):  # a GGUF matrix, served in its stored form (`runtime.ggml.weights`)
                install_ggml(model, module_name, tensor, dtype)
                continue
            module = model.get_submodule(module_name)
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
        if any(p.is_meta for p in model.parameters()) and getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        family.initialise_buffers(model, torch.device("cpu"))
        missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if missing:
            raise CheckpointError(f"the checkpoint does not hold {missing[:4]}, which the model's ends need")
        model.eval().requires_grad_(False)
        use_decode_linears(model)  # a bfloat16 head reads at memory speed, the same bits (`runtime.decode_linear`)

    # --- the parts, for callers that need them ---------------------------------------------------------
    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    # --- running -------------------------------------------------------------------------------------
    def _run_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        blocks = getattr(self._local, "blocks", None)
        if blocks is None:
            raise RuntimeError("ModelEnds ran its blocks outside of logits()")
        out = blocks(hidden)
        return out.to(hidden.dtype)

    @torch.no_grad()
    def hidden_in(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states the family's model gives its first block for `input_ids` at `position_ids` (what
        `logits` hands `blocks`), for a caller that sends them on and takes the logits later
        (`logits(lambda _: output, ...)`)."""

        def capture(hidden: torch.Tensor) -> torch.Tensor:
            raise _Captured(hidden)

        try:
            self.logits(capture, input_ids=input_ids, position_ids=position_ids, logits_to_keep=1)
        except _Captured as captured:
            return captured.hidden
        raise RuntimeError(f"{type(self.model).__name__} never reached its first block")

    # no_grad, not inference_mode: generation edits the logits in place (assisted generation's processors)
    @torch.no_grad()
    def logits(self, blocks: Blocks, *, input_ids: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor,
               logits_to_keep: int = 0) -> torch.Tensor:
        """Logits of the new tokens (`input_ids` or `inputs_embeds`, at `position_ids`), their hidden states run
        through the decoder blocks by `blocks`; `logits_to_keep` > 0 keeps the last ones only, as transformers'
        forward does. Padding is the blocks' business (their caches know which tokens are real)."""
        self._local.blocks = blocks
        try:
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                             attention_mask=None, use_cache=False, logits_to_keep=logits_to_keep)
        finally:
            self._local.blocks = None
        return out.logits
