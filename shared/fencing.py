"""Fencing: when a hand-off moves a job's epoch on, and by how much. The one rule.

An epoch names one hand-off of a job to one runner. Every status write carries the
epoch it was made under and is a compare-and-set on it, so a runner whose epoch has
moved on can write nothing: it is fenced, and stops its copy when it notices.

The epoch moves on by exactly one (``EPOCH_STEP``) when a move
- hands the job to a runner: → ``assigned`` (the tick's placement; a LOCAL job is
  created already assigned, under ``initial_epoch``), or
- takes the job from a runner that did not end it itself: back to ``queued`` from
  ``assigned`` or ``running`` (a retry, a lost owner, a preemption), or any ending
  that the tick decides while the owner's copy may still be running (an unreachable
  owner; a preemption that fails or kills the job: ``owner_unreachable=True`` is
  that case's rule too, and ``job_preempt_batch`` applies it in SQL).
Every other move keeps the epoch: a runner ending its own run, a cancel of a job
that never started (its state alone fences the start), a deadline passing in the
queue.

Postgres applies the same rule where the move is written in SQL (``job_assign_batch``
and ``irisfed_job_end_run``); tests/integration/test_rules_in_sql.py checks that the
two agree for every move.
"""

from __future__ import annotations

from irisfed.shared.lifecycle import ACTIVE_STATES, JobState

EPOCH_STEP = 1
# A job that has never been handed to anyone.
NEVER_HANDED_OFF = 0


def epoch_after(from_state: JobState | None, to_state: JobState, epoch: int, *,
                owner_unreachable: bool = False) -> int:
    """The epoch a move from ``from_state`` (None: the job is being created) to
    ``to_state`` leaves the job under, starting from ``epoch``.

    ``owner_unreachable``: the tick moves the job on behalf of an owner it cannot
    reach, which may still be running its copy.
    """
    if to_state is JobState.ASSIGNED:
        return epoch + EPOCH_STEP
    if from_state in ACTIVE_STATES and (to_state is JobState.QUEUED or owner_unreachable):
        return epoch + EPOCH_STEP
    return epoch


def initial_epoch(state: JobState) -> int:
    """The epoch a job is created under in ``state`` (queued, assigned for LOCAL, rejected)."""
    return epoch_after(None, state, NEVER_HANDED_OFF)
