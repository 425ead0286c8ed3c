"""Gangs under faults, end to end (router, tick, agents as processes, subprocess tasks,
real Postgres and NATS): an agent SIGKILLed between launching a gang's tasks and
accepting it, and a gang preempted in that state.

The agent launches a gang while its job is still ``assigned`` and accepts it once all
its tasks run. To stop an agent exactly there, the test holds a lock on
``federation_sync_state`` (the acceptance writes its sync-state row in the same
statement as the job's move), so the acceptance waits; the agent is then SIGKILLed and
its waiting statement ended (as a dead client's would be), leaving the job ``assigned``
with its tasks alive in their own sessions.

Each task appends ``job epoch index pid`` to a ledger and waits for a release file.
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path

import asyncpg
import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.configs import make_peer
from tests.infra.probes import alive, kill_group, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

NODES = ("--node", "2:cpu=1", "--resource", "cpu=2")
EAST = [{"key": "zone", "op": "eq", "value": "east"}]


def configure(federation, ttl_s: float) -> None:
    federation.configure([make_peer("home", "cpu"), make_peer("tpu-east", "tpu", zone="east"),
                          make_peer("gpu-east", "tpu", zone="west")], ttl_s=ttl_s)




class Ledger:
    def __init__(self, folder: Path) -> None:
        self.path = folder / "ledger"
        self.path.touch()
        self.release = folder / "release"

    def task(self) -> list[str]:
        note = (f'echo "$IRISFED_JOB_ID $IRISFED_EPOCH $IRISFED_TASK_INDEX $$" >> '
                f'{shlex.quote(str(self.path))}')
        wait = f"while [ ! -e {shlex.quote(str(self.release))} ]; do sleep 0.1; done"
        return ["sh", "-c", f"{note}; {wait}"]

    def rows(self, job_id: str) -> list[tuple[int, int, int]]:
        rows = []
        for line in self.path.read_text().splitlines():
            job, epoch, index, pid = line.split()
            if job == job_id:
                rows.append((int(epoch), int(index), int(pid)))
        return rows

    def pids(self) -> list[int]:
        return [int(line.split()[3]) for line in self.path.read_text().splitlines()]

    def end(self, *more_pids: int) -> None:
        """Release every task, then kill (by process group) whatever of them still runs."""
        self.release.touch()
        for pid in [*more_pids, *self.pids()]:
            kill_group(pid)


class TableLock:
    """Hold ``LOCK TABLE <table>`` (writers wait, readers do not) on an admin connection;
    ``kill_waiting(peer, function)``: SIGKILL ``peer``'s agent once its call of ``function``
    waits for the lock, and end that statement as a dead client's would end."""

    def __init__(self, federation, table: str) -> None:
        self.federation, self.table = federation, table

    async def __aenter__(self) -> TableLock:
        self.conn = await asyncpg.connect(self.federation.database_url)
        self.lock = self.conn.transaction()
        await self.lock.start()
        await self.conn.execute(f"LOCK TABLE {self.table} IN SHARE ROW EXCLUSIVE MODE")
        return self

    async def kill_waiting(self, peer: str, function: str) -> None:
        # pg_stat_activity is read once per transaction: the lock's own one would never change.
        await self.stop_waiting(function, lambda: self.federation.kill(peer))

    async def stop_waiting(self, function: str, before=lambda: None) -> None:
        """End ``function``'s statement waiting for the lock (after ``before()``)."""
        probe = await asyncpg.connect(self.federation.database_url)
        try:
            await self._stop_waiting(probe, function, before)
        finally:
            await probe.close()

    async def _stop_waiting(self, probe, function: str, before) -> None:
        async def waiting():
            return await probe.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE $1", f"%{function}%")
        await wait_for(waiting, f"{function} to wait")
        before()
        # A dead client's statement ends with it (Postgres would find out at its next write).
        await probe.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND query LIKE $1", f"%{function}%")

    async def __aexit__(self, *exc) -> None:
        try:
            await self.lock.rollback()
        finally:
            await self.conn.close()


async def start_tpu_east(federation, tmp_path: Path) -> Ledger:
    """Router, tick, home and tpu-east (two nodes), heartbeats trusted for 30 s; the
    ledger its gangs' tasks write."""
    configure(federation, ttl_s=30.0)
    ledger = Ledger(tmp_path)
    await federation.start_federation()
    federation.start("tpu-east", *NODES)
    await federation.wait_agent("tpu-east")
    return ledger


async def ended_once(federation, job_id: str) -> None:
    """``job_id`` has one terminal move: running → succeeded."""
    history = [(r.from_state, r.to_state) for r in await federation.store.changelog_list_for_job(job_id)]
    assert [h for h in history if h[1] in TERMINAL_STATES] == [("running", "succeeded")], history


async def _launched_but_not_accepted(federation, ledger: Ledger, job_id: str, peer: str, body: dict) -> list[int]:
    """Submit gang ``job_id`` and stop ``peer``'s agent between launching its tasks and
    accepting it; the pids of its tasks (alive, unwatched; the job still ``assigned``)."""
    async with TableLock(federation, "federation_sync_state") as lock:
        await federation.submit({"job_id": job_id, "command": ledger.task(), **body})
        await wait_for(lambda: returns(len(ledger.rows(job_id)) == 2), f"{job_id}'s two tasks to start")
        await lock.kill_waiting(peer, "irisfed_job_start_batch")
    job = await federation.job(job_id)
    assert (job.state, job.epoch, job.owner_peer_id) == ("assigned", 1, peer), job
    pids = [pid for _, _, pid in ledger.rows(job_id)]
    assert all(alive(pid) for pid in pids)  # their own sessions: the agent's death spares them
    return pids


async def test_a_gang_preempted_while_assigned_never_runs_elsewhere_beside_its_launched_tasks(federation, tmp_path):
    """tpu-east launched batch gang g (both tasks running) and died before accepting it,
    its heartbeat not yet expired. An interactive job that only tpu-east may run preempts
    g. g must not start on gpu-east while its epoch-1 tasks still run on tpu-east: the
    same rule as a running victim's (docs/decisions.md, "A preempted victim waits for
    its old run to stop")."""
    ledger = await start_tpu_east(federation, tmp_path)  # tpu-east stays reachable throughout
    pids: list[int] = []
    try:
        pids = await _launched_but_not_accepted(federation, ledger, "g", "tpu-east", {
            "constraints": [{"key": "device_type", "op": "eq", "value": "tpu"}], "replicas": 2, "band": "batch"})
        federation.start("gpu-east", *NODES)
        await federation.wait_agent("gpu-east")
        await federation.submit({"job_id": "urgent", "command": ["true"], "constraints": EAST})

        async def preempted():
            job = await federation.job("g")
            return job if job.preemptions == 1 else None
        job = await wait_for(preempted, "urgent to preempt g")
        # Give the tick several passes to (wrongly) place g on gpu-east.
        with contextlib.suppress(TimeoutError, AssertionError):
            await wait_for(lambda: returns(any(e > 1 for e, _, _ in ledger.rows("g"))), "g to start again",
                           timeout=5.0)
        again = [(e, i) for e, i, _ in ledger.rows("g") if e > 1]
        old_alive = [pid for pid in pids if alive(pid)]
        job = await federation.job("g")
        assert not (again and old_alive), (
            f"g runs under two epochs at once: epoch-1 tasks {old_alive} alive on tpu-east while "
            f"{again} started (job now {job.state} epoch {job.epoch} on {job.owner_peer_id}, "
            f"stopping_on={job.stopping_on!r})")
        assert job.stopping_on == "tpu-east", job
    finally:
        ledger.end(*pids)


async def test_an_agent_killed_between_launching_a_gang_and_accepting_it_runs_it_once_whole(federation, tmp_path):
    """Restarted, the agent kills the tasks its previous life launched (their job is
    ``assigned``, not ``running``: leftovers) before it launches the gang again: no task
    of the first launch is alive once a task of the second starts, and the job ends once."""
    ledger = await start_tpu_east(federation, tmp_path)
    pids: list[int] = []
    try:
        pids = await _launched_but_not_accepted(federation, ledger, "g", "tpu-east", {
            "constraints": EAST, "replicas": 2})
        federation.start("tpu-east", *NODES)
        await wait_for(lambda: returns(len(ledger.rows("g")) == 4), "g's tasks to start again")
        assert not any(alive(pid) for pid in pids), "a task of the first launch outlived the restart"
        ledger.release.touch()
        done = await federation.wait_state("g", *TERMINAL_STATES)
        assert done.state == "succeeded", done
        await ended_once(federation, "g")
        tasks = await federation.store.job_tasks_list("g")
        assert sorted((t.epoch, t.task_index, t.state) for t in tasks) == [
            (done.epoch, 0, "succeeded"), (done.epoch, 1, "succeeded")], tasks
    finally:
        ledger.end(*pids)


async def _tasks(federation, job_id: str):
    return sorted((t.epoch, t.task_index, t.state) for t in await federation.store.job_tasks_list(job_id))


async def test_an_agent_killed_right_after_accepting_a_gang_before_recording_its_tasks(federation, tmp_path):
    """The job is running, no task row written yet: the restarted agent kills both tasks
    (not its children), records them lost and hands the gang back; it runs again whole,
    never beside its first run, and ends once."""
    ledger = await start_tpu_east(federation, tmp_path)
    try:
        async with TableLock(federation, "job_tasks") as lock:
            await federation.submit({"job_id": "g", "command": ledger.task(), "replicas": 2,
                                     "constraints": EAST})
            await lock.kill_waiting("tpu-east", "irisfed_job_tasks_report")
        job = await federation.job("g")
        assert (job.state, job.epoch) == ("running", 1), job
        first = [pid for _, _, pid in ledger.rows("g")]
        assert len(first) == 2 and all(alive(pid) for pid in first)
        assert await _tasks(federation, "g") == []

        federation.start("tpu-east", *NODES)
        await wait_for(lambda: returns(len(ledger.rows("g")) == 4), "g to run again")
        assert not any(alive(pid) for pid in first), "a task of the first run outlived the restart"
        ledger.release.touch()
        done = await federation.wait_state("g", *TERMINAL_STATES)
        assert done.state == "succeeded" and done.epoch > 1, done
        await ended_once(federation, "g")
        assert {e for e, _, _ in ledger.rows("g")} == {1, done.epoch}
        assert await _tasks(federation, "g") == [(1, 0, "lost"), (1, 1, "lost"),
                                                 (done.epoch, 0, "succeeded"), (done.epoch, 1, "succeeded")]
    finally:
        ledger.end()


async def test_an_agent_killed_between_recording_its_tasks_ends_and_the_jobs_end(federation, tmp_path):
    """Every task succeeded and says so in job_tasks; the agent dies before the job's end
    is written. The job ends once (the restarted agent cannot learn a subprocess gang's
    outcome: it is handed back and runs again, whole), and the first run's task rows
    stay as that run's agent last wrote them (docs/decisions.md, "Gangs")."""
    ledger = await start_tpu_east(federation, tmp_path)
    try:
        await federation.submit({"job_id": "g", "command": ledger.task(), "replicas": 2,
                                 "constraints": EAST})

        async def recorded():
            return await _tasks(federation, "g") == [(1, 0, "running"), (1, 1, "running")]
        await wait_for(recorded, "g's tasks to be recorded running")
        async with TableLock(federation, "federation_changelog") as lock:
            ledger.release.touch()

            async def ended():
                return await _tasks(federation, "g") == [(1, 0, "succeeded"), (1, 1, "succeeded")]
            await wait_for(ended, "g's tasks to be recorded succeeded")
            await lock.kill_waiting("tpu-east", "irisfed_job_finish_batch")
        assert (await federation.job("g")).state == "running"

        federation.start("tpu-east", *NODES)
        done = await federation.wait_state("g", *TERMINAL_STATES)
        assert done.state == "succeeded", done
        await ended_once(federation, "g")
        rows = await _tasks(federation, "g")
        assert [r for r in rows if r[0] == done.epoch] == [(done.epoch, 0, "succeeded"), (done.epoch, 1, "succeeded")]
        assert [r for r in rows if r[0] == 1] == [(1, 0, "succeeded"), (1, 1, "succeeded")], (
            f"the first run's tasks all succeeded and were recorded so; after the restart they read {rows}")
    finally:
        ledger.end()


async def test_a_database_blip_right_after_a_gangs_acceptance_does_not_kill_the_gang(federation, tmp_path):
    """The agent accepted the gang (running) and its connection drops as it records the
    tasks (a Postgres restart, a network blip): the write is retried like any report.
    The healthy gang keeps running under its epoch, is never killed nor run again, and
    ends once, its first attempt."""
    ledger = await start_tpu_east(federation, tmp_path)
    try:
        async with TableLock(federation, "job_tasks") as lock:
            await federation.submit({"job_id": "g", "command": ledger.task(), "replicas": 2,
                                     "constraints": EAST})
            await lock.stop_waiting("irisfed_job_tasks_report")  # the agent lives on
        first = [pid for _, _, pid in ledger.rows("g")]
        assert len(first) == 2
        # Several reconciles' time for the agent to react.
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: returns(len(ledger.rows("g")) > 2 or not all(alive(p) for p in first)),
                           "g to be disturbed", timeout=8.0)
        job = await federation.job("g")
        dead = [pid for pid in first if not alive(pid)]
        history = [(r.from_state, r.to_state, r.detail) for r in await federation.store.changelog_list_for_job("g")]
        assert not dead and (job.state, job.epoch) == ("running", 1), (
            f"a dropped connection while recording g's tasks killed {dead} of its running tasks; "
            f"g is {job.state} at epoch {job.epoch}; history {history}")
        ledger.release.touch()
        done = await federation.wait_state("g", *TERMINAL_STATES)
        assert (done.state, done.epoch, done.attempts) == ("succeeded", 1, 1), done
        assert await _tasks(federation, "g") == [(1, 0, "succeeded"), (1, 1, "succeeded")]
    finally:
        ledger.end()
