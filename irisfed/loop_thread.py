"""An event loop of its own in a daemon thread: how :class:`irisfed.client.SyncClient` runs
the async client for code without ``asyncio``.

It works the same in a plain script and where a loop already runs (Jupyter, IPython):
the client's loop is never the caller's. Several threads may ``run`` at once; their
coroutines share the loop. Ctrl-C (``KeyboardInterrupt``) while waiting cancels the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import TypeVar

_T = TypeVar("_T")


class LoopThread:
    """An event loop of its own in a daemon thread; ``run`` a coroutine there and wait."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="irisfed-client", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[_T]) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C (KeyboardInterrupt) in a notebook: stop the work too
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


async def awaited(awaitable: Awaitable[_T]) -> _T:
    """``awaitable`` as a coroutine (what ``LoopThread.run`` takes)."""
    return await awaitable
