"""Every service exits by itself, with status 0, on SIGTERM while it is busy; an agent
so stopped while a subprocess-backend job runs kills the job's whole process group first,
on either event loop (uvloop, the default, or asyncio).

The state that matters: an agent flooded with assignment notices (its start loop
woken again and again, the tick's too) when SIGTERM comes. A wait that swallows the
cancellation of shutdown (as Python 3.11's ``asyncio.wait_for`` can) keeps the agent
running until the harness SIGKILLs it, 15 s later. tests/unit/test_task_cancel.py sets
that race up exactly; here the real processes meet it as it happens, a few times.
The stop timeout is generous: a SIGKILL, not a slow stop, is the failure.
"""

import asyncio
import json
import os

import pytest

from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

ROUNDS = 4
AGENTS = ("home", "gpu-west")
SUBMITTERS = 3
GENEROUS_STOP_S = 60.0


async def _flood(federation, stop: asyncio.Event) -> int:
    """Submit short local jobs back to back until ``stop``; how many were answered."""
    body = json.dumps({"command": ["sleep", "0.2"]}).encode()
    answered = 0
    while not stop.is_set():
        try:
            await federation.nats.request(f"{federation.prefix}.submit", body, timeout=2)
            answered += 1
        except Exception:  # noqa: BLE001 - a router going away mid-request is expected here
            await asyncio.sleep(0.05)
    return answered


STARTED = {"router": "router_started", "tick": "tick_started", "web": "web_started",
           **dict.fromkeys(AGENTS, "agent_started")}


async def test_sigterm_while_flooded_with_work_ends_every_service_cleanly(federation):
    for round_ in range(1, ROUNDS + 1):
        exits = await _flood_then_sigterm(federation, round_)
        assert federation.supervisor.overruns == [], federation.supervisor.overruns  # none SIGKILLed
        assert exits == dict.fromkeys(exits, 0)
    # Every service ran (and stopped cleanly, above) on the default event loop, uvloop.
    for name in STARTED:
        loops = {json.loads(line)["loop"] for line in federation.log(name).splitlines()
                 if '"event":"event_loop"' in line}
        assert loops == {"uvloop"}, (name, loops)


async def _flood_then_sigterm(federation, round_: int) -> dict[str, int]:
    """Start every service, flood home with work, SIGTERM them all; their exit statuses."""
    await federation.start_federation(*AGENTS)
    federation.start("web", "--port", "0")

    async def all_started():
        # Logs are appended to round after round: this round's start is the round-th.
        return all(federation.log(name).count(f'"event":"{event}"') >= round_
                   for name, event in STARTED.items()) or None
    await wait_for(all_started, "every service to start")
    ran_before = await _ran_on_home(federation)
    stop = asyncio.Event()
    floods = [asyncio.create_task(_flood(federation, stop)) for _ in range(SUBMITTERS)]

    async def working():
        # Jobs running on home: its start loop is being woken by assignment notices.
        return await _ran_on_home(federation) >= ran_before + 3 or None
    await wait_for(working, "home to run the flood's jobs")

    children = dict(federation.supervisor.processes)
    await asyncio.to_thread(federation.supervisor.stop_all, GENEROUS_STOP_S)  # SIGTERM to all, busy
    stop.set()
    assert sum(await asyncio.gather(*floods)) > 0
    return {name: process.returncode for name, process in children.items()}


async def _ran_on_home(federation) -> int:
    return await federation.store.db.fetchval(
        "SELECT count(*) FROM jobs WHERE owner_peer_id = 'home' AND state IN ('running', 'succeeded')")


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
