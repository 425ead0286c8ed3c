"""Retry policy, as pure functions: the one rule for infrastructure failures.

Infrastructure failures (peer lost while running a job, agent restarted under a
running job, backend launch error) are retried while the job's ``max_retries``
allows: the job goes back to the queue with no owner, under a new epoch
(``irisfed.shared.fencing``: its old runner is fenced). Out of retries, it fails. User failures (the command
exited non-zero) are final and never come here.

Who applies it: the tick (``irisfed.services.tick.plan.recover_from_lost_peer``) and the
peer agent (``irisfed.services.peer_agent.plan``: orphans and launch errors).
"""

from __future__ import annotations

from dataclasses import dataclass

from irisfed.shared.lifecycle import JobState


def may_retry_infra_failure(attempts: int, max_retries: int) -> bool:
    """Whether a job that has been started ``attempts`` times may be started again."""
    retries_used = max(0, attempts - 1)
    return retries_used < max_retries


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


def after_infra_failure(attempts: int, max_retries: int) -> InfraFailure:
    """Requeue while retries remain, else fail."""
    return RETRY if may_retry_infra_failure(attempts, max_retries) else GIVE_UP
