"""Invariant 3 at the database: a status write with a stale epoch is refused."""

from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays, changelog_violations
from tests.infra.factories import assign_jobs, insert_jobs, make_job


async def test_stale_epoch_write_is_refused(pool):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    moved = await assign_jobs(store, [job], "gpu-west")
    assert moved[0].epoch == 1
    assert await store.job_move(Move(job.job_id, JobState.ASSIGNED, JobState.RUNNING, 1, "gpu-west", "gpu-west"))
    # The job is requeued under a new epoch (as after a peer loss) ...
    assert await store.job_move(Move(job.job_id, JobState.RUNNING, JobState.QUEUED, 1, "tick", None, new_epoch=2))
    # ... so the old runner's report under epoch 1 changes nothing.
    stale = Move(job.job_id, JobState.RUNNING, JobState.SUCCEEDED, 1, "gpu-west", "gpu-west", exit_code=0)
    assert await store.job_move(stale) is None
    row = await store.job_get(job.job_id)
    assert (row.state, row.epoch, row.exit_code) == ("queued", 2, None)
    # A stale claim by a tick that read epoch 1 is refused too.
    assert await assign_jobs(store, [job], "tpu-east", epoch=1) == []
    await assert_changelog_replays(store)


async def test_invariant_checker_catches_a_divergent_job(pool):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    # Someone edits `jobs` behind the changelog's back: the replay check must notice.
    await pool.execute("UPDATE jobs SET state = 'running', epoch = 3 WHERE job_id = $1", job.job_id)
    problems = await changelog_violations(store)
    assert any("replays to queued but jobs says running" in p for p in problems)
    assert any("ends at epoch 0 but jobs says 3" in p for p in problems)
