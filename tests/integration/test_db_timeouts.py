"""Every wait on Postgres is bounded (services/common/db.py, DbTimeouts)."""

import asyncio

import pytest

from irisfed.services.common import db as dbmod
from irisfed.tooling.proxy import proxy_for


async def test_services_sessions_carry_the_server_side_limits(database_url):
    pool = await dbmod.connect(database_url, max_size=1)
    try:
        assert await pool.fetchval("SHOW statement_timeout") == "1min"
        assert await pool.fetchval("SHOW idle_in_transaction_session_timeout") == "1min"
    finally:
        await pool.close()


async def test_a_statement_on_a_hung_connection_times_out_client_side(database_url):
    proxy = proxy_for(database_url)
    pool = await dbmod.connect(proxy.url_for(database_url), max_size=1,
                               timeouts=dbmod.DbTimeouts(command_s=0.5, acquire_s=0.5))
    try:
        proxy.stall()
        with pytest.raises(dbmod.CONNECTION_ERRORS):
            await pool.fetchval("SELECT 1")
    finally:
        proxy.restore(drop=True)
        await pool.close()
        proxy.close()


async def test_waiting_for_a_free_connection_is_bounded(database_url):
    pool = await dbmod.connect(database_url, max_size=1, timeouts=dbmod.DbTimeouts(acquire_s=0.3))
    try:
        async with pool.acquire():
            with pytest.raises(TimeoutError):
                async with pool.acquire():
                    pass
        assert await pool.fetchval("SELECT 1") == 1  # the pool is fine afterwards
    finally:
        await pool.close()


async def test_server_side_limits_end_runaway_statements_and_hung_transactions(database_url):
    limits = dbmod.DbTimeouts(statement_s=0.2, idle_in_transaction_s=0.3)
    pool = await dbmod.connect(database_url, max_size=1, timeouts=limits)
    try:
        with pytest.raises(dbmod.CONNECTION_ERRORS):  # canceled by statement_timeout
            await pool.execute("SELECT pg_sleep(2)")
        with pytest.raises(dbmod.CONNECTION_ERRORS):  # the session is ended under us
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT 1")
                await asyncio.sleep(1.0)
                await conn.execute("SELECT 1")
        assert await pool.fetchval("SELECT 1") == 1  # a new connection replaces it
    finally:
        await pool.close()


def _two_hosts(database_url: str, first, second) -> str:
    """``database_url`` through two proxies, ``first``'s host listed first."""
    via_first = first.url_for(database_url)
    host = f"127.0.0.1:{first.port}"
    assert host in via_first
    return via_first.replace(host, f"{host},127.0.0.1:{second.port}", 1)


async def test_a_first_host_that_swallows_connections_does_not_starve_the_next(database_url):
    """A multi-host URL whose first host black-holes (accepts, never answers): each
    host gets a connect timeout of its own, and once the second served, new connections
    go to it first rather than waiting out the silent one every time."""
    silent, good = proxy_for(database_url), proxy_for(database_url)
    silent.stall()
    pool = None
    try:
        pool = await dbmod.connect(_two_hosts(database_url, silent, good), min_size=0, max_size=2,
                                   timeouts=dbmod.DbTimeouts(connect_s=0.5))
        assert await pool.fetchval("SELECT 1") == 1
        assert good.connections_seen() >= 1
        before = silent.connections_seen()
        async with pool.acquire() as a, pool.acquire() as b:  # two fresh connections
            assert await a.fetchval("SELECT 1") == await b.fetchval("SELECT 1") == 1
        assert silent.connections_seen() == before, "the silent host was tried again first"
    finally:
        if pool is not None:
            await pool.close()
        for proxy in (silent, good):
            proxy.restore(drop=True)
            proxy.close()


async def test_a_pooled_connection_to_a_host_that_hangs_is_replaced_by_one_to_the_next(database_url):
    """The primary the pool was connected to hangs and the other host now serves (a
    failover): a statement on the hung connection fails ``Unavailable``-kind, and the
    pool then reaches the other host instead of reusing the hung connection."""
    first, second = proxy_for(database_url), proxy_for(database_url)
    pool = await dbmod.connect(_two_hosts(database_url, first, second), min_size=1, max_size=1,
                               timeouts=dbmod.DbTimeouts(connect_s=0.5, command_s=0.5, acquire_s=2.0))
    try:
        assert await pool.fetchval("SELECT 1") == 1
        first.stall()
        with pytest.raises(dbmod.CONNECTION_ERRORS):
            await pool.fetchval("SELECT 1")
        answers = []
        for _ in range(3):
            try:
                answers.append(await pool.fetchval("SELECT 1"))
            except dbmod.CONNECTION_ERRORS as exc:
                answers.append(type(exc).__name__)
        assert answers[-1] == 1, f"the pool kept its hung connection: {answers}"
    finally:
        first.restore(drop=True)
        await pool.close()
        for proxy in (first, second):
            proxy.close()
