"""Dependencies in Postgres (migration 0019): what a job's end does to its dependents,
whoever ends it, and a submit racing a dependency's end (docs/design.md §3.8)."""

from __future__ import annotations

import asyncio

import asyncpg
import msgspec

from irisfed.services.common.store import Store
from irisfed.services.router.dependencies import insert_with_dependencies
from irisfed.services.router.plan import plan_new_job, route, waiting_for_dependencies
from irisfed.shared.dependencies import broken_reason, outcome, settle
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.messages import SubmitRequest
from irisfed.shared.records import NewJob
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import running_job
from tests.infra.probes import returns
from tests.infra.waiting import wait_for

CLAIM = "SELECT job_id FROM jobs WHERE state = 'queued' AND deps_pending = 0 AND job_id = ANY($1::text[])"


def _planned(job_id: str, after: list[dict]) -> tuple[SubmitRequest, NewJob, bytes]:
    request = msgspec.convert({"command": ["true"], "job_id": job_id, "after": after}, SubmitRequest)
    job, reply = plan_new_job(request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="test"), "home", None),
                              job_id)
    return request, job, reply


async def _submit(store: Store, job_id: str, after: list[dict]):
    request, job, reply = _planned(job_id, after)
    return await insert_with_dependencies(store, request, job, reply, "default")


async def test_an_end_releases_met_dependents_and_breaks_the_others_down_the_chain(pool):
    store = Store(pool)
    dep = await running_job(store, "gpu-west")
    await _submit(store, "needs-ok", [{"job_id": dep}])
    await _submit(store, "needs-any", [{"job_id": dep, "when": "any"}])
    await _submit(store, "needs-failed", [{"job_id": dep, "when": "failed"}])
    await _submit(store, "grandchild", [{"job_id": "needs-failed"}])
    await _submit(store, "two", [{"job_id": dep, "when": "any"}, {"job_id": "needs-any", "when": "any"}])
    rows = {r["job_id"]: r["deps_pending"] for r in await pool.fetch("SELECT job_id, deps_pending FROM jobs "
                                                                      "WHERE deps_pending > 0")}
    assert rows == {"needs-ok": 1, "needs-any": 1, "needs-failed": 1, "grandchild": 1, "two": 2}
    await store.job_finish_batch("gpu-west", [(dep, 1, 0, False)])  # the agent's own statement ends it
    states = {r["job_id"]: (r["state"], r["deps_pending"], r["reason"]) for r in await pool.fetch(
        "SELECT job_id, state, deps_pending, reason FROM jobs WHERE job_id = ANY($1::text[])",
        ["needs-ok", "needs-any", "needs-failed", "grandchild", "two"])}
    assert states["needs-ok"][:2] == ("queued", 0) and states["needs-any"][:2] == ("queued", 0)
    assert states["two"][:2] == ("queued", 1)  # one of its two has ended
    assert states["needs-failed"] == ("unschedulable", 0, broken_reason(dep, "succeeded", "failed"))
    assert states["grandchild"] == ("unschedulable", 0, broken_reason("needs-failed", "unschedulable", "ok"))
    assert {r["job_id"] for r in await pool.fetch(CLAIM, list(states))} == {"needs-ok", "needs-any"}
    last = (await store.changelog_list_for_job("grandchild"))[-1]
    assert (last.from_state, last.to_state, last.actor) == ("queued", "unschedulable", "dependency")
    await assert_changelog_replays(store)


def test_the_sql_rule_and_the_python_rule_agree():
    for when in ("ok", "any", "failed"):
        for state in ("succeeded", "failed", "killed", "rejected", "unschedulable", "running"):
            assert outcome(when, state) in ("met", "broken", "pending")
    assert outcome("ok", "succeeded") == "met" and outcome("failed", "killed") == "met"
    assert outcome("failed", "succeeded") == "broken" and outcome("any", "running") == "pending"


async def test_a_dependency_ending_while_its_dependent_is_submitted_never_strands_it(pool, database_url):
    """Forced interleaving: the submit has locked the dependency and counted it pending
    when the end comes; the end waits for the submit's commit, then releases the
    dependent. And the other way round: an end committed first is read as ended."""
    store = Store(pool)
    dep = await running_job(store, "gpu-west")
    request, job, reply = _planned("racer", [{"job_id": dep}])
    ender = await asyncpg.connect(database_url)
    try:
        async with store.transaction() as tx:
            states = await tx.job_dependencies_lock([dep])
            assert states == {dep: "running"}
            end = asyncio.ensure_future(ender.fetch(
                "SELECT * FROM irisfed_job_finish_batch('gpu-west', $1::text[], '{1}', '{0}', '{false}')", [dep]))
            waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
            await wait_for(lambda: pool.fetchval(waiting, ender.get_server_pid()), "the end to wait for the lock")
            assert not end.done()  # it waits for the submit's lock
            settled = settle([(dep, dep, "ok")], states)
            job, reply = waiting_for_dependencies(job, settled)
            await tx.job_insert_batch([job])
            await tx.job_dependencies_insert(job.job_id, [(dep, "ok")], settled.pending)
        await asyncio.wait_for(end, 30)
    finally:
        await ender.close()
    row = await store.job_get("racer")
    assert (row.state, await pool.fetchval("SELECT deps_pending FROM jobs WHERE job_id = 'racer'")) == ("queued", 0)
    # Ended first: the submit reads it as ended and waits for nothing.
    written, _ = await _submit(store, "after-the-end", [{"job_id": dep}])
    assert written.state == "queued" and await pool.fetchval(
        "SELECT deps_pending FROM jobs WHERE job_id = 'after-the-end'") == 0


async def test_an_end_that_releases_a_dependent_wakes_the_tick_at_once(pool):
    """Postgres notifies ``irisfed_released`` at the commit that released a job; the tick
    listens, so the job is placed now, not at its next interval (an hour here)."""
    from irisfed.services.tick.service import Tick
    from tests.infra.factories import advertise, make_config

    store = Store(pool)
    await advertise(store, "gpu-west", slots=4, ttl_s=3600, device_type="gpu")
    dep = await running_job(store, "gpu-west")
    await _submit(store, "released", [{"job_id": dep}])
    tick = Tick(make_config(tick_interval_s=3600, heartbeat_ttl_s=3600), pool, None)
    try:
        await tick.start()
        await wait_for(lambda: returns(tick.released is not None and tick.passes >= 1), "the tick to listen")
        passes = tick.passes
        assert (await store.job_get("released")).state == "queued"
        await store.job_finish_batch("gpu-west", [(dep, 1, 0, False)])
        await wait_for(lambda: _state_is(store, "released", "assigned"), "the released job to be placed")
        assert tick.passes > passes
    finally:
        await tick.close()


async def _state_is(store: Store, job_id: str, state: str) -> bool:
    return (await store.job_get(job_id)).state == state
