"""The dashboard against odd data and greedy or hostile clients, on the real Postgres
and NATS of the test session: an explanation that is not an object, the login's
redirect target, the per-client cap on live streams (and the retry a refused client is
told, in whole seconds and milliseconds), and job events beyond what one batch names
(the subscription NATS stops and the dashboard renews)."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack

import httpx
import pytest

from irisfed.services.common.store import Store
from irisfed.services.web.live import MAX_IDS
from irisfed.services.web.service import EVENTS_PER_FLUSH
from tests.infra.factories import insert_jobs, make_job
from tests.infra.web import TOKEN, client_for, csrf_of, open_stream, running_web

WAIT_S = 30  # the longest any step may take before the test fails (never a timing assertion)


async def set_raw_explanation(pool, job_id: str, raw_json: str) -> None:
    """Store ``raw_json`` as the job's explanation, by hand, wherever this schema keeps it
    (a column of ``jobs``, or ``job_explanations`` keyed from the job)."""
    value = json.loads(raw_json)  # the pool's codec encodes jsonb parameters itself
    columns = {r["column_name"] for r in await pool.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
        "AND table_name = 'jobs'")}
    if "explanation" in columns:
        await pool.execute("UPDATE jobs SET explanation = $2::jsonb WHERE job_id = $1", job_id, value)
        return
    key = f"by-hand-{job_id}"
    await pool.execute("INSERT INTO job_explanations (key, explanation) VALUES ($1, $2::jsonb)", key, value)
    await pool.execute("UPDATE jobs SET explanation_key = $2 WHERE job_id = $1", job_id, key)


@pytest.mark.parametrize("raw, shown", [
    ('["placed", "by hand"]', '[&#34;placed&#34;, &#34;by hand&#34;]'),
    ('"<script>alert(1)</script> nats://u:pw@h:4222"',
     "&#34;&lt;script&gt;alert(1)&lt;/script&gt; nats://u:***@h:4222&#34;"),
    ("42", "42"),
])
async def test_an_explanation_that_is_not_an_object_is_shown_as_text(pool, nats_client, subject_prefix, raw, shown):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    await set_raw_explanation(pool, job.job_id, raw)
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        page = await client.get(f"/jobs/{job.job_id}")
        assert page.status_code == 200, page.text[:500]
        assert f'<pre class="odd" data-testid="explain-raw">{shown}</pre>' in page.text
        assert "<script>alert" not in page.text and "pw@h" not in page.text
        assert f'data-job-id="{job.job_id}"' in (await client.get("/jobs")).text  # the list never read it


async def test_an_object_explanation_has_no_raw_text(pool, nats_client, subject_prefix):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    await store.job_explain_batch([(job.job_id, {"by": "tick", "rule": "waiting for room", "peers": []}, "waiting")])
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        page = await client.get(f"/jobs/{job.job_id}")
        assert page.status_code == 200 and "waiting for room" in page.text and "explain-raw" not in page.text


@pytest.mark.parametrize("target, lands", [
    ("/fed/jobs?state=queued", "/fed/jobs?state=queued"),
    ("/fed/jobs/j1", "/fed/jobs/j1"),
    ("/jobs", "/fed/"),  # not under the prefix
    ("/fedx/jobs", "/fed/"),
    ("//evil.example/x", "/fed/"),
    ("/\\evil.example", "/fed/"),
    ("/fed/\\evil.example", "/fed/"),
    ("https://evil.example/fed/", "/fed/"),
    ("javascript:alert(1)", "/fed/"),
    ("/fed/\r\nSet-Cookie: x=y", "/fed/"),
    ("/fed/\t/evil.example", "/fed/"),
    ("", "/fed/"),
])
async def test_after_login_the_redirect_stays_on_the_dashboard(pool, nats_client, subject_prefix, target, lands):
    async with running_web(pool, nats_client, subject_prefix, root_path="/fed") as web, client_for(web) as client:
        form = await client.get("/fed/login", params={"next": target})
        assert form.status_code == 200
        answer = await client.post("/fed/login", data={"csrf": csrf_of(form.text), "token": TOKEN, "next": target})
        assert answer.status_code == 303
        assert answer.headers["location"] == lands
        assert "irisfed_session=" in answer.headers["set-cookie"]  # logged in all the same


# ---------------------------------------------------------------- live streams


async def test_one_client_cannot_hold_every_live_stream(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, viewers_per_client=3,
                           max_viewers=10) as web, httpx.AsyncClient(timeout=WAIT_S) as http:
        url = web.url + "events"
        async with AsyncExitStack() as stack:
            mine = [await open_stream(stack, http, url, "10.1.1.1") for _ in range(3)]
            assert [s.status_code for s in mine] == [200, 200, 200]
            refused = await http.get(url, headers={"x-forwarded-for": "10.1.1.1"})
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) > 0 and "at most 3" in refused.text
            assert refused.headers["content-security-policy"]
            other = await open_stream(stack, http, url, "10.2.2.2")  # another browser still gets one
            assert other.status_code == 200 and web.broker.viewers == 4
            await mine[0].aclose()
            for _ in range(WAIT_S * 20):  # the server notices the closed stream
                if web.broker.viewers == 3:
                    break
                await asyncio.sleep(0.05)
            again = await open_stream(stack, http, url, "10.1.1.1")
            assert again.status_code == 200


async def test_the_live_view_is_full_for_everyone_at_max_viewers(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, viewers_per_client=2,
                           max_viewers=2) as web, httpx.AsyncClient(timeout=WAIT_S) as http:
        url = web.url + "events"
        async with AsyncExitStack() as stack:
            for address in ("10.0.0.1", "10.0.0.2"):
                assert (await open_stream(stack, http, url, address)).status_code == 200
            full = await http.get(url, headers={"x-forwarded-for": "10.0.0.3"})
            assert full.status_code == 503 and "retry-after" in full.headers


async def test_the_refused_retry_reaches_page_and_header_as_plain_whole_numbers(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, viewers_per_client=1,
                           refused_retry_s=2.5) as web, httpx.AsyncClient(timeout=30) as http:
        page = await http.get(web.url)
        assert re.findall(r'data-refused-retry-ms="([^"]*)"', page.text) == ["2500"]
        url = web.url + "events"
        async with AsyncExitStack() as stack:
            assert (await open_stream(stack, http, url, "10.9.9.9")).status_code == 200
            refused = await http.get(url, headers={"x-forwarded-for": "10.9.9.9"})
            assert refused.status_code == 429
            assert refused.headers.get_list("retry-after") == ["3"]  # 2.5 s rounded up


async def next_jobs_event(lines) -> dict:
    """The data of the next ``jobs`` event of a stream."""
    previous = ""
    async for line in lines:
        if previous == "event: jobs":
            return json.loads(line.removeprefix("data: "))
        previous = line
    raise AssertionError("the stream ended")


async def test_a_flood_of_job_events_is_many_jobs_and_the_next_event_is_heard(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, flush_s=0.05) as web, \
            httpx.AsyncClient(timeout=WAIT_S) as http, http.stream("GET", web.url + "events") as stream:
        assert stream.status_code == 200 and EVENTS_PER_FLUSH > MAX_IDS
        lines = stream.aiter_lines()
        for n in range(EVENTS_PER_FLUSH * 3):  # more than the subscription takes before NATS stops it
            await nats_client.publish(f"{subject_prefix}.events.flood-{n}", b"{}")
        await nats_client.flush()
        seen = await asyncio.wait_for(next_jobs_event(lines), WAIT_S)
        while not seen["all"]:  # the first flush may name a few before the flood is in
            seen = await asyncio.wait_for(next_jobs_event(lines), WAIT_S)
        # The subscription was spent: renewed before that flush, it hears the next event.
        for _ in range(WAIT_S * 20):
            if not web._events_spent:
                break
            await asyncio.sleep(0.05)
        await nats_client.publish(f"{subject_prefix}.events.after-the-flood", b"{}")
        named: set[str] = set()
        while "after-the-flood" not in named:
            event = await asyncio.wait_for(next_jobs_event(lines), WAIT_S)
            named.update(event["ids"])
