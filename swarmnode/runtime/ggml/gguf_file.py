"""A GGUF file (llama.cpp's format): its metadata, its tensor table, and any one tensor's bytes.

The header is parsed once with the `gguf` package's reader (llama.cpp's own Python reader), which gives every
tensor's name, ggml type, shape and offset; the reader's memory map is then dropped, and a tensor is read later
with one positioned read of its bytes into the node's memory. So a node reads only its blocks' tensors, holds no
mapping of the file while it serves (the file's pages are not counted against its offer), and keeps each tensor in
the form the file stores it.

Names. llama.cpp renames a model's tensors (`blk.3.attn_q.weight` for `model.layers.3.self_attn.q_proj.weight`)
and, for the `llama` architecture, permutes the rows of the query and key projections so that its rotary
embedding can rotate neighbouring pairs (`convert_hf_to_gguf.py`, `LlamaModel.permute`). :func:`hf_name` maps the
names back and :func:`unpermute_rows` undoes the permutation on whole rows, which for a quantized tensor are
rows of ggml blocks, so no value is touched.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmnode.runtime.checkpoint_files import CheckpointError
from swarmnode.runtime.ggml.formats import FORMATS, GGMLType, UnsupportedFormatError, tensor_bytes

__all__ = ["SERVED_ARCHITECTURES", "GGUFError", "GGUFFile", "GGUFTensor", "hf_name", "unpermute_rows"]

#: GGUF architectures served, with the tensors of each block (llama.cpp's names -> `transformers`' names). Mistral
#: and SmolLM2 files are `llama` too. Others are refused with a line that says so; their safetensors checkpoints
#: are served.
SERVED_ARCHITECTURES = ("llama",)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_END_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors a llama file may carry that the model computes itself (Llama 3.1's rope frequencies come from the config).
_DERIVED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
#: Rows of these projections are permuted by llama.cpp's converter for `llama` files (number of heads from the
#: config: attention heads for the query, key/value heads for the key).
PERMUTED = {"self_attn.q_proj.weight": "num_attention_heads", "self_attn.k_proj.weight": "num_key_value_heads"}
_MAGIC = b"GGUF"


class GGUFError(CheckpointError):
    """A GGUF file that cannot be served: unreadable, an architecture or tensor type not served, or tensors that
    do not match its metadata. The message says what and what to do."""

    code = "bad_gguf"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its llama.cpp name, ggml type, shape in torch's order (rows first) and where its
    bytes lie."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def hf_name(name: str) -> str | None:
    """The `transformers` name of llama.cpp tensor `name` (llama architecture), None for one the model derives
    itself; a `GGUFError` for a tensor this project has no place for."""
    if name in _END_NAMES:
        return _END_NAMES[name]
    if name in _DERIVED:
        return None
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise GGUFError(f"the GGUF file has a tensor {name!r} that a llama model has no place for: is it another "
                    f"architecture written as llama?")


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection in `transformers`' order, from llama.cpp's permuted order (the inverse
    of `LlamaModel.permute`: within each head, row 2j+s of the file is row s*(d/2)+j of the model)."""
    count = rows.shape[0]
    if heads <= 0 or count % (2 * heads):
        raise GGUFError(f"a projection of {count} rows cannot be split into {heads} heads of rotary pairs: the "
                        f"file's head count does not match its tensors")
    index = torch.arange(count).reshape(heads, count // heads // 2, 2).transpose(1, 2).reshape(-1)
    return rows[index].contiguous()


class GGUFFile:
    """The metadata and tensor table of the GGUF file at `path` (read once; see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise GGUFError(f"cannot read {self.path}: {exc}") from None
        if magic != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with 'GGUF'): pass a .gguf file "
                            f"from llama.cpp's converter, or a Hugging Face checkpoint folder")
        from gguf import GGUFReader

        try:
            reader = GGUFReader(self.path, "r")
        except (ValueError, OSError, KeyError, IndexError) as exc:
            raise GGUFError(f"{self.path} is not a readable GGUF file ({exc}): is it complete?") from None
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
                continue  # long arrays; `transformers` reads the tokenizer itself
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError, TypeError):
                continue
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self.tensors: dict[str, GGUFTensor] = {}
        size = self.path.stat().st_size
        unsupported: dict[str, list[str]] = {}
        for tensor in reader.tensors:
            shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
            try:
                kind = GGMLType(int(tensor.tensor_type))
            except ValueError:
                unsupported.setdefault(tensor.tensor_type.name, []).append(tensor.name)
                continue
            if kind not in FORMATS:
                unsupported.setdefault(kind.name, []).append(tensor.name)
                continue
            try:
                nbytes = tensor_bytes(kind, shape)
            except UnsupportedFormatError as exc:
                raise GGUFError(f"{self.path}: tensor {tensor.name}: {exc}") from None
            offset = int(tensor.data_offset)
            if offset + nbytes > size:
                raise GGUFError(f"{self.path} is truncated: tensor {tensor.name} ends at byte {offset + nbytes} of "
                                f"a {size}-byte file (download it again)")
            self.tensors[tensor.name] = GGUFTensor(tensor.name, kind, shape, offset, nbytes)
        self._header_end = min((t.offset for t in self.tensors.values()), default=size)
        del reader  # drops its memory map: tensors are read one by one from here on
        if unsupported:
            listed = "; ".join(f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                               for kind, names in unsupported.items())
            supported = ", ".join(t.name for t in FORMATS)
            raise GGUFError(f"{self.path} holds tensors in ggml types this project does not compute on ({listed}); "
                            f"served types: {supported}. Use a file in one of them (e.g. Q4_K_M, Q8_0), or "
                            f"re-quantize with llama.cpp's llama-quantize", code="unsupported_gguf_type")

    @property
    def file_type(self) -> str:
        """What the file calls its quantization (`general.file_type`, as llama.cpp names it: Q4_K_M, ...)."""
        from gguf import LlamaFileType

        value = self.metadata.get("general.file_type")
        try:
            return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else "unknown"
        except ValueError:
            return f"type{value}"

    def fingerprint(self) -> str:
        """A digest of the file's header (metadata and tensor table, so every quantization of a model differs),
        its size and modification time."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            digest.update(f.read(min(self._header_end, 64 * 2**20)))
        stat = self.path.stat()
        digest.update(f"{stat.st_size}".encode())
        return digest.hexdigest()[:16]

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name`'s bytes as uint8 (rows, row bytes) for a matrix, (bytes,) for a vector: one positioned read
        into memory of this process (no mapping of the file remains)."""
        tensor = self.tensors[name]
        out = torch.empty(tensor.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]  # a uint8 array is a buffer
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < tensor.nbytes:
                got = os.preadv(fd, [view[done:]], tensor.offset + done)
                if got <= 0:
                    raise GGUFError(f"{self.path} ended while reading {name}: is the file complete?")
                done += got
        finally:
            os.close(fd)
        if len(tensor.shape) >= 2:
            rows = 1
            for dim in tensor.shape[:-1]:
                rows *= dim
            return out.reshape(rows, tensor.nbytes // rows)
        return out

    def read_dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` as a dense tensor in `dtype` (for vectors such as norms, and for float matrices)."""
        from swarmnode.runtime.ggml import kernels

        tensor = self.tensors[name]
        raw = self.read(name)
        rows = raw.shape[0] if raw.dim() == 2 else 1
        columns = tensor.shape[-1]
        dense = kernels.dequantize(raw.reshape(rows, -1).contiguous(), tensor.type, rows, columns)
        return dense.reshape(tensor.shape).to(dtype)
