"""pgqueuer as the bench's peer baseline: when it runs, how its start times are read,
and how irisfed's figures are compared with it and judged against the bench's targets."""

import math

import pytest

from irisfed.bench.pgqueuer import parse_start, start_latencies, start_line
from irisfed.bench.report import (
    Bench,
    Figure,
    Profile,
    issue_targets,
    judge,
    markdown,
    note_ms,
    pgqueuer_comparisons,
)
from irisfed.bench.run import SECTIONS, chosen_sections


def test_pgqueuer_comes_with_submit_or_dispatch_and_in_quick_runs():
    everything = set(SECTIONS)
    assert "pgqueuer" in chosen_sections(True, everything)
    assert chosen_sections(False, {"dispatch"}) == {"dispatch", "pgqueuer"}
    assert chosen_sections(True, {"submit", "tick"}) == {"submit", "tick", "pgqueuer"}
    assert chosen_sections(False, {"tick"}) == {"tick"}
    assert chosen_sections(True, {"pgqueuer"}) == {"pgqueuer"}


def test_start_lines_round_trip_and_latencies_skip_jobs_that_never_started():
    job, at = parse_start(start_line(b"d-17", 12345.000123))
    assert job == "d-17" and math.isclose(at, 12345.000123)
    sent = {"d-0": 10.0, "d-1": 10.5, "d-2": 11.0}
    started = {"d-0": 10.004, "d-2": 11.001, "w-9": 3.0}
    assert start_latencies(sent, started) == pytest.approx([0.001, 0.004])


def test_note_values_are_read_by_label_not_by_prefix():
    note = "p50 11.42 ms, p99 23.59 ms, p999 1,028.52 ms, errors 0"
    assert note_ms(note, "p50") == 11.42 and note_ms(note, "p99") == 23.59
    assert note_ms(note, "p999") == 1028.52
    assert note_ms("errors 0", "p99") is None


def irisfed_figures(p50_ms=9.0, p99_ms=30.0, ratio_100=0.42, p99_100="8.10", ratio_2000=0.30):
    return [
        Figure("submit", "durable submits/s, 100 in flight", 9000.0, "req/s", "NATS r/r 100", ratio_100,
               met=ratio_100 >= 0.40 and float(p99_100) <= 10,
               note=f"p50 4.00 ms, p99 {p99_100} ms, p999 12.00 ms, errors 0"),
        Figure("submit", "durable submits/s, 2000 in flight", 15000.0, "req/s", "NATS r/r 2000", ratio_2000,
               met=ratio_2000 >= 0.35),
        Figure("dispatch", "submit → running p50 at 500/s", p50_ms, "ms"),
        Figure("dispatch", "submit → running p99 at 500/s", p99_ms, "ms"),
        Figure("web", "submit → running p50 at 500/s, 100 live dashboard clients", 99.0, "ms"),
    ]


PGQ = {"pgq_start_p50": 0.005, "pgq_start_p99": 0.040, "pgq_enqueue_100": 2000.0,
       "pgq_enqueue_100_p50": 0.040, "pgq_enqueue_100_p99": 0.090}


def test_comparisons_sit_beside_the_irisfed_rows_they_compare():
    bench = Bench(Profile(True), None)
    bench.figures = irisfed_figures()
    bench.baselines = dict(PGQ)
    judge(bench)
    names = [f.name for f in bench.figures]
    assert names.index("submit → running p50 vs pgqueuer enqueue → start p50") == \
        names.index("submit → running p50 at 500/s") + 1
    assert names.index("durable submits at 100 in flight vs pgqueuer 100 concurrent enqueues") == \
        names.index("durable submits/s, 100 in flight") + 1
    p50 = bench.figures[names.index("submit → running p50 vs pgqueuer enqueue → start p50")]
    assert p50.ratio == pytest.approx(1.8) and p50.met is True and "5.0 ms" in p50.baseline
    p99 = bench.figures[names.index("submit → running p99 vs pgqueuer enqueue → start p99")]
    assert p99.ratio == pytest.approx(0.75) and p99.met is True
    submits = bench.figures[names.index("durable submits at 100 in flight vs pgqueuer 100 concurrent enqueues")]
    assert submits.ratio == pytest.approx(4.5) and "8.10 ms" in submits.note and "90.00 ms" in submits.note


def test_p50_must_be_both_under_10_ms_and_within_2x_pgqueuer():
    (_, fast_but_far), *_ = pgqueuer_comparisons(irisfed_figures(p50_ms=9.0), {**PGQ, "pgq_start_p50": 0.004})
    assert fast_but_far.ratio == pytest.approx(2.25) and fast_but_far.met is False
    (_, close_but_slow), *_ = pgqueuer_comparisons(irisfed_figures(p50_ms=12.0), {**PGQ, "pgq_start_p50": 0.010})
    assert close_but_slow.ratio == pytest.approx(1.2) and close_but_slow.met is False


def test_issue_targets_met_and_not_met():
    targets = {t.what: t for t in issue_targets(irisfed_figures(p50_ms=11.0, p99_ms=60.0), PGQ)}
    assert targets["submit → running p50 at 500/s ≤ 10 ms"].met is False
    assert targets["submit → running p50 ≤ 2× pgqueuer enqueue → start p50"].met is False  # 2.2×
    assert "2.20×" in targets["submit → running p50 ≤ 2× pgqueuer enqueue → start p50"].measured
    assert targets["submit → running p99 at 500/s ≤ 50 ms"].met is False
    assert targets["durable submits at 2,000 in flight ≥ 0.35× the NATS echo"].met is False
    at_100 = targets["durable submits at 100 in flight ≥ 0.40× the NATS echo, ack p99 ≤ 10 ms"]
    assert at_100.met is True and "0.42×" in at_100.measured and "ack p99 8.10 ms" in at_100.measured
    slow_acks = {t.what: t for t in issue_targets(irisfed_figures(p99_100="12.50"), PGQ)}
    assert slow_acks["durable submits at 100 in flight ≥ 0.40× the NATS echo, ack p99 ≤ 10 ms"].met is False


def test_targets_whose_figures_did_not_run_are_not_judged_and_say_why():
    submit_only = [f for f in irisfed_figures() if f.section == "submit"]
    targets = {t.what: t for t in issue_targets(submit_only, {})}
    p50 = targets["submit → running p50 at 500/s ≤ 10 ms"]
    assert p50.met is None and "--sections dispatch" in p50.measured
    assert targets["durable submits at 2,000 in flight ≥ 0.35× the NATS echo"].met is False
    dispatch_only = [f for f in irisfed_figures() if f.section == "dispatch"]
    vs_pgq = {t.what: t for t in issue_targets(dispatch_only, {})}["submit → running p50 ≤ 2× pgqueuer enqueue → start p50"]
    assert vs_pgq.met is None and "--sections pgqueuer" in vs_pgq.measured


def test_runs_without_submit_dispatch_or_pgqueuer_judge_nothing():
    bench = Bench(Profile(True), None)
    bench.figures = [Figure("tick", "assignments/s, 10,000 queued × 20 peers", 20000.0, "jobs/s")]
    judge(bench)
    assert bench.targets == [] and len(bench.figures) == 1


def test_markdown_renders_the_targets():
    bench = Bench(Profile(False), None)
    bench.figures = irisfed_figures(p50_ms=11.0)
    bench.baselines = dict(PGQ)
    judge(bench)
    from dataclasses import asdict
    doc = {"machine": "m", "when": "2026-12-01T00:00:00", "quick": False,
           "figures": [asdict(f) for f in bench.figures], "targets": [asdict(t) for t in bench.targets]}
    text = markdown(doc)
    assert "| submit → running p50 at 500/s ≤ 10 ms | 11.0 ms | **no** |" in text
    assert "vs pgqueuer enqueue → start p50" in text
