"""Invariant 12's check (docs/design.md §6; ``gang_violations``) on hand-made changelogs
and task rows, each way it can be broken; and the users' and bands' checks counting a
gang's tasks."""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import JobState
from irisfed.tooling.invariants import (
    BandedJob,
    GangTask,
    HistoryRow,
    JobHolding,
    gang_violations,
    preemption_violations,
    quota_violations,
)

pytestmark = pytest.mark.unit

Q, A, R, S, F = JobState.QUEUED, JobState.ASSIGNED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED


def row(seq, job, frm, to, peer=None, epoch=1, actor="tick", detail=""):
    return HistoryRow(seq, job, frm and frm.value, to.value, peer, epoch, actor, detail)


def ran(job="g", peer="tpu", end=S, epoch=1, first=1, ender=None):
    """A gang queued, placed on ``peer``, started and ended (by its agent unless ``ender``)."""
    return [row(first, job, None, Q, epoch=0, actor="router"), row(first + 1, job, Q, A, peer, epoch),
            row(first + 2, job, A, R, peer, epoch, actor=peer),
            row(first + 3, job, R, end, peer if end is not Q else None, epoch if end is not Q else epoch + 1,
                actor=ender or peer)]


def tasks(job="g", epoch=1, peer="tpu", states=("succeeded",) * 4, nodes=None):
    nodes = nodes or [f"n{i}" for i in range(len(states))]
    return [GangTask(job, epoch, i, peer, nodes[i], state, 0 if state == "succeeded" else None)
            for i, state in enumerate(states)]


def test_a_gang_run_whole_on_one_peer_breaks_nothing():
    assert gang_violations(ran(), {"g": 4}, tasks()) == []


def test_some_tasks_recorded_of_a_gang_is_all_or_none_broken():
    problems = gang_violations(ran(), {"g": 4}, tasks()[:3])
    assert problems == ["g: epoch 1: tasks [0, 1, 2] recorded of its 4 (all or none)"]


def test_tasks_on_another_peer_than_the_job_ran_on():
    mixed = tasks()[:2] + tasks(peer="gpu-a")[2:]
    [problem] = gang_violations(ran(), {"g": 4}, mixed)
    assert "tasks on gpu-a, tpu but the job ran on tpu" in problem


def test_two_tasks_on_one_node():
    [problem] = gang_violations(ran(), {"g": 4}, tasks(nodes=["n0", "n1", "n1", "n3"]))
    assert "two tasks on one node" in problem


def test_a_run_its_agent_ended_with_a_task_still_running_breaks_one_fate():
    [problem] = gang_violations(ran(end=F), {"g": 4}, tasks(states=("failed", "killed", "running", "killed")))
    assert problem == "g: epoch 1: ended failed by tpu with tasks [2] still running"


def test_a_gang_that_succeeded_with_a_failed_task_breaks_one_fate():
    problems = gang_violations(ran(), {"g": 4}, tasks(states=("succeeded", "failed", "succeeded", "succeeded")))
    assert "g: epoch 1: succeeded though tasks [1] failed (one fate)" in problems
    assert any("succeeded but its last run's tasks say" in p for p in problems)


def test_a_run_the_tick_took_back_may_leave_rows_its_dead_agent_wrote():
    # The peer was lost: the tick requeued the gang; its agent never came back to say.
    history = ran(end=Q, ender="tick") + [row(10, "g", Q, A, "tpu", 3), row(11, "g", A, R, "tpu", 3, actor="tpu"),
                                          row(12, "g", R, S, "tpu", 3, actor="tpu")]
    rows = tasks(states=("running",) * 4) + tasks(epoch=3)
    assert gang_violations(history, {"g": 4}, rows) == []


def test_task_rows_of_a_single_task_job_or_a_run_that_never_ran():
    assert gang_violations(ran(job="s"), {"s": 1}, tasks(job="s")[:1]) == [
        "s: epoch 1: task rows for a single-task job"]
    queued_only = [row(1, "g", None, Q, epoch=0, actor="router")]
    assert gang_violations(queued_only, {"g": 4}, tasks()) == [
        "g: epoch 1: tasks recorded but the job was never placed at this epoch"]


def _never_accepted(end=Q):
    """A gang placed on tpu whose tasks ended before its agent could accept it (Postgres
    away meanwhile): the agent records them, then ends the assigned job itself."""
    return [row(1, "g", None, Q, epoch=0, actor="router"), row(2, "g", Q, A, "tpu", 1),
            row(3, "g", A, end, None if end is Q else "tpu", 2 if end is Q else 1, actor="tpu")]


def test_tasks_of_a_run_its_agent_never_accepted_answer_to_its_assignment():
    ended = tasks(states=("failed", "killed", "killed", "killed"))
    assert gang_violations(_never_accepted(), {"g": 4}, ended) == []
    assert gang_violations(_never_accepted(F), {"g": 4}, ended) == []
    [elsewhere] = gang_violations(_never_accepted(), {"g": 4}, tasks(peer="gpu-a", states=("killed",) * 4))
    assert "tasks on gpu-a but the job ran on tpu" in elsewhere
    live = tasks(states=("failed", "running", "pending", "killed"))
    assert gang_violations(_never_accepted(F), {"g": 4}, live) == [
        "g: epoch 1: tasks [1, 2] recorded live though the gang never ran (never accepted)",
        "g: epoch 1: ended failed by tpu with tasks [1, 2] still pending/running"]
    # Taken back by the tick (its agent away): live rows of a never-accepted run all the same.
    taken_back = [row(1, "g", None, Q, epoch=0, actor="router"), row(2, "g", Q, A, "tpu", 1),
                  row(3, "g", A, Q, None, 2, actor="tick")]
    assert gang_violations(taken_back, {"g": 4}, tasks(states=("running",) * 4)) == [
        "g: epoch 1: tasks [0, 1, 2, 3] recorded live though the gang never ran (never accepted)"]


def test_quota_replay_counts_every_task_of_a_gang():
    history = ran(job="g")[:3]
    holdings = {"g": JobHolding("alice", {"cpu": 1}, replicas=4)}
    assert quota_violations(history, holdings, {"alice": {"cpu": 4}}) == []
    [over] = quota_violations(history, holdings, {"alice": {"cpu": 3}})
    assert "held 4 cpu, over its quota of 3" in over
    assert quota_violations(history, holdings, {"alice": {"slots": 3}})  # a slot a task


def _preempted_for(urgent: str, victims: list[str], peer: str = "tpu") -> list[HistoryRow]:
    rows = []
    seq = 1
    for v in victims:
        rows += [row(seq, v, None, Q, epoch=0, actor="router"), row(seq + 1, v, Q, A, peer, 1),
                 row(seq + 2, v, A, R, peer, 1, actor=peer)]
        seq += 3
    rows.append(row(seq, urgent, None, Q, epoch=0, actor="router"))
    seq += 1
    for v in victims:
        rows.append(row(seq, v, R, Q, None, 2, detail=f"preempted by {urgent}"))
        seq += 1
    rows.append(row(seq, urgent, Q, A, peer, 1, detail="placed; preempted " + ", ".join(victims)))
    return rows


def test_more_than_needed_counts_a_victims_tasks_and_the_preemptors():
    # A gang of 2 × 1 cpu needs 2 slots: one victim gang of 2 tasks frees them alone.
    jobs = {"urgent": BandedJob(1, {"cpu": 1}, replicas=2), "v1": BandedJob(0, {"cpu": 1}, replicas=2),
            "v2": BandedJob(0, {"cpu": 1})}
    [problem] = preemption_violations(_preempted_for("urgent", ["v1", "v2"]), jobs, {"tpu": {"cpu"}})
    assert "without v2 (more than needed)" in problem
    # Two single-task victims for a gang of two: both needed.
    jobs["v1"] = BandedJob(0, {"cpu": 1})
    assert preemption_violations(_preempted_for("urgent", ["v1", "v2"]), jobs, {"tpu": {"cpu"}}) == []
    # Where nodes are advertised, a node per task may need any victim: not judged.
    jobs["v1"] = BandedJob(0, {"cpu": 1}, replicas=2)
    assert preemption_violations(_preempted_for("urgent", ["v1", "v2"]), jobs, {"tpu": {"cpu"}}, {"tpu"}) == []
