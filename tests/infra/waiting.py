"""Waiting on conditions (never sleeping a fixed time and hoping)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Generous: these bound a hang on a slow shared machine; they are not assertions.
DEFAULT_TIMEOUT_S = 60.0


async def wait_for(
    probe: Callable[[], Awaitable[T]], what: str, timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.05,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
