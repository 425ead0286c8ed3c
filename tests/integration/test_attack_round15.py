"""Attack pass, round 15, on real Postgres and nats-server: replays and forgeries by
legitimate participants (a producer, a peer agent with its own NATS user and login
role) and a nats-server that hangs (SIGSTOP) instead of resetting.

Found and fixed (services/common/peer_view.py): a peer's heartbeat whose ``seq`` does
not fit a bigint, or whose ``sent_at`` overflows when turned to UTC (both decode fine:
the wire's ints are unbounded, its offsets free), was accepted by every view, and the
tick's once-per-interval batch write of heartbeats failed as a whole on it — for every
peer's heartbeat in the batch, and again at every retry (the batch is kept). With
``seq = 2**63`` the poison never left (the peer's next heartbeats of the same run are
"older"), so ``peer_heartbeat`` froze for the whole federation. Such heartbeats are now
dropped on receipt as malformed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from datetime import UTC, datetime

import nats
import pytest

from irisfed.services.common.bus import connect_client
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
from irisfed.tooling.servers import start_nats
from tests.infra.factories import (
    advertise,
    assign_jobs,
    insert_jobs,
    make_config,
    make_job,
    running_job,
    start_jobs,
)
from tests.infra.waiting import wait_for
from tests.integration.test_hostile_peer_role import gpu  # noqa: F401 - the peer's own login role

WAIT_S = 30  # bounds a hang on a slow machine; never an assertion about time


class _Msg:
    """A NATS message as a service's heartbeat callback sees it."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


def _beat(peer: str, seq: str, sent_at: str = '"2026-01-01T00:00:00Z"', run: str = "r1") -> bytes:
    """A heartbeat body as raw JSON, so values no struct of ours would build can be sent."""
    return (f'{{"peer_id":"{peer}","seq":{seq},"sent_at":{sent_at},"ttl_s":1.5,"backends":[{{"name":"main",'
            f'"attributes":{{}},"capacity":{{"total":4,"free":4}}}}],"run_id":"{run}"}}').encode()


async def _true(value):
    return value


# ---------------------------------------------------------------- forged heartbeat fields


@pytest.mark.parametrize("seq,sent_at", [
    (str(2**63), '"2026-01-01T00:00:00Z"'),
    (str(-(2**63) - 1), '"2026-01-01T00:00:00Z"'),
    (str(10**30), '"2026-01-01T00:00:00Z"'),
    ("1", '"9999-12-31T23:59:59-14:00"'),
    ("1", '"0001-01-01T00:00:00+14:00"'),
])
async def test_a_heartbeat_postgres_cannot_store_does_not_stop_the_tick_storing_every_peers(pool, seq, sent_at):
    config = make_config(tick_interval_s=3600)
    tick = Tick(config, pool, None)
    store = Store(pool)
    await tick.on_heartbeat(_Msg(config.subjects.heartbeat("tpu-east"), _beat("tpu-east", "1")))
    await tick.on_heartbeat(_Msg(config.subjects.heartbeat("gpu-west"), _beat("gpu-west", seq, sent_at)))
    await tick.persist_heartbeats()  # raised (PermanentStoreError) for the whole batch before the fix
    assert {r.peer_id: r.seq for r in await store.peer_heartbeat_list()} == {"tpu-east": 1}
    assert "gpu-west" not in tick.view.reachable_ids()  # dropped, not heard
    # The peer's next honest heartbeat of the same run is heard and stored.
    await tick.on_heartbeat(_Msg(config.subjects.heartbeat("gpu-west"), _beat("gpu-west", "2")))
    await tick.persist_heartbeats()
    assert {r.peer_id: r.seq for r in await store.peer_heartbeat_list()} == {"tpu-east": 1, "gpu-west": 2}


async def test_absurd_but_storable_heartbeat_fields_are_stored_and_place_nothing_wrong(pool):
    """Far-future sent_at, negative seq, negative TTL, 1e308 and negative resources, a
    2**70 slot total: stored (the peer's own claim about itself; TTL capped), and
    placement neither crashes nor trusts the advertised ``free``: the tick counts free
    as the (capped) total less what is live there, and a negative total offers nothing."""
    config = make_config(tick_interval_s=3600)
    tick = Tick(config, pool, None)
    store = Store(pool)
    body = json.dumps({"peer_id": "gpu-west", "seq": -5, "sent_at": "9999-01-01T00:00:00Z", "ttl_s": -1,
                       "backends": [{"name": "main", "attributes": {}, "capacity": {"total": 2**70, "free": 2**70},
                                     "resources": {"cpu": {"total": 1e308, "free": -1e308},
                                                   "gpu": {"total": -3, "free": 1e308}}}],
                       "run_id": "r1"}).encode()
    await tick.on_heartbeat(_Msg(config.subjects.heartbeat("gpu-west"), body))
    await tick.persist_heartbeats()
    [row] = await store.peer_heartbeat_list()
    assert (row.peer_id, row.seq, row.ttl_s) == ("gpu-west", -5, config.heartbeat_ttl_s)  # TTL capped
    jobs = [make_job() for _ in range(3)] + [make_job(resources={"gpu": 1})]
    await insert_jobs(store, jobs)
    result = await tick.run_once()
    # cpu: the huge total holds the three (its advertised free of -1e308 is not what
    # counts); gpu: a total of -3 offers nothing, so that job waits, explained.
    assert sorted(result.assigned) == sorted((j.job_id, "gpu-west", 1) for j in jobs[:3])
    assert (await store.job_get(jobs[3].job_id)).state == "queued"
    assert result.waiting == 1
    await assert_changelog_replays(store)


# ---------------------------------------------------------------- producer replays


async def _router(pool, nc, prefix: str) -> Router:
    router = Router(make_config(subject_prefix=prefix), pool, nc, RouterSettings(writers=1))
    await router.start()
    return router


async def _ask(nc, prefix: str, verb: str, body: dict) -> dict:
    reply = await nc.request(f"{prefix}.{verb}", json.dumps(body).encode(), timeout=WAIT_S)
    return json.loads(reply.data)


async def _history(pool, job_id: str) -> list[tuple]:
    return [tuple(r) for r in await pool.fetch(
        "SELECT seq, from_state, to_state, epoch FROM federation_changelog WHERE job_id = $1 ORDER BY seq", job_id)]


async def test_a_replayed_submit_after_the_job_finished_or_was_requeued_creates_nothing(pool, nats_client,
                                                                                          subject_prefix):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, device_type="gpu")
    router = await _router(pool, nats_client, subject_prefix)
    try:
        body = {"job_id": "r15-replay", "command": ["echo", "once"],
                "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}
        first = await _ask(nats_client, subject_prefix, "submit", body)
        assert (first["disposition"], first["duplicate"]) == ("queue", False)
        job = type("J", (), {"job_id": "r15-replay"})()  # the helpers read only job_id
        await assign_jobs(store, [job], "gpu-west")
        await start_jobs(store, [job], "gpu-west")
        # Lost and requeued under epoch 2 (as the tick does), then run and finished there.
        assert await pool.fetchval("SELECT irisfed_job_end_run('gpu-west', 'r15-replay', 1, 'queued', 'lost')")
        replay = await _ask(nats_client, subject_prefix, "submit", body)
        assert replay == {**first, "duplicate": True}
        row = await store.job_get("r15-replay")
        assert (row.state, row.epoch, row.attempts) == ("queued", 2, 1)  # the replay reset nothing
        await assign_jobs(store, [job], "gpu-west", epoch=2)
        await start_jobs(store, [job], "gpu-west", epoch=3)
        assert await store.job_finish_batch("gpu-west", [("r15-replay", 3, 0, False)])
        history = await _history(pool, "r15-replay")
        for _ in range(3):
            assert await _ask(nats_client, subject_prefix, "submit", body) == {**first, "duplicate": True}
        row = await store.job_get("r15-replay")
        assert (row.state, row.epoch, row.attempts, row.exit_code) == ("succeeded", 3, 2, 0)
        assert await _history(pool, "r15-replay") == history
        # The same id with another spec is still a conflict, not a second job.
        other = await _ask(nats_client, subject_prefix, "submit", {**body, "command": ["echo", "twice"]})
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
        body = {"job_id": "r15-cancel", "command": ["true"], "cluster_pin": "gpu-west"}
        first = await _ask(nats_client, subject_prefix, "submit", body)
        assert first["state"] == "queued"
        job = type("J", (), {"job_id": "r15-cancel"})()
        await assign_jobs(store, [job], "gpu-west")
        await start_jobs(store, [job], "gpu-west")
        assert await pool.fetchval("SELECT irisfed_job_end_run('gpu-west', 'r15-cancel', 1, 'queued', 'lost')")
        cancel = await _ask(nats_client, subject_prefix, "cancel", {"job_id": "r15-cancel"})
        assert (cancel["state"], cancel["outcome"]) == ("killed", "not_restarted")
        history = await _history(pool, "r15-cancel")
        for _ in range(3):
            again = await _ask(nats_client, subject_prefix, "cancel", {"job_id": "r15-cancel"})
            assert (again["state"], again["outcome"]) == ("killed", "already_finished")
        assert await _ask(nats_client, subject_prefix, "submit", body) == {**first, "duplicate": True}
        row = await store.job_get("r15-cancel")
        assert (row.state, row.epoch, row.attempts) == ("killed", 2, 1)
        assert await _history(pool, "r15-cancel") == history
        # The old epoch's agent cannot revive it either.
        assert await store.job_start_batch("gpu-west", [("r15-cancel", 2, None, "late")]) == {}
        await assert_changelog_replays(store)
    finally:
        await router.close()


# ---------------------------------------------------------------- agent replays


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
        await wait_for(lambda: _state(store, done.job_id, "succeeded"), "the job to finish")
        history = await _history(pool, done.job_id)
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
        await wait_for(lambda: _true(agent.reconciled >= seen + 2 and not agent.noticed
                                     and not agent.start_wanted.is_set()), "the agent to take the replays")
        assert agent.runs == {} and agent.pending == {}
        assert await _history(pool, done.job_id) == history
        assert [(r[1], r[2]) for r in history].count(("assigned", "running")) == 1
        row = await store.job_get(elsewhere.job_id)
        assert (row.state, row.owner_peer_id, row.epoch) == ("running", "tpu-east", 3)
        await assert_changelog_replays(store)
    finally:
        await agent.close()


async def _state(store: Store, job_id: str, state: str) -> bool:
    row = await store.job_get(job_id)
    return row is not None and row.state == state


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
        await tick.on_heartbeat(_Msg(hb("tpu-east"), beat("tpu-east", "t1", 1, "tpu")))
        await tick.on_heartbeat(_Msg(hb("gpu-west"), beat("gpu-west", "r1", 50, "old")))
        await tick.on_heartbeat(_Msg(hb("gpu-west"), beat("gpu-west", "r2", 1, "new")))
        await tick.on_heartbeat(_Msg(hb("gpu-west"), beat("gpu-west", "r1", 50, "old")))  # the replay
        await tick.persist_heartbeats()
        rows = {r.peer_id: (r.run_id, r.seq) for r in await store.peer_heartbeat_list()}
        assert rows == {"tpu-east": ("t1", 1), "gpu-west": ("r1", 50)}
        await tick.on_heartbeat(_Msg(hb("gpu-west"), beat("gpu-west", "r2", 2, "new")))
        await tick.persist_heartbeats()
        rows = {r.peer_id: (r.run_id, r.seq) for r in await store.peer_heartbeat_list()}
        assert rows == {"tpu-east": ("t1", 1), "gpu-west": ("r2", 2)}
        peers = {p.peer_id: p for p in tick.view.peers()}
        assert peers["gpu-west"].backends[0].attributes == {"device_type": ("new",)}
        assert peers["tpu-east"].backends[0].attributes == {"device_type": ("tpu",)}
    finally:
        await tick.close()


async def test_the_peers_own_role_cannot_move_a_job_with_a_stale_or_future_epoch_or_anothers(pool, gpu):  # noqa: F811
    admin = Store(pool)
    mine = await running_job(admin, "gpu-west")  # running, epoch 1
    theirs = await running_job(admin, "tpu-east")
    queued = make_job()
    await insert_jobs(admin, [queued])
    await assign_jobs(admin, [queued], "gpu-west")  # assigned, epoch 1
    before = await pool.fetchval("SELECT count(*) FROM federation_changelog")
    for epoch in (0, 2, 2**62, -1):
        assert await gpu.fetch("SELECT * FROM irisfed_job_start_batch('gpu-west', $1, $2, $3, $4)",
                               [queued.job_id], [epoch], [None], ["x"]) == []
        assert await gpu.fetch("SELECT * FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)",
                               [mine], [epoch], [0], [False]) == []
        for to_state in ("queued", "failed", "killed"):
            assert await gpu.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, $2, $3, 'x')",
                                      mine, epoch, to_state) is None
    # Another peer's job at its true epoch, named as the caller's own peer: nothing moves.
    assert await gpu.fetch("SELECT * FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)",
                           [theirs], [1], [0], [False]) == []
    assert await gpu.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, 1, 'queued', 'x')", theirs) is None
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == before
    states = {r["job_id"]: (r["state"], r["epoch"]) for r in await pool.fetch("SELECT job_id, state, epoch FROM jobs")}
    assert states == {mine: ("running", 1), theirs: ("running", 1), queued.job_id: ("assigned", 1)}


# ---------------------------------------------------------------- a hung nats-server


async def test_a_sigstopped_nats_server_loses_nothing_and_runs_nothing_twice(pool, tmp_path, subject_prefix):
    """nats-server stopped (not killed) while a producer submits and an agent finishes a
    job: the producer's request gives up at its own timeout (no hang past it), the agent
    writes its result to Postgres regardless, and after SIGCONT the retried submit is a
    duplicate of the one job, which ran once."""
    server = start_nats(tmp_path / "nats")
    store = Store(pool)
    config = make_config(subject_prefix=subject_prefix)
    svc = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    agent_nc = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    producer = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    router = Router(config, pool, svc, RouterSettings(writers=1))
    agent = PeerAgent(config, pool, agent_nc, AgentSettings(
        peer_id="home", backends=(BackendSpec("main", "simulated", {}, 4),), work_root=tmp_path / "work",
        heartbeat_interval_s=0.1, heartbeat_ttl_s=1.0, reconcile_interval_s=0.2, simulated_duration_s=0.5))
    stopped = False
    try:
        await agent.start()
        await router.start()
        await wait_for(lambda: _true("home" in router.view.reachable_ids()), "the local agent heard")
        running = await _ask(producer, subject_prefix, "submit", {"job_id": "r15-stop-a", "command": ["true"]})
        assert running["disposition"] == "local"
        await wait_for(lambda: _state(store, "r15-stop-a", "running"), "the first job running")
        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        # The agent finishes its job while NATS hangs: Postgres gets it anyway.
        await wait_for(lambda: _state(store, "r15-stop-a", "succeeded"), "the finish written while NATS hangs")
        body = {"job_id": "r15-stop-b", "command": ["true"]}
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await asyncio.wait_for(producer.request(f"{subject_prefix}.submit", json.dumps(body).encode(),
                                                    timeout=1.0), WAIT_S)
        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        reply = await wait_for(lambda: _retry(producer, subject_prefix, body), "the retried submit answered")
        assert reply["job_id"] == "r15-stop-b" and "error" not in reply
        await wait_for(lambda: _state(store, "r15-stop-b", "succeeded"), "the second job run")
        for job_id in ("r15-stop-a", "r15-stop-b"):
            history = [(r[1], r[2]) for r in await _history(pool, job_id)]
            assert history.count(("assigned", "running")) == 1, history
            assert (await store.job_get(job_id)).attempts == 1
        assert await pool.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE 'r15-stop-%'") == 2
        await assert_changelog_replays(store)
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            await router.close()
        with contextlib.suppress(Exception):
            await agent.close()
        for nc in (producer, agent_nc, svc):
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()


async def _retry(nc, prefix: str, body: dict) -> dict | None:
    try:
        reply = json.loads((await nc.request(f"{prefix}.submit", json.dumps(body).encode(), timeout=2.0)).data)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
        return None
    return None if reply.get("error", {}).get("code") == "unavailable" else reply
