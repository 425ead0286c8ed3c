"""The fencing rule (``irisfed.shared.fencing``): which moves put a job under a new
epoch, and that every service's moves follow it."""

from __future__ import annotations

import pytest

from irisfed.services.peer_agent.plan import launch_error_move, orphan_move, outcome_unknown_move
from irisfed.services.router.plan import route
from irisfed.services.tick.plan import recovery_move, stored_cancel_move
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.fencing import EPOCH_STEP, epoch_after, initial_epoch
from irisfed.shared.lifecycle import TRANSITIONS, JobState
from tests.infra.rows import claimed_job, job_row, lost_peer_job, owned_job

LIVE = (JobState.ASSIGNED, JobState.RUNNING)


@pytest.mark.parametrize(("from_state", "to_state"), sorted(
    ((a, b) for a, targets in TRANSITIONS.items() for b in targets), key=str))
def test_every_allowed_move_keeps_or_steps_the_epoch_by_the_rule(from_state, to_state):
    handed_to_a_runner = to_state is JobState.ASSIGNED
    taken_from_a_runner = from_state in LIVE and to_state is JobState.QUEUED
    expected = 7 + EPOCH_STEP if handed_to_a_runner or taken_from_a_runner else 7
    assert epoch_after(from_state, to_state, 7) == expected
    # The tick ending a live job for an owner it cannot reach always fences that owner.
    unreachable = epoch_after(from_state, to_state, 7, owner_unreachable=True)
    assert unreachable == (8 if handed_to_a_runner or from_state in LIVE else 7)


def test_jobs_are_created_never_handed_off_except_local_ones():
    assert initial_epoch(JobState.QUEUED) == initial_epoch(JobState.REJECTED) == 0
    assert initial_epoch(JobState.ASSIGNED) == 1
    local = route(SubmitPlan(SubmitDisposition.LOCAL), "home", None)
    queued = route(SubmitPlan(SubmitDisposition.QUEUE), "home", None)
    assert (local.state, local.epoch, queued.epoch) == (JobState.ASSIGNED, 1, 0)


@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("cancelled", [False, True])
@pytest.mark.parametrize("retries", [0, 3])
def test_the_tick_moves_the_epoch_on_at_every_recovery(state, cancelled, retries):
    move, _ = recovery_move(lost_peer_job(state=state, epoch=4, attempts=1, max_retries=retries,
                                          cancel_requested=cancelled))
    assert move.resulting_epoch == 5


def test_a_kill_at_claim_keeps_the_epoch():
    move = stored_cancel_move(claimed_job(epoch=3, cancel_requested=True))
    assert (move.to_state, move.resulting_epoch) == (JobState.KILLED, 3)
    assert stored_cancel_move(claimed_job(epoch=3)) is None


@pytest.mark.parametrize(("attempts", "cancelled"), [(1, False), (9, False), (1, True)])
def test_an_agent_steps_the_epoch_only_when_it_hands_the_job_back(attempts, cancelled):
    job = job_row(attempts=attempts, max_retries=2, cancel_requested=cancelled)
    moves = [orphan_move("p", owned_job(epoch=6, cancel_requested=cancelled), job),
             launch_error_move("p", job.job_id, 6, "no such file", job),
             outcome_unknown_move("p", job.job_id, 6, "lost", cancelled)]
    for move in moves:
        assert move.resulting_epoch == epoch_after(JobState.RUNNING, move.to_state, 6)
