"""Where Postgres decides what a rule of ``irisfed.shared`` decides, both agree.

The cancel, fencing and reachability rules each have one owner in Python
(``irisfed.shared.cancel``, ``.fencing``, ``.reachability``). A few moves are written
in SQL instead (agents may not write ``jobs`` directly; the tick's placement is one
batched statement; reads judge reachability by ``expires_at``), so each such
statement is run here against a real Postgres, in every case, and its result
compared with the Python rule's.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from irisfed.services.common.store import Store
from irisfed.shared.cancel import run_ending
from irisfed.shared.fencing import epoch_after
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat
from irisfed.shared.reachability import is_reachable
from tests.infra.factories import assign_jobs, insert_jobs, make_job, running_jobs

PEER = "gpu-west"


async def test_placement_steps_the_epoch_as_the_fencing_rule_says(pool):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    assert (await store.job_get(job.job_id)).epoch == 0
    placed = await assign_jobs(store, [job], PEER, epoch=0)
    assert [p.epoch for p in placed] == [epoch_after(JobState.QUEUED, JobState.ASSIGNED, 0)]


@pytest.mark.parametrize("to_state", [JobState.QUEUED, JobState.FAILED, JobState.KILLED])
async def test_an_agent_ending_its_run_leaves_the_epoch_the_fencing_rule_says(pool, to_state):
    store = Store(pool)
    [job_id] = await running_jobs(store, 1, PEER)
    before = (await store.job_get(job_id)).epoch
    assert await store.job_end_run(PEER, job_id, before, to_state, "test") is not None
    after = await store.job_get(job_id)
    assert after.state is to_state
    assert after.epoch == epoch_after(JobState.RUNNING, to_state, before)
    assert (await store.changelog_list_for_job(job_id))[-1].epoch == after.epoch


@pytest.mark.parametrize("to_state", [JobState.QUEUED, JobState.FAILED, JobState.KILLED])
async def test_an_agent_handing_back_a_gang_leaves_the_epoch_and_retries_the_rules_say(pool, to_state):
    """``irisfed_job_hand_back`` (a gang whose tasks did not all start) against the
    fencing rule's epoch and ``gang_not_started_move``'s retry decision."""
    from irisfed.services.peer_agent.plan import gang_not_started_move

    store = Store(pool)
    job = make_job(replicas=2, max_retries=1)
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], PEER)
    row = await store.job_get(job.job_id)
    assert await store.job_hand_back(PEER, job.job_id, row.epoch, to_state, "test") is not None
    after = await store.job_get(job.job_id)
    assert (after.state, after.attempts) == (to_state, row.attempts + 1)
    assert after.epoch == epoch_after(JobState.ASSIGNED, to_state, row.epoch)
    assert after.owner_peer_id == (None if to_state is JobState.QUEUED else PEER)
    last = (await store.changelog_list_for_job(job.job_id))[-1]
    assert (last.from_state, last.epoch, last.actor) == (JobState.ASSIGNED, after.epoch, PEER)
    # The plan's decision for this job: one retry left before the failed start, none after.
    assert gang_not_started_move(PEER, job.job_id, row.epoch, "x", row).to_state is JobState.QUEUED
    assert gang_not_started_move(PEER, job.job_id, row.epoch, "x", after).to_state is JobState.FAILED
    # Only from assigned, ours, at that epoch.
    assert await store.job_hand_back(PEER, job.job_id, after.epoch, JobState.QUEUED, "again") is None


@pytest.mark.parametrize("exit_code", [0, 1, 137])
@pytest.mark.parametrize(("stored", "reported"), [(False, False), (True, False), (False, True), (True, True)])
async def test_a_finished_run_ends_as_the_cancel_rule_says(pool, exit_code, stored, reported):
    store = Store(pool)
    [job_id] = await running_jobs(store, 1, PEER)
    if stored:
        await store.job_request_cancel(job_id)
    moved = await store.job_finish_batch(PEER, [(job_id, 1, exit_code, reported)])
    expected = run_ending(exit_code, stored or reported)
    assert moved[job_id].state == expected
    row = await store.job_get(job_id)
    assert (row.state, row.epoch) == (expected, epoch_after(JobState.RUNNING, expected, 1))


@pytest.mark.parametrize(("ttl_s", "age_s"), [(6.0, 0.0), (6.0, 3.0), (6.0, 5.5), (6.0, 6.5), (6.0, 600.0),
                                               (1.5, 1.0), (1.5, 2.0)])
async def test_postgres_judges_reachability_as_the_rule_does(pool, ttl_s, age_s):
    store = Store(pool)
    heartbeat = Heartbeat(PEER, 1, datetime.now(UTC), ttl_s,
                          [BackendAd("main", {}, Capacity(1, 1))], run_id="r")
    await store.peer_heartbeat_upsert_batch([(heartbeat, age_s)])
    [row] = [r for r in await store.peer_heartbeat_list() if r.peer_id == PEER]
    now = row.received_epoch + row.age_s  # Postgres's now() of the read, on its own clock
    assert row.reachable is is_reachable(row.received_epoch, row.ttl_s, now)
    assert row.reachable is (age_s < ttl_s)
