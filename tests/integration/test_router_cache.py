"""The router's brief plan cache never hides a peer that just appeared."""

import json
from datetime import UTC, datetime

from irisfed.shared.messages import BackendAd, Capacity, Heartbeat

GPU_JOB = {"command": ["true"], "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}


def test_new_peer_changes_the_next_decision_at_once(router):
    first = router.request("submit", json.dumps(GPU_JOB).encode())
    assert first["disposition"] == "reject"
    heartbeat = Heartbeat("gpu-west", 1, datetime.now(UTC), 60.0,
                          [BackendAd("main", {"device_type": ["gpu"]}, Capacity(4, 4))], run_id="r1")

    async def hear():
        router.router.view.apply_heartbeat(heartbeat)

    router.run(hear())
    second = router.request("submit", json.dumps(GPU_JOB).encode())
    assert second["disposition"] == "queue"
    again = router.request("submit", json.dumps(GPU_JOB).encode())  # served from the cache
    assert again["disposition"] == "queue" and again["job_id"] != second["job_id"]
