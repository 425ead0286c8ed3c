"""The dashboard and bands (docs/design.md §3.3), against the real Postgres and NATS of the
test session: each job's band on the Jobs page (and how often it was preempted), a job
page's band and preemptions, its history naming who preempted it and on which peer (a
link to that job), the preempting job's victims, and a waiting job's ``cannot preempt``.
Preemptions are written with the tick's own statements."""

from __future__ import annotations

import html
import re

from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from tests.infra.factories import assign_jobs, insert_jobs, preempt, start_jobs, user_job
from tests.infra.web import client_for, job_ids, running_web

USERS = [{"id": "alice", "max_band": "production"}, {"id": "bob", "max_band": "batch"}]


def row_of(page: str, job_id: str) -> str:
    return page.split(f'data-job-id="{job_id}"', 1)[1].split("</tr>", 1)[0]


def text_of(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


async def test_jobs_and_job_pages_show_bands_preemptions_and_who_preempted(pool, nats_client, subject_prefix):
    store = Store(pool)
    victims = [user_job("bob", "batch-1", band="batch"), user_job("bob", "batch-2", band="batch")]
    await insert_jobs(store, victims)
    await assign_jobs(store, victims, "gpu-west")
    await start_jobs(store, victims, "gpu-west")
    urgent = user_job("alice", "urgent-1", band="production", max_preemptions=5)
    await insert_jobs(store, [urgent, user_job("default", "plain-1")])
    await preempt(store, victims, urgent)

    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        page = (await client.get("/jobs")).text
        assert "<th>state</th><th>band</th><th>peer</th>" in page
        assert set(job_ids(page)) == {"bob:batch-1", "bob:batch-2", "alice:urgent-1", "plain-1"}
        assert '<td data-testid="job-band" data-band="batch">batch <span' in row_of(page, "bob:batch-1")
        assert "preempted 1×" in row_of(page, "bob:batch-1")
        assert ('<td data-testid="job-band" data-band="production">production</td>'
                in row_of(page, "alice:urgent-1"))
        assert 'data-band="interactive"' in row_of(page, "plain-1")

        page = (await client.get("/jobs/bob:batch-1")).text
        assert '<dd data-testid="job-band" data-band="batch">batch</dd>' in page
        assert 'data-testid="job-preemptions" data-preemptions="1">1 ' in page
        assert "(after 100, the next preemption fails it)" in page
        steps = page.split('data-testid="timeline-entry"')[1:]
        assert 'data-to-state="queued"' in steps[-1]
        said = steps[-1].split('data-testid="preempted-by"', 1)[1].split("</span>", 1)[0]
        assert 'data-by="alice:urgent-1"' in said and 'href="/jobs/alice:urgent-1"' in said
        assert text_of(said.split(">", 1)[1]) == "preempted by alice:urgent-1 on gpu-west"
        assert "by tick" in steps[-1]
        stopping = page.split('data-testid="stopping-on">', 1)[1].split("</dd>", 1)[0]
        assert text_of(stopping).startswith("gpu-west to stop its preempted run")
        await store.job_runs_stopped("gpu-west", ["bob:batch-1"])
        assert 'data-testid="stopping-on"' not in (await client.get("/jobs/bob:batch-1")).text

        page = (await client.get("/jobs/alice:urgent-1")).text
        assert '<dd data-testid="job-band" data-band="production">production</dd>' in page
        assert 'data-preemptions="0"' in page and "(after 5," in page
        said = page.split('data-testid="preempting"', 1)[1].split("</span>", 1)[0]
        assert 'href="/jobs/bob:batch-1"' in said and 'href="/jobs/bob:batch-2"' in said
        assert text_of(said.split(">", 1)[1]) == "placed; preempted bob:batch-1, bob:batch-2"
        placed = page.split('data-testid="placed"', 1)[1].split("</p>", 1)[0]
        assert text_of(placed.split(">", 1)[1]) == (
            "Placed on gpu-west at epoch 1 (tick), preempting bob:batch-1, bob:batch-2.")

        page = (await client.get("/jobs/plain-1")).text
        assert 'data-band="interactive"' in page and 'data-preemptions="0"' in page
        assert "preempted-by" not in page and 'data-testid="preempting"' not in page


async def test_a_waiting_jobs_cannot_preempt_is_on_its_page(pool, nats_client, subject_prefix):
    store = Store(pool)
    waiting = user_job("bob", "batch-9", band="batch")
    await insert_jobs(store, [waiting])
    rule = "no_free_capacity: gpu-west is full; cannot preempt: gpu-west runs only production jobs"
    await store.job_explain_batch([(waiting.job_id, explanation("tick", rule), rule)])
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        page = (await client.get("/jobs/bob:batch-9")).text
        why = page.split('data-testid="explain"', 1)[1].split("</p>", 1)[0]
        assert "; cannot preempt: gpu-west runs only production jobs" in text_of(why)


async def test_a_hostile_preemptor_in_a_history_is_escaped(pool, nats_client, subject_prefix):
    """Only the tick writes these rows, but the page never trusts a stored string."""
    store = Store(pool)
    victim = user_job("bob", "batch-1", band="batch")
    await insert_jobs(store, [victim])
    hostile = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
    await pool.execute(
        "INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail) "
        "VALUES ($1, 'running', 'queued', NULL, 2, 'tick', $2), ($1, 'queued', 'assigned', 'gpu-west', 3, 'tick', $3)",
        victim.job_id, f"preempted by {hostile}; {hostile}", f"placed; preempted {hostile}, b")
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        page = (await client.get("/jobs/bob:batch-1")).text
        assert "<script>alert" not in page and "<img src=x" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        said = page.split('data-testid="preempted-by"', 1)[1].split("</span>", 1)[0]
        assert 'href="/jobs/%3Cscript%3E' in said  # a link under /jobs/, its id quoted
        assert 'data-testid="preempting"' in page


async def test_a_gangs_page_lists_its_tasks_and_escapes_what_its_peer_wrote(pool, nats_client, subject_prefix):
    store = Store(pool)
    gang = user_job("alice", "train-4", replicas=3, coschedule={"group_by": "slice"})
    single = user_job("alice", "single-1")
    await insert_jobs(store, [gang, single])
    await assign_jobs(store, [gang], "gpu-west")
    await start_jobs(store, [gang], "gpu-west")
    hostile = '<script>alert("x")</script>'
    await store.job_tasks_report("gpu-west", [
        (gang.job_id, 1, 0, "n0", "running", None, "/work/t0"),
        (gang.job_id, 1, 1, hostile, "running", None, None),
        (gang.job_id, 1, 2, "n2", "failed", 3, "/work/t2")])
    async with running_web(pool, nats_client, subject_prefix, users=USERS) as web, client_for(web) as client:
        page = (await client.get("/jobs/alice:train-4")).text
        tasks = page.split('data-testid="tasks"', 1)[1].split("</section>", 1)[0]
        assert "(3, sharing one slice; epoch 1)" in text_of(tasks)
        rows = tasks.split('data-testid="task"')[1:]
        assert [r.split('data-task-state="', 1)[1].split('"', 1)[0] for r in rows] == ["running", "running", "failed"]
        assert hostile not in page and "&lt;script&gt;alert(" in tasks
        assert 'data-testid="tasks"' not in (await client.get("/jobs/alice:single-1")).text
