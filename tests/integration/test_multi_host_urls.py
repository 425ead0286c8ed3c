"""Several hosts in one database URL (libpq's ``h1:p1,h2:p2``), as an HA set-up gives.

The first host refuses (nothing listens there): migrations, the services' pools and
``target_session_attrs=read-write`` must move on to the next host, from the same URL
every service takes.
"""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit, urlunsplit

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_a_dead_host_first(url: str) -> str:
    parts = urlsplit(url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    hosts = f"127.0.0.1:{_closed_port()},{hostport}"
    query = "&".join(q for q in (parts.query, "target_session_attrs=read-write") if q)
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{hosts}" if userinfo else hosts, query=query))


async def test_migrate_and_the_services_pool_take_a_multi_host_url(empty_database_url):
    url = with_a_dead_host_first(empty_database_url)
    assert url.count(",") == 1 and "target_session_attrs=read-write" in url
    await asyncio.to_thread(dbmod.migrate, url)
    pool = await dbmod.connect(url, max_size=2)  # checks the schema head: the migration landed
    try:
        assert await Store(pool).job_list_queued_users() == {}
    finally:
        await pool.close()
    await asyncio.to_thread(dbmod.downgrade, url, "base")


async def test_a_write_refused_by_a_read_only_server_is_retried_on_fresh_connections(database_url, pool):
    """A server that turned read-only (a primary demoted in a failover; here: the
    database's default_transaction_read_only) refuses writes with SQLSTATE 25006: that is
    ``unavailable`` (a retry), and every pooled connection is retired, so the next ones
    are opened afresh (to the new primary, in a real failover)."""
    from irisfed.shared.errors import Unavailable
    from tests.infra.factories import insert_jobs, make_job

    own = await dbmod.connect(database_url, max_size=3)
    store = Store(own)
    dbname = urlsplit(database_url).path.lstrip("/")
    try:
        await insert_jobs(store, [make_job()])  # pooled connections, writable
        await pool.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
        await own.expire_connections()  # (its next connections read the setting)
        try:
            import pytest

            with pytest.raises(Unavailable):
                await insert_jobs(store, [make_job()])
        finally:
            await pool.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = off')
        # The refusal retired the read-only connections: the retry writes.
        done = make_job()
        await insert_jobs(store, [done])
        assert (await store.job_get(done.job_id)).state == "queued"
    finally:
        await own.close()
