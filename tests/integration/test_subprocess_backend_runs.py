"""The subprocess backend finds the runs it launched again, even from a new agent run.

Real processes; what a later agent run knows is only what the backend recorded
in its work folder. A recorded pid that now names another process is never
listed and never killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import (
    LiveRun,
    RunSpec,
    SubprocessBackend,
)
from tests.infra.probes import alive, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")



def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])




@pytest.fixture
def strangers():
    """Processes the backend did not start (stopped by PID when the test ends)."""
    started: list[subprocess.Popen] = []

    def start(env: dict[str, str] | None = None) -> subprocess.Popen:
        process = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"], **(env or {})},
                                   start_new_session=True)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


async def test_runs_are_listed_until_they_end_even_by_a_new_backend_object(tmp_path, launched):
    backend = SubprocessBackend(tmp_path)
    long = await backend.launch(RunSpec("long", 1, ["sleep", "300"]))
    launched.append(long.process.pid)
    short = await backend.launch(RunSpec("short", 2, ["true"]))
    assert await short.wait() == 0
    assert await backend.list_runs() == [LiveRun("long", 1, str(long.process.pid))]
    record = json.loads((tmp_path / "long" / "epoch-1" / "run.json").read_text())
    assert record["pid"] == long.process.pid and record["start_ticks"] > 0
    assert (tmp_path / "short" / "epoch-2" / "exit").read_text() == "exit 0\n"

    # What the next agent run sees (it knows only the work folder).
    later = SubprocessBackend(tmp_path)
    [leftover] = await later.list_runs()
    assert leftover == LiveRun("long", 1, str(long.process.pid))
    assert await later.kill_run(leftover)
    await long.process.wait()  # we are still its parent here: reap it
    assert not alive(long.process.pid)
    assert await later.list_runs() == []
    assert await SubprocessBackend(tmp_path).list_runs() == []
    assert "killed" in (tmp_path / "long" / "epoch-1" / "exit").read_text()
    assert sorted(p.name for p in (tmp_path / ".live").iterdir()) == [".indexed"]  # nothing left to scan


async def test_a_run_killed_by_its_own_agent_leaves_no_live_record(tmp_path, launched):
    backend = SubprocessBackend(tmp_path)
    run = await backend.launch(RunSpec("job", 1, ["sleep", "300"]))
    launched.append(run.process.pid)
    await run.kill(grace_s=1.0)
    assert await SubprocessBackend(tmp_path).list_runs() == []


async def test_a_run_that_ended_while_no_agent_watched_is_dropped(tmp_path, launched):
    run = await SubprocessBackend(tmp_path).launch(RunSpec("job", 1, ["sleep", "300"]))
    launched.append(run.process.pid)
    os.killpg(run.process.pid, signal.SIGKILL)
    await run.process.wait()  # reaped behind the backend's back, as after an agent crash
    later = SubprocessBackend(tmp_path)
    assert await later.list_runs() == []
    assert not (tmp_path / ".live" / "job.epoch-1.json").exists()
    assert (tmp_path / "job" / "epoch-1" / "exit").read_text() == "ended while no agent watched it\n"


async def test_a_recorded_pid_that_now_names_another_process_is_never_killed(tmp_path, launched, strangers):
    run = await SubprocessBackend(tmp_path).launch(RunSpec("job", 1, ["sleep", "300"]))
    launched.append(run.process.pid)
    os.killpg(run.process.pid, signal.SIGKILL)
    await run.process.wait()
    # The pid is reused by a process that is not ours: point the records at it.
    stranger = strangers()
    stranger_start = start_ticks(stranger.pid)
    for path in (tmp_path / ".live" / "job.epoch-1.json", tmp_path / "job" / "epoch-1" / "run.json"):
        record = json.loads(path.read_text())
        # Ours started before the stranger (the clock has 10 ms ticks: make "before" strict).
        start = min(record["start_ticks"], stranger_start - 1)
        path.write_text(json.dumps({**record, "pid": stranger.pid, "start_ticks": start}))
    (tmp_path / "job" / "epoch-1" / "pid").write_text(str(stranger.pid))

    later = SubprocessBackend(tmp_path)
    assert not await later.kill_leftover("job", 1)
    assert await later.list_runs() == []
    assert not await later.kill_run(LiveRun("job", 1, str(stranger.pid)))
    assert stranger.poll() is None and alive(stranger.pid)


async def test_a_pid_file_of_an_older_agent_is_checked_by_the_runs_environment(tmp_path, strangers):
    # Work folders written before runs were recorded hold only a pid file.
    ours = strangers({"IRISFED_JOB_ID": "old", "IRISFED_EPOCH": "1"})
    other = strangers({"IRISFED_JOB_ID": "someone-else", "IRISFED_EPOCH": "1"})
    for job_id, process in (("old", ours), ("reused", other)):
        run_dir = tmp_path / job_id / "epoch-1"
        run_dir.mkdir(parents=True)
        (run_dir / "pid").write_text(str(process.pid))
    backend = SubprocessBackend(tmp_path)
    assert await backend.list_runs() == [LiveRun("old", 1, str(ours.pid))]
    assert await backend.kill_run(LiveRun("old", 1, str(ours.pid)))
    ours.wait(timeout=30)
    assert alive(other.pid) and await backend.list_runs() == []


async def test_an_agent_killed_between_marking_and_learning_the_pid_still_finds_its_run(tmp_path, strangers):
    backend = SubprocessBackend(tmp_path)
    process = strangers({"IRISFED_JOB_ID": "job", "IRISFED_EPOCH": "4"})
    (tmp_path / ".live").mkdir()
    (tmp_path / ".live" / "job.epoch-4.json").write_text(json.dumps({"job_id": "job", "epoch": 4}))
    assert await backend.list_runs() == [LiveRun("job", 4, str(process.pid))]
    assert await backend.kill_run(LiveRun("job", 4, str(process.pid)))
    await wait_for(lambda: returns(process.poll() is not None), "the run to die")


async def test_a_launch_cancelled_after_its_process_started_leaves_nothing_running(tmp_path, launched):
    """Its agent stopping while a run starts (the process exists, its record is being
    written): the caller never gets the run, so the backend ends its whole group, writes
    no exit code (the next agent hands the job back) and leaves no live record."""
    backend = SubprocessBackend(tmp_path)
    gate = threading.Event()
    record_started = backend._record_started

    def held(run_dir, record):
        gate.wait(timeout=60)
        record_started(run_dir, record)
    backend._record_started = held
    background = tmp_path / "background"
    launch = asyncio.create_task(backend.launch(RunSpec(
        "cut", 1, ["sh", "-c", f"sleep 300 & echo $! > {background}; wait"])))

    async def started():
        return next((r.pid for r in backend._active.values() if r.pid), None)
    pid = await wait_for(started, "the run's process to start")
    launched.append(pid)
    child = int(await wait_for(lambda: returns(background.exists() and background.read_text().strip()),
                               "the run's background child"))
    launch.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await launch
    await wait_for(lambda: returns(not alive(pid) and not alive(child)), "the run's process group to end")
    assert (tmp_path / "cut" / "epoch-1" / "exit").read_text() == "stopped with its agent before it was handed over\n"
    later = SubprocessBackend(tmp_path)
    assert await later.list_runs() == []
    assert await later.adopt(LiveRun("cut", 1, str(pid))) is None  # no exit code: handed back


async def test_what_a_run_left_running_when_its_leader_ended_unwatched_is_killed(tmp_path, launched):
    """The agent was away (killed) when a run's first process ended, leaving a child in
    its process group: the next agent kills that child (it holds the run's devices and
    room) and records the end without an exit code."""
    backend = SubprocessBackend(tmp_path)
    background = tmp_path / "background"
    run = await backend.launch(RunSpec("left", 1, ["sh", "-c", f"sleep 300 & echo $! > {background}"]))
    launched.append(run.process.pid)
    child = int(await wait_for(lambda: returns(background.exists() and background.read_text().strip()),
                               "the run's background child"))
    await wait_for(lambda: returns(not alive(run.process.pid)), "the run's first process to end")
    assert alive(child)

    later = SubprocessBackend(tmp_path)  # the next agent: it never saw the run end
    assert await later.list_runs() == []
    await wait_for(lambda: returns(not alive(child)), "what the run left running to be killed")
    assert (tmp_path / "left" / "epoch-1" / "exit").read_text() == (
        "ended while no agent watched it; what it left running was killed\n")
    assert await later.adopt(LiveRun("left", 1, str(run.process.pid))) is None  # handed back
    await run.process.wait()
