"""``irisfed_job_finish_batch`` (rewritten in migration 0012): how a run's ending is
decided, and that the statement finds its jobs by key.

0004's version read each job's stored cancel in a join by owner alone, which Postgres
served from every job the peer ever owned (``jobs_by_owner_newest``) whenever its
statistics lagged; 0012 decides in the update itself. The outcomes must not change.
"""

from __future__ import annotations

import re

from irisfed.services.common.store import Store
from tests.infra.factories import running_job, running_jobs


async def test_each_ending_is_decided_by_exit_code_and_cancels(pool):
    store = Store(pool)
    ok, bad, stored_cancel, cancelled_now, stale, theirs = await running_jobs(store, 6)
    await store.job_request_cancel(stored_cancel)
    moved = await store.job_finish_batch("gpu-west", [
        (ok, 1, 0, False), (bad, 1, 3, False), (stored_cancel, 1, 0, False), (cancelled_now, 1, 137, True),
        (stale, 2, 0, False)])
    assert {job_id: (m.state, m.reason) for job_id, m in moved.items()} == {
        ok: ("succeeded", "exit code 0"), bad: ("failed", "exit code 3"),
        stored_cancel: ("killed", "cancelled by request"), cancelled_now: ("killed", "cancelled by request")}
    rows = {job_id: await store.job_get(job_id) for job_id in (ok, bad, stored_cancel, cancelled_now, stale)}
    assert {job_id: (r.state, r.exit_code) for job_id, r in rows.items()} == {
        ok: ("succeeded", 0), bad: ("failed", 3), stored_cancel: ("killed", 0), cancelled_now: ("killed", 137),
        stale: ("running", None)}
    assert all(rows[j].finished_at is not None for j in (ok, bad, stored_cancel, cancelled_now))
    # History and sync state in the same statement, in the peer's own name.
    for job_id in moved:
        last = (await store.changelog_list_for_job(job_id))[-1]
        assert (last.from_state, last.to_state, last.actor, last.epoch) == ("running", moved[job_id].state,
                                                                            "gpu-west", 1)
    # Another peer's job is not this peer's to finish, and a second report moves nothing.
    assert await store.job_finish_batch("tpu-east", [(theirs, 1, 0, False)]) == {}
    assert await store.job_finish_batch("gpu-west", [(ok, 1, 0, False)]) == {}


async def test_the_finish_reads_jobs_only_in_its_compare_and_set(pool):
    body = await pool.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'irisfed_job_finish_batch'")
    assert re.findall(r"\b(?:FROM|JOIN|UPDATE)\s+jobs\b", body, re.I) == ["UPDATE jobs"]
    assert re.search(r"jobs\.state\s*=\s*'running'", body) and re.search(r"owner_peer_id\s*=\s*p_peer", body)


async def test_a_failure_with_failure_retries_left_goes_back_to_the_queue_and_a_cancel_still_kills(pool):
    """docs/design.md §3.7: a non-zero exit runs again (new epoch, no owner, failures + 1)
    while ``max_failure_retries`` allows; a stored cancel or a success is never retried."""
    store = Store(pool)
    retried = await running_job(store, "gpu-west", max_failure_retries=1)
    cancelled = await running_job(store, "gpu-west", max_failure_retries=5)
    succeeded = await running_job(store, "gpu-west", max_failure_retries=5)
    await store.job_request_cancel(cancelled)
    moved = await store.job_finish_batch("gpu-west", [(retried, 1, 2, False), (cancelled, 1, 1, False),
                                                      (succeeded, 1, 0, False)])
    assert {j: (m.state, m.reason) for j, m in moved.items()} == {
        retried: ("queued", "exit code 2; running again (failure retry 1 of 1)"),
        cancelled: ("killed", "cancelled by request"), succeeded: ("succeeded", "exit code 0")}
    row = await store.job_get(retried)
    assert (row.epoch, row.owner_peer_id, row.backend, row.failures, row.exit_code, row.finished_at) == (
        2, None, None, 1, 2, None)
    last = (await store.changelog_list_for_job(retried))[-1]
    assert (last.from_state, last.to_state, last.epoch) == ("running", "queued", 2)
    # Its second run fails too: out of failure retries, it fails, saying so.
    async with store.transaction() as tx:
        await tx.job_assign_batch([(retried, 2, "gpu-west", "main")])  # the tick places it again
    assert retried in await store.job_start_batch("gpu-west", [(retried, 3, None, "running")])
    moved = await store.job_finish_batch("gpu-west", [(retried, 3, 2, False)])
    assert (moved[retried].state, moved[retried].reason) == ("failed", "exit code 2; no failure retries left")
    row = await store.job_get(retried)
    assert (row.attempts, row.failures, row.owner_peer_id) == (2, 1, "gpu-west")
