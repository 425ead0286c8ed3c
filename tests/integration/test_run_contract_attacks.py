"""Hostile review of the run contract (docs/design.md §3.6–3.7) against real servers and
real processes, no services as subprocesses:

- forged contract fields on a real router are refused and write nothing;
- a user's credentials reach its own ``P.uevents.<user>.>`` and nothing wider (real
  nats-server with the generated permissions), and a job id holding '.' stays inside it;
- the subprocess backend's stops and device indices under jobs that fight back
  (children ignoring SIGTERM, grace 0, a leftover whose pid was never learned, two
  launches racing for the last index, a job naming its own CUDA_VISIBLE_DEVICES, a
  run whose leader exits and leaves a child behind);
- a replayed report of a failing run spends no second failure retry, and a stale
  hand-back after it spends no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest

from irisfed.services.common.bus import publish_event
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.backends import LaunchError, LocalNodes, RunSpec, SubprocessBackend
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import JobEvent
from irisfed.shared.retry import retries_used
from irisfed.shared.subjects import Subjects
from irisfed.tooling.engines.procs import group_members
from irisfed.tooling.servers import start_secured_nats
from tests.infra.factories import (
    assign_jobs,
    insert_jobs,
    make_job,
    preempt,
    running_job,
    start_jobs,
)
from tests.infra.probes import alive

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SHOW = ["sh", "-c", 'echo "${CUDA_VISIBLE_DEVICES-unset};${TPU_VISIBLE_CHIPS-unset}" > out']


def seen(root: Path, job_id: str, epoch: int = 1) -> tuple[str, str]:
    devices, chips = (root / job_id / f"epoch-{epoch}" / "out").read_text().strip().split(";")
    return devices, chips


@pytest.fixture
def groups():
    """Process groups (by their leader's pid) the test started; SIGKILLed at its end."""
    started: list[int] = []
    yield started
    for pgid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------- forged submits on a real router


FORGED = [
    {"grace_s": 601}, {"grace_s": -1}, {"grace_s": "30"}, {"grace_s": True}, {"grace_s": 1e300},
    {"time_limit_s": 0}, {"time_limit_s": -1}, {"time_limit_s": "2h"}, {"time_limit_s": False},
    {"time_limit_s": 31_536_001},
    {"max_failure_retries": 101}, {"max_failure_retries": -1}, {"max_failure_retries": 1.5},
    {"max_failure_retries": "1"}, {"max_failure_retries": True}, {"max_failure_retries": 2**70},
    {"max_failure_retries": None},
]


@pytest.mark.parametrize("fields", FORGED, ids=lambda f: f"{next(iter(f))}={next(iter(f.values()))!r}")
def test_a_forged_contract_field_is_refused_naming_it_and_writes_nothing(router, fields):
    body = json.dumps({"command": ["true"], "job_id": "forged", **fields}).encode()
    reply = router.request("submit", body)
    assert set(reply) == {"error"} and reply["error"]["code"] == "invalid_request", reply
    message = reply["error"]["message"]
    assert next(iter(fields)) in message and "\n" not in message, message
    assert router.rows() == 0
    # Its dry run too: refused the same way, nothing written.
    dry = router.request("submit", json.dumps({"command": ["true"], "dry_run": True, **fields}).encode())
    assert dry["error"]["code"] == "invalid_request"
    assert router.rows() == 0


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_on_the_wire_are_refused_and_write_nothing(router, token):
    for field in ("grace_s", "time_limit_s", "max_failure_retries"):
        body = f'{{"command": ["true"], "job_id": "nan", "{field}": {token}}}'.encode()
        reply = router.request("submit", body)
        assert reply["error"]["code"] == "invalid_request", reply
        assert "not valid JSON" in reply["error"]["message"]
    assert router.rows() == 0


def test_the_bounds_are_accepted_and_stored_as_sent(router):
    reply = router.request("submit", json.dumps({"command": ["true"], "job_id": "edges", "grace_s": 600,
                                                 "time_limit_s": 31_536_000, "max_failure_retries": 100,
                                                 "cluster_pin": "home"}).encode())
    assert reply.get("job_id") == "edges", reply
    spec = json.loads(router.run(router.pool.fetchval("SELECT spec::text FROM jobs WHERE job_id = 'edges'")))
    assert (spec["grace_s"], spec["time_limit_s"], spec["max_failure_retries"]) == (600, 31_536_000, 100)
    # The same id with another grace is another job: a conflict, never a silent duplicate.
    other = router.request("submit", json.dumps({"command": ["true"], "job_id": "edges", "grace_s": 599,
                                                 "time_limit_s": 31_536_000, "max_failure_retries": 100,
                                                 "cluster_pin": "home"}).encode())
    assert other["error"]["code"] == "conflict", other


# ---------------------------------------------------------------- per-user event subjects


@pytest.fixture
def secured_nats(tmp_path):
    server, auth = start_secured_nats(tmp_path / "nats", "irisfed", ("home",), auth_dir=tmp_path / "auth",
                                      user_ids=("alice", "bob"))
    yield auth, server
    server.stop()


async def _connect(auth, server, role, errors):
    async def on_error(exc):
        errors.append(str(exc))
    return await nats.connect(auth.url(server.url, role), error_cb=on_error, allow_reconnect=False)


async def _until(predicate, timeout: float = 10.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout=timeout)


@pytest.mark.parametrize("wider", [
    "irisfed.uevents.bob.>", "irisfed.uevents.bob.x", "irisfed.uevents.>", "irisfed.uevents.*.x",
    "irisfed.uevents.*.>", "irisfed.uevents.*", "irisfed.>", ">", "irisfed.events.*", "irisfed.events.>",
])
async def test_a_user_cannot_subscribe_to_other_users_events(secured_nats, wider):
    auth, server = secured_nats
    errors: list[str] = []
    alice = await _connect(auth, server, "user-alice", errors)
    try:
        await alice.subscribe(wider)
        await alice.flush()
        await _until(lambda: errors)
        assert any("subscription" in e and wider in e for e in errors), errors
    finally:
        await alice.close()


async def test_a_dotted_job_id_stays_inside_its_users_subjects(secured_nats):
    """alice's job 'x.y' is published on irisfed.uevents.alice.x~y (one token:
    shared.subjects.job_token): alice hears it (on her '>' and on its exact subject), bob
    hears nothing, and alice's exact subscription to her job 'x' does not pick up 'x.y'."""
    auth, server = secured_nats
    errors: list[str] = []
    agent = await _connect(auth, server, "agent-home", errors)
    alice = await _connect(auth, server, "user-alice", errors)
    bob = await _connect(auth, server, "user-bob", errors)
    heard: dict[str, list[str]] = {"alice-all": [], "alice-exact": [], "alice-x": [], "bob": []}

    def into(name):
        async def on(msg):
            heard[name].append(msg.subject)
        return on

    try:
        await alice.subscribe("irisfed.uevents.alice.>", cb=into("alice-all"))
        await alice.subscribe("irisfed.uevents.alice.x~y", cb=into("alice-exact"))
        await alice.subscribe("irisfed.uevents.alice.x", cb=into("alice-x"))
        await bob.subscribe("irisfed.uevents.bob.>", cb=into("bob"))
        await alice.flush()
        await bob.flush()
        event = JobEvent("alice:x.y", "running", "home", 1, datetime.now(UTC), reason="running on home/main")
        await publish_event(agent, Subjects("irisfed"), event)
        await agent.flush()
        await _until(lambda: heard["alice-all"] and heard["alice-exact"])
        await asyncio.sleep(0.2)
        assert heard == {"alice-all": ["irisfed.uevents.alice.x~y"], "alice-exact": ["irisfed.uevents.alice.x~y"],
                         "alice-x": [], "bob": []}
    finally:
        for client in (agent, alice, bob):
            await client.close()


async def test_an_agent_may_publish_the_operator_event_of_a_dotted_job_id(secured_nats):
    auth, server = secured_nats
    errors: list[str] = []
    agent = await _connect(auth, server, "agent-home", errors)
    try:
        event = JobEvent("alice:x.y", "running", "home", 1, datetime.now(UTC))
        await publish_event(agent, Subjects("irisfed"), event)
        await agent.flush()
        await asyncio.sleep(0.5)
        assert errors == []
    finally:
        await agent.close()


# ---------------------------------------------------------------- the subprocess backend's stops


@linux_only
async def test_sigterm_trapped_by_the_leader_and_ignored_by_its_children_leaves_nothing_alive(tmp_path, groups):
    backend = SubprocessBackend(tmp_path, LocalNodes((), {"cpu": 4}))
    # The leader checkpoints and exits on SIGTERM; its two children ignore SIGTERM.
    script = ("trap 'echo checkpoint > ckpt; exit 0' TERM; "
              "(trap '' TERM; exec sleep 300) & (trap '' TERM; exec sleep 300) & "
              "echo started > started; while true; do sleep 0.1; done")
    run = await backend.launch(RunSpec("fights", 1, ["sh", "-c", script], grace_s=30))
    groups.append(run.process.pid)
    started = tmp_path / "fights" / "epoch-1" / "started"
    await _until(lambda: started.exists())
    await _until(lambda: len(group_members(run.process.pid)) >= 3)
    began = time.monotonic()
    await run.kill(30)
    assert time.monotonic() - began < 10  # the leader's exit ends the wait, not the grace
    assert (tmp_path / "fights" / "epoch-1" / "ckpt").read_text().strip() == "checkpoint"
    assert run.process.returncode == 0
    await _until(lambda: not group_members(run.process.pid))


@linux_only
async def test_grace_zero_is_sigkill_at_once(tmp_path, groups):
    backend = SubprocessBackend(tmp_path, LocalNodes((), {"cpu": 4}))
    script = "trap 'sleep 5; exit 0' TERM; echo started > started; while true; do sleep 0.1; done"
    run = await backend.launch(RunSpec("nograce", 1, ["sh", "-c", script], grace_s=0))
    groups.append(run.process.pid)
    await _until(lambda: (tmp_path / "nograce" / "epoch-1" / "started").exists())
    began = time.monotonic()
    await run.kill(0)
    assert time.monotonic() - began < 3
    assert run.process.returncode == -signal.SIGKILL
    await _until(lambda: not group_members(run.process.pid))  # SIGKILLed children: gone once reaped


@linux_only
async def test_a_run_whose_leader_exits_leaves_no_process_on_its_gpu(tmp_path, groups):
    backend = SubprocessBackend(tmp_path, LocalNodes((), {"cpu": 4, "gpu": 1}))
    first = await backend.launch(RunSpec("trainer", 1, ["sh", "-c", "sleep 300 & echo $! > child; exit 1"],
                                         resources={"cpu": 1, "gpu": 1}))
    groups.append(first.process.pid)
    assert await first.wait() == 1
    child = int((tmp_path / "trainer" / "epoch-1" / "child").read_text())
    # The failure retry, under the next epoch, on the one GPU.
    second = await backend.launch(RunSpec("trainer", 2, SHOW, resources={"cpu": 1, "gpu": 1}))
    assert await second.wait() == 0
    assert seen(tmp_path, "trainer", 2)[0] == "0"
    assert not alive(child), "the failed run's child still runs (on GPU 0) beside its retry"


# ---------------------------------------------------------------- device indices


@linux_only
async def test_two_launches_racing_for_the_last_gpu_get_it_once(tmp_path, groups):
    backend = SubprocessBackend(tmp_path, LocalNodes((), {"cpu": 8, "gpu": 2}))
    holder = await backend.launch(RunSpec("holder", 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 1}))
    groups.append(holder.process.pid)
    racers = await asyncio.gather(*(backend.launch(RunSpec(name, 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 1}))
                                    for name in ("a", "b")), return_exceptions=True)
    won = [r for r in racers if not isinstance(r, BaseException)]
    lost = [r for r in racers if isinstance(r, BaseException)]
    groups.extend(r.process.pid for r in won)
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], LaunchError), racers
    assert sorted(backend.nodes.nodes[0].held["gpu"]) == [0, 1]
    for run in (holder, *won):
        await run.kill(1.0)
    assert not backend.nodes.nodes[0].held["gpu"]


@linux_only
async def test_a_job_cannot_pick_its_own_devices_through_its_env(tmp_path):
    backend = SubprocessBackend(tmp_path, LocalNodes((), {"cpu": 8, "gpu": 2, "tpu": 2}))
    own = {"CUDA_VISIBLE_DEVICES": "0,1", "TPU_VISIBLE_CHIPS": "0,1"}
    asks = await backend.launch(RunSpec("asks", 1, SHOW, env=own, resources={"cpu": 1, "gpu": 1, "tpu": 1}))
    none = await backend.launch(RunSpec("none", 1, SHOW, env=own, resources={"cpu": 1}))
    assert await asks.wait() == 0 and await none.wait() == 0
    assert seen(tmp_path, "asks") == ("0", "0")
    assert seen(tmp_path, "none") == ("", "")  # asked none: may use none, whatever it says


@linux_only
async def test_a_leftover_whose_pid_was_never_recorded_still_holds_its_gpu(tmp_path, groups):
    """The agent died between marking a run live and learning its pid (record pid 0): the
    next agent finds the process by its environment and must not hand its GPU out."""
    nodes = LocalNodes((), {"cpu": 4, "gpu": 1})
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME")},
           "IRISFED_JOB_ID": "half", "IRISFED_EPOCH": "1"}
    process = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    groups.append(process.pid)
    try:
        index = tmp_path / ".live"
        index.mkdir()
        (index / "half.epoch-1.json").write_text(json.dumps({
            "job_id": "half", "epoch": 1, "pid": 0, "start_ticks": 0, "boot_id": "", "task": -1,
            "node": nodes.nodes[0].name, "devices": {"gpu": [0]}}))
        later = SubprocessBackend(tmp_path, nodes)
        with pytest.raises(LaunchError, match="gpu"):
            await later.launch(RunSpec("next", 1, SHOW, resources={"cpu": 1, "gpu": 1}))
        assert [r.job_id for r in await later.list_runs()] == ["half"]
    finally:
        process.kill()
        process.wait()


# ---------------------------------------------------------------- failure-retry accounting in SQL


async def test_a_replayed_report_of_a_failing_run_spends_one_failure_retry(pool):
    """The report of a failing run is retried after a lost reply (the agent cannot know
    its first try committed): the replay moves nothing, and a stale hand-back of that
    same run (a restarted agent's orphan recovery) neither moves it nor counts a restart."""
    store = Store(pool)
    job_id = await running_job(store, "gpu-west", max_failure_retries=2, max_retries=0)
    moved = await store.job_finish_batch("gpu-west", [(job_id, 1, 1, False)])
    assert moved[job_id].state == "queued"
    assert await store.job_finish_batch("gpu-west", [(job_id, 1, 1, False)]) == {}
    assert await store.job_finish_batch("gpu-west", [(job_id, 1, 0, False)]) == {}  # nor another outcome
    assert await store.job_end_run("gpu-west", job_id, 1, JobState.QUEUED, "agent restarted", None,
                                   no_fault=True) is None
    row = await store.job_get(job_id)
    assert (row.state, row.epoch, row.failures, row.restarts, row.attempts) == ("queued", 2, 1, 0, 1)
    epochs = [r["epoch"] for r in await pool.fetch(
        "SELECT epoch FROM federation_changelog WHERE job_id = $1 AND to_state = 'running'", job_id)]
    assert epochs == [1]  # one run so far, under one epoch


@pytest.mark.parametrize("job_id", ["x.", "x..y"])
async def test_a_user_hears_the_events_of_every_id_it_may_submit(secured_nats, job_id):
    auth, server = secured_nats
    errors: list[str] = []
    agent = await _connect(auth, server, "agent-home", errors)
    alice = await _connect(auth, server, "user-alice", errors)
    heard: list[str] = []

    async def on(msg):
        heard.append(json.loads(msg.data)["job_id"])

    try:
        await alice.subscribe("irisfed.uevents.alice.>", cb=on)
        await alice.flush()
        await publish_event(agent, Subjects("irisfed"), JobEvent(f"alice:{job_id}", "running", "home", 1,
                                                                 datetime.now(UTC)))
        await agent.flush()
        await _until(lambda: heard, timeout=30)  # heard at once; a slow machine is given time
        assert heard == [job_id], errors
    finally:
        await agent.close()
        await alice.close()


async def test_a_preempted_run_that_then_exits_non_zero_spends_no_failure_retry(pool):
    """Preemption sends SIGTERM; the victim's run then exits 143 and reports it under its old
    epoch: refused (the job moved on), so no failure retry is spent and no retry counted;
    its next run, failing, is the one failure retry it has."""
    store = Store(pool)
    victim = make_job(band="batch", max_failure_retries=1, max_retries=0)
    urgent = make_job()
    await insert_jobs(store, [victim, urgent])
    await assign_jobs(store, [victim], "gpu-west")
    assert victim.job_id in await start_jobs(store, [victim], "gpu-west")
    await preempt(store, [victim], urgent)
    assert await store.job_finish_batch("gpu-west", [(victim.job_id, 1, 143, False)]) == {}
    row = await store.job_get(victim.job_id)
    assert (row.state, row.failures, row.restarts, row.preemptions) == ("queued", 0, 0, 1)
    # Placed again (epoch 3 after the preemption's 2) and failing: its one failure retry.
    async with store.transaction() as tx:
        await tx.job_assign_batch([(victim.job_id, row.epoch, "gpu-west", "main")])
    epoch = row.epoch + 1
    assert victim.job_id in await store.job_start_batch("gpu-west", [(victim.job_id, epoch, None, "running")])
    moved = await store.job_finish_batch("gpu-west", [(victim.job_id, epoch, 1, False)])
    assert moved[victim.job_id].reason == "exit code 1; running again (failure retry 1 of 1)"
    row = await store.job_get(victim.job_id)
    assert (row.attempts, row.failures, row.preemptions) == (2, 1, 1)
    assert retries_used(row.attempts, row.preemptions, row.failures + row.restarts) == 0
