"""A federation running on least-privilege Postgres roles (`irisfed db-roles`).

Router, tick and agent connect as their own login roles. An agent must still be able
to hand its own job back to the queue (launch error with retries left, orphan after a
crash), fail it, and end it killed (cancel while running, cancel while it was down).
"""

from __future__ import annotations

import contextlib
import os
import signal

from tests.e2e.conftest import TERMINAL
from tests.infra.waiting import wait_for


async def _changes(federation, job_id: str) -> list[tuple]:
    return [(r["from_state"], r["to_state"], r["actor"], r["epoch"])
            for r in await federation.store.changelog_list_for_job(job_id)]


async def test_federation_on_db_roles_retries_recovers_orphans_and_cancels(federation, tmp_path):
    await federation.use_db_roles()
    await federation.start_federation("home")

    # A failure with a failure retry left: handed back to the queue (epoch + 1), then failed;
    # a program that cannot start fails at once.
    ok = await federation.submit({"command": ["true"]})
    failing = await federation.submit({"command": ["sh", "-c", "exit 4"], "max_failure_retries": 1})
    missing = await federation.submit({"command": ["/no/such/program"], "max_retries": 1})
    assert (await federation.wait_state(ok["job_id"], "succeeded", "failed", timeout=30))["state"] == "succeeded"
    job = await federation.wait_state(failing["job_id"], *TERMINAL, timeout=30)
    assert (job["state"], job["attempts"], job["failures"], job["exit_code"]) == ("failed", 2, 1, 4)
    assert ("running", "queued", "home", 2) in await _changes(federation, failing["job_id"])
    job = await federation.wait_state(missing["job_id"], *TERMINAL, timeout=30)
    assert (job["state"], job["attempts"]) == ("failed", 1)
    assert "cannot start '/no/such/program'" in job["reason"]

    # The agent dies under two running jobs; one is cancelled while it is down.
    marker = tmp_path / "ran-once"
    orphan = await federation.submit({
        "command": ["sh", "-c", f"if [ -e {marker} ]; then exit 0; fi; touch {marker}; exec sleep 60"],
        "max_retries": 1, "cluster_pin": "home"})  # pinned: only the agent itself may recover it
    doomed = await federation.submit({"command": ["sleep", "60"], "cluster_pin": "home"})
    pids = [await federation.run_pid(orphan["job_id"]), await federation.run_pid(doomed["job_id"])]
    try:
        federation.kill("home")
        assert (await federation.cancel(doomed["job_id"]))["outcome"] in ("kill_sent", "pending_owner_offline")
        federation.start("home")
        job = await federation.wait_state(orphan["job_id"], *TERMINAL, timeout=30)
        assert (job["state"], job["attempts"], job["restarts"]) == ("succeeded", 2, 1)  # no retry spent
        assert ("running", "queued", "home", 2) in await _changes(federation, orphan["job_id"])
        job = await federation.wait_state(doomed["job_id"], *TERMINAL, timeout=30)
        assert (job["state"], job["reason"]) == ("killed", "cancelled by user default while its agent was down")
        assert (await _changes(federation, doomed["job_id"]))[-1][:3] == ("running", "killed", "home")
    finally:
        for pid in pids:  # the leftover copies, should the restarted agent not have killed them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # A cancel of a running job on a live agent.
    live = await federation.submit({"command": ["sleep", "60"]})
    await federation.run_pid(live["job_id"])
    assert (await federation.cancel(live["job_id"]))["outcome"] == "kill_sent"
    job = await federation.wait_state(live["job_id"], *TERMINAL, timeout=30)
    assert job["state"] == "killed"

    async def all_terminal():
        return all(r["state"] in TERMINAL for r in await federation.store.job_list_states())
    await wait_for(all_terminal, "every job to end")
    for name in ("router", "tick", "home"):
        text = federation.log(name)
        assert "permission denied" not in text and "row-level security" not in text, name
    assert "report_set_aside" not in federation.log("home")
