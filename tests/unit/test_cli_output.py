"""How reads print: boxes on a terminal, plain columns in a pipe, TSV and JSON for tools."""

from __future__ import annotations

import argparse

import pytest
from rich.console import Console

from irisfed.cli import views
from irisfed.cli.parser import build_parser

LONG_ID = "a-very-long-job-id-" + "x" * 60


def _grid() -> views.Grid:
    grid = views.Grid("jobs", ("job", "state", "command"))
    grid.add(views.lit(LONG_ID), views.lit("running"), views.lit("python3 train.py --epochs 100 " + "y" * 80))
    grid.add(views.lit("b"), views.lit("queued"), views.lit("tab\there\nnewline \x1b[31mred"))
    return grid


def test_plain_columns_align_and_never_cut_or_wrap(capsys):
    views.Out("plain").grid(_grid())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "STATE", "COMMAND"]
    assert lines[1].startswith(LONG_ID + "  ")  # whole id, on one line
    assert lines[1].index("running") == lines[2].index("queued") == lines[0].index("STATE")
    assert "…" not in "".join(lines) and "│" not in "".join(lines) and "\x1b" not in "".join(lines)
    assert len(lines) == 3  # the newline inside a cell is escaped, not a new row


def test_tsv_escapes_tabs_and_newlines_in_cells(capsys):
    views.Out("tsv").grid(_grid())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "job\tstate\tcommand"
    assert [len(line.split("\t")) for line in lines] == [3, 3, 3]
    # lit() shows ESC as the four characters \x1b; TSV then doubles that backslash.
    assert lines[2].split("\t")[2] == "tab\\there\\nnewline \\\\x1b[31mred"


def test_a_terminal_table_cuts_long_cells_with_an_ellipsis_unless_wide():
    def render(wide: bool) -> str:
        console = Console(width=100, record=True, force_terminal=True)
        out = views.Out("table", wide, console)
        out.grid(_grid())
        return console.export_text()

    cut, whole = render(False), render(True)
    assert "…" in cut and "y" * 80 not in cut.replace("\n", "")
    assert len(cut.splitlines()) < len(whole.splitlines())  # one line a row when cut
    assert "y" * 40 in "".join(line.strip("│ ") for line in whole.splitlines())


@pytest.mark.parametrize("argv, expected", [
    (["jobs"], "plain"),  # pytest's stdout is not a terminal
    (["jobs", "--json"], "json"),
    (["jobs", "-o", "tsv"], "tsv"),
    (["peers", "--output", "table"], "table"),
    (["job", "x", "--output", "json"], "json"),
    (["explain", "x"], "plain"),
])
def test_the_output_mode_follows_flags_then_whether_stdout_is_a_terminal(argv, expected):
    assert views.output_mode(build_parser().parse_args(argv)) == expected


def test_a_terminal_gets_tables(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert views.output_mode(argparse.Namespace(output=None, json=False)) == "table"


def test_job_lines_become_comments_in_tsv(capsys):
    out = views.Out("tsv")
    out.line("  owner       ", views.lit("gpu-west"))
    assert capsys.readouterr().out == "# owner       gpu-west\n"


# Producers choose names, labels, commands and reasons; peers choose explanation details.
HOSTILE_CELL = "a\tb\nFAKE\trow\r\x1b[31m\u202eevil\u2028x\x85y"


@pytest.mark.parametrize("mode", ["plain", "tsv"])
def test_hostile_job_and_explain_lines_stay_one_line_each(mode, capsys):
    # A name holding "\n" and "\t" must not print a line of its own that reads like a
    # TSV row (no "# "): `irisfed job X -o tsv | ...` could be fed fake rows.
    from tests.infra import rows

    spec = {"command": ["echo", HOSTILE_CELL], "name": HOSTILE_CELL, "labels": {HOSTILE_CELL: HOSTILE_CELL}}
    explanation = {"by": HOSTILE_CELL, "rule": HOSTILE_CELL, "more": {HOSTILE_CELL: 2},
                   "peers": [{"peer_id": HOSTILE_CELL, "code": HOSTILE_CELL, "detail": HOSTILE_CELL}]}
    job = rows.job_row(spec=spec, reason=HOSTILE_CELL, state="running", explanation=explanation)
    history = [rows.changelog_entry(detail=HOSTILE_CELL, actor=HOSTILE_CELL, peer_id=HOSTILE_CELL)]
    views.print_job(job, history, views.Out(mode))
    views.print_explain(job, history, views.Out(mode))
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\r\u202e\u2028\x85"), repr(out)
    lines = out.split("\n")
    assert lines.pop() == ""
    assert sum("FAKE" in line for line in lines) >= 8  # every hostile value shown, each on its own line ...
    assert not any(line.startswith("FAKE") for line in lines)  # ... never starting a line of its own
    if mode == "tsv":
        headers = {"seq\tat\tfrom\tto\tpeer\tepoch\tby\tdetail": 8, "peer\tverdict\tdetail": 3}
        width = None
        for line in lines:  # comments, a header, then rows as wide as their header
            if line.startswith("# "):
                assert "\t" not in line, line
                width = None
            elif line in headers:
                width = headers[line]
            else:
                assert width is not None and len(line.split("\t")) == width, line
