"""A GGUF file as a whole local `transformers` model, computing with the same kernels as a node that serves it.

The reference a GGUF swarm is held to: `transformers`' own causal-LM class for the file's architecture, every
matrix kept in its ggml block format (`weights.GGMLLinear`, `weights.GGMLEmbedding`) exactly as nodes and clients
keep theirs, so `generate()` here and through a swarm of GGUF nodes run the same arithmetic. (`transformers`' own
GGUF loader dequantizes every tensor to float, which is a different computation: the float32 checkpoint
de-quantized from the same file.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from swarmnode.runtime.checkpoint_files import CheckpointError
from swarmnode.runtime.ggml import decode_step
from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint
from swarmnode.runtime.ggml.weights import GGMLWeight, install

__all__ = ["load_gguf_model"]


def load_gguf_model(source: str | Path | GGUFCheckpoint, dtype: torch.dtype = torch.float32):
    """The model of GGUF file `source` (a path, `org/name:FILE.gguf`, or an opened checkpoint), evaluation mode,
    its matrices as stored and its vectors in `dtype`."""
    from transformers import AutoModelForCausalLM

    checkpoint = source if isinstance(source, GGUFCheckpoint) else GGUFCheckpoint(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=dtype)
    for name, read in checkpoint.lazy_tensors(""):
        value = read(dtype)
        module_name, _, attr = name.rpartition(".")
        if isinstance(value, GGMLWeight):
            install(model, module_name, value, dtype)
            continue
        module = model.get_submodule(module_name)
        if attr not in module._parameters:
            raise CheckpointError(f"{name} of {checkpoint.file.path.name} has no place in the model")
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    checkpoint.family.initialise_buffers(model, torch.device("cpu"))
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise CheckpointError(f"{checkpoint.file.path.name} does not hold {missing[:4]}")
    for layer in model.model.layers:  # the decode step nodes take (`decode_step`), so both compute the same bits
        decode_step.attach(layer)
    return model.eval().requires_grad_(False)
