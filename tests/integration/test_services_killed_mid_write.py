"""A service SIGKILLed in the middle of its database work, on real Postgres, as its own
restricted login role: a tick between its claim-and-assign and the commit, a router in
the middle of one multi-row insert. What it did is all there or not at all: every job
with its one history row and its one listing row, or none of them; the changelog still
replays to ``jobs`` (invariant 7), and the next tick or the producer's retry finishes
the work once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from pathlib import Path

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.db_roles import ROLES, as_role
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


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
