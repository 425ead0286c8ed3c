"""The Users view (docs/design.md §3.2) in a real browser (headless Chromium over CDP)
against a real federation with configured users: each user's live usage against its
quota, weight, share and counts; a job waiting for its user's quota; an operator
cancelling a user's job by its stored id (through the web's own NATS user, which may
publish only on ``operator.cancel``), the Users view following live; hostile user ids
shown as text and never run.

Every test fails on any console or page error (the ``page`` fixture; a CSP violation
is one), and leaves a screenshot in tests/browser/artifacts/.
"""

from __future__ import annotations

import re

import msgspec
import pytest
from playwright.async_api import Page, expect

from irisfed.services.common.store import Store
from tests.browser.conftest import ARTIFACTS, Dashboard
from tests.infra.factories import insert_jobs, make_job
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
SCRIPT = "<script>window.__pwned=1</script>"
ATTRIBUTE = '"><img src=x onerror="window.__pwned=2">'


@pytest.fixture
def federation_users() -> str:
    """alice may hold one GPU at a time and weighs twice; bob weighs half; carol has nothing live."""
    return """
[[users]]
id = "alice"
weight = 2.0
max_band = "production"
quota = { gpu = 1 }

[[users]]
id = "bob"
weight = 0.5

[[users]]
id = "carol"
quota = { cpu = 2 }
"""


async def open_live(page: Page, url: str):
    """Open ``url`` and wait until its live-update stream (/events) is connected."""
    async with page.expect_response(lambda r: r.url.endswith("/events") and r.status == 200):
        response = await page.goto(url)
    return response


async def submit_as(dashboard: Dashboard, user: str, body: dict) -> dict:
    """Submit as ``user`` (on ``<prefix>.submit.<user>``: the test's NATS user may publish anywhere)."""
    fed = dashboard.fed
    return await wait_for(lambda: fed.request(f"submit.{user}", body), f"{user}'s submit reply")


async def hostile_user_job(store: Store, job_id: str, user_id: str) -> None:
    """A queued job of a user no configuration could name, written by hand; pinned to
    tpu-east (never started), it waits."""
    job = msgspec.structs.replace(make_job(pin="tpu-east", job_id=job_id), user_id=user_id)
    await insert_jobs(store, [job])


def row(page: Page, user_id: str):
    """The Users view's row of ``user_id`` (found by its link's text, whatever characters it has)."""
    return page.get_by_test_id("user-row").filter(has=page.get_by_role("link", name=user_id, exact=True))


async def test_the_users_view_shows_usage_against_quotas_follows_live_and_shows_hostile_ids_as_text(
        dashboard: Dashboard, page: Page):
    fed = dashboard.fed
    sleep = ["sleep", "120"]
    first = await submit_as(dashboard, "alice", {"job_id": "gpu-a", "command": sleep, "resources": {"gpu": 1},
                                                 "constraints": GPU})
    assert first["disposition"] == "queue" and first["job_id"] == "gpu-a", first
    await fed.wait_state("alice:gpu-a", "running")
    second = await submit_as(dashboard, "alice", {"job_id": "gpu-b", "command": sleep, "resources": {"gpu": 1},
                                                  "constraints": GPU})
    assert second["state"] == "queued", second  # alice's quota is full: it waits
    await submit_as(dashboard, "bob", {"job_id": "cpu-1", "command": sleep, "cluster_pin": "home"})
    await fed.wait_state("bob:cpu-1", "running")
    await hostile_user_job(fed.store, "odd-1", SCRIPT)
    await hostile_user_job(fed.store, "odd-2", ATTRIBUTE)

    # The waiting job's page says why: its user's quota.
    await open_live(page, dashboard.url("/jobs/alice:gpu-b"))
    await expect(page.get_by_test_id("job-user")).to_contain_text("alice")
    await expect(page.get_by_test_id("job-sent-id")).to_have_text("gpu-b")
    await expect(page.get_by_test_id("waiting")).to_have_attribute("data-wait", "quota")
    await expect(page.get_by_test_id("waiting")).to_contain_text(
        "waiting: quota — quota: this job's 1 gpu would take alice over its quota of 1 gpu")

    # The Users view, from the navigation.
    users = await page.context.new_page()
    await open_live(users, dashboard.url("/"))
    async with users.expect_navigation():
        await users.get_by_test_id("nav-users").click()
    await expect(users.get_by_test_id("nav-users")).to_have_attribute("aria-current", "page")
    rows = users.get_by_test_id("user-row")
    await expect(rows).to_have_count(5)
    assert await rows.evaluate_all("rs => rs.map(r => r.dataset.userId)") == sorted(
        [ATTRIBUTE, SCRIPT, "alice", "bob", "carol"])
    await expect(users.get_by_test_id("federation-totals")).to_contain_text("slots 4, cpu 20, gpu 2, memory 72.0 GiB")

    alice = row(users, "alice")
    await expect(alice.locator("[data-resource=gpu] [data-testid=user-usage-amount]")).to_have_text("1 / 1")
    await expect(alice.locator("[data-resource=cpu] [data-testid=user-usage-amount]")).to_have_text("1 / —")
    await expect(alice.get_by_test_id("user-weight")).to_have_text("2")
    await expect(alice.get_by_test_id("user-share")).to_have_text("25.0%")  # gpu 1 of 2, halved
    await expect(alice.get_by_test_id("user-queued")).to_have_text("1")
    await expect(alice.get_by_test_id("user-live")).to_have_text("1")
    await expect(alice.get_by_test_id("user-max-band")).to_have_text("production")
    bob = row(users, "bob")
    await expect(bob.locator("[data-resource=cpu] [data-testid=user-usage-amount]")).to_have_text("1 / —")
    await expect(bob.get_by_test_id("user-share")).to_have_text("50.0%")  # slots 1 of 4, doubled
    await expect(bob.get_by_test_id("user-live")).to_have_text("1")
    carol = row(users, "carol")
    await expect(carol.locator("[data-resource=cpu] [data-testid=user-usage-amount]")).to_have_text("0 / 2")
    await expect(carol.get_by_test_id("user-share")).to_have_text("0.0%")

    # Hostile ids: text in their rows, never markup, never run.
    for hostile in (SCRIPT, ATTRIBUTE):
        odd = row(users, hostile)
        await expect(odd.get_by_test_id("user-queued")).to_have_text("1")
        await expect(odd.get_by_test_id("user-unconfigured")).to_be_visible()
    assert await users.evaluate("typeof window.__pwned") == "undefined"
    await expect(users.locator("main img")).to_have_count(0)
    await expect(users.locator("main script")).to_have_count(0)

    # Its jobs, one click away.
    jobs = await page.context.new_page()
    await jobs.goto(dashboard.url("/users"))
    async with jobs.expect_navigation():
        await row(jobs, "alice").get_by_test_id("user-jobs").click()
    assert re.search(r"/jobs\?user=alice$", jobs.url), jobs.url
    await expect(jobs.get_by_test_id("filter-user")).to_have_value("alice")
    assert await jobs.get_by_test_id("job-row").evaluate_all("rs => rs.map(r => r.dataset.jobId)") == [
        "alice:gpu-b", "alice:gpu-a"]
    await jobs.goto(dashboard.url("/jobs"))
    await expect(jobs.locator('[data-job-id="odd-1"] [data-testid=job-user]')).to_have_text(SCRIPT)
    await expect(jobs.locator('[data-job-id="odd-2"] [data-testid=job-user]')).to_have_text(ATTRIBUTE)
    assert await jobs.evaluate("typeof window.__pwned") == "undefined"
    await expect(jobs.locator("main img")).to_have_count(0)
    await jobs.close()

    # An operator cancels alice's running job from its page: gpu-b takes its GPU, and the
    # Users view follows without a reload.
    await users.evaluate("() => { window.__kept = 'yes'; }")
    await page.goto(dashboard.url("/login"))
    await page.get_by_test_id("login-token").fill(dashboard.token)
    async with page.expect_navigation(url=dashboard.url("/")):
        await page.get_by_test_id("login-submit").click()
    await open_live(page, dashboard.url("/jobs/alice:gpu-a"))
    async with page.expect_navigation(url=re.compile(r"/jobs/alice:gpu-a\?cancel=")):
        await page.get_by_test_id("cancel-button").click()
    await expect(page.get_by_test_id("cancel-outcome")).to_contain_text("Cancel:")
    await expect(page.get_by_test_id("job-state")).to_have_attribute("data-state", "killed")
    await expect(page.get_by_test_id("cancel-requested-by")).to_have_text("operator (web)")
    assert (await fed.job("alice:gpu-a")).cancel_requested_by == "operator (web)"

    await fed.wait_state("alice:gpu-b", "running")
    await expect(alice.get_by_test_id("user-queued")).to_have_text("0")
    await expect(alice.get_by_test_id("user-live")).to_have_text("1")
    await expect(alice.locator("[data-resource=gpu] [data-testid=user-usage-amount]")).to_have_text("1 / 1")
    assert await users.evaluate("window.__kept") == "yes"  # updated live: never reloaded
    assert await users.evaluate("typeof window.__pwned") == "undefined"
    ARTIFACTS.mkdir(exist_ok=True)
    await users.screenshot(path=str(ARTIFACTS / "users.png"), full_page=True)  # to look at, never compared
    await users.close()

    for user, job_id in (("alice", "gpu-b"), ("bob", "cpu-1")):
        await fed.request(f"cancel.{user}", {"job_id": job_id})
    for job_id in ("alice:gpu-b", "bob:cpu-1"):
        await fed.wait_state(job_id, "killed")
