"""Migrations against real Postgres: up, down, up again; the start-up schema check."""

import asyncio

import asyncpg
import pytest

from services.common import db as dbmod
from shared.errors import SchemaMismatch

TABLES = {"jobs", "federation_changelog", "federation_sync_state", "peer_heartbeat", "peer_roles"}


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows} - {"alembic_version"}
    finally:
        await conn.close()


async def _indexes(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")
        return {r["indexname"] for r in rows}
    finally:
        await conn.close()


async def test_upgrade_downgrade_twice(empty_database_url):
    url = empty_database_url
    for _ in range(2):
        await asyncio.to_thread(dbmod.migrate, url)
        assert await _tables(url) == TABLES
        assert {"jobs_queued_by_priority", "jobs_live_by_owner", "federation_changelog_by_job"} <= await _indexes(url)
        await asyncio.to_thread(dbmod.downgrade, url, "base")
        assert await _tables(url) == set()


async def test_services_refuse_a_database_without_schema(empty_database_url):
    with pytest.raises(SchemaMismatch, match="run `irisfed migrate`"):
        await dbmod.connect(empty_database_url)


async def test_services_refuse_a_database_at_another_revision(database_url):
    conn = await asyncpg.connect(database_url)
    await conn.execute("UPDATE alembic_version SET version_num = 'abc123'")
    await conn.close()
    with pytest.raises(SchemaMismatch, match="at schema revision abc123 but this irisfed needs"):
        await dbmod.connect(database_url)


async def test_head_database_is_accepted(database_url):
    pool = await dbmod.connect(database_url)
    try:
        assert await pool.fetchval("SELECT version_num FROM alembic_version") == dbmod.schema_head()
    finally:
        await pool.close()


async def test_changelog_is_append_only(pool):
    await pool.execute(
        "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, submit_reply) "
        "VALUES ('j', '{}', 'h', 'queued', 'queue', '{}')"
    )
    await pool.execute(
        "INSERT INTO federation_changelog (job_id, to_state, epoch, actor) VALUES ('j', 'queued', 0, 'test')"
    )
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await pool.execute("UPDATE federation_changelog SET detail = 'rewritten'")


async def test_database_rejects_unknown_states(pool):
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(
            "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, submit_reply) "
            "VALUES ('j', '{}', 'h', 'paused', 'queue', '{}')"
        )
