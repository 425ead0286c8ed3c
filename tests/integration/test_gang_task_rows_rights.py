"""What a peer's own restricted login role may do with gangs (migration 0016): task rows
(``irisfed_job_tasks_report``) and hand-backs (``irisfed_job_hand_back``).

A peer may update its own task rows whatever the job is now, insert rows only for a job
it owns at that epoch and an index below its replicas, and hand back only its own
``assigned`` job at its epoch. Never another peer's, never in another peer's name, never
by writing the table directly.
"""

from __future__ import annotations

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.db_roles import peer_role
from irisfed.services.common.store import Store
from irisfed.shared.errors import PermanentStoreError
from irisfed.shared.lifecycle import JobState
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.db_roles import as_role
from tests.infra.factories import assign_jobs, insert_jobs, make_job, start_jobs


@pytest.fixture
async def gpu_pool(database_url, roles):
    pool = await dbmod.connect(as_role(database_url, peer_role("gpu-west")), max_size=2)
    yield pool
    await pool.close()


def row(job_id: str, epoch: int, index: int, node: str = "n", state: str = "running"):
    return (job_id, epoch, index, node, state, None, None)


async def gangs(admin: Store) -> tuple[str, str]:
    """A gang of two assigned to gpu-west and one assigned to tpu-east (epoch 1 each);
    tpu-east has recorded its two tasks."""
    mine, theirs = make_job(replicas=2), make_job(replicas=2)
    await insert_jobs(admin, [mine, theirs])
    await assign_jobs(admin, [mine], "gpu-west")
    await assign_jobs(admin, [theirs], "tpu-east")
    assert await admin.job_tasks_report("tpu-east", [row(theirs.job_id, 1, i, f"east-{i}") for i in (0, 1)]) == 2
    return mine.job_id, theirs.job_id


async def tasks(admin: Store, job_id: str) -> list[tuple]:
    return [(t.epoch, t.task_index, t.peer_id, t.node, t.state) for t in await admin.job_tasks_list(job_id)]


async def test_a_peer_writes_task_rows_only_for_its_own_job_at_its_epoch_within_its_replicas(pool, gpu_pool):
    admin, gpu = Store(pool), Store(gpu_pool)
    mine, theirs = await gangs(admin)
    before = await tasks(admin, theirs)

    with pytest.raises(PermanentStoreError) as caught:  # in another peer's name
        await gpu.job_tasks_report("tpu-east", [row(theirs, 1, 0, "forged", "failed")])
    assert caught.value.error_class == "InsufficientPrivilegeError"
    # Another peer's job, in its own name: its rows are not ours to update, nor the job to insert for.
    assert await gpu.job_tasks_report("gpu-west", [row(theirs, 1, i, "forged", "failed") for i in (0, 1, 2)]) == 0
    assert await tasks(admin, theirs) == before

    # Its own job: not at another epoch, not past its replicas.
    for bad in (row(mine, 0, 0), row(mine, 2, 0), row(mine, 1, 2), row(mine, 1, 4095)):
        assert await gpu.job_tasks_report("gpu-west", [bad]) == 0, bad
    with pytest.raises(PermanentStoreError):  # a negative index: refused, not stored
        await gpu.job_tasks_report("gpu-west", [row(mine, 1, -1)])
    with pytest.raises(PermanentStoreError):  # a state that is none
        await gpu.job_tasks_report("gpu-west", [row(mine, 1, 0, state="succeeded; DROP TABLE jobs")])
    assert await tasks(admin, mine) == []
    assert await gpu.job_tasks_report("gpu-west", [row(mine, 1, i, f"west-{i}") for i in (0, 1)]) == 2

    # Directly: nothing.
    for statement in (
        f"INSERT INTO job_tasks (job_id, epoch, task_index, peer_id, state) VALUES ('{theirs}', 1, 3, 'gpu-west', 'running')",
        f"UPDATE job_tasks SET state = 'failed' WHERE job_id = '{theirs}'",
        "UPDATE job_tasks SET peer_id = 'gpu-west'",
        "DELETE FROM job_tasks",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute(statement)
    assert await tasks(admin, theirs) == before

    # The job moves on (taken back: epoch 2, no owner). Its old rows stay its own to
    # update (a fenced run still says how its tasks ended); new rows for it, none.
    await pool.execute("UPDATE jobs SET state = 'queued', epoch = 2, owner_peer_id = NULL WHERE job_id = $1", mine)
    assert await gpu.job_tasks_report("gpu-west", [row(mine, 1, 0, None, "killed")]) == 1
    assert await gpu.job_tasks_report("gpu-west", [row(mine, 2, 0), row(mine, 2, 1)]) == 0
    assert await tasks(admin, mine) == [(1, 0, "gpu-west", "west-0", "killed"), (1, 1, "gpu-west", "west-1", "running")]


async def test_a_peer_hands_back_only_its_own_assigned_gang_at_its_epoch(pool, gpu_pool):
    admin, gpu = Store(pool), Store(gpu_pool)
    mine, theirs = await gangs(admin)
    with pytest.raises(PermanentStoreError) as caught:
        await gpu.job_hand_back("tpu-east", theirs, 1, JobState.QUEUED, "forged")
    assert caught.value.error_class == "InsufficientPrivilegeError"
    assert await gpu.job_hand_back("gpu-west", theirs, 1, JobState.QUEUED, "forged") is None
    for epoch in (0, 2):
        assert await gpu.job_hand_back("gpu-west", mine, epoch, JobState.QUEUED, "stale") is None
    with pytest.raises(asyncpg.InvalidParameterValueError):  # no other ending than queued, failed, killed
        await gpu_pool.fetchval("SELECT irisfed_job_hand_back('gpu-west', $1, 1, 'succeeded', 'x')", mine)
    with pytest.raises(asyncpg.InvalidParameterValueError):
        await gpu_pool.fetchval("SELECT irisfed_job_hand_back('gpu-west', $1, 1, NULL, 'x')", mine)
    job = await admin.job_get(theirs)
    assert (job.state, job.epoch, job.owner_peer_id, job.attempts) == (JobState.ASSIGNED, 1, "tpu-east", 0)

    # Accepted (running), it is no longer handed back: its run ends by job_end_run.
    running = make_job(replicas=2)
    await insert_jobs(admin, [running])
    await assign_jobs(admin, [running], "gpu-west")
    assert running.job_id in await start_jobs(gpu, [running], "gpu-west")
    assert await gpu.job_hand_back("gpu-west", running.job_id, 1, JobState.QUEUED, "late") is None
    assert (await admin.job_get(running.job_id)).state is JobState.RUNNING

    # Its own assigned gang at its epoch: once, then never again.
    assert await gpu.job_hand_back("gpu-west", mine, 1, JobState.QUEUED, "tasks did not all start") is not None
    job = await admin.job_get(mine)
    assert (job.state, job.epoch, job.owner_peer_id, job.attempts) == (JobState.QUEUED, 2, None, 1), job
    assert await gpu.job_hand_back("gpu-west", mine, 1, JobState.QUEUED, "again") is None
    assert await gpu.job_hand_back("gpu-west", mine, 2, JobState.FAILED, "again") is None
    await assert_changelog_replays(admin)
