"""Strings a peer writes about its gang's tasks (node names, log paths: ``job_tasks``
through ``irisfed_job_tasks_report``) shown by ``irisfed job`` (every output mode) and
the dashboard's job page: literally, never as terminal control, markup or HTML
(real Postgres; the dashboard in process)."""

from __future__ import annotations

import json

import pytest

from irisfed.cli import views
from irisfed.cli.connect import print_json
from irisfed.jobs import task_views
from irisfed.services.common.store import Store
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.terminal import ESC, job_table
from tests.infra.web import page_text

NODES = [f"{ESC}node", "<script>alert(1)</script>", "[bold]x[/] [link=http://evil]y[/link] :smile:",
         "\u202eevil\u202c", "line\nbreak\ttab"]
LOG = f"/tmp/{ESC}<img src=x onerror=alert(1)>"


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")


async def hostile_gang(store: Store) -> str:
    job = make_job(replicas=len(NODES))
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    rows = [(job.job_id, 1, i, node, "running", None, LOG) for i, node in enumerate(NODES)]
    assert await store.job_tasks_report("gpu-west", rows) == len(NODES)
    return job.job_id


def assert_inert(text: str) -> None:
    assert "\x1b" not in text, repr(text)
    assert "\u202e" not in text, repr(text)
    assert "<script>alert(1)</script>" in text  # shown literally (a terminal is no browser)
    assert "[bold]x[/]" in text and "[link=http://evil]y[/link]" in text and ":smile:" in text
    assert "😄" not in text


async def test_irisfed_job_shows_hostile_task_strings_inert_in_every_mode(pool, capsys):
    store = Store(pool)
    job_id = await hostile_gang(store)
    job, history = await store.job_get(job_id), await store.changelog_list_for_job(job_id)
    tasks = task_views(await store.job_tasks_list(job_id))

    shown = job_table(job, history, tasks)
    # rich styles its own output with escapes; none may come from the data.
    assert ESC not in shown and "]0;pwned" not in shown.replace("\\x1b]0;pwned", ""), repr(shown)
    assert "\u202e" not in shown

    for mode in ("plain", "tsv"):
        views.print_job(job, history, views.Out(mode), tasks)
        out = capsys.readouterr().out
        assert_inert(out)
        rows = [line for line in out.splitlines() if "/tmp/" in line]  # one line per task, each with its log
        assert len(rows) == len(NODES), f"{mode}: a task's node broke its row:\n{out}"

    print_json({"tasks": tasks})
    decoded = json.loads(capsys.readouterr().out)
    assert [t["node"] for t in decoded["tasks"]] == NODES  # JSON keeps them exact (escaped)


async def test_the_dashboard_shows_hostile_task_strings_as_text(pool, nats_client, subject_prefix):
    text = await page_text(pool, nats_client, subject_prefix, f"/jobs/{await hostile_gang(Store(pool))}")
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<img src=x" not in text
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert text.count('data-testid="task"') == len(NODES)
