"""Pure decisions of the tick beyond placement: what happens to work on a lost peer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import msgspec

from irisfed.shared.cancel import under_cancel
from irisfed.shared.constraints import Constraint
from irisfed.shared.fencing import epoch_after
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ClaimedJob, LostPeerJob, Move
from irisfed.shared.resources import resources_from_json
from irisfed.shared.retry import after_infra_failure
from irisfed.shared.rooms import QueuedJob


@dataclass(frozen=True, slots=True)
class Recovery:
    """What to do with a live job whose owner is unreachable."""

    to_state: JobState
    reason: str
    avoid_owner: bool


def recover_from_lost_peer(
    state: JobState, owner: str, attempts: int, max_retries: int, cancel_requested: bool = False,
    preemptions: int = 0, spared: int = 0,
) -> Recovery:
    """Never-started work goes back to the queue; running work retries while allowed;
    work whose cancel was stored while its owner was away is killed.

    Losing a peer is an infrastructure failure, so it is retried (unlike a non-zero
    exit) under the one rule of ``irisfed.shared.retry``. A stored cancel is the user's word
    that the job must not run again: the owner was told it when it returns, and no
    other peer may start it meanwhile.
    """
    failure = None if state is JobState.ASSIGNED else after_infra_failure(attempts, max_retries, preemptions, spared)
    if under_cancel(JobState.QUEUED if failure is None else failure.to_state, cancel_requested) is JobState.KILLED:
        return Recovery(JobState.KILLED, f"cancelled while its owner {owner} was unreachable", False)
    if failure is None:
        return Recovery(JobState.QUEUED, f"owner {owner} unreachable before starting it", False)
    elsewhere = "; retrying elsewhere" if failure.retrying else f"; {failure.suffix}"
    return Recovery(failure.to_state, f"peer lost: {owner} unreachable while running it{elsewhere}",
                    failure.retrying)


def recovery_move(job: LostPeerJob) -> tuple[Move, Recovery]:
    """The compare-and-set that recovers ``job`` from its lost owner, and why.

    Every recovery moves the epoch on (``irisfed.shared.fencing``: the owner is
    unreachable), requeued, failed or killed: the lost owner's copy, should it come
    back, is fenced.
    """
    decision = recover_from_lost_peer(job.state, job.owner_peer_id, job.attempts, job.max_retries,
                                      job.cancel_requested, job.preemptions, job.spared)
    requeued = decision.to_state is JobState.QUEUED
    move = Move(job.job_id, job.state, decision.to_state, job.epoch, actor="tick",
                owner_peer_id=None if requeued else job.owner_peer_id, new_epoch=epoch_after(job.state, decision.to_state, job.epoch, owner_unreachable=True),
                reason=decision.reason, avoid_peer=job.owner_peer_id if decision.avoid_owner else None)
    return move, decision


def stored_cancel_move(row: ClaimedJob) -> Move | None:
    """Kill a claimed queued job that carries a stored cancel instead of placing it
    (None: no cancel stored; the job may be placed).

    The router kills queued jobs at once, so such a job was handed back (its owner lost,
    its launch failed) with the user's cancel already stored, maybe by a cancel that
    raced the hand-back. The claim is the one gate every queued job passes to run
    again: checked there, a cancelled job never starts again whichever way it came back.
    """
    # The move it would otherwise make is its placement: queued → assigned.
    if under_cancel(JobState.ASSIGNED, row.cancel_requested) is not JobState.KILLED:
        return None
    return Move(row.job_id, JobState.QUEUED, JobState.KILLED, row.epoch, actor="tick", owner_peer_id=None,
                reason="cancelled while handed back to the queue; not started again")


@lru_cache(maxsize=4096)
def constraints_from_json(text: str | None) -> tuple[Constraint, ...]:
    """Stored constraints (validated at submit) → Constraints; queued jobs share a few sets."""
    return tuple(Constraint(c["key"], c["op"], c.get("value")) for c in msgspec.json.decode(text or "[]"))


def queued_job_from_row(row: ClaimedJob) -> QueuedJob:
    """A claimed ``jobs`` row → QueuedJob (resources, preferences and wait included)."""
    return QueuedJob(
        job_id=row.job_id,
        epoch=row.epoch,
        constraints=constraints_from_json(row.constraints_json),
        pinned_peer_id=row.pinned_peer_id,
        avoid_peers=frozenset(row.avoid_peers) if row.avoid_peers else frozenset(),
        resources=resources_from_json(row.resources_json),
        preferences=constraints_from_json(row.preferences_json),
        waited_s=row.waited_s or 0.0,
        band=row.band,
        replicas=row.replicas,
        group_by=row.group_by,
    )
