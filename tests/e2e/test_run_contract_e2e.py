"""The run contract (docs/design.md §3.7) through real router, tick and agent processes:
time limits, a graceful stop with the job's own grace, failure retries, a command that
cannot start, and an agent restart that spends no retry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.infra.configs import make_peer
from tests.infra.probes import alive
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

# Prints "started", then loops; on SIGTERM prints "checkpoint" and exits 0.
CHECKPOINTS = ("trap 'echo checkpoint; exit 0' TERM; echo started; "
               "while true; do sleep 0.1; done")
# Ignores SIGTERM (its children inherit that): only SIGKILL ends it.
IGNORES_TERM = "trap '' TERM; echo started; while true; do sleep 0.1; done"
# Fails (exit 1) until its third run, counting runs in $COUNTER.
THIRD_TIME_LUCKY = 'n=$(cat "$COUNTER" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$COUNTER"; [ "$n" -ge 3 ]'


async def _started(federation, job_id: str) -> Path:
    """The run's folder once its command printed ``started``."""
    job = await federation.wait_state(job_id, "running")
    stdout = Path(job.log_dir) / "stdout"

    async def printed():
        return stdout.exists() and "started" in stdout.read_text()
    await wait_for(printed, f"{job_id} to print 'started'")
    return Path(job.log_dir)


async def _history(federation, job_id: str) -> list[tuple[str, str, str]]:
    return [(e.from_state or "", e.to_state, e.detail) for e in await federation.store.changelog_list_for_job(job_id)]


async def test_a_time_limit_stops_the_run_and_fails_the_job_without_a_retry(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sleep", "120"], "time_limit_s": 1, "max_retries": 3})
    job = await federation.wait_state(reply["job_id"], "failed", "succeeded", "killed")
    assert (job.state, job.reason, job.attempts) == ("failed", "time limit 1s reached", 1)
    shown = federation.cli("job", reply["job_id"])
    assert "time limit 1s" in shown.stdout and "1 run;" in shown.stdout


async def test_a_cancelled_job_gets_sigterm_and_its_grace_to_checkpoint(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sh", "-c", CHECKPOINTS], "grace_s": 30})
    await _started(federation, reply["job_id"])
    await federation.cancel(reply["job_id"])
    job = await federation.wait_state(reply["job_id"], "killed", "failed", "succeeded")
    assert job.state == "killed"
    logs = federation.cli("logs", reply["job_id"])
    assert logs.stdout.splitlines() == ["started", "checkpoint"], logs.stderr


async def test_a_run_ignoring_sigterm_is_killed_once_its_grace_is_over(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sh", "-c", IGNORES_TERM], "grace_s": 1})
    pid = await federation.run_pid(reply["job_id"])
    await _started(federation, reply["job_id"])
    await federation.cancel(reply["job_id"])
    job = await federation.wait_state(reply["job_id"], "killed", "failed", "succeeded")
    assert (job.state, job.exit_code) == ("killed", -9)  # SIGKILL, after SIGTERM was ignored
    assert not alive(pid)


@pytest.mark.parametrize(("retries", "state", "runs"), [(2, "succeeded", 3), (1, "failed", 2)])
async def test_failure_retries_run_a_failing_command_again(federation, tmp_path, retries, state, runs):
    await federation.start_federation("home")
    counter = tmp_path / f"runs-{retries}"
    reply = await federation.submit({"command": ["sh", "-c", THIRD_TIME_LUCKY], "env": {"COUNTER": str(counter)},
                                     "max_failure_retries": retries, "max_retries": 0})
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed", "killed")
    assert (job.state, job.attempts, job.failures) == (state, runs, runs - 1)
    epochs = [e.epoch for e in await federation.store.changelog_list_for_job(job.job_id) if e.to_state == "running"]
    assert len(set(epochs)) == runs  # each run under an epoch of its own
    assert int(counter.read_text()) == runs
    history = await _history(federation, reply["job_id"])
    again = [detail for (_, to, detail) in history if to == "queued"]  # the submit assigned it: local
    assert again == [f"exit code 1; running again (failure retry {i} of {retries})" for i in range(1, runs)]
    if state == "failed":
        assert job.reason == "exit code 1; no failure retries left"


async def test_a_command_that_cannot_start_fails_the_job_after_one_run(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["no-such-binary-irisfed"], "max_retries": 3})
    job = await federation.wait_state(reply["job_id"], "failed", "succeeded", "killed")
    assert job.state == "failed" and job.attempts == 1
    assert "cannot start 'no-such-binary-irisfed'" in job.reason
    assert [to for (_, to, _) in await _history(federation, reply["job_id"])] == [
        "assigned", "running", "failed"]  # local: assigned at submit; never handed back


async def test_an_agent_restart_hands_its_run_back_spending_no_retry(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sleep", "60"], "max_retries": 0})
    first = await federation.run_pid(reply["job_id"])
    federation.kill("home")  # SIGKILL: its run lives on until the next agent stops it
    federation.start("home")

    async def running_again():
        job = await federation.job(reply["job_id"])
        return job if job.state == "running" and job.attempts == 2 else None
    job = await wait_for(running_again, "the job to run again")
    assert (job.attempts, job.restarts, job.failures) == (2, 1, 0)
    assert not alive(first)
    history = await _history(federation, reply["job_id"])
    assert ("running", "queued", "agent on home restarted while running it; running again (no retry spent)") \
        in history
    await federation.cancel(reply["job_id"])
    assert (await federation.wait_state(reply["job_id"], "killed")).state == "killed"


async def test_a_preempted_run_gets_sigterm_and_the_preemptor_starts_once_it_stopped(federation, tmp_path):
    """One slot: the victim traps SIGTERM, writes its checkpoint and takes a moment to
    stop; the preemptor's first line comes after the victim's last."""

    federation.configure([make_peer("home", "cpu", 1), make_peer("gpu-west", "gpu", 1)])
    await federation.start_federation("gpu-west")
    ledger = tmp_path / "ledger"
    note = f'>> "{ledger}"'
    victim = ("trap 'echo checkpoint " + note + "; sleep 1; echo stopped " + note + "; exit 0' TERM; "
              f'echo "run $IRISFED_EPOCH" {note}; [ "$IRISFED_EPOCH" = 1 ] || exit 0; '
              "while true; do sleep 0.1; done")
    gpu = [{"key": "device_type", "op": "eq", "value": "gpu"}]
    await federation.submit({"job_id": "victim", "command": ["sh", "-c", victim], "constraints": gpu,
                             "band": "batch", "grace_s": 30})
    await federation.wait_state("victim", "running")
    await wait_for(lambda: _has(ledger, "run 1"), "the victim to start")
    await federation.submit({"job_id": "urgent", "command": ["sh", "-c", f"echo urgent {note}"], "constraints": gpu,
                             "band": "interactive"})
    assert (await federation.wait_state("urgent", "succeeded", "failed", "killed")).state == "succeeded"
    lines = ledger.read_text().splitlines()
    assert lines[:4] == ["run 1", "checkpoint", "stopped", "urgent"], lines
    victim_job = await federation.wait_state("victim", "succeeded", "failed", "killed")
    assert (victim_job.state, victim_job.preemptions) == ("succeeded", 1)


async def _has(path: Path, line: str) -> bool:
    return await asyncio.to_thread(lambda: path.exists() and line in path.read_text().splitlines())


def test_ctrl_c_of_irisfed_up_then_up_again_runs_the_job_again_spending_no_retry(tmp_path):
    """``irisfed up``'s Ctrl-C stops its agents, which kill their subprocess runs; the
    next ``up`` hands those jobs back through no fault of theirs: they run again, and a
    job allowed no retry at all still does."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.e2e.conftest import ROOT, interrupt_and_collect

    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
    env["PYTHONPATH"] = str(ROOT)

    def up() -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "irisfed.cli", "up", "--state-dir", str(state), "--no-live"],
                                   cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            if "Ctrl-C stops everything" in line:
                return process
        raise AssertionError(interrupt_and_collect(process))

    def cli(*args: str) -> subprocess.CompletedProcess:
        connect = json.loads((state / "connect.json").read_text())
        client_env = {**env, "IRISFED_DATABASE_URL": connect["database_url"], "IRISFED_NATS_URL": connect["nats_url"],
                      "IRISFED_CONFIG": connect["config"]}
        return subprocess.run([sys.executable, "-m", "irisfed.cli", *args], env=client_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)

    def job_when(ready) -> dict:
        for _ in range(600):  # each try is a real read
            shown = cli("job", "long-one", "--output", "json")
            job = json.loads(shown.stdout)["job"] if shown.returncode == 0 else None
            if job and ready(job):
                return job
            time.sleep(0.2)
        raise AssertionError(f"long-one never got there: {shown.stdout} {shown.stderr}")

    first = up()
    try:
        # `up` says ready once the router judges submits against every peer: the first
        # submit is placed (before the peers' heartbeats it would be rejected for good).
        sent = cli("submit", "--id", "long-one", "--max-retries", "0", "--", "sleep", "300")
        assert sent.returncode == 0, sent.stdout + sent.stderr
        job_when(lambda job: job["state"] == "running")
    finally:
        interrupt_and_collect(first)
    second = up()
    try:
        job = job_when(lambda job: job["state"] == "running" and job["attempts"] == 2)
        assert (job["restarts"], job["max_retries"]) == (1, 0)
        shown = cli("job", "long-one").stdout
        assert "2 runs: again after 1 agent restart; infrastructure retries 0 of 0" in shown, shown
        cancelled = cli("cancel", "long-one")
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert job_when(lambda job: job["state"] == "killed")["attempts"] == 2
    finally:
        interrupt_and_collect(second)
