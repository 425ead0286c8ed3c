"""The peer agent: one per cluster.

It advertises its backends on ``heartbeat.<self>`` (and in ``peer_heartbeat``)
every interval; listens on ``assign.<self>`` and ``cancel.<self>``; and
reconciles with Postgres at start, on NATS reconnect and periodically, so a
missed message delays work but never loses it. It accepts a job with a
compare-and-set on its epoch (assigned → running), runs it on its backend,
writes the terminal state with the exit code under the same epoch, records
``federation_sync_state`` and publishes ``events.<job_id>``. A write refused
because the epoch moved on means the job was fenced away: the local copy is
killed and nothing is reported for it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common import metrics
from services.common.bus import publish
from services.common.db import is_transient
from services.common.faults import crash_point
from services.common.log import EventLogger
from services.common.runtime import TaskOwner, forever, when_woken
from services.common.store import Store
from services.peer_agent.backends import (
    Backend,
    LaunchError,
    LiveRun,
    RunHandle,
    RunSpec,
    SimulatedBackend,
    SubprocessBackend,
)
from shared.config import FederationConfig
from shared.lifecycle import JobState
from shared.messages import (
    AssignmentNotice,
    BackendAd,
    CancelNotice,
    Capacity,
    Heartbeat,
    JobEvent,
    decode_internal,
)
from shared.records import Move
from shared.retry import may_retry_infra_failure

log = EventLogger("peer-agent")


@dataclass(frozen=True)
class BackendSpec:
    """One backend this agent offers: its kind, advertised attributes and slots."""

    name: str
    kind: str = "subprocess"
    attributes: dict[str, list[str]] = field(default_factory=dict)
    slots: int = 4


@dataclass(frozen=True)
class AgentSettings:
    peer_id: str
    backends: tuple[BackendSpec, ...]
    work_root: Path = Path(".irisfed/work")
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 6.0
    reconcile_interval_s: float = 2.0
    kill_grace_s: float = 5.0
    simulated_duration_s: float = 0.0
    report_linger_s: float = 0.01  # gather finished runs this long before writing them


@dataclass
class _Run:
    job_id: str
    epoch: int
    backend: str
    handle: RunHandle | None = None
    exit_code: int | None = None
    cancel_requested: bool = False
    fenced: bool = False
    launch_error: str = ""


@dataclass
class _Pending:
    """Assigned to us, not yet accepted (what to run comes back with the acceptance)."""

    job_id: str
    epoch: int
    backend: str
    priority: int


class PeerAgent:
    """Runs the jobs the federation assigns to one peer."""

    def __init__(self, config: FederationConfig, pool: asyncpg.Pool, nc: Client,
                 settings: AgentSettings) -> None:
        self.config = config
        self.subjects = config.subjects
        self.pool = pool
        self.store = Store(pool)
        self.nc = nc
        self.settings = settings
        self.peer_id = settings.peer_id
        self.run_id = uuid.uuid4().hex
        self.seq = 0
        self._db_shape: list | None = None  # the advertisement last written to Postgres
        self.backends: dict[str, Backend] = {}
        for spec in settings.backends:
            if spec.kind == "simulated":
                self.backends[spec.name] = SimulatedBackend(settings.simulated_duration_s)
            else:
                self.backends[spec.name] = SubprocessBackend(settings.work_root / self.peer_id)
        self.specs = {spec.name: spec for spec in settings.backends}
        self.runs: dict[str, _Run] = {}
        self.pending: dict[str, _Pending] = {}
        # Assignment notices heard since the last start; merged into ``pending`` under
        # the lock, so a reconcile in progress never drops one it could not yet see.
        self.noticed: dict[str, _Pending] = {}
        self.start_wanted = asyncio.Event()
        # Reconcile and job transitions take this lock so each sees the other's effects.
        self.lock = asyncio.Lock()
        self.reconcile_wanted = asyncio.Event()
        self.finished: asyncio.Queue[_Run] = asyncio.Queue()
        self.reconciled = 0
        # job_id → epoch of runs whose status write failed permanently (e.g. permission
        # denied): logged and counted once, then left alone instead of retried forever.
        self.set_aside: dict[str, int] = {}
        self.tasks = TaskOwner()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.assign(self.peer_id), cb=self.on_assign)
        await self.nc.subscribe(self.subjects.cancel_notice(self.peer_id), cb=self.on_cancel)
        await self.nc.flush()
        await self.heartbeat()
        await self.reconcile()
        self.tasks.spawn(forever("heartbeat", self.heartbeat, self.settings.heartbeat_interval_s),
                         name="agent-heartbeat")
        self.tasks.spawn(when_woken("reconcile", self.reconcile, self.reconcile_wanted,
                                    self.settings.reconcile_interval_s), name="agent-reconcile")
        self.tasks.spawn(self._report_loop(), name="agent-report")
        self.tasks.spawn(when_woken("start", self._start_noticed, self.start_wanted,
                                    self.settings.reconcile_interval_s), name="agent-start")
        log.info("agent_started", peer_id=self.peer_id, run_id=self.run_id,
                 backends=",".join(f"{s.name}:{s.kind}x{s.slots}" for s in self.settings.backends))

    async def close(self) -> None:
        """Stop: kill what we run (its rows stay `running`; our next start recovers them)."""
        await self.tasks.close()
        for run in list(self.runs.values()):
            if run.handle is not None and run.exit_code is None:
                await run.handle.kill(self.settings.kill_grace_s)

    async def on_reconnect(self) -> None:
        self.reconcile_wanted.set()

    # ------------------------------------------------------------ heartbeat

    def advertisement(self) -> list[BackendAd]:
        metrics.RUNNING_JOBS.set(len(self.runs))
        ads = []
        for spec in self.settings.backends:
            busy = sum(1 for r in self.runs.values() if r.backend == spec.name)
            waiting = sum(1 for p in self.pending.values() if p.backend == spec.name)
            free = max(0, spec.slots - busy - waiting)
            ads.append(BackendAd(spec.name, spec.attributes, Capacity(spec.slots, free)))
        return ads

    async def heartbeat(self) -> None:
        """Advertise on NATS; write Postgres only when NATS cannot carry it or it changed.

        Ticks write the heartbeats they hear into ``peer_heartbeat`` in one batch per
        interval, so a healthy federation pays about one commit per interval for all
        peers. An agent writes its own row at start, when its shape changes (not its
        free slots, which the tick derives from Postgres), and whenever it is cut off
        from NATS, which keeps a NATS-partitioned peer reachable through Postgres.
        """
        self.seq += 1
        message = Heartbeat(
            peer_id=self.peer_id, seq=self.seq, sent_at=datetime.now(UTC),
            ttl_s=self.settings.heartbeat_ttl_s, backends=self.advertisement(), run_id=self.run_id,
        )
        if self.nc.is_connected:
            await publish(self.nc, self.subjects.heartbeat(self.peer_id), message)
        shape = [(b.name, b.attributes, b.capacity.total) for b in message.backends]
        if self.nc.is_connected and shape == self._db_shape:
            return
        await self.store.peer_heartbeat_upsert(
            self.peer_id, self.run_id, self.seq, msgspec.to_builtins(message.backends),
            message.ttl_s, message.sent_at,
        )
        self._db_shape = shape

    # ------------------------------------------------------------ messages

    async def on_assign(self, msg: Msg) -> None:
        try:
            notice = decode_internal(AssignmentNotice, msg.data)
        except Exception as exc:  # noqa: BLE001
            log.warning("assign_notice_ignored", error=str(exc))
            return
        log.debug("assign_notice", job_id=notice.job_id, peer_id=self.peer_id, epoch=notice.epoch)
        if notice.peer_id != self.peer_id:
            return
        if not notice.backend:  # from a sender that predates the field: read the job first
            self.reconcile_wanted.set()
            return
        # Accepted straight from the notice; the CAS on (state, epoch, owner) in
        # job_start_batch refuses anything stale, and reconcile covers lost notices.
        self.noticed[notice.job_id] = _Pending(notice.job_id, notice.epoch, self._backend_for(notice.backend),
                                               notice.priority)
        self.start_wanted.set()

    async def _start_noticed(self) -> None:
        async with self.lock:
            await self._start_pending()

    async def on_cancel(self, msg: Msg) -> None:
        try:
            notice = decode_internal(CancelNotice, msg.data)
        except Exception as exc:  # noqa: BLE001
            log.warning("cancel_notice_ignored", error=str(exc))
            return
        async with self.lock:
            self.pending.pop(notice.job_id, None)
            run = self.runs.get(notice.job_id)
            if run is not None and run.epoch == notice.epoch and not run.cancel_requested:
                await self._kill(run, cancel=True)
        self.reconcile_wanted.set()

    # ------------------------------------------------------------ reconcile

    async def reconcile(self) -> None:
        """Make local runs match what Postgres says this peer owns, then start work."""
        async with self.lock:
            rows = await self.store.job_live_for_owner(self.peer_id)
            owned = {row["job_id"]: row for row in rows}
            await self._stop_leftovers(owned)
            for run in list(self.runs.values()):
                row = owned.get(run.job_id)
                if run.exit_code is not None:
                    continue  # finished; its report is being written
                if row is None or row["epoch"] != run.epoch or row["state"] != JobState.RUNNING.value:
                    await self._fence(run, "the job is no longer ours under this epoch")
                elif row["cancel_requested"] and not run.cancel_requested:
                    await self._kill(run, cancel=True)
            for job_id, pending in list(self.pending.items()):
                row = owned.get(job_id)
                if row is None or row["epoch"] != pending.epoch or row["state"] != JobState.ASSIGNED.value:
                    del self.pending[job_id]
            for row in rows:
                job_id = row["job_id"]
                if job_id in self.runs or job_id in self.pending:
                    continue
                if row["state"] == JobState.ASSIGNED.value:
                    self.pending[job_id] = _Pending(job_id, row["epoch"], self._backend_for(row["backend"]),
                                                    row["priority"])
                else:
                    await self._recover_orphan(row)
            await self._start_pending()
        self.reconciled += 1

    async def _stop_leftovers(self, owned: dict[str, asyncpg.Record]) -> None:
        """Kill every run our backends still have alive that is not ours to run any more.

        Runs outlive a crashed agent (they have their own session). A run this agent
        object did not launch may stay only while its job's row is ours, running, at
        that run's epoch — and that case is orphan recovery's (it kills and requeues).
        Anything else (the job moved on to another peer or epoch, or ended) is a stale
        copy: killed and recorded like a fenced run.
        """
        for name, backend in self.backends.items():
            try:
                leftovers = await backend.list_runs()
            except Exception as exc:  # noqa: BLE001 - the next reconcile looks again
                log.warning("leftover_scan_failed", peer_id=self.peer_id, backend=name, error=repr(exc))
                continue
            for leftover in leftovers:
                mine = self.runs.get(leftover.job_id)
                if mine is not None and mine.epoch == leftover.epoch:
                    continue  # launched by this agent object: fenced above when it goes stale
                row = owned.get(leftover.job_id)
                if (mine is None and row is not None and row["epoch"] == leftover.epoch
                        and row["state"] == JobState.RUNNING.value):
                    continue  # still ours: _recover_orphan kills it and requeues the job
                await self._kill_leftover_run(name, backend, leftover, row)

    async def _kill_leftover_run(self, name: str, backend: Backend, leftover: LiveRun,
                                 row: asyncpg.Record | None) -> None:
        if not await backend.kill_run(leftover):
            return  # ended (or turned out not ours) meanwhile
        log.warning("leftover_run_killed", job_id=leftover.job_id, peer_id=self.peer_id,
                    epoch=leftover.epoch, backend=name, handle=leftover.handle,
                    owned_epoch=row["epoch"] if row is not None else None)
        # Recorded like any fenced copy: sync-state note, metric, log line.
        await self._record_fenced(_Run(leftover.job_id, leftover.epoch, name, fenced=True))

    def _backend_for(self, name: str | None) -> str:
        if name in self.backends:
            return name
        return self.settings.backends[0].name

    async def _recover_orphan(self, row: asyncpg.Record) -> None:
        """A `running` row with no local run: a previous agent run died under it.

        A permanent database error sets the job aside (logged, counted) instead of
        stopping the agent; a transient one propagates and the next reconcile retries.
        """
        job_id, epoch = row["job_id"], row["epoch"]
        if self.set_aside.get(job_id) == epoch:
            return  # its write failed for good before: not retried every interval
        backend = self.backends[self._backend_for(row["backend"])]
        killed = backend.kill_leftover(job_id, epoch)
        try:
            job = await self.store.job_get(job_id)
            if job is None:
                return  # no longer ours since the row was read: nothing to recover
            retry = may_retry_infra_failure(job["attempts"], job["max_retries"])
            if row["cancel_requested"]:
                move = Move(job_id, JobState.RUNNING, JobState.KILLED, epoch, actor=self.peer_id,
                            owner_peer_id=self.peer_id, reason="cancelled while its agent was down")
            elif retry:
                move = Move(job_id, JobState.RUNNING, JobState.QUEUED, epoch, actor=self.peer_id,
                            owner_peer_id=None, new_epoch=epoch + 1,
                            reason=f"agent on {self.peer_id} restarted while running it; retrying")
            else:
                move = Move(job_id, JobState.RUNNING, JobState.FAILED, epoch, actor=self.peer_id,
                            owner_peer_id=self.peer_id,
                            reason=f"agent on {self.peer_id} restarted while running it; no retries left")
            written = await self._write(move)
        except Exception as exc:  # noqa: BLE001 - classified: transient ones propagate
            if is_transient(exc):
                raise
            self._set_aside("orphan", job_id, epoch, exc)
            return
        if written:
            log.warning("orphan_recovered", job_id=job_id, peer_id=self.peer_id, epoch=epoch,
                        state=move.to_state.value, leftover_killed=killed)

    async def _start_pending(self) -> None:
        """Accept as many pending jobs as there are free slots: one statement for all."""
        noticed, self.noticed = self.noticed, {}
        for job_id, pending in noticed.items():
            known = self.pending.get(job_id)
            if job_id not in self.runs and (known is None or known.epoch < pending.epoch):
                self.pending[job_id] = pending
        busy: dict[str, int] = {}
        for run in self.runs.values():
            busy[run.backend] = busy.get(run.backend, 0) + 1
        chosen = []
        for pending in sorted(self.pending.values(), key=lambda p: -p.priority):
            if busy.get(pending.backend, 0) < self.specs[pending.backend].slots:
                busy[pending.backend] = busy.get(pending.backend, 0) + 1
                chosen.append(pending)
        if not chosen:
            return
        for pending in chosen:
            del self.pending[pending.job_id]
        log_dirs = [self._log_dir(p) for p in chosen]
        # One statement (job, changelog, sync state): atomic without BEGIN/COMMIT round trips.
        async with self.pool.acquire() as conn:
            accepted = await self.store.job_start_batch(
                conn, self.peer_id, [(p.job_id, p.epoch, d, f"running on {self.peer_id}/{p.backend}")
                                     for p, d in zip(chosen, log_dirs, strict=True)])
        crash_point("agent_after_accept")
        now = datetime.now(UTC)
        started = []
        # Committed: every accepted job is launched first, whatever NATS does next.
        for pending in chosen:
            row = accepted.get(pending.job_id)
            if row is None:
                log.info("accept_lost", job_id=pending.job_id, peer_id=self.peer_id, epoch=pending.epoch)
                continue
            pending.backend = self._backend_for(row["backend"])  # the row decides, not the notice
            await self._launch(pending, row["spec"])
            started.append(pending)
        # Then the events, best effort (_announce logs a failed publish): Postgres
        # already holds the truth, and NATS gone mid-batch must not strand the rest.
        for pending in started:
            await self._announce(JobEvent(
                pending.job_id, JobState.RUNNING.value, self.peer_id, pending.epoch, now,
                reason=f"running on {self.peer_id}/{pending.backend}"))

    def _log_dir(self, pending: _Pending) -> str | None:
        backend = self.backends[pending.backend]
        if isinstance(backend, SubprocessBackend):
            return str(backend.run_dir(pending.job_id, pending.epoch).resolve())
        return None

    async def _launch(self, pending: _Pending, spec: dict) -> None:
        job_id, epoch = pending.job_id, pending.epoch
        run = _Run(job_id, epoch, pending.backend)
        self.runs[job_id] = run
        try:
            run.handle = await self.backends[pending.backend].launch(RunSpec(
                job_id, epoch, list(spec["command"]), dict(spec.get("env", {})),
                dict(spec.get("labels", {})),
            ))
        except Exception as exc:  # noqa: BLE001 - any failure to start is a launch error
            run.launch_error = str(exc) if isinstance(exc, LaunchError) else repr(exc)
            run.exit_code = -1
            log.warning("launch_failed", job_id=job_id, peer_id=self.peer_id, epoch=epoch, error=str(exc))
        log.debug("job_started", job_id=job_id, peer_id=self.peer_id, epoch=epoch)
        self.tasks.spawn(self._finish(run), name=f"run-{job_id}")

    # ------------------------------------------------------------ finishing

    async def _finish(self, run: _Run) -> None:
        if run.handle is not None:
            run.exit_code = await run.handle.wait()
        self.finished.put_nowait(run)

    async def _report_loop(self) -> None:
        """Report finished runs in batches: one statement for all normal endings.

        Only transient errors (Postgres unreachable, the connection lost, a timeout) are
        retried, keeping the results until Postgres answers. A permanent error sets that
        one run aside (``_set_aside``) and never holds back the reports of the others.
        """
        while True:
            batch = [await self.finished.get()]
            # Completions are not on anyone's critical path: a moment's wait lets a
            # burst of them share one statement and one commit.
            await asyncio.sleep(self.settings.report_linger_s)
            while not self.finished.empty():
                batch.append(self.finished.get_nowait())
            while batch:
                try:
                    async with self.lock:
                        await self._report(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - results are never dropped
                    # Transient only (_report sets permanent errors aside): partitioned
                    # from Postgres, or its connection broke mid-statement. Keep what is
                    # left of the batch and report it when Postgres answers again.
                    metrics.DB_UNAVAILABLE.inc()
                    log.warning("report_deferred", jobs=len(batch), peer_id=self.peer_id, error=repr(exc))
                    await asyncio.sleep(self.settings.reconcile_interval_s)
            # Freed slots: the start loop takes pending work (a failure there is its
            # own, and never makes this batch be reported twice).
            self.start_wanted.set()

    async def _report(self, batch: list[_Run]) -> None:
        """Write how ``batch``'s runs ended; each run leaves ``batch`` once settled.

        Settled: written (or refused by the CAS), or set aside after a permanent error.
        A transient error propagates with the unsettled runs still in ``batch``, so a
        retry never writes a run twice.
        """
        for run in [r for r in batch if r.fenced or r.launch_error]:
            if run.fenced:
                await self._settle(batch, run, "stale_copy", self._record_fenced(run))
            else:
                await self._settle(batch, run, "launch_error", self._report_launch_error(run))
        normal = list(batch)
        if len(normal) <= 1:
            for run in normal:
                await self._settle(batch, run, "finish", self._report_finished(normal))
            return
        try:
            await self._report_finished(normal)
        except Exception as exc:  # noqa: BLE001 - classified: transient ones propagate
            if is_transient(exc):
                raise
            # One bad row must not sink the others: report them one by one.
            log.warning("report_batch_failed", jobs=len(normal), peer_id=self.peer_id,
                        error=f"{type(exc).__name__}: {exc}")
            for run in normal:
                await self._settle(batch, run, "finish", self._report_finished([run]))
            return
        for run in normal:
            self._settled(batch, run)

    async def _settle(self, batch: list[_Run], run: _Run, kind: str, write: Awaitable[None]) -> None:
        """Await ``write`` (``run``'s report); a permanent error sets ``run`` aside."""
        try:
            await write
        except Exception as exc:  # noqa: BLE001 - classified: transient ones propagate
            if is_transient(exc):
                raise
            self._set_aside(kind, run.job_id, run.epoch, exc)
        self._settled(batch, run)

    def _settled(self, batch: list[_Run], run: _Run) -> None:
        batch.remove(run)
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]

    def _set_aside(self, kind: str, job_id: str, epoch: int, exc: BaseException) -> None:
        """A status write that failed for good: log it, count it, and move on.

        The job's row stays as it was (visible to operators; Postgres is the truth) and
        this agent does not retry it; an agent restarted after the cause is fixed
        recovers it like any orphan.
        """
        self.set_aside[job_id] = epoch
        metrics.AGENT_REPORT_ERRORS.labels(kind).inc()
        log.error("report_set_aside", job_id=job_id, peer_id=self.peer_id, epoch=epoch, kind=kind,
                  error=f"{type(exc).__name__}: {exc}")

    async def _report_finished(self, runs: list[_Run]) -> None:
        """Runs that ended by their exit (or a kill): one statement, atomic on its own."""
        async with self.pool.acquire() as conn:
            moved = await self.store.job_finish_batch(conn, self.peer_id, [
                (r.job_id, r.epoch, r.exit_code, r.cancel_requested) for r in runs])
        now = datetime.now(UTC)
        for run in runs:
            row = moved.get(run.job_id)
            if row is None:
                metrics.FENCED_WRITES.inc()
                log.warning("fenced_write_refused", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch)
                continue
            metrics.JOBS_FINISHED.labels(row["state"]).inc()
            log.info("job_finished", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                     state=row["state"], exit_code=run.exit_code)
            await self._announce(JobEvent(run.job_id, row["state"], self.peer_id, run.epoch, now,
                                          exit_code=run.exit_code, reason=row["reason"]))

    async def _record_fenced(self, run: _Run) -> None:
        """Record that this peer killed its stale copy, where operators look for a
        peer's view of a job: its sync state row (a row of its own, which an agent role
        may write even for a job it no longer sees). A permanent error writing it sets
        the note aside; a transient one propagates (the caller tries again later)."""
        now_epoch = run.epoch
        try:
            last = await self.store.changelog_last_for_job(run.job_id)
            now_epoch = last["epoch"] if last else run.epoch
            note = f"stale copy killed: epoch {run.epoch} superseded by {now_epoch}"
            await self.store.sync_state_upsert(run.job_id, self.peer_id, last["seq"] if last else 0,
                                               run.epoch, note=note)
        except Exception as exc:  # noqa: BLE001 - classified: transient ones propagate
            if is_transient(exc):
                raise
            self._set_aside("stale_copy", run.job_id, run.epoch, exc)
        metrics.STALE_COPIES_KILLED.inc()
        log.warning("stale_copy_killed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                    current_epoch=now_epoch)

    async def _report_launch_error(self, run: _Run) -> None:
        job = await self.store.job_get(run.job_id)
        retry = job is not None and may_retry_infra_failure(job["attempts"], job["max_retries"])
        move = Move(run.job_id, JobState.RUNNING, JobState.QUEUED if retry else JobState.FAILED,
                    run.epoch, actor=self.peer_id,
                    owner_peer_id=None if retry else self.peer_id,
                    new_epoch=run.epoch + 1 if retry else None,
                    reason=f"launch failed: {run.launch_error}" + ("; retrying" if retry else ""))
        if not await self._write(move):
            metrics.FENCED_WRITES.inc()
            log.warning("fenced_write_refused", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch)

    async def _kill(self, run: _Run, cancel: bool) -> None:
        run.cancel_requested = run.cancel_requested or cancel
        if run.handle is not None:
            self.tasks.spawn(run.handle.kill(self.settings.kill_grace_s), name=f"kill-{run.job_id}")

    async def _fence(self, run: _Run, why: str) -> None:
        run.fenced = True
        log.warning("fencing_local_copy", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch, why=why)
        if run.handle is not None:
            self.tasks.spawn(run.handle.kill(self.settings.kill_grace_s), name=f"fence-{run.job_id}")

    # ------------------------------------------------------------ writes

    async def _write(self, move: Move) -> bool:
        """End one of our running jobs as ``move`` says, then announce it.

        Handed back to the queue (epoch + 1, no owner), failed or killed: one statement
        (``job_end_run``) does the CAS on (state, epoch, owner), the changelog row and
        our sync state. False: the CAS lost (the job is no longer ours at that epoch).
        """
        seq = await self.store.job_end_run(self.peer_id, move.job_id, move.epoch, move.to_state,
                                           move.reason, move.exit_code)
        if seq is None:
            return False
        handed_back = move.to_state is JobState.QUEUED
        await self._announce(JobEvent(
            move.job_id, move.to_state.value, "" if handed_back else self.peer_id,
            move.epoch + 1 if handed_back else move.epoch, datetime.now(UTC),
            exit_code=move.exit_code, reason=move.reason,
        ))
        return True

    async def _announce(self, event: JobEvent) -> None:
        """Publish a committed change, best effort: Postgres already holds the truth, and
        a failed publish must not make the write look failed (and be written again)."""
        if not self.nc.is_connected:
            return
        try:
            await publish(self.nc, self.subjects.events(event.job_id), event)
        except Exception as exc:  # noqa: BLE001 - watchers also read Postgres
            log.warning("event_publish_failed", job_id=event.job_id, peer_id=self.peer_id,
                        epoch=event.epoch, error=repr(exc))
