"""A cancel stored while a job's owner is away holds whichever way the job comes back
(attack round 15): killed, never handed to another peer to run.

The router kills queued and not-yet-started jobs at once; a running job's cancel is
stored (``cancel_requested``) when its owner is offline. Before this fix the tick
requeued such a job when it judged the owner lost, another peer accepted it and it ran
again. Now recovery kills it, and the claim (the one gate every queued job passes to
run again) kills any queued job that carries a stored cancel, so a cancel that races a
hand-back cannot be lost either.
"""

from __future__ import annotations

from irisfed.services.common.store import Store
from irisfed.services.router.service import Router
from irisfed.services.tick.service import Tick
from irisfed.shared.clock import ManualClock
from tests.infra.factories import advertise, insert_jobs, make_config, make_job, running_job


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
    # The state a cancel racing a hand-back leaves: queued with the cancel stored (the
    # agent read the row before the cancel, then handed it back).
    await store.db.execute("UPDATE jobs SET cancel_requested = true WHERE job_id = $1", cancelled.job_id)
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
