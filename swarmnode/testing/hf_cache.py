"""Hugging Face hub caches built from local checkpoint folders, so Hub-name tests run offline.

`build_hf_cache` lays a checkpoint folder out exactly as `huggingface_hub` stores a downloaded repo:

    <cache_dir>/models--<org>--<name>/
        blobs/<etag>                       the files' contents
        snapshots/<commit>/<file>          relative symlinks to the blobs
        refs/main                          the commit hash (no newline, as the library writes it)

so that with `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE=<cache_dir>` the library resolves `org/name` from it
like any repo it downloaded before. `files` leaves files out, which is how tests model a cache that holds
only some of a model's shards. `use_hf_cache` points this process (and the processes it starts) at such a
cache. `shards_by_block` tells which shard holds which block, so tests derive their expectations from the
checkpoint instead of hard-coding its layout (the prepared SmolLM2 has six shards: embeddings, five of
blocks, the last one with the final norm). `FakeHub` serves a checkpoint folder over HTTP on 127.0.0.1 the
way the Hub's file endpoints do, so tests can check what a Hub-named checkpoint downloads, and when.

Blob names: small files get their git blob SHA-1, as on the Hub; large files (LFS on the Hub, named by the
SHA-256 of their contents) get the SHA-256 of their contents only with `hash_contents=True`, and
otherwise a SHA-256 of their name, size and modification time, which spares hashing hundreds of MB per
test. `huggingface_hub` treats blob names as opaque etags and never checks them offline.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import threading
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote

__all__ = ["DEFAULT_COMMIT", "FakeHub", "build_hf_cache", "repo_cache_folder", "shards_by_block", "use_hf_cache"]

DEFAULT_COMMIT = "5f3a1c0de2b4a6c8e0f1a3b5c7d9e1f3a5b7c9d1"
_LFS_SUFFIXES = {".safetensors", ".bin", ".model", ".gguf", ".pt", ".pth", ".msgpack", ".h5"}
_LFS_MIN_SIZE = 10 * 2**20
_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")


def repo_cache_folder(cache_dir: str | Path, repo_id: str) -> Path:
    """The folder `huggingface_hub` keeps model repo `repo_id` in under `cache_dir`."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def build_hf_cache(model_dir: str | Path, cache_dir: str | Path, repo_id: str, *,
                   revision_hash: str = DEFAULT_COMMIT, files: Iterable[str] | None = None,
                   ref: str = "main", link: str = "hardlink", hash_contents: bool = False) -> Path:
    """Lay `model_dir`'s files out in `cache_dir` as a cached snapshot of Hub repo `repo_id`.

    `files`: the file names to put in the snapshot (default: every regular, non-hidden file of
    `model_dir`). `revision_hash`: the snapshot's commit (40 hex digits), which `refs/<ref>` names.
    `link`: how blobs are made from the source files: "hardlink" (no copy; falls back to a copy across
    file systems), "symlink" (the source must outlive the cache) or "copy". Tests must not write to blobs
    made with a link, since that would change the source checkpoint. Returns the snapshot folder.
    """
    if not re.fullmatch(r"[0-9a-f]{40}", revision_hash):
        raise ValueError(f"revision_hash must be 40 lower-case hex digits, not {revision_hash!r}")
    if link not in ("hardlink", "symlink", "copy"):
        raise ValueError(f"link must be 'hardlink', 'symlink' or 'copy', not {link!r}")
    model_dir = Path(model_dir).expanduser().resolve()
    if files is None:
        names = sorted(p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        names = list(files)
        absent = [name for name in names if not (model_dir / name).is_file()]
        if absent:
            raise FileNotFoundError(f"{model_dir} has no {', '.join(absent)}")
    repo_folder = repo_cache_folder(cache_dir, repo_id)
    blobs = repo_folder / "blobs"
    snapshot = repo_folder / "snapshots" / revision_hash
    refs = repo_folder / "refs"
    for folder in (blobs, snapshot, refs):
        folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = model_dir / name
        blob = blobs / _etag(source, hash_contents)
        if not blob.exists():
            _make_blob(source, blob, link)
        pointer = snapshot / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if pointer.is_symlink() or pointer.exists():
            pointer.unlink()
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (refs / ref).write_text(revision_hash)
    return snapshot


def use_hf_cache(monkeypatch, cache_dir: str | Path, *, offline: bool = True,
                 endpoint: str | None = None) -> None:
    """Point `huggingface_hub` in this process, and the processes it starts, at `cache_dir`.

    The library reads `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` once, when it is imported; so
    besides the environment (for child processes) this sets the module constants it reads at call time.
    `monkeypatch` (pytest's) undoes both when the test ends.
    """
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    if endpoint is not None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint.rstrip("/"))
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint.rstrip("/") + "/{repo_id}/resolve/{revision}/{filename}")


def shards_by_block(model_dir: str | Path) -> dict[str, set[int | str]]:
    """Which blocks (as ints) and which other tensors (by name) each shard of a sharded checkpoint holds."""
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    held: dict[str, set[int | str]] = defaultdict(set)
    for name, shard in index["weight_map"].items():
        match = _LAYER_RE.match(name)
        held[shard].add(int(match.group(1)) if match else name)
    return dict(held)


def _etag(path: Path, hash_contents: bool) -> str:
    size = path.stat().st_size
    if path.suffix in _LFS_SUFFIXES or size >= _LFS_MIN_SIZE:
        if hash_contents:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
            return digest.hexdigest()
        stamp = f"{path.name}\0{size}\0{path.stat().st_mtime_ns}".encode()
        return hashlib.sha256(stamp).hexdigest()
    git = hashlib.sha1(f"blob {size}\0".encode())
    git.update(path.read_bytes())
    return git.hexdigest()


def _make_blob(source: Path, blob: Path, link: str) -> None:
    if link == "symlink":
        blob.symlink_to(source)
        return
    if link == "hardlink":
        try:
            os.link(source, blob)
            return
        except OSError:
            pass
    shutil.copyfile(source, blob)


class FakeHub:
    """Serves `model_dir` as Hub model repo `repo_id` at commit `commit` on 127.0.0.1, for online tests.

    It answers what `huggingface_hub` asks of the Hub's file endpoint, `/{repo}/resolve/{revision}/{file}`:
    HEAD (commit, etag and size headers) and GET (whole file or one byte range, as used to read a
    safetensors header); an unknown repo, revision or file gets the 404 and `X-Error-Code` the Hub sends.
    `requests` lists `(method, file, range or None)` of every request answered, so a test can tell what was
    downloaded. Use as a context manager; `endpoint` is the URL to set as HF_ENDPOINT.
    """

    def __init__(self, model_dir: str | Path, repo_id: str, *, commit: str = DEFAULT_COMMIT,
                 files: Iterable[str] | None = None):
        self.model_dir = Path(model_dir).expanduser().resolve()
        self.repo_id = repo_id
        self.commit = commit
        self.files = set(files) if files is not None else {
            p.name for p in self.model_dir.iterdir() if p.is_file() and not p.name.startswith(".")}
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def downloaded(self) -> set[str]:
        """Files fetched whole (GET without a range)."""
        with self._lock:
            return {file for method, file, byte_range in self.requests if method == "GET" and byte_range is None}

    def ranged(self) -> set[str]:
        """Files of which only a byte range was fetched (a safetensors header)."""
        with self._lock:
            return {file for method, file, byte_range in self.requests if method == "GET" and byte_range}

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(handler.path.split("?", 1)[0]).lstrip("/")
        match = re.fullmatch(r"(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)", path)
        if match is None or match.group("repo") != self.repo_id:
            return self._error(handler, 404, "RepoNotFound", "Repository not found")
        if match.group("revision") not in ("main", self.commit):
            return self._error(handler, 404, "RevisionNotFound", "Invalid rev id")
        name = match.group("file")
        byte_range = handler.headers.get("Range")
        with self._lock:
            self.requests.append((handler.command, name, byte_range))
        if name not in self.files or not (self.model_dir / name).is_file():
            return self._error(handler, 404, "EntryNotFound", "Entry not found")
        file = self.model_dir / name
        size = file.stat().st_size
        status, start, end = 200, 0, size
        if body and byte_range and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", byte_range.strip())):
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1 if m.group(2) else size)
            status = 206
        etag = hashlib.sha256(f"{name}\0{size}".encode()).hexdigest()
        handler.send_response(status)
        handler.send_header("X-Repo-Commit", self.commit)
        handler.send_header("ETag", f'"{etag}"')
        handler.send_header("Content-Length", str(end - start))
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        handler.end_headers()
        if body:
            with open(file, "rb") as f:
                f.seek(start)
                left = end - start
                while left > 0 and (chunk := f.read(min(left, 1 << 20))):
                    handler.wfile.write(chunk)
                    left -= len(chunk)

    @staticmethod
    def _error(handler, status: int, code: str, message: str) -> None:
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", message)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
