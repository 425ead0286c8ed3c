"""The users' invariant checks (docs/design.md §6, 9 and 10) on hand-made rows:
``quota_violations`` replays a changelog against quotas, ``identity_violations`` judges
whose each job is and who cancelled it."""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogRow
from irisfed.tooling.chaos.checks import Ledger, quotas_reached
from irisfed.tooling.invariants import (
    JobHolding,
    JobIdentity,
    identity_violations,
    peak_live_usage,
    quota_violations,
)

pytestmark = pytest.mark.unit

Q, A, R, S, F, K = (JobState.QUEUED, JobState.ASSIGNED, JobState.RUNNING, JobState.SUCCEEDED,
                    JobState.FAILED, JobState.KILLED)


def changelog(*moves: tuple[int, str, JobState | None, JobState]) -> list[ChangelogRow]:
    """(seq, job, from, to) → changelog rows (peer, epoch, actor: placeholders)."""
    return [ChangelogRow(seq, job, frm, to, "home", 1, "tick", "") for seq, job, frm, to in moves]


def lifecycle(job: str, first: int, *states: JobState) -> list[tuple[int, str, JobState | None, JobState]]:
    """``job`` moving through ``states`` (queued first) at seq first, first + 1, ..."""
    moves, before = [], None
    for n, state in enumerate((Q, *states)):
        moves.append((first + n, job, before, state))
        before = state
    return moves


JOBS = {
    "alice:a": JobHolding("alice"),  # the default request: one cpu
    "alice:b": JobHolding("alice", {"cpu": 0.5, "gpu": 1}),
    "alice:c": JobHolding("alice", '{"cpu": 1.5, "gpu": 1}'),  # jobs.resources as JSON text
    "bob:a": JobHolding("bob", {"cpu": 4}),
    "d": JobHolding("default", {"cpu": 8}),
}


# ---------------------------------------------------------------- invariant 10: quota


def test_a_changelog_that_stays_within_every_quota_passes():
    # alice (2 slots, 2 cpu, 1 gpu): a and b live together; c starts only after b ended.
    rows = changelog(*lifecycle("alice:a", 1, A, R, S), *lifecycle("alice:b", 2, A, R, F),
                     (10, "alice:c", None, Q), (11, "alice:c", Q, A), (12, "alice:c", A, R),
                     # bob and default have no quota: anything goes.
                     *lifecycle("bob:a", 20, A, R, S), *lifecycle("d", 30, A, R, S))
    quotas = {"alice": {"slots": 2, "cpu": 2, "gpu": 1}}
    assert quota_violations(rows, JOBS, quotas) == []


def test_a_third_live_job_over_two_slots_is_a_violation_naming_the_row():
    rows = changelog((1, "alice:a", None, A), (2, "alice:b", None, Q), (3, "alice:b", Q, A),
                     (4, "alice:c", None, Q), (5, "alice:c", Q, A), (6, "alice:a", A, R), (7, "alice:a", R, S))
    problems = quota_violations(rows, JOBS, {"alice": {"slots": 2}})
    assert len(problems) == 1
    assert "alice:c" in problems[0] and "seq 5" in problems[0]
    assert "held 3 slots, over its quota of 2" in problems[0]


def test_fractional_cpu_and_extended_counts_are_summed_exactly():
    rows = changelog((1, "alice:b", None, A), (2, "alice:c", None, A))  # 0.5 + 1.5 cpu, 2 gpu
    assert quota_violations(rows, JOBS, {"alice": {"cpu": 2}}) == []
    assert quota_violations(rows, JOBS, {"alice": {"cpu": 1.999}}) != []
    [gpu] = quota_violations(rows, JOBS, {"alice": {"gpu": 1}})
    assert "held 2 gpu, over its quota of 1" in gpu


def test_rows_are_replayed_in_seq_order_whatever_order_they_come_in():
    # By job (as changelog_list_all returns them): a ends at seq 3 before c starts at 4.
    rows = changelog((1, "alice:a", None, A), (3, "alice:a", A, S), (2, "alice:c", None, Q), (4, "alice:c", Q, A))
    assert quota_violations(rows, JOBS, {"alice": {"slots": 1}}) == []
    # The same rows with c placed before a ended: over.
    rows = changelog((1, "alice:a", None, A), (4, "alice:a", A, S), (2, "alice:c", None, Q), (3, "alice:c", Q, A))
    assert len(quota_violations(rows, JOBS, {"alice": {"slots": 1}})) == 1


def test_a_requeued_job_gives_its_room_back_and_counts_again_when_placed():
    rows = changelog((1, "alice:a", None, A), (2, "alice:a", A, R), (3, "alice:a", R, Q),  # retried
                     (4, "alice:b", None, A), (5, "alice:a", Q, A))  # placed again while b is live
    [problem] = quota_violations(rows, JOBS, {"alice": {"slots": 1}})
    assert "seq 5" in problem
    assert quota_violations(rows[:4], JOBS, {"alice": {"slots": 1}}) == []


def test_running_to_running_moves_and_unknown_jobs_change_nothing():
    rows = changelog((1, "alice:a", None, A), (2, "alice:a", A, R), (3, "ghost", None, A), (4, "ghost", A, R))
    assert quota_violations(rows, JOBS, {"alice": {"slots": 1}, "default": {"slots": 0}}) == []


def test_users_are_counted_apart_and_a_resource_not_asked_for_is_never_over():
    rows = changelog((1, "alice:a", None, A), (2, "bob:a", None, A), (3, "d", None, A))
    quotas = {"alice": {"slots": 1, "gpu": 0}, "bob": {"slots": 1, "cpu": 4}, "default": {"memory_mb": 0}}
    assert quota_violations(rows, JOBS, quotas) == []


def test_peaks_and_which_quotas_were_filled():
    rows = changelog((1, "alice:a", None, A), (2, "alice:b", None, A), (3, "alice:a", A, S), (4, "bob:a", None, A))
    peaks = peak_live_usage(rows, JOBS)
    assert peaks["alice"] == {"cpu": 1500, "gpu": 1, "slots": 2}  # cpu in millicores
    assert peaks["bob"] == {"cpu": 4000, "slots": 1}
    quotas = {"alice": {"slots": 2, "gpu": 2}, "bob": {"cpu": 4}}
    assert quotas_reached(peaks, quotas) == ["alice:slots", "bob:cpu"]


# ---------------------------------------------------------------- invariant 9: identity


def test_jobs_of_their_senders_pass():
    jobs = {"x": JobIdentity("default", "succeeded", sent_by="default"),
            "alice:x": JobIdentity("alice", "killed", True, "user alice", sent_by="alice"),
            "bob:x": JobIdentity("bob", "killed", True, "operator (web)")}
    sent = {("default", "x"), ("alice", "x"), ("bob", "x")}
    assert identity_violations(jobs, sent, foreign_cancels=[("bob", "alice:x")], own_cancels={"alice:x"}) == []


def test_a_job_whose_user_is_not_the_one_its_id_or_sender_names():
    jobs = {"alice:x": JobIdentity("bob", "queued"), "y": JobIdentity("default", "queued", sent_by="alice")}
    problems = identity_violations(jobs)
    assert len(problems) == 2
    assert "stored as alice's job but jobs.user_id is 'bob'" in problems[0]
    assert "alice sent it but it belongs to default" in problems[1]


def test_a_job_nobody_sent_as_that_user():
    # bob sent x; a job x of alice means one id of two users became the wrong job.
    jobs = {"alice:x": JobIdentity("alice", "queued"), "bob:x": JobIdentity("bob", "queued")}
    [problem] = identity_violations(jobs, sent={("bob", "x")})
    assert "alice:x" in problem and "never sent" in problem


def test_a_cancel_stored_for_another_user_or_a_kill_without_a_requester():
    jobs = {"alice:x": JobIdentity("alice", "running", True, "user bob"),
            "alice:y": JobIdentity("alice", "killed", True, None),
            "alice:z": JobIdentity("alice", "killed", True, "operatorish")}
    problems = identity_violations(jobs)
    assert len(problems) == 3
    assert "cancel requested by 'user bob'" in problems[0]
    assert "killed with no cancel requester" in problems[1]
    assert "'operatorish'" in problems[2]


@pytest.mark.parametrize("job", [JobIdentity("alice", "killed", True, "operator"),
                                 JobIdentity("alice", "running", True, "operator")])
def test_a_foreign_cancel_must_leave_the_job_alone(job):
    # Even a stored cancel that names an operator is a finding if only bob asked.
    jobs = {"alice:x": job}
    [problem] = identity_violations(jobs, foreign_cancels=[("bob", "alice:x")])
    assert "only bob asked to cancel this job of alice" in problem
    assert identity_violations(jobs, foreign_cancels=[("bob", "alice:x")], own_cancels={"alice:x"}) == []


def test_ledger_counts_ids_that_several_users_sent():
    ledger = Ledger(sent={("alice", "x"), ("bob", "x"), ("default", "x"), ("alice", "y"), ("bob", "z")})
    assert ledger.shared_ids() == 1
