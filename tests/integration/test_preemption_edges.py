"""Preemption in the tick at its edges, against a real Postgres: which victim an assigned
job that ran before is taken for, the quota recheck of a batch whose preempting job is
dropped, and preemption records naming many long ids (nothing cut or corrupted).

Pure-rule and message edges: tests/unit/test_preemption_edges.py.
"""

from __future__ import annotations

import msgspec

from irisfed.cli import views
from irisfed.services.common.store import Store
from irisfed.shared.bands import band_rank
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from tests.infra.factories import (
    advertise_cpus,
    assign_jobs,
    banded_job,
    insert_jobs,
    make_job,
    start_in_order,
    tick_for,
)
from tests.infra.probes import history_of

PEER = "gpu-west"


async def test_an_assigned_victim_that_ran_before_holds_its_room_since_its_new_assignment(pool):
    """A job assigned again after an earlier run (requeued by a lost peer or a
    preemption) has not started this time: its room is its since its new assignment, so
    it is the most recent holder, not a job started before it. The tick must stop it
    (no work lost), not a job that has been running since."""
    store = Store(pool)
    await advertise_cpus(store, cpus=2)
    again = banded_job("batch")
    await start_in_order(store, [again])  # epoch 1, started now
    async with store.transaction() as tx:  # its peer was lost: back to the queue, epoch 2
        assert await tx.job_move(Move(again.job_id, JobState.RUNNING, JobState.QUEUED, 1, actor="tick",
                                      owner_peer_id=None, new_epoch=2, reason="requeued")) is not None
    working = banded_job("batch")
    await start_in_order(store, [working])  # started after `again`'s first run
    await assign_jobs(store, [again], PEER, epoch=2)  # assigned again (epoch 3), not started
    urgent = banded_job("interactive")
    await insert_jobs(store, [urgent])

    result = await (await tick_for(pool)).run_once(full=False)

    assert [(v.job_id, v.state.value) for v in result.preempted] == [(again.job_id, "queued")]
    assert (await store.job_get(working.job_id)).state is JobState.RUNNING


async def test_a_preempting_job_dropped_by_its_quota_recheck_frees_no_quota_for_the_next(pool, monkeypatch):
    """Invariant 10 under a race: the commit rechecks quotas under the users' locks and
    counts a preempting job's victims as freed. Counted for a placement that the recheck
    then drops, the victims keep running, yet the next placement of that user was
    judged as if they had gone: the user ends over its quota."""
    store = Store(pool)
    await advertise_cpus(store, PEER, cpus=1)
    await advertise_cpus(store, "tpu-east", cpus=1)
    mine = banded_job("batch", user="alice")
    await start_in_order(store, [mine])  # alice's batch job fills gpu-west
    first = banded_job("interactive", user="alice", priority=10)  # placed first: on tpu-east, free
    second = banded_job("interactive", user="alice")  # gpu-west is full: preempts alice's batch job
    await insert_jobs(store, [first, second])
    tick = await tick_for(pool, users=[{"id": "alice", "quota": {"cpu": 3}}])
    real_lock = Store.job_quota_lock
    raced = []

    async def a_router_commits_first(self, users, wait_s):
        if not raced:  # a LOCAL job of alice's (2 cpu) committed by a router since the tick's snapshot
            local = banded_job("interactive", cpu=2, user="alice")
            await insert_jobs(Store(pool), [local])
            await assign_jobs(Store(pool), [local], "home")
            raced.append(local.job_id)
        return await real_lock(self, users, wait_s)

    monkeypatch.setattr(Store, "job_quota_lock", a_router_commits_first)
    await tick.run_once(full=False)

    assert raced
    held = await pool.fetchval(
        "SELECT coalesce(sum((resources->>'cpu')::numeric), 0) FROM jobs "
        "WHERE user_id = 'alice' AND state IN ('assigned', 'running')")
    assert held <= 3, f"alice's live jobs hold {held} cpu, over her quota of 3"


async def test_many_long_victim_ids_are_recorded_whole_and_read_back_whole(pool):
    """A job that needs many victims with 128-character ids: its history row names every
    one, each victim's row names it, nothing is cut, and the CLI reads them all back."""
    store = Store(pool)
    await advertise_cpus(store, cpus=40, slots=40)
    victims = [banded_job("batch", job_id=f"v{i:02d}" + "x" * 125) for i in range(40)]
    assert all(len(v.job_id) == 128 for v in victims)
    await start_in_order(store, victims)
    urgent = banded_job("production", cpu=40, user="alice", job_id="u" + "y" * 127)
    await insert_jobs(store, [urgent])

    result = await (await tick_for(pool, users=[{"id": "alice", "max_band": "production"}])).run_once(full=False)

    assert sorted(v.job_id for v in result.preempted) == sorted(v.job_id for v in victims)
    placed = (await history_of(pool, urgent.job_id))[-1]
    assert placed[:2] == ("queued", "assigned")
    named = placed[2].removeprefix("placed; preempted ").split(", ")
    assert sorted(named) == sorted(v.job_id for v in victims) and len(placed[2]) > 40 * 128
    for v in victims:
        assert (await history_of(pool, v.job_id))[-1] == ("running", "queued", f"preempted by {urgent.job_id}")
        assert (await store.job_get(v.job_id)).reason == f"preempted by {urgent.job_id}"
    entries = await store.changelog_list_for_job(urgent.job_id)
    assert sorted(views.preempted_for(entries[-1])) == sorted(v.job_id for v in victims)
    [stop] = views.preemptions(await store.changelog_list_for_job(victims[0].job_id))
    assert stop.by == urgent.job_id and stop.peer == PEER
    assert (await store.job_get(urgent.job_id)).state is JobState.ASSIGNED


async def test_a_dropped_preemption_whose_victim_holds_what_its_backend_no_longer_offers_gives_its_room_back(
        pool, monkeypatch):
    """The victim asked memory when placed; its backend now advertises cpu only (its agent
    restarted with other --resources, an engine lost the nodes that had it). The victim
    changes before the commit, so the preemption is dropped and the run takes the room
    back: that must not raise (it did, a KeyError after the commit, so the pass's
    notices were never sent)."""
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    holder = make_job(resources={"cpu": 1, "memory_mb": 512}, band="batch")
    holder = msgspec.structs.replace(holder, band=band_rank("batch"))
    await start_in_order(store, [holder])
    urgent = banded_job("interactive")
    await insert_jobs(store, [urgent])
    tick = await tick_for(pool)
    real_lock = Store.job_lock_victims

    async def victim_cancelled_meanwhile(self, victims):
        await Store(pool).job_request_cancel(holder.job_id, "user default")
        async with Store(pool).transaction() as tx:  # the router kills it (a cancel stored, its run told)
            await tx.job_move(Move(holder.job_id, JobState.RUNNING, JobState.KILLED, 1, actor="agent",
                                   owner_peer_id=PEER, reason="cancelled"))
        return await real_lock(self, victims)

    monkeypatch.setattr(Store, "job_lock_victims", victim_cancelled_meanwhile)
    result = await tick.run_once(full=False)

    assert result.assigned == [] and result.preempted == []
    assert (await store.job_get(urgent.job_id)).state is JobState.QUEUED
