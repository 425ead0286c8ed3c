"""The dashboard and users (docs/design.md §3.2), against the real Postgres and NATS of
the test session: each job's user on the Jobs page and its user filter, a user's job
page under its stored id (``alice:train-1``), who asked for a cancel, a job waiting for
its user's quota, and the Users page (live usage against quotas, weights, weighted
dominant shares of what the peers advertise, counts) with its JSON twin."""

from __future__ import annotations

import html
import json
import re

import msgspec
import pytest

from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from tests.infra.factories import (
    advertise_resources,
    assign_jobs,
    insert_jobs,
    make_job,
    start_all,
    user_job,
)
from tests.infra.web import (
    assert_shows,
    client_for,
    job_ids,
    ok_page,
    running_web,
    user_ids,
    user_row,
)

HOSTILE_USER = "<script>alert(1)</script>"
HOSTILE_RESOURCE = '"><img src=x onerror=alert(1)>'
USERS = [
    {"id": "alice", "weight": 2.0, "max_band": "production", "quota": {"gpu": 2}},
    {"id": "bob"},
    {"id": "carol", "quota": {"gpu": 1, "cpu": 0.5}},
]


def next_link(html: str) -> str | None:
    found = re.search(r'<a href="([^"]+)" data-testid="next-page"', html)
    return found.group(1).replace("&amp;", "&") if found else None


# ---------------------------------------------------------------- the Jobs page


async def test_the_jobs_page_shows_each_jobs_user_and_filters_by_user(pool, nats_client, subject_prefix):
    store = Store(pool)
    mine = make_job(job_id="plain-1")
    alice = [user_job("alice", f"train-{i}") for i in range(5)]
    bob = user_job("bob", "train-1")  # the same id as alice's: another job
    for job in (mine, *alice, bob):  # one transaction each: newest first is this order reversed
        await insert_jobs(store, [job])
    async with running_web(pool, nats_client, subject_prefix, users=USERS, page_size=2) as web, \
            client_for(web) as client:
        page = (await client.get("/jobs")).text
        assert job_ids(page) == ["bob:train-1", "alice:train-4"]
        row = page.split('data-job-id="bob:train-1"', 1)[1].split("</tr>", 1)[0]
        assert '<td data-testid="job-user">bob</td>' in row
        assert 'href="/jobs/bob:train-1"' in row  # the stored id, readable in the link
        assert "<th>user</th>" in page

        seen, url = [], "/jobs?user=alice"
        while url:
            listed = await client.get(url)
            assert listed.status_code == 200, listed.text[:300]
            seen += job_ids(listed.text)
            url = next_link(listed.text)
            assert url is None or "user=alice" in url  # the filter survives every page
        assert seen == [f"alice:train-{i}" for i in range(4, -1, -1)]
        assert 'value="alice"' in (await client.get("/jobs?user=alice")).text  # the form keeps it
        assert job_ids((await client.get("/jobs?user=default")).text) == ["plain-1"]
        assert job_ids((await client.get("/jobs?user=bob&text=train-1")).text) == ["bob:train-1"]
        assert job_ids((await client.get("/jobs?user=carol")).text) == []
        assert 'data-testid="no-jobs"' in (await client.get("/jobs?user=dave")).text  # valid, no jobs


@pytest.mark.parametrize("query", [
    "user=Alice", "user=%3Cscript%3Ealert(1)%3C/script%3E", "user=" + "a" * 33, "user=al%20ice", "user=9lives",
    "user=alice&user=bob", "user=al%00ice", "user=alice:train-1",
])
async def test_a_bad_user_filter_gets_a_clear_400(pool, nats_client, subject_prefix, query):
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        response = await client.get("/jobs?" + query)
        assert response.status_code == 400, response.text[:300]
        assert 'data-testid="filter-error"' in response.text
        assert "user" in response.text.split('data-testid="filter-error"', 1)[1].split("</p>", 1)[0]
        assert "<script>alert" not in response.text
        fragment = await client.get("/jobs?" + query, headers={"HX-Request": "true"})
        assert fragment.status_code == 400 and "<html" not in fragment.text


# ---------------------------------------------------------------- a user's job


async def test_a_users_job_has_its_page_under_its_stored_id(pool, nats_client, subject_prefix):
    store = Store(pool)
    job = user_job("alice", "train-1", name="alice's run")
    await insert_jobs(store, [job, make_job(job_id="train-1")])  # the default user's train-1: another job
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        for path in ("/jobs/alice:train-1", "/jobs/alice%3Atrain-1"):
            assert_shows(await ok_page(client, path), '<span data-testid="job-id">alice:train-1</span>',
                         'data-testid="job-user" data-user-id="alice"', '<code data-testid="job-sent-id">train-1</code>',
                         'hx-get="/jobs/alice:train-1"', 'data-live-job="alice:train-1"', 'href="/jobs?user=alice"')
        plain = (await client.get("/jobs/train-1")).text
        assert 'data-testid="job-user" data-user-id="default"' in plain and "job-sent-id" not in plain
        for hostile in ("alice:%3Cscript%3E", "Alice:train-1", "alice:bob:train-1", ":train-1", "alice:",
                        "a" * 33 + ":x", "alice:train-1%0A"):
            answer = await client.get(f"/jobs/{hostile}")
            assert answer.status_code == 404, hostile
            assert "<script>" not in answer.text
        assert (await client.get("/jobs/bob:train-1")).status_code == 404  # valid, no such job


async def test_a_job_page_names_who_asked_for_its_cancel_and_a_quota_wait(pool, nats_client, subject_prefix):
    store = Store(pool)
    waiting = user_job("alice", "gpu-3", resources={"gpu": 1})
    asked = user_job("bob", "long-1")
    await insert_jobs(store, [waiting, asked])
    rule = "quota: this job's 1 gpu would take alice over its quota of 2 gpu"
    await store.job_explain_batch([(waiting.job_id, explanation("tick", rule, code="quota"), rule)])
    await store.job_request_cancel(asked.job_id, "user bob")
    await store.job_request_cancel(asked.job_id, "operator (web)")  # a later asker does not rename the first
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        page = (await client.get("/jobs/alice:gpu-3")).text
        said = page.split('data-testid="waiting"', 1)[1].split("</p>", 1)[0]
        assert 'data-wait="quota"' in said
        assert html.unescape(re.sub(r"<[^>]+>", "", said.split(">", 1)[1])) == (
            "Decided by tick, waiting: quota — quota: this job's 1 gpu would take alice over its quota of 2 gpu")
        assert "cancel-requested-by" not in page

        page = (await client.get("/jobs/bob:long-1")).text
        assert '<dd data-testid="cancel-requested-by">user bob</dd>' in page
        assert 'data-testid="cancel-requested"' in page
        assert 'data-testid="waiting"' not in page

        await assign_jobs(store, [waiting], "gpu-west")  # placed since: no longer waiting
        assert 'data-testid="waiting"' not in (await client.get("/jobs/alice:gpu-3")).text


# ---------------------------------------------------------------- the Users page


async def test_the_users_page_shows_usage_against_quotas_weights_and_shares(pool, nats_client, subject_prefix):
    store = Store(pool)
    # What the federation advertises: slots 12, cpu 20, gpu 4, memory 64.0 GiB.
    await advertise_resources(store, "gpu-west", {"cpu": 16, "gpu": 4, "memory_mb": 65536}, slots=8)
    await advertise_resources(store, "home", {"cpu": 4}, slots=4)
    alice_live = [user_job("alice", f"gpu-{i}", resources={"gpu": 1, "cpu": 1.5}) for i in range(2)]
    await start_all(store, alice_live[:1])
    await insert_jobs(store, alice_live[1:])
    await assign_jobs(store, alice_live[1:], "gpu-west")  # assigned, not running yet: live all the same
    await insert_jobs(store, [user_job("alice", "gpu-2", resources={"gpu": 1})])  # queued
    await start_all(store, [user_job("bob", "cpu-1", resources={"cpu": 3})], "home")
    await start_all(store, [make_job(job_id="plain-1")], "home")  # the default user: one cpu
    await start_all(store, [user_job("dave", "old-1", resources={"gpu": 1})])  # dave: no longer configured
    done = user_job("carol", "done-1")
    await start_all(store, [done])
    await store.job_finish_batch("gpu-west", [(done.job_id, 1, 0, False)])  # ended: holds nothing

    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        await web.poll_once()  # the stored heartbeats into the view
        page = await client.get("/users")
        assert page.status_code == 200
        html = page.text
        assert 'data-testid="nav-users" aria-current="page"' in html
        assert user_ids(html) == ["alice", "bob", "carol", "dave", "default"]

        alice = user_row(html, "alice")
        # gpu 2 of 4 advertised is its dominant share (0.5), halved by its weight 2.
        assert 'data-share="0.250000"' in alice and '<td class="num" data-testid="user-share">25.0%</td>' in alice
        assert re.search(r'data-resource="gpu">.*?<span class="fill w100 full"></span>.*?'
                         r'data-testid="user-usage-amount">2 / 2</span>', alice, re.S)
        assert re.search(r'data-resource="cpu">.*?no cap.*?data-testid="user-usage-amount">3 / —</span>', alice, re.S)
        assert '<td class="num" data-testid="user-weight">2</td>' in alice
        assert '<td class="num" data-testid="user-queued">1</td>' in alice
        assert '<td class="num" data-testid="user-live">2</td>' in alice
        assert '<td data-testid="user-max-band">production</td>' in alice
        assert 'href="/jobs?user=alice"' in alice and "user-unconfigured" not in alice

        bob = user_row(html, "bob")  # cpu 3 of 20: 15%
        assert 'data-share="0.150000"' in bob and "3 / —" in bob and 'data-resource="gpu"' not in bob
        assert '<td data-testid="user-max-band">interactive</td>' in bob

        carol = user_row(html, "carol")  # configured, nothing live: its caps at 0
        assert 'data-share="0.000000"' in carol
        assert re.search(r'data-resource="cpu">.*?<span class="fill w0"></span>.*?>0 / 0.5</span>', carol, re.S)
        assert re.search(r'data-resource="gpu">.*?>0 / 1</span>', carol, re.S)
        assert '<td class="num" data-testid="user-live">0</td>' in carol

        dave = user_row(html, "dave")  # a user with live jobs the config no longer names
        assert 'data-testid="user-unconfigured"' in dave and 'data-share="0.250000"' in dave and "1 / —" in dave
        default = user_row(html, "default")  # slots 1 of 12 is its dominant share
        assert 'data-share="0.083333"' in default and 'data-testid="user-unconfigured"' in default
        assert "slots 12, cpu 20, gpu 4, memory 64.0 GiB" in html

        fragment = await client.get("/users", headers={"HX-Request": "true"})
        assert fragment.status_code == 200 and "<html" not in fragment.text
        assert user_ids(fragment.text) == user_ids(html)

        data = json.loads((await client.get("/api/users")).text)
        assert data["totals"] == {"cpu": 20, "gpu": 4, "memory_mb": 65536, "slots": 12}
        by_id = {u["user"]: u for u in data["users"]}
        assert list(by_id) == ["alice", "bob", "carol", "dave", "default"]
        assert by_id["alice"] == {"user": "alice", "configured": True, "max_band": "production", "weight": 2.0,
                                  "share": 0.25, "queued": 1, "assigned": 1, "running": 1,
                                  "usage": {"cpu": {"held": 3, "quota": None}, "gpu": {"held": 2, "quota": 2}}}
        assert by_id["carol"]["usage"] == {"cpu": {"held": 0, "quota": 0.5}, "gpu": {"held": 0, "quota": 1}}
        assert by_id["default"]["configured"] is False and by_id["default"]["running"] == 1


async def test_the_users_page_without_users_or_reachable_peers(pool, nats_client, subject_prefix):
    async with running_web(pool, nats_client, subject_prefix) as web, client_for(web) as client:
        page = (await client.get("/users")).text
        assert 'data-testid="no-users"' in page and "nothing (no peer reachable)" in page
        await start_all(Store(pool), [make_job(job_id="plain-1")])
        web.federation.users.expire()
        page = (await client.get("/users")).text
        assert user_ids(page) == ["default"]
        assert 'data-share="0.000000"' in user_row(page, "default")  # no totals: no share
        assert json.loads((await client.get("/api/users")).text)["totals"] == {}


async def test_hostile_users_and_resources_are_shown_escaped(pool, nats_client, subject_prefix):
    """A user id and a resource name no router would write, put in Postgres by hand."""
    store = Store(pool)
    job = msgspec.structs.replace(user_job("alice", "odd-1"), job_id="odd-1", user_id=HOSTILE_USER,
                                  resources_json=json.dumps({HOSTILE_RESOURCE: 2, "cpu": 1}))
    await start_all(store, [job])
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        pages = {path: (await client.get(path)).text for path in ("/users", "/jobs", "/jobs/odd-1")}
        for path, html in pages.items():
            assert "<script>alert" not in html and "<img src=x" not in html, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
        users = pages["/users"]
        assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in users
        assert 'href="/jobs?user=%3Cscript%3Ealert%281%29%3C%2Fscript%3E"' in users
        data = json.loads((await client.get("/api/users")).text)
        odd = next(u for u in data["users"] if u["user"] == HOSTILE_USER)
        assert odd["usage"][HOSTILE_RESOURCE] == {"held": 2, "quota": None}
        # Its filter link is refused as a user id, clearly.
        answer = await client.get("/jobs?user=%3Cscript%3Ealert%281%29%3C%2Fscript%3E")
        assert answer.status_code == 400 and "<script>alert" not in answer.text


async def test_the_users_page_works_as_the_read_only_web_role(database_url, pool, roles, nats_client,
                                                              subject_prefix):
    from urllib.parse import quote, urlsplit, urlunsplit

    from irisfed.services.common import db as dbmod

    store = Store(pool)
    await start_all(store, [user_job("alice", "gpu-1", resources={"gpu": 1})])
    parts = urlsplit(database_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    url = urlunsplit(parts._replace(netloc=f"irisfed_svc_web:{quote(roles['irisfed_svc_web'], safe='')}@{host}"))
    web_pool = await dbmod.connect(url)
    try:
        async with running_web(web_pool, nats_client, subject_prefix, users=USERS) as web, \
                client_for(web) as client:
            for path in ("/users", "/api/users", "/jobs?user=alice", "/jobs/alice:gpu-1"):
                response = await client.get(path)
                assert response.status_code == 200, (path, response.text[:300])
            assert "1 / 2" in user_row((await client.get("/users")).text, "alice")
    finally:
        await web_pool.close()
