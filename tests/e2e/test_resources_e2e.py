"""Resource-shaped jobs through real services: agents advertise with --resource, the
router judges totals, the tick places by what is free, the job runs on the right peer."""

import json
import re

import pytest

pytestmark = pytest.mark.e2e

SHAPES = {
    "home": ["cpu=4", "memory_mb=8192"],
    "gpu-west": ["cpu=16", "memory_mb=65536", "gpu=2"],
    "gpu-east": ["cpu=32", "memory_mb=131072", "gpu=4"],
}


async def test_resource_shaped_jobs_run_where_they_fit(federation):
    federation.start("router")
    federation.start("tick")
    for peer_id, resources in SHAPES.items():
        federation.start(peer_id, *(arg for r in resources for arg in ("--resource", r)))
    await federation.wait_router()
    for peer_id in SHAPES:
        await federation.wait_agent(peer_id)

    big = await federation.submit({"job_id": "gpu-4", "command": ["true"], "resources": {"gpu": 4}})
    assert big["disposition"] == "queue", big  # home has no GPU: not local
    small = await federation.submit({"job_id": "gpu-2", "command": ["true"], "resources": {"gpu": 2, "cpu": 2}})
    assert small["disposition"] == "queue", small
    cpu = await federation.submit({"job_id": "cpu-1", "command": ["true"], "resources": {"cpu": 1}})
    assert cpu["disposition"] == "local", cpu

    assert (await federation.wait_state("gpu-4", "succeeded")).owner_peer_id == "gpu-east"
    # Best fit: two GPUs fill gpu-west exactly rather than half of gpu-east.
    assert (await federation.wait_state("gpu-2", "succeeded")).owner_peer_id == "gpu-west"
    assert (await federation.wait_state("cpu-1", "succeeded")).owner_peer_id == "home"

    too_big = await federation.submit({"job_id": "gpu-8", "command": ["true"], "resources": {"gpu": 8}})
    assert too_big["disposition"] == "reject", too_big
    verdicts = {v["peer_id"]: v for v in too_big["verdicts"]}
    assert verdicts["gpu-east"]["code"] == "insufficient_resources"
    assert "gpu: asked 8, at most 4" in verdicts["gpu-east"]["detail"]

    peers = {p["peer_id"]: p for p in json.loads(federation.cli("peers", "--json").stdout)}
    assert peers["gpu-east"]["backends"][0]["resources"]["gpu"]["total"] == 4
    table = federation.cli("peers")
    assert table.returncode == 0 and re.search(r"gpu \d/4", table.stdout), table.stdout
