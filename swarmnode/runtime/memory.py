"""Giving freed session memory back to the operating system.

A closed session's KV cache is freed by torch, but glibc's allocator keeps freed heap pages for reuse: after
the first large block is freed its mmap threshold rises, so later cache tensors come from the heap, and a
node that has served many sessions of different sizes would hold the high-water mark of all of them as
resident memory. `malloc_trim(0)` returns free pages in every arena to the kernel. `TrimScheduler` runs it once
shortly after a burst of session closes (not after each one: a trim walks the heaps). On other C libraries
(no `malloc_trim`) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> bool:
    """Return the C heap's free pages to the kernel; False where the C library cannot."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class TrimScheduler:
    """Trim `delay` seconds after the last of a burst of `soon()` calls, on the running event loop."""

    def __init__(self, delay: float = 1.0):
        self.delay = delay
        self._handle: asyncio.TimerHandle | None = None
        self.trims = 0

    def soon(self) -> None:
        if _MALLOC_TRIM is None:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_later(self.delay, self._trim)

    def _trim(self) -> None:
        self._handle = None
        release_free_memory()
        self.trims += 1
