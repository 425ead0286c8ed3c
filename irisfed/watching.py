"""Watching a job (:meth:`irisfed.client.Client.watch`): its changelog, read again on every cue.

The events come from the job's changelog in Postgres (the durable record of every
hand-off; without a database URL, read through the router: :mod:`irisfed.remote_reads`),
read again whenever the watcher is woken (``wake``: an event of the job arrived, NATS
reconnected) and every poll interval, so an event missed while NATS was away is never
missed here. Each entry is yielded once, in order, as a :class:`~shared.messages.JobEvent`;
the watch ends after the terminal one. A transient failure to read is waited out (read
again within ``RETRY_READ_S``); any other is raised, as is :class:`NotFoundError` for a
job that does not exist. Listening for the cues is the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from irisfed.errors import NotFoundError, translated
from irisfed.jobs import job_event
from irisfed.shared.errors import IrisfedError
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.shared.messages import JobEvent

log = logging.getLogger("irisfed.client")
RETRY_READ_S = 1.0  # a watch whose read of Postgres failed tries again this soon


async def changelog_events(store: Any, stored: str, job_id: str, *, history: bool, wake: asyncio.Event,
                           poll_interval: float) -> AsyncIterator[JobEvent]:
    """The job stored as ``stored`` (shown as ``job_id``), each state change once, read from
    ``store`` (``JobReads`` or ``RemoteReads``) on every ``wake`` and every ``poll_interval``
    seconds; from its first state with ``history``, else from its current one."""
    last_seq: int | None = None
    while True:
        wake.clear()
        pause = poll_interval
        try:
            # The changelog first: the job row read after it is at least as new, so a
            # terminal entry finds the job's exit code and reason there.
            entries = await store.changelog_list_for_job(stored)
            job = await store.job_get(stored)
        except IrisfedError as exc:
            error = translated(exc)
            if not error.retryable:
                raise error from None
            log.info("irisfed client: watching %s: %s; trying again", job_id, error)
            pause = min(pause, RETRY_READ_S)
        else:
            if job is None:
                raise NotFoundError(f"no job {job_id!r}")
            if entries and last_seq is None and not history:
                last_seq = entries[-1].seq - 1
            for entry in entries:
                if last_seq is None or entry.seq > last_seq:
                    last_seq = entry.seq
                    yield job_event(job_id, entry, job)
            if entries and entries[-1].to_state in TERMINAL_STATES:
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=pause)
