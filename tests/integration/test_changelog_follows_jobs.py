"""What keeps every changelog row tied to an existing job now that the changelog has no
foreign key to `jobs` (migration 0009; it cost the tick's assign a quarter of its time):

- every statement that writes a changelog row takes its rows from the ``RETURNING`` of
  a CTE that inserted or updated those jobs, in the same statement: the store's SQL
  and the agents' database functions, read here from the files and from Postgres;
- no service role may delete or truncate jobs, nor may an agent or the dashboard
  write history at all;
- an operator's DELETE of a job (the owner may) still takes its history with it, as
  the key's ON DELETE CASCADE did.
"""

from __future__ import annotations

import asyncio
import re

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.queries import load_queries
from irisfed.tooling.invariants import changelog_violations
from tests.infra.factories import assign_jobs, insert_jobs, make_job, start_jobs

CHANGELOG_INSERT = re.compile(r"INSERT\s+INTO\s+federation_changelog\b", re.I)
# The insert's own SELECT and the relation it reads (the first FROM after it).
FROM_SOURCE = re.compile(r"INSERT\s+INTO\s+federation_changelog\s*\([^)]*\)\s*SELECT\b.*?\bFROM\s+(\w+)",
                         re.I | re.S)
# A CTE that inserts or updates jobs and returns them: RETURNING before the CTE ends
# (before the next ``), name AS (``).
JOB_WRITING_CTE = re.compile(r"(\w+)\s+AS\s+\(\s*(?:UPDATE\s+jobs\b|INSERT\s+INTO\s+jobs\b)"
                             r"(?:(?!\)\s*,\s*\w+\s+AS\s*\().)*?\bRETURNING\b", re.I | re.S)


def _unfed_inserts(sql: str) -> list[str]:
    """Changelog inserts in ``sql`` that do not read a CTE writing jobs with RETURNING."""
    writers = {name.lower() for name in JOB_WRITING_CTE.findall(sql)}
    fed = [source.lower() for source in FROM_SOURCE.findall(sql)]
    problems = [f"reads {source}, which writes no jobs" for source in fed if source not in writers]
    missing = len(CHANGELOG_INSERT.findall(sql)) - len(fed)
    return problems + ["an insert that is not INSERT … SELECT … FROM a CTE"] * missing


def test_the_checker_refuses_history_written_on_its_own():
    assert _unfed_inserts("INSERT INTO federation_changelog (job_id, to_state) VALUES ('x', 'queued')")
    assert _unfed_inserts("WITH c AS (SELECT job_id FROM jobs) "
                          "INSERT INTO federation_changelog (job_id) SELECT job_id FROM c")
    assert not _unfed_inserts("WITH moved AS (UPDATE jobs SET state = 'x' RETURNING job_id), logged AS ("
                              "INSERT INTO federation_changelog (job_id) SELECT job_id FROM moved) SELECT 1")


def test_every_store_statement_writes_history_only_for_jobs_it_wrote():
    writers = {name: sql for name, sql in load_queries().items() if CHANGELOG_INSERT.search(sql)}
    assert {"job_insert_batch", "job_move", "job_assign_batch", "job_expire_deadlines"} <= set(writers)
    assert {name: _unfed_inserts(sql) for name, sql in writers.items()} == {name: [] for name in writers}


async def test_every_database_function_writes_history_only_for_jobs_it_wrote(pool):
    bodies = {r["proname"]: r["prosrc"] for r in await pool.fetch(
        "SELECT proname, prosrc FROM pg_proc WHERE prosrc ~* 'INSERT\\s+INTO\\s+federation_changelog'")}
    assert set(bodies) == {"irisfed_job_start_batch", "irisfed_job_finish_batch", "irisfed_job_end_run"}
    assert {name: _unfed_inserts(sql) for name, sql in bodies.items()} == {name: [] for name in bodies}


async def test_no_service_may_delete_jobs_and_only_router_and_tick_insert_history(pool):
    rights = {(r["role"], r["what"]): r["allowed"] for r in await pool.fetch("""
        SELECT role, what, has_table_privilege(role, t, p) AS allowed
        FROM unnest(ARRAY['irisfed_router', 'irisfed_tick', 'irisfed_agent', 'irisfed_web']) AS role
        CROSS JOIN (VALUES ('jobs', 'DELETE', 'jobs DELETE'), ('jobs', 'TRUNCATE', 'jobs TRUNCATE'),
                           ('federation_changelog', 'INSERT', 'history INSERT')) AS w(t, p, what)""")}
    assert {key for key, allowed in rights.items() if allowed} == {
        ("irisfed_router", "history INSERT"), ("irisfed_tick", "history INSERT")}


async def test_deleting_a_job_deletes_its_history_and_nothing_else(pool):
    store = Store(pool)
    gone, kept = make_job(), make_job()
    await insert_jobs(store, [gone, kept])
    await assign_jobs(store, [gone, kept], "gpu-west")
    await start_jobs(store, [gone, kept], "gpu-west")
    assert len(await store.changelog_list_for_job(gone.job_id)) == 3
    assert await pool.execute("DELETE FROM jobs WHERE job_id = $1", gone.job_id) == "DELETE 1"
    assert await store.changelog_list_for_job(gone.job_id) == []
    assert len(await store.changelog_list_for_job(kept.job_id)) == 3
    assert await changelog_violations(store) == []


async def test_a_truncate_of_jobs_must_name_what_refers_to_them(pool):
    # The sync state's key (kept) refuses a truncate that would leave history behind.
    try:
        await pool.execute("TRUNCATE jobs")
    except asyncpg.FeatureNotSupportedError as refused:
        assert "federation_sync_state" in str(refused)
    else:
        raise AssertionError("TRUNCATE jobs went through")


async def test_0009_drops_the_key_for_a_trigger_and_its_downgrade_puts_it_back(empty_database_url):
    async def schema() -> tuple[set[str], set[str]]:
        conn = await asyncpg.connect(empty_database_url)
        try:
            keys = {r["conname"] for r in await conn.fetch(
                "SELECT conname FROM pg_constraint WHERE contype = 'f' AND confrelid = 'jobs'::regclass")}
            triggers = {r["tgname"] for r in await conn.fetch(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND NOT tgisinternal")}
            return keys, triggers
        finally:
            await conn.close()

    await asyncio.to_thread(dbmod.migrate, empty_database_url, "0009")
    assert await schema() == ({"federation_sync_state_job_id_fkey"}, {"jobs_deleted_drop_history"})
    await asyncio.to_thread(dbmod.downgrade, empty_database_url, "0008")
    assert await schema() == ({"federation_sync_state_job_id_fkey", "federation_changelog_job_id_fkey"}, set())
    await asyncio.to_thread(dbmod.migrate, empty_database_url, "0009")
    assert await schema() == ({"federation_sync_state_job_id_fkey"}, {"jobs_deleted_drop_history"})
