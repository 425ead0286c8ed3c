"""Migrations against real Postgres: up, down, up again; the start-up schema check."""

import asyncio
import contextlib
import json

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.errors import SchemaMismatch

TABLES = {"jobs", "federation_changelog", "federation_sync_state", "peer_heartbeat", "peer_roles", "job_explanations",
          "job_listing", "job_tasks", "job_outputs", "job_dependencies", "job_arrays"}


async def _names(url: str, query: str) -> set[str]:
    """The first column of ``query``'s rows, on a connection of its own."""
    conn = await asyncpg.connect(url)
    try:
        return {r[0] for r in await conn.fetch(query)}
    finally:
        await conn.close()


async def _tables(url: str) -> set[str]:
    return await _names(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'") - {"alembic_version"}


async def _indexes(url: str) -> set[str]:
    return await _names(url, "SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")


@contextlib.asynccontextmanager
async def _pool_at(url: str, revision: str):
    """The database at ``url`` migrated to ``revision``, and a small pool on it that does
    not check the schema; closed at the end."""
    await asyncio.to_thread(dbmod.migrate, url, revision)
    pool = await dbmod.connect(url, max_size=2, check=False)
    try:
        yield pool
    finally:
        await pool.close()


async def _finish_function(pool) -> tuple:
    """``irisfed_job_finish_batch`` as Postgres keeps it: its source, settings and rights."""
    return tuple(await pool.fetchrow(
        "SELECT prosrc, proconfig::text, prosecdef, proowner, proacl::text FROM pg_proc "
        "WHERE proname = 'irisfed_job_finish_batch'"))


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
        "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
        "VALUES ('j', '{}', 'h', 'queued', 'queue')"
    )
    await pool.execute(
        "INSERT INTO federation_changelog (job_id, to_state, epoch, actor) VALUES ('j', 'queued', 0, 'test')"
    )
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await pool.execute("UPDATE federation_changelog SET detail = 'rewritten'")


async def test_database_rejects_unknown_states(pool):
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(
            "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
            "VALUES ('j', '{}', 'h', 'paused', 'queue')"
        )


async def test_0008_moves_explanations_out_of_job_rows_and_back(empty_database_url):
    url = empty_database_url
    await asyncio.to_thread(dbmod.migrate, url, "0007")
    conn = await asyncpg.connect(url)
    verdicts = [{"peer_id": "gpu-west", "code": "missing_attribute", "detail": "no device_type"}]
    shared_doc = {"by": "router", "rule": "rule 3: reachable peers can host it", "peers": []}
    rejected_doc = {"by": "router", "rule": "rule 4: no peer", "peers": verdicts}
    try:
        for job_id, state, disposition, doc, reply_verdicts in (
                ("q1", "queued", "queue", shared_doc, []), ("q2", "assigned", "queue", shared_doc, []),
                ("r1", "rejected", "reject", rejected_doc, verdicts)):
            reply = {"job_id": job_id, "disposition": disposition, "state": "queued" if disposition == "queue"
                     else "rejected", "peer_id": "", "duplicate": False, "reason": doc["rule"],
                     "verdicts": reply_verdicts}
            await conn.execute(
                "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, explanation, submit_reply, reason) "
                "VALUES ($1, '{}', 'h', $2, $3, $4::text::jsonb, $5::text::jsonb, $6)",
                job_id, state, disposition, json.dumps(doc), json.dumps(reply), doc["rule"])
            await conn.execute("INSERT INTO federation_changelog (job_id, to_state, epoch, actor, detail) "
                               "VALUES ($1, $2, 0, 'router', $3)", job_id, reply["state"], doc["rule"])
        before = {r["job_id"]: json.loads(r["submit_reply"]) for r in await conn.fetch(
            "SELECT job_id, submit_reply::text FROM jobs")}
        await conn.close()
        await asyncio.to_thread(dbmod.migrate, url)
        conn = await asyncpg.connect(url)
        assert await conn.fetchval("SELECT count(*) FROM job_explanations") == 2  # one per distinct document
        pool = await dbmod.connect(url)
        try:
            store = Store(pool)
            assert (await store.job_get("q1")).explanation == shared_doc
            assert (await store.job_get("r1")).explanation == rejected_doc
            submitted = await store.job_get_submitted(["q1", "q2", "r1"])
            assert submitted["r1"].verdicts == verdicts and submitted["q2"].first_state == "queued"
        finally:
            await pool.close()
        await conn.close()
        await asyncio.to_thread(dbmod.downgrade, url, "0007")
        conn = await asyncpg.connect(url)
        after = {r["job_id"]: (json.loads(r["submit_reply"]), json.loads(r["explanation"])) for r in await conn.fetch(
            "SELECT job_id, submit_reply::text, explanation::text FROM jobs")}
        assert {job_id: reply for job_id, (reply, _) in after.items()} == before
        assert after["r1"][1] == rejected_doc and after["q2"][1] == shared_doc
    finally:
        await conn.close()


async def test_0011_and_0012_go_down_and_up_with_jobs_in_place(empty_database_url):
    """The listing (0011) is rebuilt from the same jobs each way up, and the finish function
    0012 rewrote comes back byte for byte with the same rights on the way down."""
    url = empty_database_url
    async with _pool_at(url, "0010") as pool:
        # Jobs as 0010 wrote them: with and without names and labels, one running.
        await pool.execute(
            "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, owner_peer_id, epoch) VALUES "
            "('named', '{\"name\": \"100%_x\", \"labels\": {\"team\": \"a\"}}', 'h', 'queued', 'queue', NULL, 0), "
            "('bare', '{}', 'h', 'succeeded', 'queue', NULL, 0), "
            "('labelled', '{\"labels\": {\"k\": \"<v>\"}}', 'h', 'running', 'queue', 'gpu-west', 1), "
            "('nulls', '{\"name\": null, \"labels\": null}', 'h', 'running', 'queue', 'gpu-west', 1)")

        async def listing() -> list[tuple]:
            return [tuple(r) for r in await pool.fetch(
                "SELECT job_id, submitted_at, labels::text, search_text FROM job_listing ORDER BY job_id")]

        await asyncio.to_thread(dbmod.migrate, url, "0011")
        as_0004 = await _finish_function(pool)
        listed = await listing()
        assert [(r[0], r[2], r[3]) for r in listed] == [
            ("bare", "{}", "bare "), ("labelled", '{"k": "<v>"}', "labelled "),
            ("named", '{"team": "a"}', "named 100%_x"),
            ("nulls", "null", "nulls ")]
        await asyncio.to_thread(dbmod.migrate, url, "0012")
        as_0012 = await _finish_function(pool)
        assert as_0012[0] != as_0004[0] and as_0012[1:] == as_0004[1:]
        await asyncio.to_thread(dbmod.downgrade, url, "0011")
        assert await _finish_function(pool) == as_0004  # byte for byte, and the same rights
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        assert await pool.fetchval("SELECT to_regclass('job_listing')") is None
        assert await pool.fetchval("SELECT count(*) FROM pg_proc WHERE proname = 'jobs_listed_never_change'") == 0
        assert await pool.execute("UPDATE jobs SET spec = spec WHERE job_id = 'bare'") == "UPDATE 1"
        await asyncio.to_thread(dbmod.migrate, url, "0012")
        assert await _finish_function(pool) == as_0012
        assert await listing() == listed  # the same rows again, from the same jobs
        moved = await pool.fetch("SELECT job_id, state FROM irisfed_job_finish_batch('gpu-west', "
                                 "ARRAY['labelled', 'nulls'], ARRAY[1, 1]::bigint[], ARRAY[0, 2], ARRAY[false, false])")
        assert sorted(tuple(r) for r in moved) == [("labelled", "succeeded"), ("nulls", "failed")]
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        await asyncio.to_thread(dbmod.migrate, url)
        assert [(r[0], r[2], r[3]) for r in await listing()] == [(r[0], r[2], r[3]) for r in listed]


async def test_0013_gives_existing_jobs_the_default_user_and_goes_back(empty_database_url):
    url = empty_database_url
    async with _pool_at(url, "0012") as pool:
        await pool.execute(
            "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition, owner_peer_id, epoch) VALUES "
            "('old', '{}', 'h', 'running', 'queue', 'gpu-west', 1)")

        as_0012 = await _finish_function(pool)
        await asyncio.to_thread(dbmod.migrate, url, "0013")
        assert await pool.fetchval("SELECT user_id FROM jobs WHERE job_id = 'old'") == "default"
        assert {"jobs_queued_by_user", "jobs_live_by_user", "jobs_by_user_newest"} <= await _indexes(url)
        as_0013 = await _finish_function(pool)
        assert as_0013[0] != as_0012[0] and as_0013[1:] == as_0012[1:]
        # A stored cancel's ending names who asked.
        await pool.execute("UPDATE jobs SET cancel_requested = true, cancel_requested_by = 'user alice' "
                           "WHERE job_id = 'old'")
        await pool.execute("SELECT * FROM irisfed_job_finish_batch('gpu-west', ARRAY['old'], ARRAY[1]::bigint[], "
                           "ARRAY[137], ARRAY[false])")
        assert await pool.fetchval("SELECT reason FROM jobs WHERE job_id = 'old'") == "cancelled by user alice"
        assert await pool.fetchval("SELECT detail FROM federation_changelog WHERE job_id = 'old' "
                                   "ORDER BY seq DESC LIMIT 1") == "cancelled by user alice"
        await asyncio.to_thread(dbmod.downgrade, url, "0012")
        assert await _finish_function(pool) == as_0012  # byte for byte, and the same rights
        assert await pool.fetchval("SELECT count(*) FROM information_schema.columns "
                                   "WHERE table_name = 'jobs' AND column_name IN ('user_id', 'cancel_requested_by')") == 0
        await asyncio.to_thread(dbmod.migrate, url)
