"""The preemption checks (docs/design.md §6, invariant 11; §3.3) on hand-made histories:
``preemption_violations`` passes a good history and names each crafted violation."""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogRow
from irisfed.tooling.invariants import (
    BandedJob,
    HistoryRow,
    count_preemptions,
    preemption_violations,
    preemptor_of,
    victims_named,
)

pytestmark = pytest.mark.unit

BATCH, INTERACTIVE, PRODUCTION = 0, 1, 2
T1, T2 = "2026-01-01T00:00:01", "2026-01-01T00:00:02"  # transaction marks (``at``)


def row(seq, job, frm, to, peer, epoch, actor="tick", detail="", tx=None) -> HistoryRow:
    return HistoryRow(seq, job, frm, to, peer, epoch, actor, detail, tx)


def ran(job: str, peer: str, first: int) -> list[HistoryRow]:
    """``job`` submitted, placed on ``peer`` and running there (epoch 1), at seq first..first+2."""
    return [row(first, job, None, "queued", None, 0, "router", "queued"),
            row(first + 1, job, "queued", "assigned", peer, 1, "tick", "placed"),
            row(first + 2, job, "assigned", "running", peer, 1, peer, "started")]


def good_history() -> list[HistoryRow]:
    """x (batch) runs on gpu-a; j (production) preempts it there; x runs again on gpu-b."""
    return [
        *ran("x", "gpu-a", 1),
        row(4, "j", None, "queued", None, 0, "router", "queued"),
        row(5, "x", "running", "queued", None, 2, detail="preempted by j", tx=T1),
        row(6, "j", "queued", "assigned", "gpu-a", 1, detail="placed; preempted x", tx=T1),
        row(7, "x", "queued", "assigned", "gpu-b", 3, detail="placed", tx=T2),
        row(8, "x", "assigned", "running", "gpu-b", 3, "gpu-b", "started"),
        row(9, "x", "running", "succeeded", "gpu-b", 3, "gpu-b", "exit 0"),
    ]


JOBS = {"x": BandedJob(BATCH, None, "succeeded", 1), "j": BandedJob(PRODUCTION, None, "assigned", 0)}


def replace(history: list[HistoryRow], seq: int, **changes) -> list[HistoryRow]:
    return [r._replace(**changes) if r.seq == seq else r for r in history]


def test_a_good_history_passes_and_counts_its_preemption():
    history = good_history()
    assert preemption_violations(history, JOBS, {"gpu-a": set(), "gpu-b": set()}) == []
    assert preemption_violations(list(reversed(history)), JOBS) == []  # any order: sorted by seq
    assert count_preemptions(history) == 1
    assert preemptor_of(history[4]) == "j"
    assert victims_named(history[5]) == ["x"]
    assert preemptor_of(history[5]) is None and victims_named(history[4]) is None


def test_store_rows_with_enum_states_and_no_transaction_mark_pass_too():
    history = [ChangelogRow(r.seq, r.job_id, JobState(r.from_state) if r.from_state else None,
                            JobState(r.to_state), r.peer_id, r.epoch, r.actor, r.detail) for r in good_history()]
    assert preemption_violations(history, JOBS) == []


def test_failed_and_killed_victims_pass_with_their_reason():
    for to_state, why in (("failed", "; preempted 2 times, more than its max_preemptions 1"),
                          ("killed", "; cancelled by user default")):
        history = [*good_history()[:4],
                   row(5, "x", "running", to_state, "gpu-a", 2, detail=f"preempted by j{why}", tx=T1),
                   row(6, "j", "queued", "assigned", "gpu-a", 1, detail="placed; preempted x", tx=T1)]
        jobs = {**JOBS, "x": BandedJob(BATCH, None, to_state, 1)}
        assert preemption_violations(history, jobs) == []
        # ... but a terminal victim moves no more.
        late = [*history, row(7, "x", to_state, "queued", None, 3, detail="placed")]
        assert any("after its preemption ended it" in p for p in preemption_violations(late, jobs))


@pytest.mark.parametrize("x_band, j_band", [(INTERACTIVE, INTERACTIVE), (PRODUCTION, PRODUCTION),
                                            (INTERACTIVE, BATCH)])
def test_only_strictly_lower_bands_never_production(x_band, j_band):
    jobs = {"x": BandedJob(x_band, None, "succeeded", 1), "j": BandedJob(j_band, None, "assigned", 0)}
    problems = preemption_violations(good_history(), jobs)
    assert len(problems) == 1 and "only strictly lower bands" in problems[0], problems


def test_preempting_on_one_peer_for_room_on_another():
    history = replace(good_history(), 6, peer_id="gpu-b")
    problems = preemption_violations(history, JOBS)
    assert len(problems) == 1 and "ran on gpu-a but j was placed on gpu-b" in problems[0], problems


def test_the_placement_in_another_transaction():
    problems = preemption_violations(replace(good_history(), 6, tx=T2), JOBS)
    assert len(problems) == 1 and "another transaction" in problems[0], problems


def test_a_preemption_with_no_placement_after_it():
    history = [r for r in good_history() if r.seq != 6]
    problems = preemption_violations(history, JOBS)
    assert len(problems) == 1 and "next row is not its placement" in problems[0], problems
    # A plain placement (naming no victims) is not the preemption's either.
    problems = preemption_violations(replace(good_history(), 6, detail="placed"), JOBS)
    assert len(problems) == 1 and "next row is not its placement" in problems[0], problems


def test_the_placement_names_exactly_its_victims():
    named_more = replace(good_history(), 6, detail="placed; preempted x, y")
    problems = preemption_violations(named_more, JOBS)
    assert len(problems) == 1 and "names y but no preemption by j" in problems[0], problems
    twice = replace(good_history(), 6, detail="placed; preempted x, x")
    assert any("names a victim twice" in p for p in preemption_violations(twice, JOBS))
    # y preempted for j too, in the same transaction, but the placement leaves it out.
    base = good_history()
    y_rows = [row(-3, "y", None, "queued", None, 0, "router"), row(-2, "y", "queued", "assigned", "gpu-a", 1),
              row(-1, "y", "assigned", "running", "gpu-a", 1, "gpu-a")]
    left_out = [*y_rows, *base[:4], row(5, "y", "running", "queued", None, 2, detail="preempted by j", tx=T1),
                *[r._replace(seq=r.seq + 1) for r in base[4:]]]
    jobs = {**JOBS, "y": BandedJob(BATCH, None, "queued", 1)}
    problems = preemption_violations(left_out, jobs)
    assert len(problems) == 2, problems
    assert any("does not name it" in p for p in problems)
    assert any("y preempted for it but not named" in p for p in problems)
    both = replace(left_out, 7, detail="placed; preempted x, y")
    jobs["j"] = BandedJob(PRODUCTION, {"cpu": 2}, "assigned", 0)  # x's and y's core each: both needed
    assert preemption_violations(both, jobs, {"gpu-a": {"cpu"}}) == []


def test_a_write_of_the_fenced_run_after_the_preemption():
    stale = [*good_history()[:6], row(6.5, "x", "running", "succeeded", "gpu-a", 1, "gpu-a", "exit 0")]
    problems = preemption_violations(stale, {**JOBS, "x": BandedJob(BATCH, None, "succeeded", 1)})
    assert any("carries epoch 1 after its preemption moved it to 2" in p for p in problems), problems
    assert any("follows its preemption back to queued" in p for p in problems), problems


def test_the_epoch_must_be_bumped_and_a_requeued_victim_names_no_peer():
    problems = preemption_violations(replace(good_history(), 5, epoch=1), JOBS)
    assert any("not bumped by one" in p for p in problems), problems
    problems = preemption_violations(replace(good_history(), 5, peer_id="gpu-a"), JOBS)
    assert len(problems) == 1 and "still names peer gpu-a" in problems[0], problems


def test_only_live_jobs_are_preempted():
    history = [row(1, "x", None, "queued", None, 0, "router"), row(4, "j", None, "queued", None, 0, "router"),
               row(5, "x", "queued", "queued", None, 1, detail="preempted by j", tx=T1),
               row(6, "j", "queued", "assigned", "gpu-a", 1, detail="placed; preempted x", tx=T1)]
    problems = preemption_violations(history, {**JOBS, "x": BandedJob(BATCH, None, "queued", 1)})
    assert any("not from assigned or running" in p for p in problems), problems
    assert any("no run owner on record" in p for p in problems), problems


def test_a_preempted_job_is_never_lost_and_its_preemptions_are_counted():
    problems = preemption_violations(good_history(), {"j": JOBS["j"]})
    assert len(problems) == 1 and "gone from jobs" in problems[0], problems
    problems = preemption_violations(good_history(), {**JOBS, "x": BandedJob(BATCH, None, "succeeded", 0)})
    assert len(problems) == 1 and "jobs.preemptions is 0 but the changelog shows 1" in problems[0], problems


def _two_victims(x_cpu: float, y_cpu: float, j_cpu: float) -> tuple[list[HistoryRow], dict[str, BandedJob]]:
    history = [*ran("x", "gpu-a", 1), *[r._replace(seq=r.seq + 10) for r in ran("y", "gpu-a", 1)],
               row(20, "j", None, "queued", None, 0, "router"),
               row(21, "x", "running", "queued", None, 2, detail="preempted by j", tx=T1),
               row(22, "y", "running", "queued", None, 2, detail="preempted by j", tx=T1),
               row(23, "j", "queued", "assigned", "gpu-a", 1, detail="placed; preempted x, y", tx=T1)]
    jobs = {"x": BandedJob(BATCH, {"cpu": x_cpu}, "queued", 1), "y": BandedJob(BATCH, {"cpu": y_cpu}, "queued", 1),
            "j": BandedJob(INTERACTIVE, {"cpu": j_cpu}, "assigned", 0)}
    return history, jobs


def test_never_more_than_needed():
    # j asks 4 cores; x and y hold 2 each: both were needed where cpu counts.
    history, jobs = _two_victims(2, 2, 4)
    assert preemption_violations(history, jobs, {"gpu-a": {"cpu"}}) == []
    assert preemption_violations(history, jobs) == []  # unknown peer: every resource counts
    # ... but on a peer placing by slots only one victim's slot was all j could lack.
    problems = preemption_violations(history, jobs, {"gpu-a": set()})
    assert len(problems) == 1 and "more than needed" in problems[0], problems
    # x alone (4 cores) held all j asks: y was needless wherever cpu counts.
    history, jobs = _two_victims(4, 1, 4)
    problems = preemption_violations(history, jobs, {"gpu-a": {"cpu", "memory_mb"}})
    assert len(problems) == 1 and "without y" in problems[0], problems
