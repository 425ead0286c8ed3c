"""Resource-shaped jobs through real services: agents advertise with --resource, the
router judges totals, the tick places by what is free, the job runs on the right peer."""

import asyncio
import json
import re

import pytest

pytestmark = pytest.mark.e2e

SHAPES = {
    "home": ["cpu=4", "memory_mb=8192"],
    "gpu-west": ["cpu=16", "memory_mb=65536", "gpu=2"],
    "gpu-east": ["cpu=32", "memory_mb=131072", "gpu=4"],
}
AGENTS = [(peer_id, *(arg for r in resources for arg in ("--resource", r))) for peer_id, resources in SHAPES.items()]


async def test_resource_shaped_jobs_run_where_they_fit(federation):
    await federation.start_federation(*AGENTS)

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


async def _running_seq(federation, job_id: str) -> int:
    entries = await federation.store.changelog_list_for_job(job_id)
    return next(e.seq for e in entries if e.to_state == "running")


async def test_preferences_choose_among_peers_that_fit_and_the_cli_sends_resources(federation):
    await federation.start_federation(*AGENTS)

    # Best fit alone would pick gpu-west (2 GPUs) for one GPU; the preference wins.
    a100 = federation.cli("submit", "--id", "prefers-a100", "--resource", "gpu=1", "--resource", "memory_mb=1024",
                          "--prefer", "device_variant=a100", "--", "true")
    assert a100.returncode == 0, a100.stderr
    h100 = federation.cli("submit", "--id", "prefers-h100", "--resource", "gpu=1",
                          "--prefer", "device_variant=h100", "--", "true")
    assert h100.returncode == 0, h100.stderr
    # A preference nobody satisfies never rejects: the job runs where it fits.
    nowhere = federation.cli("submit", "--id", "prefers-nowhere", "--resource", "gpu=1",
                             "--prefer", "device_variant=b200", "--", "true")
    assert nowhere.returncode == 0, nowhere.stderr
    assert (await federation.wait_state("prefers-a100", "succeeded")).owner_peer_id == "gpu-east"
    assert (await federation.wait_state("prefers-h100", "succeeded")).owner_peer_id == "gpu-west"
    assert (await federation.wait_state("prefers-nowhere", "succeeded")).owner_peer_id in ("gpu-west", "gpu-east")
    stored = await federation.job("prefers-a100")
    assert stored.spec["resources"] == {"cpu": 1, "gpu": 1, "memory_mb": 1024}


async def test_a_big_job_is_not_starved_by_a_stream_of_small_ones(federation):
    """The anti-starvation rule (docs/scheduling.md): once the 4-GPU job has waited past
    --reserve-after, gpu-east is held for it, so small jobs that arrive later start after it."""
    federation.start("router")
    federation.start("tick", "--reserve-after", "0.5")
    federation.start("home", "--resource", "cpu=4")
    federation.start("gpu-east", "--resource", "cpu=32", "--resource", "gpu=4", "--slots", "8")
    await federation.wait_router()
    await federation.wait_agent("home")
    await federation.wait_agent("gpu-east")

    small = {"command": ["sleep", "2"], "resources": {"gpu": 1}}
    for i in range(3):
        await federation.submit({"job_id": f"small-{i}", **small})
    for i in range(3):
        await federation.wait_state(f"small-{i}", "running")
    await federation.submit({"job_id": "big", "command": ["true"], "resources": {"gpu": 4}})
    later = []
    for i in range(8):  # a stream that, without the rule, would always take the freed GPU first
        later.append(f"later-{i}")
        await federation.submit({"job_id": later[-1], **small})
        await asyncio.sleep(0.4)
    assert (await federation.wait_state("big", "succeeded", timeout=120)).owner_peer_id == "gpu-east"
    for job_id in later:
        await federation.wait_state(job_id, "succeeded", timeout=120)
    big_started = await _running_seq(federation, "big")
    # Jobs submitted after the big one waited past the threshold all start after it.
    late_starts = {job_id: await _running_seq(federation, job_id) for job_id in later[2:]}
    assert all(seq > big_started for seq in late_starts.values()), (big_started, late_starts)
