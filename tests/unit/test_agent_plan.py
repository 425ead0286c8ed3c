"""The peer agent's decisions (services/peer_agent/plan.py), with no server at all."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from irisfed.services.peer_agent.backends import LiveRun
from irisfed.services.peer_agent.plan import (
    Leftover,
    Pending,
    backend_for,
    choose_starts,
    free_slots,
    launch_error_move,
    merge_noticed,
    orphan_move,
    outcome_unknown_move,
    plan_leftovers,
    plan_reconcile,
    run_contract,
    stopped_move,
    time_limit_reason,
)
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import JobRow, OwnedJob

BACKENDS = ["main", "gpu"]


@dataclass
class FakeRun:
    job_id: str
    epoch: int
    backend: str = "main"
    exit_code: int | None = None
    cancel_requested: bool = False
    tasks: int = 1
    accepted: bool = True


def owned(job_id: str, state: JobState = JobState.RUNNING, epoch: int = 1, backend: str | None = "main",
          cancel_requested: bool = False, priority: int = 0) -> OwnedJob:
    return OwnedJob(job_id, state, epoch, backend, cancel_requested, priority)


def job_row(job_id: str = "j", attempts: int = 1, max_retries: int = 2) -> JobRow:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return JobRow(job_id=job_id, spec={"command": ["true"]}, spec_hash="h", state=JobState.RUNNING,
                  disposition="queue", pinned_peer_id=None, owner_peer_id="p", backend="main", epoch=1,
                  attempts=attempts, max_retries=max_retries, priority=0, avoid_peers=[], submitted_at=at,
                  updated_at=at, assigned_at=at, started_at=at, finished_at=None, deadline_at=None,
                  exit_code=None, log_dir=None, reason="", explanation=None,
                  cancel_requested=False, cancel_requested_at=None)


def runs(*items: FakeRun) -> dict[str, FakeRun]:
    return {r.job_id: r for r in items}


# ---------------------------------------------------------------- reconcile


def test_runs_that_are_no_longer_ours_at_their_epoch_are_fenced():
    local = runs(FakeRun("moved", 1), FakeRun("newer", 1), FakeRun("ended", 1), FakeRun("ours", 1),
                 FakeRun("finished", 1, exit_code=0))
    rows = [owned("newer", epoch=2), owned("ended", state=JobState.ASSIGNED), owned("ours")]
    plan = plan_reconcile(local, {}, rows, BACKENDS)
    assert plan.fence == ("moved", "newer", "ended")  # gone, later epoch, not running under us
    assert plan.cancel == () and plan.orphans == ()  # "finished" is being reported: left alone


def test_a_gang_launched_before_its_acceptance_is_ours_while_its_row_is_assigned():
    local = runs(FakeRun("waiting", 1, tasks=4, accepted=False), FakeRun("started", 1, tasks=4, accepted=False),
                 FakeRun("moved", 1, tasks=4, accepted=False))
    rows = [owned("waiting", state=JobState.ASSIGNED), owned("started"), owned("moved", state=JobState.ASSIGNED,
                                                                                  epoch=2)]
    plan = plan_reconcile(local, {}, rows, BACKENDS)
    # Running rows are the accepted's; a later epoch is another run's: both fenced.
    assert plan.fence == ("started", "moved") and plan.add_pending == () and plan.orphans == ()


def test_a_gang_takes_a_slot_per_task_and_waits_for_all_of_them():
    from irisfed.services.peer_agent.plan import Pending, choose_starts

    pending = {"big": Pending("big", 1, "main", 9, tasks=3), "small": Pending("small", 1, "main", 1)}
    chosen = choose_starts(pending, [FakeRun("r", 1, tasks=2)], {"main": 4})
    assert [p.job_id for p in chosen] == ["small"]  # 2 + 3 > 4: the gang waits, a single fits
    assert [p.job_id for p in choose_starts(pending, [], {"main": 4})] == ["big", "small"]


def test_a_stored_cancel_kills_the_run_once():
    local = runs(FakeRun("a", 1), FakeRun("b", 1, cancel_requested=True))
    plan = plan_reconcile(local, {}, [owned("a", cancel_requested=True), owned("b", cancel_requested=True)],
                          BACKENDS)
    assert plan.cancel == ("a",) and plan.fence == ()


def test_pending_entries_follow_the_rows():
    pending = {"stale": Pending("stale", 1, "main", 0), "kept": Pending("kept", 2, "main", 0),
               "started": Pending("started", 1, "main", 0), "gone": Pending("gone", 1, "main", 0)}
    rows = [owned("stale", JobState.ASSIGNED, epoch=3), owned("kept", JobState.ASSIGNED, epoch=2),
            owned("started", JobState.RUNNING)]
    plan = plan_reconcile({}, pending, rows, BACKENDS)
    assert plan.drop_pending == ("stale", "started", "gone")
    # The stale entry comes back at the row's epoch; the running row has no run: an orphan.
    assert plan.add_pending == (Pending("stale", 3, "main", 0),)
    assert [o.job_id for o in plan.orphans] == ["started"]


def test_new_assigned_rows_become_pending_on_their_backend_and_running_rows_without_a_run_are_orphans():
    rows = [owned("a", JobState.ASSIGNED, backend="gpu", priority=5), owned("b", JobState.ASSIGNED, backend=None),
            owned("c", JobState.ASSIGNED, backend="gone"), owned("lost"), owned("mine")]
    plan = plan_reconcile(runs(FakeRun("mine", 1)), {}, rows, BACKENDS)
    assert plan.add_pending == (Pending("a", 1, "gpu", 5), Pending("b", 1, "main", 0), Pending("c", 1, "main", 0))
    assert [o.job_id for o in plan.orphans] == ["lost"]
    assert plan.fence == plan.cancel == plan.drop_pending == ()


def test_backend_for_falls_back_to_the_first():
    assert backend_for("gpu", BACKENDS) == "gpu"
    assert backend_for(None, BACKENDS) == "main"
    assert backend_for("slurm", BACKENDS) == "main"


# ---------------------------------------------------------------- leftovers


def test_leftovers_not_ours_any_more_are_killed_and_the_rest_left_to_their_owner():
    local = runs(FakeRun("launched", 2))
    rows = {r.job_id: r for r in [owned("orphan", epoch=1), owned("moved_on", epoch=3),
                                  owned("launched", epoch=2), owned("requeued", JobState.ASSIGNED, epoch=2)]}
    listed = {"main": [LiveRun("launched", 2, "10"), LiveRun("orphan", 1, "11"), LiveRun("moved_on", 1, "12"),
                       LiveRun("gone", 1, "13"), LiveRun("launched", 1, "14"), LiveRun("requeued", 2, "15")]}
    kill = plan_leftovers(local, rows, listed)
    assert kill == [
        Leftover("main", LiveRun("moved_on", 1, "12"), 3),  # the job moved on to a later epoch
        Leftover("main", LiveRun("gone", 1, "13"), None),  # not ours at all any more
        Leftover("main", LiveRun("launched", 1, "14"), 2),  # an older copy of a run we launched
        Leftover("main", LiveRun("requeued", 2, "15"), 2),  # its row is not running (assigned again)
    ]
    # "launched" at epoch 2 is ours (fenced by reconcile if it goes stale); "orphan" is
    # orphan recovery's, which kills it and requeues the job.


# ---------------------------------------------------------------- starting


def test_notices_join_pending_unless_running_here_or_older():
    pending = {"a": Pending("a", 2, "main", 0)}
    noticed = {"a": Pending("a", 1, "main", 9), "b": Pending("b", 1, "main", 0), "r": Pending("r", 5, "main", 0)}
    merged = merge_noticed(pending, noticed, runs(FakeRun("r", 4)))
    assert merged == {"a": Pending("a", 2, "main", 0), "b": Pending("b", 1, "main", 0)}
    assert merge_noticed(pending, {"a": Pending("a", 3, "gpu", 1)}, {})["a"] == Pending("a", 3, "gpu", 1)
    assert pending == {"a": Pending("a", 2, "main", 0)}  # the input is left as it was


def test_starts_go_by_priority_within_each_backends_free_slots():
    pending = {p.job_id: p for p in [Pending("low", 1, "main", 1), Pending("high", 1, "main", 9),
                                     Pending("mid", 1, "main", 5), Pending("g1", 1, "gpu", 0),
                                     Pending("g2", 1, "gpu", 0)]}
    chosen = choose_starts(pending, [FakeRun("busy", 1, "main")], {"main": 3, "gpu": 1})
    assert [p.job_id for p in chosen] == ["high", "mid", "g1"]  # ties keep arrival order


def test_free_slots_count_runs_and_pending():
    free = free_slots({"main": 3, "gpu": 1}, [FakeRun("r", 1, "main"), FakeRun("s", 1, "gpu")],
                      [Pending("p", 1, "main", 0), Pending("q", 1, "gpu", 0)])
    assert free == {"main": 1, "gpu": 0}


# ---------------------------------------------------------------- lost runs


def test_an_orphan_is_requeued_under_the_next_epoch_spending_no_retry():
    move = orphan_move("gpu-west", owned("j", epoch=4), job_row(attempts=1, max_retries=1))
    assert (move.from_state, move.to_state, move.epoch, move.new_epoch, move.owner_peer_id) == \
        (JobState.RUNNING, JobState.QUEUED, 4, 5, None)
    assert move.reason == "agent on gpu-west restarted while running it; running again (no retry spent)"
    assert move.actor == "gpu-west" and move.no_fault


def test_an_orphan_out_of_retries_still_runs_again_and_a_cancelled_one_is_killed():
    # Its agent's restart is no fault of the job (docs/design.md §3.7): no retry needed.
    again = orphan_move("gpu-west", owned("j"), job_row(attempts=2, max_retries=0))
    assert (again.to_state, again.owner_peer_id, again.no_fault) == (JobState.QUEUED, None, True)
    killed = orphan_move("gpu-west", owned("j", cancel_requested=True), job_row(attempts=1, max_retries=5))
    assert (killed.to_state, killed.reason) == (JobState.KILLED, "cancelled while its agent was down")
    asked = msgspec.structs.replace(job_row(attempts=1, max_retries=5), cancel_requested_by="user alice")
    assert orphan_move("gpu-west", owned("j", cancel_requested=True), asked).reason == (
        "cancelled by user alice while its agent was down")


def test_a_launch_error_is_retried_like_any_infrastructure_failure():
    retried = launch_error_move("p", "j", 1, "cannot start 'nope'", job_row(attempts=1, max_retries=1))
    assert (retried.to_state, retried.new_epoch, retried.owner_peer_id, retried.reason) == (
        JobState.QUEUED, 2, None, "launch failed: cannot start 'nope'; retrying")
    final = launch_error_move("p", "j", 1, "boom", job_row(attempts=2, max_retries=1))
    assert (final.to_state, final.owner_peer_id, final.reason) == (JobState.FAILED, "p", "launch failed: boom")
    unreadable = launch_error_move("p", "j", 1, "boom", None)  # the row is no longer ours to read
    assert unreadable.to_state is JobState.FAILED


def test_a_launch_error_or_lost_run_of_a_cancelled_job_kills_it_instead_of_handing_it_back():
    stored = msgspec.structs.replace(job_row(attempts=1, max_retries=5), cancel_requested=True)
    for move in (launch_error_move("p", "j", 1, "boom", stored),  # the cancel stored on its row
                 launch_error_move("p", "j", 1, "node died", job_row(attempts=1, max_retries=5), lost=True,
                                   cancelled=True),  # the cancel this agent was told of
                 launch_error_move("p", "j", 1, "boom", None, cancelled=True)):
        assert (move.from_state, move.to_state, move.new_epoch, move.owner_peer_id) == (
            JobState.RUNNING, JobState.KILLED, None, "p")
        assert move.reason.startswith("cancelled; ")
    assert launch_error_move("p", "j", 1, "node died", stored, lost=True).reason == "cancelled; run lost: node died"
    asked = msgspec.structs.replace(stored, cancel_requested_by="operator (web)")
    assert launch_error_move("p", "j", 1, "boom", asked).reason == "cancelled by operator (web); launch failed: boom"


def test_a_run_whose_outcome_its_engine_lost_fails_and_is_never_retried():
    why = "Slurm forgot job 12 after it started; its outcome is unknown (no exit status in /w/j/epoch-3)"
    failed = outcome_unknown_move("p", "j", 3, why, cancelled=False)
    assert (failed.from_state, failed.to_state, failed.epoch, failed.new_epoch, failed.owner_peer_id,
            failed.reason, failed.exit_code) == (JobState.RUNNING, JobState.FAILED, 3, None, "p", why, None)
    assert failed.actor == "p"
    killed = outcome_unknown_move("p", "j", 3, why, cancelled=True)
    assert (killed.to_state, killed.new_epoch, killed.reason) == (JobState.KILLED, None, why)


# ---------------------------------------------------------------- the run contract (docs/design.md §3.7)


def test_a_job_names_its_grace_and_time_limit_else_the_agent_default_and_none():
    assert run_contract({"command": ["x"]}, 7.0) == (7.0, None)
    assert run_contract({"grace_s": 0, "time_limit_s": 1800}, 7.0) == (0.0, 1800.0)


def test_a_time_limit_reason_reads_as_the_flag_was_written():
    assert [time_limit_reason(s) for s in (90, 1800, 7200, 5400, 2.5)] == [
        "time limit 1m30s reached", "time limit 30m reached", "time limit 2h reached",
        "time limit 1h30m reached", "time limit 2.5s reached"]


def test_a_run_stopped_at_its_time_limit_fails_keeping_its_exit_code():
    move = stopped_move("p", "j", 3, "time limit 30m reached", -15)
    assert (move.from_state, move.to_state, move.epoch, move.new_epoch, move.owner_peer_id, move.exit_code,
            move.reason) == (JobState.RUNNING, JobState.FAILED, 3, None, "p", -15, "time limit 30m reached")


def test_failure_retries_and_restarts_spend_no_infrastructure_retry():
    # attempts 4 = the first run + one failure retry + one restart + one infrastructure retry
    row = msgspec.structs.replace(job_row(attempts=4, max_retries=1), failures=1, restarts=1)
    assert launch_error_move("p", "j", 1, "boom", row).to_state is JobState.FAILED  # its one retry spent
    row = msgspec.structs.replace(job_row(attempts=3, max_retries=1), failures=1, restarts=1)
    assert launch_error_move("p", "j", 1, "boom", row).to_state is JobState.QUEUED


def test_an_orphan_past_its_free_restarts_spends_a_retry_and_one_past_its_time_limit_fails():
    from datetime import timedelta

    from irisfed.shared.retry import MAX_FREE_RESTARTS

    worn = msgspec.structs.replace(job_row(attempts=MAX_FREE_RESTARTS + 1, max_retries=0), restarts=MAX_FREE_RESTARTS)
    move = orphan_move("p", owned("j"), worn)
    assert (move.to_state, move.no_fault) == (JobState.FAILED, False)
    assert move.reason.endswith(f"(past {MAX_FREE_RESTARTS} restarts that spend no retry); no retries left")
    limited = msgspec.structs.replace(job_row(), spec={"time_limit_s": 60})
    late = orphan_move("p", owned("j", epoch=3), limited, limited.started_at + timedelta(seconds=61))
    assert (late.to_state, late.new_epoch, late.reason) == (JobState.FAILED, None, "time limit 1m reached")
    assert orphan_move("p", owned("j"), limited, limited.started_at + timedelta(seconds=59)).to_state is JobState.QUEUED
