"""Which kind of checkpoint a `--model` names: a Hugging Face checkpoint or a GGUF file.

`open_checkpoint` is what the CLI, nodes, clients and the coordinator call: a folder or a Hub name `org/name` opens
a `runtime.checkpoint.Checkpoint` (safetensors), a `.gguf` file or a Hub file `org/name:FILE.gguf` a
`runtime.ggml.checkpoint.GGUFCheckpoint`, which serves the file's tensors as they are stored.
"""

from __future__ import annotations

from pathlib import Path

from swarmnode.runtime.checkpoint import Checkpoint

__all__ = ["open_checkpoint"]


def open_checkpoint(source: str | Path, *, model_name: str | None = None) -> Checkpoint:
    """The checkpoint `source` names (see the module docstring); `CheckpointError` when it names none."""
    from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint, is_gguf_source

    if is_gguf_source(source):
        return GGUFCheckpoint(source, model_name=model_name)
    return Checkpoint(source, model_name=model_name)
