"""A write refused by a read-only server (SQLSTATE 25006: a standby after a failover, or
a URL that reached a replica) is ``Unavailable`` — retried, never set aside as a
permanent error — and retires the pool's connections, so the next write, once the
primary is back at that address, goes through without a restart (services/common/store.py).

Read-only here: ``ALTER DATABASE ... SET default_transaction_read_only`` — every session
opened meanwhile stays read-only for its whole life (``RESET ALL`` keeps it), exactly
as a connection to a standby does.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.errors import Unavailable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from tests.infra.factories import insert_jobs, make_job


async def _read_only(database_url: str, on: bool) -> None:
    name = urlsplit(database_url).path.lstrip("/")
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SET default_transaction_read_only = off")  # this admin session writes
        if on:
            await conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        else:
            await conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    finally:
        await conn.close()


async def test_a_write_refused_read_only_is_unavailable_and_the_pool_finds_the_writable_server_again(database_url):
    job = make_job()
    await _read_only(database_url, True)
    pool = await dbmod.connect(database_url, max_size=2)
    try:
        store = Store(pool)
        assert await store.job_get("nothing") is None  # reads work on a standby
        with pytest.raises(Unavailable):
            await store.job_request_cancel("nothing")
        with pytest.raises(Unavailable):  # inside a transaction too (the tick's, the router's)
            await insert_jobs(store, [job])
        with pytest.raises(Unavailable):
            async with store.transaction() as tx:
                await tx.job_move(Move(job.job_id, JobState.QUEUED, JobState.KILLED, 0, actor="test", owner_peer_id=None))
        held = await store.hold()
        try:
            with pytest.raises(Unavailable):  # a held connection (a router writer's)
                await held.job_request_cancel("nothing")
        finally:
            await held.release()

        await _read_only(database_url, False)  # "the primary is back"
        # asyncpg's pool reopens its min_size connections as soon as they are retired —
        # while the server still refused writes — so one more write may be refused (and
        # retire them again); the one after goes through, with no restart.
        for attempt in range(2):
            try:
                await insert_jobs(store, [job])
                break
            except Unavailable:
                assert attempt == 0, "still refused twice after the server became writable"
        assert (await store.job_get(job.job_id)).state is JobState.QUEUED
        await store.job_request_cancel(job.job_id)
        assert (await store.job_get(job.job_id)).cancel_requested
    finally:
        await pool.close()
        await _read_only(database_url, False)
