"""Per-key limits of `swarmnode api`: generations a key runs at once, and tokens it uses per minute.

Each generation is admitted (`Limits.admit`) before it starts: refused with 429 and `Retry-After` when its key
already runs `sessions` generations, or when the tokens the key used in the last `WINDOW` seconds (prompts
as admitted, generated tokens as they come) leave no room for this prompt; `Retry-After` is when enough of
them leave the window (OpenAI's clients wait that long before they retry). A prompt larger than the whole
per-minute budget could never pass and gets a 400 instead. An admitted generation runs to its end even if
its tokens take the key past the budget: the key's next request waits. What each key runs and uses is
exported per key name in `/metrics` (`swarmnode.metrics.API_KEY_*`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from swarmnode import metrics
from swarmnode.api.keys import APIKey
from swarmnode.api.schemas import APIError

__all__ = ["WINDOW", "Admission", "Limits"]

#: the span (s) over which `tokens_per_minute` counts tokens
WINDOW = 60.0


@dataclass
class _Usage:
    sessions: int = 0
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens), oldest first
    total: int = 0  # sum of `spent`


class Admission:
    """One admitted generation of a key: `spend` records its generated tokens, `close` ends it (idempotent)."""

    def __init__(self, limits: Limits, key: APIKey):
        self._limits, self.key, self._open = limits, key, True

    def spend(self, tokens: int) -> None:
        if tokens > 0:
            self._limits._spend(self.key, tokens)
            metrics.API_KEY_TOKENS.labels(self.key.name, "completion").inc(tokens)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._limits._release(self.key)


class Limits:
    """The usage of every key, against its `APIKey` limits. Thread-safe; `clock` is injectable for tests."""

    def __init__(self, *, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}

    def _window(self, usage: _Usage, now: float) -> int:
        while usage.spent and usage.spent[0][0] <= now - WINDOW:
            usage.total -= usage.spent.popleft()[1]
        return usage.total

    def used(self, key: APIKey) -> tuple[int, int]:
        """(generations running, tokens used in the last `WINDOW` s) of `key`."""
        with self._lock:
            usage = self._usage.setdefault(key.name, _Usage())
            return usage.sessions, self._window(usage, self._clock())

    def admit(self, key: APIKey, prompt_tokens: int) -> Admission:
        """Admit one generation of `key` with a prompt of `prompt_tokens`, or raise `APIError` (429 with
        `Retry-After`, or 400 for a prompt larger than the key's whole per-minute budget)."""
        with self._lock:
            now = self._clock()
            usage = self._usage.setdefault(key.name, _Usage())
            if key.sessions is not None and usage.sessions >= key.sessions:
                raise APIError(429, f"the API key {key.name!r} runs {usage.sessions} generations now, its limit "
                                    f"(sessions={key.sessions}): retry when one of them finishes",
                               type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})
            budget = key.tokens_per_minute
            if budget is not None:
                if prompt_tokens > budget:
                    raise APIError(400, f"the prompt has {prompt_tokens} tokens, more than the API key {key.name!r} "
                                        f"may use in a minute ({budget}): shorten it", type="tokens",
                                   code="rate_limit_exceeded")
                used = self._window(usage, now)
                if used + prompt_tokens > budget:
                    wait = self._wait(usage, used + prompt_tokens - budget, now)
                    raise APIError(429, f"the API key {key.name!r} used {used} of its {budget} tokens per minute; "
                                        f"this prompt needs {prompt_tokens}: retry in {wait} s",
                                   type="tokens", code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
            usage.sessions += 1
            usage.spent.append((now, prompt_tokens))
            usage.total += prompt_tokens
            sessions = usage.sessions
        metrics.API_KEY_SESSIONS.labels(key.name).set(sessions)
        metrics.API_KEY_TOKENS.labels(key.name, "prompt").inc(prompt_tokens)
        return Admission(self, key)

    @staticmethod
    def _wait(usage: _Usage, excess: int, now: float) -> int:
        """Whole seconds until `excess` tokens have left the window."""
        freed = 0
        for when, tokens in usage.spent:
            freed += tokens
            if freed >= excess:
                return max(1, math.ceil(when + WINDOW - now))
        return max(1, math.ceil(WINDOW))

    def _spend(self, key: APIKey, tokens: int) -> None:
        with self._lock:
            usage = self._usage.setdefault(key.name, _Usage())
            usage.spent.append((self._clock(), tokens))
            usage.total += tokens

    def _release(self, key: APIKey) -> None:
        with self._lock:
            usage = self._usage.setdefault(key.name, _Usage())
            usage.sessions = max(0, usage.sessions - 1)
            sessions = usage.sessions
        metrics.API_KEY_SESSIONS.labels(key.name).set(sessions)
