"""``irisfed bench --compare``: medians and ratios from alternating runs (pure parts)."""

from irisfed.bench.compare import render, render_series, summarise


def run(**values):
    return {"figures": [{"section": "dispatch", "name": name.replace("_", " "), "unit": unit, "value": v}
                        for name, (v, unit) in values.items()]}


def test_medians_and_ratio_per_figure_found_in_every_run():
    rev = [run(p50=(6.0, "ms"), gone=(1.0, "ms")), run(p50=(7.0, "ms"), gone=(1.0, "ms")), run(p50=(8.0, "ms"))]
    work = [run(p50=(9.0, "ms")), run(p50=(6.0, "ms")), run(p50=(7.5, "ms"))]
    rows = summarise(rev, work)
    assert [(r.name, r.rev_median, r.work_median) for r in rows] == [("p50", 7.0, 7.5)]
    assert rows[0].ratio == 7.5 / 7.0
    assert rows[0].rev == [6.0, 7.0, 8.0] and rows[0].work == [9.0, 6.0, 7.5]


def test_same_run_ratios_and_unitless_figures_are_left_out():
    one = run(p50=(5.0, "ms"), p50_vs_pgqueuer=(2.0, "ms"), count=(3.0, ""))
    rows = summarise([one], [one])
    assert [r.name for r in rows] == ["p50"]


def test_a_zero_baseline_has_no_ratio_and_renders():
    rows = summarise([run(errors=(0.0, "jobs"))], [run(errors=(2.0, "jobs"))])
    assert rows[0].ratio is None
    text = render(rows, "067ef89")
    assert "—" in text and "0.0 | 2.0 jobs" in text


def test_a_figure_renamed_since_meets_its_older_name():
    old = {"figures": [{"section": "dispatch", "name": "submit → running p50 at 500/s", "unit": "ms", "value": 6.0}]}
    new = {"figures": [{"section": "dispatch", "name": "submit → running p50 at 500/s, QUEUE job", "unit": "ms",
                        "value": 7.0}]}
    rows = summarise([old], [new])
    assert [(r.name, r.rev, r.work) for r in rows] == [("submit → running p50 at 500/s", [6.0], [7.0])]


def test_a_series_shows_each_commit_against_the_base_and_marks_what_one_lacks():
    base = [run(p50=(6.0, "ms"), alone=(4.0, "ms"))]
    sides = {"16dc9b6": summarise(base, [run(p50=(6.6, "ms"), alone=(4.0, "ms"))]),
             "7ac7652": summarise(base, [run(p50=(9.0, "ms"))])}
    lines = render_series("067ef89", sides).splitlines()
    assert "16dc9b6" in lines[0] and "7ac7652" in lines[0]
    p50 = next(line for line in lines if " p50 " in line)
    assert "6.60   1.10×" in p50 and "9.00   1.50×" in p50
    alone = next(line for line in lines if " alone " in line)
    assert "1.00×" in alone and "—" in alone  # the second commit has no such figure
