"""Cleaning up a failed start closes NATS without hiding why the start failed.

A chaos run in CI caught it: an agent's first reconcile failed while Postgres
restarted (Unavailable: retried), but nats-py's ``close`` then raised CancelledError
from its transport, which replaced the Unavailable and ended the agent (exit 1).
"""

import asyncio

import pytest

from irisfed.services.common.bus import close_quietly


class _Closing:
    def __init__(self, fails_with: BaseException | None = None, hangs: bool = False) -> None:
        self.fails_with, self.hangs, self.closed = fails_with, hangs, False

    async def close(self) -> None:
        self.closed = True
        if self.hangs:
            await asyncio.sleep(3600)
        if self.fails_with is not None:
            raise self.fails_with


@pytest.mark.parametrize("failure", [asyncio.CancelledError(), RuntimeError("transport gone"), None])
async def test_a_close_that_fails_by_itself_is_not_raised(failure):
    nc = _Closing(failure)
    await close_quietly(nc)
    assert nc.closed


async def test_a_cancellation_of_the_closing_task_is_passed_on():
    nc = _Closing(hangs=True)
    task = asyncio.create_task(close_quietly(nc))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_start_failure_stays_the_one_raised():
    """The pattern startup.attempt uses: the first error wins over the close's."""
    from irisfed.shared.errors import Unavailable

    nc = _Closing(asyncio.CancelledError())

    async def attempt():
        try:
            raise Unavailable("database unavailable: connection was closed in the middle of operation")
        except BaseException:
            await close_quietly(nc)
            raise

    with pytest.raises(Unavailable):
        await attempt()
