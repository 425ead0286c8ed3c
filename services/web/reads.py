"""What each page reads, and the caches every viewer shares.

Pages re-fetch their fragments whenever something changes, so many viewers ask at
once: what the federation, users and charts pages read is loaded by one caller at a
time and shared for a short while (``Shared``); a job list page and a job are read
per request (each an index range: cheap). A job's log tail is read from the log
stream of the peer its run is on (docs/design.md §3.6), never from a peer's disk,
within LOG_READ_TIMEOUT_S (NATS away: the page says the logs cannot be read now).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import msgspec

from irisfed.services.common.logstore import LogStore
from irisfed.services.common.objects import ObjectStoreError
from irisfed.services.common.store import Store
from irisfed.services.web import charts
from irisfed.services.web.filters import JobFilter
from irisfed.shared.logs import assemble, log_subject
from irisfed.shared.records import (
    ChangelogEntry,
    DependencyRow,
    JobListRow,
    JobRow,
    OldestQueued,
    OutputRow,
    QueueClass,
    TaskRow,
)

_T = TypeVar("_T")

QUEUE_CLASSES = 8  # the largest (pin, constraints) classes on the federation page; the rest as "other"
LOG_FILES = ("stdout", "stderr")
LOG_READ_TIMEOUT_S = 2.0


class Shared(Generic[_T]):
    """A value loaded by one caller at a time and reused by everyone for ``ttl_s``.

    A failed load is not kept: the next caller tries again.
    """

    def __init__(self, load: Callable[[], Awaitable[_T]], ttl_s: float, clock: Callable[[], float]) -> None:
        self._load = load
        self.ttl_s = ttl_s
        self._clock = clock
        self._value: _T | None = None
        self._until = float("-inf")
        self._lock = asyncio.Lock()

    def expire(self) -> None:
        """The next ``get`` loads afresh."""
        self._until = float("-inf")

    def _fresh(self) -> bool:
        return self._value is not None and self._clock() < self._until

    async def get(self) -> _T:
        if self._fresh():
            return self._value  # type: ignore[return-value]
        async with self._lock:
            if not self._fresh():
                value = await self._load()
                self._value, self._until = value, self._clock() + self.ttl_s
            return self._value  # type: ignore[return-value]


# ---------------------------------------------------------------- the federation page


@dataclass(frozen=True)
class Queue:
    """The federation's queue: live counts, classes, the oldest waiting job."""

    live: dict[str, int]
    classes: list[QueueClass]
    oldest: OldestQueued | None


@dataclass(frozen=True)
class UserUsage:
    """Every user's live jobs: what they hold (units, shared.users; ``slots``: how many)
    and how many are queued, assigned and running (users with none are absent)."""

    held: dict[str, dict[str, int]]
    counts: dict[str, dict[str, int]]


class FederationReads:
    def __init__(self, store: Store, snapshot_s: float, totals_s: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.queue = Shared(self._queue, snapshot_s, clock)
        self.totals = Shared(store.job_count_by_state, totals_s, clock)
        self.users = Shared(self._users, snapshot_s, clock)

    async def _queue(self) -> Queue:
        return Queue(await self.store.job_count_live_by_state(),
                     await self.store.job_count_queued_by_class(QUEUE_CLASSES),
                     await self.store.job_get_oldest_queued())

    async def _users(self) -> UserUsage:
        return UserUsage(await self.store.job_live_usage_by_user(), await self.store.job_count_by_user())


# ---------------------------------------------------------------- the job list


@dataclass(frozen=True)
class JobPage:
    rows: list[JobListRow]
    next_after: tuple[datetime, str] | None  # the cursor of the next (older) page, None: last page


async def job_page(store: Store, jobs: JobFilter, size: int) -> JobPage:
    rows = await store.job_list_page(jobs.query(size + 1))
    if len(rows) > size:
        rows = rows[:size]
        return JobPage(rows, (rows[-1].submitted_at, rows[-1].job_id))
    return JobPage(rows, None)


# ---------------------------------------------------------------- one job


@dataclass(frozen=True)
class LogTail:
    name: str  # stdout or stderr
    text: str | None  # None: not readable from here
    size: int
    cut: bool  # only the end is shown


@dataclass(frozen=True)
class JobStory:
    job: JobRow
    history: list[ChangelogEntry]
    logs: list[LogTail]
    # The stored explanation when it is not an object (an older version or a hand wrote
    # it): ``job.explanation`` is then None and the page shows this as text.
    odd_explanation: Any = None
    tasks: list[TaskRow] = field(default_factory=list)  # a gang's newest run's tasks
    outputs: list[OutputRow] = field(default_factory=list)  # the newest run's output files (§3.5)
    after: list[DependencyRow] = field(default_factory=list)  # the jobs it waits for (§3.8)
    dependents: list[DependencyRow] = field(default_factory=list)  # the jobs that wait for it

    @property
    def logs_readable(self) -> bool:
        return any(tail.text is not None for tail in self.logs)


async def job_story(store: Store, job_id: str, tail_bytes: int,
                    log_stores: Callable[[str], LogStore] | None = None) -> JobStory | None:
    odd = None
    try:
        job = await store.job_get(job_id)
    except msgspec.ValidationError:
        found = await job_with_odd_explanation(store, job_id)
        if found is None:
            raise  # not the explanation's fault
        job, odd = found
    if job is None:
        return None
    history = await store.changelog_list_for_job(job_id)
    logs = await read_logs(log_stores, job, tail_bytes) if job.log_dir and job.owner_peer_id else []
    tasks = await store.job_tasks_list(job_id) if job.replicas > 1 else []
    newest = tasks[0].epoch if tasks else None
    outputs = await store.job_outputs_list(job_id)
    return JobStory(job, history, logs, odd, [t for t in tasks if t.epoch == newest], outputs,
                    await store.job_dependencies_of(job_id), await store.job_dependents_of(job_id))


async def job_with_odd_explanation(store: Store, job_id: str) -> tuple[JobRow | None, Any] | None:
    """``job_get``'s row when its explanation is not an object (which ``JobRow`` refuses):
    the row without it, and the explanation as stored (None: the explanation is not
    what is odd about the row)."""
    record = await store._fetchrow("job_get", job_id)  # the same named query, read raw
    if record is None:
        return None, None
    values = dict(record.items())
    odd = values.get("explanation")
    if odd is None or isinstance(odd, dict):
        return None
    values["explanation"] = None
    return JobRow.from_record([values[name] for name in JobRow.__struct_fields__]), odd


async def read_logs(log_stores: Callable[[str], LogStore] | None, job: JobRow, tail_bytes: int) -> list[LogTail]:
    """The tails of the job's newest run's stdout and stderr (task 0's for a gang), from
    its peer's log stream; not readable (None) when there is no NATS or it does not
    answer in time."""
    if log_stores is None:
        return [LogTail(name, None, 0, False) for name in LOG_FILES]
    store = log_stores(job.owner_peer_id)

    async def one(name: str) -> LogTail:
        subject = log_subject(store.prefix, job.owner_peer_id, job.job_id, job.epoch, 0, name)
        pieces, size = await store.tail(subject, tail_bytes)
        start = max(0, size - tail_bytes)
        data, _, _ = assemble(pieces, start)
        if start > 0 and b"\n" in data:
            data = data[data.index(b"\n") + 1:]  # from the first whole line
        return LogTail(name, data.decode("utf-8", "replace"), size, start > 0)
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(one(name) for name in LOG_FILES)), LOG_READ_TIMEOUT_S))
    except (TimeoutError, ObjectStoreError):
        return [LogTail(name, None, 0, False) for name in LOG_FILES]


# ---------------------------------------------------------------- the charts


class ChartSource:
    """The charts' data, refreshed at most every ``ttl_s``.

    Minutes older than ``charts.SETTLE`` no longer change: they are kept, and each
    refresh reads only the changelog since then (its start found by bisecting
    positions, as ``at`` has no index), so a refresh costs the last few minutes'
    changes, however busy the hour was.
    """

    def __init__(self, store: Store, ttl_s: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.shared = Shared(self._refresh, ttl_s, clock)
        self._kept: dict[int, charts.Minute] = {}
        self._last_now: datetime | None = None

    async def get(self) -> dict:
        return await self.shared.get()

    async def _refresh(self) -> dict:
        bounds = await self.store.changelog_get_bounds()
        now = bounds.now
        first = charts.window_start(now)
        since = first
        if self._last_now is not None and now - self._last_now < timedelta(minutes=charts.WINDOW_MIN - 10):
            since = max(first, charts.minute_of(self._last_now - charts.SETTLE))
        since_at = datetime.fromtimestamp(since, now.tzinfo)
        from_seq = 0
        if bounds.first_seq is not None and bounds.last_seq is not None:
            from_seq = await charts.first_seq_from(self.store.changelog_get_first_from_seq, bounds.first_seq,
                                                   bounds.last_seq, since_at - charts.SEQ_MARGIN)
        counts = await self.store.changelog_count_by_minute(from_seq, since_at)
        submits = await self.store.job_count_submitted_by_minute(since_at)
        fresh, queued_now, running_now = charts.fold(counts, submits)
        self._kept = charts.merge(self._kept, fresh, since, first)
        self._last_now = now
        return charts.series(now, self._kept, queued_now, running_now)
