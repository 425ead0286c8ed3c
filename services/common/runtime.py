"""Running a service: signals, owned tasks, clean shutdown, clear start-up errors."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.common import metrics
from services.common.log import EventLogger
from services.common.redact import redact
from services.common.store import Store
from shared.clock import Clock, as_clock
from shared.config import FederationConfig
from shared.errors import IrisfedError, Unavailable

log = EventLogger("runtime")

# What a loop waits out rather than reports as a bug: Postgres away (the store says
# Unavailable) or a connection (NATS, Postgres while connecting) refused or timing out.
WAIT_OUT = (Unavailable, OSError, TimeoutError)


class TaskOwner:
    """Owns a service's background tasks; ``close`` cancels and awaits them all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Loops are written never to end; one that did is a bug worth shouting about.
            log.error("task_died", task=task.get_name(), error=repr(task.exception()))

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Service:
    """What every service holds: the federation's configuration and subjects, its door to
    Postgres, its NATS client, its settings, its clock and its background tasks.

    ``pool``: a pool from ``services.common.db.connect`` (or a ``Store`` over one; None
    in unit tests that never reach Postgres). ``clock``: a ``Clock`` (default: the
    system's); a bare ``() -> float`` is taken as its monotonic reading.
    """

    def __init__(self, config: FederationConfig, pool: Any, nc: Any, settings: Any,
                 clock: Clock | Callable[[], float] | None = None) -> None:
        self.config = config
        self.subjects = config.subjects
        self.store = pool if isinstance(pool, Store) else Store(pool)
        self.nc = nc
        self.settings = settings
        self.clock = as_clock(clock)
        self.tasks = TaskOwner()


async def forever(name: str, step: Callable[[], Awaitable[None]], interval_s: float) -> None:
    """Run ``step`` every ``interval_s``; one failure is logged, never fatal to the loop."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - background loops never die on one error
            log.error("loop_step_failed", loop=name, error=repr(exc))
        await asyncio.sleep(interval_s)


async def when_woken(
    name: str,
    step: Callable[[], Awaitable[None]],
    wake: asyncio.Event,
    interval_s: float,
    on_db_back: Callable[[], None] | None = None,
) -> None:
    """Run ``step`` whenever ``wake`` is set, and at least every ``interval_s``.

    One failure never ends the loop: Postgres being away is a warning (and
    ``on_db_back`` runs after the first success once it answers again); anything
    else is an error. After a failure the loop pauses briefly, so a stream of
    wake-ups cannot turn it into a busy retry.
    """
    db_down = False
    while True:
        try:
            await asyncio.wait_for(wake.wait(), timeout=interval_s)
        except TimeoutError:
            pass
        wake.clear()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except WAIT_OUT as exc:
            metrics.DB_UNAVAILABLE.inc()
            log.warning("db_unavailable", loop=name, error=str(exc))
            db_down = True
        except Exception as exc:  # noqa: BLE001 - background loops never die on one error
            log.error("loop_step_failed", loop=name, error=repr(exc))
        else:
            if db_down:
                db_down = False
                if on_db_back is not None:
                    on_db_back()
            continue
        await asyncio.sleep(min(1.0, interval_s))


async def start_with_retry(attempt: Callable[[], Awaitable[Any]], stop: asyncio.Event, name: str,
                           max_delay: float = 5.0) -> Any:
    """``attempt()`` until it does not fail for Postgres being away; None if stopped meanwhile.

    A service whose start-up reads Postgres (its first view, an agent's first
    reconcile) must not exit because Postgres restarted or hung at that moment.
    ``attempt`` undoes what it did before it raises; any other error is raised.
    """
    delay = 0.2
    while True:
        try:
            return await attempt()
        except WAIT_OUT as exc:
            if stop.is_set():
                return None  # shutting down anyway
            metrics.DB_UNAVAILABLE.inc()
            log.warning("start_retry", service=name, error=repr(exc), retry_in_s=delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return None  # asked to stop while waiting to retry
        except TimeoutError:
            delay = min(max_delay, delay * 2)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop)`` until SIGTERM/SIGINT sets ``stop``; return a process exit code."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(runner())
    except IrisfedError as exc:
        print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
