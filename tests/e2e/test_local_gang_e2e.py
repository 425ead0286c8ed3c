"""A LOCAL gang end to end (router, tick, the local agent as processes; subprocess tasks).

A gang whose constraints the local cluster matches is LOCAL: the router assigns it to
the local agent at once and tells it on ``assign.<local>``. The agent must treat it as
the gang its row says it is — launched while ``assigned``, accepted (``running``) only
once all its tasks run, one slot per task (docs/design.md §3.4, "One fate") — whatever
the notice carried.

``home`` has two one-cpu nodes; a single-task job holds one of them, so a LOCAL gang of
two cannot start yet. Reconciles are 600 s apart: only the router's notice starts work.
"""

from __future__ import annotations

import contextlib
import shlex

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.configs import make_peer
from tests.infra.probes import kill_group, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

HOME = ("--node", "2:cpu=1", "--resource", "cpu=2", "--reconcile-interval", "600")
CPU = [{"key": "device_type", "op": "eq", "value": "cpu"}]





async def test_a_local_gang_is_running_only_once_all_its_tasks_run(federation, tmp_path):
    federation.configure([make_peer("home", "cpu", 3), make_peer("tpu-east", "tpu")], ttl_s=5.0)
    ledger, release = tmp_path / "ledger", tmp_path / "release"
    ledger.touch()
    note = f'echo "$IRISFED_JOB_ID $IRISFED_TASK_INDEX $$" >> {shlex.quote(str(ledger))}'
    wait = f"while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.1; done"
    command = ["sh", "-c", f"{note}; {wait}"]
    await federation.start_federation()
    federation.start("home", *HOME)
    await federation.wait_agent("home")
    try:
        reply = await federation.submit({"job_id": "single", "command": command, "constraints": CPU})
        assert reply["disposition"] == "local", reply
        await federation.wait_state("single", "running")
        reply = await federation.submit({"job_id": "g", "command": command, "constraints": CPU, "replicas": 2})
        assert reply["disposition"] == "local", reply

        # Only one node is free: g's tasks cannot all start, so g is not running.
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: returns(any(" g " in f" {line} " for line in ledger.read_text().splitlines())),
                           "a task of g to start", timeout=3.0)
        started = [line for line in ledger.read_text().splitlines() if line.startswith("g ")]
        job = await federation.job("g")
        history = [(r.from_state, r.to_state) for r in await federation.store.changelog_list_for_job("g")]
        assert not (job.state == "running" and len(started) < 2), (
            f"the LOCAL gang g is {job.state} with {len(started)} of its 2 tasks started; history {history}")

        release.touch()
        done = await federation.wait_state("g", *TERMINAL_STATES)
        assert done.state == "succeeded", done
        tasks = await federation.store.job_tasks_list("g")
        assert sorted((t.task_index, t.state) for t in tasks) == [(0, "succeeded"), (1, "succeeded")], tasks
    finally:
        release.touch()
        for line in ledger.read_text().splitlines():
            kill_group(int(line.split()[-1]))
