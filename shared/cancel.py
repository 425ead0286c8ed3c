"""Cancel: what a cancel does, in every state and wherever it meets the job. The one rule.

A cancel is the user's word that the job must not run, or not run again. The router
stores it on the job (``cancel_requested``) and acts at once where it can; every
other actor that moves the job afterwards obeys it through :func:`under_cancel`, so
a stored cancel is never handed on to another run:

| where the cancel meets the job | state | what happens |
|---|---|---|
| the router, when the cancel arrives | queued, assigned | killed at once (the owner's start, a CAS from assigned, then fails) |
| the router | running | stored; the owner is told (an offline owner is told when it returns) |
| the router | finished | nothing |
| the tick, claiming queued jobs | queued with a stored cancel | killed, never placed |
| the tick, recovering a lost owner's job | assigned, running | killed, not requeued |
| the tick, preempting the job (`job_preempt_batch`) | assigned, running | killed, not requeued |
| the owner's agent, reconciling | running, its run not told yet | its run is killed |
| the owner's agent, a run that exited | running | killed, whatever the exit code |
| the owner's agent, a run lost, never launched, orphaned, or whose outcome the engine lost | running | killed, not requeued nor failed |

Postgres applies the same rule where the ending is decided in SQL (an agent's batch
of finished runs, ``irisfed_job_finish_batch``); tests/integration/test_rules_in_sql.py
checks that SQL and :func:`run_ending` agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from irisfed.shared.lifecycle import CancelOutcome, JobState


class CancelAction(StrEnum):
    """What the router does to a job in the database when a cancel arrives."""

    KILL_NOW = "kill_now"  # not started: killed in the database (fences the owner's start)
    ASK_OWNER = "ask_owner"  # running: the request is stored and the owner told
    REPEAT = "repeat"  # running, cancel already requested: stored and told again
    NOTHING = "nothing"  # already finished


def cancel_action(state: JobState, cancel_requested: bool) -> CancelAction:
    """What a cancel arriving at the router does to a job in ``state``."""
    if state.is_terminal:
        return CancelAction.NOTHING
    if state in (JobState.QUEUED, JobState.ASSIGNED):
        # Not started: killing it in the database fences the owner's start (its CAS
        # assigned → running can no longer succeed).
        return CancelAction.KILL_NOW
    return CancelAction.REPEAT if cancel_requested else CancelAction.ASK_OWNER


@dataclass(frozen=True, slots=True)
class CancelDecision:
    """A cancel's action, the outcome its requester is told, and the job's state after it."""

    action: CancelAction
    outcome: CancelOutcome
    new_state: JobState


def cancel_decision(state: JobState, cancel_requested: bool, attempts: int,
                    owner_reachable: bool) -> CancelDecision:
    """Decide a cancel of a job in ``state`` (started ``attempts`` times; its owner reachable or not)."""
    action = cancel_action(state, cancel_requested)
    if action is CancelAction.NOTHING:
        return CancelDecision(action, CancelOutcome.ALREADY_FINISHED, state)
    if action is CancelAction.KILL_NOW:
        # A job requeued after a lost peer did run before: it is not restarted.
        outcome = CancelOutcome.NEVER_STARTED if attempts == 0 else CancelOutcome.NOT_RESTARTED
        return CancelDecision(action, outcome, JobState.KILLED)
    if not owner_reachable:
        return CancelDecision(action, CancelOutcome.PENDING_OWNER_OFFLINE, state)
    outcome = CancelOutcome.ALREADY_REQUESTED if action is CancelAction.REPEAT else CancelOutcome.KILL_SENT
    return CancelDecision(action, outcome, state)


def under_cancel(proposed: JobState, cancel_requested: bool) -> JobState:
    """Where a move goes that would take a job to ``proposed``: with a stored cancel,
    ``killed`` instead (never queued or assigned to run again, never succeeded or
    failed as if nobody had asked); without one, ``proposed``."""
    return JobState.KILLED if cancel_requested else proposed


def run_ending(exit_code: int, cancel_requested: bool) -> JobState:
    """How a run that exited with ``exit_code`` ends its job."""
    return under_cancel(JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED, cancel_requested)


def must_kill_run(cancel_stored: bool, run_told: bool) -> bool:
    """Whether an agent must kill a run of its own: its job carries a stored cancel
    (``cancel_stored``) that the run has not been told yet (``run_told``)."""
    return cancel_stored and not run_told


def cancelled_by(requested_by: str | None) -> str:
    """The words that start a cancelled run's reason: who asked (``jobs.cancel_requested_by``:
    ``user alice``, ``operator (web)``) when it is known."""
    return f"cancelled by {requested_by}" if requested_by else "cancelled"
