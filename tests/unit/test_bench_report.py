"""The README's performance table, generated from a bench results file (``irisfed bench
--report FILE [--readme README.md]``), and the LOCAL job's rows beside pgqueuer. Pure:
no servers, no processes, no sockets; files only in tmp_path."""

import errno
import json
import os
import re
from dataclasses import asdict

import pytest

from irisfed.bench.report import (
    TABLE_END,
    TABLE_START,
    Bench,
    Figure,
    Profile,
    ResultsError,
    headline,
    issue_targets,
    judge,
    load_results,
    markdown,
    pgqueuer_comparisons,
    with_table,
)
from irisfed.bench.sections import hop_medians
from irisfed.cli import main

PGQ = {"pgq_start_p50": 0.0025, "pgq_start_p99": 0.010, "pgq_enqueue_100": 2000.0,
       "pgq_enqueue_100_p50": 0.040, "pgq_enqueue_100_p99": 0.090}


def dispatch_figures() -> list[Figure]:
    """The dispatch section's rows as it adds them (bench/sections.py, dispatch_bench)."""
    return [
        Figure("baseline", "NATS request/reply, 1 in flight", 2000.0, "req/s", note="p50 0.44 ms, p99 0.62 ms"),
        Figure("pgqueuer", "pgqueuer enqueue → start p50 at 500/s", 2.5, "ms"),
        Figure("dispatch", "submit → running p50, one job at a time", 5.5, "ms", note="QUEUE jobs; ..."),
        Figure("dispatch", "submit → running p50 at 500/s, QUEUE job", 8.0, "ms", "one job at a time", 8.0 / 5.5,
               "≤ 10 ms", True, note="router → tick → agent; ..."),
        Figure("dispatch", "submit → running p99 at 500/s, QUEUE job", 16.0, "ms", target="≤ 50 ms", met=True),
        Figure("dispatch", "LOCAL job: submit → running p50 at 500/s", 4.0, "ms", "QUEUE path p50 (8.0 ms)", 0.5,
               note="router → the local cluster's agent, no tick; ..."),
        Figure("dispatch", "LOCAL job: submit → running p99 at 500/s", 9.0, "ms"),
        Figure("submit", "durable submits/s, 100 in flight", 15941.7, "req/s", "NATS r/r 100", 0.23,
               "≥ 0.4× NATS, p99 ≤ 10 ms", False, "3 runs, 15,669–16,120",
               "p50 6.16 ms, p99 9.75 ms, p999 48.65 ms, errors 0"),
        Figure("submit", "jobs committed (all acked submits)", 490000, "rows"),
    ]


def judged_doc(figures: list[Figure] | None = None, quick: bool = True) -> dict:
    """A results file's contents, as bench/run.py writes them after judge()."""
    bench = Bench(Profile(quick), None)
    bench.figures = dispatch_figures() if figures is None else figures
    bench.baselines = dict(PGQ)
    judge(bench)
    return {"machine": "vm x86_64, 2 cores, Python 3.11.7", "when": "2026-12-02T16:00:00.123+00:00",
            "quick": quick, "figures": [asdict(f) for f in bench.figures],
            "targets": [asdict(t) for t in bench.targets]}


def rows(table: str) -> dict[str, list[str]]:
    """The table's rows by figure name: the cells after the name."""
    found = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| section "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            found[cells[1]] = cells[2:]
    return found


def test_local_rows_are_compared_with_pgqueuer_beside_them_without_a_target():
    doc = judged_doc()
    names = [f["name"] for f in doc["figures"]]
    p50 = "LOCAL job: submit → running p50 vs pgqueuer enqueue → start p50"
    p99 = "LOCAL job: submit → running p99 vs pgqueuer enqueue → start p99"
    assert names.index(p50) == names.index("LOCAL job: submit → running p50 at 500/s") + 1
    assert names.index(p99) == names.index("LOCAL job: submit → running p99 at 500/s") + 1
    by_name = {f["name"]: f for f in doc["figures"]}
    assert by_name[p50]["ratio"] == pytest.approx(1.6) and "2.5 ms" in by_name[p50]["baseline"]
    assert by_name[p99]["ratio"] == pytest.approx(0.9) and "10.0 ms" in by_name[p99]["baseline"]
    assert by_name[p50]["target"] == "" and by_name[p50]["met"] is None
    # The QUEUE job's rows keep their comparisons and issue 15's targets.
    queue = by_name["submit → running p50 vs pgqueuer enqueue → start p50"]
    assert queue["value"] == 8.0 and queue["ratio"] == pytest.approx(3.2) and queue["met"] is False
    targets = {t["what"]: t for t in doc["targets"]}
    assert targets["submit → running p50 at 500/s ≤ 10 ms"]["measured"] == "8.0 ms"


def test_a_pgqueuer_that_fell_behind_its_offered_rate_judges_nothing():
    """Its enqueues then wait for Postgres's commit lock: enqueue → start is a backlog."""
    behind = {**PGQ, "pgq_start_p50": 0.850, "pgq_start_p99": 1.6, "pgq_start_kept_up": 0.70}
    pairs = {cmp.name: cmp for _, cmp in pgqueuer_comparisons(dispatch_figures(), behind)}
    queue = pairs["submit → running p50 vs pgqueuer enqueue → start p50"]
    assert queue.ratio < 2 and queue.met is None and "70% of the offered rate" in queue.note
    assert "backlog" in pairs["LOCAL job: submit → running p50 vs pgqueuer enqueue → start p50"].note
    assert pairs["submit → running p99 vs pgqueuer enqueue → start p99"].met is True  # ≤ 50 ms is irisfed's own
    targets = {t.what: t for t in issue_targets(dispatch_figures(), behind)}
    vs_pgq = targets["submit → running p50 ≤ 2× pgqueuer enqueue → start p50"]
    assert vs_pgq.met is None and "backlog" in vs_pgq.measured
    kept_up = {t.what: t for t in issue_targets(dispatch_figures(), {**behind, "pgq_start_kept_up": 0.98})}
    assert kept_up["submit → running p50 ≤ 2× pgqueuer enqueue → start p50"].met is True
    bench = Bench(Profile(True), None)
    bench.figures, bench.baselines = dispatch_figures(), behind
    judge(bench)
    doc = {"machine": "m", "when": "2026-12-02T16:00:00", "quick": True, "figures": [asdict(f) for f in bench.figures]}
    assert rows(headline(doc, "r.json"))["submit → running p50 vs pgqueuer enqueue → start p50"][3] == "not judged"


@pytest.mark.parametrize(("done", "warned"), [("349", True), ("489", False), ("1,000", False)])
def test_the_headline_warns_when_pgqueuer_fell_behind_its_offered_rate(done, warned):
    """Read from pgqueuer's own row, so files written before the check are flagged too."""
    figures = dispatch_figures()
    figures[1].note = f"1500/1500 started, 0 enqueue errors, enqueues done at {done}/s; enqueue ack p50 662.06 ms"
    table = headline(judged_doc(figures), "r.json")
    warning = f"**Read with care:** pgqueuer's enqueues finished at {done}/s of the offered 500/s"
    lines = table.splitlines()
    assert lines[1] == "" and (warning in lines[2]) is warned
    assert lines[2 + 2 * warned].startswith("| section ")


def test_local_rows_are_not_compared_when_pgqueuer_did_not_run():
    names = [row.name for row, _ in pgqueuer_comparisons(dispatch_figures(), {})]
    assert names == []


def test_headline_shows_judged_and_compared_figures_and_where_they_came_from():
    table = headline(judged_doc(), "bench/results/quick-2026-12-02.json")
    first = table.splitlines()[0]
    assert "`bench/results/quick-2026-12-02.json`" in first and "2026-12-02T16:00Z" in first
    assert "quick sizes" in first and "sections pgqueuer, dispatch, submit" in first
    assert "irisfed bench --report bench/results/quick-2026-12-02.json --readme README.md" in first
    found = rows(table)
    assert found["submit → running p50 at 500/s, QUEUE job"] == [
        "8.0 ms", "1.45× one job at a time", "≤ 10 ms", "yes"]
    assert found["LOCAL job: submit → running p50 at 500/s"][:2] == ["4.0 ms", "0.50× QUEUE path p50 (8.0 ms)"]
    assert found["LOCAL job: submit → running p50 vs pgqueuer enqueue → start p50"][:2] == [
        "4.0 ms", "1.60× pgqueuer enqueue → start p50 (2.5 ms)"]
    assert found["LOCAL job: submit → running p99 at 500/s"] == ["9.0 ms", "", "", ""]
    assert found["submit → running p50, one job at a time"] == ["5.5 ms", "", "", ""]  # the QUEUE p50's floor
    assert found["submit → running p50 vs pgqueuer enqueue → start p50"][3] == "**no**"
    # A target that names a p99 shows the measured one beside the value.
    assert found["durable submits/s, 100 in flight"] == [
        "15,942 req/s (p99 9.75 ms)", "0.23× NATS r/r 100", "≥ 0.4× NATS, p99 ≤ 10 ms", "**no**"]
    # Raw baselines, pgqueuer's own rows (its figures are in the comparisons) and counts stay in --all.
    for left_out in ("NATS request/reply, 1 in flight", "pgqueuer enqueue → start p50 at 500/s",
                     "jobs committed (all acked submits)"):
        assert left_out not in found


def test_headline_of_a_full_run_says_so_and_keeps_cells_whole():
    doc = judged_doc([Figure("web", "odd | name", 0.5, "% core", target="< 10%\nof a core", met=True)], quick=False)
    table = headline(doc, "r.json")
    assert "full sizes" in table.splitlines()[0] and "load average" not in table.splitlines()[0]
    doc["load_average"] = {"start": [0.42, 1.0, 1.0], "end": [3.05, 2.0, 1.0]}
    assert "load average 0.4 at start and 3.0 at the end" in headline(doc, "r.json").splitlines()[0]
    assert "| web | odd \\| name | 0.50 % core |  | &lt; 10% of a core | yes |" in table


def test_table_goes_between_the_markers_and_again_in_place():
    readme = f"# irisfed\n\n## Performance\n\nText.\n\n{TABLE_START}\nold | table\n{TABLE_END}\n\n## Tests\n"
    once = with_table(readme, "| new |\n")
    assert once == f"# irisfed\n\n## Performance\n\nText.\n\n{TABLE_START}\n| new |\n{TABLE_END}\n\n## Tests\n"
    assert with_table(once, "| new |\n") == once
    assert with_table(once, "| newer |").count("| newer |") == 1


@pytest.mark.parametrize("readme", [
    "no markers at all\n",
    f"{TABLE_START}\nonly a start\n",
    f"{TABLE_END}\n{TABLE_START}\n",
    f"{TABLE_START}\n{TABLE_END}\n{TABLE_START}\n{TABLE_END}\n",
])
def test_a_readme_without_one_pair_of_markers_in_order_is_refused(readme):
    with pytest.raises(ResultsError, match="README.md"):
        with_table(readme, "| t |")


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "not JSON"),
    ("[]", "not a bench results file"),
    ('{"machine": "m", "when": "w", "quick": true}', "not a bench results file"),
    ('{"machine": "m", "when": "w", "quick": true, "figures": [{"name": "x"}]}', "figure 1 lacks"),
])
def test_what_is_not_a_results_file_says_why(text, why):
    with pytest.raises(ResultsError, match=why):
        load_results(text, "f.json")


def test_the_kept_results_files_render(tmp_path):
    from pathlib import Path

    kept = sorted(Path(__file__).resolve().parents[2].joinpath("bench", "results").glob("*.json"))
    assert kept
    for path in kept:
        table = headline(load_results(path.read_text(), path.name), path.name)
        assert rows(table), path.name


def test_report_command_prints_and_writes_the_readme(tmp_path, capsys):
    doc, results = judged_doc(), tmp_path / "run.json"
    results.write_text(json.dumps(doc))
    capsys.readouterr()  # judge() says what it added
    assert main(["bench", "--report", str(results)]) == 0
    printed = capsys.readouterr().out
    assert printed == headline(doc, str(results))

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{TABLE_START}\n{TABLE_END}\noutro\n")
    assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 0
    assert "updated" in capsys.readouterr().out
    written = headline(doc, str(results), str(readme))  # says how to regenerate it there
    assert f"--readme {readme}`" in written
    assert readme.read_text() == f"intro\n{TABLE_START}\n{written.rstrip()}\n{TABLE_END}\noutro\n"
    assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 0
    assert "unchanged" in capsys.readouterr().out

    assert main(["bench", "--report", str(results), "--all"]) == 0
    everything = capsys.readouterr().out
    assert "| baseline | NATS request/reply, 1 in flight |" in everything and "issue 15 target" in everything


@pytest.mark.parametrize(("argv", "why"), [
    (["bench", "--report", "{missing}"], "cannot read"),
    (["bench", "--report", "{results}", "--quick"], "runs nothing"),
    (["bench", "--report", "{results}", "--sections", "dispatch"], "runs nothing"),
    (["bench", "--report", "{results}", "--readme", "{readme}", "--all"], "drop one"),
    (["bench", "--readme", "{readme}"], "go with --report"),
    (["bench", "--report", "{readme}"], "not JSON"),
    (["bench", "--report", "{results}", "--readme", "{readme}"], "exactly one"),
])
def test_report_command_refuses_what_it_cannot_do(tmp_path, capsys, argv, why):
    results, readme = tmp_path / "run.json", tmp_path / "README.md"
    results.write_text(json.dumps(judged_doc()))
    readme.write_text("no markers\n")
    paths = {"results": results, "readme": readme, "missing": tmp_path / "absent.json"}
    assert main([a.format(**paths) for a in argv]) == 2
    assert why in capsys.readouterr().err
    assert readme.read_text() == "no markers\n"


def _one_figure(**changes) -> dict:
    """judged_doc() with its first compared figure changed (as a hand-edited file might be)."""
    doc = judged_doc()
    figure = next(f for f in doc["figures"] if f["ratio"] is not None)
    figure.update(changes)
    doc["figures"] = [figure]
    return doc


@pytest.mark.parametrize(("doc", "where"), [
    (_one_figure(value="fast"), "figure 1's value: expected float, got str"),
    (_one_figure(value=None), "figure 1's value: expected float, got null"),
    (_one_figure(value=True), "figure 1's value: expected float, got bool"),
    (_one_figure(ratio="2x"), "figure 1's ratio: expected float or null, got str"),
    (_one_figure(name=5, ratio=None, met=None, target=""), "figure 1's name: expected str, got int"),
    (_one_figure(target=3), "figure 1's target: expected str, got int"),
    (_one_figure(note=None, target="p99 <= 10 ms"), "figure 1's note: expected str, got null"),
    (_one_figure(met="yes"), "figure 1's met: expected bool or null, got str"),
    (_one_figure(runs=3), "figure 1's runs: expected str, got int"),
    ({**judged_doc(), "load_average": {"start": 5, "end": [1.0]}}, "load_average.start: expected array, got int"),
    ({**judged_doc(), "load_average": {"start": [1.0], "end": ["x"]}}, "load_average.end[0]: expected float"),
    ({**judged_doc(), "load_average": "busy"}, "load_average: expected object or null, got str"),
    ({**judged_doc(), "targets": [{"what": 1, "measured": "", "met": None}]}, "target 1's what: expected str"),
    ({**judged_doc(), "targets": {}}, "targets: expected array, got object"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(doc, where):
    """Every field is checked before anything renders: a wrong type was a traceback."""
    with pytest.raises(ResultsError) as refused:
        load_results(json.dumps(doc), "f.json")
    assert str(refused.value).startswith(f"f.json: {where}")
    assert "\n" not in str(refused.value)


def test_report_command_refuses_a_wrong_type_in_one_line_and_writes_nothing(tmp_path, capsys):
    results, readme = tmp_path / "run.json", tmp_path / "README.md"
    results.write_text(json.dumps(_one_figure(value="fast")))
    readme.write_text(f"intro\n{TABLE_START}\nold\n{TABLE_END}\n")
    capsys.readouterr()
    assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"irisfed: {results}: figure 1's value: expected float, got str\n"
    assert captured.out == ""
    assert readme.read_text() == f"intro\n{TABLE_START}\nold\n{TABLE_END}\n"


def test_a_file_whose_figures_lack_runs_renders_in_full():
    """Older files have no ``runs``: it is Figure's default, in --all as in the headline."""
    doc = judged_doc()
    for figure in doc["figures"]:
        del figure["runs"]
    everything = markdown(load_results(json.dumps(doc), "f.json"))
    assert "| baseline | NATS request/reply, 1 in flight | 2,000.0 req/s |  |  |  | 1 run | p50 0.44 ms" in everything


HOSTILE = f"a | b\n| injected | row |\n<script>alert(1)</script> {TABLE_END} {TABLE_START} & <b>bold</b>"


def hostile_doc() -> dict:
    """Every string a results file holds, each trying to leave its cell."""
    doc = judged_doc()
    doc["machine"] = f"vm {TABLE_START}\n\n# machine heading"
    doc["when"] = "\n\n# HACKED\n\n<!-"
    for f in doc["figures"]:
        for key in ("section", "name", "unit", "baseline", "note", "runs"):
            f[key] = f"{f[key]} {HOSTILE}"
        f["target"] = f"{f['target']} {HOSTILE}" if f["target"] else ""
    for t in doc["targets"]:
        t["what"], t["measured"] = f"{t['what']} {HOSTILE}", f"{t['measured']} {HOSTILE}"
    return doc


def assert_contained(text: str, columns: dict[str, int]) -> None:
    """No HTML, no marker, no heading; each table row has its own number of cells."""
    assert "<" not in text and ">" not in text
    assert TABLE_START not in text and TABLE_END not in text
    for line in text.splitlines():
        assert not line.startswith("#"), line
        if line.startswith("|"):
            pipes = len(re.findall(r"(?<!\\)\|", line))
            assert pipes in columns.values(), line


def test_no_string_from_the_file_or_the_command_line_leaves_its_cell():
    source, into = f"r\n# src {TABLE_END}<i>`x`.json", f"README {TABLE_START}&.md"
    table = headline(hostile_doc(), source, into)
    assert_contained(table, {"headline": 7})
    first = table.splitlines()[0]
    assert first.startswith("From ``r # src &lt;!-- bench-table:end --&gt;&lt;i&gt;`x`.json``: vm &lt;!-- ")
    assert "run # HACKED &lt;!-Z," in first
    assert "a \\| b \\| injected \\| row \\| &lt;script&gt;alert(1)&lt;/script&gt;" in table
    assert "&amp; &lt;b&gt;bold&lt;/b&gt;" in table
    assert_contained(markdown(hostile_doc()), {"figures": 9, "targets": 4})
    # So the table goes in, and in again: no marker of its own for with_table to count.
    readme = f"intro\n{TABLE_START}\n{TABLE_END}\noutro\n"
    assert with_table(with_table(readme, table), table) == with_table(readme, table)


def test_report_command_writes_a_hostile_file_into_the_readme_twice(tmp_path, capsys):
    results, readme = tmp_path / "run.json", tmp_path / "README.md"
    results.write_text(json.dumps(hostile_doc()))
    readme.write_text(f"# irisfed\n{TABLE_START}\n{TABLE_END}\n## Tests\n")
    capsys.readouterr()
    for _ in range(2):
        assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 0
    written = readme.read_text()
    assert written.count(TABLE_START) == written.count(TABLE_END) == 1
    assert [line for line in written.splitlines() if line.startswith("#")] == ["# irisfed", "## Tests"]
    assert "<script>" not in written and "<b>" not in written


def readme_with_table(tmp_path):
    results, readme = tmp_path / "run.json", tmp_path / "README.md"
    results.write_text(json.dumps(judged_doc()))
    readme.write_text(f"intro\n{TABLE_START}\nold\n{TABLE_END}\noutro\n")
    return results, readme


def _fails(exc: OSError):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize(("broken", "exc"), [
    ("replace", OSError(errno.EROFS, "Read-only file system")),  # the rename into place
    ("fsync", OSError(errno.ENOSPC, "No space left on device")),  # a full disk shows when flushed
    ("open", OSError(errno.EROFS, "Read-only file system")),  # a target that cannot be opened for writing
])
def test_a_failed_write_leaves_the_readme_as_it_was_in_one_line(tmp_path, capsys, monkeypatch, broken, exc):
    """Tests run as root, whom chmod does not stop: the failure is made at the call."""
    results, readme = readme_with_table(tmp_path)
    before, files = readme.read_text(), sorted(tmp_path.iterdir())
    capsys.readouterr()
    real_open = os.open

    def open_readme_read_only(path, flags, *rest):  # only the README's own opening for writing
        if os.fspath(path) == str(readme) and flags & os.O_WRONLY:
            raise exc
        return real_open(path, flags, *rest)

    if broken == "open":
        monkeypatch.setattr(os, "open", open_readme_read_only)
    else:
        monkeypatch.setattr(os, broken, _fails(exc))
    assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 2
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert captured.err == f"irisfed: cannot write {readme}: {exc.strerror} (left as it was)\n"
    assert readme.read_text() == before
    assert sorted(tmp_path.iterdir()) == files  # no temporary file left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
@pytest.mark.parametrize("read_only", ["file", "folder"])
def test_a_read_only_readme_or_folder_is_refused(tmp_path, capsys, read_only):
    results, readme = readme_with_table(tmp_path)
    before = readme.read_text()
    (readme if read_only == "file" else tmp_path).chmod(0o444 if read_only == "file" else 0o555)
    try:
        assert main(["bench", "--report", str(results), "--readme", str(readme)]) == 2
    finally:
        tmp_path.chmod(0o755)
    assert "cannot write" in capsys.readouterr().err
    assert readme.read_text() == before


def test_the_readme_is_replaced_whole_keeping_its_mode_and_symlink(tmp_path, capsys, monkeypatch):
    """Written beside it and renamed over it: a reader never sees half a README."""
    results, real = readme_with_table(tmp_path)
    real.chmod(0o640)
    link = tmp_path / "link.md"
    link.symlink_to(real.name)
    renames, real_replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renames.append((src, dst)), real_replace(src, dst))[1])
    assert main(["bench", "--report", str(results), "--readme", str(link)]) == 0
    assert renames and len(renames) == 1
    src, dst = renames[0]
    assert os.path.dirname(src) == str(tmp_path) and dst == os.path.realpath(real)
    assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o640
    assert f"{TABLE_START}\n{headline(judged_doc(), str(results), str(link)).rstrip()}\n{TABLE_END}" in real.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "link.md", "run.json"]


def test_hop_medians_skip_a_stage_no_job_passed():
    sent = {"l-0": 0.0, "l-1": 1.0}
    seen = {"queued": {}, "assigned": {"l-0": 0.002, "l-1": 1.004}, "running": {"l-0": 0.005, "l-1": 1.006}}
    assert hop_medians(sent, seen) == ["→assigned 4.0", "→running 3.0"]
    seen["queued"] = {"l-0": 0.001, "l-1": 1.001}
    assert hop_medians(sent, seen) == ["→queued 1.0", "→assigned 3.0", "→running 3.0"]
