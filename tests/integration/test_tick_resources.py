"""The tick places resource-shaped jobs against real Postgres (docs/scheduling.md)."""

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick, TickSettings
from tests.infra.factories import (
    advertise_resources,
    assign_jobs,
    insert_jobs,
    make_config,
    make_job,
)


async def _tick(store: Store, **settings) -> Tick:
    tick = Tick(make_config(), store, None, TickSettings(**settings))
    await tick.refresh_view()
    return tick


async def test_gpu_job_goes_where_gpus_are_free_and_the_next_one_waits(pool):
    store = Store(pool)
    await advertise_resources(store, "gpu-west", {"cpu": 16, "memory_mb": 65536, "gpu": 2})
    await advertise_resources(store, "tpu-east", {"cpu": 64, "memory_mb": 262144, "gpu": 1})
    first, second = make_job(resources={"gpu": 2}), make_job(resources={"gpu": 2})
    await insert_jobs(store, [first, second])
    stored = await pool.fetchval("SELECT resources::text FROM jobs WHERE job_id = $1", first.job_id)
    assert stored.replace(" ", "") == '{"cpu":1,"gpu":2}'

    result = await (await _tick(store)).run_once()
    assert [(job_id, peer) for job_id, peer, _ in result.assigned] == [(first.job_id, "gpu-west")]
    waiting = await store.job_get(second.job_id)
    assert waiting.state == "queued"
    verdicts = {p["peer_id"]: p for p in waiting.explanation["peers"]}
    # tpu-east can never hold two GPUs; gpu-west's are taken by the first job.
    assert verdicts["tpu-east"]["code"] == "insufficient_resources"
    assert verdicts["tpu-east"]["short"] == [{"resource": "gpu", "asked": 2, "available": 1, "backend": "main"}]
    assert verdicts["gpu-west"]["code"] == "no_free_capacity"

    # A later run counts the live job's GPUs from Postgres (job_live_usage), not from
    # the heartbeat (which still says 2 free): the second job still waits.
    again = await (await _tick(store)).run_once()
    assert again.assigned == [] and again.waiting == 1
    assert await store.job_live_usage() == ({("gpu-west", "main"): 1},
                                            {("gpu-west", "main"): {"cpu": 1.0, "gpu": 2.0}})


async def test_packing_takes_the_best_fit_and_spread_the_emptiest(pool):
    store = Store(pool)
    await advertise_resources(store, "gpu-west", {"cpu": 16, "memory_mb": 65536})
    await advertise_resources(store, "tpu-east", {"cpu": 4, "memory_mb": 16384})
    packed = make_job(resources={"cpu": 4, "memory_mb": 8192})
    await insert_jobs(store, [packed])
    result = await (await _tick(store)).run_once()
    assert [(job_id, peer) for job_id, peer, _ in result.assigned] == [(packed.job_id, "tpu-east")]

    spread = make_job(resources={"cpu": 2, "memory_mb": 1024})
    await insert_jobs(store, [spread])
    result = await (await _tick(store, policy="spread")).run_once()
    assert [(job_id, peer) for job_id, peer, _ in result.assigned] == [(spread.job_id, "gpu-west")]


async def test_live_usage_leaves_room_for_what_fits(pool):
    store = Store(pool)
    await advertise_resources(store, "gpu-west", {"cpu": 8, "memory_mb": 32768})
    running = make_job(resources={"cpu": 6})
    await insert_jobs(store, [running])
    await assign_jobs(store, [running], "gpu-west")
    too_big, fits = make_job(resources={"cpu": 4}), make_job(resources={"cpu": 2})
    await insert_jobs(store, [too_big, fits])
    result = await (await _tick(store)).run_once()
    assert [job_id for job_id, _, _ in result.assigned] == [fits.job_id]
    waiting = await store.job_get(too_big.job_id)
    gpu_west = next(p for p in waiting.explanation["peers"] if p["peer_id"] == "gpu-west")
    assert gpu_west["code"] == "no_free_capacity"


def test_settings_are_checked():
    import pytest

    from irisfed.shared.errors import ConfigError

    with pytest.raises(ConfigError, match="policy"):
        TickSettings(policy="random")
    with pytest.raises(ConfigError, match="reserve_after_s"):
        TickSettings(reserve_after_s=-1)
    assert TickSettings(reserve_after_s=None).reserve_after_s is None
