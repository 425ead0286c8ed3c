"""The cancel rule (``irisfed.shared.cancel``): what a cancel does in every state, and
that a stored cancel turns every later move of the job into ``killed``."""

from __future__ import annotations

import pytest

from irisfed.shared.cancel import (
    CancelAction,
    cancel_decision,
    must_kill_run,
    run_ending,
    under_cancel,
)
from irisfed.shared.lifecycle import CancelOutcome, JobState, check_transition


@pytest.mark.parametrize(("state", "requested", "attempts", "reachable", "action", "outcome", "after"), [
    (JobState.SUCCEEDED, False, 1, True, CancelAction.NOTHING, CancelOutcome.ALREADY_FINISHED, JobState.SUCCEEDED),
    (JobState.QUEUED, False, 0, False, CancelAction.KILL_NOW, CancelOutcome.NEVER_STARTED, JobState.KILLED),
    (JobState.QUEUED, False, 1, False, CancelAction.KILL_NOW, CancelOutcome.NOT_RESTARTED, JobState.KILLED),
    (JobState.ASSIGNED, True, 0, True, CancelAction.KILL_NOW, CancelOutcome.NEVER_STARTED, JobState.KILLED),
    (JobState.RUNNING, False, 1, True, CancelAction.ASK_OWNER, CancelOutcome.KILL_SENT, JobState.RUNNING),
    (JobState.RUNNING, False, 1, False, CancelAction.ASK_OWNER, CancelOutcome.PENDING_OWNER_OFFLINE,
     JobState.RUNNING),
    (JobState.RUNNING, True, 1, True, CancelAction.REPEAT, CancelOutcome.ALREADY_REQUESTED, JobState.RUNNING),
    (JobState.RUNNING, True, 1, False, CancelAction.REPEAT, CancelOutcome.PENDING_OWNER_OFFLINE, JobState.RUNNING),
])
def test_what_a_cancel_does(state, requested, attempts, reachable, action, outcome, after):
    decision = cancel_decision(state, requested, attempts, owner_reachable=reachable)
    assert (decision.action, decision.outcome, decision.new_state) == (action, outcome, after)


def test_cancel_outcomes_keep_their_wire_values():
    assert [o.value for o in CancelOutcome] == ["never_started", "not_restarted", "kill_sent",
                                                "pending_owner_offline", "already_finished", "already_requested"]
    assert all(o.meaning for o in CancelOutcome)


@pytest.mark.parametrize("proposed", list(JobState))
def test_a_stored_cancel_turns_every_move_into_killed(proposed):
    assert under_cancel(proposed, cancel_requested=True) is JobState.KILLED
    assert under_cancel(proposed, cancel_requested=False) is proposed


@pytest.mark.parametrize("from_state", [JobState.QUEUED, JobState.ASSIGNED, JobState.RUNNING])
def test_killing_instead_is_an_allowed_transition_from_every_live_state(from_state):
    check_transition(from_state, under_cancel(JobState.QUEUED, True))  # raises when not allowed


@pytest.mark.parametrize(("exit_code", "cancelled", "ending"), [
    (0, False, JobState.SUCCEEDED), (3, False, JobState.FAILED), (-9, False, JobState.FAILED),
    (0, True, JobState.KILLED), (137, True, JobState.KILLED),
])
def test_a_run_that_exited_ends_by_its_exit_code_unless_cancelled(exit_code, cancelled, ending):
    assert run_ending(exit_code, cancelled) is ending


@pytest.mark.parametrize(("stored", "told", "kill"), [(True, False, True), (True, True, False),
                                                      (False, False, False), (False, True, False)])
def test_an_agent_kills_its_run_once_for_a_stored_cancel(stored, told, kill):
    assert must_kill_run(stored, told) is kill
