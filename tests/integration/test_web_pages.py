"""The dashboard's pages against the real Postgres and NATS of the test session:
what they show, filters and pagination, escaping, headers, errors, the root path,
the read-only role."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser

import pytest

from irisfed.services.common.logstore import LogStore, ensure_log_streams
from irisfed.services.common.store import Store
from irisfed.services.web.security import CONTENT_SECURITY_POLICY
from irisfed.shared.logs import log_subject, split
from tests.infra.factories import (
    advertise,
    assign_jobs,
    insert_jobs,
    make_job,
    start_jobs,
)
from tests.infra.web import assert_shows, client_for, job_ids, ok_page, running_web

HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "';alert(1);//", "{{7*7}}"]


def next_link(html: str) -> str | None:
    found = re.search(r'<a href="([^"]+)" data-testid="next-page"', html)
    return found.group(1).replace("&amp;", "&") if found else None


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag == "script" and "src" not in names:
            self.problems.append("inline <script>")
        if tag == "style":
            self.problems.append("<style> element")
        for name in names:
            if name == "style" or name.startswith("on"):
                self.problems.append(f"<{tag} {name}=...>")
            if name.startswith("hx-on"):
                self.problems.append(f"<{tag} {name}=...> (htmx evaluates it)")


def assert_no_inline_code(html: str) -> None:
    """What the CSP would block anyway, and must not be there: inline scripts and styles,
    style attributes, event-handler attributes (real ones, as a browser parses the page)."""
    tags = _Tags()
    tags.feed(html)
    tags.close()
    assert not tags.problems, tags.problems


# ---------------------------------------------------------------- fixtures and tests



@pytest.fixture
async def web(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix) as service:
        yield service


@pytest.fixture
async def client(web):
    async with client_for(web) as http:
        yield http


async def expected_order(pool, where: str = "true") -> list[str]:
    rows = await pool.fetch(f"SELECT job_id FROM jobs WHERE {where} ORDER BY submitted_at DESC, job_id DESC")
    return [r["job_id"] for r in rows]


async def walk(client, url: str) -> tuple[list[str], list[int]]:
    """Every job id of every page from ``url`` on, following the "older" links."""
    seen, sizes = [], []
    while url:
        page = await client.get(url)
        assert page.status_code == 200, page.text
        ids = job_ids(page.text)
        seen += ids
        sizes.append(len(ids))
        url = next_link(page.text)
    return seen, sizes


async def test_every_response_carries_the_security_headers(client, pool):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    paths = ["/", "/jobs", f"/jobs/{job.job_id}", "/charts", "/api/charts", "/login", "/healthz",
             "/static/app.js", "/static/vendor/htmx.min.js", "/nowhere", "/jobs?state=nope", "/jobs/no-such-job"]
    for path in paths:
        response = await client.get(path)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert response.headers["referrer-policy"] == "no-referrer", path
        assert response.headers["x-frame-options"] == "DENY", path
    forged = await client.post(f"/jobs/{job.job_id}/cancel", data={"csrf": "x"})
    assert forged.status_code == 403
    assert forged.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert (await client.get("/jobs")).headers["cache-control"] == "no-store"


async def test_pages_show_what_the_federation_holds(client, pool):
    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, device_type="gpu")
    queued, placed = make_job(name="queued-one"), make_job(name="placed-one")
    await insert_jobs(store, [queued, placed])
    await assign_jobs(store, [placed], "gpu-west")
    await start_jobs(store, [placed], "gpu-west")

    front = await client.get("/")
    assert front.status_code == 200
    assert 'data-testid="peer-row" data-peer-id="gpu-west"' in front.text
    assert 'data-testid="peer-row" data-peer-id="tpu-east"' in front.text  # configured, never heard
    assert 'data-testid="count-queued"' in front.text
    assert "oldest queued: " + queued.job_id in front.text

    listed = await client.get("/jobs")
    assert set(job_ids(listed.text)) == {queued.job_id, placed.job_id}
    assert f'data-job-id="{placed.job_id}"' in listed.text

    one = await client.get(f"/jobs/{placed.job_id}")
    assert one.status_code == 200
    assert 'data-testid="job-state" data-state="running"' in one.text
    assert one.text.count('data-testid="timeline-entry"') == 3  # queued, assigned, running
    assert 'data-testid="cancel-button"' not in one.text  # a viewer, not an operator
    assert "Placed on gpu-west at epoch 1" in one.text

    charts = await client.get("/api/charts")
    data = json.loads(charts.text)
    assert len(data["t"]) == 60 and data["queued"][-1] == 1
    assert [s["values"][-1] for s in data["running"] if s["peer"] == "gpu-west"] == [1]
    assert data["queued"][0] == 0 and all(v == 0 for s in data["running"] for v in s["values"][:1])


async def test_the_front_page_shows_live_peers_and_their_resources(web, client, pool):
    store = Store(pool)
    backends = [{"name": "main", "attributes": {"device_type": ["gpu"]}, "capacity": {"total": 8, "free": 2},
                 "resources": {"cpu": {"total": 16, "free": 4}, "gpu": {"total": 4, "free": 1},
                               "memory_mb": {"total": 65536, "free": 16384}}}]
    await store.peer_heartbeat_upsert("gpu-west", "run-1", 1, backends, 60.0, datetime.now(UTC))
    await web.poll_once()
    page = await client.get("/")
    row = page.text.split('data-peer-id="gpu-west"', 1)[1].split("</tr>", 1)[0]
    assert 'data-reachable="yes"' in row
    assert 'data-resource="slots"' in row and "6 used, 2 free of 8" in row
    assert 'class="fill w75"' in row  # slots: 6 of 8
    assert "12 used, 4 free of 16" in row and "3 used, 1 free of 4" in row
    assert "48.0 GiB used, 16.0 GiB free of 64.0 GiB" in row and '<span class="meter-name">memory</span>' in row
    assert "device_type=gpu" in row


async def test_hostile_strings_are_shown_escaped_everywhere(web, client, pool):
    store = Store(pool)
    hostile = " ".join(HOSTILE)
    job = make_job(name=hostile, command=["echo", *HOSTILE], labels={"team": hostile, HOSTILE[1]: "x"},
                   env={"SECRET_TOKEN": "hunter2-value-never-shown", HOSTILE[0]: "v"},
                   constraints=[{"key": "zone", "op": "eq", "value": HOSTILE[1]}])
    await insert_jobs(store, [job])
    backends = [{"name": HOSTILE[0], "attributes": {HOSTILE[1]: [HOSTILE[0], "\x1b[31mred\u202e"]},
                 "capacity": {"total": 2, "free": 1}}]
    await store.peer_heartbeat_upsert("gpu-west", "run-1", 1, backends, 60.0, datetime.now(UTC))
    await web.poll_once()
    await assign_jobs(store, [job], "gpu-west")
    await store.job_explain_batch([(job.job_id, {"by": HOSTILE[0], "rule": HOSTILE[1], "peers": [
        {"peer_id": "gpu-west", "code": HOSTILE[0], "detail": HOSTILE[1]}]}, HOSTILE[0])])

    pages = {path: (await client.get(path)).text
             for path in ("/", "/jobs", f"/jobs/{job.job_id}", f"/jobs?text={HOSTILE[0][:30]}")}
    for path, html in pages.items():
        for raw in ("<script>alert", "<img src=x", "onerror=alert(1)>"):
            assert raw not in html, (path, raw)
        assert "hunter2-value-never-shown" not in html
        assert_no_inline_code(html)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[f"/jobs/{job.job_id}"]
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in pages[f"/jobs/{job.job_id}"]
    assert "{{7*7}}" in pages[f"/jobs/{job.job_id}"]  # data is never read as a template
    assert "SECRET_TOKEN" in pages[f"/jobs/{job.job_id}"]  # env names are shown, values never
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages["/"]  # the peer's backend name
    assert "\\x1b[31mred\\u202e" in pages["/"]  # control and bidi characters shown as escapes
    assert job.job_id in job_ids(pages[f"/jobs?text={HOSTILE[0][:30]}"])


async def test_the_jobs_page_shows_hostile_names_found_by_search_escaped(pool, nats_client, subject_prefix):
    store = Store(pool)
    job = make_job(job_id="h-script", name="<script>alert(1)</script> 100%_x",
                   labels={"t": "<b>x</b>", "\u202e": "\"'"})
    other = make_job(job_id="h-other", name="script alert 1000 x")
    await insert_jobs(store, [job, other])
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        for query in ("text=%3Cscript%3E", "text=100%25_", "text=%25_x", "label=t%3D%3Cb%3Ex%3C%2Fb%3E",
                      "label=%E2%80%AE%3D%22%27"):
            page = await client.get("/jobs?" + query)
            assert page.status_code == 200, query
            assert job_ids(page.text) == ["h-script"], query
            assert "<script>alert" not in page.text and "<b>x</b>" not in page.text
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert job_ids((await client.get("/jobs?text=%25")).text) == ["h-script"]
        assert sorted(job_ids((await client.get("/jobs?text=script")).text)) == ["h-other", "h-script"]


async def test_filters_and_pagination_return_the_right_rows_in_order(client, pool):
    store = Store(pool)
    jobs = []
    for batch in range(3):  # one submitted_at per transaction: ties are ordered by job id
        made = [make_job(name=f"{'alpha' if i % 2 else 'beta'}-{batch}-{i}",
                         labels={"team": "a" if i % 3 == 0 else "b", "batch": str(batch)})
                for i in range(45)]
        await insert_jobs(store, made)
        jobs += made
    odd = make_job(name="100%_done", labels={"team": "c"})
    await insert_jobs(store, [odd])
    await assign_jobs(store, jobs[:7], "gpu-west")

    everything, sizes = await walk(client, "/jobs")
    assert everything == await expected_order(pool)
    assert sizes == [50, 50, 36]

    team_a, _ = await walk(client, "/jobs?label=team%3Da")
    assert team_a == await expected_order(pool, "spec->'labels'->>'team' = 'a'") and len(team_a) == 45

    both, _ = await walk(client, "/jobs?label=team%3Da&label=batch%3D1")
    assert both == await expected_order(pool, "spec->'labels' @> '{\"team\": \"a\", \"batch\": \"1\"}'")

    placed, _ = await walk(client, "/jobs?state=assigned&peer=gpu-west")
    assert placed == await expected_order(pool, "state = 'assigned'") and len(placed) == 7

    queued, sizes = await walk(client, "/jobs?state=queued")
    assert queued == await expected_order(pool, "state = 'queued'") and sizes == [50, 50, 29]

    named, _ = await walk(client, "/jobs?text=alpha-1-")
    assert named == await expected_order(pool, "spec->>'name' LIKE 'alpha-1-%'") and named

    assert (await walk(client, "/jobs?text=%25_"))[0] == [odd.job_id]  # % and _ taken literally
    assert (await walk(client, "/jobs?text=_"))[0] == [odd.job_id]
    assert (await walk(client, "/jobs?text=beta-0-0"))[0] == [jobs[0].job_id]
    assert len((await walk(client, "/jobs?text=" + jobs[0].job_id))[0]) >= 1
    assert (await walk(client, "/jobs?state=failed"))[0] == []


@pytest.mark.parametrize("query", [
    "state=%3Cscript%3Ealert(1)%3C/script%3E",
    "peer=%22%3E%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E",
    "label=no-equals-sign",
    "label=%3Dvalue-without-key",
    "text=a%00b",
    "label=k%3Dv%00",
    "text=" + "x" * 10_000,
    "label=" + "k" * 300 + "%3Dv",
    "after=not-a-cursor!",
    "after=" + "A" * 5000,
    "after=PHNjcmlwdD4",  # base64 of "<script>"
    "after=MjAyNi0wMS0wMXxqb2I",  # "2026-01-01|job": no time zone
    "after=MjAyNi0wMS0wMVQwMDowMDowMCswMDowMHw8c2NyaXB0Pg",  # a job id that is no job id
    "after=OTk5OS0xMi0zMVQyMzo1OTo1OS0xNDowMHxqb2I",  # 9999-12-31T23:59:59-14:00: past the end of time in UTC (was a 500)
    "after=MDAwMS0wMS0wMVQwMDowMDowMCsxNDowMHxqb2I",  # 0001-01-01T00:00:00+14:00: before its start (was a 500)
    "state=queued&state=running",
    "&".join(f"label=k{i}%3Dv" for i in range(9)),
])
async def test_bad_filters_get_a_clear_400_never_a_500(client, query):
    response = await client.get("/jobs?" + query)
    assert response.status_code == 400, response.text[:500]
    assert 'data-testid="filter-error"' in response.text
    assert "<script>alert" not in response.text and "<img src=x" not in response.text
    assert_no_inline_code(response.text)
    fragment = await client.get("/jobs?" + query, headers={"HX-Request": "true"})
    assert fragment.status_code == 400 and "<html" not in fragment.text


async def test_a_job_page_tells_its_story(web, client, pool, nats_client, subject_prefix):
    """Its logs come from the log stream of its run's peer, never from a path on a disk."""
    store = Store(pool)
    job = make_job(name="story", env={"API_KEY": "s3cret-value"}, command=["sh", "-c", "psql postgresql://u:pw@db/x"])
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    await ensure_log_streams(nats_client, subject_prefix, ["gpu-west"])
    logs = LogStore(nats_client, subject_prefix, "gpu-west")
    out = "".join(f"line {i}\n" for i in range(20_000)).encode()
    for offset, piece in split(out, 0, 4096):  # shipped piece by piece, as an agent does
        await logs.publish(log_subject(subject_prefix, "gpu-west", job.job_id, 1, 0, "stdout"), offset, piece)
    await logs.publish(log_subject(subject_prefix, "gpu-west", job.job_id, 1, 0, "stderr"), 0,
                       b"<script>alert(1)</script> \x1b[31m\n")
    await store.job_start_batch("gpu-west", [(job.job_id, 1, "/on/the/peer/not/here", "started")])

    page = (await client.get(f"/jobs/{job.job_id}")).text
    assert "line 19999" in page and "line 0\n" not in page  # the tail only
    assert "last part of" in page and f"{len(out)} bytes" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; \\x1b[31m" in page
    assert "API_KEY" in page and "s3cret-value" not in page
    assert "u:pw@" not in page and "u:***@" in page  # a URL's password in a command is redacted
    steps = page.count('data-testid="timeline-entry"')
    assert steps == 3 and 'data-to-state="running"' in page
    assert 'hx-trigger="irisfed-job, irisfed-resync from:body, every 1s"' in page  # followed while it runs

    elsewhere = make_job()  # its peer's log stream cannot be read (here: never made)
    await insert_jobs(store, [elsewhere])
    await assign_jobs(store, [elsewhere], "tpu-east")
    await store.job_start_batch("tpu-east", [(elsewhere.job_id, 1, "/on/tpu-east", "started")])
    page = (await client.get(f"/jobs/{elsewhere.job_id}")).text
    assert 'data-testid="logs-unreadable"' in page and "its run on tpu-east cannot be read" in page

    assert (await client.get("/jobs/no-such-job")).status_code == 404
    assert (await client.get("/jobs/%3Cscript%3E")).status_code == 404
    fragment = await client.get(f"/jobs/{job.job_id}", headers={"HX-Request": "true"})
    assert fragment.status_code == 200 and "<html" not in fragment.text and 'data-testid="job-state"' in fragment.text


async def test_the_explanation_of_a_queued_job_is_shown(client, pool):
    store = Store(pool)
    job = make_job(constraints=[{"key": "device_type", "op": "eq", "value": "tpu"}])
    await insert_jobs(store, [job])
    explanation = {"by": "tick", "rule": "no reachable peer can take it now", "peers": [
        {"peer_id": "gpu-west", "code": "value_mismatch", "detail": "device_type is gpu, not tpu"},
        {"peer_id": "tpu-east", "code": "unreachable", "detail": "no heartbeat for 12s"}],
        "more": {"unreachable": 3}}
    await store.job_explain_batch([(job.job_id, {**explanation, "wait": "capacity"}, "waiting")])
    page = (await client.get(f"/jobs/{job.job_id}")).text
    assert page.count('data-testid="verdict"') == 2
    assert 'data-peer-id="gpu-west" data-code="value_mismatch"' in page
    assert "attribute value does not match" in page and "device_type is gpu, not tpu" in page
    assert "3 more unreachable" in page and 'data-testid="waiting"' in page

    # Placed and run since: why it waited is no longer why it is where it is.
    await assign_jobs(store, [job], "tpu-east")
    await store.job_start_batch("tpu-east", [(job.job_id, 1, None, "started")])
    page = (await client.get(f"/jobs/{job.job_id}")).text
    assert 'data-testid="waiting"' not in page and "no reachable peer can take it now" not in page
    assert 'data-testid="verdict"' not in page and "3 more unreachable" not in page
    assert 'data-testid="placed"' in page and "on tpu-east at epoch 1" in page


async def test_served_under_a_root_path_with_or_without_the_prefix(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, root_path="/irisfed") as web, client_for(web) as client:
        for path in ("/irisfed/jobs", "/jobs"):
            page = await ok_page(client, path)
            assert_shows(page, 'data-events="/irisfed/events"', 'href="/irisfed/static/app.css?v=',
                         'action="/irisfed/jobs"')
            assert 'href="/jobs' not in page and 'href="/"' not in page
        assert (await client.get("/irisfed/static/app.js")).status_code == 200
        login = await client.get("/irisfed/login")
        assert "irisfed_login_csrf" in login.headers["set-cookie"]
        assert "Path=/irisfed" in login.headers["set-cookie"]


async def test_without_nats_pages_say_they_poll_postgres(pool, subject_prefix):
    async with running_web(pool, None, subject_prefix) as web, client_for(web) as client:
        store = Store(pool)
        page = await client.get("/")
        banner = page.text.split('id="live-banner"', 1)[1].split(">", 1)[0]
        assert "hidden" not in banner and "polling Postgres" in page.text

        await web.poll_once()  # the first look notes where the changelog ends
        viewer = web.broker.join()
        job = make_job()
        await insert_jobs(store, [job])
        await web.poll_once()
        web.broker.flush()
        batch = viewer.queue.get_nowait()
        assert job.job_id in batch.jobs
        await web.poll_once()
        web.broker.flush()
        assert viewer.queue.empty()  # nothing new: nothing sent
        assert json.loads((await client.get("/healthz")).text) == {"status": "ok", "live": False, "database": "ok"}


async def test_charts_walk_back_from_the_counts(web, client, pool):
    store = Store(pool)
    jobs = [make_job() for _ in range(6)]
    await insert_jobs(store, jobs)
    await assign_jobs(store, jobs[:4], "gpu-west")
    await start_jobs(store, jobs[:4], "gpu-west")
    await store.job_finish_batch("gpu-west", [(j.job_id, 1, 0, False) for j in jobs[:2]])
    first = json.loads((await client.get("/api/charts")).text)
    assert first["queued"][-1] == 2 and first["queued"][0] == 0
    running = {s["peer"]: s["values"] for s in first["running"]}
    assert running["gpu-west"][-1] == 2 and running["gpu-west"][0] == 0
    assert sum(first["completions"][-2:]) > 0 and sum(first["submits"][-2:]) > 0

    web.charts.shared.expire()  # the next read refreshes: only the last minutes are read again
    await store.job_finish_batch("gpu-west", [(j.job_id, 1, 1, False) for j in jobs[2:4]])
    second = json.loads((await client.get("/api/charts")).text)
    running = {s["peer"]: s["values"] for s in second["running"]}
    assert running["gpu-west"][-1] == 0 and second["queued"][-1] == 2
    assert second["t"][-1] >= first["t"][-1]


async def test_a_database_outage_is_a_503_page(web, client, monkeypatch):
    from irisfed.shared.errors import Unavailable

    async def away(*args, **kwargs):
        raise Unavailable("database unavailable: connection refused")

    monkeypatch.setattr(Store, "job_list_page", away)
    response = await client.get("/jobs")
    assert response.status_code == 503 and "Database unavailable" in response.text
    assert "connection refused" not in response.text


async def test_every_page_works_as_the_read_only_web_role(database_url, pool, roles, nats_client, subject_prefix,
                                                          tmp_path):
    """In production the dashboard logs in as irisfed_svc_web (migration 0007: SELECT only)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    from irisfed.services.common import db as dbmod
    from irisfed.shared.errors import PermanentStoreError

    store = Store(pool)
    job = make_job(labels={"team": "a"}, name="read-only")
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    await start_jobs(store, [job], "gpu-west")
    await advertise(store, "gpu-west")
    parts = urlsplit(database_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    url = urlunsplit(parts._replace(netloc=f"irisfed_svc_web:{quote(roles['irisfed_svc_web'], safe='')}@{host}"))
    web_pool = await dbmod.connect(url)  # the schema check reads alembic_version too
    try:
        async with running_web(web_pool, nats_client, subject_prefix) as web, client_for(web) as client:
            await web.poll_once()  # heartbeats, and where the changelog ends
            await web.poll_once()  # the changelog since
            for path in ("/", "/jobs", "/jobs?state=running&peer=gpu-west&label=team%3Da&text=read",
                         f"/jobs/{job.job_id}", "/api/charts"):
                response = await client.get(path)
                assert response.status_code == 200, (path, response.text[:300])
                assert path == "/api/charts" or job.job_id in response.text or path == "/"
            assert job.job_id in (await client.get("/jobs?text=read-only")).text
        with pytest.raises(PermanentStoreError):
            await Store(web_pool).job_request_cancel(job.job_id)  # it cannot write
    finally:
        await web_pool.close()


async def test_a_job_page_shows_its_run_contract_its_runs_and_a_stop_under_way(client, pool):
    """docs/design.md §3.7: the time limit, grace and failure retries asked; how many runs
    and why each ran again; a cancelled running job's grace end."""
    store = Store(pool)
    job = make_job(time_limit_s=1800, grace_s=90, max_failure_retries=2, max_retries=1)
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    await store.job_start_batch("gpu-west", [(job.job_id, 1, None, "started")])
    await store.db.execute("UPDATE jobs SET attempts = 3, failures = 1, restarts = 1 WHERE job_id = $1", job.job_id)
    await store.job_request_cancel(job.job_id)
    page = (await client.get(f"/jobs/{job.job_id}")).text
    assert "time limit 30m, grace 1m30s, failure retries 2" in page
    assert "3 runs: again after 1 failure (of 2 allowed), 1 agent restart; infrastructure retries 0 of 1" in page
    until = (await store.job_get(job.job_id)).cancel_requested_at + timedelta(seconds=90)
    assert f'data-testid="job-stopping">stopping (grace until <time datetime="{until.isoformat()}"' in page


async def test_a_job_page_links_its_dependencies_and_dependents(client, pool):
    """docs/design.md §3.8: what a job waits for and what waits for it, each with its
    state and condition, each a link to its own page."""
    import msgspec

    from irisfed.services.router.dependencies import insert_with_dependencies
    from irisfed.services.router.plan import plan_new_job, route
    from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
    from irisfed.shared.messages import SubmitRequest

    store = Store(pool)
    first = make_job()
    await insert_jobs(store, [first])
    request = msgspec.convert({"command": ["true"], "job_id": "waiter",
                               "after": [{"job_id": first.job_id, "when": "any"}]}, SubmitRequest)
    job, reply = plan_new_job(request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="test"), "home", None),
                              "waiter")
    await insert_with_dependencies(store, request, job, reply, "default")
    page = (await client.get("/jobs/waiter")).text
    assert 'data-testid="job-after"' in page and f'href="/jobs/{first.job_id}"' in page
    assert "(queued; must end)" in page
    page = (await client.get(f"/jobs/{first.job_id}")).text
    assert 'data-testid="job-dependents"' in page and 'href="/jobs/waiter"' in page


async def test_an_arrays_id_opens_a_page_of_its_jobs(client, pool):
    """docs/design.md §3.8: the base id of an array names all its jobs on the dashboard."""
    import msgspec

    from irisfed.services.router.arrays import insert_array
    from irisfed.services.router.plan import route
    from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
    from irisfed.shared.messages import SubmitRequest

    request = msgspec.convert({"command": ["true"], "job_id": "grid", "array": 3, "array_parallel": 1},
                              SubmitRequest)
    await insert_array(Store(pool), request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="test"), "home", None),
                       "grid", "default")
    response = await client.get("/jobs/grid")
    assert response.status_code == 200
    page = response.text
    assert 'data-testid="array-counts">3 jobs: 3 queued<' in page
    assert [f'href="/jobs/grid_{i}"' in page for i in range(3)] == [True] * 3
    assert (await client.get("/jobs/grid_9")).status_code == 404
