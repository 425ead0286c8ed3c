"""The tick against real Postgres: placement, concurrency, deadlines, lost peers."""

import asyncio
import time

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick, TickSettings
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import advertise, assign_jobs, insert_jobs, make_config, make_job


async def _queue_and_tick(store: Store, jobs: list, slots: int, batch_size: int) -> Tick:
    """``jobs`` queued, gpu-west advertising ``slots``, and a tick (with its view) claiming ``batch_size`` at a time."""
    await advertise(store, "gpu-west", slots=slots)
    await insert_jobs(store, jobs)
    tick = Tick(make_config(), store, None, TickSettings(batch_size=batch_size))
    await tick.refresh_view()
    return tick


async def test_places_by_constraint_and_capacity(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=2, device_type="gpu")
    await advertise(store, "tpu-east", slots=5, device_type="tpu")
    gpu = {"constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}
    jobs = [make_job(**gpu) for _ in range(3)] + [make_job()]
    await insert_jobs(store, jobs)
    tick = Tick(make_config(), pool, None)
    await tick.refresh_view()
    result = await tick.run_once()
    owners = {job_id: peer for job_id, peer, _ in result.assigned}
    assert sorted(owners.values()) == ["gpu-west", "gpu-west", "tpu-east"]
    assert owners[jobs[3].job_id] == "tpu-east"
    assert result.waiting == 1  # one GPU job: no slot left (which one is the order's tie-break)
    waiting = [job for job in jobs[:3] if job.job_id not in owners]
    assert len(waiting) == 1 and (await store.job_get(waiting[0].job_id)).state == "queued"
    assert all(epoch == 1 for _, _, epoch in result.assigned)
    await assert_changelog_replays(store)


async def test_priority_order_decides_who_gets_the_last_slot(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=1)
    low, high = make_job(priority=1), make_job(priority=5)
    await insert_jobs(store, [low, high])
    tick = Tick(make_config(), pool, None)
    await tick.refresh_view()
    result = await tick.run_once()
    assert [job_id for job_id, _, _ in result.assigned] == [high.job_id]


async def test_concurrent_ticks_never_double_assign(pool, database_url):
    from irisfed.services.common import db as dbmod

    store = Store(pool)
    await advertise(store, "gpu-west", slots=500)
    await advertise(store, "tpu-east", slots=500)
    jobs = [make_job() for _ in range(400)]
    await insert_jobs(store, jobs)
    other_pool = await dbmod.connect(database_url)
    try:
        ticks = [Tick(make_config(), p, None, TickSettings(batch_size=50)) for p in (pool, other_pool)]
        for tick in ticks:
            await tick.refresh_view()
        results = await asyncio.gather(*(t.run_once() for t in ticks), *(t.run_once() for t in ticks))
    finally:
        await other_pool.close()
    assigned = [job_id for r in results for job_id, _, _ in r.assigned]
    assert len(assigned) == len(set(assigned)) == 400
    rows = await pool.fetch(
        "SELECT job_id, count(*) FROM federation_changelog WHERE to_state = 'assigned' GROUP BY job_id"
    )
    assert len(rows) == 400 and all(r["count"] == 1 for r in rows)
    await assert_changelog_replays(store)


async def test_capacity_holds_across_batches_placed_while_the_previous_commits(pool):
    # Batch k+1 is claimed and placed while batch k commits: capacity taken by k must
    # already count, and the highest priorities must still win the slots.
    store = Store(pool)
    await advertise(store, "tpu-east", slots=30)
    jobs = [make_job(priority=i % 7) for i in range(200)]
    tick = await _queue_and_tick(store, jobs, slots=30, batch_size=25)
    result = await tick.run_once()
    assert len(result.assigned) == 60
    per_peer = {}
    for _, peer, _ in result.assigned:
        per_peer[peer] = per_peer.get(peer, 0) + 1
    assert per_peer == {"gpu-west": 30, "tpu-east": 30}
    priorities = {j.job_id: j.priority for j in jobs}
    lowest_placed = min(priorities[job_id] for job_id, _, _ in result.assigned)
    assert all(priorities[j] <= lowest_placed for j in priorities if j not in {a for a, _, _ in result.assigned})
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'queued'") == 140
    again = await tick.run_once()
    assert again.assigned == []  # full: nothing more, nothing twice
    await assert_changelog_replays(store)


async def test_deadline_makes_queued_jobs_unschedulable(pool):
    store = Store(pool)
    job = make_job(deadline_s=0.001, constraints=[{"key": "device_type", "op": "eq", "value": "quantum"}])
    await insert_jobs(store, [job])
    await pool.execute("SELECT pg_sleep(0.01)")
    result = await Tick(make_config(), pool, None).run_once()
    assert result.expired == 1
    row = await store.job_get(job.job_id)
    assert row.state == "unschedulable" and "deadline" in row.reason
    await assert_changelog_replays(store)


async def _assign_and_start(store, job, peer, start=False):
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], peer)
    if start:
        await store.job_move(Move(job.job_id, JobState.ASSIGNED, JobState.RUNNING, 1, "test", peer))


async def test_lost_peer_work_is_requeued_or_failed_and_pins_stay(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4)
    never_started = make_job(max_retries=0)
    running_retry = make_job(max_retries=1)
    running_final = make_job(max_retries=0)
    pinned = make_job(pin="gpu-west")
    await _assign_and_start(store, never_started, "gpu-west")
    await _assign_and_start(store, running_retry, "gpu-west", start=True)
    await _assign_and_start(store, running_final, "gpu-west", start=True)
    await _assign_and_start(store, pinned, "gpu-west", start=True)
    config = make_config(assign_grace_s=0.001)
    now = [time.time()]
    tick = Tick(config, pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    await pool.execute("SELECT pg_sleep(0.01)")
    assert await tick.recover_lost_peers() == 0  # gpu-west is fresh
    # An hour later (injected clock, no sleeping) gpu-west has gone silent.
    now[0] += 3600
    assert await tick.recover_lost_peers() == 3

    row = await store.job_get(never_started.job_id)
    assert (row.state, row.epoch, row.owner_peer_id) == ("queued", 2, None)
    row = await store.job_get(running_retry.job_id)
    assert (row.state, row.epoch, row.avoid_peers) == ("queued", 2, ["gpu-west"])
    row = await store.job_get(running_final.job_id)
    assert row.state == "failed" and "peer lost" in row.reason
    row = await store.job_get(pinned.job_id)
    assert (row.state, row.epoch) == ("running", 1)
    await assert_changelog_replays(store)


async def test_restarted_control_plane_gives_peers_a_ttl_before_judging_them(pool):
    """No mass failure when the tick itself was the one that was down."""
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, ttl_s=1.5)
    job = make_job(max_retries=0)
    await _assign_and_start(store, job, "gpu-west", start=True)
    # The tick comes up an hour after gpu-west's last heartbeat reached Postgres
    # (say Postgres and NATS were down with it): it must wait a TTL first.
    await pool.execute("UPDATE peer_heartbeat SET received_at = now() - interval '1 hour'")
    now = [time.time() + 3600]
    tick = Tick(make_config(assign_grace_s=0.001), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    assert await tick.recover_lost_peers() == 0
    assert (await store.job_get(job.job_id)).state == "running"
    now[0] += 1.0  # still within one TTL of the restart
    assert await tick.recover_lost_peers() == 0
    now[0] += 1.0  # a full TTL after the restart and still silent: now it is lost
    assert await tick.recover_lost_peers() == 1
    assert (await store.job_get(job.job_id)).state == "failed"


async def test_a_pool_of_one_places_batch_by_batch(database_url):
    from irisfed.services.common import db as dbmod

    single = await dbmod.connect(database_url, max_size=1)
    try:
        store = Store(single)
        tick = await _queue_and_tick(store, [make_job() for _ in range(100)], slots=30, batch_size=20)
        result = await asyncio.wait_for(tick.run_once(), 30)  # no second connection to wait for
        assert len(result.assigned) == 30
        await assert_changelog_replays(store)
    finally:
        await single.close()


async def test_a_failed_batch_leaves_no_claim_behind(pool, monkeypatch):
    store = Store(pool)
    tick = await _queue_and_tick(store, [make_job() for _ in range(100)], slots=500, batch_size=20)
    real_assign, calls = Store.job_assign_batch, []

    async def fail_third(self, assignments, details=None):
        calls.append(len(assignments))
        if len(calls) == 3:
            raise RuntimeError("injected: assign failed")
        return await real_assign(self, assignments, details)

    monkeypatch.setattr(Store, "job_assign_batch", fail_third)  # the tick's batches run on bound stores
    try:
        await tick.run_once()
        raise AssertionError("the injected failure should surface")
    except RuntimeError as exc:
        assert "injected" in str(exc)
    monkeypatch.undo()
    assigned = await pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'assigned'")
    assert assigned == 40  # the two batches committed before the failure, nothing of the third
    async with store.transaction() as tx:  # every queued row is claimable again
        claimable = await tx.job_claim_queued(1000)
    assert len(claimable) == 60
    await assert_changelog_replays(store)


async def test_capacity_in_use_is_counted_with_one_connection_or_many(pool, database_url):
    # The counts of what is in use run beside the first claim when the pool has
    # connections to spare, and before it on the one connection otherwise: either
    # way a run sees the slots already taken and fills only what is left.
    from irisfed.services.common import db as dbmod

    store = Store(pool)
    await advertise(store, "gpu-west", slots=3)
    taken = [make_job() for _ in range(2)]
    await insert_jobs(store, taken)
    await assign_jobs(store, taken, "gpu-west")
    for size in (1, 4):
        waiting = [make_job() for _ in range(3)]
        await insert_jobs(store, waiting)
        own = await dbmod.connect(database_url, min_size=1, max_size=size)
        try:
            tick = Tick(make_config(), own, None)
            await tick.refresh_view()
            result = await tick.run_once()
        finally:
            await own.close()
        assert len(result.assigned) == (1 if size == 1 else 0), size  # 3 slots, 2 then 3 in use
        assert result.waiting == (2 if size == 1 else 5)  # the first round's two still wait
    await assert_changelog_replays(store)
