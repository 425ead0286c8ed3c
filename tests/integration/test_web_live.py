"""The dashboard live: operators' login and cancel (through a real router), the
server-sent events fed by NATS, and the real HTTP server's start and stop."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest

from irisfed.cli.admin import web_answers
from irisfed.services.common.store import Store
from irisfed.services.router.service import Router
from irisfed.services.web.security import CONTENT_SECURITY_POLICY, SESSION_COOKIE
from tests.infra.factories import insert_jobs, make_config, make_job, user_job
from tests.infra.web import TOKEN, client_for, csrf_of, log_in, running_web

WAIT_S = 30  # the longest any step may take before the test fails (never a timing assertion)


@pytest.fixture
async def router(pool, servers, subject_prefix):
    from irisfed.services.common.bus import connect_client

    nc = await connect_client(servers.nats_url)
    service = Router(make_config(subject_prefix=subject_prefix), pool, nc)
    await service.start()
    yield service
    await service.close()
    await nc.close()


async def test_cancel_needs_a_logged_in_operator_and_the_csrf_token(pool, nats_client, subject_prefix, router):
    store = Store(pool)
    job = make_job()
    await insert_jobs(store, [job])
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        url = f"/jobs/{job.job_id}"
        assert 'data-testid="cancel-button"' not in (await client.get(url)).text
        assert (await client.post(url + "/cancel", data={"csrf": "guess"})).status_code == 403

        refused = await log_in(client, token="not-the-operator-token-at-all")
        assert refused.status_code == 403 and 'data-testid="login-error"' in refused.text
        assert SESSION_COOKIE not in client.cookies

        logged = await log_in(client)
        assert logged.status_code == 303 and logged.headers["location"] == "/"
        cookie = logged.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert TOKEN not in cookie and TOKEN not in client.cookies[SESSION_COOKIE]

        page = await client.get(url)
        assert 'data-testid="cancel-button"' in page.text and 'data-testid="operator-badge"' in page.text
        csrf = csrf_of(page.text.split('data-testid="cancel-form"', 1)[1])
        assert (await client.post(url + "/cancel", data={})).status_code == 403
        assert (await client.post(url + "/cancel", data={"csrf": csrf[:-1] + ("1" if csrf.endswith("0") else "0")})).status_code == 403
        async with client_for(web) as stranger:  # the token alone, in another browser: no session
            assert (await stranger.post(url + "/cancel", data={"csrf": csrf})).status_code == 403
        assert (await store.job_get(job.job_id)).state == "queued"

        done = await client.post(url + "/cancel", data={"csrf": csrf})
        assert done.status_code == 303 and done.headers["location"] == f"{url}?cancel=never_started"
        after = await client.get(done.headers["location"])
        assert 'data-testid="cancel-outcome"' in after.text and "will never run" in after.text
        assert 'data-state="killed"' in after.text
        assert 'data-testid="cancel-button"' not in after.text  # nothing left to cancel
        assert (await store.job_get(job.job_id)).state == "killed"

        missing = await client.post("/jobs/no-such-job/cancel", data={"csrf": csrf})
        assert missing.headers["location"].endswith("?cancel_error=not_found")

        logout = await client.post("/logout", data={"csrf": csrf})
        assert logout.status_code == 303
        assert 'data-testid="login-link"' in (await client.get("/")).text


async def test_cancel_goes_to_the_router_as_an_operators_cancel(pool, nats_client, subject_prefix):
    """Without a router: the request made on <prefix>.operator.cancel with the stored id
    and ``"by": "web"``, answered by a test responder; nothing is asked on <prefix>.cancel."""
    asked: list[bytes] = []
    as_default_user: list[bytes] = []

    async def answer(msg):
        asked.append(msg.data)
        await msg.respond(json.dumps({"job_id": json.loads(msg.data)["job_id"], "state": "running",
                                      "outcome": "kill_sent"}).encode())

    async def wrong_subject(msg):
        as_default_user.append(msg.data)

    await nats_client.subscribe(f"{subject_prefix}.operator.cancel", cb=answer)
    await nats_client.subscribe(f"{subject_prefix}.cancel", cb=wrong_subject)
    await nats_client.flush()
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        await log_in(client)
        page = await client.get("/jobs/j1")  # no such job in Postgres: the form is not shown ...
        assert page.status_code == 404
        csrf = csrf_of((await client.get("/")).text)  # ... but an operator's CSRF token is on every page
        done = await client.post("/jobs/j1/cancel", data={"csrf": csrf})
        assert done.headers["location"] == "/jobs/j1?cancel=kill_sent"
        # A user's job, by its stored id (with its ':' as typed or escaped).
        done = await client.post("/jobs/alice:train-1/cancel", data={"csrf": csrf})
        assert done.headers["location"] == "/jobs/alice:train-1?cancel=kill_sent"
        done = await client.post("/jobs/bob%3Aeval.2/cancel", data={"csrf": csrf})
        assert done.headers["location"] == "/jobs/bob:eval.2?cancel=kill_sent"
        for hostile in ("Alice:x", "alice:bob:x", ":x", "alice:", "alice:%3Cscript%3E", "a" * 33 + ":x"):
            refused = await client.post(f"/jobs/{hostile}/cancel", data={"csrf": csrf})
            assert refused.status_code == 404, hostile
        await nats_client.flush()
    assert [json.loads(a) for a in asked] == [{"job_id": "j1", "by": "web"}, {"job_id": "alice:train-1", "by": "web"},
                                              {"job_id": "bob:eval.2", "by": "web"}]
    assert as_default_user == []


async def test_an_operator_cancels_a_users_job_and_its_page_names_who_asked(pool, nats_client, subject_prefix,
                                                                            router):
    store = Store(pool)
    job = user_job("alice", "train-1")
    await insert_jobs(store, [job])
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        await log_in(client)
        url = "/jobs/alice:train-1"
        page = await client.get(url)
        assert page.status_code == 200 and 'data-testid="cancel-button"' in page.text
        assert 'data-testid="cancel-requested-by"' not in page.text
        csrf = csrf_of(page.text.split('data-testid="cancel-form"', 1)[1])
        done = await client.post(url + "/cancel", data={"csrf": csrf})
        assert done.status_code == 303 and done.headers["location"] == f"{url}?cancel=never_started"
        after = await client.get(done.headers["location"])
        assert 'data-state="killed"' in after.text
        assert '<dd data-testid="cancel-requested-by">operator (web)</dd>' in after.text
    row = await store.job_get("alice:train-1")
    assert (row.state, row.cancel_requested_by) == ("killed", "operator (web)")


async def test_without_a_token_the_dashboard_is_view_only(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, operator_token=None) as web, \
            client_for(web) as client:
        page = await client.get("/login")
        assert 'data-testid="login-disabled"' in page.text and 'data-testid="login-form"' not in page.text
        client.cookies.set("irisfed_login_csrf", "a")
        forged = await client.post("/login", data={"csrf": "a", "token": TOKEN})
        assert forged.status_code == 404 and SESSION_COOKIE not in forged.headers.get("set-cookie", "")
        assert (await client.post("/jobs/j1/cancel", data={"csrf": "a"})).status_code == 403


async def test_a_forged_session_cookie_is_not_an_operator(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        for forged in (TOKEN, "v1.1700000000.abc.def", "v1." + "9" * 12 + ".x.y", "x" * 5000):
            client.cookies.set(SESSION_COOKIE, forged)
            page = await client.get("/")
            assert 'data-testid="operator-badge"' not in page.text
            assert (await client.post("/jobs/j1/cancel", data={"csrf": "x"})).status_code == 403


async def read_until(lines, wanted: str, limit: int = 200) -> list[str]:
    """Lines of a server-sent event stream up to the first event named ``wanted`` (and its data)."""
    seen: list[str] = []
    async for line in lines:
        seen.append(line)
        if len(seen) >= 2 and seen[-2] == f"event: {wanted}":
            return seen
        assert len(seen) < limit, seen
    raise AssertionError(f"stream ended before {wanted}: {seen}")


async def test_the_event_stream_follows_nats(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, listen=True, flush_s=0.05) as web, \
            httpx.AsyncClient(timeout=WAIT_S) as http:
        async with http.stream("GET", web.url + "events") as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert stream.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            lines = stream.aiter_lines()
            opening = await asyncio.wait_for(read_until(lines, "mode"), WAIT_S)
            assert json.loads(opening[-1].removeprefix("data: ")) == {"live": True}

            await nats_client.publish(f"{subject_prefix}.events.job-7", b'{"job_id": "job-7"}')
            await nats_client.publish(f"{subject_prefix}.events.<script>", b"{}")  # no job id: ignored
            seen = await asyncio.wait_for(read_until(lines, "jobs"), WAIT_S)
            assert json.loads(seen[-1].removeprefix("data: ")) == {"all": False, "ids": ["job-7"]}

            heartbeat = {"peer_id": "gpu-west", "seq": 1, "sent_at": datetime.now(UTC).isoformat(), "ttl_s": 5,
                         "run_id": "r1", "backends": [{"name": "main", "attributes": {},
                                                       "capacity": {"total": 2, "free": 2}}]}
            await nats_client.publish(f"{subject_prefix}.heartbeat.gpu-west", json.dumps(heartbeat).encode())
            await asyncio.wait_for(read_until(lines, "peers"), WAIT_S)
        assert web.view.reachable_ids() == ["gpu-west"]

        page = await http.get(web.url)
        assert page.status_code == 200 and 'data-peer-id="gpu-west"' in page.text
        assert await asyncio.to_thread(web_answers, web.url, 5)  # `irisfed health web --url ...`


async def test_a_viewer_that_falls_behind_gets_one_resync(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix, queue_batches=2) as web:
        slow = web.broker.join()
        for i in range(5):
            web.broker.job_changed(f"job-{i}")
            web.broker.flush()
        batches = []
        while not slow.queue.empty():
            batches.append(slow.queue.get_nowait())
        assert len(batches) <= 2 and batches[-1].resync
        web.broker.leave(slow)


async def test_the_service_runs_as_irisfed_web_and_stops_on_sigterm(database_url, servers, subject_prefix, tmp_path):
    """`python -m irisfed.services.web` with a config and a token file; SIGTERM stops it cleanly."""
    config = tmp_path / "federation.toml"
    config.write_text(f'subject_prefix = "{subject_prefix}"\nlocal_cluster = "home"\n[[peers]]\nid = "home"\n')
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = {**os.environ, "IRISFED_DATABASE_URL": database_url, "IRISFED_NATS_URL": servers.nats_url_for("web"),
           "IRISFED_CONFIG": str(config)}
    proc = subprocess.Popen([sys.executable, "-m", "irisfed.services.web", "--port", "0", "--operator-token-file", str(token),
                             "--log-level", "info"], cwd=os.getcwd(), env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        lines = []
        for line in proc.stderr:  # the start event names the address it listens on
            lines.append(line)
            if "web_started" in line:
                url = json.loads(line)["url"]
                break
        assert url, "".join(lines)
        assert await asyncio.to_thread(web_answers, url, 10)
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            page = await http.get(url + "jobs")
            assert page.status_code == 200 and "Jobs" in page.text
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=WAIT_S)[1]
    assert proc.returncode == 0, "".join(lines) + rest
    assert TOKEN not in "".join(lines) + rest
