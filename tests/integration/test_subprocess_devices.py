"""The subprocess backend binds each run to device indices of its node (docs/design.md
§3.7): real processes see distinct ``CUDA_VISIBLE_DEVICES``, and a new backend object
(the next agent run) counts the indices of processes an earlier one left as held."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import LaunchError, LocalNodes, RunSpec, SubprocessBackend
from irisfed.shared.config import NodeSpec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# What a run sees: its devices ("unset" when not set at all) and what it asked.
SHOW = ["sh", "-c", 'echo "${CUDA_VISIBLE_DEVICES-unset};$IRISFED_RESOURCES" > out']


def four_gpus() -> LocalNodes:
    return LocalNodes((), {"cpu": 8, "gpu": 4})


def seen(root: Path, job_id: str, task: int = -1) -> tuple[str, dict]:
    run_dir = root / job_id / "epoch-1" / (f"task-{task}" if task >= 0 else "")
    devices, resources = (run_dir / "out").read_text().strip().split(";")
    return devices, json.loads(resources)



async def test_two_live_runs_see_disjoint_gpus_and_a_later_one_reuses_them(tmp_path):
    backend = SubprocessBackend(tmp_path, four_gpus())
    first = await backend.launch(RunSpec("a", 1, SHOW, resources={"cpu": 1, "gpu": 2}))
    second = await backend.launch(RunSpec("b", 1, SHOW, resources={"cpu": 1, "gpu": 2},
                                          env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}))  # never its own choice
    assert await first.wait() == 0 and await second.wait() == 0
    assert seen(tmp_path, "a") == ("0,1", {"cpu": 1, "gpu": 2})
    assert seen(tmp_path, "b") == ("2,3", {"cpu": 1, "gpu": 2})
    record = json.loads((tmp_path / "b" / "epoch-1" / "run.json").read_text())
    assert record["devices"] == {"gpu": [2, 3]} and record["node"] == backend.nodes.nodes[0].name
    # Both ended: their indices are free again; a job asking none sees none.
    third = await backend.launch(RunSpec("c", 1, SHOW, resources={"cpu": 1, "gpu": 2}))
    none = await backend.launch(RunSpec("d", 1, SHOW, resources={"cpu": 1}))
    assert await third.wait() == 0 and await none.wait() == 0
    assert seen(tmp_path, "c")[0] == "0,1"
    assert seen(tmp_path, "d") == ("", {"cpu": 1})  # empty, not unset: it may use none of them
    assert all(not node.held.get("gpu") for node in backend.nodes.nodes)


async def test_a_run_that_would_need_a_held_gpu_is_refused_not_bound_to_it(tmp_path, launched):
    backend = SubprocessBackend(tmp_path, four_gpus())
    holder = await backend.launch(RunSpec("holder", 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 3}))
    launched.append(holder.process.pid)
    with pytest.raises(LaunchError, match="1 more gpu"):
        await backend.launch(RunSpec("late", 1, SHOW, resources={"cpu": 1, "gpu": 2}))
    assert sorted(backend.nodes.nodes[0].held["gpu"]) == [0, 1, 2]
    await holder.kill(grace_s=1.0)
    assert not backend.nodes.nodes[0].held["gpu"]


async def test_a_new_backend_counts_the_gpus_a_leftover_process_holds(tmp_path, launched):
    earlier = SubprocessBackend(tmp_path, four_gpus())
    left = await earlier.launch(RunSpec("left", 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 2}))
    launched.append(left.process.pid)
    record = json.loads((tmp_path / ".live" / "left.epoch-1.json").read_text())
    assert record["devices"] == {"gpu": [0, 1]}

    # The next agent run: it knows only the work folder.
    later = SubprocessBackend(tmp_path, four_gpus())
    run = await later.launch(RunSpec("next", 1, SHOW, resources={"cpu": 1, "gpu": 2}))
    assert await run.wait() == 0
    assert seen(tmp_path, "next")[0] == "2,3"

    [leftover] = await later.list_runs()
    assert await later.kill_run(leftover)
    await left.process.wait()  # still our child here: reap it
    after = await later.launch(RunSpec("after", 1, SHOW, resources={"cpu": 1, "gpu": 2}))
    assert await after.wait() == 0
    assert seen(tmp_path, "after")[0] == "0,1"


async def test_a_leftover_seen_ended_frees_its_gpus(tmp_path, launched):
    earlier = SubprocessBackend(tmp_path, four_gpus())
    left = await earlier.launch(RunSpec("left", 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 4}))
    launched.append(left.process.pid)
    later = SubprocessBackend(tmp_path, four_gpus())
    assert len(await later.list_runs()) == 1
    assert sorted(later.nodes.nodes[0].held["gpu"]) == [0, 1, 2, 3]
    os.killpg(left.process.pid, signal.SIGKILL)
    await left.process.wait()
    assert await later.list_runs() == []
    assert not later.nodes.nodes[0].held["gpu"]


async def test_gang_tasks_each_hold_gpus_of_their_own_node(tmp_path):
    nodes = LocalNodes([NodeSpec(2, {"cpu": 4, "gpu": 2})], {})
    backend = SubprocessBackend(tmp_path, nodes)
    single = await backend.launch(RunSpec("single", 1, ["sleep", "300"], resources={"cpu": 1, "gpu": 1}))
    try:
        gang = await backend.launch(RunSpec("gang", 1, SHOW, resources={"cpu": 1, "gpu": 1}, replicas=2,
                                            start_timeout_s=30))
        assert await gang.wait() == 0
    finally:
        await single.kill(grace_s=1.0)
    tasks = {task.node: seen(tmp_path, "gang", task.index)[0] for task in gang.tasks()}
    assert len(tasks) == 2
    single_node = single.node
    assert tasks[single_node] == "1"  # index 0 there is the single run's
    assert [devices for node, devices in tasks.items() if node != single_node] == ["0"]
    assert seen(tmp_path, "gang", 0)[1] == {"cpu": 1, "gpu": 1}
    assert all(not node.held.get("gpu") for node in nodes.nodes)
