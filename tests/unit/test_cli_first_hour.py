"""What a person reads first (docs/design.md §3.7, "the first hour"): key columns kept
at any terminal width, resources and run time in `jobs` and `job`, memory in MiB/GiB."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console

from irisfed.cli import views
from irisfed.shared.lifecycle import JobState
from tests.infra.rows import job_row, job_summary

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def rows():
    long = "matching peers are full; waiting for 4 free nodes with cpu 1 sharing one slice " * 3
    return [job_summary(job_id="train-long-name-1", user_id="nlp", state=JobState.QUEUED, reason=long,
                        command=["python3", "train.py", "--epochs", "100", "--lr", "0.001"] * 3,
                        resources={"cpu": 4, "gpu": 2, "memory_mb": 65536}),
            job_summary(job_id="done-2", state=JobState.SUCCEEDED, owner_peer_id="gpu-west", exit_code=0,
                        resources={"cpu": 1}, replicas=4, started_at=NOW - timedelta(minutes=3, seconds=4),
                        finished_at=NOW)]


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_key_columns_stay_whole_at_any_width(width):
    console = Console(file=io.StringIO(), width=width, record=True, force_terminal=True)
    console.print(views.jobs_table(rows(), width=width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "┃┃" not in text and "││" not in text
    for word in ("train-long-name-1", "queued", "succeeded", "interactive", "gpu-west"):
        assert word in text, (word, text)


def test_jobs_show_what_each_asked_and_how_long_it_ran():
    grid = views.jobs_grid(rows())
    cells = {row[0].plain: {c: cell.plain for c, cell in zip(grid.columns, row, strict=True)} for row in grid.rows}
    assert cells["train-long-name-1"]["resources"] == "cpu 4, gpu 2, memory 64.0 GiB"
    assert cells["train-long-name-1"]["ran"] == "-"  # not started
    assert cells["done-2"]["resources"] == "4 × cpu 1" and cells["done-2"]["ran"] == "3m04s"
    assert [views.duration_text(s) for s in (5, 184, 7260, 3 * 86400 + 3600)] == ["5s", "3m04s", "2h01m", "3d01h"]


def test_a_jobs_page_says_what_it_asked(capsys):
    job = job_row(spec={"command": ["true"], "resources": {"cpu": 2, "memory_mb": 1536}}, state=JobState.RUNNING,
                  started_at=datetime.now(UTC) - timedelta(seconds=30))
    views.print_job(job, [], views.Out("plain"))
    line = next(line for line in capsys.readouterr().out.splitlines() if "resources" in line)
    assert "cpu 2, memory 1.5 GiB" in line and "ran 3" in line
