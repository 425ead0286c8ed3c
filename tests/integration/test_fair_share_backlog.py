"""One user's enormous backlog, held back by that user's quota, must not make every
tick pass read all of it: a pass with 50,000 queued jobs of a user at its quota and
20 of another user's reads one batch of the backlog; and the backlog's stored
reasons are not rewritten each time that user's usage moves."""

from __future__ import annotations

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick
from tests.infra.factories import advertise, assign_jobs, insert_jobs, make_config, user_job

BACKLOG = 50_000
USERS = [{"id": "alice", "quota": {"slots": 2}}, {"id": "bob"}]


async def _insert_many(store: Store, jobs: list) -> None:
    for start in range(0, len(jobs), 5000):
        await insert_jobs(store, jobs[start:start + 5000])


async def test_a_backlog_held_by_its_quota_does_not_slow_each_pass(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=200)
    # Alice already holds her whole quota (2 live jobs), and queues 50,000 more.
    running = [user_job("alice", f"live-{i}") for i in range(2)]
    await insert_jobs(store, running)
    await assign_jobs(store, running, "gpu-west")
    await _insert_many(store, [user_job("alice", f"a{i}") for i in range(BACKLOG)])
    await advertise(store, "gpu-west", slots=200, seq=2)  # fresh: the inserts outlast a heartbeat's TTL
    tick = Tick(make_config(users=USERS, heartbeat_ttl_s=120.0), pool, None)
    await tick.refresh_view()
    first = await tick.run_once(full=False)  # explains alice's backlog once: its writes are allowed
    assert first.assigned == []

    # Bob's 20 jobs arrive: one pass (a wake-up) places them, reading one batch of
    # alice's backlog, not all of it (every submit wakes a pass).
    await insert_jobs(store, [user_job("bob", f"b{i}") for i in range(20)])
    result = await tick.run_once(full=False)
    assert sorted(job_id for job_id, _, _ in result.assigned) == sorted(f"bob:b{i}" for i in range(20))
    assert 20 < result.claimed <= tick.settings.batch_size + 20, result.claimed
    # Once alice has room again, her backlog is claimed and placed as before.
    await pool.execute("UPDATE jobs SET state = 'succeeded' WHERE job_id IN ('alice:live-0', 'alice:live-1')")
    result = await tick.run_once(full=False)
    assert sorted(job_id for job_id, _, _ in result.assigned) == ["alice:a0", "alice:a1"]


async def _job_updates(pool) -> int:
    await pool.execute("SELECT pg_stat_force_next_flush()")
    return await pool.fetchval("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'jobs'")


async def test_a_backlog_waiting_for_quota_is_not_rewritten_whenever_its_users_usage_moves(pool):
    """"A long-waiting queue costs no writes per tick" (job_explain_batch): a quota wait's
    reason names what the user holds now, so every change of it rewrites every one of
    that user's waiting rows."""
    store = Store(pool)
    backlog = 5000
    users = [{"id": "alice", "quota": {"cpu": 4}}]
    big = user_job("alice", "big", resources={"cpu": 4})
    await insert_jobs(store, [big])
    await assign_jobs(store, [big], "gpu-west")
    await _insert_many(store, [user_job("alice", f"a{i}", resources={"cpu": 3}) for i in range(backlog)])
    await advertise(store, "gpu-west", slots=200, seq=2)
    tick = Tick(make_config(users=users, heartbeat_ttl_s=120.0), pool, None)
    await tick.refresh_view()
    await tick.run_once(full=False)  # the backlog's first explanation: written once, fine
    assert (await store.job_get("alice:a0")).reason == "quota: this job's 3 cpu would take alice over its quota of 4 cpu"

    # Alice's big job ends: one 3-cpu job starts in its place; the rest still wait.
    await pool.execute("UPDATE jobs SET state = 'succeeded' WHERE job_id = 'alice:big'")
    before = await _job_updates(pool)
    result = await tick.run_once(full=False)
    rewritten = await _job_updates(pool) - before
    assert len(result.assigned) == 1
    assert rewritten < backlog // 10, (rewritten, (await store.job_get("alice:a0")).reason)
