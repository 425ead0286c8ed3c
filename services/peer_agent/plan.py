"""Pure decisions of the peer agent: no I/O, no clock, nothing kept between calls.

- ``plan_leftovers``: which runs the backends still have alive are no longer ours
  (not a live row we own at that run's epoch) and must be killed.
- ``plan_reconcile``: given the local runs, the pending acceptances and the live rows
  Postgres says this peer owns — which runs to fence (no longer ours at their epoch),
  which to kill for a stored cancel, which pending entries to drop (stale), which
  assigned rows to add as pending, and which running rows to recover as orphans
  (no local run: a previous agent run died under them).
- ``merge_noticed`` / ``choose_starts``: assignment notices join the pending set; the
  pending jobs start in priority order within each backend's free slots.
- ``job_resources`` / ``free_resources``: what a run's job asked, and what each
  backend advertises free (its configured totals less what its runs asked).
- ``orphan_move`` / ``launch_error_move``: how a job ends when its run was lost or
  never started — the infrastructure-failure rule of ``irisfed.shared.retry``;
  ``outcome_unknown_move``: when it started and its engine lost how it ended (failed,
  never retried: it may have done its work).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from irisfed.services.peer_agent.backends import LiveRun
from irisfed.shared.cancel import cancelled_by, must_kill_run, under_cancel
from irisfed.shared.fencing import epoch_after
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import JobRow, Move, OwnedJob
from irisfed.shared.resources import DEFAULT_RESOURCES, ResourceError, as_resources
from irisfed.shared.retry import GIVE_UP, MAX_FREE_RESTARTS, after_infra_failure
from irisfed.shared.run_contract import grace_of, time_limit_of
from irisfed.shared.shorthands import duration_words


@dataclass(frozen=True, slots=True)
class Pending:
    """Assigned to us, not yet accepted (what to run comes back with the acceptance)."""

    job_id: str
    epoch: int
    backend: str
    priority: int
    tasks: int = 1  # a gang's tasks: the slots it takes


class RunState(Protocol):
    """What the plan reads of a local run (the agent's own record of a launched run)."""

    job_id: str
    epoch: int
    backend: str
    exit_code: int | None  # set once it ended: its report is being written
    cancel_requested: bool
    tasks: int  # slots it takes (a gang: one per task)
    accepted: bool  # its job is running (a gang: not until all its tasks run; its row stays assigned)


def backend_for(name: str | None, backends: Sequence[str]) -> str:
    """The backend a job runs on: the one its row names when we have it, else our first."""
    return name if name in backends else backends[0]


# ---------------------------------------------------------------- reconcile


@dataclass(frozen=True, slots=True)
class Leftover:
    """A run a backend still has alive that is not ours to run any more: kill it."""

    backend: str
    run: LiveRun
    owned_epoch: int | None  # the epoch our row has now (None: we own no such row)


def plan_leftovers(runs: Mapping[str, RunState], owned: Mapping[str, OwnedJob],
                   listed: Mapping[str, Sequence[LiveRun]]) -> list[Leftover]:
    """The runs of ``listed`` (backend → its live runs) to kill.

    Runs outlive a crashed agent (they have their own session). A run this agent
    did not launch may stay only while its job's row is ours, running, at that run's
    epoch — and that case is orphan recovery's (it kills and requeues). Runs this
    agent launched are fenced by ``plan_reconcile`` when they go stale.
    """
    kill = []
    for backend, leftovers in listed.items():
        for leftover in leftovers:
            mine = runs.get(leftover.job_id)
            if mine is not None and mine.epoch == leftover.epoch:
                continue  # launched by this agent: fenced by plan_reconcile when it goes stale
            row = owned.get(leftover.job_id)
            if (mine is None and row is not None and row.epoch == leftover.epoch
                    and row.state is JobState.RUNNING):
                continue  # still ours: an orphan, recovered (killed and requeued) by reconcile
            kill.append(Leftover(backend, leftover, row.epoch if row is not None else None))
    return kill


@dataclass(frozen=True, slots=True)
class ReconcilePlan:
    """What to change so that local work matches what Postgres says this peer owns."""

    fence: tuple[str, ...] = ()  # local runs no longer ours under their epoch: kill, report nothing
    cancel: tuple[str, ...] = ()  # local runs whose job has a stored cancel: kill, report killed
    drop_pending: tuple[str, ...] = ()  # pending acceptances gone stale
    add_pending: tuple[Pending, ...] = ()  # assigned rows not yet known here
    orphans: tuple[OwnedJob, ...] = ()  # running rows with no local run


def plan_reconcile(runs: Mapping[str, RunState], pending: Mapping[str, Pending],
                   owned_rows: Sequence[OwnedJob], backends: Sequence[str]) -> ReconcilePlan:
    """Compare local runs and pending work with ``owned_rows`` (in Postgres's order)."""
    owned = {row.job_id: row for row in owned_rows}
    fence, cancel = [], []
    for run in runs.values():
        if run.exit_code is not None:
            continue  # finished; its report is being written
        row = owned.get(run.job_id)
        # A gang launched but not accepted yet: its row is assigned at its epoch.
        expected = JobState.RUNNING if run.accepted else JobState.ASSIGNED
        if row is None or row.epoch != run.epoch or row.state is not expected:
            fence.append(run.job_id)
        elif must_kill_run(row.cancel_requested, run.cancel_requested):
            cancel.append(run.job_id)
    drop = [job_id for job_id, p in pending.items()
            if (row := owned.get(job_id)) is None or row.epoch != p.epoch or row.state is not JobState.ASSIGNED]
    kept = pending.keys() - set(drop)
    add, orphans = [], []
    for row in owned_rows:
        if row.job_id in runs or row.job_id in kept:
            continue
        if row.state is JobState.ASSIGNED:
            add.append(Pending(row.job_id, row.epoch, backend_for(row.backend, backends), row.priority,
                               row.replicas))
        else:
            orphans.append(row)
    return ReconcilePlan(tuple(fence), tuple(cancel), tuple(drop), tuple(add), tuple(orphans))


# ---------------------------------------------------------------- starting


def merge_noticed(pending: Mapping[str, Pending], noticed: Mapping[str, Pending],
                  runs: Mapping[str, RunState]) -> dict[str, Pending]:
    """``pending`` with what assignment notices told us: a job not running here, at a newer epoch."""
    merged = dict(pending)
    for job_id, notice in noticed.items():
        known = merged.get(job_id)
        if job_id not in runs and (known is None or known.epoch < notice.epoch):
            merged[job_id] = notice
    return merged


def choose_starts(pending: Mapping[str, Pending], runs: Iterable[RunState],
                  slots: Mapping[str, int]) -> list[Pending]:
    """Pending jobs to accept now: highest priority first, within each backend's free slots
    (a gang takes one per task, and waits for them all)."""
    busy: Counter = Counter()
    for run in runs:
        busy[run.backend] += run.tasks
    chosen = []
    for p in sorted(pending.values(), key=lambda p: -p.priority):
        if busy[p.backend] + p.tasks <= slots[p.backend]:
            busy[p.backend] += p.tasks
            chosen.append(p)
    return chosen


def free_slots(slots: Mapping[str, int], runs: Iterable[RunState], pending: Iterable[Pending]) -> dict[str, int]:
    """What each backend advertises as free: its slots less its runs' and pending jobs' tasks."""
    used: Counter = Counter()
    for item in (*runs, *pending):
        used[item.backend] += item.tasks
    return {name: max(0, total - used[name]) for name, total in slots.items()}


def job_resources(spec: Mapping[str, Any]) -> dict[str, float]:
    """What an accepted job asked (its stored spec, validated at submit); the default when unreadable."""
    try:
        return as_resources(spec.get("resources") or None).as_dict()
    except (ResourceError, AttributeError):
        return DEFAULT_RESOURCES.as_dict()


def job_gang(spec: Mapping[str, Any]) -> tuple[int, str]:
    """An accepted job's tasks and the node attribute they share (its stored spec,
    validated at submit): (1, "") for a single-task job."""
    replicas = spec.get("replicas", 1)
    coschedule = spec.get("coschedule") or {}
    group_by = coschedule.get("group_by", "") if isinstance(coschedule, Mapping) else ""
    return (replicas if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1 else 1,
            group_by if isinstance(group_by, str) else "")


def free_resources(backends: Iterable[Any], runs: Iterable[Any]) -> dict[str, dict[str, float]]:
    """What each backend advertises free of each resource it has: its configured total
    less what the jobs it runs asked, every task (``backends``: BackendSpecs, ``runs``: Runs)."""
    used: dict[str, Counter] = {}
    for run in runs:
        asked = getattr(run, "resources", {}) or {}
        tasks = getattr(run, "tasks", 1)
        used.setdefault(run.backend, Counter()).update({name: amount * tasks for name, amount in asked.items()})
    result = {}
    for spec in backends:
        taken = used.get(spec.name, Counter())
        result[spec.name] = {name: max(0.0, total - taken[name]) for name, total in spec.resources.items()}
    return result


# ---------------------------------------------------------------- runs lost or never started


def orphan_move(peer_id: str, row: OwnedJob, job: JobRow, now: datetime | None = None) -> Move:
    """End a running job of ours that has no run here (a previous agent run died under it).

    A stored cancel makes it ``killed``. A run past its time limit by ``now`` (its agent
    died while stopping it, or before) ends ``failed`` as its limit says, never run
    again. Otherwise it is handed back to the queue under a new epoch through no fault
    of the job (docs/design.md §3.7: ``irisfed up`` stopped, the agent killed),
    spending no retry, MAX_FREE_RESTARTS times; past them (a job that takes its agent
    down with it) each hand-back is an infrastructure failure like any other.
    """
    if under_cancel(JobState.QUEUED, row.cancel_requested) is JobState.KILLED:
        return Move(row.job_id, JobState.RUNNING, JobState.KILLED, row.epoch, actor=peer_id,
                    owner_peer_id=peer_id, reason=f"{cancelled_by(job.cancel_requested_by)} while its agent was down")
    limit = time_limit_of(job.spec)
    if limit is not None and job.started_at is not None and now is not None and (
            now - job.started_at).total_seconds() >= limit:
        return stopped_move(peer_id, row.job_id, row.epoch, time_limit_reason(limit), None)
    why = f"agent on {peer_id} restarted while running it"
    if job.restarts < MAX_FREE_RESTARTS:
        return Move(row.job_id, JobState.RUNNING, JobState.QUEUED, row.epoch, actor=peer_id, owner_peer_id=None,
                    new_epoch=epoch_after(JobState.RUNNING, JobState.QUEUED, row.epoch),
                    reason=f"{why}; running again (no retry spent)", no_fault=True)
    failure = after_infra_failure(job.attempts, job.max_retries, job.preemptions, job.spared)
    return Move(row.job_id, JobState.RUNNING, failure.to_state, row.epoch, actor=peer_id,
                owner_peer_id=failure.owner_after(peer_id),
                new_epoch=epoch_after(JobState.RUNNING, failure.to_state, row.epoch),
                reason=f"{why} again (past {MAX_FREE_RESTARTS} restarts that spend no retry); {failure.suffix}")


def launch_error_move(peer_id: str, job_id: str, epoch: int, error: str, job: JobRow | None,
                      lost: bool = False, cancelled: bool = False) -> Move:
    """End a job whose run could not start, or (``lost``) that its engine lost through no
    fault of the job (node failure, preemption): requeued (a new epoch) while retries
    remain, else failed; killed when a cancel was requested (``cancelled``, or stored on
    its row), never handed back to run again.

    ``job`` None: its row is no longer ours to read (the write's CAS will say so).
    """
    what = f"{'run lost' if lost else 'launch failed'}: {error}"
    return _handed_back(peer_id, job_id, epoch, JobState.RUNNING, what, job, cancelled, attempts_added=0,
                        out_of_retries="")


def gang_not_started_move(peer_id: str, job_id: str, epoch: int, why: str, job: JobRow | None,
                          cancelled: bool = False) -> Move:
    """Hand back an assigned gang whose tasks did not all start (``why``): the failed start
    counts as one (attempts + 1), so requeued while retries remain, else failed; killed
    when a cancel was requested. ``job`` None: no longer ours to read (the CAS will say)."""
    return _handed_back(peer_id, job_id, epoch, JobState.ASSIGNED, why, job, cancelled, attempts_added=1,
                        out_of_retries="; no retries left")


def _handed_back(peer_id: str, job_id: str, epoch: int, from_state: JobState, why: str, job: JobRow | None,
                 cancelled: bool, attempts_added: int, out_of_retries: str) -> Move:
    """A job of ours at ``epoch`` that failed through no fault of its own (``why``):
    requeued while retries remain (its attempts plus ``attempts_added``), else failed;
    killed when a cancel was requested (``cancelled``, or stored on its row)."""
    attempts = job.attempts + attempts_added if job is not None else 0
    failure = (after_infra_failure(attempts, job.max_retries, job.preemptions, job.spared) if job is not None
               else GIVE_UP)
    if under_cancel(failure.to_state, cancelled or (job is not None and job.cancel_requested)) is JobState.KILLED:
        asker = job.cancel_requested_by if job is not None else None
        return Move(job_id, from_state, JobState.KILLED, epoch, actor=peer_id, owner_peer_id=peer_id,
                    reason=f"{cancelled_by(asker)}; {why}")
    return Move(job_id, from_state, failure.to_state, epoch, actor=peer_id,
                owner_peer_id=failure.owner_after(peer_id),
                new_epoch=epoch_after(from_state, failure.to_state, epoch),
                reason=why + ("; retrying" if failure.retrying else out_of_retries))


def unusable_workspace_move(peer_id: str, job_id: str, epoch: int, why: str, cancelled: bool,
                            accepted: bool = True) -> Move:
    """End a job whose run never started because its workspace is unusable for good
    (refused archive, bytes not their digest, gone from the store): failed, not retried
    (another try would fetch the same bytes); killed when a cancel was requested. A gang
    not yet accepted (``accepted`` False) ends from ``assigned``."""
    from_state = JobState.RUNNING if accepted else JobState.ASSIGNED
    return Move(job_id, from_state, under_cancel(JobState.FAILED, cancelled), epoch, actor=peer_id,
                owner_peer_id=peer_id, reason=why)


def outcome_unknown_move(peer_id: str, job_id: str, epoch: int, why: str, cancelled: bool) -> Move:
    """End a job whose run started but whose outcome its engine lost (``RunOutcomeUnknown``):
    failed, never retried, since it may have done its work and a retry could run it
    twice (the user's failure class, not an infrastructure failure); killed when a
    cancel was requested. ``why`` is the reason recorded."""
    return Move(job_id, JobState.RUNNING, under_cancel(JobState.FAILED, cancelled), epoch, actor=peer_id,
                owner_peer_id=peer_id, reason=why)


def stopped_move(peer_id: str, job_id: str, epoch: int, why: str, exit_code: int | None) -> Move:
    """End a job whose run its agent stopped for the job's own rule (``why``: its time
    limit was reached, docs/design.md §3.7): failed, never retried."""
    return Move(job_id, JobState.RUNNING, JobState.FAILED, epoch, actor=peer_id, owner_peer_id=peer_id,
                reason=why, exit_code=exit_code)


def run_contract(spec: Mapping[str, Any], default_grace_s: float) -> tuple[float, float | None]:
    """A job's grace (its ``grace_s``, else the agent's default) and time limit (None: none)
    from its stored spec (docs/design.md §3.7)."""
    return grace_of(spec, default_grace_s), time_limit_of(spec)


def time_limit_reason(limit_s: float | None) -> str:
    """``time limit 30m reached`` (``90s``, ``1h30m``, ``2h``)."""
    return f"time limit {duration_words(limit_s or 0)} reached"
