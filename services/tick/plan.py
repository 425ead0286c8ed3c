"""Pure decisions of the tick beyond placement: what happens to work on a lost peer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import msgspec

from shared.constraints import Constraint
from shared.lifecycle import JobState
from shared.placement import QueuedJob
from shared.retry import may_retry_infra_failure


@dataclass(frozen=True, slots=True)
class Recovery:
    """What to do with a live job whose owner is unreachable."""

    to_state: JobState
    reason: str
    avoid_owner: bool


def recover_from_lost_peer(
    state: JobState, owner: str, attempts: int, max_retries: int
) -> Recovery:
    """Never-started work goes back to the queue; running work retries while allowed.

    Losing a peer is an infrastructure failure, so it is retried (unlike a non-zero
    exit).
    """
    if state is JobState.ASSIGNED:
        return Recovery(JobState.QUEUED, f"owner {owner} unreachable before starting it", False)
    if may_retry_infra_failure(attempts, max_retries):
        return Recovery(JobState.QUEUED, f"peer lost: {owner} unreachable while running it; retrying elsewhere", True)
    return Recovery(JobState.FAILED, f"peer lost: {owner} unreachable while running it; no retries left", False)


@lru_cache(maxsize=4096)
def constraints_from_json(text: str | None) -> tuple[Constraint, ...]:
    """Stored constraints (validated at submit) → Constraints; queued jobs share a few sets."""
    return tuple(Constraint(c["key"], c["op"], c.get("value")) for c in msgspec.json.decode(text or "[]"))


def queued_job_from_row(row) -> QueuedJob:
    """A claimed ``jobs`` row → QueuedJob."""
    return QueuedJob(
        job_id=row["job_id"],
        epoch=row["epoch"],
        constraints=constraints_from_json(row["constraints_json"]),
        pinned_peer_id=row["pinned_peer_id"],
        avoid_peers=frozenset(row["avoid_peers"]) if row["avoid_peers"] else frozenset(),
    )
