"""A run left behind by a SIGKILLed agent is found and stopped when the agent returns.

Runs are started in their own session, so they outlive their agent. If the job
moved to another peer meanwhile (a higher epoch), the old copy must not keep
running beside the new one: the restarted agent finds every run it launched
(from what it recorded in its work folder) and kills those it no longer owns.
"""

import contextlib
import os
import signal

import pytest

from tests.infra.probes import alive, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

# The first copy (epoch 1) would run for minutes (long past this test) and leaves
# a mark that it started; any later copy finishes at once.
FIRST_COPY_LINGERS = ["sh", "-c",
                      'if [ "$IRISFED_EPOCH" = 1 ]; then touch first-copy-started; sleep 300; else echo ran; fi']


GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]





async def test_restarted_agent_kills_the_run_it_left_behind_when_the_job_moved_on(federation):
    await federation.start_federation("gpu-west")
    reply = await federation.submit({"command": FIRST_COPY_LINGERS, "constraints": GPU, "max_retries": 2})
    job_id = reply["job_id"]
    job = await federation.wait_state(job_id, "running")
    assert (job["owner_peer_id"], job["epoch"]) == ("gpu-west", 1)
    first_pid = await federation.run_pid(job_id)
    first_dir = job["log_dir"]
    try:
        await wait_for(lambda: returns(os.path.exists(os.path.join(first_dir, "first-copy-started"))),
                       "the epoch-1 copy to start")
        federation.start("gpu-east")  # a second GPU peer, where the job can go next
        federation.kill("gpu-west")  # SIGKILL: its run (own session) keeps running

        # Lost past grace: requeued (epoch 2), placed on gpu-east (epoch 3), done there.
        done = await federation.wait_state(job_id, "succeeded", "failed")
        assert (done["state"], done["owner_peer_id"], done["epoch"]) == ("succeeded", "gpu-east", 3)
        assert alive(first_pid)  # the leftover of epoch 1 still runs beside it

        federation.start("gpu-west")  # back: it must find and stop what it left behind

        async def recorded():
            rows = await federation.store.sync_state_get(job_id)
            notes = [r["note"] for r in rows if r["peer_id"] == "gpu-west"]
            return notes and "stale copy killed" in notes[0] and notes[0]

        note = await wait_for(recorded, "gpu-west to record that it killed its stale copy")
        assert "epoch 1" in note
        await wait_for(lambda: returns(not alive(first_pid)), "the epoch-1 process to be gone")
        await wait_for(lambda: returns("leftover_run_killed" in federation.log("gpu-west")),
                       "gpu-west to log the kill")

        job = await federation.job(job_id)
        assert (job["state"], job["owner_peer_id"], job["epoch"]) == ("succeeded", "gpu-east", 3)
        successes = await federation.store.db.fetchval(
            "SELECT count(*) FROM federation_changelog WHERE job_id = $1 AND to_state = 'succeeded'", job_id)
        assert successes == 1
        runs = await federation.store.db.fetch(
            "SELECT epoch, peer_id FROM federation_changelog WHERE job_id = $1 AND to_state = 'running' "
            "ORDER BY seq", job_id)
        assert [(r["epoch"], r["peer_id"]) for r in runs] == [(1, "gpu-west"), (3, "gpu-east")]
    finally:
        if alive(first_pid):  # never leave the test's own leftover behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first_pid, signal.SIGKILL)
