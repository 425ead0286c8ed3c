"""Gangs end to end on the local backends (docs/design.md §3.4; invariant 12): router,
tick and real peer agents as processes, subprocess runs, real Postgres and NATS.

``tpu`` has eight configured nodes, two slices of four (``--node 4:cpu=1:slice=v5e-a
--node 4:cpu=1:slice=v5e-b``); every task asks one cpu, so a node holds one task. Each
task appends ``job epoch index tasks coordinator node pid`` to a ledger, and a task waits
for a release file only where the test says so.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.configs import make_peer
from tests.infra.probes import alive, kill_group, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

TPU = [{"key": "device_type", "op": "eq", "value": "tpu"}]
SLICES = ("--node", "4:cpu=1:slice=v5e-a", "--node", "4:cpu=1:slice=v5e-b")


def configure(federation, ttl_s: float = 1.5) -> None:
    federation.configure([make_peer("home", "cpu"), make_peer("tpu-east", "tpu", 8)], ttl_s=ttl_s)





class Ledger:
    def __init__(self, folder: Path) -> None:
        self.path = folder / "ledger"
        self.path.touch()

    def task(self, *, exit_code: int = 0, gate: Path | None = None, first_epoch_only: bool = True,
             fail_index: int | None = None) -> list[str]:
        note = (f'echo "$IRISFED_JOB_ID $IRISFED_EPOCH $IRISFED_TASK_INDEX $IRISFED_NUM_TASKS '
                f'$IRISFED_COORDINATOR $IRISFED_NODE $$" >> {shlex.quote(str(self.path))}; echo "task $IRISFED_TASK_INDEX"')
        script = note
        if gate is not None:
            wait = f"while [ ! -e {shlex.quote(str(gate))} ]; do sleep 0.1; done"
            script += f'; if [ "$IRISFED_EPOCH" = 1 ]; then {wait}; fi' if first_epoch_only else f"; {wait}"
        if fail_index is not None:
            # The failing task exits once every task of its run has written its line: a
            # sibling killed before its shell wrote would otherwise go unseen.
            ledger = shlex.quote(str(self.path))
            all_written = (f'n=0; while [ "$(grep -c "^$IRISFED_JOB_ID $IRISFED_EPOCH " {ledger})" -lt '
                           f'"$IRISFED_NUM_TASKS" ] && [ $n -lt 1200 ]; do n=$((n+1)); sleep 0.05; done')
            script += (f'; if [ "$IRISFED_TASK_INDEX" = {fail_index} ]; then {all_written}; exit {exit_code}; fi; '
                       'sleep 600')
        return ["sh", "-c", script]

    def rows(self, job_id: str | None = None) -> list[dict]:
        rows = []
        for line in self.path.read_text().splitlines():
            job, epoch, index, tasks, coordinator, node, pid = line.split()
            if job_id in (None, job):
                rows.append({"job": job, "epoch": int(epoch), "index": int(index), "tasks": int(tasks),
                             "coordinator": coordinator, "node": node, "pid": int(pid)})
        return rows


async def gang(federation, job_id: str, command: list[str], replicas: int = 4, group_by: str | None = "slice",
               **extra) -> dict:
    body = {"job_id": job_id, "command": command, "constraints": TPU, "replicas": replicas, **extra}
    if group_by:
        body["coschedule"] = {"group_by": group_by}
    return await federation.submit(body)


async def tasks_of(federation, job_id: str):
    return await federation.store.job_tasks_list(job_id)


def slice_of(node: str) -> str:
    """Nodes are numbered in configuration order: 0-3 slice a, 4-7 slice b."""
    return "v5e-a" if int(node.rsplit("-", 1)[1]) < 4 else "v5e-b"


async def start_slices(federation, tmp_path: Path, *flags: str, ttl_s: float = 1.5) -> Ledger:
    """Router, tick, home and tpu-east (two slices of four nodes; ``flags`` for its agent),
    heartbeats trusted for ``ttl_s``; the ledger its tasks write."""
    configure(federation, ttl_s=ttl_s)
    await federation.start_federation()
    federation.start("tpu-east", *SLICES, "--resource", "cpu=8", *flags)
    await federation.wait_agent("tpu-east")
    return Ledger(tmp_path)


def kill_all(pids) -> None:
    for pid in pids:
        kill_group(pid)


async def test_a_gang_of_four_runs_all_on_one_slice_each_task_knowing_its_place(federation, tmp_path):
    ledger = await start_slices(federation, tmp_path)

    reply = await gang(federation, "train", ledger.task())
    assert (reply["disposition"], reply["state"]) == ("queue", "queued"), reply
    done = await federation.wait_state("train", *TERMINAL_STATES)
    assert (done.state, done.exit_code, done.replicas) == ("succeeded", 0, 4), done

    started = ledger.rows("train")
    assert sorted(r["index"] for r in started) == [0, 1, 2, 3]
    assert {r["tasks"] for r in started} == {4} and len({r["coordinator"] for r in started}) == 1
    assert len({r["node"] for r in started}) == 4  # one task a node
    assert len({slice_of(r["node"]) for r in started}) == 1  # all on one slice
    rows = await tasks_of(federation, "train")
    assert [(t.task_index, t.state, t.exit_code, t.peer_id) for t in rows] == [
        (i, "succeeded", 0, "tpu-east") for i in range(4)]
    assert {t.node for t in rows} == {r["node"] for r in started}

    shown = federation.cli("job", "train")
    assert shown.returncode == 0 and "tasks       4  sharing one slice" in shown.stdout, shown.stdout
    detail = json.loads(federation.cli("job", "train", "--json").stdout)
    assert [(t["index"], t["state"]) for t in detail["tasks"]] == [(i, "succeeded") for i in range(4)]
    assert federation.cli("logs", "train", "--task", "2").stdout == "task 2\n"
    refused = federation.cli("logs", "train", "--task", "4")
    assert refused.returncode == 2 and "has 4 tasks (0..3)" in refused.stderr
    # The whole history is the job's: one assignment, one start, one end.
    history = [(r.from_state, r.to_state) for r in await federation.store.changelog_list_for_job("train")]
    assert history == [(None, "queued"), ("queued", "assigned"), ("assigned", "running"), ("running", "succeeded")]


async def test_a_gang_no_backend_could_ever_hold_is_rejected_naming_nodes(federation, tmp_path):
    await start_slices(federation, tmp_path)
    reply = await gang(federation, "too-big", ["true"], replicas=5)
    assert reply["disposition"] == "reject", reply
    [verdict] = [v for v in reply["verdicts"] if v["peer_id"] == "tpu-east"]
    assert verdict["code"] == "insufficient_nodes"
    assert verdict["detail"] == "gang: needs 5 nodes with cpu 1 sharing one slice, at most 4 (backend subprocess)"
    assert (await gang(federation, "nine", ["true"], replicas=9, group_by=None))["disposition"] == "reject"
    assert (await federation.job("too-big")).state == "rejected"


async def test_one_task_failing_fails_the_gang_and_its_siblings_are_killed(federation, tmp_path):
    ledger = await start_slices(federation, tmp_path)
    await gang(federation, "broken", ledger.task(exit_code=3, fail_index=1), max_retries=2)
    done = await federation.wait_state("broken", *TERMINAL_STATES)
    try:
        assert (done.state, done.exit_code) == ("failed", 3), done
        pids = [r["pid"] for r in ledger.rows("broken")]
        assert len(pids) == 4
        await wait_for(lambda: returns(not any(alive(pid) for pid in pids)), "every sibling to be killed")
        rows = {t.task_index: t for t in await tasks_of(federation, "broken")}
        assert (rows[1].state, rows[1].exit_code) == ("failed", 3)
        assert all(rows[i].state == "killed" for i in (0, 2, 3)), rows
        assert done.epoch == 1 and done.attempts == 1  # a task's own failure is never retried
    finally:
        kill_all(r["pid"] for r in ledger.rows("broken"))


async def test_an_agent_sigkilled_mid_gang_ends_every_task_then_runs_it_again_whole(federation, tmp_path):
    """The restarted agent cannot adopt subprocess tasks: it kills all four and hands
    the gang back (a retry); it runs again whole, and no task of the old run is alive
    when a task of the new one starts."""
    gate = tmp_path / "release"
    ledger = await start_slices(federation, tmp_path, ttl_s=20.0)  # the agent is not judged lost while it restarts
    await gang(federation, "long", ledger.task(gate=gate), max_retries=1)
    await wait_for(lambda: returns(len(ledger.rows("long")) == 4), "the four tasks to start")
    first = ledger.rows("long")
    try:
        await federation.wait_state("long", "running")  # the agent reports it once all four run
        federation.kill("tpu-east")
        assert all(alive(r["pid"]) for r in first)  # their own sessions: the agent's death spares them
        federation.start("tpu-east", *SLICES, "--resource", "cpu=8")
        await wait_for(lambda: returns(not any(alive(r["pid"]) for r in first)), "the old run's four tasks to be killed")
        done = await federation.wait_state("long", *TERMINAL_STATES)
        assert done.state == "succeeded" and done.epoch > 1, done
        again = [r for r in ledger.rows("long") if r["epoch"] == done.epoch]
        assert sorted(r["index"] for r in again) == [0, 1, 2, 3]
        assert {r["epoch"] for r in ledger.rows("long")} == {1, done.epoch}  # two runs, each whole
        rows = await tasks_of(federation, "long")
        assert {t.epoch for t in rows} <= {1, done.epoch}
        assert [t.state for t in rows if t.epoch == done.epoch] == ["succeeded"] * 4
    finally:
        gate.touch()
        kill_all(r["pid"] for r in ledger.rows("long"))


async def test_gangs_queue_whole_and_start_when_a_slice_frees(federation, tmp_path):
    """Three gangs of four on two slices: two run, the third waits whole (never some of
    its tasks), then runs on the slice the first frees."""
    gates = {name: tmp_path / f"{name}-release" for name in ("g1", "g2", "g3")}
    ledger = await start_slices(federation, tmp_path)
    try:
        for name in ("g1", "g2"):
            await gang(federation, name, ledger.task(gate=gates[name], first_epoch_only=False))
        await wait_for(lambda: returns(len(ledger.rows()) == 8), "two gangs to run")
        await gang(federation, "g3", ledger.task(gate=gates["g3"], first_epoch_only=False))

        async def explained():
            job = await federation.job("g3")
            return job if job.state == "queued" and "4 free nodes" in job.reason else None
        waiting = await wait_for(explained, "g3 to wait, saying why")
        assert waiting.reason.startswith("matching peers are full; waiting for 4 free nodes"), waiting.reason
        [verdict] = [p for p in waiting.explanation["peers"] if p["peer_id"] == "tpu-east"]
        assert "needs 4 free nodes with cpu 1 sharing one slice" in verdict["detail"], verdict
        assert verdict["detail"].endswith("0 free slots (backend subprocess)"), verdict
        assert ledger.rows("g3") == []
        gates["g1"].touch()
        await federation.wait_state("g1", "succeeded")
        await wait_for(lambda: returns(len(ledger.rows("g3")) == 4), "g3 to start whole")
        g1_slice = {slice_of(r["node"]) for r in ledger.rows("g1")}
        assert {slice_of(r["node"]) for r in ledger.rows("g3")} == g1_slice
        for name in ("g2", "g3"):
            gates[name].touch()
            assert (await federation.wait_state(name, *TERMINAL_STATES)).state == "succeeded"
    finally:
        for gate in gates.values():
            gate.touch()
        kill_all(r["pid"] for r in ledger.rows())


async def test_an_interactive_gang_preempts_a_whole_batch_gang_which_runs_again_whole(federation, tmp_path):
    """Both slices run a batch gang; an interactive gang of four preempts exactly one of
    them, whole: every task of it is killed at once, it is queued again and later runs
    again whole, once; its preemption is counted apart from its retries."""
    gate = tmp_path / "release"
    ledger = await start_slices(federation, tmp_path, "--reconcile-interval", "600")
    try:
        for name in ("b1", "b2"):
            await gang(federation, name, ledger.task(gate=gate), band="batch", max_retries=0)
        await wait_for(lambda: returns(len(ledger.rows()) == 8), "two batch gangs to run")
        # Accepted too: a gang preempted while still assigned never had task rows to end.
        for name in ("b1", "b2"):
            await federation.wait_state(name, "running")
        await gang(federation, "urgent", ledger.task())

        async def preempted():
            rows = await federation.store.db.fetch(
                "SELECT job_id FROM federation_changelog WHERE detail = 'preempted by urgent'")
            return [r["job_id"] for r in rows]
        [victim] = await wait_for(preempted, "urgent to preempt a batch gang")
        first = ledger.rows(victim)
        # Killed on the tick's notice (reconciles are 600 s apart here), every task of it.
        await wait_for(lambda: returns(not any(alive(r["pid"]) for r in first)), f"{victim}'s four tasks to be killed")
        done = await federation.wait_state("urgent", *TERMINAL_STATES)
        assert done.state == "succeeded", done
        assert {slice_of(r["node"]) for r in ledger.rows("urgent")} == {slice_of(r["node"]) for r in first}
        other = next(name for name in ("b1", "b2") if name != victim)
        assert all(alive(r["pid"]) for r in ledger.rows(other))  # the other gang untouched
        history = [(r.from_state, r.to_state, r.detail) for r in await federation.store.changelog_list_for_job("urgent")]
        assert ("queued", "assigned", f"placed; preempted {victim}") in history
        # Its agent writes how the tasks ended with the run's report, after the kills.
        async def tasks_killed() -> bool:
            return [t.state for t in await tasks_of(federation, victim) if t.epoch == 1] == ["killed"] * 4
        await wait_for(tasks_killed, f"{victim}'s four tasks recorded as killed")

        gate.touch()
        job = await federation.wait_state(victim, *TERMINAL_STATES)
        assert (job.state, job.preemptions, job.max_retries) == ("succeeded", 1, 0), job
        assert sorted(r["index"] for r in ledger.rows(victim) if r["epoch"] == job.epoch) == [0, 1, 2, 3]
        assert {r["epoch"] for r in ledger.rows(victim)} == {1, job.epoch}
        assert (await federation.wait_state(other, *TERMINAL_STATES)).state == "succeeded"
    finally:
        gate.touch()
        kill_all(r["pid"] for r in ledger.rows())
