"""A GGUF file served as a checkpoint: a node reads its blocks' tensors from it and keeps them as the file stores them.

`GGUFCheckpoint` stands where `runtime.checkpoint.Checkpoint` stands (nodes, clients, the coordinator and the CLI
take either, through `runtime.sources.open_checkpoint`), so everything above the weights is unchanged:

* the model's `transformers` config and tokenizer come from the file's metadata, converted by `transformers`' own
  GGUF support once per file into a small folder of the cache (`cache_home()/gguf/<file>-<digest>/`: config.json,
  tokenizer files, generation config), which is the checkpoint's `path` as a Hugging Face folder's would be;
* :meth:`lazy_tensors` gives each tensor under its `transformers` name (`gguf_file.hf_name`), read when asked:
  a matrix as a `weights.GGMLWeight` in its ggml block format (query and key rows put back in the model's order),
  a vector (norms) as a dense tensor in the served dtype. `runtime.blocks` and `runtime.model_ends` install the
  matrices as `GGMLLinear` / `GGMLEmbedding` modules;
* sizes are the file's: :meth:`loaded_block_bytes` is what a block holds once loaded, which memory plans and records use.

A file is named by its path, or on the Hub as `org/name:FILE.gguf` (`org/name@revision:FILE.gguf`), fetched
into the Hugging Face cache (offline: from it). The swarm a GGUF node joins is named by `--model-name`, else the
Hub repo and file (`org/name:FILE.gguf`), else the file's name without `.gguf`: a GGUF model's blocks differ from the
safetensors model's, so its nodes form their own swarm unless told otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import shutil
import tempfile
import threading
from functools import cached_property
from pathlib import Path

import torch

from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.checkpoint_files import CheckpointError, TensorInfo
from swarmnode.runtime.ggml.formats import GGMLType, is_quantized
from swarmnode.runtime.ggml.gguf_file import (
    PERMUTED,
    SERVED_ARCHITECTURES,
    GGUFError,
    GGUFFile,
    GGUFTensor,
    hf_name,
    unpermute_rows,
)
from swarmnode.runtime.ggml.weights import GGMLWeight

logger = logging.getLogger(__name__)

__all__ = ["GGUFCheckpoint", "is_gguf_source", "parse_hub_gguf"]

_LAYER_PREFIX = "model.layers."
_HUB_GGUF_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
                          r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]*))?:(?P<file>[^:\\]+\.gguf)$", re.IGNORECASE)
_FOLDER_VERSION = 1  # bump when what the cache folder holds changes


def parse_hub_gguf(text: str) -> tuple[str, str | None, str] | None:
    """(repo id, revision or None, file) if `text` names a GGUF file of a Hub repo: `org/name[@rev]:FILE.gguf`."""
    match = _HUB_GGUF_RE.match(text.strip())
    if match is None:
        return None
    return match.group("repo"), match.group("revision"), match.group("file")


def is_gguf_source(source: str | Path) -> bool:
    """Whether `source` names a GGUF file: an existing file that starts with GGUF's magic, a path ending in
    `.gguf`, or a Hub file `org/name:FILE.gguf`."""
    text = str(source).strip()
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf") and not path.is_dir():
        return True
    if path.is_file():
        try:
            with open(path, "rb") as f:
                return f.read(4) == b"GGUF"
        except OSError:
            return False
    return parse_hub_gguf(text) is not None


def _hub_file(repo: str, revision: str | None, filename: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    from swarmnode.runtime.hub import hub_offline

    label = f"{repo}{'@' + revision if revision else ''}:{filename}"
    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set and it is" if hub_offline() else "the Hub did not answer and it is"
        raise CheckpointError(f"cannot get {label}: {where} not in the Hugging Face cache; fetch it once online "
                              f"(or copy the file here and pass its path)", code="not_cached") from None
    except (EntryNotFoundError, RepositoryNotFoundError) as exc:
        raise CheckpointError(f"cannot get {label}: {type(exc).__name__} (check the repo id and the file name; "
                              f"the repo's file list is on its Hub page)") from None


class GGUFCheckpoint(Checkpoint):
    """The GGUF file `source` (a path, or `org/name[@rev]:FILE.gguf`) as a checkpoint; see the module docstring."""

    def __init__(self, source: str | Path, *, model_name: str | None = None):
        text = str(source).strip()
        if model_name is not None and not model_name.strip():
            raise CheckpointError("the model name is empty: pass a name such as org/name, or none to use the "
                                  "file's own")
        self.source = text
        self.hub = None
        self.repo_id: str | None = None
        self.revision: str | None = None
        self.opened_shards: set[str] = set()
        self._headers = {}
        self._lock = threading.Lock()
        hub = parse_hub_gguf(text)
        local = Path(text).expanduser()
        if local.is_file():
            file_path = local.resolve()
            default_name = file_path.name[: -len(".gguf")] if file_path.name.lower().endswith(".gguf") \
                else file_path.name
        elif hub is not None:
            repo, revision, filename = hub
            file_path = _hub_file(repo, revision, filename)
            self.repo_id, self.revision = repo, revision
            default_name = f"{repo}:{filename}"
        else:
            raise CheckpointError(f"no GGUF file at {text}: pass the path of a .gguf file, or a Hub file as "
                                  f"org/name:FILE.gguf")
        self.file = GGUFFile(file_path)
        if self.file.architecture not in SERVED_ARCHITECTURES:
            raise GGUFError(f"{file_path.name} is a GGUF file of architecture {self.file.architecture!r}; GGUF files "
                            f"are served for {', '.join(SERVED_ARCHITECTURES)} so far. Serve the model's "
                            f"safetensors checkpoint (its Hub name or folder) instead", code="unsupported_gguf_arch")
        self.name = (model_name.strip() if model_name else None) or default_name
        from swarmnode.records import model_prefix

        try:
            model_prefix(self.name)
        except ValueError:
            raise CheckpointError(f"model name {self.name!r} has no letter or digit to name a swarm by: pass "
                                  f"--model-name org/name") from None
        self.weight_map = self._weight_map()
        self.layer_prefix = _LAYER_PREFIX
        self.path = self._metadata_folder()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({self.source!r}, name={self.name!r}, {self.file.file_type})"

    # --- names --------------------------------------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        """`transformers` name -> the file's tensor name (a tied head shares the embeddings' tensor)."""
        names: dict[str, str] = {}
        for name in self.file.tensors:
            model_name = hf_name(name)
            if model_name is not None:
                names[model_name] = name
        if "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
            names["lm_head.weight"] = names["model.embed_tokens.weight"]  # tied: llama.cpp writes no output.weight
        if not any(n.startswith(_LAYER_PREFIX) for n in names):
            raise GGUFError(f"{self.file.path} holds no transformer blocks (no blk.N.* tensors)")
        return names

    @property
    def file_type(self) -> str:
        return self.file.file_type

    # --- the config and tokenizer, once per file ---------------------------------------------------------
    def _metadata_folder(self) -> Path:
        from swarmnode.model_prep import cache_home

        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", self.file.path.name)[:80]
        self.fingerprint = self.file.fingerprint()  # reads the header: once
        folder = cache_home() / "gguf" / f"{stem}-{self.fingerprint}-v{_FOLDER_VERSION}"
        if (folder / "config.json").is_file():
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock_path = folder.parent / f".{folder.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "config.json").is_file():
                logger.info("reading the config and tokenizer of %s from its metadata into %s (once per file)",
                            self.file.path.name, folder)
                with tempfile.TemporaryDirectory(prefix=".staging-", dir=folder.parent) as staging:
                    self._write_metadata(Path(staging) / "folder")
                    if folder.exists():
                        shutil.rmtree(folder)
                    (Path(staging) / "folder").rename(folder)
        with contextlib.suppress(OSError):
            lock_path.unlink()
        return folder

    def _write_metadata(self, out: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        parent, filename = str(self.file.path.parent), self.file.path.name
        try:
            config = AutoConfig.from_pretrained(parent, gguf_file=filename)
            tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=filename)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise GGUFError(f"transformers cannot read the config or tokenizer of {filename} ({exc})") from None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if "output.weight" not in self.file.tensors:
            config.tie_word_embeddings = True
        config.dtype = torch.float32
        out.mkdir(parents=True)
        config.save_pretrained(out)
        data = json.loads((out / "config.json").read_text())
        data["_name_or_path"] = self.file.path.name
        data["gguf"] = {"file": filename, "file_type": self.file.file_type, "fingerprint": self.fingerprint}
        (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(out)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(out)

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    # --- sizes ---------------------------------------------------------------------------------------
    def _tensors(self, prefix: str) -> list[tuple[str, GGUFTensor]]:
        return [(name, self.file.tensors[stored]) for name, stored in self.weight_map.items()
                if name.startswith(prefix)]

    def tensor_info(self, prefix: str) -> dict[str, TensorInfo]:
        """As stored: a quantized tensor as its bytes (`U8`, one dimension), a float tensor in its dtype."""
        infos = {}
        for name, tensor in self._tensors(prefix):
            if is_quantized(tensor.type):
                infos[name] = TensorInfo("U8", (tensor.nbytes,))
            else:
                infos[name] = TensorInfo(tensor.type.name, tensor.shape)
        if not infos:
            raise CheckpointError(f"no tensors named {prefix}* in {self.source}")
        return infos

    def loaded_block_bytes(self, index: int, dtype: torch.dtype, quantization: str = "none") -> int:
        """Bytes block `index` holds once loaded: its matrices as the file stores them, its vectors in `dtype`
        (`quantization` does not apply: the file's is served)."""
        total = 0
        for _, tensor in self._tensors(self.block_prefix(index)):
            if len(tensor.shape) >= 2:
                total += tensor.nbytes
            else:
                total += tensor.shape[0] * dtype.itemsize
        return total

    def block_param_bytes(self, index: int, dtype: torch.dtype) -> int:
        return self.loaded_block_bytes(index, dtype)

    # --- tensors -------------------------------------------------------------------------------------
    def lazy_tensors(self, prefix: str, device: str = "cpu", *, copy: bool = True):
        """(model name, reader) of each tensor under `prefix`: `reader(dtype)` gives a matrix as a `GGMLWeight`, a
        vector as a dense tensor in `dtype` (see the module docstring)."""
        if torch.device(device).type != "cpu":
            raise CheckpointError(f"GGUF weights are computed on by CPU kernels: serve {self.file.path.name} with "
                                  f"--device cpu (a GPU node serves the safetensors checkpoint)")
        return [(name, _GGUFReader(self, name)) for name, _ in self._tensors(prefix)]

    def read_model_tensor(self, name: str, dtype: torch.dtype | None) -> torch.Tensor | GGMLWeight:
        stored = self.weight_map[name]
        tensor = self.file.tensors[stored]
        with self._lock:
            self.opened_shards.add(self.file.path.name)
        if len(tensor.shape) < 2:
            return self.file.read_dense(stored, dtype or torch.float32)
        data = self.file.read(stored)
        suffix = name.rpartition(".layers.")[2].partition(".")[2]
        if suffix in PERMUTED:
            data = unpermute_rows(data, int(getattr(self.config, PERMUTED[suffix])))
        return GGMLWeight(data, GGMLType(tensor.type), (tensor.shape[0], tensor.shape[1]))

    def require_blocks(self, start: int, end: int) -> list[Path]:
        for index in range(start, end):
            if not self._tensors(self.block_prefix(index)):
                raise CheckpointError(f"{self.file.path.name} holds no tensors of block {index}: it does not hold "
                                      f"blocks [{start}, {end})", code="missing_shard")
        return [self.file.path]

    def shard_file(self, shard: str, *, reason: str | None = None) -> Path:
        return self.file.path


class _GGUFReader:
    """A deferred read of one GGUF tensor (`GGUFCheckpoint.lazy_tensors`)."""

    def __init__(self, checkpoint: GGUFCheckpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def __call__(self, dtype: torch.dtype | None = None):
        return self.checkpoint.read_model_tensor(self.name, dtype)
