"""API keys of `swarmnode api`: who may call it, and what each caller may use at once.

`swarmnode api --api-keys FILE` admits only requests that carry a key of FILE as `Authorization: Bearer KEY`
(what OpenAI's clients send for `api_key=`). FILE has one key per line (`#` starts a comment):

    # name   key, or the SHA-256 of the key          limits (optional)
    alice    sha256:5e884898da28047151d0e56f8dc6...  sessions=4 tokens_per_minute=20000
    ci-bot   sk-swarm-Q2tq1Kc8m0Cy9ZkF7PqzJ0xGq3...  sessions=1

A key is written as itself or, so that the file holds no secret, as `sha256:` and the hex digest of the key
(`swarmnode api-key NAME` makes a key and prints both). `sessions` caps the generations a key runs at once,
`tokens_per_minute` the prompt and generated tokens it uses in any 60 s (`api.limits`); a key without them
is capped only by the server's `--workers`. Names label the key in `/metrics` and the logs (never the key).

The file is read again when it changes (checked at most once a second, on a request), so keys are added and
revoked without a restart. A file that no longer parses keeps the keys read before it, and the log says what
is wrong and where: a typo never opens the server, nor locks everyone out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarmnode.errors import SwarmError

logger = logging.getLogger(__name__)

__all__ = ["KEY_PREFIX", "APIKey", "KeyFileError", "KeyRing", "digest_of", "key_line", "new_key", "parse_keys"]

#: how keys made by `new_key` start (any other string of `MIN_KEY_CHARS` or more is a key too)
KEY_PREFIX = "sk-swarm-"
MIN_KEY_CHARS = 16
#: how often (s) a request may look at the file's modification time
RELOAD_CHECK_PERIOD = 1.0
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
_LIMITS = frozenset({"sessions", "tokens_per_minute"})


class KeyFileError(SwarmError, ValueError):
    """A keys file that cannot be read or parsed; the message names the file and line."""

    code = "bad_api_keys"


@dataclass(frozen=True)
class APIKey:
    """One caller: its name (for metrics and logs), the SHA-256 hex digest of its key, and its limits (None:
    no cap beyond the server's own)."""

    name: str
    digest: str
    sessions: int | None = None
    tokens_per_minute: int | None = None


def digest_of(key: str) -> str:
    """The SHA-256 hex digest of `key`, as a keys file may hold it."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _check_name(name: str, where: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise KeyFileError(f"{where}the key name {name[:80]!r} must be 1-64 letters, digits, '_', '.', '@' or '-', "
                           f"starting with a letter or digit")


def key_line(name: str, key: str, *, sessions: int | None = None, tokens_per_minute: int | None = None) -> str:
    """The keys-file line for `key` under `name`, holding its digest (not the key) and its limits."""
    _check_name(name, "")
    limits = [f"{field}={value}" for field, value in (("sessions", sessions), ("tokens_per_minute", tokens_per_minute))
              if value is not None]
    return " ".join([name, f"sha256:{digest_of(key)}", *limits])


def _limit(value: str, field: str, where: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise KeyFileError(f"{where}: {field} must be a whole number of at least 1, got {value!r}")
    return int(value)


def parse_keys(text: str, source: str = "the keys file") -> dict[str, APIKey]:
    """The keys of a keys file's `text`, by digest. Raises `KeyFileError` naming `source` and the line for a
    malformed line, a key too short to be secret, an unknown limit, or a name or key given twice."""
    keys: dict[str, APIKey] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        fields = line.split()
        if len(fields) < 2:
            raise KeyFileError(f"{where}: expected 'NAME KEY [sessions=N] [tokens_per_minute=N]', got {line[:80]!r}")
        name, secret, *options = fields
        _check_name(name, f"{where}: ")
        if name in names:
            raise KeyFileError(f"{where}: the name {name!r} is given twice (each key needs its own name)")
        match = _DIGEST_RE.fullmatch(secret)
        if match:
            digest = match.group(1)
        elif secret.startswith("sha256:"):
            raise KeyFileError(f"{where}: 'sha256:' must be followed by 64 lowercase hex digits")
        elif len(secret) < MIN_KEY_CHARS:
            raise KeyFileError(f"{where}: the key of {name!r} has {len(secret)} characters; a key needs at least "
                               f"{MIN_KEY_CHARS} (make one with `swarmnode api-key {name}`)")
        else:
            digest = digest_of(secret)
        if digest in keys:
            raise KeyFileError(f"{where}: the key of {name!r} is also the key of {keys[digest].name!r}")
        limits: dict[str, int] = {}
        for option in options:
            field, _, value = option.partition("=")
            if field not in _LIMITS or not value:
                raise KeyFileError(f"{where}: unknown option {option[:80]!r} (known: sessions=N, "
                                   f"tokens_per_minute=N)")
            if field in limits:
                raise KeyFileError(f"{where}: {field} is given twice")
            limits[field] = _limit(value, field, where)
        keys[digest] = APIKey(name, digest, **limits)
        names.add(name)
    return keys


def read_keys(path: Path) -> dict[str, APIKey]:
    """The keys of the file at `path` (`parse_keys`); `KeyFileError` when it cannot be read."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the keys file {path}: {exc}") from exc
    return parse_keys(text, str(path))


class KeyRing:
    """The keys of one file, read again when it changes (`RELOAD_CHECK_PERIOD`). Thread-safe."""

    def __init__(self, path: Path | str, *, clock=time.monotonic):
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._keys = read_keys(self.path)  # a file that cannot be read at start is refused (the CLI says why)
        self._stamp = self._file_stamp()
        self._checked = clock()
        if not self._keys:
            logger.warning("the keys file %s holds no key: every request will be refused until one is added",
                           self.path)
        logger.info("API keys: %d read from %s", len(self._keys), self.path)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def __len__(self) -> int:
        return len(self._keys)

    def refresh(self, *, force: bool = False) -> None:
        """Read the file again if it changed since it was last read (at most once per check period)."""
        now = self._clock()
        with self._lock:
            if not force and now - self._checked < RELOAD_CHECK_PERIOD:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            if stamp is None:
                logger.error("the keys file %s is gone: keeping the %d keys read before (empty the file to revoke "
                             "every key)", self.path, len(self._keys))
                return
            try:
                keys = read_keys(self.path)
            except KeyFileError as exc:
                logger.error("%s: keeping the %d keys read before", exc, len(self._keys))
                return
            added = sorted(k.name for d, k in keys.items() if d not in self._keys)
            removed = sorted(k.name for d, k in self._keys.items() if d not in keys)
            self._keys = keys
            logger.info("API keys read again from %s: %d keys%s%s", self.path, len(keys),
                        f"; added {', '.join(added)}" if added else "",
                        f"; revoked {', '.join(removed)}" if removed else "")

    def lookup(self, key: str) -> APIKey | None:
        """The caller whose key is `key`, or None: found by the key's SHA-256, so no key is ever compared."""
        self.refresh()
        return self._keys.get(digest_of(key))
