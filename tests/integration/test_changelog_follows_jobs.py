"""What keeps every changelog row tied to an existing job now that the changelog has no
foreign key to `jobs` (migration 0009; it cost the tick's assign a quarter of its time),
so that the changelog always replays to ``jobs`` (invariant 7):

- every statement that writes a changelog row takes its rows from the ``RETURNING`` of
  a CTE that inserted or updated those jobs, in the same statement: the store's SQL
  and the agents' database functions, read here from the files and from Postgres;
- no service role may delete or truncate jobs, nor may an agent or the dashboard
  write history at all; no role may change or remove history, rename a job away from
  it, or switch off, replace or borrow the triggers that keep the two together
  (0010);
- an operator's DELETE or TRUNCATE of jobs (the owner may) still takes their history
  with them, as the key's ON DELETE CASCADE did;
- what a role that may write history (router, tick) could still get wrong is named by
  the invariant check.
"""

from __future__ import annotations

import asyncio
import re

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.queries import load_queries
from irisfed.tooling.invariants import assert_changelog_replays, changelog_violations
from tests.infra.db_roles import refused
from tests.infra.factories import assign_jobs, insert_jobs, make_job, running_job, start_jobs

CHANGELOG_INSERT = re.compile(r"INSERT\s+INTO\s+federation_changelog\b", re.I)
# The insert's own SELECT and the relation it reads (the first FROM after it).
FROM_SOURCE = re.compile(r"INSERT\s+INTO\s+federation_changelog\s*\([^)]*\)\s*SELECT\b.*?\bFROM\s+(\w+)",
                         re.I | re.S)
# A CTE that inserts or updates jobs and returns them: RETURNING before the CTE ends
# (before the next ``), name AS (``).
JOB_WRITING_CTE = re.compile(r"(\w+)\s+AS\s+\(\s*(?:UPDATE\s+jobs\b|INSERT\s+INTO\s+jobs\b)"
                             r"(?:(?!\)\s*,\s*\w+\s+AS\s*\().)*?\bRETURNING\b", re.I | re.S)


def _history_row(job_id: str, epoch: int = 1) -> str:
    """A changelog row no store statement wrote: ``job_id`` running → succeeded at ``epoch``."""
    return ("INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail) "
            f"VALUES ('{job_id}', 'running', 'succeeded', 'gpu-west', {epoch}, 'operator', 'forged')")


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
    assert set(bodies) == {"irisfed_job_start_batch", "irisfed_job_finish_batch", "irisfed_job_end_run",
                           "irisfed_job_hand_back", "irisfed_dependencies_settle"}
    assert {name: _unfed_inserts(sql) for name, sql in bodies.items()} == {name: [] for name in bodies}


async def test_no_service_may_delete_jobs_and_only_router_and_tick_insert_history(pool):
    rights = {(r["role"], r["what"]): r["allowed"] for r in await pool.fetch("""
        SELECT role, what, has_table_privilege(role, t, p) AS allowed
        FROM unnest(ARRAY['irisfed_router', 'irisfed_tick', 'irisfed_agent', 'irisfed_web']) AS role
        CROSS JOIN (VALUES ('jobs', 'DELETE', 'jobs DELETE'), ('jobs', 'TRUNCATE', 'jobs TRUNCATE'),
                           ('federation_changelog', 'INSERT', 'history INSERT')) AS w(t, p, what)""")}
    assert {key for key, allowed in rights.items() if allowed} == {
        ("irisfed_router", "history INSERT"), ("irisfed_tick", "history INSERT")}


async def test_agent_and_web_roles_write_no_history_at_all(pool, conns):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    for name in ("agent", "web"):
        for job_id in ("no-such-job", theirs):
            assert await refused(conns[name], _history_row(job_id)), (name, job_id)
    assert len(await admin.changelog_list_for_job(theirs)) == 3
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog WHERE job_id = 'no-such-job'") == 0


async def test_no_role_may_change_or_remove_history_nor_remove_jobs(pool, conns):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    for name, conn in conns.items():
        for sql in (f"UPDATE federation_changelog SET epoch = 9, to_state = 'succeeded' WHERE job_id = '{theirs}'",
                    f"DELETE FROM federation_changelog WHERE job_id = '{theirs}'",
                    "TRUNCATE federation_changelog",
                    f"DELETE FROM jobs WHERE job_id = '{theirs}'",
                    "TRUNCATE jobs CASCADE"):
            assert await refused(conn, sql), (name, sql)
    assert [(c.to_state, c.epoch) for c in await admin.changelog_list_for_job(theirs)] == [
        ("queued", 0), ("assigned", 1), ("running", 1)]
    await assert_changelog_replays(admin)


async def test_no_role_may_switch_off_or_replace_what_keeps_history_with_jobs(pool, conns):
    triggers = {r["tgname"] for r in await pool.fetch(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND NOT tgisinternal")}
    assert triggers == {"jobs_deleted_drop_history", "jobs_id_never_changes", "jobs_truncated_drop_history",
                        "jobs_deleted_drop_listing", "jobs_truncated_drop_listing", "jobs_listed_never_change",
                        "jobs_dependencies_settle", "jobs_array_release"}
    for name, conn in conns.items():
        attempts = ["SET session_replication_role = replica", "ALTER TABLE jobs DISABLE TRIGGER ALL",
                    "CREATE OR REPLACE FUNCTION public.jobs_deleted_drop_history() RETURNS trigger "
                    "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
                    "CREATE OR REPLACE FUNCTION public.jobs_id_never_changes() RETURNS trigger "
                    "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
                    "CREATE OR REPLACE FUNCTION public.jobs_deleted_drop_listing() RETURNS trigger "
                    "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$"]
        for trigger in sorted(triggers):
            attempts += [f"ALTER TABLE jobs DISABLE TRIGGER {trigger}", f"DROP TRIGGER {trigger} ON jobs"]
        for sql in attempts:
            assert await refused(conn, sql), (name, sql)
    assert {r["tgname"]: r["tgenabled"] for r in await pool.fetch(
        "SELECT tgname, tgenabled::text FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND NOT tgisinternal")} == {
        trigger: "O" for trigger in triggers}


async def test_the_history_trigger_functions_run_with_their_callers_rights(pool, conns):
    """A role may make a temp table and hang the delete trigger's function on it: the
    function must not delete history on that role's behalf (not SECURITY DEFINER)."""
    admin = Store(pool)
    victim = await running_job(admin, "tpu-east")
    assert await pool.fetchval("SELECT bool_or(prosecdef) FROM pg_proc WHERE proname IN "
                               "('jobs_deleted_drop_history', 'jobs_truncated_drop_history', "
                               "'jobs_deleted_drop_listing', 'jobs_truncated_drop_listing')") is False
    for name, conn in conns.items():
        await conn.execute("CREATE TEMP TABLE decoy (job_id text)")
        await conn.execute("CREATE TRIGGER decoy AFTER DELETE ON decoy REFERENCING OLD TABLE AS deleted "
                           "FOR EACH STATEMENT EXECUTE FUNCTION public.jobs_deleted_drop_history()")
        await conn.execute("CREATE TRIGGER decoy_truncate AFTER TRUNCATE ON decoy "
                           "FOR EACH STATEMENT EXECUTE FUNCTION public.jobs_truncated_drop_history()")
        await conn.execute("INSERT INTO decoy VALUES ($1)", victim)
        assert await refused(conn, "DELETE FROM decoy"), name
        assert await refused(conn, "TRUNCATE decoy"), name
    assert len(await admin.changelog_list_for_job(victim)) == 3


async def test_no_role_nor_the_owner_may_rename_a_job_away_from_its_history(pool, conns):
    """The router and tick roles hold UPDATE on ``jobs``: a rename would leave the job's
    history behind ('renamed: no changelog rows', '<id>: changelog rows for a job that
    does not exist'), so a trigger refuses any change of a job's id, the owner's too."""
    admin = Store(pool)
    queued, running = make_job(), await running_job(admin, "gpu-west")
    await insert_jobs(admin, [queued])
    for job_id in (queued.job_id, running):
        for name in ("router", "tick"):
            with pytest.raises(asyncpg.RestrictViolationError, match="never changes"):
                await conns[name].execute("UPDATE jobs SET job_id = 'renamed' WHERE job_id = $1", job_id)
        with pytest.raises(asyncpg.RestrictViolationError):
            await pool.execute("UPDATE jobs SET job_id = 'renamed', reason = 'x' WHERE job_id = $1", job_id)
        for name in ("agent", "web"):
            assert await refused(conns[name], f"UPDATE jobs SET job_id = 'renamed' WHERE job_id = '{job_id}'")
    assert await admin.job_get("renamed") is None
    # Updates that leave the id alone are untouched by the trigger.
    assert await conns["router"].execute("UPDATE jobs SET priority = 3 WHERE job_id = $1", queued.job_id) == "UPDATE 1"
    await assert_changelog_replays(admin)


async def test_a_truncate_of_jobs_takes_history_along(pool):
    """An operator's ``TRUNCATE jobs CASCADE`` (the owner may) takes every history row
    along, as a foreign key's cascade would: none is left for a job that is gone."""
    admin = Store(pool)
    await running_job(admin, "gpu-west")
    await insert_jobs(admin, [make_job()])
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 4
    await pool.execute("TRUNCATE jobs CASCADE")
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 0
    await running_job(admin, "gpu-west")
    await pool.execute("TRUNCATE jobs, job_outputs, job_dependencies, federation_sync_state")
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 0
    await assert_changelog_replays(admin)


async def test_invariant_7_names_history_no_job_backs_and_forged_epochs(pool, conns):
    admin = Store(pool)
    real = await running_job(admin, "gpu-west")
    assert await changelog_violations(admin) == []
    # The owner plants an orphan row and a forged epoch on a real job.
    await pool.execute(_history_row("planted-by-owner"))
    await pool.execute(_history_row(real, epoch=7))
    # The router and tick roles may insert history (their own SQL writes it from the
    # jobs it wrote: docs/decisions.md, 0009); one that lies is still found out.
    await conns["router"].execute(_history_row("planted-by-router"))
    problems = await changelog_violations(admin)
    assert "planted-by-owner: changelog rows for a job that does not exist" in problems
    assert "planted-by-router: changelog rows for a job that does not exist" in problems
    assert f"{real}: changelog ends at epoch 7 but jobs says 1" in problems


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


async def test_0010_refuses_renames_and_truncates_history_along_and_downgrades_cleanly(empty_database_url):
    """At 0009 a rename left history on the old id and ``TRUNCATE jobs CASCADE`` left it all
    behind; from 0010 on neither can happen, and its downgrade and upgrade go cleanly."""
    async def rename_and_truncate() -> tuple[str, int]:
        """(a rename's outcome, history rows left after TRUNCATE jobs CASCADE)."""
        pool = await dbmod.connect(empty_database_url, max_size=2, check=False)
        try:
            job = make_job()
            # The job and its first history row as written at every revision from 0009 on
            # (today's store also writes tables later migrations add).
            await pool.execute("INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
                               "VALUES ($1, '{}', 'h', 'queued', 'queue')", job.job_id)
            await pool.execute("INSERT INTO federation_changelog (job_id, to_state, epoch, actor, detail) "
                               "VALUES ($1, 'queued', 0, 'router', 'test')", job.job_id)
            try:
                renamed = await pool.execute("UPDATE jobs SET job_id = $1 WHERE job_id = $2",
                                             job.job_id + "-renamed", job.job_id)
            except asyncpg.RestrictViolationError:
                renamed = "refused"
            await pool.execute("TRUNCATE jobs CASCADE")
            return renamed, await pool.fetchval("SELECT count(*) FROM federation_changelog")
        finally:
            await pool.close()

    await asyncio.to_thread(dbmod.migrate, empty_database_url, "0009")
    assert await rename_and_truncate() == ("UPDATE 1", 1)
    await asyncio.to_thread(dbmod.migrate, empty_database_url)
    assert await rename_and_truncate() == ("refused", 0)
    await asyncio.to_thread(dbmod.downgrade, empty_database_url, "0009")
    assert await rename_and_truncate() == ("UPDATE 1", 1)
    await asyncio.to_thread(dbmod.migrate, empty_database_url)
    assert await rename_and_truncate() == ("refused", 0)
