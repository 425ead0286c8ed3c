"""Preemption in the tick, against a real Postgres: who is stopped, how it is written, and the races.

A federation full of ``batch`` work; an ``interactive`` job that fits only if batch
work goes. The tick's pass decides (shared/preemption.py) and commits the victims'
moves, their history rows and the preempting job's assignment in one transaction.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from irisfed.services.common.store import Store
from irisfed.services.tick.service import VICTIM_CHANGED, Tick
from irisfed.shared.bands import band_rank
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import (
    advertise_cpus,
    assign_jobs,
    banded_job,
    insert_jobs,
    make_config,
    make_job,
    start_in_order,
    start_jobs,
    tick_for,
)
from tests.infra.probes import history_of

PEER = "gpu-west"


async def test_one_batch_job_goes_for_an_interactive_job_and_runs_again_later(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=4)
    batch = [banded_job("batch", cpu=2, max_retries=1) for _ in range(2)]
    await start_in_order(store, batch)
    urgent = banded_job("interactive", cpu=2)
    await insert_jobs(store, [urgent])
    tick = await tick_for(pool)

    result = await tick.run_once(full=False)

    assert [(j, p) for j, p, _ in result.assigned] == [(urgent.job_id, PEER)]
    [victim] = result.preempted
    newest = batch[1].job_id  # started last: the most recently started goes
    assert (victim.job_id, victim.state.value, victim.run_owner, victim.preemptor) == (
        newest, "queued", PEER, urgent.job_id)
    row = await store.job_get(newest)
    assert (row.state.value, row.epoch, row.owner_peer_id, row.backend, row.preemptions) == ("queued", 2, None, None, 1)
    assert row.max_retries == 1 and row.reason == f"preempted by {urgent.job_id}"
    assert row.stopping_on == PEER  # not placed again until its old run is seen to stop
    assert (await history_of(pool, newest))[-1] == ("running", "queued", f"preempted by {urgent.job_id}")
    assert (await history_of(pool, urgent.job_id))[-1] == ("queued", "assigned", f"placed; preempted {newest}")
    other = await store.job_get(batch[0].job_id)
    assert (other.state.value, other.preemptions) == ("running", 0)

    # The preempted run's report is fenced: its epoch moved on. Its agent, seeing the
    # run gone, lets it be placed again (the agent does both: tests/integration/test_agent_preempted_runs.py).
    assert await store.job_finish_batch(PEER, [(newest, 1, 0, False)]) == {}
    assert (await store.job_get(newest)).state.value == "queued"
    assert await store.job_runs_stopped("tpu-east", [newest]) == []  # only the run's own peer says so
    assert await store.job_runs_stopped(PEER, [newest]) == [newest]
    assert (await store.job_get(newest)).stopping_on is None

    # It waits at its old place (no room: batch preempts nothing) and runs once room frees.
    result = await tick.run_once(full=False)
    assert result.assigned == [] and result.preempted == []
    assert (await store.job_get(newest)).reason.endswith("cannot preempt: a batch job preempts nothing")
    await store.job_finish_batch(PEER, [(batch[0].job_id, 1, 0, False)])
    result = await tick.run_once(full=False)
    assert [j for j, _, _ in result.assigned] == [newest]
    assert newest in await start_jobs(store, [batch[1]], PEER, epoch=3)
    assert (await store.job_finish_batch(PEER, [(newest, 3, 0, False)]))[newest].state.value == "succeeded"
    done = await store.job_get(newest)
    assert (done.state.value, done.preemptions, done.attempts) == ("succeeded", 1, 2)


async def test_production_work_is_never_preempted(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=2)
    await start_in_order(store, [banded_job("production", cpu=2)])
    urgent = banded_job("production", cpu=1)
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    assert result.assigned == [] and result.preempted == []
    row = await store.job_get(urgent.job_id)
    assert row.reason.endswith("cannot preempt: no job of a lower band runs on a backend that could hold it")


async def test_it_never_preempts_for_room_it_would_still_not_have(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=4)
    await start_in_order(store, [banded_job("batch", cpu=1), banded_job("production", cpu=3)])
    urgent = banded_job("interactive", cpu=2)
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    assert result.preempted == []
    assert (await store.job_get(urgent.job_id)).reason.endswith(
        "cannot preempt: it would not fit even with every job of a lower band there preempted")


async def test_it_preempts_only_on_the_peer_where_it_then_runs(pool):
    store = Store(pool)
    await advertise_cpus(store, PEER, cpus=2)
    await advertise_cpus(store, "tpu-east", cpus=2)
    west, east = banded_job("batch", cpu=2), banded_job("batch", cpu=2)
    await start_in_order(store, [west], PEER)
    await start_in_order(store, [east], "tpu-east")
    urgent = banded_job("interactive", cpu=2, cluster_pin="tpu-east")
    urgent = msgspec.structs.replace(urgent, pinned_peer_id="tpu-east")
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    assert [(v.job_id, v.run_owner) for v in result.preempted] == [(east.job_id, "tpu-east")]
    assert [(j, p) for j, p, _ in result.assigned] == [(urgent.job_id, "tpu-east")]
    assert (await store.job_get(west.job_id)).state.value == "running"


async def test_past_max_preemptions_the_next_preemption_fails_it(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    fragile = banded_job("batch", cpu=1, max_preemptions=0)
    await start_in_order(store, [fragile])
    urgent = banded_job("interactive", cpu=1)
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    [victim] = result.preempted
    assert victim.state.value == "failed"
    row = await store.job_get(fragile.job_id)
    assert (row.state.value, row.owner_peer_id, row.preemptions, row.epoch) == ("failed", PEER, 1, 2)
    assert row.reason == f"preempted by {urgent.job_id}; preempted 1 times, more than its max_preemptions 0"


async def test_a_victim_with_a_stored_cancel_ends_killed(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    victim = banded_job("batch", cpu=1)
    await start_in_order(store, [victim])
    await store.job_request_cancel(victim.job_id, "user default")
    urgent = banded_job("interactive", cpu=1)
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    assert [v.state.value for v in result.preempted] == ["killed"]
    row = await store.job_get(victim.job_id)
    assert row.state.value == "killed" and row.reason == f"preempted by {urgent.job_id}; cancelled by user default"


async def test_a_job_over_its_quota_preempts_nothing(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    await start_in_order(store, [banded_job("batch", cpu=1)])
    over = make_job(resources={"cpu": 1})
    over = msgspec.structs.replace(over, user_id="alice", job_id="alice:" + over.job_id)
    held = make_job(resources={"cpu": 1})
    held = msgspec.structs.replace(held, user_id="alice", job_id="alice:" + held.job_id)
    await advertise_cpus(store, "tpu-east", cpus=1)
    await start_in_order(store, [held], "tpu-east")  # alice holds her whole quota there
    await insert_jobs(store, [over])
    tick = await tick_for(pool, users=[{"id": "alice", "quota": {"cpu": 1}}])
    result = await tick.run_once(full=False)
    assert result.preempted == [] and result.assigned == []
    assert (await store.job_get(over.job_id)).reason.startswith("quota:")


async def test_a_victim_that_ends_between_decision_and_commit_costs_a_pass_not_a_needless_victim(pool, monkeypatch):
    store = Store(pool)
    await advertise_cpus(store, cpus=2)
    batch = [banded_job("batch", cpu=1) for _ in range(2)]
    await start_in_order(store, batch)
    urgent = banded_job("interactive", cpu=1)
    await insert_jobs(store, [urgent])
    tick = await tick_for(pool)
    real_lock = Store.job_lock_victims

    async def victim_finishes_first(self, victims):
        for job_id, _, epoch, owner in victims:
            await Store(pool).job_finish_batch(owner, [(job_id, epoch, 0, False)])
        return await real_lock(self, victims)

    monkeypatch.setattr(Store, "job_lock_victims", victim_finishes_first)
    result = await tick.run_once(full=False)
    assert result.assigned == [] and result.preempted == []
    ended = await store.job_get(batch[1].job_id)
    assert (ended.state.value, ended.preemptions) == ("succeeded", 0)
    assert (await store.job_get(urgent.job_id)).reason == VICTIM_CHANGED
    monkeypatch.setattr(Store, "job_lock_victims", real_lock)
    # The next pass finds the room the victim freed: placed, nobody preempted.
    result = await tick.run_once(full=False)
    assert [j for j, _, _ in result.assigned] == [urgent.job_id] and result.preempted == []
    assert (await store.job_get(batch[0].job_id)).state.value == "running"


async def test_two_ticks_at_once_never_preempt_a_job_twice_or_for_one_room_twice(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=4, slots=4)
    batch = [banded_job("batch", cpu=2) for _ in range(2)]
    await start_in_order(store, batch)
    urgent = [banded_job("interactive", cpu=2) for _ in range(4)]
    await insert_jobs(store, urgent)
    ticks = [await tick_for(pool), await tick_for(pool)]
    for _ in range(3):
        await asyncio.gather(*(t.run_once(full=False) for t in ticks))
    counts = await pool.fetch("SELECT job_id, count(*) AS n FROM federation_changelog "
                              "WHERE detail LIKE 'preempted by %' GROUP BY job_id")
    assert all(r["n"] == 1 for r in counts)  # the victims stay queued (batch preempts nothing)
    assert {r["job_id"] for r in counts} == {b.job_id for b in batch}
    live = await pool.fetch("SELECT job_id, resources FROM jobs WHERE state IN ('assigned', 'running')")
    assert len(live) == 2 and all(r["job_id"] in {u.job_id for u in urgent} for r in live)


async def test_a_cancelled_preempting_job_releases_the_room_it_held(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    victim = banded_job("batch", cpu=1)
    await start_in_order(store, [victim])
    urgent = banded_job("interactive", cpu=1)
    await insert_jobs(store, [urgent])
    tick = await tick_for(pool)
    result = await tick.run_once(full=False)
    [(job_id, _, epoch)] = result.assigned
    # Cancelled before its agent started it: killed at once (the router's rule), as here.
    moved = await store.job_move(Move(job_id, JobState.ASSIGNED, JobState.KILLED, epoch, actor="router",
                                      owner_peer_id=PEER, reason="cancelled by user default"))
    assert moved is not None
    # The room is free again: the victim, queued, is placed back on it once its old run stopped.
    assert (await tick.run_once(full=False)).assigned == []
    assert await store.job_runs_stopped(PEER, [victim.job_id]) == [victim.job_id]
    result = await tick.run_once(full=False)
    assert [j for j, _, _ in result.assigned] == [victim.job_id]


@pytest.mark.parametrize("state", ["assigned"])
async def test_an_assigned_victim_is_preempted_too_and_its_start_is_fenced(pool, state):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    victim = banded_job("batch", cpu=1)
    await insert_jobs(store, [victim])
    await assign_jobs(store, [victim], PEER)
    urgent = banded_job("interactive", cpu=1)
    await insert_jobs(store, [urgent])
    result = await (await tick_for(pool)).run_once(full=False)
    assert [(v.job_id, v.state.value) for v in result.preempted] == [(victim.job_id, "queued")]
    assert await start_jobs(store, [victim], PEER, epoch=1) == {}  # its old assignment cannot start
    row = await store.job_get(victim.job_id)
    assert (row.state.value, row.attempts, row.preemptions) == ("queued", 0, 1)


async def test_the_queue_lists_each_users_highest_band_so_the_tick_reads_victims_at_once(pool):
    store = Store(pool)

    def of(user: str, band: str, job_id: str):
        return msgspec.structs.replace(banded_job(band), user_id=user, job_id=f"{user}:{job_id}")

    await insert_jobs(store, [of("alice", "batch", "a1"), of("alice", "production", "a2"),
                              of("bob", "batch", "b1"), of("carol", "interactive", "c1")])
    assert await store.job_list_queued_users() == {
        "alice": band_rank("production"), "bob": band_rank("batch"), "carol": band_rank("interactive")}
    await pool.execute("UPDATE jobs SET state = 'killed' WHERE job_id = 'alice:a2'")
    assert (await store.job_list_queued_users())["alice"] == band_rank("batch")


async def test_a_preempted_run_must_be_seen_to_stop_before_its_job_is_placed_again(pool):
    """A running victim is queued at once (fenced) but not placed again, anywhere, while
    its old run may live: its owner says the run is gone (the agent, after the kill), or
    the owner is lost past TTL + grace (the tick). An assigned victim never started a
    run: it is free at once."""
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    await advertise_cpus(store, "tpu-east", cpus=1)
    started, east_holder = banded_job("batch"), banded_job("interactive")
    await start_in_order(store, [started])
    await start_in_order(store, [east_holder], peer="tpu-east")
    urgent = banded_job("interactive")
    await insert_jobs(store, [urgent])
    now = [time.time()]
    tick = Tick(make_config(heartbeat_ttl_s=60.0, assign_grace_s=1.0), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    assert [v.job_id for v in (await tick.run_once(full=False)).preempted] == [started.job_id]
    assert (await store.job_get(started.job_id)).stopping_on == PEER

    # Room elsewhere: the victim still waits, though a later job takes the room.
    assert east_holder.job_id in await store.job_finish_batch("tpu-east", [(east_holder.job_id, 1, 0, False)])
    later = banded_job("batch")
    await insert_jobs(store, [later])
    assert [j for j, _, _ in (await tick.run_once(full=False)).assigned] == [later.job_id]
    assert (await store.job_get(started.job_id)).state is JobState.QUEUED
    assert later.job_id in await start_jobs(store, [later], "tpu-east")
    assert later.job_id in await store.job_finish_batch("tpu-east", [(later.job_id, 1, 0, False)])

    # gpu-west lost past TTL + grace: no agent is left to say so; the tick lets it go.
    assert await tick.recover_lost_peers() == 0
    assert (await store.job_get(started.job_id)).stopping_on == PEER
    now[0] += 3600
    await advertise_cpus(store, "tpu-east", cpus=2, seq=2)  # tpu-east still heard from
    await tick.refresh_view()
    await tick.recover_lost_peers()  # the preempting job is taken back from gpu-west too
    assert (await store.job_get(started.job_id)).stopping_on is None
    placed = (await tick.run_once(full=False)).assigned
    assert sorted((j, p) for j, p, _ in placed) == sorted([(started.job_id, "tpu-east"), (urgent.job_id, "tpu-east")])
    await assert_changelog_replays(store)


async def test_a_peer_no_longer_configured_never_keeps_a_preempted_job_waiting(pool):
    store = Store(pool)
    await advertise_cpus(store, cpus=1)
    victim = banded_job("batch")
    await start_in_order(store, [victim])
    await insert_jobs(store, [banded_job("interactive")])
    await (await tick_for(pool)).run_once(full=False)
    assert (await store.job_get(victim.job_id)).stopping_on == PEER
    # gpu-west leaves the configuration; once such owners count as lost, its wait ends.
    now = [time.time()]
    tick = Tick(make_config(peers=[{"id": "home"}, {"id": "tpu-east"}], assign_grace_s=0.001), pool, None,
                clock=lambda: now[0])
    await tick.refresh_view()
    await tick.recover_lost_peers()
    assert (await store.job_get(victim.job_id)).stopping_on == PEER  # not judged within a TTL of starting
    now[0] += 3600
    await tick.recover_lost_peers()
    assert (await store.job_get(victim.job_id)).stopping_on is None
