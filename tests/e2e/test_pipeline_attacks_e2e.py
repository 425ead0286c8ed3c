"""Attacks on pipelines (docs/design.md §3.8) through real router, tick and agent
processes: a cancel of an array that takes its time while its elements keep ending, and
the tick's listening connection killed under it.

Each pins what an attack tried and the system withstood.
"""

from __future__ import annotations

import asyncpg
import pytest

from tests.infra.configs import make_peer
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

ENDED = ("succeeded", "failed", "killed", "rejected", "unschedulable")
LISTENERS = "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()"


async def _states(federation, base: str, size: int) -> dict[str, str]:
    return {f"{base}_{i}": (await federation.job(f"{base}_{i}")).state for i in range(size)}


async def test_no_element_starts_after_its_arrays_cancel_was_asked(federation, tmp_path):
    federation.configure([make_peer("home", "cpu", 4)])
    await federation.start_federation("home")
    go = tmp_path / "go"
    # Element 0 runs until the test says; the others would run a minute.
    command = ["sh", "-c", f'if [ "$IRISFED_ARRAY_INDEX" = 0 ]; then while [ ! -f {go} ]; do sleep 0.1; done; '
                           'else sleep 60; fi']
    reply = await federation.submit({"job_id": "w", "array": 5, "array_parallel": 1, "command": command})
    assert reply["state"] == "queued", reply
    await federation.wait_state("w_0", "running")
    # A slow row (here: locked, as a hung statement would hold it) stalls the cancel's one
    # statement killing the queued elements, at w_2, w_1 (the next held) locked already.
    conn = await asyncpg.connect(federation.database_url)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.fetch("SELECT 1 FROM jobs WHERE job_id = 'w_2' FOR UPDATE")
        answer = await federation.request("cancel", {"job_id": "w"}, timeout=15)
        assert answer is not None and answer["error"]["code"] == "unavailable", answer
        assert (await federation.job("w_3")).state == "queued"  # one statement: all of them or none yet
        go.write_text("")  # the running element ends by itself, the cancel asked and in progress
        await federation.wait_state("w_0", *ENDED)
        try:  # what the tick does with the slot it freed
            await federation.wait_state("w_1", "assigned", "running", timeout=10)
        except AssertionError:
            pass
        await tx.rollback()
    finally:
        await conn.close()
    # The database did not answer in time: a client asks again (irisfed.connection does).
    again = await federation.cancel("w")
    assert again["job_id"] == "w" and "error" not in again, again
    states = {job: (await federation.wait_state(job, *ENDED, timeout=60)).state
              for job in (f"w_{i}" for i in range(5))}
    assert states == {"w_0": "succeeded", "w_1": "killed", "w_2": "killed", "w_3": "killed", "w_4": "killed"}
    history = [row.to_state for row in await federation.store.changelog_list_for_job("w_1")]
    assert "assigned" not in history and "running" not in history, history


async def test_releases_are_still_placed_after_the_ticks_listener_is_killed(federation):
    federation.configure([make_peer("home", "cpu", 4)])
    await federation.start_federation("home")
    await wait_for(lambda: federation.store.db.fetchval(LISTENERS), "the tick to listen")
    pid = await federation.store.db.fetchval(LISTENERS)
    assert await federation.store.db.fetchval("SELECT pg_terminate_backend($1)", pid)
    reply = await federation.submit({"job_id": "after-kill", "array": 3, "array_parallel": 1,
                                     "command": ["sleep", "0.2"]})
    assert reply["state"] == "queued", reply
    then = await federation.submit({"job_id": "then", "command": ["true"], "after": [{"job_id": "after-kill"}]})
    assert then["state"] == "queued", then
    states = {job: (await federation.wait_state(job, *ENDED, timeout=60)).state
              for job in ("after-kill_0", "after-kill_1", "after-kill_2", "then")}
    assert set(states.values()) == {"succeeded"}, states


async def test_the_tick_process_listens_again_after_its_listener_is_killed(federation):
    federation.configure([make_peer("home", "cpu", 4)])
    await federation.start_federation("home")
    await wait_for(lambda: federation.store.db.fetchval(LISTENERS), "the tick to listen")
    pid = await federation.store.db.fetchval(LISTENERS)
    assert await federation.store.db.fetchval("SELECT pg_terminate_backend($1)", pid)

    async def listening_again() -> bool:
        now = await federation.store.db.fetchval(LISTENERS)
        return now is not None and now != pid

    try:
        await wait_for(listening_again, "the tick to listen again", timeout=15)
    finally:
        failures = federation.log("tick").count("loop_step_failed")
    assert failures == 0, f"{failures} loop_step_failed lines in the tick's log"

