"""Output names are chosen by the job (its files in IRISFED_OUTPUT_DIR): ``irisfed job``,
``irisfed outputs`` and the dashboard's job page show them literally, never as terminal
control, markup or HTML (real Postgres; the dashboard in process)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from irisfed.cli import views
from irisfed.services.common.store import Store
from irisfed.transfer import output_views
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.web import client_for, running_web

ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"
NAMES = [f"{ESC}model.pt", "<script>alert(1)</script>", "[bold]x[/] :smile:", "\u202eevil\u202c.txt"]


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")


async def job_with_outputs(store: Store) -> str:
    job = make_job()
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    rows = [(job.job_id, 1, 0, name, 2**20 * (i + 1), i % 2 == 0, "" if i % 2 == 0 else f"left out {ESC}")
            for i, name in enumerate(NAMES)]
    assert await store.job_outputs_record("gpu-west", rows) == len(NAMES)
    return job.job_id


async def test_irisfed_job_and_outputs_show_hostile_names_inert(pool, capsys):
    store = Store(pool)
    job_id = await job_with_outputs(store)
    job, history = await store.job_get(job_id), await store.changelog_list_for_job(job_id)
    outputs = output_views(await store.job_outputs_list(job_id))
    console = Console(file=io.StringIO(), width=500, force_terminal=True, color_system="truecolor")
    views.print_job(job, history, views.Out("table", True, console), [], outputs)
    shown = console.file.getvalue()
    assert "]0;pwned" not in shown.replace("\\x1b]0;pwned", "") and "\u202e" not in shown
    assert "1.0 MiB" in shown and "4.0 MiB" in shown
    for mode in ("plain", "tsv"):
        views.Out(mode).grid(views.outputs_grid(outputs))
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u202e" not in out and "<script>alert(1)</script>" in out
        assert len([line for line in out.splitlines() if "MiB" in line]) == len(NAMES)


async def test_the_dashboard_lists_outputs_with_sizes_as_text(pool, nats_client, subject_prefix):
    store = Store(pool)
    job_id = await job_with_outputs(store)
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        page = await client.get(f"/jobs/{job_id}")
        assert page.status_code == 200, page.text[:500]
        text = page.text
        assert text.count('data-testid="output"') == len(NAMES)
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script>alert(1)</script>" not in text
        assert "\x1b" not in text and "\u202e" not in text
        assert "2.0 MiB" in text and "no: left out" in text
