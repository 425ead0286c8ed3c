"""Replays by legitimate participants, on real Postgres and nats-server: a producer
resending a submit or a cancel after its job moved on, an agent hearing its old
assignment notices and forged job events again, and a captured heartbeat of a peer's
previous run. A replay never creates, restarts or runs a job again, never rewrites
history, and rewinds at most the sender's own advertisement.
"""

from __future__ import annotations

from datetime import UTC, datetime

from irisfed.services.common.store import Store
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.services.router.service import Router, RouterSettings
from irisfed.services.tick.service import Tick
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import (
    AssignmentNotice,
    BackendAd,
    Capacity,
    Heartbeat,
    JobEvent,
    encoder,
)
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import (
    Msg,
    advertise,
    assign_jobs,
    insert_jobs,
    make_config,
    make_job,
    start_jobs,
)
from tests.infra.probes import ask, changelog_of, in_state, returns
from tests.infra.waiting import wait_for


async def _router(pool, nc, prefix: str) -> Router:
    router = Router(make_config(subject_prefix=prefix), pool, nc, RouterSettings(writers=1))
    await router.start()
    return router




async def test_a_replayed_submit_after_the_job_finished_or_was_requeued_creates_nothing(pool, nats_client,
                                                                                          subject_prefix):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, device_type="gpu")
    router = await _router(pool, nats_client, subject_prefix)
    try:
        body = {"job_id": "replayed-submit", "command": ["echo", "once"],
                "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}
        first = await ask(nats_client, subject_prefix, "submit", body)
        assert (first["disposition"], first["duplicate"]) == ("queue", False)
        job = type("J", (), {"job_id": "replayed-submit"})()  # the helpers read only job_id
        await assign_jobs(store, [job], "gpu-west")
        await start_jobs(store, [job], "gpu-west")
        # Lost and requeued under epoch 2 (as the tick does), then run and finished there.
        assert await pool.fetchval("SELECT irisfed_job_end_run('gpu-west', 'replayed-submit', 1, 'queued', 'lost')")
        replay = await ask(nats_client, subject_prefix, "submit", body)
        assert replay == {**first, "duplicate": True}
        row = await store.job_get("replayed-submit")
        assert (row.state, row.epoch, row.attempts) == ("queued", 2, 1)  # the replay reset nothing
        await assign_jobs(store, [job], "gpu-west", epoch=2)
        await start_jobs(store, [job], "gpu-west", epoch=3)
        assert await store.job_finish_batch("gpu-west", [("replayed-submit", 3, 0, False)])
        history = await changelog_of(pool, "replayed-submit")
        for _ in range(3):
            assert await ask(nats_client, subject_prefix, "submit", body) == {**first, "duplicate": True}
        row = await store.job_get("replayed-submit")
        assert (row.state, row.epoch, row.attempts, row.exit_code) == ("succeeded", 3, 2, 0)
        assert await changelog_of(pool, "replayed-submit") == history
        # The same id with another spec is still a conflict, not a second job.
        other = await ask(nats_client, subject_prefix, "submit", {**body, "command": ["echo", "twice"]})
        assert other["error"]["code"] == "conflict"
        await assert_changelog_replays(store)
    finally:
        await router.close()


async def test_a_replayed_cancel_after_a_requeue_kills_the_job_once_and_nothing_after(pool, nats_client,
                                                                                      subject_prefix):
    """A cancel names a job, not an attempt: replayed after the job was requeued under a
    new epoch it stops the job (it must never run again); replayed again it changes
    nothing, and a resubmission of the id is the same killed job, never a new run."""
    store = Store(pool)
    router = await _router(pool, nats_client, subject_prefix)
    try:
        body = {"job_id": "replayed-cancel", "command": ["true"], "cluster_pin": "gpu-west"}
        first = await ask(nats_client, subject_prefix, "submit", body)
        assert first["state"] == "queued"
        job = type("J", (), {"job_id": "replayed-cancel"})()
        await assign_jobs(store, [job], "gpu-west")
        await start_jobs(store, [job], "gpu-west")
        assert await pool.fetchval("SELECT irisfed_job_end_run('gpu-west', 'replayed-cancel', 1, 'queued', 'lost')")
        cancel = await ask(nats_client, subject_prefix, "cancel", {"job_id": "replayed-cancel"})
        assert (cancel["state"], cancel["outcome"]) == ("killed", "not_restarted")
        history = await changelog_of(pool, "replayed-cancel")
        for _ in range(3):
            again = await ask(nats_client, subject_prefix, "cancel", {"job_id": "replayed-cancel"})
            assert (again["state"], again["outcome"]) == ("killed", "already_finished")
        assert await ask(nats_client, subject_prefix, "submit", body) == {**first, "duplicate": True}
        row = await store.job_get("replayed-cancel")
        assert (row.state, row.epoch, row.attempts) == ("killed", 2, 1)
        assert await changelog_of(pool, "replayed-cancel") == history
        # The old epoch's agent cannot revive it either.
        assert await store.job_start_batch("gpu-west", [("replayed-cancel", 2, None, "late")]) == {}
        await assert_changelog_replays(store)
    finally:
        await router.close()


async def test_replayed_assign_notices_and_forged_events_never_run_a_job_twice(pool, nats_client, subject_prefix,
                                                                              tmp_path):
    store = Store(pool)
    config = make_config(subject_prefix=subject_prefix)
    agent = PeerAgent(config, pool, nats_client, AgentSettings(
        peer_id="gpu-west", backends=(BackendSpec("main", "simulated", {}, 4),), work_root=tmp_path / "work",
        heartbeat_interval_s=0.1, heartbeat_ttl_s=1.0, reconcile_interval_s=0.2))
    done, elsewhere = make_job(), make_job()
    await insert_jobs(store, [done, elsewhere])
    await assign_jobs(store, [done], "gpu-west")
    # `elsewhere` was gpu-west's at epoch 1, handed back, and now runs on tpu-east at epoch 3.
    await assign_jobs(store, [elsewhere], "gpu-west")
    await start_jobs(store, [elsewhere], "gpu-west")
    assert await store.job_end_run("gpu-west", elsewhere.job_id, 1, JobState.QUEUED, "lost")
    await assign_jobs(store, [elsewhere], "tpu-east", epoch=2)
    await start_jobs(store, [elsewhere], "tpu-east", epoch=3)
    await agent.start()
    try:
        await wait_for(lambda: in_state(store, done.job_id, "succeeded"), "the job to finish")
        history = await changelog_of(pool, done.job_id)
        # Replays: the finished job's own notice (epoch 1), the moved job's old notices
        # (epochs 1 and 3, the latter naming gpu-west), and events claiming both run again.
        for _ in range(20):
            for job, epoch in ((done, 1), (elsewhere, 1), (elsewhere, 3), (done, 2)):
                await nats_client.publish(config.subjects.assign("gpu-west"), encoder.encode(
                    AssignmentNotice(job.job_id, "gpu-west", epoch, "main", 0)))
                await nats_client.publish(config.subjects.events(job.job_id), encoder.encode(
                    JobEvent(job.job_id, "running", "gpu-west", epoch, datetime.now(UTC))))
        await nats_client.flush()
        seen = agent.reconciled
        await wait_for(lambda: returns(agent.reconciled >= seen + 2 and not agent.noticed
                                     and not agent.start_wanted.is_set()), "the agent to take the replays")
        assert agent.runs == {} and agent.pending == {}
        assert await changelog_of(pool, done.job_id) == history
        assert [(r[1], r[2]) for r in history].count(("assigned", "running")) == 1
        row = await store.job_get(elsewhere.job_id)
        assert (row.state, row.owner_peer_id, row.epoch) == ("running", "tpu-east", 3)
        await assert_changelog_replays(store)
    finally:
        await agent.close()



async def test_a_replayed_old_run_heartbeat_rewinds_only_the_senders_own_advert(pool, nats_client, subject_prefix):
    """After gpu-west's agent restarted (run r2), a captured heartbeat of its old run (r1,
    seq 50) is heard as news (a different run): the peer may rewind its own advertisement,
    which it could forge anyway, but no one else's, and its next real heartbeat wins."""
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    tick = Tick(config, pool, nats_client)
    store = Store(pool)
    await tick.start()
    try:
        def beat(peer, run, seq, device):
            return encoder.encode(Heartbeat(peer, seq, datetime.now(UTC), 1.5,
                                            [BackendAd("main", {"device_type": [device]}, Capacity(4, 4))],
                                            run_id=run))
        hb = config.subjects.heartbeat
        await tick.on_heartbeat(Msg(hb("tpu-east"), beat("tpu-east", "t1", 1, "tpu")))
        await tick.on_heartbeat(Msg(hb("gpu-west"), beat("gpu-west", "r1", 50, "old")))
        await tick.on_heartbeat(Msg(hb("gpu-west"), beat("gpu-west", "r2", 1, "new")))
        await tick.on_heartbeat(Msg(hb("gpu-west"), beat("gpu-west", "r1", 50, "old")))  # the replay
        await tick.persist_heartbeats()
        rows = {r.peer_id: (r.run_id, r.seq) for r in await store.peer_heartbeat_list()}
        assert rows == {"tpu-east": ("t1", 1), "gpu-west": ("r1", 50)}
        await tick.on_heartbeat(Msg(hb("gpu-west"), beat("gpu-west", "r2", 2, "new")))
        await tick.persist_heartbeats()
        rows = {r.peer_id: (r.run_id, r.seq) for r in await store.peer_heartbeat_list()}
        assert rows == {"tpu-east": ("t1", 1), "gpu-west": ("r2", 2)}
        peers = {p.peer_id: p for p in tick.view.peers()}
        assert peers["gpu-west"].backends[0].attributes == {"device_type": ("new",)}
        assert peers["tpu-east"].backends[0].attributes == {"device_type": ("tpu",)}
    finally:
        await tick.close()
