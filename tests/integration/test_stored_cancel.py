"""A cancel stored while a job's owner is away holds whichever way the job comes back:
killed, never handed to another peer to run.

The router kills queued and not-yet-started jobs at once; a running job's cancel is
stored (``cancel_requested``) when its owner is offline. Were such a job requeued when
the tick judges its owner lost, another peer would accept it and it would run again.
So recovery kills it, and the claim (the one gate every queued job passes to run
again) kills any queued job that carries a stored cancel, so a cancel that races a
hand-back cannot be lost either. Pinned here: whole claim batches of cancelled jobs
(the cursor and ``more``, pipelined and on a pool of one), a pinned job whose pin is
lost, a cancel racing the tick's claim or an agent's finish on another connection, the
tick's own restricted login role doing the kills, and what ``irisfed job``/``explain``
show after.
"""

from __future__ import annotations

import asyncio
import os
import sys

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.services.router.service import Router
from irisfed.services.tick.service import Tick, TickSettings
from irisfed.shared.clock import ManualClock
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.db_roles import ROLES, as_role
from tests.infra.factories import advertise, insert_jobs, make_config, make_job, running_job
from tests.infra.waiting import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINISH = "SELECT job_id, state FROM irisfed_job_finish_batch($1, $2, $3, $4, $5)"


async def _store_cancel(store: Store, *job_ids: str) -> None:
    """The state a cancel racing a hand-back leaves: queued, the cancel stored (the agent
    read the row before the cancel, then handed it back)."""
    await store.db.execute("UPDATE jobs SET cancel_requested = true WHERE job_id = ANY($1::text[])", list(job_ids))


async def _history(store: Store, job_id: str) -> list[tuple]:
    rows = await store.db.fetch("SELECT from_state, to_state, actor FROM federation_changelog "
                                "WHERE job_id = $1 ORDER BY seq", job_id)
    return [tuple(r) for r in rows]


async def test_a_cancel_stored_for_an_offline_owner_survives_the_owners_loss(pool, nats_client, subject_prefix):
    store = Store(pool)
    job_id = await running_job(store, "gpu-west", max_retries=2)  # unpinned, running, epoch 1
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    router = Router(config, pool, nats_client)  # gpu-west never heard from: offline
    reply = await router.cancel(job_id)
    assert reply.outcome == "pending_owner_offline"
    clock = ManualClock()
    tick = Tick(config, pool, None, clock=clock)
    clock.advance(config.heartbeat_ttl_s + config.assign_grace_s + 1)  # gpu-west now lost
    await advertise(store, "tpu-east", slots=4)  # a healthy peer with room
    await tick.refresh_view()
    result = await tick.run_once()

    row = await store.job_get(job_id)
    assert (row.state, row.owner_peer_id) == ("killed", "gpu-west")
    assert row.epoch == 2  # moved on: the lost owner's copy is fenced when it returns
    assert "cancelled while its owner gpu-west was unreachable" in row.reason
    assert result.assigned == []
    assert await _history(store, job_id) == [(None, "queued", "router"), ("queued", "assigned", "tick"),
                                             ("assigned", "running", "gpu-west"), ("running", "killed", "tick")]
    # tpu-east cannot accept it, at any epoch, and the lost owner's late finish is refused.
    assert await store.job_start_batch("tpu-east", [(job_id, e, None, "x") for e in (1, 2, 3)]) == {}
    assert await store.job_finish_batch("gpu-west", [(job_id, 1, 0, False)]) == {}
    assert (await store.job_get(job_id)).state == "killed"


async def test_a_queued_job_carrying_a_stored_cancel_is_killed_at_the_claim_and_the_rest_are_placed(pool):
    store = Store(pool)
    cancelled, other = make_job(), make_job()
    await insert_jobs(store, [cancelled, other])
    await _store_cancel(store, cancelled.job_id)
    await advertise(store, "gpu-west", slots=4)
    tick = Tick(make_config(tick_interval_s=3600), pool, None)
    await tick.refresh_view()
    result = await tick.run_once()

    assert [job for job, _, _ in result.assigned] == [other.job_id]
    row = await store.job_get(cancelled.job_id)
    assert (row.state, row.owner_peer_id, row.epoch) == ("killed", None, 0)
    assert row.reason == "cancelled while handed back to the queue; not started again"
    assert row.finished_at is not None
    assert await _history(store, cancelled.job_id) == [(None, "queued", "router"), ("queued", "killed", "tick")]
    # Nothing left for a later run, and no peer can start it.
    assert (await tick.run_once()).assigned == []
    assert await store.job_start_batch("gpu-west", [(cancelled.job_id, 1, None, "x")]) == {}


@pytest.mark.parametrize("connections", [1, 4], ids=["pool-of-one", "pipelined"])
async def test_whole_claim_batches_of_cancelled_jobs_are_killed_and_the_claim_goes_on_to_the_rest(
        database_url, pool, connections):
    admin = Store(pool)
    # Seven cancelled jobs first in priority order (three whole batches of two and a
    # half one), then placeable jobs mixed with more cancelled ones behind them.
    cancelled = [make_job(priority=10) for _ in range(7)]
    tail = [make_job(priority=1) for _ in range(6)]
    await insert_jobs(admin, cancelled + tail)
    late_cancelled = [tail[1].job_id, tail[4].job_id]
    await _store_cancel(admin, *[j.job_id for j in cancelled], *late_cancelled)
    placeable = [j.job_id for j in tail if j.job_id not in late_cancelled]
    await advertise(admin, "gpu-west", slots=10)
    tick_pool = await dbmod.connect(database_url, max_size=connections)
    try:
        tick = Tick(make_config(tick_interval_s=3600), tick_pool, None, TickSettings(batch_size=2))
        assert tick.store.max_connections == connections
        await tick.refresh_view()
        result = await tick.run_once()
        assert sorted(job for job, _, _ in result.assigned) == sorted(placeable)
        states = {r.job_id: r.state for r in await admin.job_list_states()}
        for job_id in [j.job_id for j in cancelled] + late_cancelled:
            assert states[job_id] == "killed", job_id
            assert await _history(admin, job_id) == [(None, "queued", "router"), ("queued", "killed", "tick")]
        # Drained: the next pass claims nothing and ends (no loop over the killed).
        assert (await tick.run_once()).assigned == []
    finally:
        await tick_pool.close()
    await assert_changelog_replays(admin)


async def test_cancelled_jobs_behind_a_full_federation_are_killed_once_a_pass_reaches_them(pool):
    """A known limit, documented: the claim stops at the first batch once no slot is left
    (``more`` needs ``run.has_room()``) and claims nothing when no peer is reachable, so
    a queued job carrying a stored cancel behind a full (or absent) federation stays
    ``queued`` until a pass reaches it. What matters is that it is never placed
    meanwhile (and a second cancel kills it at once: the router kills queued jobs)."""
    admin = Store(pool)
    first = make_job(priority=10)
    cancelled = [make_job(priority=1) for _ in range(4)]
    await insert_jobs(admin, [first, *cancelled])
    await _store_cancel(admin, *[j.job_id for j in cancelled])
    await advertise(admin, "gpu-west", slots=1)
    tick = Tick(make_config(tick_interval_s=3600), pool, None, TickSettings(batch_size=2))
    await tick.refresh_view()
    result = await tick.run_once()
    assert [job for job, _, _ in result.assigned] == [first.job_id]
    states = {r.job_id: r.state for r in await admin.job_list_states()}
    # The first batch's cancelled job is killed; those behind the full run wait.
    assert states[cancelled[0].job_id] == "killed"
    assert [states[j.job_id] for j in cancelled[1:]] == ["queued"] * 3
    # Never placed while they wait, and freed room reaches them: all killed, none assigned.
    await admin.db.execute("UPDATE jobs SET state = 'succeeded', finished_at = now() WHERE job_id = $1",
                           first.job_id)
    assert (await tick.run_once()).assigned == []
    assert {(await admin.job_get(j.job_id)).state for j in cancelled} == {"killed"}


async def test_a_pinned_job_with_a_stored_cancel_and_its_pin_lost_is_neither_moved_nor_run(
        pool, nats_client, subject_prefix):
    admin = Store(pool)
    running = await running_job(admin, "gpu-west", max_retries=3, pin="gpu-west", cluster_pin="gpu-west")
    assert (await admin.job_get(running)).pinned_peer_id == "gpu-west"
    queued = make_job(pin="gpu-west", cluster_pin="gpu-west")  # handed back by a launch error, cancel raced it
    await insert_jobs(admin, [queued])
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    router = Router(config, pool, nats_client)
    assert (await router.cancel(running)).outcome == "pending_owner_offline"
    await _store_cancel(admin, queued.job_id)
    clock = ManualClock()
    tick = Tick(config, pool, None, clock=clock)
    clock.advance(config.heartbeat_ttl_s + config.assign_grace_s + 1)  # gpu-west lost
    await advertise(admin, "tpu-east", slots=4)
    await tick.refresh_view()
    result = await tick.run_once()

    assert result.assigned == [] and result.recovered == 0
    row = await admin.job_get(running)
    # Recovery leaves pinned jobs alone: still gpu-west's, same epoch, cancel still stored.
    assert (row.state, row.owner_peer_id, row.epoch, row.cancel_requested) == ("running", "gpu-west", 1, True)
    assert await admin.job_start_batch("tpu-east", [(running, e, None, "x") for e in (1, 2)]) == {}
    # The queued pinned one is killed at the claim although its pin is unreachable.
    q = await admin.job_get(queued.job_id)
    assert (q.state, q.owner_peer_id) == ("killed", None)
    # When gpu-west returns, its run's end (even exit 0) is recorded as killed.
    ended = await admin.job_finish_batch("gpu-west", [(running, 1, 0, False)])
    assert running in ended
    assert (await admin.job_get(running)).state == "killed"
    await assert_changelog_replays(admin)


async def _blocked_on_lock(pool, backend_pid: int) -> bool:
    return bool(await pool.fetchval("SELECT count(*) FROM pg_stat_activity "
                                    "WHERE wait_event_type = 'Lock' AND $1 = ANY(pg_blocking_pids(pid))",
                                    backend_pid))


@pytest.mark.parametrize("stored", [False, True], ids=["plain-queued", "queued-with-stored-cancel"])
async def test_a_cancel_racing_the_tick_claim_waits_for_it_and_the_job_never_runs(
        pool, nats_client, subject_prefix, stored):
    admin = Store(pool)
    job = make_job()
    await insert_jobs(admin, [job])
    if stored:
        await _store_cancel(admin, job.job_id)
    await advertise(admin, "gpu-west", slots=4)
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    tick = Tick(config, pool, None)
    await tick.refresh_view()
    router = Router(config, pool, nats_client)
    async with tick.store.connection() as bound:
        claimed, run = await tick._open_run(bound, tick.view.peers(), tick.clock.monotonic(), concurrent=False)
        batch = await tick._placed(bound, *claimed, run)
        holder = await bound.db.fetchval("SELECT pg_backend_pid()")
        cancel = asyncio.ensure_future(router.cancel(job.job_id))  # locks the row FOR UPDATE: waits
        await wait_for(lambda: _blocked_on_lock(pool, holder), "the router's cancel to wait on the claim")
        assert not cancel.done()
        committed = await tick._commit_batch(batch)
    reply = await cancel
    row = await admin.job_get(job.job_id)
    assert row.state == "killed"
    if stored:  # the claim killed it; the waiting cancel finds it finished
        assert committed == [] and reply.outcome == "already_finished"
        assert await _history(admin, job.job_id) == [(None, "queued", "router"), ("queued", "killed", "tick")]
    else:  # the claim assigned it (epoch 1); the waiting cancel kills it before its owner starts it
        assert [r.job_id for r in committed] == [job.job_id]
        assert reply.outcome == "never_started"
        assert await admin.job_start_batch("gpu-west", [(job.job_id, 1, None, "x")]) == {}
    await assert_changelog_replays(admin)


async def test_the_tick_role_itself_kills_cancelled_jobs_at_claim_and_at_recovery(database_url, pool, roles):
    admin = Store(pool)
    lost_running = await running_job(admin, "gpu-west", max_retries=3)
    await _store_cancel(admin, lost_running)
    queued = make_job()
    await insert_jobs(admin, [queued])
    await _store_cancel(admin, queued.job_id)
    tick_pool = await dbmod.connect(as_role(database_url, ROLES["tick"]), max_size=2)
    try:
        assert await tick_pool.fetchval("SELECT current_user") == ROLES["tick"]
        clock = ManualClock()
        config = make_config(tick_interval_s=3600)
        tick = Tick(config, tick_pool, None, clock=clock)
        clock.advance(config.heartbeat_ttl_s + config.assign_grace_s + 1)
        await advertise(admin, "tpu-east", slots=4)
        await tick.refresh_view()
        result = await tick.run_once()
    finally:
        await tick_pool.close()
    assert result.recovered == 1 and result.assigned == []
    assert (await admin.job_get(lost_running)).state == "killed"
    assert (await admin.job_get(queued.job_id)).state == "killed"
    assert (await _history(admin, lost_running))[-1] == ("running", "killed", "tick")
    assert (await _history(admin, queued.job_id))[-1] == ("queued", "killed", "tick")
    await assert_changelog_replays(admin)


async def _cli(database_url: str, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "irisfed.cli", *argv, "--database-url", database_url, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_irisfed_job_and_explain_say_why_a_claim_killed_a_job(database_url, pool):
    admin = Store(pool)
    job = make_job(constraints=[{"key": "device_type", "op": "eq", "value": "tpu"}])
    await insert_jobs(admin, [job])
    await advertise(admin, "gpu-west", slots=4)
    tick = Tick(make_config(tick_interval_s=3600), pool, None)
    await tick.refresh_view()
    await tick.run_once()  # explained as waiting first (gpu-west advertises no tpu)
    assert (await admin.job_get(job.job_id)).state == "queued"
    await _store_cancel(admin, job.job_id)
    await tick.run_once()
    assert (await admin.job_get(job.job_id)).state == "killed"

    code, out, err = await _cli(database_url, "job", job.job_id)
    assert (code, err) == (0, "")
    assert "killed" in out and "cancelled while handed back to the queue; not started again" in out
    assert "cancel      requested" in out
    code, out, err = await _cli(database_url, "explain", job.job_id)
    assert (code, err) == (0, "")
    assert f"{job.job_id} is killed" in out
    assert "now         cancelled while handed back to the queue; not started again" in out


async def test_a_cancel_committed_while_the_finish_waits_makes_it_killed(pool, database_url, roles):
    """The finish decides in its UPDATE's SET (0012): when it waited on the row a cancel
    held, it re-reads the committed row and the stored cancel wins. Decided in a join of
    its own snapshot, before the wait (0004), the cancel would be lost and the job
    recorded as succeeded."""
    admin = Store(pool)
    job_id = await running_job(admin, "gpu-west")
    agent = await asyncpg.connect(as_role(database_url, ROLES["agent"]))
    held = await pool.acquire()
    try:
        cancel = held.transaction()
        await cancel.start()
        assert await held.execute("UPDATE jobs SET cancel_requested = true, cancel_requested_at = now() "
                                  "WHERE job_id = $1", job_id) == "UPDATE 1"
        backend = await agent.fetchval("SELECT pg_backend_pid()")
        finishing = asyncio.ensure_future(agent.fetch(FINISH, "gpu-west", [job_id], [1], [0], [False]))

        async def waiting() -> bool:
            return await pool.fetchval("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                                       backend)
        await wait_for(waiting, "the finish to wait on the row the cancel holds")
        await cancel.commit()
        assert [tuple(r) for r in await finishing] == [(job_id, "killed")]
    finally:
        await pool.release(held)
        await agent.close()
    row = await admin.job_get(job_id)
    assert (row.state, row.reason, row.exit_code) == ("killed", "cancelled by request", 0)
