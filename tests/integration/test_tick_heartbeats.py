"""The tick against real Postgres and NATS: heartbeat trust, when a peer counts as lost,
recovery of big lost peers, and which heartbeats wake a placement pass."""

import time
from datetime import UTC, datetime

import nats
from prometheus_client.registry import REGISTRY

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, encoder
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import Msg, advertise, insert_jobs, make_config, make_job, start_all
from tests.infra.probes import returns
from tests.infra.waiting import wait_for

TPU = {"constraints": [{"key": "device_type", "op": "eq", "value": "tpu"}]}


def heartbeat(peer_id: str, seq: int, device: str = "gpu", free: int = 4, ttl_s: float = 1.5) -> Heartbeat:
    return Heartbeat(peer_id, seq, datetime.now(UTC), ttl_s,
                     [BackendAd("main", {"device_type": [device]}, Capacity(4, free))], run_id="r1")


async def test_a_forged_heartbeat_does_not_make_another_peer_reachable(pool, servers, subject_prefix):
    store = Store(pool)
    job = make_job(**TPU)
    await insert_jobs(store, [job])
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    service_nc = await nats.connect(servers.nats_url_for("tick"))
    agent_nc = await nats.connect(servers.nats_url_for("agent-gpu-west"))
    tick = Tick(config, pool, service_nc)
    try:
        await tick.start()
        before = REGISTRY.get_sample_value("irisfed_heartbeats_dropped_total", {"reason": "subject_mismatch"}) or 0
        # gpu-west's agent, allowed to publish only on its own subject, claims tpu-east
        # with a TPU backend for an hour.
        forged = heartbeat("tpu-east", 1, device="tpu", ttl_s=3600)
        await agent_nc.publish(config.subjects.heartbeat("gpu-west"), encoder.encode(forged))
        await agent_nc.publish(config.subjects.heartbeat("gpu-west"), encoder.encode(heartbeat("gpu-west", 1)))
        await agent_nc.flush()
        await wait_for(lambda: returns("gpu-west" in tick.view.reachable_ids()), "gpu-west's own heartbeat")
        await tick.run_once()
        await tick.persist_heartbeats()
        assert "tpu-east" not in tick.view.reachable_ids()
        row = await store.job_get(job.job_id)
        assert (row.state, row.owner_peer_id) == ("queued", None)
        assert {r.peer_id for r in await store.peer_heartbeat_list()} == {"gpu-west"}
        after = REGISTRY.get_sample_value("irisfed_heartbeats_dropped_total", {"reason": "subject_mismatch"})
        assert after - before == 1
    finally:
        await tick.close()
        await agent_nc.close()
        await service_nc.close()


async def test_grace_counts_from_the_last_heartbeat_not_from_the_jobs_last_update(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, ttl_s=1.5)
    job = make_job(max_retries=1)
    await start_all(store, [job], "gpu-west")
    # It has been running for an hour: its row was last updated then.
    await pool.execute("UPDATE jobs SET updated_at = now() - interval '1 hour' WHERE job_id = $1", job.job_id)
    now = [time.time()]
    tick = Tick(make_config(assign_grace_s=30), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    now[0] += 1.6  # gpu-west just passed its TTL: unreachable, not yet lost
    assert "gpu-west" not in tick.view.reachable_ids()
    assert await tick.recover_lost_peers() == 0
    now[0] += 20  # still within assign_grace_s of the TTL
    assert await tick.recover_lost_peers() == 0
    assert (await store.job_get(job.job_id)).state == "running"
    now[0] += 10.1  # TTL + grace passed since its last heartbeat
    assert await tick.recover_lost_peers() == 1
    row = await store.job_get(job.job_id)
    assert (row.state, row.epoch, row.avoid_peers) == ("queued", 2, ["gpu-west"])
    await assert_changelog_replays(store)


async def test_owners_never_heard_are_judged_from_the_ticks_start_with_the_configured_ttl(pool):
    # tpu-east never advertised; gone-east was removed from the configuration while it
    # still owned work. Neither can be heard now: both count as heard when the tick
    # started, with the configured TTL, then get the grace like anyone else.
    store = Store(pool)
    silent, orphan = make_job(max_retries=1), make_job(max_retries=1)
    await start_all(store, [silent], "tpu-east")
    await start_all(store, [orphan], "gone-east")
    await pool.execute("UPDATE jobs SET updated_at = now() - interval '1 hour'")
    now = [time.time()]
    tick = Tick(make_config(assign_grace_s=5), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    assert await tick.recover_lost_peers() == 0
    now[0] += 6.4  # configured TTL 1.5 + grace 5 not yet over
    assert await tick.recover_lost_peers() == 0
    now[0] += 0.2
    assert await tick.recover_lost_peers() == 2
    for job in (silent, orphan):
        assert (await store.job_get(job.job_id)).state == "queued"
    await assert_changelog_replays(store)


async def test_a_wall_clock_jump_on_the_tick_host_does_not_requeue(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, ttl_s=1.5, seq=1)
    job = make_job(max_retries=1)
    await start_all(store, [job], "gpu-west")
    now = [time.time()]
    tick = Tick(make_config(assign_grace_s=0.001), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    assert await tick.recover_lost_peers() == 0
    now[0] += 3600  # the tick host's clock jumps an hour ahead; Postgres's does not
    await advertise(store, "gpu-west", slots=4, ttl_s=1.5, seq=2)  # gpu-west keeps heartbeating
    await tick.refresh_view()
    assert await tick.recover_lost_peers() == 0
    assert (await store.job_get(job.job_id)).state == "running"
    assert "gpu-west" in tick.view.reachable_ids()


async def test_pinned_jobs_on_a_lost_peer_do_not_starve_recovery(pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4000, ttl_s=1.5)
    pinned = [make_job(pin="gpu-west") for _ in range(1000)]
    unpinned = [make_job(max_retries=1) for _ in range(1100)]  # more than one batch
    await start_all(store, pinned, "gpu-west")
    await start_all(store, unpinned, "gpu-west")
    now = [time.time()]
    tick = Tick(make_config(assign_grace_s=0.001), pool, None, clock=lambda: now[0])
    await tick.refresh_view()
    now[0] += 3600
    assert await tick.recover_lost_peers() == 1100  # one pass recovers all of them
    states = dict(await pool.fetch("SELECT state, count(*) FROM jobs GROUP BY state"))
    assert states == {"running": 1000, "queued": 1100}
    assert await pool.fetchval(
        "SELECT count(*) FROM jobs WHERE pinned_peer_id = 'gpu-west' AND state = 'running' AND epoch = 1") == 1000
    assert await tick.recover_lost_peers() == 0


async def test_a_heartbeat_that_changes_nothing_does_not_trigger_a_placement_pass(pool, servers, subject_prefix):
    # No interval runs: passes come only from wake-ups.
    config = make_config(subject_prefix=subject_prefix, tick_interval_s=3600)
    service_nc = await nats.connect(servers.nats_url_for("tick"))
    agent_nc = await nats.connect(servers.nats_url_for("agent-gpu-west"))
    tick = Tick(config, pool, service_nc)
    subject = config.subjects.heartbeat("gpu-west")

    async def hear(seq: int, free: int) -> None:
        # Sent again until heard, as an agent's next heartbeat would be: NATS delivers at
        # most once (a full suite once lost one here). A copy of a heartbeat already
        # heard changes nothing, which is what this test counts.
        body = encoder.encode(heartbeat("gpu-west", seq, free=free))

        async def heard() -> bool:
            if _seq(tick) < seq:
                await agent_nc.publish(subject, body)
                await agent_nc.flush()
            return _seq(tick) >= seq
        await wait_for(heard, f"heartbeat {seq} heard", interval=0.5)
        # A wake-up set by that heartbeat is cleared by the loop in the same step that
        # starts (and counts) the pass it causes: once it is clear, the count is final.
        await wait_for(lambda: returns(not tick.wake.is_set()), "the tick loop idle")

    try:
        await tick.start()
        await hear(1, free=2)  # gpu-west appears: worth a pass
        await wait_for(lambda: returns(tick.passes == 1), "the pass for gpu-west appearing")
        for seq in (2, 3, 4):
            await hear(seq, free=2)  # nothing changed
        assert tick.passes == 1
        await hear(5, free=1)  # fuller: nothing more can be placed
        assert tick.passes == 1
        await hear(6, free=3)  # slots freed: worth a pass
        await wait_for(lambda: returns(tick.passes == 2), "the pass for freed slots")
    finally:
        await tick.close()
        await agent_nc.close()
        await service_nc.close()


def _seq(tick: Tick) -> int:
    advert = tick.view._adverts.get("gpu-west")
    return advert.seq if advert else 0


async def test_a_heartbeat_held_back_through_an_outage_is_persisted_as_old_as_it_is(pool):
    """The tick hears a peer, Postgres goes away, and the peer dies meanwhile. Were the
    held heartbeat written on Postgres's return stamped ``now()``, a restarted tick would
    take the dead agent for alive and place work there: it is stored as old as it is."""
    from irisfed.shared.clock import ManualClock

    store = Store(pool)
    clock = ManualClock()
    config = make_config(tick_interval_s=3600)
    tick = Tick(config, pool, None, clock=clock)
    beat = heartbeat("gpu-west", 1, ttl_s=1.5)
    await tick.on_heartbeat(Msg(config.subjects.heartbeat("gpu-west"), encoder.encode(beat)))
    clock.advance(5.0)  # Postgres away this long: the write waits
    await tick.persist_heartbeats()
    [row] = await store.peer_heartbeat_list()
    assert row.age_s >= 5.0
    restarted = Tick(config, pool, None, clock=ManualClock())
    await restarted.refresh_view()
    assert "gpu-west" not in restarted.view.reachable_ids()


async def test_a_re_read_of_stored_heartbeats_returns_only_what_the_view_lacks(pool):
    """``peer_heartbeat_list_news``: a view re-reads the table every interval and most
    rows are what it holds; only a peer it lacks, a higher seq or another run come back."""
    store = Store(pool)
    await store.peer_heartbeat_upsert_batch([(heartbeat("same", 5), 0.0), (heartbeat("ahead", 7), 0.0),
                                             (heartbeat("behind", 2), 0.0), (heartbeat("new-run", 1), 0.0),
                                             (heartbeat("unheld", 1), 0.0)])
    held = [("same", "r1", 5), ("ahead", "r1", 6), ("behind", "r1", 3), ("new-run", "r0", 9)]
    news = await store.peer_heartbeat_list_news(held)
    assert [(r.peer_id, r.seq) for r in news] == [("ahead", 7), ("new-run", 1), ("unheld", 1)]
    everything = await store.peer_heartbeat_list()
    assert {r.peer_id for r in await store.peer_heartbeat_list_news([])} == {r.peer_id for r in everything}
