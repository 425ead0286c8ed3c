"""Small probes the integration tests poll or ask with: a request/reply answer as
JSON, a job's changelog as tuples, whether a job is in a state."""

from __future__ import annotations

import json

from irisfed.services.common.store import Store

ASK_TIMEOUT_S = 30  # bounds a hang on a slow machine; never an assertion about time


async def returns(value):
    """An awaitable of ``value`` (for wait_for, which polls a coroutine function)."""
    return value


async def ask(nc, prefix: str, verb: str, body: dict) -> dict:
    """Request ``<prefix>.<verb>`` with ``body`` and decode the reply."""
    reply = await nc.request(f"{prefix}.{verb}", json.dumps(body).encode(), timeout=ASK_TIMEOUT_S)
    return json.loads(reply.data)


async def changelog_of(pool, job_id: str) -> list[tuple]:
    """``(seq, from_state, to_state, epoch)`` of every changelog row of ``job_id``, in order."""
    return [tuple(r) for r in await pool.fetch(
        "SELECT seq, from_state, to_state, epoch FROM federation_changelog WHERE job_id = $1 ORDER BY seq", job_id)]


async def in_state(store: Store, job_id: str, state: str) -> bool:
    row = await store.job_get(job_id)
    return row is not None and row.state == state
