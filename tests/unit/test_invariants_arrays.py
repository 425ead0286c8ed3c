"""The arrays' check (docs/design.md §3.8; ``array_violations``) on hand-made changelogs,
``job_arrays`` rows and element rows: a good history passes, and each way of breaking
it is named (too many live at once, an element stranded, an array not whole)."""

from __future__ import annotations

import pytest

from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import ChangelogRow
from irisfed.tooling.invariants import (
    ArrayElement,
    ArrayPeak,
    HistoryRow,
    JobArray,
    array_peaks,
    array_violations,
)

pytestmark = pytest.mark.unit

TERMINAL = ("succeeded", "failed", "killed", "rejected", "unschedulable")


class History:
    """A changelog written in order (each row the next ``seq``), and each element's row
    as it ends: its last state and whether it is still held."""

    def __init__(self) -> None:
        self.rows: list[HistoryRow] = []
        self.held: set[str] = set()

    def add(self, job: str, frm: str | None, to: str, actor: str = "tick", peer: str | None = None) -> None:
        epoch = sum(1 for r in self.rows if r.job_id == job and r.to_state == "assigned") + (to == "assigned")
        self.rows.append(HistoryRow(len(self.rows) + 1, job, frm, to, peer, epoch, actor, ""))

    def submit(self, base: str, size: int, parallel: int | None) -> JobArray:
        for i in range(size):
            self.add(f"{base}_{i}", None, "queued", "router")
            if parallel is not None and i >= parallel:
                self.held.add(f"{base}_{i}")
        return JobArray(base, size, parallel)

    def start(self, job: str, peer: str = "gpu-a") -> None:
        self.held.discard(job)  # (released first, when it was held)
        self.add(job, "queued", "assigned", "tick", peer)
        self.add(job, "assigned", "running", peer, peer)

    def end(self, job: str, state: str = "succeeded", peer: str = "gpu-a") -> None:
        self.add(job, "running", state, peer, peer)

    def cancel_queued(self, job: str) -> None:
        self.add(job, "queued", "killed", "router")  # a held element cancelled stays marked held

    def elements(self, arrays: list[JobArray], held: set[str] | None = None) -> list[ArrayElement]:
        last = {r.job_id: r.to_state for r in self.rows}
        held = self.held if held is None else held
        return [ArrayElement(f"{a.array_id}_{i}", a.array_id, i, last[f"{a.array_id}_{i}"],
                             f"{a.array_id}_{i}" in held)
                for a in arrays for i in range(a.size)]


def good_history() -> tuple[History, list[JobArray]]:
    """sweep: 5 elements, 2 at once; one preempted (queued again, its slot kept) and one
    failing; alice:grid (3 elements, no limit) all at once; cut (4, 1 at once) cancelled
    by its base id after its first element ran: its held ones end killed, still marked held."""
    h = History()
    sweep, grid, cut = h.submit("sweep", 5, 2), h.submit("alice:grid", 3, None), h.submit("cut", 4, 1)
    h.start("sweep_0")
    h.start("sweep_1", "gpu-b")
    for i in range(3):
        h.start(f"alice:grid_{i}", "home")
    h.start("cut_0")
    h.add("sweep_1", "running", "queued", "tick")  # preempted: still holds its slot
    h.end("sweep_0", "failed")
    h.start("sweep_2")  # released by sweep_0's end
    for i in range(3):
        h.end(f"alice:grid_{i}", peer="home")
    h.add("sweep_1", "queued", "assigned", "tick", "gpu-a")
    h.add("sweep_1", "assigned", "running", "gpu-a", "gpu-a")
    for i in (3, 2, 1):
        h.cancel_queued(f"cut_{i}")
    h.add("cut_0", "running", "killed", "gpu-a", "gpu-a")
    h.end("sweep_1")
    h.start("sweep_3")
    h.end("sweep_2")
    h.start("sweep_4", "gpu-b")
    h.end("sweep_3")
    h.end("sweep_4", peer="gpu-b")
    return h, [sweep, grid, cut]


def test_a_good_history_breaks_nothing():
    h, arrays = good_history()
    assert array_violations(h.rows, arrays, h.elements(arrays)) == []
    assert array_peaks(h.rows, arrays, h.elements(arrays)) == {
        "sweep": ArrayPeak(2, 2), "alice:grid": ArrayPeak(3, 3), "cut": ArrayPeak(1, 1)}


def test_the_changelog_store_rows_and_any_order_read_the_same():
    h, arrays = good_history()
    rows = [ChangelogRow(r.seq, r.job_id, r.from_state and JobState(r.from_state), JobState(r.to_state), r.peer_id,
                         r.epoch, r.actor, r.detail) for r in reversed(h.rows)]
    assert array_violations(rows, arrays, h.elements(arrays)) == []


def test_more_live_than_the_limit_is_named_with_the_elements_live_then():
    h = History()
    sweep = h.submit("sweep", 4, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.start("sweep_2")  # while 0 and 1 still run: a third slot
    h.start("sweep_3")
    for i in range(4):
        h.end(f"sweep_{i}")
    problems = array_violations(h.rows, [sweep], h.elements([sweep]))
    assert problems == ["sweep: 3 elements live at seq 9 (sweep_0, sweep_1, sweep_2; sweep_2 → assigned), "
                        "over its limit of 2 (most at once: 4)"]


def test_an_assignment_before_the_end_it_waited_for_is_over_the_limit():
    """The release must follow the end in seq order: a placement one row early is a third live."""
    h = History()
    sweep = h.submit("sweep", 3, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.add("sweep_2", "queued", "assigned", "tick", "gpu-b")
    h.end("sweep_0")
    h.add("sweep_2", "assigned", "running", "gpu-b", "gpu-b")
    h.end("sweep_1")
    h.end("sweep_2", peer="gpu-b")
    [problem] = array_violations(h.rows, [sweep], h.elements([sweep], held=set()))
    assert problem.startswith("sweep: 3 elements live at seq 8 (sweep_0, sweep_1, sweep_2; ")


def test_a_requeued_element_keeps_its_slot():
    """Preempted and queued again, it still holds its slot: a third element placed meanwhile
    makes three (its own end alone frees a slot)."""
    h = History()
    sweep = h.submit("sweep", 3, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.add("sweep_1", "running", "queued", "tick")
    h.start("sweep_2")
    h.end("sweep_0")
    h.end("sweep_2")
    h.start("sweep_1")
    h.end("sweep_1")
    [problem] = array_violations(h.rows, [sweep], h.elements([sweep]))
    assert "over its limit of 2" in problem and "sweep_2 → assigned" in problem


def test_without_a_limit_every_element_may_be_live():
    h = History()
    grid = h.submit("grid", 3, None)
    for i in range(3):
        h.start(f"grid_{i}")
    for i in range(3):
        h.end(f"grid_{i}")
    assert array_violations(h.rows, [grid], h.elements([grid])) == []
    assert array_peaks(h.rows, [grid], h.elements([grid])) == {"grid": ArrayPeak(3, 3)}


def test_an_element_held_while_a_slot_is_free_is_stranded():
    h = History()
    sweep = h.submit("sweep", 4, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.end("sweep_0")  # frees a slot, but nothing released sweep_2
    h.end("sweep_1", "failed")
    problems = array_violations(h.rows, [sweep], h.elements([sweep]))
    assert problems == ["sweep: sweep_2, sweep_3 still held, waiting for a slot, though only 0 of its 2 slots "
                        "are taken: stranded"]


def test_one_slot_free_with_another_taken_is_stranded_too_and_the_taker_is_named():
    h = History()
    sweep = h.submit("sweep", 4, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.end("sweep_0")
    problems = array_violations(h.rows, [sweep], h.elements([sweep]))
    assert problems == ["sweep: sweep_2, sweep_3 still held, waiting for a slot, though only 1 of its 2 slots "
                        "are taken (sweep_1): stranded"]


def test_held_elements_waiting_while_every_slot_is_taken_are_not_stranded():
    """Mid-run: two slots taken (one released but not placed yet, waiting for the tick)."""
    h = History()
    sweep = h.submit("sweep", 4, 2)
    h.start("sweep_0")
    h.start("sweep_1")
    h.end("sweep_0")
    h.held.discard("sweep_2")  # released by sweep_0's end, still queued
    assert array_violations(h.rows, [sweep], h.elements([sweep])) == []


@pytest.mark.parametrize("state", TERMINAL)
def test_a_held_element_that_ended_is_not_stranded(state):
    h = History()
    sweep = h.submit("sweep", 3, 1)
    h.add("sweep_1", "queued", state, "router")
    h.add("sweep_2", "queued", state, "router")
    h.start("sweep_0")
    h.end("sweep_0")
    assert array_violations(h.rows, [sweep], h.elements([sweep])) == []


def test_an_array_missing_an_element_or_with_one_too_many():
    h = History()
    short, extra = h.submit("short", 3, None), h.submit("extra", 2, None)
    h.add("extra_2", None, "queued", "router")
    elements = [e for e in h.elements([short, extra]) if e.job_id != "short_1"]
    elements.append(ArrayElement("extra_2", "extra", 2, "queued", False))
    problems = array_violations(h.rows, [short, extra], elements)
    assert problems == ["extra: an array of size 2 with 3 elements; index 2 twice or out of range",
                        "short: an array of size 3 with 2 elements; no element at index 1"]


def test_an_element_at_another_index_than_its_id_says_or_named_twice():
    h = History()
    sweep = h.submit("sweep", 3, None)
    elements = h.elements([sweep])
    elements[2] = elements[2]._replace(array_index=1)  # sweep_2 stored at index 1
    problems = array_violations(h.rows, [sweep], elements)
    assert problems == ["sweep: an array of size 3 with no element at index 2; index 1 twice or out of range; "
                        "misnamed sweep_2 (index 1)"]


def test_elements_of_an_array_job_arrays_does_not_hold():
    h = History()
    h.add("ghost_0", None, "queued", "router")
    problems = array_violations(h.rows, [], [ArrayElement("ghost_0", "ghost", 0, "queued", False)])
    assert problems == ["ghost: its elements (ghost_0) name an array job_arrays does not hold"]


def test_an_array_with_no_element_at_all():
    assert array_violations([], [JobArray("lost", 2, 1)], []) == [
        "lost: an array of size 2 with 0 elements; no element at index 0, 1"]


def test_rows_of_other_jobs_and_rows_after_an_end_are_not_counted():
    h = History()
    sweep = h.submit("sweep", 2, 1)
    h.add("other", None, "queued", "router")
    h.add("other", "queued", "assigned", "tick", "gpu-a")
    h.start("sweep_0")
    h.end("sweep_0")
    h.add("sweep_0", "succeeded", "running", "gpu-a", "gpu-a")  # (a bad row the changelog check names)
    h.start("sweep_1")
    h.end("sweep_1")
    assert array_violations(h.rows, [sweep], h.elements([sweep])) == []
    assert array_peaks(h.rows, [sweep], h.elements([sweep]))["sweep"].most == 1
