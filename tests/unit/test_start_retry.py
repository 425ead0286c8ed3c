"""A service whose start-up meets Postgres away (or hung) starts again, rather than exit."""

import asyncio

import pytest

from irisfed.services.common.runtime import start_with_retry
from irisfed.shared.errors import PermanentStoreError, Unavailable


async def test_start_is_retried_while_postgres_is_away_then_succeeds():
    # Connecting fails (refused, timed out), or the store says Postgres is away
    # (its translation of every transient driver error).
    failures = [ConnectionResetError("reset"), TimeoutError(), Unavailable("down"),
                Unavailable("database unavailable: connection was closed in the middle of operation")]
    attempts = []

    async def attempt():
        attempts.append(1)
        if failures:
            raise failures.pop(0)
        return "started"

    assert await start_with_retry(attempt, asyncio.Event(), "test", max_delay=0.01) == "started"
    assert len(attempts) == 5


async def test_other_errors_are_not_retried():
    async def attempt():
        raise PermanentStoreError("permission denied for table jobs", "InsufficientPrivilegeError", "42501")

    with pytest.raises(PermanentStoreError):
        await start_with_retry(attempt, asyncio.Event(), "test")


async def test_a_stop_while_waiting_to_retry_ends_it():
    stop = asyncio.Event()

    async def attempt():
        stop.set()
        raise ConnectionRefusedError("down")

    assert await start_with_retry(attempt, stop, "test") is None
