"""A Hugging Face checkpoint, read tensor by tensor: a node never loads (or fetches) more than its blocks.

A checkpoint is a local folder or a Hub model named `org/name[@revision]` (`swarmnode.runtime.hub`
resolves it into the standard Hugging Face cache; weight shards are fetched only when their tensors are
read). Works with sharded safetensors (`model.safetensors.index.json`) and single-file checkpoints, for
any decoder-only architecture whose blocks `transformers` keeps as a list of layers (`model.layers.{i}.`).

The checkpoint's `name` decides which swarm it joins (`records.model_prefix(name)`), so it is the name
the model declares, not where it happens to be stored: the name given explicitly, else the Hub repo id,
else the repo id the folder's `config.json` declares (`_name_or_path`), else, for a snapshot folder of a
Hugging Face cache given as a path, its repo's id, else the folder's name.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from swarmnode.runtime.checkpoint_files import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    TensorInfo,
    read_header,
    read_index,
)
from swarmnode.runtime.hub import HubRepo, hub_offline, parse_hub_name

if TYPE_CHECKING:
    from swarmnode.runtime.conversion import LazyTensor
    from swarmnode.runtime.family import ModelFamily

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<index>\d+)\.")
# config.json keys under which transformers records the repo a model came from
_DECLARED_NAME_KEYS = ("_name_or_path", "name_or_path")



class Checkpoint:
    """A model's config, tokenizer files and weights, from a local folder or a Hub repo.

    `Checkpoint(source, model_name=None)`: `source` is a folder holding `config.json` and safetensors
    weights, or a Hub model name `org/name` / `org/name@revision` that is not an existing path. A Hub
    name is resolved through `huggingface_hub` (honouring HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE and
    HF_ENDPOINT); its config, generation config, tokenizer files and shard index are fetched now, its
    weight shards when `load_tensors` needs them.

    Attributes: `path` (a local folder with config.json and the tokenizer files: the folder itself, or
    the Hub snapshot folder in the cache), `name` (the declared model name, see the module docstring),
    `repo_id`/`revision` (the Hub repo and the snapshot's commit; None for a folder), `weight_map`
    (tensor name -> shard file), `layer_prefix`, `opened_shards` (shard files whose tensors were read,
    fetching them first for a Hub repo).
    """

    def __init__(self, source: str | Path, *, model_name: str | None = None):
        if model_name is not None and not model_name.strip():
            raise CheckpointError("the model name is empty: pass a name such as org/name, or none to use the "
                                  "checkpoint's own")
        if model_name is not None:
            from swarmnode.records import model_prefix

            try:
                model_prefix(model_name)
            except ValueError:
                raise CheckpointError(f"model name {model_name!r} has no letter or digit to name a swarm by: pass "
                                      f"a name such as org/name") from None
        self.source = str(source)
        self.hub: HubRepo | None = None
        self.repo_id: str | None = None
        self.revision: str | None = None
        self.opened_shards: set[str] = set()
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._lock = threading.Lock()
        folder, hub_name = _classify(source)
        if folder is not None:
            self.path = folder
            if not (self.path / "config.json").is_file():
                raise CheckpointError(
                    f"{self.path} has no config.json: pass the folder of a Hugging Face checkpoint or a Hub "
                    f"name org/name (run `swarmnode prepare-model` to make the test model)"
                )
            self.weight_map = self._local_weight_map()
        else:
            assert hub_name is not None, "`_classify` gives a folder or a Hub name"
            self.hub = HubRepo(*hub_name)
            self.repo_id, self.revision = self.hub.repo_id, self.hub.commit
            self.path = self.hub.folder
            self.weight_map = self._hub_weight_map()
        prefixes = {m.group("prefix") for name in self.weight_map if (m := _LAYER_RE.match(name))}
        if len(prefixes) != 1:
            raise CheckpointError(f"cannot find one list of transformer layers in {self.source}: {sorted(prefixes)}")
        self.layer_prefix = prefixes.pop()
        self.name: str = (model_name.strip() if model_name else None) or self.repo_id or \
            declared_name(self.path) or _snapshot_repo_id(self.path) or self.path.name

    def __repr__(self) -> str:
        return f"Checkpoint({self.source!r}, name={self.name!r})"

    # --- weights index -------------------------------------------------------------------------------
    def _local_weight_map(self) -> dict[str, str]:
        index_file = self.path / INDEX_FILE
        single_file = self.path / SINGLE_FILE
        if index_file.is_file():
            return read_index(index_file, self.source)
        if single_file.is_file():
            return {name: SINGLE_FILE for name in read_header(single_file)}
        raise CheckpointError(f"{self.path} holds no safetensors weights ({INDEX_FILE} or {SINGLE_FILE})")

    def _hub_weight_map(self) -> dict[str, str]:
        assert self.hub is not None
        index_file = self.hub.fetch(INDEX_FILE, required=False)
        if index_file is not None:
            return read_index(index_file, self.source)
        single_file = self.hub.fetch(SINGLE_FILE, required=False)
        if single_file is not None:
            return {name: SINGLE_FILE for name in read_header(single_file)}
        if hub_offline():
            raise CheckpointError(self.hub.not_cached_message(INDEX_FILE), code="not_cached")
        raise CheckpointError(f"{self.hub.label} holds no safetensors weights ({INDEX_FILE} or {SINGLE_FILE}): "
                              f"only safetensors checkpoints can be served")

    # --- config --------------------------------------------------------------------------------------
    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    @cached_property
    def family(self) -> ModelFamily:
        """The model's family as `transformers` defines it (`runtime.family`); :class:`~swarmnode.runtime.family.
        FamilyError` for one this project cannot serve."""
        from swarmnode.runtime.family import ModelFamily

        return ModelFamily(self.config)

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def block_prefix(self, index: int) -> str:
        return f"{self.layer_prefix}{index}."

    # --- sizes ---------------------------------------------------------------------------------------
    def tensor_info(self, prefix: str) -> dict[str, TensorInfo]:
        """Dtype and shape of the tensors whose names start with `prefix`, by full tensor name (unlike
        `load_tensors`, the prefix is kept), read from the safetensors headers without loading or fetching
        any shard.

        A header comes from the shard file when it is here (in the folder, or in the Hugging Face cache),
        else, for a Hub repo while online, from the Hub (a ranged request for the header alone). Offline,
        a tensor of a decoder block whose shard is not here takes the dtype and shape of the same tensor
        in the nearest block whose shard is: a decoder's blocks are alike (same tensors, same shapes), so
        a node can size every block of the model while holding the shards of its own blocks only.
        """
        by_shard = self._names_by_shard(prefix)
        if not by_shard:
            raise CheckpointError(f"no tensors named {prefix}* in {self.source}")
        infos: dict[str, TensorInfo] = {}
        unknown: list[str] = []
        for shard, names in by_shard.items():
            header = self._header(shard, remote=True)
            for name in names:
                if header is not None and name in header:
                    infos[name] = header[name]
                else:
                    unknown.append(name)
        if unknown:
            infos.update(self._infer_from_alike(prefix, unknown))
        return infos

    def tensor_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors named `prefix`*, by full name; see `tensor_info`."""
        return {name: info.shape for name, info in self.tensor_info(prefix).items()}

    def loaded_block_bytes(self, index: int, dtype: torch.dtype, quantization: str = "none") -> int:
        """Bytes block `index` takes once loaded in `dtype` with `quantization` (`runtime.quantize`), from the
        model's own layer built on the meta device (no tensor read)."""
        from swarmnode.runtime import quantize

        family = self.family
        return quantize.block_bytes(family.new_layer(index), quantization, dtype,
                                    lambda name: family.tensor_dtype(index, name, dtype))

    def block_param_bytes(self, index: int, dtype: torch.dtype) -> int:
        """Bytes of block `index`'s weights once cast to `dtype`, from the headers (see `tensor_info`)."""
        element = torch.empty((), dtype=dtype).element_size()
        return sum(info.numel for info in self.tensor_info(self.block_prefix(index)).values()) * element

    # --- tensors -------------------------------------------------------------------------------------
    def load_tensors(self, prefix: str, dtype: torch.dtype | None = None, device: str = "cpu") -> dict:
        """Tensors whose names start with `prefix`, with the prefix stripped, read shard by shard (a Hub
        repo's shards are fetched into the cache first, if they are not there yet)."""
        tensors = dict(self.iter_tensors(prefix, dtype, device))
        if not tensors:
            raise CheckpointError(f"no tensors named {prefix}* in {self.source}")
        return tensors

    def iter_tensors(self, prefix: str, dtype: torch.dtype | None = None, device: str = "cpu", *,
                     copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(name without `prefix`, tensor) for each tensor under `prefix`, one at a time: a caller that
        transforms each tensor as it comes (casts, quantizes) holds at most one of them in its stored form.

        The shard is memory-mapped afresh for each tensor: pages of the file read so far are counted in the
        process's resident memory for as long as the mapping lives, so one mapping per shard would hold up
        to a whole shard's pages beside the blocks while they load. A tensor already in the asked dtype is
        copied out of the mapping: weights are in the node's memory once it serves (no disk reads on the
        first request, no crash if the file is replaced), and its memory accounting sees them. `copy=False`
        leaves that to a caller that converts the tensor anyway (a quantizer), so it is not copied twice."""
        for shard, names in self._names_by_shard(prefix).items():
            self.shard_file(shard, reason=f"{prefix}*")  # fetched (or found missing) before the first read
            for name in names:
                yield name[len(prefix):], self.read_tensor(shard, name, dtype, device, copy=copy)

    def lazy_tensors(self, prefix: str, device: str = "cpu", *, copy: bool = True) -> list[tuple[str, LazyTensor]]:
        """(full name, reader) for each tensor under `prefix`: `reader(dtype)` reads its tensor when called, as
        :meth:`iter_tensors` reads it (cast to `dtype`, copied out of the file unless `copy` is False), so a
        conversion that merges many of them reads each only when it builds their target."""
        return [(name, _Reader(self, shard, name, device, copy))
                for shard, names in self._names_by_shard(prefix).items() for name in names]

    def read_tensor(self, shard: str, name: str, dtype: torch.dtype | None = None, device: str = "cpu", *,
                    copy: bool = True) -> torch.Tensor:
        """Tensor `name` of shard file `shard`, as :meth:`iter_tensors` reads it."""
        file = self.shard_file(shard, reason=name)
        with self._lock:
            self.opened_shards.add(shard)
        with safe_open(file, framework="pt", device="cpu") as f:
            tensor = f.get_tensor(name)
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        elif copy and tensor.device.type == "cpu" and torch.device(device).type == "cpu":
            tensor = tensor.clone()  # the node's own memory, not pages of a file that may change
        return tensor.to(device)

    def require_blocks(self, start: int, end: int) -> list[Path]:
        """The shard files holding blocks [start, end), fetched first for a Hub repo: a node serving a fixed
        range checks this before it starts. `CheckpointError` when a block has no tensors here or a shard
        cannot be had (absent from the folder, or from the cache while offline)."""
        files: dict[str, Path] = {}
        for index in range(start, end):
            shards = self._names_by_shard(self.block_prefix(index))
            if not shards:
                raise CheckpointError(f"{self.source} holds no tensors of block {index} "
                                      f"({self.block_prefix(index)}*): it does not hold blocks [{start}, {end})",
                                      code="missing_shard")
            for shard in shards:
                if shard not in files:
                    files[shard] = self.shard_file(shard, reason=f"block {index}")
        return list(files.values())

    def shard_file(self, shard: str, *, reason: str | None = None) -> Path:
        """The local path of shard file `shard`, fetched first for a Hub repo; `reason` (what needs it)
        goes into the error when the shard cannot be had."""
        needed = f" (it holds {reason})" if reason else ""
        if self.hub is not None:
            path = self.hub.fetch(shard, what=f"shard {shard}{needed}")
            assert path is not None
            return path
        path = self.path / shard
        if not path.is_file():
            raise CheckpointError(f"{self.path} lacks {shard}{needed}, which {INDEX_FILE} lists: copy the file "
                                  f"into the folder", code="missing_shard")
        return path

    def _names_by_shard(self, prefix: str) -> dict[str, list[str]]:
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in self.weight_map.items():
            if name.startswith(prefix):
                by_shard[shard].append(name)
        return by_shard

    def _local_shard(self, shard: str) -> Path | None:
        if self.hub is not None:
            return self.hub.cached(shard)
        path = self.path / shard
        return path if path.is_file() else None

    def _header(self, shard: str, *, remote: bool) -> dict[str, TensorInfo] | None:
        """The header of `shard` if it can be read without fetching the shard, else None. `remote`: a Hub
        repo's header may be read from the Hub while online."""
        with self._lock:
            header = self._headers.get(shard)
        if header is not None:
            return header
        local = self._local_shard(shard)
        if local is not None:
            header = read_header(local)
        elif remote and self.hub is not None:
            if hub_offline() or self.hub.unreachable:
                return None
            try:
                header = self.hub.remote_header(shard)
            except CheckpointError as exc:
                logger.warning("%s; sizing its tensors from alike blocks instead", exc)
                return None
        else:
            return None
        with self._lock:
            self._headers[shard] = header
        return header

    def _infer_from_alike(self, prefix: str, names: list[str]) -> dict[str, TensorInfo]:
        """Infos of block tensors `names` (of block `prefix`) taken from the same tensors of other blocks
        whose shards are here; a CheckpointError naming the missing shard when that cannot be done."""
        match = re.fullmatch(re.escape(self.layer_prefix) + r"(\d+)\.", prefix)
        index = int(match.group(1)) if match else None
        blocks = sorted({int(m.group("index")) for name in self.weight_map if (m := _LAYER_RE.match(name))})
        infos: dict[str, TensorInfo] = {}
        for name in names:
            rest = name[len(prefix):]
            if index is not None:
                for other in sorted(blocks, key=lambda j: abs(j - index)):
                    alike = f"{self.layer_prefix}{other}.{rest}"
                    shard = self.weight_map.get(alike)
                    if other == index or shard is None:
                        continue
                    header = self._header(shard, remote=False)
                    if header is not None and alike in header:
                        infos[name] = header[alike]
                        break
            if name not in infos:
                raise CheckpointError(f"cannot tell the size of {name}, and no block alike it has its shard here: "
                                      f"{self._unavailable(self.weight_map[name])}", code="missing_shard")
        return infos

    def _unavailable(self, shard: str) -> str:
        if self.hub is not None:
            return self.hub.not_cached_message(shard)
        return f"{self.path} lacks {shard}, which {INDEX_FILE} lists (copy the file into the folder)"


@dataclass(frozen=True)
class _Reader:
    """A deferred read of one tensor (`Checkpoint.lazy_tensors`)."""

    checkpoint: Checkpoint
    shard: str
    name: str
    device: str
    copy: bool

    def __call__(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.checkpoint.read_tensor(self.shard, self.name, dtype, self.device, copy=self.copy)


def declared_name(folder: Path) -> str | None:
    """The Hub repo id `folder`'s config.json declares it was saved from (`_name_or_path`), if it is one;
    a local path there (absolute, relative with './', or a home path) declares nothing."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key in _DECLARED_NAME_KEYS:
        value = config.get(key)
        if isinstance(value, str) and (parsed := parse_hub_name(value.strip())) and parsed[1] is None:
            return parsed[0]
    return None


def _snapshot_repo_id(folder: Path) -> str | None:
    """The repo id of a folder given by its place in a Hugging Face cache (`models--org--name/snapshots/
    <commit>`), so a node started on a snapshot's path joins the swarm of the repo's name."""
    repo_folder = folder.parent.parent
    if folder.parent.name != "snapshots" or not repo_folder.name.startswith("models--"):
        return None
    parsed = parse_hub_name(repo_folder.name[len("models--"):].replace("--", "/"))
    return parsed[0] if parsed and parsed[1] is None else None


def _classify(source: str | Path) -> tuple[Path | None, tuple[str, str | None] | None]:
    """(folder, None) for an existing folder, (None, (repo_id, revision)) for a Hub name; else the error."""
    text = str(source)
    hint = ("pass the folder of a Hugging Face checkpoint (holding config.json), a GGUF file, or a Hub model name "
            "org/name[@revision], e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    if not text.strip():
        raise CheckpointError(f"no model given: {hint}")
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve(), None
    if path.exists():
        raise CheckpointError(f"{path} is a file, not a folder: {hint}")
    parsed = parse_hub_name(text)
    if parsed is not None:
        return None, parsed
    if "/" in text or "\\" in text or text.startswith(("~", ".")):
        raise CheckpointError(f"no folder at {text} (and {text!r} is not a Hub name org/name): {hint}")
    raise CheckpointError(f"{text!r} is neither a folder nor a Hub model name: {hint}")
