"""A `generate` streamer that notes when each token arrives, for tests and benchmarks that time generation."""

from __future__ import annotations

import time

from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """`times[i]`: when `generate` handed over its i-th `put` (`perf_counter`); the first is the prompt, the
    second the first generated token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass
