"""Gangs and nodes on a real Ray cluster (``ray_head``: a head with 2 CPUs and
``{"TPU": 4}``, and two alike worker raylets labelled ``slice=a``, 1 CPU each, all on
this host; tests/engines/fixtures.py), through the backend and, for a node dying under
a gang, through a federation of service processes (tests/e2e/conftest.py) whose
``tpu-east`` agent runs on the cluster.

The ray backend runs a gang as one Ray job whose driver places one task a node
(``STRICT_SPREAD`` placement group) and prints what happens; these tests look at the
tasks from outside (their own files: every node is this host) and at what the backend
reads back. Tasks that must stay alive wait for a file the test creates. A test that
kills a worker's raylet starts another like it when it ends, so every test finds the
cluster whole. Every wait is a bound on a hang of a busy machine, never an assertion on
time.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import (
    KILLED_EXIT_CODE,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    LaunchError,
    LiveRun,
    RunLost,
    RunSpec,
)
from irisfed.services.peer_agent.backends.ray import RayBackend
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.engines.ray import RayHead, RayWorker
from tests.e2e.conftest import federation  # noqa: F401 - the federation of service processes
from tests.infra.engine_peers import ray_engine, start_with_engine, unique_job_id
from tests.infra.probes import alive
from tests.infra.waiting import wait_for

TIMEOUT_S = 180.0
POLL_S = 0.5
SLICE = "slice"


@pytest.fixture
async def backend(ray_head: RayHead, tmp_path: Path):
    made = RayBackend(ray_head.address, tmp_path / "work", f"peer-{uuid.uuid4().hex[:6]}", poll_interval_s=POLL_S)
    yield made
    await made.close()


@pytest.fixture
def kill_worker(ray_head: RayHead):
    """``kill(node_ids)``: SIGKILL the raylet (by PID) of a worker running one of
    ``node_ids``; the worker is replaced by another like it when the test ends."""
    if ray_head.process is None:
        pytest.skip(f"killing a raylet needs a Ray cluster of this session's own, not {ray_head.address}")
    killed: list[RayWorker] = []

    def kill(node_ids) -> RayWorker:
        worker = next(worker for worker in ray_head.workers if worker.node_id in set(node_ids))
        worker.kill_raylet()
        killed.append(worker)
        return worker

    yield kill
    for worker in killed:
        ray_head.replace_worker(worker)


def task_script(folder: Path, then: str = "exit 0") -> list[str]:
    """Each task writes what it knows to ``folder/task-<i>`` (index, tasks, node,
    coordinator, job, epoch, its pid and ``$MINE``), waits for ``folder/release``, then
    runs ``then`` (shell; ``$IRISFED_TASK_INDEX`` is there)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = (
        'printf "%s\\n" "$IRISFED_TASK_INDEX" "$IRISFED_NUM_TASKS" "$IRISFED_NODE" "$IRISFED_COORDINATOR" '
        '"$IRISFED_JOB_ID" "$IRISFED_EPOCH" "$$" "$MINE" > "$1/task-$IRISFED_TASK_INDEX.tmp"; '
        'mv "$1/task-$IRISFED_TASK_INDEX.tmp" "$1/task-$IRISFED_TASK_INDEX"; '
        'echo "out of $IRISFED_TASK_INDEX"; echo "err of $IRISFED_TASK_INDEX" >&2; '
        f'while [ ! -e "$1/release" ]; do sleep 0.2; done; {then}'
    )
    return ["sh", "-c", script, "sh", str(folder)]


def seen(folder: Path, replicas: int) -> list[dict] | None:
    """What each task wrote, once all did."""
    found = []
    for index in range(replicas):
        path = folder / f"task-{index}"
        if not path.exists():
            return None
        index_, tasks, node, coordinator, job, epoch, pid, mine = path.read_text().split("\n")[:8]
        found.append({"index": int(index_), "tasks": int(tasks), "node": node, "coordinator": coordinator,
                      "job": job, "epoch": int(epoch), "pid": int(pid), "mine": mine})
    return found



async def started(handle) -> None:
    await asyncio.wait_for(handle.started.wait(), TIMEOUT_S)


async def gone(pids: list[int]) -> None:
    async def none_alive():
        return not any(alive(pid) for pid in pids) or None
    await wait_for(none_alive, f"processes {pids} to end", TIMEOUT_S, 0.2)


def all_nodes(ray_head: RayHead) -> set[str]:
    return {ray_head.node_id, *(worker.node_id for worker in ray_head.workers)}


async def test_a_gang_of_three_runs_one_task_a_node_each_knowing_its_place(
        ray_head: RayHead, backend: RayBackend, tmp_path: Path) -> None:
    if len(ray_head.workers) < 2:
        pytest.skip("needs a head and two workers of this session's own")
    folder = tmp_path / "tasks"
    spec = RunSpec(unique_job_id("three"), 4, task_script(folder, 'printf "last words of $IRISFED_TASK_INDEX"'),
                   env={"MINE": "$HOME ${HOME} 'q' `x`"}, resources={"cpu": 1}, replicas=3, start_timeout_s=120)

    handle = await backend.launch(spec)
    await started(handle)

    running = handle.tasks()
    assert [(t.index, t.state) for t in running] == [(i, TASK_RUNNING) for i in range(3)]
    assert {t.node for t in running} == all_nodes(ray_head)  # STRICT_SPREAD: one a node
    said = await wait_for(lambda: asyncio.to_thread(seen, folder, 3), "every task to say where it is", TIMEOUT_S)
    assert [(s["index"], s["tasks"], s["job"], s["epoch"], s["mine"]) for s in said] == [
        (i, 3, spec.job_id, 4, "$HOME ${HOME} 'q' `x`") for i in range(3)]
    assert [s["node"] for s in said] == [t.node for t in running]
    assert len({s["coordinator"] for s in said}) == 1 and said[0]["coordinator"].rsplit(":", 1)[1].isdigit()

    (folder / "release").touch()
    assert await handle.wait() == 0

    ended = handle.tasks()
    assert [(t.state, t.exit_code, t.node) for t in ended] == [(TASK_SUCCEEDED, 0, t.node) for t in running]
    for task in ended:
        assert task.log_path == str(Path(handle.log_dir) / f"task-{task.index}")
        assert (Path(task.log_path) / "stdout").read_text() == (
            f"out of {task.index}\nlast words of {task.index}")  # byte for byte: no newline added
        assert (Path(task.log_path) / "stderr").read_text() == f"err of {task.index}\n"
    assert "irisfed-gang end" in (Path(handle.log_dir) / "stdout").read_text()  # the whole job log, as for a job
    again = await backend.launch(spec)  # a second launch of the run is that run, never another
    assert await again.wait() == 0 and [t.node for t in again.tasks()] == [t.node for t in running]
    assert await ray_jobs_named(ray_head, f"irisfed-{spec.job_id}-e4") == 1


async def ray_jobs_named(ray_head: RayHead, submission_id: str) -> int:
    jobs = await asyncio.to_thread(ray_head.job_client().list_jobs)
    return sum(job.submission_id == submission_id for job in jobs)


async def test_group_by_keeps_a_gang_on_one_label_value_and_a_gang_that_cannot_start_in_time_is_lost(
        ray_head: RayHead, backend: RayBackend, tmp_path: Path) -> None:
    workers = {worker.node_id for worker in ray_head.workers if worker.spec.labels.get(SLICE) == "a"}
    if len(workers) < 2:
        pytest.skip("needs two workers labelled slice=a of this session's own")
    folder = tmp_path / "holder"
    holder = await backend.launch(RunSpec(unique_job_id("slice"), 1, task_script(folder), resources={"cpu": 1},
                                          replicas=2, group_by=SLICE, start_timeout_s=120))
    await started(holder)
    assert {t.node for t in holder.tasks()} == workers  # the head has no slice label

    # Both workers are taken: another gang of the slice waits in Ray, then is lost at its start timeout.
    late = await backend.launch(RunSpec(unique_job_id("late"), 1, ["true"], resources={"cpu": 1}, replicas=2,
                                        group_by=SLICE, start_timeout_s=5))
    with pytest.raises(RunLost, match="did not all start within 5s"):
        await asyncio.wait_for(late.wait(), TIMEOUT_S)
    assert not late.started.is_set()
    assert [t.state for t in late.tasks()] == ["pending", "pending"]  # the agent records them lost

    # More nodes than any slice has: refused before anything is submitted.
    with pytest.raises(LaunchError, match="needs 3 Ray nodes sharing one slice .* the cluster has 2"):
        await backend.launch(RunSpec(unique_job_id("wide"), 1, ["true"], resources={"cpu": 1}, replicas=3, group_by=SLICE))
    with pytest.raises(LaunchError, match="needs 2 Ray nodes that can each hold cpu=1, tpu=1; the cluster has 1"):
        await backend.launch(RunSpec(unique_job_id("tpus"), 1, ["true"], resources={"cpu": 1, "tpu": 1}, replicas=2))

    (folder / "release").touch()
    assert await holder.wait() == 0


async def test_one_task_failing_fails_the_gang_and_its_siblings_are_killed(
        ray_head: RayHead, backend: RayBackend, tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    script = task_script(folder)
    # Task 1 fails as soon as every task has said where it is; the others would wait for ever.
    script[2] = script[2].replace('while [ ! -e "$1/release" ]',
                                  'if [ "$IRISFED_TASK_INDEX" = 1 ]; then while [ ! -e "$1/task-0" ] || '
                                  '[ ! -e "$1/task-2" ]; do sleep 0.1; done; exit 3; fi; while [ ! -e "$1/release" ]')
    handle = await backend.launch(RunSpec(unique_job_id("broken"), 1, script, resources={"cpu": 1}, replicas=3))

    assert await asyncio.wait_for(handle.wait(), TIMEOUT_S) == 3

    said = seen(folder, 3)
    assert said is not None
    await gone([s["pid"] for s in said])  # the siblings were killed: nobody released them
    assert [(t.state, t.exit_code) for t in handle.tasks()] == [
        (TASK_KILLED, None), (TASK_FAILED, 3), (TASK_KILLED, None)]


async def test_killing_a_gang_kills_every_task(ray_head: RayHead, backend: RayBackend, tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    handle = await backend.launch(RunSpec(unique_job_id("kill"), 2, task_script(folder), resources={"cpu": 0.5},
                                          replicas=2))
    await started(handle)
    said = await wait_for(lambda: asyncio.to_thread(seen, folder, 2), "every task to start", TIMEOUT_S)

    await handle.kill(grace_s=5)

    assert await handle.wait() == KILLED_EXIT_CODE
    await gone([s["pid"] for s in said])
    assert [t.state for t in handle.tasks()] == [TASK_KILLED, TASK_KILLED]
    # A restarted agent adopts the ended gang as a gang: its tasks as the driver said.
    later = RayBackend(ray_head.address, backend.work_root, backend.peer_id, poll_interval_s=POLL_S)
    try:
        adopted = await later.adopt(LiveRun(handle.job_id, 2, ""))
        assert adopted is not None and await adopted.wait() == KILLED_EXIT_CODE
        assert [(t.state, t.node) for t in adopted.tasks()] == [(t.state, t.node) for t in handle.tasks()]
    finally:
        await later.close()


async def test_a_stopped_gangs_tasks_get_sigterm_and_their_grace(backend: RayBackend, tmp_path: Path) -> None:
    """docs/design.md §3.7: each task's command gets SIGTERM and the run's grace (its
    checkpoint takes longer than the driver's own 1 s and Ray's 3 s), the driver the
    grace and more from Ray."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    command = ["sh", "-c", 'cd "$1" && trap "sleep 6; echo checkpoint >> ckpt-$IRISFED_TASK_INDEX; exit 0" TERM; '
                           'touch "ready-$IRISFED_TASK_INDEX"; sleep 300 & wait', "sh", str(folder)]
    handle = await backend.launch(RunSpec(unique_job_id("grace"), 1, command, resources={"cpu": 0.5}, replicas=2,
                                          grace_s=10))
    await started(handle)
    await wait_for(lambda: asyncio.to_thread(lambda: all((folder / f"ready-{i}").exists() for i in range(2))),
                   "every task to trap SIGTERM", TIMEOUT_S, 0.2)

    await handle.kill(grace_s=10)

    assert await asyncio.wait_for(handle.wait(), TIMEOUT_S) == KILLED_EXIT_CODE
    assert [(folder / f"ckpt-{i}").read_text() for i in range(2)] == ["checkpoint\n"] * 2
    assert [t.state for t in handle.tasks()] == [TASK_KILLED, TASK_KILLED]


async def test_a_node_dying_under_a_gang_loses_the_run_and_kills_its_other_tasks(
        ray_head: RayHead, backend: RayBackend, kill_worker, tmp_path: Path) -> None:
    folder = tmp_path / "tasks"
    handle = await backend.launch(RunSpec(unique_job_id("doomed"), 1, task_script(folder), resources={"cpu": 1},
                                          replicas=2, group_by=SLICE))  # both workers: the head stays whole
    await started(handle)
    said = await wait_for(lambda: asyncio.to_thread(seen, folder, 2), "every task to start", TIMEOUT_S)

    dead = kill_worker([said[1]["node"]])

    with pytest.raises(RunLost, match=rf"task 1 on node {dead.node_id} failed in Ray \(NodeDiedError"):
        await asyncio.wait_for(handle.wait(), TIMEOUT_S)
    await gone([said[0]["pid"]])  # the task on the node still alive was killed
    assert [t.state for t in handle.tasks()] == [TASK_KILLED, TASK_LOST]
    assert "run lost: task 1" in (Path(handle.log_dir) / "stderr").read_text()
    (folder / "release").touch()  # the dead node's task lives on, orphaned on this host: let it end


async def test_discover_advertises_the_alive_nodes_grouped_with_their_labels(
        ray_head: RayHead, backend: RayBackend) -> None:
    if len(ray_head.workers) < 2:
        pytest.skip("knows the shape of this session's own cluster only")
    async def idle():  # the resource report lags a few seconds behind the last test's tasks
        found = await backend.discover()
        return found if len(found.nodes) == 2 else None

    found = await wait_for(idle, "the cluster to be idle: a group for the head, one for the workers", TIMEOUT_S, 1)
    assert found.resources["cpu"][0] == 2 + len(ray_head.workers)
    assert found.attributes == {"device_type": ["tpu"]}  # the cluster's, as before nodes
    shapes = sorted(((g["count"], g["attributes"], {name: r["total"] for name, r in g["resources"].items()})
                     for g in found.nodes), key=lambda shape: shape[0])
    head, workers = shapes
    assert head[0] == 1 and head[1] == {} and head[2]["cpu"] == 2 and head[2]["tpu"] == 4
    assert workers == (2, {SLICE: ["a"]}, {"cpu": 1, "memory_mb": 1024})  # alike workers: one group of 2
    for group in found.nodes:
        assert all(0 <= r["free"] <= r["total"] for r in group["resources"].values())


TPU = [{"key": "device_type", "op": "eq", "value": "tpu"}]


async def test_an_agent_requeues_a_gang_whose_node_died_and_it_runs_again_whole_once(
        federation, ray_head: RayHead, kill_worker, tmp_path: Path) -> None:  # noqa: F811
    engine = ray_engine(ray_head)
    await start_with_engine(federation, engine)
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    ledger.touch()
    # Each task notes "epoch index node pid"; the first run's tasks then wait (for ever:
    # until the test ends), a later run's end at once.
    command = ["sh", "-c", 'echo "$IRISFED_EPOCH $IRISFED_TASK_INDEX $IRISFED_NODE $$" >> "$0"; '
               'if [ "$IRISFED_EPOCH" = 1 ]; then while [ ! -e "$1" ]; do sleep 0.2; done; fi',
               str(ledger), str(release)]
    job = unique_job_id("requeued")
    try:
        reply = await federation.submit({"job_id": job, "command": command, "replicas": 2, "resources": {"cpu": 1},
                                         "constraints": TPU, "max_retries": 1})
        assert reply["disposition"] == "queue", reply

        async def first_run_started():
            rows = [r for r in await federation.store.job_tasks_list(job) if r.epoch == 1]
            return rows if len(rows) == 2 and all(r.state == TASK_RUNNING and r.node for r in rows) else None

        rows = await wait_for(first_run_started, "the gang's two tasks to run, their nodes recorded", TIMEOUT_S, 0.25)
        assert len({r.node for r in rows}) == 2  # one task a node
        dead = kill_worker([r.node for r in rows])

        done = await federation.wait_state(job, *TERMINAL_STATES, timeout=TIMEOUT_S)
        history = [(r.from_state, r.to_state, r.epoch, r.detail) for r in
                   await federation.store.changelog_list_for_job(job)]
        assert (done.state, done.owner_peer_id) == ("succeeded", engine.peer_id), history
        lost = [(old, new) for old, new, _epoch, detail in history if detail.startswith("run lost: task")]
        assert lost == [("running", "queued")], history  # handed back whole, once
        runs: dict[int, list[tuple[int, str]]] = {}
        for line in ledger.read_text().splitlines():
            epoch, index, node, _pid = line.split()
            runs.setdefault(int(epoch), []).append((int(index), node))
        assert sorted(runs) == [1, done.epoch]  # two runs, each whole
        assert all(sorted(index for index, _ in tasks) == [0, 1] for tasks in runs.values())
        assert dead.node_id not in {node for _, node in runs[done.epoch]}  # on nodes alive
        tasks = {(r.epoch, r.task_index): r for r in await federation.store.job_tasks_list(job)}
        assert sorted(tasks[(1, i)].state for i in (0, 1)) == [TASK_KILLED, TASK_LOST]
        assert [tasks[(done.epoch, i)].state for i in (0, 1)] == [TASK_SUCCEEDED, TASK_SUCCEEDED]
    finally:
        release.touch()  # the first run's task on the dead node lives on, orphaned on this host
