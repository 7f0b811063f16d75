"""Checkpoints named by a Hugging Face Hub repo id (`org/name[@revision]`), fetched file by file.

A `HubRepo` resolves the repo through `huggingface_hub` into the standard Hugging Face cache, so the
library's own settings apply: `HF_HUB_CACHE`/`HF_HOME` (where the cache is), `HF_HUB_OFFLINE` (use only
the cache), `HF_ENDPOINT` (a mirror) and the saved token. At construction it fetches the small files a
node or client needs before any weight (config, generation config, tokenizer files, the shard index) and
pins the revision to the commit they came from, so shards fetched later belong to the same snapshot even
if the branch moves meanwhile. Weight shards are fetched one at a time, when asked for: a node fetches
the shards of its blocks, a client those of the embeddings, the final norm and the head.

Every failure is a one-line `CheckpointError` saying what was wrong and what to do.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from swarmnode.runtime.checkpoint_files import CheckpointError, TensorInfo

logger = logging.getLogger(__name__)

__all__ = ["METADATA_FILES", "HubRepo", "hub_cache_dir", "hub_offline", "parse_hub_name"]

# org/name, optionally @revision (a branch, tag or commit; branches may hold '/', as in refs/pr/1)
_HUB_NAME_RE = re.compile(
    r"^(?P<repo>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)"
    r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]*))?$"
)
CONFIG_FILE = "config.json"
# Fetched with the config when the repo has them; a node or client needs no weight to use them.
METADATA_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "tokenizer.model")


def parse_hub_name(text: str) -> tuple[str, str | None] | None:
    """`(repo_id, revision or None)` if `text` reads as a Hub model name `org/name[@revision]`, else None."""
    match = _HUB_NAME_RE.match(text)
    if match is None or len(match.group("repo")) > 96:
        return None
    repo = match.group("repo")
    if "--" in repo or ".." in repo or repo.endswith(".git"):
        return None
    return repo, match.group("revision")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache `huggingface_hub` uses now (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether `huggingface_hub` may not reach the Hub (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


class HubRepo:
    """One snapshot of a Hub model repo in the local cache: `folder` holds what was fetched so far.

    `repo_id` and `revision` (as asked, None for the default branch) name it; `commit` is the snapshot's
    commit hash, which every later fetch uses; `folder` is `<cache>/models--org--name/snapshots/<commit>`.
    """

    def __init__(self, repo_id: str, revision: str | None = None):
        self.repo_id = repo_id
        self.revision = revision
        # set once the Hub failed to answer: later optional files and headers come from the cache only,
        # instead of each waiting out the library's retries
        self.unreachable = False
        config = self._download(CONFIG_FILE, revision or "main", what="its config.json")
        self.folder = Path(config).parent.absolute()
        self.commit = self.folder.name
        for name in METADATA_FILES:
            self.fetch(name, required=False)

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    def fetch(self, filename: str, *, required: bool = True, what: str | None = None) -> Path | None:
        """The local path of `filename` in this snapshot, fetched into the cache if it is not there yet.

        When not `required`, a file the repo does not have is None, and so is one not in the cache while
        offline or while the Hub does not answer; when `required`, each is a CheckpointError.
        """
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        if not required:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(self.repo_id, filename, revision=self.commit)
            if isinstance(found, str):
                return Path(found)
            if found is not None or hub_offline() or self.unreachable:  # known absent, or no Hub to ask
                return None
        try:
            return Path(self._download(filename, self.commit, what=what or filename, quiet=not required))
        except LocalEntryNotFoundError:
            self.unreachable = True
            return None
        except EntryNotFoundError:
            return None

    def cached(self, filename: str) -> Path | None:
        """The local path of `filename` if the cache holds it already; never reaches the Hub."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, filename, revision=self.commit)
        return Path(found) if isinstance(found, str) else None

    def remote_header(self, filename: str) -> dict[str, TensorInfo]:
        """The tensors' dtypes and shapes in safetensors file `filename`, read from its header on the Hub
        (a ranged request of about 100 kB) without downloading the file."""
        from huggingface_hub import HfApi

        try:
            meta = HfApi().parse_safetensors_file_metadata(self.repo_id, filename, revision=self.commit)
        except Exception as exc:  # network and HTTP errors of any kind: say which file and why
            self.unreachable = True
            raise CheckpointError(f"could not read the header of {filename} of {self.label} from the Hub at "
                                  f"{hub_endpoint()}: {_brief(exc)}", code="hub_unavailable") from exc
        return {name: TensorInfo(info.dtype, tuple(info.shape)) for name, info in meta.tensors.items()}

    def not_cached_message(self, filename: str | None = None) -> str:
        """Why a file (or the repo) cannot be had offline, and what to do, in one line."""
        revision = f" --revision {self.revision}" if self.revision else ""
        what = f"{filename} of {self.label} is" if filename else f"{self.label} is"
        files = f" {filename}" if filename else ""
        return (f"{what} not in the Hugging Face cache at {hub_cache_dir()} and HF_HUB_OFFLINE=1: download it "
                f"first with `hf download {self.repo_id}{files}{revision}` or unset HF_HUB_OFFLINE")

    def _download(self, filename: str, revision: str, *, what: str, quiet: bool = False) -> str:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            return hf_hub_download(self.repo_id, filename, revision=revision)
        except LocalEntryNotFoundError as exc:
            if quiet:
                raise
            self.unreachable = not hub_offline()
            if hub_offline():
                message = self.not_cached_message(None if filename == CONFIG_FILE else filename)
            else:
                message = (f"could not fetch {what} of {self.label} from the Hub at {hub_endpoint()}, and it is "
                           f"not in the Hugging Face cache at {hub_cache_dir()}: check the network or HF_ENDPOINT "
                           f"({_brief(exc)})")
            raise CheckpointError(message, code="not_cached" if hub_offline() else "hub_unavailable") from exc
        except EntryNotFoundError as exc:
            if quiet:
                raise
            raise CheckpointError(f"{self.label} has no file {filename} on the Hub at {hub_endpoint()}: "
                                  f"is it a safetensors checkpoint of a transformers model?") from exc
        except GatedRepoError as exc:
            raise CheckpointError(f"{self.label} is gated on the Hub: accept its terms on the model's page and "
                                  f"log in with `hf auth login` (or set HF_TOKEN)", code="hub_denied") from exc
        except RepositoryNotFoundError as exc:
            raise CheckpointError(f"no model repo {self.repo_id} on the Hub at {hub_endpoint()} (or it is private: "
                                  f"log in with `hf auth login`): check the name", code="hub_not_found") from exc
        except RevisionNotFoundError as exc:
            raise CheckpointError(f"{self.repo_id} has no revision {revision!r} on the Hub: check the part after "
                                  f"'@'", code="hub_not_found") from exc
        except HFValidationError as exc:
            raise CheckpointError(f"{self.label!r} is not a valid Hub repo id: {_brief(exc)}") from exc
        except Exception as exc:  # HTTP, network and disk errors while downloading: one line, with the cause
            raise CheckpointError(f"could not fetch {what} of {self.label} from the Hub at {hub_endpoint()} into "
                                  f"{hub_cache_dir()}: {_brief(exc)}", code="hub_unavailable") from exc


def _brief(exc: BaseException) -> str:
    """An exception in one short line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."
