"""``job_listing`` (migration 0011): what the Jobs page searches, written once per job.

- the router's insert writes each new job's listing row in the same statement, from
  the job as inserted (id, submit time, labels, id and name as searchable text), and
  a duplicate submit writes none;
- no state change writes it again (that was the point: the search indexes are not
  paid for on every transition);
- an operator's DELETE or TRUNCATE of jobs takes the listing rows along;
- only the router may add rows, nobody but the owner may change or remove them,
  the dashboard reads them, the tick and agents cannot;
- 0011 fills the table from the jobs already there, and its downgrade puts the three
  indexes back on ``jobs``.
"""

from __future__ import annotations

import asyncio

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.services.web.filters import JobFilter
from tests.infra.factories import assign_jobs, insert_jobs, make_job, start_jobs
from tests.integration.conftest import ROLES
from tests.integration.test_db_roles import as_role

LISTING = "SELECT job_id, submitted_at, labels, search_text, xmin::text AS version FROM job_listing ORDER BY job_id"


async def _listing(pool) -> dict[str, dict]:
    return {r["job_id"]: dict(r) for r in await pool.fetch(LISTING)}


async def test_the_insert_lists_each_new_job_once_as_it_was_submitted(pool):
    store = Store(pool)
    named = make_job(name="résumé training", labels={"team": "speech", "run": "7"})
    bare = make_job()
    await insert_jobs(store, [named, bare])
    await insert_jobs(store, [named])  # a duplicate submit: no second row
    listed = await _listing(pool)
    assert set(listed) == {named.job_id, bare.job_id}
    assert listed[named.job_id]["search_text"] == f"{named.job_id} résumé training"
    assert listed[bare.job_id]["search_text"] == f"{bare.job_id} "
    assert listed[bare.job_id]["labels"] == {}
    assert await pool.fetchval("SELECT labels @> '{\"team\": \"speech\"}' FROM job_listing WHERE job_id = $1",
                               named.job_id)
    submitted = {r["job_id"]: r["submitted_at"] for r in await pool.fetch("SELECT job_id, submitted_at FROM jobs")}
    assert {job_id: row["submitted_at"] for job_id, row in listed.items()} == submitted


async def test_state_changes_never_write_the_listing_again(pool):
    store = Store(pool)
    job = make_job(labels={"team": "vision"})
    await insert_jobs(store, [job])
    before = await _listing(pool)
    await assign_jobs(store, [job], "gpu-west")
    await start_jobs(store, [job], "gpu-west")
    await store.job_finish_batch("gpu-west", [(job.job_id, 1, 0, False)])
    assert (await store.job_get(job.job_id)).state == "succeeded"
    assert await _listing(pool) == before  # same row version (xmin): never updated


async def test_the_page_finds_jobs_by_label_and_text_through_the_listing(pool):
    store = Store(pool)
    wanted = make_job(name="nightly-eval", labels={"team": "speech"})
    other = make_job(name="warmup", labels={"team": "vision"})
    await insert_jobs(store, [wanted, other])
    await assign_jobs(store, [wanted], "gpu-west")
    for query in (JobFilter(labels=(("team", "speech"),)).query(10), JobFilter(text="ightly-ev").query(10),
                  JobFilter(text="ightly-ev", state="assigned").query(10),
                  JobFilter(labels=(("team", "speech"),), peer="gpu-west").query(10)):
        rows = await store.job_list_page(query)
        assert [r.job_id for r in rows] == [wanted.job_id], query
        assert rows[0].state == "assigned" and rows[0].labels == {"team": "speech"}
    assert [r.job_id for r in await store.job_list_page(JobFilter().query(10))] == [other.job_id, wanted.job_id]
    assert [r.job_id for r in await store.job_list(None, 10)] == [other.job_id, wanted.job_id]
    assert [r.job_id for r in await store.job_list("queued", 10)] == [other.job_id]


async def test_delete_and_truncate_of_jobs_take_their_listing_rows(pool):
    store = Store(pool)
    gone, kept = make_job(), make_job()
    await insert_jobs(store, [gone, kept])
    assert await pool.execute("DELETE FROM jobs WHERE job_id = $1", gone.job_id) == "DELETE 1"
    assert set(await _listing(pool)) == {kept.job_id}
    await pool.execute("TRUNCATE jobs CASCADE")
    assert await _listing(pool) == {}


async def _refused(conn: asyncpg.Connection, sql: str) -> bool:
    try:
        await conn.execute(sql)
    except (asyncpg.InsufficientPrivilegeError, asyncpg.RaiseError):
        return True
    return False


async def test_roles_on_the_listing(pool, roles, database_url):
    job = make_job()
    await insert_jobs(Store(pool), [job])
    forged = ("INSERT INTO job_listing (job_id, submitted_at, labels, search_text) "
              "VALUES ('forged', now(), '{}', 'forged')")
    for name, role in ROLES.items():
        conn = await asyncpg.connect(as_role(database_url, role))
        try:
            for sql in (f"UPDATE job_listing SET search_text = 'x' WHERE job_id = '{job.job_id}'",
                        f"DELETE FROM job_listing WHERE job_id = '{job.job_id}'", "TRUNCATE job_listing",
                        "DROP TRIGGER jobs_deleted_drop_listing ON jobs"):
                assert await _refused(conn, sql), (name, sql)
            if name in ("agent", "tick"):  # neither needs it; an agent must not read other peers' job names
                assert await _refused(conn, "SELECT 1 FROM job_listing LIMIT 1"), name
                assert await _refused(conn, forged), name
            else:
                assert await conn.fetchval("SELECT count(*) FROM job_listing WHERE job_id = $1", job.job_id) == 1
                assert await _refused(conn, forged) == (name == "web"), name
        finally:
            await conn.close()
    listed = await _listing(pool)
    assert listed[job.job_id]["search_text"] == f"{job.job_id} "


async def test_0011_lists_the_jobs_already_there_and_its_downgrade_restores_the_indexes(empty_database_url):
    url = empty_database_url

    async def indexes(conn) -> set[str]:
        return {r["indexname"] for r in await conn.fetch(
            "SELECT indexname FROM pg_indexes WHERE tablename IN ('jobs', 'job_listing')")}

    await asyncio.to_thread(dbmod.migrate, url, "0010")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) VALUES "
                           "('old-1', '{\"name\": \"n1\", \"labels\": {\"a\": \"b\"}}', 'h', 'queued', 'queue'), "
                           "('old-2', '{}', 'h', 'succeeded', 'queue')")
        assert {"jobs_newest", "jobs_by_label"} <= await indexes(conn)
        await asyncio.to_thread(dbmod.migrate, url, "0011")
        assert [tuple(r) for r in await conn.fetch(
            "SELECT job_id, labels::text, search_text FROM job_listing ORDER BY job_id")] == [
            ("old-1", '{"a": "b"}', "old-1 n1"), ("old-2", "{}", "old-2 ")]
        found = await indexes(conn)
        assert {"job_listing_newest", "job_listing_by_label"} <= found
        assert not found & {"jobs_newest", "jobs_by_label", "jobs_by_text"}
        with_trigrams = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm')")
        assert ("job_listing_by_text" in found) == with_trigrams
        await asyncio.to_thread(dbmod.downgrade, url, "0010")
        found = await indexes(conn)
        assert {"jobs_newest", "jobs_by_label"} <= found and "job_listing_newest" not in found
        assert await conn.fetchval("SELECT to_regclass('job_listing')") is None
    finally:
        await conn.close()
