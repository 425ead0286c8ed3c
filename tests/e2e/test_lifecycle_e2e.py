"""The whole lifecycle through real router, tick and agent subprocesses."""

import os

import pytest

pytestmark = pytest.mark.e2e


async def test_plain_nats_submit_runs_locally_and_logs_are_visible(federation):
    await federation.start_federation("home")
    # A producer with no irisfed code: raw JSON over nats-py request/reply.
    reply = await federation.submit({"command": ["sh", "-c", "echo hello from irisfed"]})
    assert reply["disposition"] == "local"
    assert reply["state"] == "assigned" and reply["peer_id"] == "home"
    assert reply["duplicate"] is False
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    assert job["state"] == "succeeded" and job["exit_code"] == 0 and job["owner_peer_id"] == "home"
    logs = federation.cli("logs", reply["job_id"])
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == "hello from irisfed\n"


async def test_gpu_job_queues_to_the_gpu_peer_and_pin_wins(federation):
    await federation.start_federation("home", "gpu-west", "tpu-east")
    gpu = await federation.submit({"command": ["true"], "constraints": [
        {"key": "device_type", "op": "eq", "value": "gpu"}]})
    assert (gpu["disposition"], gpu["state"], gpu["peer_id"]) == ("queue", "queued", "")
    pinned = await federation.submit({"command": ["true"], "cluster_pin": "gpu-west", "constraints": [
        {"key": "device_type", "op": "eq", "value": "tpu"}]})
    assert (pinned["disposition"], pinned["peer_id"]) == ("queue", "gpu-west")
    for reply in (gpu, pinned):
        job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
        assert (job["state"], job["owner_peer_id"]) == ("succeeded", "gpu-west")


async def test_pinned_job_waits_for_its_peer_then_runs(federation):
    await federation.start_federation("home", "gpu-west")
    pinned = await federation.submit({"command": ["true"], "cluster_pin": "tpu-east", "priority": 9})
    assert pinned["disposition"] == "queue"
    # A later, lower-priority queued job placed and finished proves the tick has
    # passed over the pinned job (claimed first) and left it waiting.
    later = await federation.submit({"command": ["true"], "constraints": [
        {"key": "device_type", "op": "eq", "value": "gpu"}]})
    assert (await federation.wait_state(later["job_id"], "succeeded"))["owner_peer_id"] == "gpu-west"
    job = await federation.job(pinned["job_id"])
    assert job["state"] == "queued" and job["owner_peer_id"] is None
    federation.start("tpu-east")
    job = await federation.wait_state(pinned["job_id"], "succeeded", "failed")
    assert (job["state"], job["owner_peer_id"]) == ("succeeded", "tpu-east")


async def test_no_peer_can_host_is_rejected_with_reasons(federation):
    await federation.start_federation("home", "gpu-west")
    reply = await federation.submit({"command": ["true"], "constraints": [
        {"key": "device_type", "op": "eq", "value": "fpga"}]})
    assert reply["disposition"] == "reject" and reply["state"] == "rejected"
    reasons = {v["peer_id"]: v["code"] for v in reply["verdicts"]}
    assert reasons == {"home": "value_mismatch", "gpu-west": "value_mismatch", "tpu-east": "unreachable",
                       "gpu-east": "unreachable"}
    assert "fpga" in reply["reason"]
    history = await federation.store.changelog_list_for_job(reply["job_id"])
    assert [r["to_state"] for r in history] == ["rejected"]


async def test_failing_command_records_exit_code(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sh", "-c", "exit 7"]})
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    assert (job["state"], job["exit_code"]) == ("failed", 7)
    assert job["attempts"] == 1  # a user failure is not retried


async def test_cancel_running_job_kills_the_process(federation):
    await federation.start_federation("home")
    reply = await federation.submit({"command": ["sleep", "300"]})
    job = await federation.wait_state(reply["job_id"], "running")
    pid = await federation.run_pid(job["job_id"])
    os.kill(pid, 0)  # really running
    cancel = await federation.cancel(reply["job_id"])
    assert cancel["outcome"] == "kill_sent" and cancel["state"] == "running"
    job = await federation.wait_state(reply["job_id"], "killed")
    assert job["cancel_requested"] is True
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    again = await federation.cancel(reply["job_id"])
    assert again["outcome"] == "already_finished"


async def test_cancel_before_start_means_never_started(federation):
    await federation.start_federation()  # no agents: the job can only wait
    reply = await federation.submit({"command": ["true"], "cluster_pin": "gpu-west"})
    cancel = await federation.cancel(reply["job_id"])
    assert (cancel["outcome"], cancel["state"]) == ("never_started", "killed")
    federation.start("gpu-west")
    await federation.wait_agent("gpu-west")
    job = await federation.job(reply["job_id"])
    assert job["state"] == "killed" and job["started_at"] is None
    missing = await federation.cancel("no-such-job")
    assert missing["error"]["code"] == "not_found"


async def test_duplicate_and_conflict(federation):
    await federation.start_federation("home")
    body = {"job_id": "train-42", "command": ["true"], "priority": 3}
    first = await federation.submit(body)
    again = await federation.submit(body)
    assert again == {**first, "duplicate": True}
    conflict = await federation.submit({**body, "priority": 4})
    assert conflict["error"]["code"] == "conflict"
    count = await federation.store.db.fetchval("SELECT count(*) FROM jobs")
    assert count == 1


async def test_agent_restart_picks_assigned_work_up_from_postgres(federation):
    await federation.start_federation("home")
    federation.kill("home")
    # Local jobs are judged on home's advertised shape: still LOCAL, assigned at once,
    # while nobody listens on assign.home.
    reply = await federation.submit({"command": ["sh", "-c", "echo recovered"]})
    assert reply["disposition"] == "local" and reply["state"] == "assigned"
    federation.start("home")
    job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
    assert job["state"] == "succeeded"


async def test_router_restart_between_submits_loses_nothing(federation):
    await federation.start_federation("home")
    first = await federation.submit({"command": ["true"]})
    federation.kill("router")
    federation.start("router")
    second = await federation.submit({"command": ["true"]})
    for reply in (first, second):
        job = await federation.wait_state(reply["job_id"], "succeeded", "failed")
        assert job["state"] == "succeeded"


async def test_bad_input_gets_errors_and_writes_nothing(federation):
    await federation.start_federation()
    cases = [
        b"{not json",
        b'{"command": ["x"], "cluster-pin": "gpu-west"}',
        b'{"command": ["x"], "constraints": [{"key": "k", "op": "gt", "value": "big"}]}',
        b'{"command": ["x"], "cluster_pin": "mars"}',
        b'{"command": ["x"], "job_id": "bad id!"}',
        b'{"command": "x" }',
        b'{"command": ["' + b"x" * 70_000 + b'"]}',
    ]
    codes = []
    for body in cases:
        reply = await federation.submit(body)
        codes.append(reply["error"]["code"])
        assert reply["error"]["message"]
    assert codes == ["invalid_request"] * 3 + ["unknown_peer"] + ["invalid_request"] * 3
    assert await federation.store.db.fetchval("SELECT count(*) FROM jobs") == 0
    assert await federation.store.db.fetchval("SELECT count(*) FROM federation_changelog") == 0
