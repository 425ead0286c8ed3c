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
