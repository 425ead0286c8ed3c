"""Invariant 16's check (docs/design.md §6, §3.8; ``dependency_violations``) on hand-made
changelogs, edges and job states: a good history passes, and each way of breaking it
is named."""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogRow
from irisfed.tooling.invariants import (
    DependencyCounts,
    DependencyEdge,
    HistoryRow,
    WaitingJob,
    condition_met,
    dependency_counts,
    dependency_violations,
)

pytestmark = pytest.mark.unit

BROKEN_A = "dependency a ended failed; it had to succeed"


class History:
    """A changelog written in order: each row takes the next ``seq``."""

    def __init__(self) -> None:
        self.rows: list[HistoryRow] = []

    def add(self, job: str, frm: str | None, to: str, actor: str = "tick", peer: str | None = None,
            detail: str = "") -> HistoryRow:
        epoch = sum(1 for r in self.rows if r.job_id == job and r.to_state == "assigned") + (to == "assigned")
        row = HistoryRow(len(self.rows) + 1, job, frm, to, peer, epoch, actor, detail)
        self.rows.append(row)
        return row

    def submit(self, job: str) -> None:
        self.add(job, None, "queued", "router")

    def run(self, job: str, end: str, peer: str = "gpu-a") -> None:
        self.add(job, "queued", "assigned", "tick", peer)
        self.add(job, "assigned", "running", peer, peer)
        self.add(job, "running", end, peer, peer)

    def broken(self, job: str, reason: str = BROKEN_A) -> None:
        self.add(job, "queued", "unschedulable", "dependency", detail=reason)

    def states(self, **pending: int) -> dict[str, WaitingJob]:
        """Each job's last state (``pending``: deps_pending of the queued ones, else 0)."""
        last = {r.job_id: r.to_state for r in self.rows}
        return {job: WaitingJob(state, pending.get(job, 0)) for job, state in last.items()}


def edges(*triples: str) -> list[DependencyEdge]:
    """``"b<a:failed"``: b waits for a, which must end other than succeeded."""
    found = []
    for text in triples:
        job, _, rest = text.partition("<")
        needs, _, condition = rest.partition(":")
        found.append(DependencyEdge(job, needs, condition))
    return found


EDGES = edges("b<a:failed", "c<a:ok", "d<a:any", "d<b:any", "e<a:ok", "f<c:ok", "g<a:ok", "h<b:ok", "w<x:ok")


def good_history() -> History:
    """a fails: b (``failed``) runs, c (``ok``) ends unschedulable and so does f (after c);
    d (``any`` on a and b) runs once both ended; e, sent after a ended, is unschedulable
    at its submit; g (``ok`` on a) was cancelled while it waited; h runs after b succeeded;
    w still waits for x, which runs."""
    h = History()
    for job in ("a", "b", "c", "d", "f", "g", "h", "w", "x"):
        h.submit(job)
    h.add("g", "queued", "killed", "router")
    h.add("x", "queued", "assigned", "tick", "gpu-b")
    h.run("a", "failed")
    h.broken("c")
    h.broken("f", "dependency c ended unschedulable; it had to succeed")
    h.run("b", "succeeded", "gpu-b")
    h.run("d", "killed")
    h.run("h", "succeeded", "home")
    h.submit("e")
    h.broken("e")
    return h


def test_a_good_history_breaks_nothing():
    h = good_history()
    assert dependency_violations(h.rows, EDGES, h.states(w=1)) == []


def test_the_changelog_store_rows_and_any_order_read_the_same():
    h = good_history()
    rows = [ChangelogRow(r.seq, r.job_id, r.from_state and JobState(r.from_state), JobState(r.to_state), r.peer_id,
                         r.epoch, r.actor, r.detail) for r in reversed(h.rows)]
    assert dependency_violations(rows, EDGES, h.states(w=1)) == []


def test_a_dependent_placed_before_its_dependency_ended_is_an_early_start():
    h = History()
    for job in ("a", "b"):
        h.submit(job)
    h.add("a", "queued", "assigned", "tick", "gpu-a")
    h.run("b", "succeeded")  # b (any on a) started while a was still assigned
    h.add("a", "assigned", "running", "gpu-a", "gpu-a")
    h.add("a", "running", "succeeded", "gpu-a", "gpu-a")
    [problem] = dependency_violations(h.rows, edges("b<a:any"), h.states())
    assert problem == "b: assigned at seq 4 before its dependency a (any) ended (at seq 8)"


def test_a_dependent_that_started_though_its_dependency_never_ended():
    h = History()
    h.submit("a")
    h.submit("b")
    h.run("b", "succeeded")
    problems = dependency_violations(h.rows, edges("b<a:ok"), h.states())
    assert problems == ["b: assigned at seq 3 before its dependency a (ok) ended (never)"]


def test_a_dependent_that_started_after_its_dependency_ended_the_wrong_way():
    h = History()
    h.submit("a")
    h.submit("b")
    h.run("a", "succeeded")
    h.run("b", "succeeded")  # b needed a to fail
    problems = dependency_violations(h.rows, edges("b<a:failed"), h.states())
    assert problems == [
        "b: assigned at seq 6 though its dependency a (failed) ended succeeded at seq 5",
        "b: its dependency a (failed) ended succeeded at seq 5 (never to be met) but it ended succeeded at seq 8, "
        "not unschedulable"]


@pytest.mark.parametrize("after", ["queued", "killed"])
def test_a_dependent_not_ended_unschedulable_when_its_dependency_broke(after):
    h = History()
    h.submit("a")
    h.submit("c")
    h.run("a", "failed")
    if after == "killed":  # cancelled after a failed: it should have been unschedulable already
        h.add("c", "queued", "killed", "router")
    problems = dependency_violations(h.rows, edges("c<a:ok"), h.states())
    end = "still queued" if after == "queued" else "ended killed at seq 6"
    assert problems == [f"c: its dependency a (ok) ended failed at seq 5 (never to be met) but it {end}, "
                        f"not unschedulable"]


def test_a_broken_chain_ends_whole():
    """f waits for c, which waits for a: a failing ends c, and c's end ends f."""
    h = History()
    for job in ("a", "c", "f"):
        h.submit(job)
    h.run("a", "failed")
    h.broken("c")  # f is left waiting for a job that can never succeed now
    problems = dependency_violations(h.rows, edges("c<a:ok", "f<c:ok"), h.states())
    assert problems == ["f: its dependency c (ok) ended unschedulable at seq 7 (never to be met) but it still "
                        "queued, not unschedulable"]


def test_unschedulable_for_a_dependency_that_was_met_or_had_not_ended():
    h = History()
    for job in ("a", "b", "c"):
        h.submit(job)
    h.broken("c")  # before a ended at all
    h.run("a", "failed")
    h.broken("b", "dependency a ended failed; it had to succeed")  # b wanted a to fail: met
    problems = dependency_violations(h.rows, edges("b<a:failed", "c<a:ok"), h.states())
    assert problems == [
        "b: ended unschedulable for a dependency at seq 8 ('dependency a ended failed; it had to succeed') but "
        "none of its dependencies had ended breaking its condition",
        f"c: ended unschedulable for a dependency at seq 4 ({BROKEN_A!r}) but none of its dependencies had ended "
        f"breaking its condition"]


def test_a_dependent_that_ended_before_its_dependency_broke_is_left_alone():
    h = History()
    h.submit("a")
    h.submit("c")
    h.add("c", "queued", "unschedulable", "tick", detail="deadline passed")
    h.run("a", "failed")
    assert dependency_violations(h.rows, edges("c<a:ok"), h.states()) == []


def test_queued_at_the_end_with_every_dependency_ended_waits_forever():
    h = History()
    for job in ("a", "b", "d"):
        h.submit(job)
    h.run("a", "succeeded")
    h.run("b", "failed")
    problems = dependency_violations(h.rows, edges("d<a:ok", "d<b:any"), h.states())
    assert problems == ["d: still queued though every dependency ended (a succeeded, b failed): it waits forever"]


def test_a_count_of_pending_dependencies_that_can_never_reach_zero():
    h = History()
    for job in ("a", "b", "d"):
        h.submit(job)
    h.run("a", "succeeded")  # b still runs: d waits for one, but its count says two
    h.add("b", "queued", "assigned", "tick", "gpu-b")
    problems = dependency_violations(h.rows, edges("d<a:ok", "d<b:ok"), h.states(d=2))
    assert problems == ["d: queued with deps_pending 2 but 1 of its dependencies have not ended (b)"]
    assert dependency_violations(h.rows, edges("d<a:ok", "d<b:ok"), h.states(d=1)) == []


def test_a_dependency_on_a_job_that_does_not_exist():
    h = History()
    h.submit("b")
    problems = dependency_violations(h.rows, edges("b<ghost:ok"), h.states(b=1))
    assert problems == ["b: waits for ghost (ok), a job that does not exist"]


def test_conditions_and_counts():
    assert condition_met("ok", "succeeded") and not condition_met("ok", "killed")
    assert condition_met("failed", "unschedulable") and not condition_met("failed", "succeeded")
    assert condition_met("any", "succeeded") and condition_met("any", "rejected")
    h = good_history()
    # b, d and h started; c, e and f ended for a dependency; 9 edges on 8 dependents.
    assert dependency_counts(h.rows, EDGES) == DependencyCounts(edges=9, dependents=8, started=3, unschedulable=3)
