"""Running a service: signals, owned tasks, clean shutdown, clear start-up errors."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from irisfed.services.common import metrics
from irisfed.services.common.log import EventLogger
from irisfed.services.common.store import Store
from irisfed.shared.clock import Clock, as_clock
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import ConfigError, IrisfedError, Unavailable
from irisfed.shared.redact import redact

log = EventLogger("runtime")

# What a loop waits out rather than reports as a bug: Postgres away (the store says
# Unavailable) or a connection (NATS, Postgres while connecting) refused or timing out.
WAIT_OUT = (Unavailable, OSError, TimeoutError)

RECANCEL_S = 0.5  # TaskOwner.close: a task still running this long after a cancel is cancelled again
CLOSE_WAIT_S = 5.0  # TaskOwner.close: tasks still running after this are logged and left


async def wait_event(event: asyncio.Event, within_s: float) -> bool:
    """Whether ``event`` is set within ``within_s`` seconds.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11 that returns
    normally when the task is cancelled just as the event is set (CPython gh-86296),
    so a loop woken often (an agent flooded with assignments, a tick with heartbeats)
    could lose the cancellation of its shutdown and run on; the agent then outlived
    SIGTERM until the harness's SIGKILL. ``asyncio.timeout`` awaits in this task
    itself: a cancellation always arrives.
    """
    try:
        async with asyncio.timeout(within_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


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
        """Cancel every task and wait for it to end, cancelling again every
        ``RECANCEL_S`` one that goes on: a cancellation can be lost (see
        :func:`wait_event`), and a loop that lost one would otherwise run for ever and
        hold the process past its SIGTERM. After ``CLOSE_WAIT_S`` the rest are named in
        the log and left behind."""
        pending = set(self._tasks)
        deadline = asyncio.get_running_loop().time() + CLOSE_WAIT_S
        while pending:
            for task in pending:
                task.cancel()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                log.error("tasks_ignore_cancel", tasks=",".join(sorted(t.get_name() for t in pending)))
                return
            _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))


class Service:
    """What every service holds: the federation's configuration and subjects, its door to
    Postgres, its NATS client, its settings, its clock and its background tasks.

    ``pool``: a pool from ``irisfed.services.common.db.connect`` (or a ``Store`` over one; None
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
        await wait_event(wake, interval_s)
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
        if await wait_event(stop, delay):
            return None  # asked to stop while waiting to retry
        delay = min(max_delay, delay * 2)


def dump_tasks() -> None:
    """Every asyncio task's stack to stderr: where each coroutine waits (SIGUSR2)."""
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio tasks (SIGUSR2) ---", file=sys.stderr)
    for task in tasks:
        print(f"{task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a service's event loop: uvloop (``auto`` when it is installed) or asyncio's own.

    uvloop runs the same coroutines with its I/O in C. Every job crosses a dozen
    process hand-offs, each a wake-up of some service's loop: on this project's
    benchmark machine uvloop cut the router's and agents' CPU by 7–8% and one job's
    submit → running by 11% (docs/performance.md). ``asyncio`` is there to rule
    uvloop out when chasing a problem.
    """
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"event loop (--event-loop) must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("event loop uvloop (--event-loop uvloop) asked for, but uvloop is not installed "
                              "(pip install uvloop, or --event-loop asyncio)") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_service(main: Callable[[asyncio.Event], Awaitable[None]],
                loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop) -> int:
    """Run ``main(stop)`` on a loop from ``loop_factory`` until SIGTERM/SIGINT sets
    ``stop``; return a process exit code.

    Where a service that does not stop waits, it says on stderr: SIGUSR1 writes every
    thread's stack (faulthandler, in C: it works while the loop is blocked or after it
    has ended), SIGUSR2 every asyncio task's (while the loop runs).
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
        log.info("event_loop", loop=type(loop).__module__.split(".")[0])
        await main(stop)

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve())
    except IrisfedError as exc:
        print(f"irisfed: {redact(exc.message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
