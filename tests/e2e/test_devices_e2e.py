"""Device binding through real services (docs/design.md §3.7): a subprocess agent with
four GPUs runs two 2-GPU jobs at once on disjoint indices, and a third waits (not for a
slot: the peer has four) until one of them ends, then gets that one's indices."""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.configs import make_peer
from tests.infra.probes import kill_group
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]



async def test_gpu_jobs_on_one_node_get_disjoint_devices_and_a_third_waits(federation, tmp_path):
    federation.configure([make_peer("home", "cpu"), make_peer("gpu-east", "gpu", 4)], ttl_s=5.0)
    # Each job notes its devices, what it asked and its pid in its run folder, then waits to be released.
    gate = shlex.quote(str(tmp_path / "release-"))
    command = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES;$IRISFED_RESOURCES;$$" > devices; '
                           f'while [ ! -e {gate}"$IRISFED_JOB_ID" ]; do sleep 0.1; done']
    await federation.start_federation()
    federation.start("gpu-east", "--resource", "cpu=8", "--resource", "gpu=4")
    await federation.wait_agent("gpu-east")
    pids: list[int] = []

    async def devices(job_id: str) -> list[int]:
        job = await federation.wait_state(job_id, "running")
        path = Path(job.log_dir) / "devices"

        async def noted():
            text = path.read_text().strip() if path.exists() else ""
            return text.split(";") if text.count(";") == 2 else None
        seen, resources, pid = await wait_for(noted, f"{job_id} to note its devices")
        pids.append(int(pid))
        assert json.loads(resources) == {"cpu": 1, "gpu": 2}
        return [int(index) for index in seen.split(",")]

    try:
        for job_id in ("a", "b"):
            reply = await federation.submit({"job_id": job_id, "command": command, "constraints": GPU,
                                             "resources": {"gpu": 2}})
            assert reply["disposition"] == "queue", reply
        first, second = await devices("a"), await devices("b")
        assert len(first) == len(second) == 2 and sorted(first + second) == [0, 1, 2, 3]

        reply = await federation.submit({"job_id": "c", "command": command, "constraints": GPU,
                                         "resources": {"gpu": 2}})
        assert reply["disposition"] == "queue", reply
        with contextlib.suppress(AssertionError):  # given time to (wrongly) start
            await federation.wait_state("c", "running", timeout=3.0)
        assert (await federation.job("c")).state in ("queued", "assigned")

        (tmp_path / "release-a").touch()
        assert (await federation.wait_state("a", *TERMINAL_STATES)).state == "succeeded"
        assert sorted(await devices("c")) == sorted(first)
        for job_id in ("b", "c"):
            (tmp_path / f"release-{job_id}").touch()
            assert (await federation.wait_state(job_id, *TERMINAL_STATES)).state == "succeeded"
    finally:
        for job_id in ("a", "b", "c"):
            (tmp_path / f"release-{job_id}").touch()
        for pid in pids:
            kill_group(pid)
