"""Hostile review of the run contract (docs/design.md §3.7) through real router, tick and
agent processes: the agent SIGKILLed or stopped at each step of a run's end and of a
stop (a failing run's exit before its report, a time limit's grace, a cancel's grace),
and a job that takes its own agent down.

Every job here writes one line to its ledger per run ("run") and per SIGTERM it
receives ("term"), so a test counts runs and signals exactly. Jobs whose agent is
killed are pinned to ``home``: the tick never recovers a pinned job from a lost peer, so
only the restarted agent decides what becomes of it (no race with lost-peer recovery).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest

from irisfed.shared.retry import MAX_FREE_RESTARTS
from tests.infra.probes import alive
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

TERMINAL = ("succeeded", "failed", "killed", "rejected", "unschedulable")

# Records its run; waits for $GO; exits $CODE.
WAITS_THEN_EXITS = 'echo run >> "$LEDGER"; while [ ! -e "$GO" ]; do sleep 0.1; done; exit "$CODE"'
# Records its run and every SIGTERM, and goes on running after each (a long checkpoint).
KEEPS_RUNNING = ("trap 'echo term >> \"$LEDGER\"' TERM; echo run >> \"$LEDGER\"; "
                 "while true; do sleep 0.1; done")
# Records its run, then SIGKILLs its parent: the agent that started it.
KILLS_ITS_AGENT = 'echo run >> "$LEDGER"; kill -9 $PPID'


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The file a test's jobs record their runs and SIGTERMs in."""
    return tmp_path / "ledger"


def _lines(ledger: Path, word: str) -> int:
    try:
        return ledger.read_text().split().count(word)
    except FileNotFoundError:
        return 0


async def _has(ledger: Path, word: str, count: int = 1) -> bool:
    return _lines(ledger, word) >= count


def _kill_once(marker: bytes) -> None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)


async def _kill_runs_of(ledger: Path, settle_s: float = 2.0) -> None:
    """SIGKILL the process group of every live process started with ``LEDGER=<ledger>``
    in its environment: this test's runs only, found by /proc (a run the agent spawned
    just before it was killed may have no pid file yet). Scanned for ``settle_s``: a
    child forked by an agent that was then killed shows its environment only once it
    has exec'd."""
    marker = f"LEDGER={ledger}".encode()
    deadline = asyncio.get_running_loop().time() + settle_s
    while True:
        _kill_once(marker)
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.1)


async def _terminal_or_again(federation, job_id: str, timeout: float = 90.0):
    """The job once it ended, or once it is running a second time (it ran again)."""
    async def settled():
        job = await federation.job(job_id)
        if job is not None and (job.state in TERMINAL or (job.state == "running" and job.attempts >= 2)):
            return job
        return None
    return await wait_for(settled, f"{job_id} to end or run again", timeout=timeout)


async def _submit_on_home(federation, ledger: Path, script: str, **fields) -> str:
    """Start a federation of ``home`` and submit ``script`` pinned to it, recording in
    ``ledger``: its job id."""
    await federation.start_federation("home")
    reply = await federation.submit({
        "cluster_pin": "home", "command": ["sh", "-c", script], "env": {"LEDGER": str(ledger)}, **fields})
    return reply["job_id"]


async def _run_started(federation, job_id: str, ledger: Path) -> int:
    """The pid of the job's run, once it recorded its start."""
    pid = await federation.run_pid(job_id)
    await wait_for(lambda: _has(ledger, "run"), "the run to start")
    return pid


async def _cancel_into_grace(federation, job_id: str, ledger: Path) -> None:
    """Cancel the job and wait for its run to record the SIGTERM (its grace begins)."""
    await federation.cancel(job_id)
    await wait_for(lambda: _has(ledger, "term"), "the cancel's SIGTERM")


# ---------------------------------------------------------------- between a run's exit and its report


@pytest.mark.parametrize(("code", "failure_retries", "state", "runs"), [
    (0, 0, "succeeded", 1),  # succeeded: never run again
    (1, 1, "failed", 2),     # one failure retry, exactly once
], ids=["succeeded", "failed-with-one-retry"])
async def test_an_end_not_yet_reported_when_the_agent_is_sigkilled_is_not_run_again(
        federation, tmp_path, ledger, code, failure_retries, state, runs):
    go = tmp_path / "go"
    await federation.start_federation()
    _, db_proxy = federation.start_behind_proxies("home")
    await federation.wait_agent("home")
    reply = await federation.submit({
        "cluster_pin": "home", "command": ["sh", "-c", WAITS_THEN_EXITS], "max_retries": 0,
        "max_failure_retries": failure_retries,
        "env": {"LEDGER": str(ledger), "GO": str(go), "CODE": str(code)}})
    job_id = reply["job_id"]
    try:
        job = await federation.wait_state(job_id, "running")
        await wait_for(lambda: _has(ledger, "run"), "the first run to start")
        db_proxy.cut()  # the agent can no longer report
        go.touch()
        exit_file = Path(job.log_dir) / "exit"

        async def ended():
            return exit_file.exists()
        await wait_for(ended, "the run to end")
        await wait_for(lambda: _has_text(federation.log("home"), "report_deferred"), "the report to be deferred")
        federation.kill("home")  # SIGKILL between the run's exit and its report
        db_proxy.restore()
        federation.start("home")
        job = await federation.wait_state(job_id, *TERMINAL, timeout=90)
        assert _lines(ledger, "run") == runs
        assert (job.state, job.attempts, job.failures, job.restarts) == (state, runs, runs - 1, 0)
    finally:
        go.touch()
        await _kill_runs_of(ledger)


async def _has_text(text: str, needle: str) -> bool:
    return needle in text


# ---------------------------------------------------------------- time limits


async def test_a_gangs_time_limit_counts_from_when_all_its_tasks_run_not_from_its_launch(federation, ledger):
    """``home`` has two one-cpu nodes and a single job holds one for 3 s: a gang of two with
    a 1 s time limit waits for it, then both tasks run, and only then is it stopped."""
    from irisfed.tooling.federation import Peer, render_config

    federation.config_path.write_text(render_config(
        [Peer("home", {"device_type": "cpu"}, slots=3), Peer("tpu-east", {"device_type": "tpu"})],
        local_cluster="home", subject_prefix=federation.prefix, heartbeat_interval_s=0.25,
        heartbeat_ttl_s=5.0, tick_interval_s=0.25, assign_grace_s=1.0))
    await federation.start_federation(("home", "--node", "2:cpu=1", "--resource", "cpu=2"))
    cpu = [{"key": "device_type", "op": "eq", "value": "cpu"}]
    try:
        await federation.submit({"job_id": "holder", "command": ["sleep", "3"], "constraints": cpu})
        await federation.wait_state("holder", "running")
        await federation.submit({
            "job_id": "gang", "command": ["sh", "-c", KEEPS_RUNNING], "env": {"LEDGER": str(ledger)},
            "constraints": cpu, "replicas": 2, "time_limit_s": 1, "grace_s": 1})
        job = await federation.wait_state("gang", *TERMINAL)
        assert (job.state, job.reason) == ("failed", "time limit 1s reached")
        assert _lines(ledger, "run") == 2  # both tasks ran before the limit stopped them
        # The gang ran once the holder's 3 s were over (its node freed; the holder's end is
        # recorded a moment later, with its agent's next report), not at its launch.
        holder = await federation.job("holder")
        assert holder.state == "succeeded" and job.started_at >= holder.started_at + timedelta(seconds=2)
    finally:
        await _kill_runs_of(ledger)




async def test_a_time_limit_spends_no_failure_retry_even_when_the_run_exits_non_zero(federation, ledger):
    """The run's own SIGTERM handler exits 3 when its time limit stops it: the job fails
    for its time limit, once, though failure retries remain (§3.7: not retried)."""
    script = "trap 'echo term >> \"$LEDGER\"; exit 3' TERM; echo run >> \"$LEDGER\"; while true; do sleep 0.1; done"
    job_id = await _submit_on_home(federation, ledger, script, time_limit_s=1, grace_s=0, max_failure_retries=3,
                                   max_retries=3)
    try:
        job = await federation.wait_state(job_id, *TERMINAL)
        assert (job.state, job.reason, job.attempts, job.failures) == ("failed", "time limit 1s reached", 1, 0)
        assert _lines(ledger, "run") == 1
    finally:
        await _kill_runs_of(ledger)




# ---------------------------------------------------------------- during a stop's grace


async def test_sigkill_of_the_agent_during_a_time_limits_grace_fails_the_job_without_running_it_again(
        federation, ledger):
    job_id = await _submit_on_home(federation, ledger, KEEPS_RUNNING, time_limit_s=1, grace_s=30, max_retries=3)
    try:
        first = await federation.run_pid(job_id)
        await wait_for(lambda: _has(ledger, "term"), "the time limit's SIGTERM")
        federation.kill("home")  # within the 30 s grace: SIGKILL not sent yet
        assert alive(first)
        federation.start("home")
        job = await _terminal_or_again(federation, job_id)
        assert not alive(first)
        assert (job.state, job.reason, job.attempts) == ("failed", "time limit 1s reached", 1)
        assert _lines(ledger, "run") == 1
    finally:
        federation.kill("home")
        await _kill_runs_of(ledger)


async def test_sigkill_of_the_agent_during_a_cancels_grace_kills_the_job_once(federation, ledger):
    job_id = await _submit_on_home(federation, ledger, KEEPS_RUNNING, grace_s=30, max_retries=3)
    try:
        first = await _run_started(federation, job_id, ledger)
        await _cancel_into_grace(federation, job_id, ledger)
        federation.kill("home")
        federation.start("home")
        job = await _terminal_or_again(federation, job_id)
        assert (job.state, job.attempts, job.restarts) == ("killed", 1, 0)
        assert "while its agent was down" in job.reason
        assert not alive(first)
        assert _lines(ledger, "run") == 1
    finally:
        federation.kill("home")
        await _kill_runs_of(ledger)


async def test_an_agent_stopping_during_a_cancels_grace_sends_no_second_sigterm(federation, ledger):
    job_id = await _submit_on_home(federation, ledger, KEEPS_RUNNING, grace_s=4)
    try:
        pid = await _run_started(federation, job_id, ledger)
        await _cancel_into_grace(federation, job_id, ledger)
        federation.stop("home")  # SIGTERM to the agent, within the job's grace
        assert not alive(pid)  # the agent does not leave its run behind
        assert _lines(ledger, "term") == 1
    finally:
        await _kill_runs_of(ledger)


async def test_stopping_the_agent_leaves_no_run_alive_whatever_the_jobs_grace(federation, ledger):
    job_id = await _submit_on_home(federation, ledger, KEEPS_RUNNING, grace_s=600)
    try:
        pid = await _run_started(federation, job_id, ledger)
        federation.stop("home")  # what irisfed up's Ctrl-C does to its agents (it waits 15 s)
        assert not alive(pid)
    finally:
        await _kill_runs_of(ledger)


# ---------------------------------------------------------------- a job that takes its agent down


async def test_a_job_that_kills_its_agent_is_not_run_again_and_again(federation, ledger):
    job_id = await _submit_on_home(federation, ledger, KILLS_ITS_AGENT, max_retries=0)

    async def ended_or_agent_dead():
        job = await federation.job(job_id)
        return (job is not None and job.state in TERMINAL) or not federation.supervisor.running("home")

    # Its first MAX_FREE_RESTARTS hand-backs spend no retry; the next one spends its
    # max_retries (none), so it fails: never run again and again.
    for deaths in range(1, MAX_FREE_RESTARTS + 3):
        await wait_for(ended_or_agent_dead, f"the job to end or take its agent down (#{deaths})", timeout=90)
        if federation.supervisor.running("home"):
            break  # the job ended: the agent lives on
        federation.start("home")  # as irisfed up restarts a dead agent
    job = await federation.wait_state(job_id, *TERMINAL, timeout=30)
    assert (job.state, job.restarts) == ("failed", MAX_FREE_RESTARTS)
    assert _lines(ledger, "run") == MAX_FREE_RESTARTS + 1
