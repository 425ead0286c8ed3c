"""Output names are chosen by the job (its files in IRISFED_OUTPUT_DIR): ``irisfed job``,
``irisfed outputs`` and the dashboard's job page show them literally, never as terminal
control, markup or HTML; the page's download serves a stored file's bytes to a logged-in
operator only, always as an attachment (real Postgres, NATS with JetStream; the
dashboard in process)."""

from __future__ import annotations

import html
import re
from urllib.parse import quote

import pytest

from irisfed.cli import views
from irisfed.services.common.objects import ObjectStore, ensure_buckets
from irisfed.services.common.store import Store
from irisfed.transfer import output_views
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.terminal import ESC, job_table
from tests.infra.web import client_for, log_in, page_text, running_web

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
    shown = job_table(job, history, [], outputs)
    assert "]0;pwned" not in shown.replace("\\x1b]0;pwned", "") and "\u202e" not in shown
    assert "1.0 MiB" in shown and "4.0 MiB" in shown
    for mode in ("plain", "tsv"):
        views.Out(mode).grid(views.outputs_grid(outputs))
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u202e" not in out and "<script>alert(1)</script>" in out
        assert len([line for line in out.splitlines() if "MiB" in line]) == len(NAMES)


async def test_the_dashboard_lists_outputs_with_sizes_as_text(pool, nats_client, subject_prefix):
    text = await page_text(pool, nats_client, subject_prefix, f"/jobs/{await job_with_outputs(Store(pool))}")
    assert text.count('data-testid="output"') == len(NAMES)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script>alert(1)</script>" not in text
    assert "\x1b" not in text and "\u202e" not in text
    assert "2.0 MiB" in text and "no: left out" in text


async def test_the_dashboard_downloads_a_stored_output_for_an_operator_only(pool, nats_client, subject_prefix):
    store = Store(pool)
    job_id = await job_with_outputs(store)
    await ensure_buckets(nats_client, subject_prefix, peers=["gpu-west"])
    objects = ObjectStore(nats_client, subject_prefix, peer="gpu-west")  # where its run's outputs are
    stored = {name: f"bytes of {name}".encode() for i, name in enumerate(NAMES) if i % 2 == 0}
    for name, data in stored.items():
        await objects.put_output(job_id, 1, 0, name, data)
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        viewer = await client.get(f"/jobs/{job_id}")
        assert 'data-testid="output-download"' not in viewer.text  # names and sizes only
        link = f"/jobs/{job_id}/outputs/1/0/{quote(NAMES[0])}"  # a name full of terminal control
        assert (await client.get(link)).status_code == 403
        await log_in(client)
        page = await client.get(f"/jobs/{job_id}")
        hrefs = re.findall(r'<a href="([^"]+)" download data-testid="output-download"', page.text)
        assert len(hrefs) == len(stored)  # the stored ones; a file left out has no link
        for href in hrefs:
            answer = await client.get(html.unescape(href))
            assert answer.status_code == 200, answer.text[:300]
            assert answer.content in stored.values()
            assert answer.headers["content-type"] == "application/octet-stream"
            assert answer.headers["content-disposition"].startswith("attachment; ")
            assert answer.headers["x-content-type-options"] == "nosniff"
        control = await client.get(link)
        assert control.content == f"bytes of {NAMES[0]}".encode()
        disposition = control.headers["content-disposition"]
        assert disposition.isascii() and disposition.isprintable() and "\x1b" not in disposition
        # Listed but left out, never listed, another epoch or task: no such output.
        left_out = f"/jobs/{job_id}/outputs/1/0/{quote(NAMES[1])}"
        for missing in (left_out, f"/jobs/{job_id}/outputs/1/0/other.bin", f"/jobs/{job_id}/outputs/2/0/{quote(NAMES[2])}",
                        f"/jobs/{job_id}/outputs/1/1/{quote(NAMES[2])}", "/jobs/no-such-job/outputs/1/0/x"):
            assert (await client.get(missing)).status_code == 404, missing
