"""``irisfed web`` in a real browser (headless Chromium over CDP) against a real
federation: live updates without a reload, filters and pages, the hand-off timeline,
operator-only cancel, hostile strings shown as text, no console errors anywhere.

Every test fails on any console or page error (the ``page`` fixture; a CSP
violation is one), and leaves a screenshot in tests/browser/artifacts/.
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Page, expect

from irisfed.services.web.settings import WebSettings
from tests.browser.conftest import ARTIFACTS, REFUSED_RETRY_S, Dashboard, update_screenshots
from tests.infra.probes import kill_group
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
# The first copy (epoch 1) would run a while; any later copy ends at once.
EPOCH_AWARE = ["sh", "-c", 'if [ "$IRISFED_EPOCH" = 1 ]; then sleep 20; else echo ran; fi']
GPU_EAST = ["--resource", "cpu=32", "--resource", "gpu=4"]  # started by the tests that need it
SCRIPT = "<script>window.__pwned=1</script>"
ATTRIBUTE = '"><img src=x onerror="window.__pwned=2">'

# Records every value a page shows in an element's data-* attribute (e.g. a job's
# data-state), in order, as the page's live fragments are swapped in: a state shown
# only for a moment is not missed, and a reload would lose window.__states.
RECORD_STATES = """([selector, key]) => {
  window.__states = [];
  const read = () => {
    const el = document.querySelector(selector);
    const state = el && el.dataset[key];
    if (state && window.__states[window.__states.length - 1] !== state) { window.__states.push(state); }
  };
  read();
  new MutationObserver(read).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""
# Marks on <body> which live-update DOM events the page has seen from now on
# (data-heard-irisfed-jobs, data-heard-htmx-after-settle): waiting assertions read them.
LISTEN = """() => {
  for (const [name, key] of [["irisfed-jobs", "heardIrisfedJobs"], ["htmx:afterSettle", "heardHtmxAfterSettle"]]) {
    delete document.body.dataset[key];
    document.body.addEventListener(name, () => { document.body.dataset[key] = "yes"; });
  }
}"""


async def open_live(page: Page, url: str):
    """Open ``url`` and wait until its live-update stream (/events) is connected."""
    async with page.expect_response(lambda r: r.url.endswith("/events") and r.status == 200):
        response = await page.goto(url)
    return response


async def row_ids(page: Page) -> list[str]:
    return await page.get_by_test_id("job-row").evaluate_all("rows => rows.map(r => r.dataset.jobId)")


async def row_times(page: Page) -> list[datetime]:
    values = await page.get_by_test_id("job-row").evaluate_all(
        "rows => rows.map(r => r.querySelector('time').getAttribute('datetime'))")
    return [datetime.fromisoformat(v) for v in values]


async def show(page: Page, *, state: str = "", label: str = "", text: str = "") -> None:
    """Filter the job list through its form, like a person would."""
    await page.get_by_test_id("filter-state").select_option(state)
    labels = page.get_by_test_id("filter-label")
    for i in range(await labels.count()):
        await labels.nth(i).fill("")
    await labels.first.fill(label)
    await page.get_by_test_id("filter-text").fill(text)
    async with page.expect_navigation():
        await page.get_by_test_id("filter-submit").click()


async def all_pages(page: Page) -> tuple[list[str], list[datetime], int]:
    """Every row from this page on, following ``next-page``; and how many pages."""
    ids, times, pages = await row_ids(page), await row_times(page), 1
    while await page.get_by_test_id("next-page").count():
        async with page.expect_navigation():
            await page.get_by_test_id("next-page").click()
        await expect(page.get_by_test_id("first-page")).to_be_visible()
        ids += await row_ids(page)
        times += await row_times(page)
        pages += 1
    return ids, times, pages


# ---------------------------------------------------------------- 1. live federation, jobs and job pages


async def test_peers_and_capacity_show_and_a_job_moves_live_on_the_jobs_and_job_pages(dashboard: Dashboard,
                                                                                     page: Page):
    fed = dashboard.fed
    await open_live(page, dashboard.url("/"))
    rows = page.get_by_test_id("peer-row")
    await expect(rows).to_have_count(4)  # every configured peer, started or not
    assert await rows.evaluate_all("rs => rs.map(r => r.dataset.peerId)") == ["home", "gpu-west", "tpu-east",
                                                                             "gpu-east"]
    west = page.locator('[data-testid=peer-row][data-peer-id="gpu-west"]')
    home = page.locator('[data-testid=peer-row][data-peer-id="home"]')
    east = page.locator('[data-testid=peer-row][data-peer-id="gpu-east"]')
    await expect(west.get_by_test_id("peer-reachable")).to_have_attribute("data-reachable", "yes")
    await expect(home.get_by_test_id("peer-reachable")).to_have_attribute("data-reachable", "yes")
    await expect(east.get_by_test_id("peer-reachable")).to_have_attribute("data-reachable", "no")
    await expect(west.locator('[data-resource="gpu"]')).to_contain_text("0 used, 2 free of 2")
    await expect(west.locator('[data-resource="cpu"]')).to_contain_text("free of 16")
    await expect(west.locator('[data-resource="slots"]')).to_contain_text("free of 2")
    await expect(home.locator('[data-resource="memory_mb"]')).to_contain_text("free of 8.0 GiB")
    await expect(home.locator('[data-resource="gpu"]')).to_have_count(0)
    await expect(east).to_contain_text("no heartbeat yet")

    # Pinned to gpu-east, whose agent is not up yet: it waits queued until we start it.
    reply = await fed.submit({"job_id": "live-1", "command": ["sh", "-c", "echo hello-from-live-1; sleep 2"],
                              "cluster_pin": "gpu-east", "name": "live one"})
    assert reply["state"] == "queued", reply
    await expect(page.get_by_test_id("count-queued")).to_contain_text("1")  # live, no reload

    jobs = page
    await open_live(jobs, dashboard.url("/jobs"))
    await expect(jobs.locator("#job-live-1").get_by_test_id("job-state")).to_have_attribute("data-state", "queued")
    await jobs.evaluate(RECORD_STATES, ["#job-live-1 [data-testid=job-state]", "state"])
    job = await page.context.new_page()
    await open_live(job, dashboard.url("/jobs/live-1"))
    await expect(job.get_by_test_id("job-state")).to_have_attribute("data-state", "queued")
    await expect(job.get_by_test_id("logs-none")).to_be_visible()
    await job.evaluate(RECORD_STATES, ["#job-live [data-testid=job-state]", "state"])
    federation_page = await page.context.new_page()
    await open_live(federation_page, dashboard.url("/"))
    await federation_page.evaluate(RECORD_STATES, ['[data-peer-id="gpu-east"] [data-testid=peer-reachable]',
                                                   "reachable"])

    fed.start("gpu-east", *GPU_EAST)

    for tab in (jobs, job):
        await expect(tab.get_by_test_id("job-state").first).to_have_attribute("data-state", "succeeded")
    east = federation_page.locator('[data-testid=peer-row][data-peer-id="gpu-east"]')
    await expect(east.get_by_test_id("peer-reachable")).to_have_attribute("data-reachable", "yes")
    await expect(east.locator('[data-resource="gpu"]')).to_contain_text("free of 4")
    await expect(job.get_by_test_id("job-owner")).to_have_text("gpu-east")
    await expect(job.get_by_test_id("log-stdout")).to_contain_text("hello-from-live-1")
    await expect(job.get_by_test_id("placed")).to_contain_text("on gpu-east")
    for tab in (jobs, job):
        # __states survives only if the page never reloaded: everything came live.
        seen = await tab.evaluate("window.__states")
        assert seen[0] == "queued" and seen[-1] == "succeeded", seen
        assert "running" in seen and seen.index("running") < len(seen) - 1, seen
    assert await federation_page.evaluate("window.__states") == ["no", "yes"]
    await federation_page.close()
    await job.close()


# ---------------------------------------------------------------- 2. filters and pages


async def test_filters_and_pages_return_the_right_rows_newest_first(dashboard: Dashboard, page: Page, watch):
    fed = dashboard.fed
    teams = ["red", "blue", "green"]
    # Pinned to tpu-east, which never starts: they stay queued, in submit order.
    for i in range(120):
        await fed.submit({"job_id": f"seed-{i:03d}", "command": ["true"], "cluster_pin": "tpu-east",
                          "name": f"{'alpha' if i % 2 == 0 else 'beta'}-{i:03d}",
                          "labels": {"team": teams[i % 3], "batch": "b1"}})
    for k in range(3):
        await fed.submit({"job_id": f"done-{k}", "command": ["true"], "name": f"done-{k}",
                          "labels": {"team": "ops"}})
    for k in range(3):
        await fed.wait_state(f"done-{k}", "succeeded")
    seeded = [f"seed-{i:03d}" for i in range(120)]
    newest_first = [f"done-{k}" for k in (2, 1, 0)] + seeded[::-1]

    await page.goto(dashboard.url("/jobs"))
    ids, times, pages = await all_pages(page)
    assert pages == 3
    assert len(ids) == len(set(ids)) == 123
    assert ids == newest_first
    assert times == sorted(times, reverse=True)

    await page.goto(dashboard.url("/jobs"))
    await show(page, state="succeeded")
    assert "state=succeeded" in page.url
    assert await row_ids(page) == ["done-2", "done-1", "done-0"]
    assert set(await page.get_by_test_id("job-state").evaluate_all("s => s.map(e => e.dataset.state)")) == {
        "succeeded"}
    await expect(page.get_by_test_id("filter-state")).to_have_value("succeeded")
    await expect(page.get_by_test_id("next-page")).to_have_count(0)
    await page.set_viewport_size({"width": 1400, "height": 900})  # a laptop: short words never break
    lines = await page.locator('[data-testid="job-state"] .state, [data-testid="job-band"]').evaluate_all(
        "cells => cells.map(c => { const r = document.createRange(); r.selectNodeContents(c);"
        " return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size; })")
    assert lines and set(lines) == {1}, lines

    await show(page, state="queued")
    ids, times, pages = await all_pages(page)
    assert (pages, ids) == (3, seeded[::-1])  # the filter survives every page
    assert "state=queued" in page.url

    await page.goto(dashboard.url("/jobs"))
    await show(page, label="team=red")
    assert await row_ids(page) == [f"seed-{i:03d}" for i in range(117, -1, -1) if i % 3 == 0]  # 40 rows
    await expect(page.get_by_test_id("next-page")).to_have_count(0)
    await expect(page.get_by_test_id("filter-label").first).to_have_value("team=red")

    await show(page, text="beta-11")
    assert await row_ids(page) == ["seed-119", "seed-117", "seed-115", "seed-113", "seed-111"]

    await page.goto(dashboard.url("/jobs?label=team%3Dred&text=alpha"))
    assert await row_ids(page) == [f"seed-{i:03d}" for i in range(114, -1, -6)]

    await page.goto(dashboard.url("/jobs?text=no-such-job"))
    await expect(page.get_by_test_id("no-jobs")).to_have_text("No job matches these filters.")

    # Bad filters: the page says what is wrong, with HTTP 400 (Chromium logs that 400 as
    # "Failed to load resource", which the fixture then expects; nothing else may be logged).
    watch.expect_status("/jobs", 400)
    response = await page.goto(dashboard.url("/jobs?state=bogus"))
    assert response.status == 400
    await expect(page.get_by_test_id("filter-error")).to_contain_text("unknown state 'bogus'")
    await expect(page.get_by_test_id("job-row")).to_have_count(0)
    await page.goto(dashboard.url("/jobs"))
    async with page.expect_response(lambda r: "/jobs?" in r.url) as answer:
        await show(page, label="no-equals-sign")
    assert (await answer.value).status == 400
    await expect(page.get_by_test_id("filter-error")).to_have_text("a label filter looks like key=value")
    response = await page.goto(dashboard.url("/jobs?after=not-a-cursor!"))
    assert response.status == 400
    await expect(page.get_by_test_id("filter-error")).to_contain_text("this page link is not valid")


# ---------------------------------------------------------------- 3. hand-off timeline, verdicts


async def test_the_job_page_shows_the_hand_off_after_a_failover_and_why_a_job_was_rejected(dashboard: Dashboard,
                                                                                           page: Page):
    fed = dashboard.fed
    # 64 GPUs: no peer has that many (asked while gpu-west is up, to hear its verdict too).
    rejected = await fed.submit({"job_id": "too-big", "command": ["true"], "resources": {"gpu": 64}})
    assert rejected["disposition"] == "reject", rejected
    # Unpinned; gpu-west is the only GPU peer up, so it runs there first.
    reply = await fed.submit({"job_id": "handoff", "command": EPOCH_AWARE, "constraints": GPU, "max_retries": 2})
    assert reply["disposition"] == "queue", reply
    first_pid = await fed.run_pid("handoff")
    try:
        assert (await fed.job("handoff")).owner_peer_id == "gpu-west"
        fed.start("gpu-east", *GPU_EAST)
        await open_live(page, dashboard.url("/jobs/handoff"))
        await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "running")
        await expect(page.get_by_test_id("job-owner")).to_have_text("gpu-west")
        await fed.wait_agent("gpu-east")

        fed.kill("gpu-west")  # SIGKILL: its heartbeat stops; after TTL + grace the job moves

        await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "succeeded", timeout=60_000)
    finally:
        kill_group(first_pid)  # the lost copy, orphaned by its killed agent
    await expect(page.get_by_test_id("job-owner")).to_have_text("gpu-east")
    await expect(page.get_by_test_id("job-epoch")).to_have_text("3")
    await expect(page.get_by_test_id("placed")).to_contain_text("on gpu-east at epoch 3")
    steps = await page.get_by_test_id("timeline-entry").evaluate_all(
        "els => els.map(e => [e.dataset.toState, e.querySelector('.where').textContent])")
    moves = []
    for state, where in steps:
        found = re.search(r"peer (\S+) · epoch (\d+)", where)
        assert found, where
        moves.append((state, found.group(1), int(found.group(2))))
    assert [s for s, _, _ in moves] == ["queued", "assigned", "running", "queued", "assigned", "running",
                                        "succeeded"], moves
    epochs = [e for _, _, e in moves]
    assert epochs == sorted(epochs) and moves[1][2] == 1 and epochs[-1] == 3, moves
    runs = [(peer, epoch) for state, peer, epoch in moves if state == "running"]
    assert runs == [("gpu-west", 1), ("gpu-east", 3)], moves
    await expect(page.locator('[data-testid=timeline-entry][data-to-state="queued"]').nth(1)).to_contain_text(
        "peer lost")
    await expect(page.get_by_test_id("log-stdout")).to_contain_text("ran")

    await page.goto(dashboard.url("/jobs/too-big"))
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "rejected")
    verdicts = page.get_by_test_id("verdict")
    await expect(verdicts.first).to_be_visible()
    codes = dict(await verdicts.evaluate_all("vs => vs.map(v => [v.dataset.peerId, v.dataset.code])"))
    assert codes["gpu-west"] == codes["home"] == "insufficient_resources", codes
    assert codes["tpu-east"] == "unreachable", codes
    await expect(page.locator('[data-testid=verdict][data-peer-id="gpu-west"]')).to_contain_text(
        "gpu: asked 64, at most 2")
    await expect(page.get_by_test_id("logs-none")).to_be_visible()
    await expect(page.get_by_test_id("placed")).to_have_count(0)


# ---------------------------------------------------------------- 4. cancel: operators only


async def test_an_operator_cancels_with_the_token_and_nobody_else_can(dashboard: Dashboard, page: Page, watch):
    fed = dashboard.fed
    await fed.submit({"job_id": "long-1", "command": ["sleep", "60"]})
    await fed.wait_state("long-1", "running")
    job_url = dashboard.url("/jobs/long-1")

    await open_live(page, job_url)
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "running")
    await expect(page.get_by_test_id("login-link")).to_be_visible()
    await expect(page.get_by_test_id("cancel-button")).to_have_count(0)
    await expect(page.get_by_test_id("operator-badge")).to_have_count(0)

    # Forged posts: no session, no CSRF token; then a session without the CSRF token.
    forged = await page.request.post(job_url + "/cancel", form={"csrf": "forged"}, max_redirects=0)
    assert forged.status == 403
    bare = await page.request.post(job_url + "/cancel", max_redirects=0)
    assert bare.status == 403

    watch.expect_status("/login", 403)
    await page.get_by_test_id("login-link").click()
    await page.get_by_test_id("login-token").fill("not-the-operator-token-at-all")
    await page.get_by_test_id("login-submit").click()
    await expect(page.get_by_test_id("login-error")).to_have_text("That is not the operator token.")
    await expect(page.get_by_test_id("operator-badge")).to_have_count(0)
    await page.get_by_test_id("login-token").fill(dashboard.token)
    async with page.expect_navigation(url=dashboard.url("/")):
        await page.get_by_test_id("login-submit").click()
    await expect(page.get_by_test_id("operator-badge")).to_be_visible()
    await expect(page.get_by_test_id("logout-button")).to_be_visible()

    logged_in_but_forged = await page.request.post(job_url + "/cancel", form={"csrf": "forged"}, max_redirects=0)
    assert logged_in_but_forged.status == 403
    job = await fed.job("long-1")
    assert (job.state, job.cancel_requested) == ("running", False)

    await open_live(page, job_url)
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "running")
    await expect(page.get_by_test_id("cancel-requested")).to_have_count(0)
    async with page.expect_navigation(url=re.compile(r"/jobs/long-1\?cancel=")):
        await page.get_by_test_id("cancel-button").click()
    await expect(page.get_by_test_id("cancel-outcome")).to_contain_text("Cancel:")
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "killed")
    await expect(page.get_by_test_id("cancel-button")).to_have_count(0)  # a finished job has none
    assert (await fed.job("long-1")).state == "killed"

    async with page.expect_navigation(url=dashboard.url("/")):
        await page.get_by_test_id("logout-button").click()
    await expect(page.get_by_test_id("login-link")).to_be_visible()
    await expect(page.get_by_test_id("operator-badge")).to_have_count(0)


# ---------------------------------------------------------------- 5. hostile strings


async def test_hostile_strings_are_shown_as_text_and_never_run(dashboard: Dashboard, page: Page, watch):
    fed = dashboard.fed
    # Pinned to tpu-east (never started): it stays queued, nothing tries to run it.
    reply = await fed.submit({
        "job_id": "hostile", "name": SCRIPT, "cluster_pin": "tpu-east",
        "command": ["echo", SCRIPT, ATTRIBUTE],
        "labels": {SCRIPT: ATTRIBUTE, "note": SCRIPT},
        "env": {SCRIPT: "x", ATTRIBUTE: "y"},
    })
    assert reply["state"] == "queued", reply

    await open_live(page, dashboard.url("/jobs"))
    row = page.locator("#job-hostile")
    await expect(row).to_contain_text(SCRIPT)
    await expect(row).to_contain_text(ATTRIBUTE)
    await expect(row.get_by_text(SCRIPT, exact=True)).to_be_visible()  # the name cell
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    await expect(page.locator("main img")).to_have_count(0)

    await open_live(page, dashboard.url("/jobs/hostile"))
    await expect(page.get_by_test_id("job-name")).to_have_text(SCRIPT)
    await expect(page.get_by_test_id("job-command")).to_contain_text(SCRIPT)
    await expect(page.get_by_test_id("job-command")).to_contain_text(ATTRIBUTE)
    await expect(page.get_by_test_id("job-labels")).to_contain_text(f"{SCRIPT}={ATTRIBUTE}")
    await expect(page.get_by_test_id("job-env")).to_contain_text(SCRIPT)
    await expect(page.get_by_test_id("job-env")).to_contain_text(ATTRIBUTE)
    await expect(page.get_by_test_id("job-env")).not_to_contain_text("x y")  # names only, never values
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    await expect(page.locator("main img")).to_have_count(0)
    await expect(page.locator("main script")).to_have_count(0)

    # A live swap of the same fragment (the job moves: cancelled) must not run them either.
    await fed.cancel("hostile")
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "killed")
    await expect(page.get_by_test_id("job-name")).to_have_text(SCRIPT)
    assert await page.evaluate("typeof window.__pwned") == "undefined"

    # Typed into the filters: echoed back as text, in the form and in the error.
    watch.expect_status("/jobs", 400)
    await page.goto(dashboard.url("/jobs"))
    await page.get_by_test_id("filter-text").fill(ATTRIBUTE)
    await page.get_by_test_id("filter-label").last.fill(f"k={SCRIPT}")
    async with page.expect_navigation():
        await page.get_by_test_id("filter-submit").click()
    await expect(page.get_by_test_id("filter-text")).to_have_value(ATTRIBUTE)
    await expect(page.get_by_test_id("filter-label").first).to_have_value(f"k={SCRIPT}")
    await page.goto(dashboard.url("/jobs?state=" + SCRIPT.replace("<", "%3C").replace(">", "%3E")))
    await expect(page.get_by_test_id("filter-error")).to_contain_text("<script>window.__pwned=1")
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    await expect(page.locator("main img")).to_have_count(0)
    assert watch.problems == []

    # Had any of it become markup, the CSP would refuse to run it and this test would
    # fail on the console error it logs (and an uncaught error is caught as well).
    await page.evaluate("html => document.querySelector('main').insertAdjacentHTML('beforeend', html)",
                        '<img src="/nope" onerror="window.__pwned=3">')
    await page.evaluate("() => { setTimeout(() => { throw new Error('thrown on purpose'); }); }")

    async def reported():
        text = "\n".join(watch.problems)
        return "Content Security Policy" in text and "thrown on purpose" in text
    await wait_for(reported, "the browser to report the refused handler and the error", timeout=15)
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    watch.problems.clear()  # provoked on purpose


# ---------------------------------------------------------------- 6. every page, live, without errors


async def test_every_page_loads_and_updates_live_without_errors_and_charts_draw(dashboard: Dashboard, page: Page):
    fed = dashboard.fed
    await fed.submit({"job_id": "quick-1", "command": ["true"], "name": "quick"})
    await fed.wait_state("quick-1", "succeeded")
    await fed.submit({"job_id": "waits-1", "command": ["true"], "cluster_pin": "tpu-east"})
    moves = iter([
        lambda: fed.submit({"command": ["true"]}),
        lambda: fed.submit({"command": ["true"]}),
        lambda: fed.cancel("waits-1"),  # the job page below is this job's
        lambda: fed.submit({"command": ["true"]}),
        lambda: fed.submit({"command": ["true"]}),
    ])
    for path in ["/", "/jobs", "/jobs/waits-1", "/charts", "/login"]:
        response = await open_live(page, dashboard.url(path))
        assert response.status == 200, path
        await expect(page.get_by_test_id("stream-banner")).to_be_hidden()
        await expect(page.get_by_test_id("live-banner")).to_be_hidden()
        # A change reaches the page as a DOM event, and pages with live parts re-fetch them.
        await page.evaluate(LISTEN)
        await next(moves)()
        await expect(page.locator("body")).to_have_attribute("data-heard-irisfed-jobs", "yes")
        if path in ("/", "/jobs", "/jobs/waits-1"):
            await expect(page.locator("body")).to_have_attribute("data-heard-htmx-after-settle", "yes")
        if path == "/charts":
            for name in ("submits", "completions", "queued", "running"):
                await expect(page.locator(f"[data-testid=chart-{name}] canvas").first).to_be_visible()
            await expect(page.get_by_test_id("charts-error")).to_be_hidden()
        if path == "/login":
            await expect(page.get_by_test_id("login-form")).to_be_visible()


# ---------------------------------------------------------------- 6b. a refused live stream


async def test_a_browser_refused_a_live_stream_refreshes_by_itself_and_streams_again_later(dashboard: Dashboard,
                                                                                          page: Page, watch):
    """This address holds its share of streams (from the test, as many tabs would): the
    page's own stream is refused (429), it says so and refreshes itself; once a slot is
    free its next try streams again."""
    share = WebSettings().viewers_per_client
    watch.expect_status("/events", 429)
    async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as held:
        for _ in range(share):
            stream = await held.enter_async_context(http.stream("GET", dashboard.url("/events")))
            assert stream.status_code == 200
        async with page.expect_response(lambda r: r.url.endswith("/events") and r.status == 429):
            await page.goto(dashboard.url("/jobs"))
        # The dashboard's --refused-retry reaches the page (its next try comes that long after).
        await expect(page.locator("body")).to_have_attribute("data-refused-retry-ms", str(REFUSED_RETRY_S * 1000))
        await expect(page.get_by_test_id("poll-banner")).to_be_visible()
        await expect(page.get_by_test_id("stream-banner")).to_be_hidden()
        await page.evaluate(RECORD_STATES, ["#job-polled-1 [data-testid=job-state]", "state"])
        await dashboard.fed.submit({"job_id": "polled-1", "command": ["true"], "name": "polled"})
        # Refreshed by the page's own timer (every 10 s), without a reload.
        await expect(page.locator("#job-polled-1 [data-testid=job-state]")).to_have_attribute(
            "data-state", "succeeded", timeout=60_000)
        states = await page.evaluate("window.__states")  # still there: the page never reloaded
        assert states and states[-1] == "succeeded", states
    # The held streams are closed: the page's next try (every REFUSED_RETRY_S) is let in.
    await expect(page.get_by_test_id("poll-banner")).to_be_hidden(timeout=90_000)
    await expect(page.get_by_test_id("stream-banner")).to_be_hidden()


# ---------------------------------------------------------------- 7. the screenshot in the docs


async def test_screenshot_of_the_federation_page_with_jobs_running(dashboard: Dashboard, page: Page):
    """Writes docs/dashboard.png when IRISFED_UPDATE_SCREENSHOT=1, else an artifact."""
    fed = dashboard.fed
    running = ["train-resnet", "eval-batch", "gpu-sweep-1"]
    await fed.submit({"job_id": "train-resnet", "command": ["sleep", "30"], "name": "train resnet",
                      "labels": {"team": "vision"}})
    await fed.submit({"job_id": "eval-batch", "command": ["sleep", "30"], "name": "nightly eval",
                      "labels": {"team": "nlp"}})
    await fed.submit({"job_id": "gpu-sweep-1", "command": ["sleep", "30"], "name": "sweep lr=3e-4",
                      "resources": {"gpu": 1, "cpu": 4}, "constraints": GPU})
    await fed.submit({"job_id": "tpu-pretrain", "command": ["true"], "name": "tpu pretrain",
                      "cluster_pin": "tpu-east"})
    for job_id in running:
        await fed.wait_state(job_id, "running")
    try:
        await open_live(page, dashboard.url("/"))
        await expect(page.get_by_test_id("count-running")).to_contain_text("3")
        west = page.locator('[data-testid=peer-row][data-peer-id="gpu-west"]')
        await expect(west.locator('[data-resource="gpu"]')).to_contain_text("1 used, 1 free of 2")
        target = DOCS_SCREENSHOT if update_screenshots() else ARTIFACTS / "dashboard.png"
        target.parent.mkdir(exist_ok=True)
        await page.set_viewport_size({"width": 1280, "height": 720})
        await page.screenshot(path=str(target), full_page=True)
        assert target.stat().st_size > 10_000
    finally:
        for job_id in running:
            await fed.cancel(job_id)
        for job_id in running:
            await fed.wait_state(job_id, "killed")
