"""A private asyncio loop on a background thread: the client's sync API runs hivemind's async calls there.

Every wait on it has a timeout, and nothing here is ever called from the loop itself or from a finalizer
(a finalizer that blocks on the loop it runs on deadlocks: sessions are closed explicitly instead).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class LoopThread:
    def __init__(self, name: str = "swarmnode-client-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop: this would deadlock")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it, join the thread and close the loop."""
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            try:
                self.run(self._cancel_pending(), timeout=10)
            except TimeoutError:  # a task ignored its cancellation: the loop is stopped below regardless
                logger.debug("tasks on the client loop did not finish cancelling in 10 s")
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    @staticmethod
    async def _cancel_pending() -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
