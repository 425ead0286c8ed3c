"""Retry policy, as pure functions: the one rule for infrastructure failures.

Infrastructure failures (peer lost while running a job, agent restarted under a
running job, backend launch error) are retried while the job's ``max_retries``
allows: the job goes back to the queue with no owner, under a new epoch
(``irisfed.shared.fencing``: its old runner is fenced). Out of retries, it fails. User failures (the command
exited non-zero) never come here: ``max_failure_retries`` alone may run them again
(docs/design.md §3.7). A run ended by preemption (§3.3) is not a retry either, nor a
run its own agent handed back after restarting under it: the starts a job's retries
count leave out one per preemption, failure retry and such restart (``spared``).

Who applies it: the tick (``irisfed.services.tick.plan.recover_from_lost_peer``) and the
peer agent (``irisfed.services.peer_agent.plan``: orphans and launch errors).
"""

from __future__ import annotations

from dataclasses import dataclass

from irisfed.shared.lifecycle import JobState

# A job's runs handed back by its own agent's restart that spend no retry; past them, a
# hand-back counts like any infrastructure failure (a job that takes its agent down with
# it must not run again for ever: docs/decisions.md, "Retries").
MAX_FREE_RESTARTS = 3


def retries_used(attempts: int, preemptions: int = 0, spared: int = 0) -> int:
    """The retries of ``max_retries`` a job started ``attempts`` times has spent: its
    starts after the first, less those that followed a preemption or (``spared``) a
    failure retry or its agent's restart."""
    return max(0, attempts - 1 - preemptions - spared)


def may_retry_infra_failure(attempts: int, max_retries: int, preemptions: int = 0, spared: int = 0) -> bool:
    """Whether a job that has been started ``attempts`` times, ``preemptions`` of those
    runs ended by preemption and ``spared`` by a failure retry or a restart, may be
    started again. (A job preempted before it started is counted too: that preemption
    spares it one retry, in its favour.)"""
    used = retries_used(attempts, preemptions, spared)
    return used < max_retries


@dataclass(frozen=True, slots=True)
class InfraFailure:
    """What an infrastructure failure does to a started job: requeue it or fail it."""

    to_state: JobState  # QUEUED (retrying) or FAILED (no retries left)

    @property
    def retrying(self) -> bool:
        return self.to_state is JobState.QUEUED

    def owner_after(self, owner: str | None) -> str | None:
        """Requeued: no owner (the tick places it again); failed: the owner stays on record."""
        return None if self.retrying else owner

    @property
    def suffix(self) -> str:
        """How reasons end: ``retrying`` or ``no retries left``."""
        return "retrying" if self.retrying else "no retries left"


RETRY = InfraFailure(JobState.QUEUED)
GIVE_UP = InfraFailure(JobState.FAILED)


def after_infra_failure(attempts: int, max_retries: int, preemptions: int = 0, spared: int = 0) -> InfraFailure:
    """Requeue while retries remain, else fail."""
    return RETRY if may_retry_infra_failure(attempts, max_retries, preemptions, spared) else GIVE_UP
