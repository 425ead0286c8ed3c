"""Small probes the tests poll or ask with: a request/reply answer as JSON, a job's
changelog as tuples, whether a job is in a state, whether a process runs (and ending
its process group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from irisfed.services.common.store import Store

ASK_TIMEOUT_S = 30  # bounds a hang on a slow machine; never an assertion about time


async def returns(value):
    """An awaitable of ``value`` (for wait_for, which polls a coroutine function):
    ``wait_for(lambda: returns(x == y), ...)``."""
    return value


async def ask(nc, prefix: str, verb: str, body: dict) -> dict:
    """Request ``<prefix>.<verb>`` with ``body`` and decode the reply."""
    reply = await nc.request(f"{prefix}.{verb}", json.dumps(body).encode(), timeout=ASK_TIMEOUT_S)
    return json.loads(reply.data)


async def changelog_of(pool, job_id: str) -> list[tuple]:
    """``(seq, from_state, to_state, epoch)`` of every changelog row of ``job_id``, in order."""
    return [tuple(r) for r in await pool.fetch(
        "SELECT seq, from_state, to_state, epoch FROM federation_changelog WHERE job_id = $1 ORDER BY seq", job_id)]


async def history_of(pool, job_id: str) -> list[tuple[str, str, str]]:
    """``(from_state, to_state, detail)`` of every changelog row of ``job_id``, in order."""
    rows = await pool.fetch("SELECT from_state, to_state, detail FROM federation_changelog WHERE job_id = $1 "
                            "ORDER BY seq", job_id)
    return [(r["from_state"], r["to_state"], r["detail"]) for r in rows]


async def in_state(store: Store, job_id: str, state: str) -> bool:
    row = await store.job_get(job_id)
    return row is not None and row.state == state


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_group(pid: int) -> None:
    """SIGKILL process group ``pid`` (a run's: backends start each in its own session) if
    its leader still runs; gone meanwhile is fine."""
    if alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
