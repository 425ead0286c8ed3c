"""Attack pass, round 12: the changelog without a foreign key to ``jobs`` (0009, 0010).

Each restricted login role (a peer's agent, router, tick, web) tries to write history
that no job backs, to move history off its job, to remove jobs or history, and to
switch off the trigger that keeps them together; the agents' functions get ids that
do not exist, duplicates, arrays of different lengths and NULLs; processes holding a
router insert or a tick assign are SIGKILLed mid-way. Afterwards the changelog must
still replay to ``jobs`` (invariant 7) or the attempt must have been refused.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import textwrap
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import httpx
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.tooling.invariants import assert_changelog_replays, changelog_violations
from tests.infra.factories import assign_jobs, insert_jobs, make_job, running_job
from tests.infra.waiting import wait_for
from tests.integration.conftest import ROLES
from tests.integration.test_db_roles import as_role
from tests.integration.test_web_pages import running_web
from tests.integration.test_web_safety import open_stream

REPO = Path(__file__).resolve().parents[2]
REFUSED = (asyncpg.InsufficientPrivilegeError, asyncpg.RaiseError, asyncpg.ObjectNotInPrerequisiteStateError)


def _history_row(job_id: str, epoch: int = 1) -> str:
    return ("INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail) "
            f"VALUES ('{job_id}', 'running', 'succeeded', 'gpu-west', {epoch}, 'operator', 'forged')")


async def _refused(conn: asyncpg.Connection, sql: str) -> str | None:
    """None when ``sql`` was refused, else what it did (a statement tag)."""
    try:
        return await conn.execute(sql)
    except REFUSED:
        return None


async def test_agent_and_web_roles_write_no_history_at_all(pool, conns):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    for name in ("agent", "web"):
        for job_id in ("no-such-job", theirs):
            assert await _refused(conns[name], _history_row(job_id)) is None, (name, job_id)
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
            assert await _refused(conn, sql) is None, (name, sql)
    assert [(c.to_state, c.epoch) for c in await admin.changelog_list_for_job(theirs)] == [
        ("queued", 0), ("assigned", 1), ("running", 1)]
    await assert_changelog_replays(admin)


async def test_no_role_may_switch_off_or_replace_what_keeps_history_with_jobs(pool, conns):
    triggers = {r["tgname"] for r in await pool.fetch(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND NOT tgisinternal")}
    assert triggers == {"jobs_deleted_drop_history", "jobs_id_never_changes", "jobs_truncated_drop_history",
                        "jobs_deleted_drop_listing", "jobs_truncated_drop_listing", "jobs_listed_never_change"}
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
            assert await _refused(conn, sql) is None, (name, sql)
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
        assert await _refused(conn, "DELETE FROM decoy") is None, name
        assert await _refused(conn, "TRUNCATE decoy") is None, name
    assert len(await admin.changelog_list_for_job(victim)) == 3


async def test_no_role_nor_the_owner_may_rename_a_job_away_from_its_history(pool, conns):
    """Before 0010 the router and tick roles (UPDATE on jobs) could: 'renamed: no
    changelog rows', '<id>: changelog rows for a job that does not exist'."""
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
            assert await _refused(conns[name], f"UPDATE jobs SET job_id = 'renamed' WHERE job_id = '{job_id}'") is None
    assert await admin.job_get("renamed") is None
    # Updates that leave the id alone are untouched by the trigger.
    assert await conns["router"].execute("UPDATE jobs SET priority = 3 WHERE job_id = $1", queued.job_id) == "UPDATE 1"
    await assert_changelog_replays(admin)


async def test_a_truncate_of_jobs_takes_history_along(pool):
    """Before 0010 ``TRUNCATE jobs CASCADE`` (the owner's) left every history row behind."""
    admin = Store(pool)
    await running_job(admin, "gpu-west")
    await insert_jobs(admin, [make_job()])
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 4
    await pool.execute("TRUNCATE jobs CASCADE")
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 0
    await running_job(admin, "gpu-west")
    await pool.execute("TRUNCATE jobs, federation_sync_state")
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


async def test_agent_functions_write_history_only_for_what_they_really_move(pool, conns):
    admin, agent = Store(pool), conns["agent"]
    jobs = [make_job() for _ in range(3)]
    await insert_jobs(admin, jobs)
    await assign_jobs(admin, jobs, "gpu-west")
    a, b, c = (j.job_id for j in jobs)
    theirs = await running_job(admin, "tpu-east")
    start = "SELECT job_id FROM irisfed_job_start_batch('gpu-west', $1, $2, $3, $4)"
    finish = "SELECT job_id FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)"
    # Ids that do not exist, another peer's, a duplicate, a NULL; epochs shorter than ids
    # (unnest pads NULLs), forged epochs.
    started = await agent.fetch(start, ["ghost", a, a, None, theirs, b, c], [1, 1, 1, 1, 1, 99], ["x"], None)
    assert [r["job_id"] for r in started] == [a]
    assert await agent.fetch(start, None, None, None, None) == []
    assert [r["job_id"] for r in await agent.fetch(start, [b], [1], None, None)] == [b]
    # A duplicate with different outcomes: one move, one row.
    finished = await agent.fetch(finish, [a, a, "ghost", theirs], [1, 1, 1, 1], [0, 1, 0, 0], [False, None, False, False])
    assert [r["job_id"] for r in finished] == [a]
    # A NULL exit code is refused outright (reason NOT NULL): nothing moves, nothing is logged.
    with pytest.raises(asyncpg.NotNullViolationError):
        await agent.fetch(finish, [b], [1], [None], [False])
    for args in (("ghost", 1, "queued"), (None, None, "failed"), (theirs, 1, "killed"), (c, 1, "queued"),
                 (b, 2, "queued")):
        assert await agent.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, $2, $3, 'x')", *args) is None, args
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await agent.fetch("SELECT * FROM irisfed_job_start_batch(NULL, $1, $2, NULL, NULL)", [c], [1])
    counts = dict(await pool.fetch("SELECT job_id, count(*) FROM federation_changelog WHERE job_id = ANY($1) "
                                   "GROUP BY job_id", [a, b, c, theirs, "ghost"]))
    assert counts == {a: 4, b: 3, c: 2, theirs: 3}
    await assert_changelog_replays(admin)


async def test_0010_closes_what_0009_left_open_and_downgrades_cleanly(empty_database_url):
    async def attack() -> tuple[str, int]:
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
    assert await attack() == ("UPDATE 1", 1)
    await asyncio.to_thread(dbmod.migrate, empty_database_url)
    assert await attack() == ("refused", 0)
    await asyncio.to_thread(dbmod.downgrade, empty_database_url, "0009")
    assert await attack() == ("UPDATE 1", 1)
    await asyncio.to_thread(dbmod.migrate, empty_database_url)
    assert await attack() == ("refused", 0)


# A service's database work, held open in its own process until the test SIGKILLs it:
# ``tick`` claims the queued jobs and assigns them (changelog in the same statement)
# but does not commit; ``router`` inserts a batch of jobs (one statement) that waits
# on a row the test holds. The child prints its backend's pid once it got that far.
CHILD = textwrap.dedent("""
    import asyncio, sys
    from irisfed.services.common import db as dbmod
    from irisfed.services.common.store import Store
    from tests.infra.factories import make_job

    async def main(url, what, job_ids):
        pool = await dbmod.connect(url, max_size=1)
        async with Store(pool).connection() as bound:
            pid = await bound.db.fetchval("SELECT pg_backend_pid()")
            if what == "tick":
                await bound.begin()
                rows = await bound.job_claim_queued(100)
                moved = await bound.job_assign_batch([(r.job_id, r.epoch, "gpu-west", "main") for r in rows])
                assert len(moved) == len(job_ids), moved
                print(pid, flush=True)
                await asyncio.sleep(3600)
            else:
                print(pid, flush=True)
                await bound.job_insert_batch([make_job(job_id=job_id) for job_id in job_ids])
                print("inserted: it should have waited", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
""")


async def _child(url: str, what: str, job_ids: list[str]) -> tuple[asyncio.subprocess.Process, int]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, url, what, *job_ids, stdout=asyncio.subprocess.PIPE,
        cwd=REPO)
    line = await asyncio.wait_for(child.stdout.readline(), 60)
    assert line.strip().isdigit(), line
    return child, int(line)


async def _kill(child: asyncio.subprocess.Process) -> None:
    child.send_signal(signal.SIGKILL)
    assert await child.wait() == -signal.SIGKILL


async def _backend_gone(pool, backend_pid: int) -> None:
    async def gone() -> bool:
        return not await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend_pid)
    await wait_for(gone, "the killed process's Postgres backend to end")


async def test_a_tick_killed_between_its_assign_and_its_commit_leaves_the_jobs_queued(
        pool, database_url, roles):
    admin = Store(pool)
    jobs = [make_job() for _ in range(3)]
    await insert_jobs(admin, jobs)
    child, backend = await _child(as_role(database_url, ROLES["tick"]), "tick", [j.job_id for j in jobs])
    await _kill(child)
    await _backend_gone(pool, backend)
    assert {j.state for j in await admin.job_list_states()} == {"queued"}
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 3
    await assert_changelog_replays(admin)
    # The next tick claims and assigns them once.
    tick_pool = await dbmod.connect(as_role(database_url, ROLES["tick"]), max_size=1)
    try:
        assert len(await assign_jobs(Store(tick_pool), jobs, "gpu-west")) == 3
    finally:
        await tick_pool.close()
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == 6
    await assert_changelog_replays(admin)


async def test_a_router_killed_mid_insert_leaves_each_job_with_its_history_or_neither(
        pool, database_url, roles):
    admin = Store(pool)
    ids = [f"crash-{i}" for i in range(4)]
    held = await pool.acquire()
    try:
        # The test holds an uncommitted insert of the last id: the router's batch stops there.
        hold = held.transaction()
        await hold.start()
        await Store(held).job_insert_batch([make_job(job_id=ids[-1])])
        child, backend = await _child(as_role(database_url, ROLES["router"]), "router", ids)

        async def waiting() -> bool:
            return await pool.fetchval("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                                       backend)
        await wait_for(waiting, "the router's insert to wait on the held row")
        await _kill(child)
        await hold.rollback()
    finally:
        await pool.release(held)
    await _backend_gone(pool, backend)
    rows = dict(await pool.fetch("SELECT job_id, count(*) FROM federation_changelog GROUP BY job_id"))
    jobs = {j.job_id for j in await admin.job_list_states()}
    # The statement is all or nothing (its backend may finish it after the kill,
    # unacknowledged): each job exists with its one history row and its one listing row
    # at its own submit time (migration 0011), or none of them does.
    assert jobs == set(rows) and set(rows.values()) <= {1}, (jobs, rows)
    await assert_changelog_replays(admin)
    jobs_at = dict(await pool.fetch("SELECT job_id, submitted_at FROM jobs"))
    assert dict(await pool.fetch("SELECT job_id, submitted_at FROM job_listing")) == jobs_at
    assert await pool.fetchval("SELECT count(*) FROM job_listing") == len(jobs_at)
    # The producer's retry creates what is missing, once, and a second retry nothing.
    router_pool = await dbmod.connect(as_role(database_url, ROLES["router"]), max_size=1)
    try:
        for _ in range(2):
            await insert_jobs(Store(router_pool), [make_job(job_id=job_id) for job_id in ids])
    finally:
        await router_pool.close()
    assert dict(await pool.fetch("SELECT job_id, count(*) FROM federation_changelog GROUP BY job_id")) == {
        job_id: 1 for job_id in ids}
    await assert_changelog_replays(admin)
    listed = dict(await pool.fetch("SELECT job_id, submitted_at FROM job_listing"))
    assert listed == dict(await pool.fetch("SELECT job_id, submitted_at FROM jobs")) and set(listed) == set(ids)
    assert await pool.fetchval("SELECT count(*) FROM job_listing") == len(ids)


async def test_the_refused_retry_reaches_page_and_header_as_plain_whole_numbers(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, viewers_per_client=1,
                           refused_retry_s=2.5) as web, httpx.AsyncClient(timeout=30) as http:
        page = await http.get(web.url)
        assert re.findall(r'data-refused-retry-ms="([^"]*)"', page.text) == ["2500"]
        url = web.url + "events"
        async with AsyncExitStack() as stack:
            assert (await open_stream(stack, http, url, "10.9.9.9")).status_code == 200
            refused = await http.get(url, headers={"x-forwarded-for": "10.9.9.9"})
            assert refused.status_code == 429
            assert refused.headers.get_list("retry-after") == ["3"]  # 2.5 s rounded up
