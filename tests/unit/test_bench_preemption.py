"""The preemption section's rows (bench/preemption.py): how each figure is judged
against its target, what it says when it cannot be judged, and that the rows reach the
report. Pure: no servers, no processes; files only in tmp_path."""

import json
import math
from dataclasses import asdict

import msgspec

from irisfed.bench.load import Run
from irisfed.bench.preemption import (
    DISPATCH_NAME,
    DISPATCH_TARGET,
    PREEMPT_PEERS,
    TICK_TARGET,
    batch_body,
    dispatch_figure,
    tick_figure,
)
from irisfed.bench.report import Bench, Profile, markdown
from tests.infra.bench_reports import reported


def run(*ms: float) -> Run:
    return Run(len(ms), 0.0, [m / 1e3 for m in ms])


def test_the_preempting_dispatch_is_judged_on_its_p50_against_the_idle_p50():
    idle = run(40, 50, 60, 70)
    met = dispatch_figure(run(100, 120, 140), idle, sent=3, hops=["→queued 5.0"], idle_hops=["→queued 4.0"])
    assert (met.section, met.name, met.unit) == ("preemption", DISPATCH_NAME, "ms")
    assert math.isclose(met.value, 120.0) and math.isclose(met.ratio, 120 / 60)
    assert met.met is True and met.target == f"≤ {DISPATCH_TARGET:g}× idle" == "≤ 3× idle"
    assert met.baseline == "same job, idle federation (p50 60.0 ms)" and met.runs == "3 + 4 samples"
    assert "3/3 preempted" in met.note and "hop p50 ms: →queued 5.0" in met.note and "→queued 4.0" in met.note
    unmet = dispatch_figure(run(190, 200, 210), idle, sent=3, hops=[], idle_hops=[])
    assert math.isclose(unmet.ratio, 200 / 60) and unmet.met is False


def test_a_preempting_dispatch_with_too_few_preemptions_or_no_idle_samples_is_not_judged():
    # Fewer than half of the jobs sent preempted (e.g. batch jobs stored as interactive).
    few = dispatch_figure(run(100, 120), run(50, 60), sent=10, hops=[], idle_hops=[])
    assert few.met is None and few.ratio is None and few.note.startswith("not judged: 2/10 jobs preempted")
    assert few.target == "≤ 3× idle"  # the target is still shown, as not judged
    none = dispatch_figure(Run(0, 0.0, []), run(50, 60), sent=0, hops=[], idle_hops=[])
    assert none.met is None and math.isnan(none.value)
    no_idle = dispatch_figure(run(100, 120), Run(0, 0.0, []), sent=2, hops=[], idle_hops=[])
    assert no_idle.met is None and no_idle.note.startswith("not judged: no idle sample")
    half = dispatch_figure(run(100), run(50), sent=2, hops=[], idle_hops=[])
    assert half.met is True  # half of them is enough


def test_the_preempting_tick_pass_is_judged_on_medians_of_alternating_pairs():
    preempting, plain = [0.9, 1.2, 1.0], [0.5, 0.6, 0.55]
    fig = tick_figure(preempting, plain, running=10_000, peers=100, queued=200, preempted=[200] * 3,
                      waited=[200] * 3)
    assert fig.name == "tick pass preempting for 200 queued, 10,000 running × 100 peers"
    assert math.isclose(fig.value, 1000.0) and math.isclose(fig.ratio, 1.0 / 0.55)
    assert fig.met is True and fig.target == f"≤ {TICK_TARGET:g}× not preempting" == "≤ 2× not preempting"
    assert fig.baseline == "same pass, nothing preemptible (550.0 ms)" and fig.runs == "3 pairs, alternating"
    assert "pair ratios 1.80 2.00 1.82" in fig.note and "preempted 200/200" in fig.note
    assert "left 200/200 waiting" in fig.note and "100 a peer" in fig.note
    slow = tick_figure([1.5, 1.6, 1.4], plain, 10_000, 100, 200, [200] * 3, [200] * 3)
    assert slow.met is False


def test_a_tick_pass_that_did_not_preempt_or_wait_for_the_whole_queue_is_not_judged():
    short = tick_figure([0.9, 1.0, 1.1], [0.6, 0.6, 0.6], 10_000, 100, 200, [200, 198, 200], [200] * 3)
    assert short.met is None and short.note.startswith("not judged:") and "preempted 198–200/200" in short.note
    placed = tick_figure([0.9, 1.0, 1.1], [0.6, 0.6, 0.6], 10_000, 100, 200, [200] * 3, [200, 0, 200])
    assert placed.met is None and "left 0–200/200 waiting" in placed.note


def test_the_batch_fill_is_a_valid_submit_of_a_batch_gpu_sleep_never_failed_for_its_preemptions():
    from irisfed.shared.bands import MAX_PREEMPTIONS_LIMIT
    from irisfed.shared.messages import SubmitRequest

    request = msgspec.json.decode(batch_body("fill")(3), type=SubmitRequest)
    assert (request.job_id, request.band, request.max_preemptions) == ("fill-3", "batch", MAX_PREEMPTIONS_LIMIT)
    assert request.command[0] == "sleep" and [c.value for c in request.constraints] == ["gpu"]
    assert [p for p, attrs, _ in PREEMPT_PEERS if attrs["device_type"] == "gpu"] == ["gpu0", "gpu1"]


def test_the_section_runs_in_quick_runs_and_its_rows_reach_the_report(tmp_path):
    from irisfed.bench.run import SECTIONS, chosen_sections

    assert "preemption" in chosen_sections(True, set(SECTIONS))
    bench = Bench(Profile(True), tmp_path)
    bench.add(dispatch_figure(run(100, 120, 140), run(40, 50, 60), 3, [], []))
    bench.add(tick_figure([0.9, 1.2, 1.0], [0.5, 0.6, 0.55], 10_000, 100, 200, [200] * 3, [200] * 3))
    bench.add(dispatch_figure(Run(0, 0.0, []), run(50), 0, [], []))  # not judged, its value NaN
    out, doc, table = reported(bench, tmp_path)
    assert "| preemption | tick pass preempting for 200 queued, 10,000 running × 100 peers | 1,000 ms |" in table
    assert "≤ 2× not preempting | yes |" in table and "≤ 3× idle | not judged |" in table
    assert "not judged" in markdown(doc)
    assert json.loads(out.read_text())["figures"][0] == json.loads(json.dumps(asdict(bench.figures[0])))


def test_bench_jobs_take_the_kind_asked_for():
    from irisfed.bench.sections import _bench_job

    assert '"value":"gpu"' in _bench_job(0, kind="gpu").spec_json.replace(" ", "")
    assert '"value":"cpu"' in _bench_job(0).spec_json.replace(" ", "")  # KINDS[0 % 3]
