"""Attack round 16, end to end: an agent on uvloop (the default loop since f1aab21)
stopped by SIGTERM while a subprocess-backend job runs kills the job's whole process
group and exits 0."""

import json
import os

import pytest

from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_sigterm_kills_a_running_jobs_process_group_and_exits_0(federation, loop):
    federation.start("router")
    federation.start("tick")
    federation.start("home", "--event-loop", loop)
    await federation.wait_router()
    await federation.wait_agent("home")
    # A job whose shell leaves a second process in its group: both must go.
    reply = await federation.submit({"command": ["sh", "-c", "sleep 300 & sleep 300"]})
    assert reply["disposition"] == "local", reply
    pid = await federation.run_pid(reply["job_id"])
    pgid = os.getpgid(pid)
    assert pgid != os.getpgid(0)  # its own group, not the test's
    assert _group_alive(pgid)

    assert federation.stop("home") == 0
    assert federation.supervisor.overruns == []  # stopped by itself, never SIGKILLed

    async def gone():
        return not _group_alive(pgid)
    try:
        await wait_for(gone, "the job's process group to be killed", timeout=20)
    finally:
        if _group_alive(pgid):
            os.killpg(pgid, 9)  # leave nothing behind when the assertion fails
    loops = {json.loads(line)["loop"] for line in federation.log("home").splitlines()
             if '"event":"event_loop"' in line}
    assert loops == {loop}
