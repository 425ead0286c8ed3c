"""Invariant 17 as the chaos suite checks it: no device index of a node is held by two
live runs at once, read from the agents' run records (``run.json``) of the processes
the watcher sees alive (pure: files and /proc of this test's own processes)."""

from __future__ import annotations

import json
import os

from irisfed.tooling.chaos.watcher import RunWatcher, held_twice, recorded_devices


def test_held_twice_names_each_index_two_runs_hold_on_one_node():
    assert held_twice([("gpu-b", "h-0", {"gpu": [0]}, "a"), ("gpu-b", "h-1", {"gpu": [0]}, "b"),
                       ("gpu-a", "h-0", {"gpu": [0]}, "c")]) == {}
    assert held_twice([("gpu-b", "h-0", {"gpu": [0, 1]}, "b"), ("gpu-b", "h-0", {"gpu": [1, 2]}, "a"),
                       ("gpu-b", "h-0", {"tpu": [1]}, "c")]) == {("gpu-b", "h-0", "gpu", 1): ["a", "b"]}


def test_recorded_devices_come_from_the_run_folder_of_that_very_process(tmp_path):
    run_dir = tmp_path / "job" / "epoch-1"
    (run_dir / "workspace").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"pid": 7, "node": "h-0", "devices": {"gpu": [1]}}))
    assert recorded_devices(str(run_dir), 7) == ("h-0", {"gpu": [1]})
    assert recorded_devices(str(run_dir / "workspace"), 7) == ("h-0", {"gpu": [1]})
    assert recorded_devices(str(run_dir), 8) is None  # another process's record (or not written yet)
    (run_dir / "run.json").write_text(json.dumps({"pid": 7}))  # from before devices: none
    assert recorded_devices(str(run_dir), 7) == ("", {})


def _watched(tmp_path, a_holds: list[int], b_holds: list[int]) -> RunWatcher:
    """A watcher that has swept two live runs on node h-0 of gpu-b holding those GPU
    indices: two processes alive for the whole test (this one and its parent) stand for them."""
    work, log = tmp_path / "work", tmp_path / "runs.log"
    lines = []
    for job_id, pid, devices in (("a", os.getpid(), a_holds), ("b", os.getppid(), b_holds)):
        run_dir = work / "gpu-b" / job_id / "epoch-1"
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({"pid": pid, "node": "h-0", "devices": {"gpu": devices}}))
        lines.append(f"start {job_id} 1 {pid} {run_dir} -\n")
    log.write_text("".join(lines))
    watcher = RunWatcher(log, work)
    watcher.sweep()
    return watcher


def test_two_live_runs_holding_one_index_are_a_violation(tmp_path):
    problems, _ = _watched(tmp_path, [0, 1], [1]).violations()
    assert len(problems) == 1 and problems[0].startswith("gpu-b/h-0: gpu 1 held by a epoch 1") and (
        "invariant 17" in problems[0]), problems


def test_runs_holding_distinct_indices_are_none(tmp_path):
    assert _watched(tmp_path, [0], [1]).violations() == ([], 0)
