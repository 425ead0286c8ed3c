"""The pipelines section's rows (bench/pipelines.py): link latencies from changelog
rows, how each figure is judged against its target, what it says when it cannot be
judged, and that the rows reach the report. Pure: no servers, no processes; files only
in tmp_path."""

import math
from datetime import UTC, datetime, timedelta

import msgspec

from irisfed.bench.pipelines import (
    CHAIN_TARGET,
    FANOUT_GATE,
    FANOUT_TARGET,
    WAITING_TARGET,
    chain_figure,
    fanout_body,
    fanout_figure,
    link_latencies,
    submit_latencies,
    waiting_figure,
)
from irisfed.bench.report import Bench, Profile
from irisfed.shared.messages import SubmitRequest
from tests.infra.bench_reports import reported

T0 = datetime(2026, 12, 7, tzinfo=UTC)


def at(ms: float) -> datetime:
    return T0 + timedelta(milliseconds=ms)


# A chain a → b → c as the changelog holds it, in seq order.
ROWS = [
    ("a", "queued", at(0)), ("b", "queued", at(1)), ("c", "queued", at(2)),
    ("a", "assigned", at(10)), ("a", "running", at(12)), ("a", "succeeded", at(20)),
    ("b", "assigned", at(300)), ("b", "running", at(305)), ("b", "succeeded", at(310)),
    ("c", "assigned", at(800)), ("c", "running", at(810)), ("c", "succeeded", at(811)),
]


def test_each_link_runs_from_the_dependencys_end_to_the_dependents_start():
    assert [round(s * 1e3, 3) for s in link_latencies(ROWS, ["a", "b", "c"])] == [285.0, 500.0]
    assert [round(s * 1e3, 3) for s in link_latencies(ROWS, ["a", "b", "c"], "assigned")] == [280.0, 490.0]
    assert link_latencies(ROWS, ["a"]) == []


def test_a_link_missing_a_row_is_left_out_and_the_first_end_counts():
    rows = [r for r in ROWS if not (r[0] == "b" and r[1] == "running")]
    assert [round(s * 1e3, 3) for s in link_latencies(rows, ["a", "b", "c"])] == [500.0]
    # A job ended twice in the rows (never in irisfed's; the first counts).
    rows = ROWS + [("a", "failed", at(900))]
    assert round(link_latencies(rows, ["a", "b"])[0] * 1e3, 3) == 285.0
    assert link_latencies(ROWS, ["a", "x"]) == [] and link_latencies(ROWS, ["x", "a"]) == []


def test_a_lone_jobs_submit_is_its_queued_row():
    assert [round(s * 1e3, 3) for s in submit_latencies(ROWS, ["a", "c", "missing"])] == [12.0, 808.0]


def test_the_chain_is_judged_on_its_link_p50_against_the_lone_job_p50():
    met = chain_figure([0.009, 0.010, 0.011], [0.007, 0.008, 0.009], 4, assigned=[0.006] * 3, lone_bench_p50=0.0095)
    assert (met.section, met.unit) == ("pipelines", "ms") and met.name.startswith("chain of 4:")
    assert math.isclose(met.value, 10.0) and math.isclose(met.ratio, 10 / 8) and met.met is True
    assert met.target == f"≤ {CHAIN_TARGET:g}× lone job" and "(8.0 ms)" in met.baseline
    assert "end → assigned p50 6.0 ms" in met.note and "bench's clock (send → event) p50 9.5 ms" in met.note
    assert chain_figure([0.5] * 3, [0.01] * 3, 4).met is False
    broken = chain_figure([0.01] * 3, [0.01] * 3, 4, problem="2 of 4 chain jobs succeeded")
    assert broken.met is None and broken.ratio is None and broken.note.startswith("not judged: 2 of 4")
    assert chain_figure([0.01], [0.01] * 3, 10).met is None  # most links untimed
    assert chain_figure([0.01] * 9, [], 10).met is None  # no lone job


def test_one_jobs_dependents_are_judged_only_when_every_pass_released_and_placed_them_all():
    row = fanout_figure([0.9, 1.2, 1.0], [0.8, 0.9, 0.85], 100, [100] * 3, [100] * 3, [100] * 3, [0.2, 0.3, 0.25])
    assert math.isclose(row.ratio, 1.0 / 0.85) and row.met is True and row.target == f"≤ {FANOUT_TARGET:g}× plain"
    assert math.isclose(row.value, 1000.0) and "median 250.0 ms" in row.note
    assert fanout_figure([2.0], [1.0], 100, [100], [100], [100], [0.5]).met is False
    short = fanout_figure([0.9], [0.8], 100, [100], [99], [100], [0.2])
    assert short.met is None and short.note.startswith("not judged")
    assert fanout_figure([0.9], [0.8], 100, [50], [100], [100], [0.2]).met is None


def test_waiting_jobs_are_judged_only_when_no_pass_released_one():
    row = waiting_figure([0.105, 0.1, 0.11], [0.1, 0.1, 0.1], 2000, 1000, [1000] * 3, [1000] * 3, [2000] * 3)
    assert math.isclose(row.ratio, 1.05) and row.met is True and row.target == f"≤ {WAITING_TARGET:g}× none waiting"
    assert waiting_figure([0.12], [0.1], 2000, 1000, [1000], [1000], [2000]).met is False
    leaked = waiting_figure([0.1], [0.1], 2000, 1000, [1001], [1000], [1999])
    assert leaked.met is None and leaked.note.startswith("not judged")


def test_the_dependents_submit_is_valid_and_waits_for_the_gate():
    request = msgspec.json.decode(fanout_body("f", FANOUT_GATE)(3), type=SubmitRequest)
    assert request.job_id == "f-3" and [(d.job_id, d.when) for d in request.after] == [(FANOUT_GATE, "ok")]
    assert [c.value for c in request.constraints] == ["gpu"]
    assert msgspec.json.decode(fanout_body("f", None)(3), type=SubmitRequest).after == []


def test_the_section_runs_after_stops_in_quick_runs_and_its_rows_reach_the_report(tmp_path):
    from irisfed.bench.run import SECTIONS, chosen_sections

    names = list(SECTIONS)
    assert names.index("pipelines") == names.index("stops") + 1
    assert "pipelines" in chosen_sections(True, set(SECTIONS))
    bench = Bench(Profile(True), tmp_path)
    bench.add(chain_figure([0.5] * 9, [0.01] * 20, 10))
    bench.add(fanout_figure([0.07], [0.06], 200, [200], [200], [200], [0.03]))
    bench.add(waiting_figure([0.1], [0.1], 2000, 1000, [1000], [1000], [2000]))
    _, _, table = reported(bench, tmp_path)
    assert "| pipelines | chain of 10: dependency's end → dependent running p50 | 500 ms |" in table
    assert "≤ 1.5× lone job | **no** |" in table and "≤ 1.1× none waiting | yes |" in table


def test_the_bench_help_names_every_section():
    from irisfed.bench.run import SECTIONS
    from irisfed.cli.parser import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    listed = next(a.help for a in bench._actions if "--sections" in a.option_strings).split(":")[1].split("(")[0]
    assert [name.strip() for name in listed.split(",")] == list(SECTIONS)
