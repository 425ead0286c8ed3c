"""Arrays in Postgres (migration 0020): the router's one transaction, held elements
released one per ended element that held a slot, two ends at once releasing two, and an
`after` naming an array (docs/design.md §3.8)."""

from __future__ import annotations

import asyncio

import asyncpg
import msgspec
import pytest

from irisfed.services.common.store import Store
from irisfed.services.router.arrays import insert_array
from irisfed.services.router.dependencies import insert_with_dependencies
from irisfed.services.router.plan import plan_new_job, route
from irisfed.shared.errors import Conflict, InvalidRequest
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import assign_jobs, start_jobs
from tests.infra.waiting import wait_for

QUEUE = route(SubmitPlan(SubmitDisposition.QUEUE, reason="test"), "home", None)
FINISH = "SELECT * FROM irisfed_job_finish_batch('gpu-west', $1::text[], '{1}', '{0}', '{false}')"


def _request(**fields) -> SubmitRequest:
    return msgspec.convert({"command": ["true"], **fields}, SubmitRequest)


async def _held(pool) -> dict[str, tuple[bool, int]]:
    rows = await pool.fetch("SELECT job_id, array_held, deps_pending FROM jobs WHERE array_id IS NOT NULL")
    return {r["job_id"]: (r["array_held"], r["deps_pending"]) for r in rows}


async def test_held_elements_are_released_one_per_slot_freed_even_by_two_ends_at_once(pool, database_url):
    store = Store(pool)
    jobs, reply = await insert_array(store, _request(job_id="sw", array=5, array_parallel=2), QUEUE, "sw", "default")
    assert b'"reason":"array of 5 jobs sw_0' in reply and [j.job_id for j in jobs] == [f"sw_{i}" for i in range(5)]
    assert await _held(pool) == {"sw_0": (False, 0), "sw_1": (False, 0), "sw_2": (True, 1), "sw_3": (True, 1),
                                 "sw_4": (True, 1)}
    assert (await store.job_get("sw_3")).reason == "waiting for a slot of array sw (2 live at once)"
    assert dict(await pool.fetch("SELECT job_id, spec->'env'->>'IRISFED_ARRAY_INDEX' FROM jobs "
                                 "WHERE array_id = 'sw'")) == {f"sw_{i}": str(i) for i in range(5)}
    await assign_jobs(store, jobs[:2], "gpu-west")
    await start_jobs(store, jobs[:2], "gpu-west")
    # A held element cancelled frees no slot it never had.
    await store.job_move(Move("sw_4", JobState.QUEUED, JobState.KILLED, 0, actor="router", owner_peer_id=None))
    assert (await _held(pool))["sw_2"] == (True, 1)
    # Two ends at once: the second waits for the first's release, then takes the next one.
    first, second = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        tx = first.transaction()
        await tx.start()
        await first.fetch(FINISH, ["sw_0"])
        other = asyncio.ensure_future(second.fetch(FINISH, ["sw_1"]))
        waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
        await wait_for(lambda: pool.fetchval(waiting, second.get_server_pid()), "the second end to wait")
        await tx.commit()
        await asyncio.wait_for(other, 30)
    finally:
        await first.close()
        await second.close()
    held = await _held(pool)
    assert (held["sw_2"], held["sw_3"]) == ((False, 0), (False, 0)), held
    assert (await store.job_get("sw_2")).reason == ""
    await assert_changelog_replays(store)


async def test_the_whole_submit_is_one_check(pool):
    store = Store(pool)
    request = _request(job_id="a", array=3)
    written, _ = await insert_array(store, request, QUEUE, "a", "default")
    again, reply = await insert_array(store, request, QUEUE, "a", "default")
    assert (len(written), again) == (3, []) and b'"duplicate":true' in reply
    with pytest.raises(Conflict, match="already names an array with a different spec"):
        await insert_array(store, _request(job_id="a", array=4), QUEUE, "a", "default")
    plain, _ = plan_new_job(_request(job_id="b_2"), QUEUE, "b_2")
    async with store.transaction() as tx:
        await tx.job_insert_batch([plain])
    with pytest.raises(Conflict, match="'b_2' already names a job"):
        await insert_array(store, _request(job_id="b", array=3), QUEUE, "b", "default")
    assert await store.job_get("b_0") is None and await store.job_array_get("b") is None
    with pytest.raises(Conflict, match="'b_2' already names a job; an array needs"):
        await insert_array(store, _request(job_id="b_2", array=2), QUEUE, "b_2", "default")


async def test_after_an_array_waits_for_each_of_its_jobs_and_counts_the_edges(pool):
    store = Store(pool)
    await insert_array(store, _request(job_id="m", array=3), QUEUE, "m", "default")
    request = _request(job_id="after-m", after=[{"job_id": "m", "when": "any"}, {"job_id": "m_1"}])
    job, reply = plan_new_job(request, QUEUE, "after-m")
    written, _ = await insert_with_dependencies(store, request, job, reply, "default")
    assert written.reason.startswith("waiting for its dependencies: m_1 (queued), m_0 (queued), m_2 (queued)")
    edges = dict(await pool.fetch("SELECT needs, condition FROM job_dependencies WHERE job_id = 'after-m'"))
    assert edges == {"m_0": "any", "m_1": "ok", "m_2": "any"}
    assert await pool.fetchval("SELECT deps_pending FROM jobs WHERE job_id = 'after-m'") == 3
    # An array after an array: each of its jobs waits for each of the other's.
    await insert_array(store, _request(job_id="n", array=2, after=[{"job_id": "m"}]), QUEUE, "n", "default")
    assert await pool.fetchval("SELECT count(*) FROM job_dependencies WHERE job_id LIKE 'n\\_%'") == 6
    assert await pool.fetchval("SELECT deps_pending FROM jobs WHERE job_id = 'n_1'") == 3
    await insert_array(store, _request(job_id="w", array=11), QUEUE, "w", "default")
    with pytest.raises(InvalidRequest, match="after: 10,000 jobs waiting for 11 each make 110,000 dependencies; "
                                             "at most 100,000 in one submit"):
        await insert_array(store, _request(job_id="big", array=10_000, after=[{"job_id": "w"}]), QUEUE, "big",
                           "default")
    assert await store.job_array_get("big") is None
