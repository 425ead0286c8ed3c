"""What a peer agent writes about its runs, and announces once it is written.

Finished runs are reported in batches (one statement for all normal endings);
launch errors, runs whose outcome their engine lost, and orphans (running rows with
no run here) end their job through ``job_end_run``; a fenced copy
leaves a note in this peer's sync state. Only ``Unavailable`` (Postgres away) is
retried — the results are kept until Postgres answers. Any other failure of a
write sets that one run aside (logged, counted, not retried) and never holds back
the reports of the others. Every committed change is then announced on
``events.<job_id>``, best effort: Postgres already holds the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from nats.aio.client import Client

from irisfed.services.common import metrics
from irisfed.services.common.bus import publish_event
from irisfed.services.common.log import EventLogger
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.backends import TASK_ENDED, TASK_LOST, TASK_PENDING, RunHandle
from irisfed.services.peer_agent.plan import (
    gang_not_started_move,
    launch_error_move,
    orphan_move,
    outcome_unknown_move,
    stopped_move,
    unusable_workspace_move,
)
from irisfed.shared.clock import Clock
from irisfed.shared.errors import PermanentStoreError, Unavailable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import DEFAULT_GRACE_S, JobEvent
from irisfed.shared.records import Move, OwnedJob
from irisfed.shared.subjects import Subjects

log = EventLogger("peer-agent")


class ReportKind(StrEnum):
    """What a set-aside write was writing (the label of irisfed_agent_report_errors_total)."""

    FINISH = "finish"
    LAUNCH_ERROR = "launch_error"
    STALE_COPY = "stale_copy"
    ORPHAN = "orphan"
    TASKS = "tasks"


@dataclass
class Run:
    """A run this agent launched, and how it ended (what its report says)."""

    job_id: str
    epoch: int
    backend: str
    handle: RunHandle | None = None
    exit_code: int | None = None
    cancel_requested: bool = False
    fenced: bool = False
    launch_error: str = ""  # why it could not start, or (lost) why its engine lost it
    lost: bool = False
    outcome_unknown: bool = False  # it started and its engine lost how it ended: failed, not retried
    refused: bool = False  # never started: its workspace is unusable for good (failed, not retried)
    resources: Mapping[str, float] = field(default_factory=dict)  # what its job asked (normalised; each task's)
    tasks: int = 1  # a gang's tasks (the slots it takes)
    accepted: bool = True  # its job is running; a gang not yet (launched while assigned, until its tasks all run)
    grace_s: float = DEFAULT_GRACE_S  # SIGTERM to SIGKILL, whatever stops it (docs/design.md §3.7)
    time_limit_s: float | None = None
    limit_timer: asyncio.TimerHandle | None = None  # stops it when its time limit is reached
    stopping: bool = False  # its stop (SIGTERM, SIGKILL after its grace) is under way
    stopped_for: str = ""  # stopped by its agent for the job's own rule (the time limit): failed, with this reason


def _describe(exc: BaseException) -> str:
    return exc.detail if isinstance(exc, PermanentStoreError) else f"{type(exc).__name__}: {exc}"


class Reports:
    """The agent's status writes, over its store; ``runs`` is the agent's own table of runs."""

    def __init__(self, store: Store, peer_id: str, nc: Client, subjects: Subjects, clock: Clock,
                 runs: dict[str, Run], lock: asyncio.Lock) -> None:
        self.store = store
        self.peer_id = peer_id
        self.nc = nc
        self.subjects = subjects
        self.clock = clock
        self.runs = runs
        self.lock = lock  # the agent's: reconcile and reports see each other's effects
        self.finished: asyncio.Queue[Run] = asyncio.Queue()
        # job_id → epoch of runs whose status write failed permanently (e.g. permission
        # denied): logged and counted once, then left alone instead of retried forever.
        self.set_aside: dict[str, int] = {}

    # ------------------------------------------------------------ the report loop

    async def loop(self, linger_s: float, retry_s: float, on_freed: Callable[[], None]) -> None:
        """Report finished runs in batches, for ever: gather for ``linger_s``, write, free slots."""
        while True:
            batch = [await self.finished.get()]
            # Completions are not on anyone's critical path: a moment's wait lets a
            # burst of them share one statement and one commit.
            await asyncio.sleep(linger_s)
            while not self.finished.empty():
                batch.append(self.finished.get_nowait())
            while batch:
                try:
                    async with self.lock:
                        await self.report(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - results are never dropped
                    # Unavailable only (report() sets other errors aside): partitioned
                    # from Postgres, or its connection broke mid-statement. Keep what is
                    # left of the batch and report it when Postgres answers again.
                    metrics.DB_UNAVAILABLE.inc()
                    log.warning("report_deferred", jobs=len(batch), peer_id=self.peer_id, error=repr(exc))
                    await asyncio.sleep(retry_s)
            # Freed slots: the start loop takes pending work (a failure there is its
            # own, and never makes this batch be reported twice).
            on_freed()

    async def report(self, batch: list[Run]) -> None:
        """Write how ``batch``'s runs ended; each run leaves ``batch`` once settled.

        Settled: written (or refused by the CAS), or set aside after a permanent error.
        ``Unavailable`` propagates with the unsettled runs still in ``batch``, so a
        retry never writes a run twice. A gang's tasks are recorded first, while the job
        is still ours at that epoch.
        """
        gangs = [r for r in batch if r.tasks > 1 and r.handle is not None]
        if gangs:
            await self.guard(ReportKind.TASKS, gangs[0].job_id, gangs[0].epoch, self.record_tasks(gangs))
        for run in [r for r in batch if r.fenced or r.launch_error or r.stopped_for and not r.cancel_requested]:
            if run.fenced:
                await self._settle(batch, run, ReportKind.STALE_COPY, self.record_fenced(run.job_id, run.epoch))
            elif run.launch_error:
                await self._settle(batch, run, ReportKind.LAUNCH_ERROR, self._report_launch_error(run))
            else:
                await self._settle(batch, run, ReportKind.FINISH, self._report_stopped(run))
        normal = list(batch)
        if len(normal) <= 1:
            for run in normal:
                await self._settle(batch, run, ReportKind.FINISH, self._report_finished(normal))
            return
        try:
            await self._report_finished(normal)
        except Unavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad row must not sink the others
            log.warning("report_batch_failed", jobs=len(normal), peer_id=self.peer_id, error=_describe(exc))
            for run in normal:  # one by one
                await self._settle(batch, run, ReportKind.FINISH, self._report_finished([run]))
            return
        for run in normal:
            self._settled(batch, run)

    async def _settle(self, batch: list[Run], run: Run, kind: ReportKind, write: Awaitable[None]) -> None:
        """Await ``write`` (``run``'s report); a permanent error sets ``run`` aside."""
        await self.guard(kind, run.job_id, run.epoch, write)
        self._settled(batch, run)

    def _settled(self, batch: list[Run], run: Run) -> None:
        batch.remove(run)
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]

    async def guard(self, kind: ReportKind, job_id: str, epoch: int, write: Awaitable[object]) -> bool:
        """Await ``write``; True when it completed. ``Unavailable`` propagates (retry later);
        any other error sets (job, epoch) aside and returns False."""
        try:
            await write
        except Unavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - anything else fails the same way on every retry
            self._set_aside(kind, job_id, epoch, exc)
            return False
        return True

    def _set_aside(self, kind: ReportKind, job_id: str, epoch: int, exc: BaseException) -> None:
        """A status write that failed for good: log it, count it, and move on.

        The job's row stays as it was (visible to operators; Postgres is the truth) and
        this agent does not retry it; an agent restarted after the cause is fixed
        recovers it like any orphan.
        """
        self.set_aside[job_id] = epoch
        metrics.AGENT_REPORT_ERRORS.labels(kind).inc()
        log.error("report_set_aside", job_id=job_id, peer_id=self.peer_id, epoch=epoch, kind=kind,
                  error=_describe(exc))

    # ------------------------------------------------------------ the writes

    async def _report_finished(self, runs: list[Run]) -> None:
        """Runs that ended by their exit (or a kill): one statement, atomic on its own."""
        moved = await self.store.job_finish_batch(self.peer_id, [
            (r.job_id, r.epoch, r.exit_code, r.cancel_requested) for r in runs])
        now = self.clock.now()
        refused = [run.job_id for run in runs if run.job_id not in moved]
        if refused:  # ended after they were preempted: their runs are gone all the same
            await self.runs_stopped(refused)
        for run in runs:
            row = moved.get(run.job_id)
            if row is None:
                self._refused(run.job_id, run.epoch)
                continue
            again = row.state == JobState.QUEUED  # a failure retry: under a new epoch, no owner
            if not again:
                metrics.JOBS_FINISHED.labels(row.state).inc()
            log.info("job_finished", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                     state=row.state, exit_code=run.exit_code)
            await self.announce(JobEvent(run.job_id, row.state, "" if again else self.peer_id,
                                         run.epoch + 1 if again else run.epoch, now,
                                         exit_code=run.exit_code, reason=row.reason))

    async def _report_launch_error(self, run: Run) -> None:
        if run.refused:
            move = unusable_workspace_move(self.peer_id, run.job_id, run.epoch, run.launch_error,
                                           run.cancel_requested, accepted=run.accepted)
            ended = (await self.end_run(move) if run.accepted else await self.store.job_hand_back(
                self.peer_id, move.job_id, move.epoch, move.to_state, move.reason) is not None)
            if not ended:
                await self.runs_stopped([run.job_id])
                self._refused(run.job_id, run.epoch)
            elif not run.accepted:
                await self.announce(JobEvent(move.job_id, move.to_state, self.peer_id, move.epoch,
                                             self.clock.now(), reason=move.reason))
            return
        if not run.accepted:  # a gang whose tasks did not all start: handed back from assigned
            job = await self.store.job_get(run.job_id)
            move = gang_not_started_move(self.peer_id, run.job_id, run.epoch, run.launch_error, job,
                                         cancelled=run.cancel_requested)
            if await self.store.job_hand_back(self.peer_id, move.job_id, move.epoch, move.to_state,
                                              move.reason) is None:
                await self.runs_stopped([run.job_id])
                self._refused(run.job_id, run.epoch)
                return
            await self.announce(JobEvent(
                move.job_id, move.to_state, "" if move.to_state is JobState.QUEUED else self.peer_id,
                move.resulting_epoch, self.clock.now(), reason=move.reason))
            return
        if run.outcome_unknown:
            move = outcome_unknown_move(self.peer_id, run.job_id, run.epoch, run.launch_error, run.cancel_requested)
        else:
            job = await self.store.job_get(run.job_id)
            move = launch_error_move(self.peer_id, run.job_id, run.epoch, run.launch_error, job, lost=run.lost,
                                     cancelled=run.cancel_requested)
        if not await self.end_run(move):
            await self.runs_stopped([run.job_id])
            self._refused(run.job_id, run.epoch)

    async def _report_stopped(self, run: Run) -> None:
        """A run its agent stopped for the job's own rule (its time limit): failed, not
        retried, the reason saying why."""
        if not await self.end_run(stopped_move(self.peer_id, run.job_id, run.epoch, run.stopped_for, run.exit_code)):
            await self.runs_stopped([run.job_id])
            self._refused(run.job_id, run.epoch)

    async def record_tasks(self, runs: list[Run]) -> None:
        """Each gang task's node, state, exit code and log, as its backend knows them now
        (one statement for all; only jobs still ours at their epoch take rows). A task
        never started of a run its backend lost is ``lost``."""
        rows = []
        for run in runs:
            for task in run.handle.tasks():
                state = TASK_LOST if run.lost and task.state == TASK_PENDING else task.state
                rows.append((run.job_id, run.epoch, task.index, task.node, state, task.exit_code, task.log_path))
        if rows:
            await self.store.job_tasks_report(self.peer_id, rows)

    async def runs_stopped(self, job_ids: list[str]) -> None:
        """Our runs of ``job_ids`` are gone: those preempted (waiting for exactly that)
        may be placed again."""
        for job_id in await self.store.job_runs_stopped(self.peer_id, job_ids):
            log.info("preempted_run_stopped", job_id=job_id, peer_id=self.peer_id)

    def _refused(self, job_id: str, epoch: int) -> None:
        metrics.FENCED_WRITES.inc()
        log.warning("fenced_write_refused", job_id=job_id, peer_id=self.peer_id, epoch=epoch)

    async def record_fenced(self, job_id: str, epoch: int) -> None:
        """Record that this peer killed its stale copy (job, epoch), where operators look for a
        peer's view of a job: its sync state row (a row of its own, which an agent role
        may write even for a job it no longer sees); a preempted job waiting for that run
        to stop is then free to be placed again. A permanent error writing it sets
        the note aside; ``Unavailable`` propagates (the caller tries again later)."""
        now_epoch = epoch

        async def write() -> None:
            nonlocal now_epoch
            last = await self.store.changelog_get_last_for_job(job_id)
            now_epoch = last.epoch if last else epoch
            note = f"stale copy killed: epoch {epoch} superseded by {now_epoch}"
            await self.store.sync_state_upsert(job_id, self.peer_id, last.seq if last else 0, epoch, note=note)
            await self.runs_stopped([job_id])

        await self.guard(ReportKind.STALE_COPY, job_id, epoch, write())
        metrics.STALE_COPIES_KILLED.inc()
        log.warning("stale_copy_killed", job_id=job_id, peer_id=self.peer_id, epoch=epoch, current_epoch=now_epoch)

    async def recover_orphan(self, row: OwnedJob, leftover_killed: bool) -> None:
        """End a running job of ours that has no run here (``orphan_move``)."""
        moved: list[Move] = []

        async def write() -> None:
            job = await self.store.job_get(row.job_id)
            if job is None:
                return  # no longer ours since the row was read: nothing to recover
            move = orphan_move(self.peer_id, row, job, self.clock.now())
            if await self.end_run(move):
                moved.append(move)

        if row.replicas > 1:  # every task it left behind is killed (or gone): none runs any more
            await self.guard(ReportKind.TASKS, row.job_id, row.epoch, self._tasks_lost(row))
        if await self.guard(ReportKind.ORPHAN, row.job_id, row.epoch, write()) and moved:
            log.warning("orphan_recovered", job_id=row.job_id, peer_id=self.peer_id, epoch=row.epoch,
                        state=moved[0].to_state.value, leftover_killed=leftover_killed)

    async def _tasks_lost(self, row: OwnedJob) -> None:
        """The tasks of ``row``'s run left behind are ``lost``, except those its rows
        already say ended (written before the agent died: how they ended stays)."""
        ended = {task.task_index for task in await self.store.job_tasks_list(row.job_id)
                 if task.epoch == row.epoch and task.state in TASK_ENDED}
        lost = [(row.job_id, row.epoch, i, None, TASK_LOST, None, None)
                for i in range(row.replicas) if i not in ended]
        if lost:
            await self.store.job_tasks_report(self.peer_id, lost)

    async def end_run(self, move: Move) -> bool:
        """End one of our running jobs as ``move`` says, then announce it.

        Handed back to the queue (a new epoch, no owner), failed or killed: one statement
        (``job_end_run``) does the CAS on (state, epoch, owner), the changelog row and
        our sync state. False: the CAS lost (the job is no longer ours at that epoch).
        """
        seq = await self.store.job_end_run(self.peer_id, move.job_id, move.epoch, move.to_state,
                                           move.reason, move.exit_code, no_fault=move.no_fault)
        if seq is None:
            return False
        handed_back = move.to_state is JobState.QUEUED
        # The epoch job_end_run wrote: Postgres decides it, by the rule the plan
        # applied (irisfed.shared.fencing; tests/integration/test_rules_in_sql.py).
        await self.announce(JobEvent(
            move.job_id, move.to_state, "" if handed_back else self.peer_id, move.resulting_epoch, self.clock.now(),
            exit_code=move.exit_code, reason=move.reason,
        ))
        return True

    async def announce(self, event: JobEvent) -> None:
        """Publish a committed change, best effort: Postgres already holds the truth, and
        a failed publish must not make the write look failed (and be written again)."""
        if not self.nc.is_connected:
            return
        try:
            await publish_event(self.nc, self.subjects, event)
        except Exception as exc:  # noqa: BLE001 - watchers also read Postgres
            log.warning("event_publish_failed", job_id=event.job_id, peer_id=self.peer_id,
                        epoch=event.epoch, error=repr(exc))
