"""The job lifecycle: states and the one table of allowed transitions.

Who moves a job:
- router: (new) → queued | assigned (LOCAL) | rejected; queued/assigned → killed on cancel
- scheduler tick: queued → assigned; queued → unschedulable (deadline passed);
  queued → killed (a stored cancel, met when it claims the job); assigned/running →
  queued | failed | killed when the owner peer is lost (retried, out of retries, or
  a stored cancel: ``irisfed.shared.cancel``)
- peer agent: assigned → running → succeeded | failed | killed (its run's exit, or a
  kill); running → queued | failed (a launch error, or a run lost when the agent
  restarted: ``irisfed.shared.retry``) | killed (a cancel stored while it was down);
  assigned → queued | failed | killed (a gang, running only once all its tasks run,
  whose tasks did not all start)

The database enforces the same moves with compare-and-set updates
(``... WHERE state = $old AND epoch = $epoch``).
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """A job's state. Persisted in ``jobs.state``: append only."""

    QUEUED = "queued"
    ASSIGNED = "assigned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    REJECTED = "rejected"
    UNSCHEDULABLE = "unschedulable"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.KILLED, JobState.REJECTED, JobState.UNSCHEDULABLE}
)
ACTIVE_STATES = frozenset({JobState.ASSIGNED, JobState.RUNNING})

# The states a job may be created in (changelog rows with from_state NULL).
INITIAL_STATES = frozenset({JobState.QUEUED, JobState.ASSIGNED, JobState.REJECTED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # Nothing fails a job that never started: a queued job is placed, killed by a
    # cancel, or expires at its deadline.
    JobState.QUEUED: frozenset(
        {JobState.ASSIGNED, JobState.KILLED, JobState.UNSCHEDULABLE}
    ),
    JobState.ASSIGNED: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.KILLED, JobState.FAILED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.KILLED, JobState.QUEUED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.KILLED: frozenset(),
    JobState.REJECTED: frozenset(),
    JobState.UNSCHEDULABLE: frozenset(),
}


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow."""


def can_transition(old: JobState | None, new: JobState) -> bool:
    """Whether a job may move from ``old`` (None: not yet created) to ``new``."""
    if old is None:
        return new in INITIAL_STATES
    return new in TRANSITIONS[old]


def check_transition(old: JobState | None, new: JobState) -> None:
    """Raise IllegalTransition unless ``old`` → ``new`` is allowed."""
    if not can_transition(old, new):
        shown = old.value if old is not None else "(new)"
        raise IllegalTransition(f"a job cannot move from {shown} to {new.value}")


def sources_of(new: JobState) -> frozenset[JobState]:
    """Every state from which a job may move to ``new``."""
    return frozenset(old for old, targets in TRANSITIONS.items() if new in targets)


class CancelOutcome(StrEnum):
    """What a cancel request did: the ``outcome`` of a cancel reply. Wire values: append only."""

    NEVER_STARTED = "never_started"
    NOT_RESTARTED = "not_restarted"
    KILL_SENT = "kill_sent"
    PENDING_OWNER_OFFLINE = "pending_owner_offline"
    ALREADY_FINISHED = "already_finished"
    ALREADY_REQUESTED = "already_requested"

    @property
    def meaning(self) -> str:
        """One sentence for people (CLI output, the changelog's detail of a kill)."""
        return _CANCEL_MEANINGS[self]


_CANCEL_MEANINGS = {
    CancelOutcome.NEVER_STARTED: "the job had not started; it is killed and will never run",
    CancelOutcome.NOT_RESTARTED: "the job was waiting to run again after losing its peer; it will not run again",
    CancelOutcome.KILL_SENT: "the owner peer is online; it was told to kill the job",
    CancelOutcome.PENDING_OWNER_OFFLINE: "the owner peer is offline; the cancel is stored and applied when it returns",
    CancelOutcome.ALREADY_FINISHED: "the job had already finished; nothing changed",
    CancelOutcome.ALREADY_REQUESTED: "a cancel was already requested for this job",
}
