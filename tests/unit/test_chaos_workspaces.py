"""Invariant 14 as the chaos suite checks it: every real run's start line names the
workspace token its folder held, and it must be its job's (pure: a log file read)."""

from __future__ import annotations

import random

from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import JOB_SCRIPT, WORKSPACE_TOKEN, job_body


def test_runs_in_the_wrong_workspace_or_none_are_violations(tmp_path):
    log = tmp_path / "runs.log"
    work = tmp_path / "work"
    log.write_text(
        f"start alice:j1 1 101 {work}/gpu-a/alice:j1/epoch-1/workspace alice-0-1\n"
        f"start alice:j2 1 102 {work}/gpu-a/alice:j2/epoch-1/workspace bob-0-2\n"  # another's workspace
        f"start alice:j3 1 103 {work}/home/alice:j3/epoch-1 -\n"  # ran without its workspace
        f"start j4 2 104 {work}/home/j4/epoch-2 -\n"  # no workspace asked, none had
        f"start j5 1 105 {work}/home/j5/epoch-1\n")  # a line from before tokens: none
    watcher = RunWatcher(log, work)
    watcher._read_log()
    problems, in_workspace = watcher.workspace_violations(
        {"alice:j1": "alice-0-1", "alice:j2": "alice-0-1", "alice:j3": "alice-0-1", "j4": "-", "j5": "-"})
    assert in_workspace == 2
    assert problems == [
        "alice:j2: epoch 1 on gpu-a started in workspace 'bob-0-2', its job names 'alice-0-1' (invariant 14)",
        "alice:j3: epoch 1 on home started in workspace '-', its job names 'alice-0-1' (invariant 14)"]


def test_the_job_script_reports_its_workspace_token():
    body = job_body(random.Random(1), "j1", "/tmp/runs.log")
    assert body["command"][2] == JOB_SCRIPT and f"cat {WORKSPACE_TOKEN}" in JOB_SCRIPT
