"""Gangs on a real Slurm (services/peer_agent/backends/slurm.py; docs/engines.md, "Gangs
and nodes on Slurm"): the backend alone, then a federation (router, tick and a peer
agent in front of the cluster, as processes; tests/e2e/conftest.py's ``federation``).

The session's cluster has a partition of several nodes, each its own slurmd on this
host (``SlurmCluster.gang_partition``: gn1 and gn2 with feature ``rack:a``, gn3 with
``rack=b,ssd``; 2 CPUs, 4096 MB and 2 GPUs each). Each test has a peer id of its own,
and waits for its gangs to end, so the next finds the nodes free. Timeouts bound a
hang; nothing here is timed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import (
    KILLED_EXIT_CODE,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_SUCCEEDED,
    LaunchError,
    LiveRun,
    RunLost,
    RunSpec,
)
from irisfed.services.peer_agent.backends.slurm import SlurmBackend
from irisfed.services.peer_agent.backends.slurm_nodes import (
    feature_attribute,
    parse_features,
    parse_gres,
)
from irisfed.services.peer_agent.backends.slurm_text import (
    EXIT_STATUS_FILE,
    STARTED_MARKER,
    job_name,
)
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.engines.slurm import SlurmCluster
from irisfed.tooling.federation import Peer
from tests.e2e.conftest import federation  # noqa: F401 - the federation of service processes
from tests.engines.fixtures import _unavailable
from tests.infra.slurm_runs import (
    JOB_TIMEOUT_S,
    eventually,
    in_environment,
    run_ended,
    slurm_backends,
    slurm_job,
)
from tests.infra.waiting import wait_for

# A gang takes ~3 s (JOB_TIMEOUT_S bounds a hang). Each task: prints what it was told,
# then task 0 listens on the coordinator's port and reads one line, which task 1
# (retrying until task 0 listens) sends it.
RENDEZVOUS = r"""
import json, os, socket, sys, time
env = {k: v for k, v in os.environ.items() if k.startswith("IRISFED_")}
print(json.dumps(env), flush=True)
host, port = env["IRISFED_COORDINATOR"].rsplit(":", 1)
if env["IRISFED_TASK_INDEX"] == "0":
    with socket.create_server((host, int(port))) as server:
        server.settimeout(120)
        conn, _ = server.accept()
        print("heard:", conn.makefile().readline().strip(), flush=True)
else:
    for _ in range(600):
        try:
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(f"hello from {env['IRISFED_TASK_INDEX']} on {env['IRISFED_NODE']}\n".encode())
                break
        except OSError:
            time.sleep(0.2)
    else:
        sys.exit("task 0 never listened")
"""


@pytest.fixture
def gangs_cluster(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The session's cluster, in the environment; it must have a partition of several nodes."""
    if not slurm_cluster.gang_partition:
        _unavailable("the given Slurm cluster has no partition of two nodes or more (gangs)")
    return in_environment(slurm_cluster, monkeypatch)


@pytest.fixture
async def make_backend(gangs_cluster: SlurmCluster, tmp_path: Path) -> AsyncIterator[Callable[..., SlurmBackend]]:
    """New SlurmBackend objects (an agent run each) on the gang partition and one work
    folder, all of one peer; all closed at the end."""
    async with slurm_backends(tmp_path / "work", f"peer-{uuid.uuid4().hex[:8]}",
                              gangs_cluster.gang_partition) as make:
        yield make


@pytest.fixture
def backend(make_backend: Callable[..., SlurmBackend]) -> SlurmBackend:
    return make_backend()


def _gang(command: list[str], replicas: int = 2, **kwargs) -> RunSpec:
    kwargs.setdefault("resources", {"cpu": 1, "memory_mb": 256})
    return RunSpec(f"gang-{uuid.uuid4().hex[:8]}", 1, command, replicas=replicas, **kwargs)


def _hostnames(cluster: SlurmCluster, hostlist: str) -> list[str]:
    return cluster.run("scontrol", "show", "hostnames", hostlist).split()


def _jobs_named(cluster: SlurmCluster, spec: RunSpec) -> list[str]:
    return cluster.run("squeue", "-h", "-t", "all", "-n", job_name(spec.job_id, spec.epoch), "-o", "%i").split()


def _steps_of(cluster: SlurmCluster, slurm_id: str) -> str:
    return cluster.run("squeue", "-h", "-s", "-j", slurm_id, "-o", "%i", check=False).strip()


# ---------------------------------------------------------------- running


async def test_a_two_task_gang_is_one_slurm_job_with_a_task_on_each_node_that_meet_at_the_coordinator(
    backend: SlurmBackend, gangs_cluster: SlurmCluster,
) -> None:
    spec = _gang(["python3", "-c", RENDEZVOUS])
    handle = await backend.launch(spec)
    await asyncio.wait_for(handle.started.wait(), JOB_TIMEOUT_S)

    assert await run_ended(handle) == 0
    assert _jobs_named(gangs_cluster, spec) == [handle.slurm_id]  # one Slurm job ...
    job = slurm_job(gangs_cluster, handle.slurm_id)
    assert (job["JobState"], job["NumNodes"], job["NumTasks"]) == ("COMPLETED", "2", "2"), job  # ... of two tasks
    nodes = _hostnames(gangs_cluster, job["NodeList"])
    tasks = handle.tasks()
    assert [(t.index, t.node, t.state, t.exit_code) for t in tasks] == [
        (0, nodes[0], TASK_SUCCEEDED, 0), (1, nodes[1], TASK_SUCCEEDED, 0)]
    assert len(set(nodes)) == 2  # each task on a node of its own
    seen = []
    for task in tasks:
        folder = Path(task.log_path)
        assert folder == Path(handle.log_dir) / f"task-{task.index}"
        assert (folder / STARTED_MARKER).read_text() == f"{task.node}\n"
        assert (folder / EXIT_STATUS_FILE).read_text() == "0\n"
        seen.append(json.loads((folder / "stdout").read_text().splitlines()[0]))
    assert [(s["IRISFED_TASK_INDEX"], s["IRISFED_NUM_TASKS"], s["IRISFED_NODE"]) for s in seen] == [
        ("0", "2", nodes[0]), ("1", "2", nodes[1])]
    assert {(s["IRISFED_JOB_ID"], s["IRISFED_EPOCH"], s["IRISFED_COORDINATOR"]) for s in seen} == {
        (spec.job_id, "1", seen[0]["IRISFED_COORDINATOR"])}  # one coordinator for all
    heard = (Path(tasks[0].log_path) / "stdout").read_text().splitlines()[-1]
    assert heard == f"heard: hello from 1 on {nodes[1]}"


async def test_group_by_keeps_a_gang_on_nodes_sharing_one_value(
    backend: SlurmBackend, gangs_cluster: SlurmCluster,
) -> None:
    """Partition ``gang``: rack a has two nodes, rack b one. Two tasks grouped by rack can
    only run on rack a; grouped by a plain feature (``ssd``: one node), never."""
    features = {name: parse_features(gangs_cluster.node(name).get("AvailableFeatures", ""))
                for name in gangs_cluster.gang_nodes}
    racks = Counter(value for listed in features.values() for key, value in map(feature_attribute, listed)
                    if key == "rack")
    if not racks or max(racks.values()) < 2:
        pytest.skip("the gang partition has no two nodes sharing a rack:VALUE feature")
    spec = _gang(["sh", "-c", "exit 0"], group_by="rack")

    handle = await backend.launch(spec)

    assert await run_ended(handle) == 0
    job = slurm_job(gangs_cluster, handle.slurm_id)
    assert job["Features"] == "[" + "|".join(sorted({f for listed in features.values() for f in listed
                                                     if feature_attribute(f)[0] == "rack"})) + "]", job
    nodes = _hostnames(gangs_cluster, job["NodeList"])
    assert len({feature_attribute(f)[1] for node in nodes for f in features[node]
                if feature_attribute(f)[0] == "rack"}) == 1, (nodes, features)
    with pytest.raises(LaunchError, match="the gang needs 2 nodes .* sharing one feature .* at most 1"):
        await backend.launch(_gang(["true"], group_by="feature"))
    with pytest.raises(LaunchError, match="the gang needs 4 nodes .* at most 3"):
        await backend.launch(_gang(["true"], replicas=4))


async def test_a_task_exiting_1_fails_the_gang_and_slurm_ends_its_sibling(
    backend: SlurmBackend, gangs_cluster: SlurmCluster,
) -> None:
    # Task 0 runs until Slurm ends it (and says so); task 1 fails once task 0 is ready.
    command = ["sh", "-c", 'if [ "$IRISFED_TASK_INDEX" = 0 ]; then trap "echo got-term > term; exit 0" TERM; '
                           "touch ready; while :; do sleep 0.1; done; fi; "
                           "while [ ! -e ../task-0/ready ]; do sleep 0.1; done; exit 1"]
    handle = await backend.launch(_gang(command))

    assert await run_ended(handle) == 1
    job = slurm_job(gangs_cluster, handle.slurm_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "1:0"), job
    assert _steps_of(gangs_cluster, handle.slurm_id) == ""  # no step left running
    tasks = handle.tasks()
    assert [(t.index, t.state, t.exit_code) for t in tasks] == [(0, TASK_KILLED, KILLED_EXIT_CODE),
                                                                (1, TASK_FAILED, 1)]
    assert (Path(tasks[0].log_path) / "term").read_text() == "got-term\n"  # Slurm's SIGTERM reached it
    stderr = (Path(handle.log_dir) / "stderr").read_text()
    assert "task 1: Exited with exit code 1" in stderr, stderr  # srun's own account


async def test_a_stopped_gangs_tasks_get_sigterm_and_their_grace_and_slurm_a_time_limit(
    backend: SlurmBackend, gangs_cluster: SlurmCluster,
) -> None:
    """docs/design.md §3.7 on Slurm: each task gets SIGTERM (never through srun, which
    would turn it into SIGKILL at once) and the run's grace to checkpoint, longer than our
    cluster's KillWait (5 s) after which a plain scancel would have SIGKILLed it."""
    command = ["sh", "-c", 'trap "sleep 6; echo checkpoint >> ckpt; exit 0" TERM; touch ready; sleep 300 & wait']
    handle = await backend.launch(_gang(command, grace_s=10, time_limit_s=90))
    await asyncio.wait_for(handle.started.wait(), JOB_TIMEOUT_S)
    folders = [Path(handle.log_dir) / f"task-{index}" for index in range(2)]
    await eventually(lambda: asyncio.to_thread(lambda: all((f / "ready").exists() for f in folders)),
                     "every task to trap SIGTERM")
    assert slurm_job(gangs_cluster, handle.slurm_id)["TimeLimit"] == "00:03:00"  # ceil((90 + 10) / 60) + 1

    await handle.kill(grace_s=10)

    assert await run_ended(handle) == KILLED_EXIT_CODE
    assert [(t.state, t.exit_code) for t in handle.tasks()] == [(TASK_KILLED, KILLED_EXIT_CODE)] * 2
    assert [(f / "ckpt").read_text() for f in folders] == ["checkpoint\n"] * 2
    job = slurm_job(gangs_cluster, handle.slurm_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "0:15"), job  # ended by SIGTERM, in its grace
    assert "forcing job termination" not in (Path(handle.log_dir) / "stderr").read_text()  # srun kept out
    assert _steps_of(gangs_cluster, handle.slurm_id) == ""


async def test_a_gang_whose_tasks_cannot_all_start_in_time_is_lost_and_its_slurm_job_gone(
    make_backend: Callable[..., SlurmBackend], gangs_cluster: SlurmCluster, tmp_path: Path,
) -> None:
    """Outside work holds every CPU of one node: a gang asking every node stays pending
    past its start timeout; the backend cancels it and the run is lost (requeued whole).
    A restarted agent that adopts such a gang keeps the timeout it was launched with."""
    busy_node = gangs_cluster.gang_nodes[-1]
    cpus = gangs_cluster.node(busy_node)["CPUTot"]
    blocker = gangs_cluster.run(
        "sbatch", "--parsable", "-J", "outside-work", "-p", gangs_cluster.gang_partition, "-w", busy_node,
        "-c", cpus, "--mem=64", "-D", str(tmp_path), "-o", "/dev/null", "--wrap", "sleep 300").strip().split(";")[0]
    try:
        await eventually(lambda: asyncio.to_thread(lambda: slurm_job(gangs_cluster, blocker)["JobState"] == "RUNNING"),
                         "the outside work to run")
        replicas = len(gangs_cluster.gang_nodes)
        backend, first = make_backend(), make_backend()
        spec, adopted_spec = (_gang(["true"], replicas=replicas, start_timeout_s=3) for _ in range(2))
        handle = await backend.launch(spec)
        await first.launch(adopted_spec)
        await first.close()  # that agent stops; the next adopts its pending gang
        adopted = await make_backend().adopt(LiveRun(adopted_spec.job_id, 1, ""))
        assert adopted is not None and [t.state for t in adopted.tasks()] == [TASK_PENDING] * replicas

        for run in (handle, adopted):
            with pytest.raises(RunLost, match=rf"its {replicas} tasks did not all start within 3s: "
                                              rf"Slurm job {run.slurm_id} was still PENDING( \(\w+\))?, cancelled"):
                await run_ended(run)
            assert not run.started.is_set()
            job = slurm_job(gangs_cluster, run.slurm_id)
            assert job["JobState"] == "CANCELLED", job
            assert [t.state for t in run.tasks()] == [TASK_LOST] * replicas
        assert await backend.list_runs() == []
    finally:
        gangs_cluster.run("scancel", blocker, check=False)
    await eventually(lambda: asyncio.to_thread(lambda: slurm_job(gangs_cluster, blocker)["JobState"] != "COMPLETING"
                                               and slurm_job(gangs_cluster, blocker)["JobState"] != "RUNNING"),
                     "the outside work to end")


# ---------------------------------------------------------------- adopted, killed


async def test_a_restarted_agent_adopts_a_gang_with_its_tasks_and_a_stale_one_is_killed_whole(
    make_backend: Callable[..., SlurmBackend], gangs_cluster: SlurmCluster,
) -> None:
    wait_for_go = ["sh", "-c", "touch running; while [ ! -e ../go ]; do sleep 0.2; done"]
    first = make_backend()
    spec = _gang(wait_for_go)
    launched = await first.launch(spec)
    stale = await first.launch(_gang(wait_for_go))
    await asyncio.wait_for(launched.started.wait(), JOB_TIMEOUT_S)
    await first.close()  # the agent stops; the gangs go on

    restarted = make_backend()
    assert (await restarted.launch(spec)).slurm_id == launched.slurm_id  # launch is idempotent for a gang too
    adopted = await restarted.adopt(LiveRun(spec.job_id, spec.epoch, ""))
    assert adopted is not None and adopted.slurm_id == launched.slurm_id
    await asyncio.wait_for(adopted.started.wait(), JOB_TIMEOUT_S)
    assert [t.index for t in adopted.tasks()] == [0, 1]
    stale_run = Path(stale.log_dir)
    assert await restarted.kill_leftover(*_run_of(stale_run)) is True  # its epoch moved on: one scancel ends it
    (Path(launched.log_dir) / "go").touch()

    assert await run_ended(adopted) == 0
    assert [t.state for t in adopted.tasks()] == [TASK_SUCCEEDED, TASK_SUCCEEDED]
    # A scancel landing while srun starts the step leaves the job COMPLETING a few seconds.
    async def settled() -> str | None:
        state = (await asyncio.to_thread(slurm_job, gangs_cluster, stale.slurm_id))["JobState"]
        return None if state == "COMPLETING" else state
    assert await wait_for(settled, "the stale gang's job to finish completing") == "CANCELLED"
    assert _steps_of(gangs_cluster, stale.slurm_id) == ""
    assert await restarted.list_runs() == []


def _run_of(run_dir: Path) -> tuple[str, int]:
    return run_dir.parent.name, int(run_dir.name.removeprefix("epoch-"))


# ---------------------------------------------------------------- nodes


def _expected_groups(cluster: SlurmCluster) -> list[tuple[int, str]]:
    """The gang partition's nodes, as ``scontrol show node`` has them, grouped by hand:
    (how many nodes, their attributes and each resource's total and free), sorted."""
    shapes: Counter[str] = Counter()
    for name in cluster.gang_nodes:
        node = cluster.node(name)
        usable = "DRAIN" not in node["State"] and "DOWN" not in node["State"]
        gpus = parse_gres(node.get("Gres", ""))[0].get("gpu", 0)
        resources = {"cpu": (int(node["CPUTot"]), int(node["CPUTot"]) - int(node["CPUAlloc"])),
                     "memory_mb": (int(node["RealMemory"]), int(node["RealMemory"]) - int(node["AllocMem"]))}
        if gpus:
            used = parse_gres(cluster.run("scontrol", "show", "node", "-o", "-d", name).split("GresUsed=")[1]
                              .split()[0])[0].get("gpu", 0)
            resources["gpu"] = (gpus, gpus - used)
        attributes: dict[str, list[str]] = {}
        for feature in parse_features(node.get("AvailableFeatures", "")):
            key, value = feature_attribute(feature)
            attributes.setdefault(key, []).append(value)
        shapes[json.dumps({"attributes": {k: sorted(v) for k, v in sorted(attributes.items())},
                           "resources": {k: {"total": t, "free": f if usable else 0}
                                         for k, (t, f) in sorted(resources.items())}}, sort_keys=True)] += 1
    return sorted((count, shape) for shape, count in shapes.items())


def _groups(found) -> list[tuple[int, str]]:
    return sorted((group["count"], json.dumps({"attributes": group["attributes"], "resources": group["resources"]},
                                              sort_keys=True)) for group in found.nodes)


async def test_discover_returns_node_groups_matching_scontrol_also_while_a_gang_runs(
    backend: SlurmBackend, gangs_cluster: SlurmCluster,
) -> None:
    async def matches():
        before = await asyncio.to_thread(_expected_groups, gangs_cluster)
        found = await backend.discover()
        after = await asyncio.to_thread(_expected_groups, gangs_cluster)
        return (before, found) if before == after == _groups(found) else None

    idle, found = await eventually(matches, "discover() to agree with scontrol")
    assert sum(count for count, _ in idle) == len(gangs_cluster.gang_nodes)
    assert found.resources["cpu"][0] == sum(int(gangs_cluster.node(n)["CPUTot"]) for n in gangs_cluster.gang_nodes)
    if gangs_cluster.folder is not None:  # our own cluster: its shape is known
        assert [(g["count"], g["attributes"]) for g in sorted(found.nodes, key=lambda g: g["count"])] == [
            (1, {"feature": ["ssd"], "rack": ["b"]}), (2, {"rack": ["a"]})]

    handle = await backend.launch(_gang(["sleep", "300"], resources={"cpu": 1, "memory_mb": 512, "gpu": 1}))
    await asyncio.wait_for(handle.started.wait(), JOB_TIMEOUT_S)
    _, found = await eventually(matches, "discover() to agree with scontrol while the gang runs")
    gpu_free = sorted(group["resources"]["gpu"]["free"] for group in found.nodes for _ in range(group["count"]))
    gpu_total = [group["resources"]["gpu"]["total"] for group in found.nodes]
    if gangs_cluster.folder is not None:
        assert gpu_free == [1, 1, 2] and set(gpu_total) == {2}, found.nodes  # a GPU held on each of two nodes

    await handle.kill(grace_s=1)
    assert await run_ended(handle) == KILLED_EXIT_CODE
    assert [t.state for t in handle.tasks()] == [TASK_KILLED, TASK_KILLED]
    job = slurm_job(gangs_cluster, handle.slurm_id)
    # SIGTERM ended it within its grace (FAILED by the signal), or scancel did after it.
    assert (job["JobState"], job["ExitCode"]) in (("FAILED", "0:15"), ("CANCELLED", "0:15"), ("CANCELLED", "0:9")), job


# ---------------------------------------------------------------- through a federation


async def test_a_federation_places_a_gang_on_the_slurm_peer_s_nodes_and_records_its_tasks(
    federation, gangs_cluster: SlurmCluster,  # noqa: F811
) -> None:
    """The agent advertises the gang partition's node groups; the tick places a gang of
    two grouped by rack there (rack a: two nodes), the agent runs it as one Slurm job,
    and its tasks' nodes are recorded; three grouped by rack no rack holds: rejected,
    naming nodes."""
    if gangs_cluster.folder is None:
        pytest.skip("needs our own cluster's racks")
    federation.configure([Peer("gpu-west", slots=8, backend="slurm", slurm_partition=gangs_cluster.gang_partition)],
                         local="gpu-west")
    await federation.start_federation()
    federation.start("gpu-west", "--backend", "slurm", "--poll-interval", "0.25", env=gangs_cluster.env)
    await federation.wait_agent("gpu-west")

    async def nodes_advertised():
        rows = {row.peer_id: row for row in await federation.store.peer_heartbeat_list()}
        backends = rows["gpu-west"].backends if "gpu-west" in rows else []
        return backends[0].get("nodes") if backends else None
    advertised = await wait_for(nodes_advertised, "gpu-west to advertise its Slurm nodes", timeout=60)
    assert sorted(group["count"] for group in advertised) == [1, 2], advertised

    job_id = f"slurm-gang-{uuid.uuid4().hex[:8]}"
    reply = await federation.submit({"job_id": job_id, "command": ["sh", "-c", "echo task $IRISFED_TASK_INDEX"],
                                     "resources": {"cpu": 1, "gpu": 1}, "replicas": 2,
                                     "coschedule": {"group_by": "rack"}})
    assert reply["disposition"] in ("local", "queue"), reply  # gpu-west is the only peer: placed at once
    done = await federation.wait_state(job_id, *TERMINAL_STATES, timeout=JOB_TIMEOUT_S)
    assert (done.state, done.exit_code, done.owner_peer_id) == ("succeeded", 0, "gpu-west"), done
    rows = await federation.store.job_tasks_list(job_id)
    assert [(t.task_index, t.state, t.exit_code) for t in rows] == [(0, "succeeded", 0), (1, "succeeded", 0)]
    assert {t.node for t in rows} == set(gangs_cluster.gang_nodes[:2])  # rack a's two nodes
    assert federation.cli("logs", job_id, "--task", "1").stdout == "task 1\n"

    too_big = await federation.submit({"job_id": f"slurm-gang-{uuid.uuid4().hex[:8]}", "command": ["true"],
                                       "resources": {"cpu": 1}, "replicas": 3, "coschedule": {"group_by": "rack"}})
    assert too_big["disposition"] == "reject", too_big
    [verdict] = [v for v in too_big["verdicts"] if v["peer_id"] == "gpu-west"]
    assert verdict["code"] == "insufficient_nodes", verdict
    assert "needs 3 nodes with cpu 1 sharing one rack, at most 2 (backend slurm)" in verdict["detail"], verdict



async def test_each_task_of_a_gang_runs_in_its_own_workspace_copy_with_its_own_outputs(
    backend: SlurmBackend, tmp_path: Path,
) -> None:
    workspace = tmp_path / "tree"
    workspace.mkdir()
    (workspace / "data.txt").write_text("shared")
    script = ("import os, pathlib; out = pathlib.Path(os.environ['IRISFED_OUTPUT_DIR']); "
              "pathlib.Path('mine').write_text(os.environ['IRISFED_TASK_INDEX']); "
              "out.joinpath('seen.txt').write_text(pathlib.Path('data.txt').read_text() + ' ' + os.getcwd())")
    spec = _gang(["python3", "-c", script], workspace=workspace)
    handle = await backend.launch(spec)
    assert await run_ended(handle) == 0
    dirs = backend.output_dirs(spec.job_id, spec.epoch, 2)
    assert [task for task, _ in dirs] == [0, 1]
    for task, outputs in dirs:
        own = Path(handle.log_dir) / f"task-{task}" / "workspace"
        assert (outputs / "seen.txt").read_text() == f"shared {own}"
        assert (own / "mine").read_text() == str(task)  # each task its own copy
    assert sorted(p.name for p in workspace.iterdir()) == ["data.txt"]
