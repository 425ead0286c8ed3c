"""The router judges a job's resources against what peers can hold (docs/scheduling.md)."""

import json
from datetime import UTC, datetime

from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, ResourceAmount


def _hear(router, peer_id: str, gpus: int, seq: int = 1) -> None:
    heartbeat = Heartbeat(peer_id, seq, datetime.now(UTC), 60.0, [BackendAd(
        "slurm", {"device_type": ["gpu"]}, Capacity(4, 4),
        {"cpu": ResourceAmount(32, 32), "memory_mb": ResourceAmount(131072, 131072),
         "gpu": ResourceAmount(gpus, gpus)})], run_id="r1")

    async def hear():
        router.router.view.apply_heartbeat(heartbeat)

    router.run(hear())


def _submit(router, **fields) -> dict:
    return router.request("submit", json.dumps({"command": ["true"], **fields}).encode())


def test_too_big_for_every_peer_is_rejected_naming_the_resource(router):
    _hear(router, "gpu-west", 4)
    _hear(router, "home", 2)
    reply = _submit(router, resources={"gpu": 8})
    assert reply["disposition"] == "reject", reply
    verdicts = {v["peer_id"]: v for v in reply["verdicts"]}
    assert verdicts["gpu-west"]["code"] == "insufficient_resources"
    assert "gpu: asked 8, at most 4" in verdicts["gpu-west"]["detail"]
    assert "gpu: asked 8, at most 4" in reply["reason"]
    stored = router.run(router.pool.fetchrow("SELECT state, resources FROM jobs WHERE job_id = $1",
                                             reply["job_id"]))
    assert stored["state"] == "rejected"
    assert stored["resources"] == {"cpu": 1, "gpu": 8}


def test_local_only_when_the_local_shape_can_hold_it(router):
    _hear(router, "home", 2)
    _hear(router, "gpu-west", 4)
    small = _submit(router, resources={"gpu": 2})
    assert small["disposition"] == "local", small
    # Same constraints, a bigger request: not cached as local; gpu-west can hold it.
    big = _submit(router, resources={"gpu": 4})
    assert big["disposition"] == "queue", big
    stored = router.run(router.pool.fetchval("SELECT resources FROM jobs WHERE job_id = $1", big["job_id"]))
    assert stored == {"cpu": 1, "gpu": 4}
