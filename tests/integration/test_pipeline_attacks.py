"""Attacks on pipelines (docs/design.md §3.8, invariant 16): a hostile-but-legitimate user
and a chaos monkey against arrays and ``after``, on real Postgres and nats-server.

Each pins what an attack tried and the system withstood.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import asyncpg
import msgspec
import pytest

from irisfed.services.common.store import Store
from irisfed.services.router.arrays import insert_array
from irisfed.services.router.plan import route
from irisfed.shared.errors import Conflict
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import advertise, assign_jobs, make_config, start_jobs, user_job
from tests.infra.probes import returns
from tests.infra.routers import RouterThread
from tests.infra.waiting import wait_for

USERS = [{"id": "alice"}, {"id": "bob"}]
QUEUE = route(SubmitPlan(SubmitDisposition.QUEUE, reason="test"), "home", None)
CLAIMABLE = "SELECT job_id FROM jobs WHERE state = 'queued' AND deps_pending = 0 AND array_id = $1 ORDER BY 1"
LOCK_WAIT = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"


@pytest.fixture
def routed(database_url, servers):
    """A router serving alice and bob (and ``default``), with two peers advertising."""
    running = RouterThread(database_url, servers.nats_url, users=USERS)
    store = Store(running.pool)
    running.run(advertise(store, "home", slots=2, ttl_s=3600, device_type="cpu"))
    running.run(advertise(store, "gpu-west", slots=2, ttl_s=3600, device_type="gpu"))
    running.run(running.router.refresh_view())
    yield running
    running.close()


def _request(**fields) -> SubmitRequest:
    return msgspec.convert({"command": ["true"], **fields}, SubmitRequest)


def _submit(router: RouterThread, user: str, timeout: float = 20, **body) -> dict:
    subject = "submit" if user == "default" else f"submit.{user}"
    return router.ask(subject, {"command": ["true"], **body}, timeout)


def _cancel(router: RouterThread, user: str, job_id: str, timeout: float = 20) -> dict:
    return router.ask(f"cancel.{user}", {"job_id": job_id}, timeout)


def _read(router: RouterThread, user: str, method: str, args: list, timeout: float = 20):
    return router.ask(f"read.store.{user}", {"method": method, "args": args}, timeout)


def _states(router: RouterThread, array_id: str) -> dict[str, str]:
    rows = router.run(router.pool.fetch(
        "SELECT job_id, state FROM jobs WHERE array_id = $1 ORDER BY array_index", array_id))
    return {r["job_id"]: r["state"] for r in rows}


def _poll(condition, what: str, timeout: float = 60) -> None:
    """Wait (in the test's thread, never on the router's loop) for ``condition()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _array_rows(router: RouterThread) -> tuple[int, int]:
    """(arrays, their elements) the database holds."""
    return router.run(router.pool.fetchrow(
        "SELECT (SELECT count(*) FROM job_arrays), (SELECT count(*) FROM jobs WHERE array_id IS NOT NULL)"))


# ---------------------------------------------------------------- another user's ids


def test_another_users_array_is_out_of_reach_and_ids_are_per_user(routed):
    assert _submit(routed, "alice", job_id="sweep", array=3)["state"] == "queued"
    assert _submit(routed, "alice", job_id="mine", array=2)["state"] == "queued"
    # Bob's `sweep` is his own array, independent of alice's.
    assert _submit(routed, "bob", job_id="sweep", array=2)["duplicate"] is False
    assert _array_rows(routed) == (3, 7)
    # Bob may not wait for alice's array, by her id or by its stored form.
    refused = _submit(routed, "bob", job_id="w", after=[{"job_id": "mine"}])
    assert refused["error"] == {"code": "invalid_request", "message": "after: no job 'mine' of yours to wait for"}
    assert _submit(routed, "bob", job_id="w", after=[{"job_id": "alice:mine"}])["error"]["code"] == "invalid_request"
    assert _submit(routed, "bob", job_id="w", array=2, after=[{"job_id": "mine_0"}])["error"]["code"] == (
        "invalid_request")
    # Nor cancel it: alice's array answers exactly like none at all.
    assert _cancel(routed, "bob", "mine") == {"error": {"code": "not_found", "message": "no job 'mine'"}}
    assert _cancel(routed, "bob", "alice:mine")["error"]["code"] == "invalid_request"
    assert routed.ask("cancel", {"job_id": "mine"})["error"]["code"] == "not_found"  # the default user neither
    # Bob's cancel of his `sweep` ends his elements only.
    assert _cancel(routed, "bob", "sweep")["outcome"] == "never_started"
    assert set(_states(routed, "bob:sweep").values()) == {"killed"}
    assert set(_states(routed, "alice:sweep").values()) == {"queued"}
    assert set(_states(routed, "alice:mine").values()) == {"queued"}
    # Reads: another user's array counts as none, as does a string no id can be; an argument
    # that is no string is refused, never crashed on.
    assert _read(routed, "bob", "job_array_counts", ["mine"]) == {}
    assert _read(routed, "alice", "job_array_counts", ["mine"]) == {"queued": 2}
    assert _read(routed, "alice", "job_array_counts", ["alice:mine"]) == {"queued": 2}
    for args in (["alice:mine"], ["../x"], [""], ["mine\n"], ["a" * 200]):  # like a job that does not exist
        assert _read(routed, "bob", "job_array_counts", args) == {}, args
    for args in ([None], [123], []):
        answer = _read(routed, "bob", "job_array_counts", args)
        assert answer["error"]["code"] == "invalid_request", (args, answer)
    assert _read(routed, "bob", "job_get", ["mine_0"]) is None
    assert _read(routed, "bob", "job_dependents_of", ["mine_0"]) == []
    listed = _read(routed, "bob", "job_list", [None, 100])
    assert {row[0] if isinstance(row, list) else row["job_id"] for row in listed} == {"sweep_0", "sweep_1"}


def test_hostile_array_values_are_refused_and_write_nothing(routed):
    cases = [
        ({"job_id": "p", "array_parallel": 2}, "array_parallel limits an array: give array too"),
        ({"job_id": "p", "array": 2, "env": {"IRISFED_ARRAY_INDEX": "7"}}, "IRISFED_ARRAY_INDEX is set for each"),
        ({"job_id": "p", "array": 2, "env": {"IRISFED_ARRAY_SIZE": "1"}}, "IRISFED_ARRAY_SIZE is set for each"),
        ({"job_id": "c" * 124, "array": 10_000}, "it may have at most 123 characters"),
        ({"job_id": "p", "array": 0}, "array must be at least 1"),
        ({"job_id": "p", "array": 10_001}, "array must be at most 10,000"),
        ({"job_id": "p", "array": 2, "array_parallel": 0}, "array_parallel must be at least 1"),
        ({"job_id": "p", "array": True}, "array must be a whole number"),
        ({"job_id": "p", "array": "2"}, "array must be a whole number"),
        ({"job_id": "p", "array": 2, "after": [{"job_id": "p"}]}, "after names the job itself"),
    ]
    for body, words in cases:
        answer = _submit(routed, "alice", **body)
        assert answer["error"]["code"] == "invalid_request" and words in answer["error"]["message"], (body, answer)
    assert _array_rows(routed) == (0, 0)
    # At the limits: the longest base for 10 jobs, and more parallel slots than jobs (none held).
    longest = "c" * 126
    assert _submit(routed, "alice", job_id=longest, array=10)["state"] == "queued"
    assert routed.run(routed.pool.fetchval("SELECT max(length(job_id)) FROM jobs")) == len("alice:") + 128
    assert _submit(routed, "alice", job_id="wide", array=2, array_parallel=50)["reason"] == (
        "array of 2 jobs wide_0 … wide_1")
    assert routed.run(routed.pool.fetchval("SELECT count(*) FROM jobs WHERE array_held")) == 0
    # Dots, dashes and underscores in a base are ids like any other.
    assert _submit(routed, "alice", job_id="a.b-c_d", array=2)["state"] == "queued"
    assert set(_states(routed, "alice:a.b-c_d")) == {"alice:a.b-c_d_0", "alice:a.b-c_d_1"}


# ---------------------------------------------------------------- ids that collide


def test_a_plain_job_may_not_take_an_arrays_id(routed):
    assert _submit(routed, "alice", job_id="sweep", array=3)["state"] == "queued"
    plain = _submit(routed, "alice", job_id="sweep")
    shadowed = routed.run(routed.pool.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'alice:sweep'"))
    cancelled = _cancel(routed, "alice", "sweep")
    assert (plain.get("error", {}).get("code"), shadowed) == ("conflict", 0), plain
    assert set(_states(routed, "alice:sweep").values()) == {"killed"}, cancelled


def test_an_arrays_element_may_not_take_another_arrays_id(routed):
    assert _submit(routed, "alice", job_id="a_1", array=2)["state"] == "queued"
    second = _submit(routed, "alice", job_id="a", array=3)
    both = routed.run(routed.pool.fetchval(
        "SELECT count(*) FROM jobs j JOIN job_arrays a ON a.array_id = j.job_id"))
    assert (second.get("error", {}).get("code"), both) == ("conflict", 0), second


def test_an_array_may_not_take_an_element_or_a_jobs_id_and_the_other_way_round(routed):
    """What held: the checks the router does make, in both orders."""
    assert _submit(routed, "alice", job_id="a", array=20)["state"] == "queued"
    # `a_1` is an element of `a`: an array of that base is refused, whole.
    refused = _submit(routed, "alice", job_id="a_1", array=3)
    assert refused["error"]["code"] == "conflict" and "'a_1' already names a job" in refused["error"]["message"]
    # `a_1_0` .. are free ids (a's elements are a_10 .. a_19, never a_1_0).
    assert _submit(routed, "alice", job_id="a_1_0")["duplicate"] is False
    # An element id taken by a plain job refuses the array that would need it, writing nothing.
    refused = _submit(routed, "alice", job_id="a_1", array=2)
    assert refused["error"]["code"] == "conflict"
    assert _array_rows(routed) == (1, 20)


# ---------------------------------------------------------------- sizes that break answers


def _longest_array(router: RouterThread, base_len: int) -> tuple[str, int]:
    """An array whose waiting reason (every element named) would not fit one NATS message."""
    max_payload = router.client.max_payload
    per_element = 128 + len(" (queued), ")
    size = math.ceil(max_payload / per_element) + 200
    if size > 10_000:
        pytest.skip(f"this nats-server allows {max_payload} byte messages")
    base = "b" * base_len
    router.run(insert_array(Store(router.pool), _request(job_id=base, array=size), QUEUE, base, "alice"), 120)
    return base, size


def test_a_job_after_a_large_array_is_answered(routed):
    """Its reason names the first few of thousands of pending jobs, so the reply (and the
    row, and every read listing it) stays far below NATS's message size."""
    base, size = _longest_array(routed, 123)
    answer = _submit(routed, "alice", job_id="after-big", after=[{"job_id": base}], timeout=15)
    assert answer.get("job_id") == "after-big" and answer["state"] == "queued", str(answer)[:300]
    assert answer["reason"].endswith(f" and {size - 10:,} more"), answer["reason"][-100:]
    stored = routed.run(routed.pool.fetchrow(
        "SELECT state, length(reason) AS length FROM jobs WHERE job_id = 'alice:after-big'"))
    assert stored["state"] == "queued" and stored["length"] < 2_000
    assert any(row[0] == "after-big" for row in _read(routed, "alice", "job_list", [None, 10], timeout=15))
    again = _submit(routed, "alice", job_id="after-big", after=[{"job_id": base}], timeout=15)
    assert again["duplicate"] is True


def test_cancelling_a_full_size_array_is_answered(routed):
    base = "big"
    routed.run(insert_array(Store(routed.pool), _request(job_id=base, array=10_000, array_parallel=4), QUEUE,
                            base, "alice"), 120)
    answer = _cancel(routed, "alice", base, timeout=30)
    if "error" in answer:  # what a client does with `unavailable` (irisfed.connection: it asks again)
        again = _cancel(routed, "alice", base, timeout=30)
        passes = len(routed.router._cancels)
        answer = {**answer, "then": again, "passes over the array at once": passes}
    assert "error" not in answer, answer


# ---------------------------------------------------------------- a hung server, a cancel racing an end


async def _lock_row(database_url: str, job_id: str) -> tuple[asyncpg.Connection, object]:
    conn = await asyncpg.connect(database_url)
    tx = conn.transaction()
    await tx.start()
    await conn.fetch("SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE", job_id)
    return conn, tx


async def _unlock(conn: asyncpg.Connection, tx) -> None:
    await tx.rollback()
    await conn.close()


def test_an_array_cancel_stuck_on_a_hung_row_is_answered_in_time_and_a_retry_converges(routed, database_url):
    store = Store(routed.pool)
    jobs, _ = routed.run(insert_array(store, _request(job_id="hang", array=8, array_parallel=2), QUEUE, "hang",
                                      "alice"))
    routed.run(assign_jobs(store, jobs[:2], "gpu-west"))
    routed.run(start_jobs(store, jobs[:2], "gpu-west"))
    conn, tx = routed.run(_lock_row(database_url, "alice:hang_4"))
    try:
        answer = _cancel(routed, "alice", "hang")  # the queued ones in one statement: it waits for hang_4
        assert answer["error"]["code"] == "unavailable" and "retry" in answer["error"]["message"]
        states = _states(routed, "alice:hang")
        assert [states[f"alice:hang_{i}"] for i in range(2, 8)] == ["queued"] * 6  # all or none
        again = _cancel(routed, "alice", "hang")  # a retry while it hangs: answered in time too
        assert again["error"]["code"] == "unavailable"
    finally:
        routed.run(_unlock(conn, tx))
    # Once the row is free both passes finish; a retry answers what happened, and nothing is left.
    _poll(lambda: set(_states(routed, "alice:hang").values()) <= {"killed", "running"},
          "the cancel to finish in the background")
    final = _cancel(routed, "alice", "hang")
    assert (final["state"], final["outcome"]) in (("running", "already_requested"),
                                                  ("running", "pending_owner_offline")), final
    states = _states(routed, "alice:hang")
    assert [states[f"alice:hang_{i}"] for i in range(2, 8)] == ["killed"] * 6
    assert routed.run(routed.pool.fetchval(
        "SELECT bool_and(cancel_requested) FROM jobs WHERE job_id = ANY($1::text[])", ["alice:hang_0",
                                                                                        "alice:hang_1"]))
    routed.run(assert_changelog_replays(store))


def test_an_element_ending_while_its_array_is_cancelled_releases_no_held_one(routed, database_url):
    store = Store(routed.pool)
    jobs, _ = routed.run(insert_array(store, _request(job_id="race", array=6, array_parallel=1), QUEUE, "race",
                                      "alice"))
    routed.run(assign_jobs(store, jobs[:1], "gpu-west"))
    routed.run(start_jobs(store, jobs[:1], "gpu-west"))
    # The cancel kills the queued ones in one statement; a slow row (here: locked) holds it
    # at race_2, having locked race_1 (the next held one) already.
    conn, tx = routed.run(_lock_row(database_url, "alice:race_2"))
    try:
        assert _cancel(routed, "alice", "race")["error"]["code"] == "unavailable"
        # Meanwhile the running element ends (its agent's own statement).
        finish = asyncio.run_coroutine_threadsafe(
            store.job_finish_batch("gpu-west", [("alice:race_0", 1, 0, False)]), routed.loop)
        try:
            finish.result(5)
        except TimeoutError:
            pass  # a fix may make the end wait for the cancel: then it released nothing yet
        claimable = routed.run(routed.pool.fetch(CLAIMABLE, "alice:race"))
    finally:
        routed.run(_unlock(conn, tx))
    finish.result(30)
    _poll(lambda: set(_states(routed, "alice:race").values()) <= {"killed", "succeeded"}, "the cancel to finish")
    assert [r["job_id"] for r in claimable] == [], "released after the array's cancel was asked"


# ---------------------------------------------------------------- dry runs


def test_a_dry_run_of_an_array_answers_as_its_submit_would(routed):
    dry = _submit(routed, "alice", job_id="x", array=3, dry_run=True)
    assert routed.run(routed.pool.fetchval("SELECT count(*) FROM jobs")) == 0
    real = _submit(routed, "alice", job_id="x", array=3)
    fields = ("job_id", "disposition", "state", "peer_id", "reason")
    assert {k: dry[k] for k in fields} == {k: real[k] for k in fields}, (dry, real)


def test_a_dry_run_of_an_array_foresees_a_taken_element_id(routed):
    assert _submit(routed, "alice", job_id="y_2")["duplicate"] is False
    dry = _submit(routed, "alice", job_id="y", array=3, dry_run=True)
    real = _submit(routed, "alice", job_id="y", array=3)
    assert real["error"]["code"] == "conflict"
    assert dry.get("error", {}).get("code") == "conflict", dry


def test_a_dry_run_with_array_and_after_writes_nothing(routed):
    assert _submit(routed, "alice", job_id="m", array=11, array_parallel=1)["state"] == "queued"
    before = routed.written()
    dry = _submit(routed, "alice", job_id="d", array=2, after=[{"job_id": "m", "when": "any"}], dry_run=True)
    assert dry["dry_run"] is True and dry["waiting_code"] == "dependency"
    assert "m_0 (queued), m_1 (queued), m_2 (queued)" in dry["waiting"]
    # The edge cap, judged as the real submit judges it.
    for dry_run in (True, False):
        refused = _submit(routed, "alice", job_id="d", array=10_000, after=[{"job_id": "m"}], dry_run=dry_run)
        assert refused["error"] == {"code": "invalid_request", "message": (
            "after: 10,000 jobs waiting for 11 each make 110,000 dependencies; at most 100,000 in one submit "
            "(an array named stands for each of its jobs)")}, refused
    assert routed.written() == before and _array_rows(routed) == (1, 11)


def test_a_dry_run_judges_an_element_named_twice_as_the_submit_does(routed):
    assert _submit(routed, "alice", job_id="m", array=2)["state"] == "queued"
    assert _cancel(routed, "alice", "m_1")["outcome"] == "never_started"  # m_1 ended killed
    after = [{"job_id": "m"}, {"job_id": "m_1", "when": "any"}]  # m_1 itself: any end will do
    dry = _submit(routed, "alice", job_id="d", after=after, dry_run=True)
    real = _submit(routed, "alice", job_id="d", after=after)
    assert real["state"] == "queued" and real["reason"] == "waiting for its dependencies: m_0 (queued)"
    assert (dry.get("state"), dry.get("waiting")) == ("queued", real["reason"]), dry


# ---------------------------------------------------------------- replays and races


def test_the_same_array_from_two_routers_at_once_is_one_array(database_url, servers):
    one = RouterThread(database_url, servers.nats_url, users=USERS)
    two = RouterThread(database_url, servers.nats_url, prefix=one.prefix, users=USERS)
    try:
        one.run(advertise(Store(one.pool), "gpu-west", slots=2, ttl_s=3600, device_type="gpu"))
        for router in (one, two):
            router.run(router.router.refresh_view())
        async def both(body: dict, times: int) -> list[bytes]:
            raw = json.dumps(body).encode()
            replies = await asyncio.gather(*(one.client.request(f"{one.prefix}.submit.alice", raw, timeout=30)
                                             for _ in range(times)))
            return [r.data for r in replies]

        async def sizes(base: str, each: tuple[int, ...]) -> list[bytes]:
            replies = await asyncio.gather(*(one.client.request(f"{one.prefix}.submit.alice", json.dumps(
                {"job_id": base, "command": ["true"], "array": size}).encode(), timeout=30) for size in each))
            return [r.data for r in replies]

        for round_ in range(6):
            base = f"r{round_}"
            replies = one.run(both({"job_id": base, "command": ["true"], "array": 50, "array_parallel": 3}, 4), 60)
            decoded = [json.loads(r) for r in replies]
            assert all("error" not in d for d in decoded), decoded
            firsts = [r for r, d in zip(replies, decoded, strict=True) if not d["duplicate"]]
            assert len(firsts) == 1, decoded
            for raw, answer in zip(replies, decoded, strict=True):
                if answer["duplicate"]:
                    assert raw == firsts[0].replace(b'"duplicate":false', b'"duplicate":true')
            # A different spec at once: one array, the rest conflicts; never a partial one.
            mixed = one.run(sizes(f"m{round_}", (30, 31, 30, 31)), 60)
            codes = [json.loads(m).get("error", {}).get("code", "ok") for m in mixed]
            assert sorted(codes) == ["conflict", "conflict", "ok", "ok"], codes  # the winner's spec twice
            size = one.run(one.pool.fetchval("SELECT size FROM job_arrays WHERE array_id = $1", f"alice:m{round_}"))
            assert len(_states(one, f"alice:m{round_}")) == size
        held = one.run(one.pool.fetchval("SELECT count(*) FROM jobs WHERE array_held AND array_id LIKE 'alice:r%'"))
        assert held == 6 * (50 - 3)
    finally:
        two.close()
        one.close()


async def _blocked_on(pool, count: int) -> bool:
    return await pool.fetchval(LOCK_WAIT) >= count


async def test_racing_array_submits_forced_to_interleave_write_one_whole_array_or_none(pool, database_url):
    store = Store(pool)
    request = _request(job_id="s", array=4)
    blocker = await asyncpg.connect(database_url)
    try:
        # A plain job s_2 being written (not committed) holds the first submit mid-array.
        tx = blocker.transaction()
        await tx.start()
        await Store(blocker).job_insert_batch([user_job("alice", "s_2")])
        first = asyncio.ensure_future(insert_array(store, request, QUEUE, "s", "alice"))
        await wait_for(lambda: _blocked_on(pool, 1), "the first submit to wait on s_2")
        same = asyncio.ensure_future(insert_array(store, request, QUEUE, "s", "alice"))
        other = asyncio.ensure_future(insert_array(store, _request(job_id="s", array=5), QUEUE, "s", "alice"))
        await wait_for(lambda: _blocked_on(pool, 3), "both others to wait on the array's id")
        await tx.rollback()  # s_2 was never written: the first array is whole
        written, reply = await asyncio.wait_for(first, 30)
        again = await asyncio.wait_for(same, 30)
        assert len(written) == 4 and again == ([], reply.replace(b'"duplicate":false', b'"duplicate":true'))
        with pytest.raises(Conflict, match="already names an array with a different spec"):
            await asyncio.wait_for(other, 30)
        # Again, with the blocking job committed: the first is refused, whole, and so is the next.
        tx = blocker.transaction()
        await tx.start()
        await Store(blocker).job_insert_batch([user_job("alice", "t_1")])
        first = asyncio.ensure_future(insert_array(store, _request(job_id="t", array=3), QUEUE, "t", "alice"))
        await wait_for(lambda: _blocked_on(pool, 1), "the first submit to wait on t_1")
        second = asyncio.ensure_future(insert_array(store, _request(job_id="t", array=3), QUEUE, "t", "alice"))
        await wait_for(lambda: _blocked_on(pool, 2), "the second to wait on the array's id")
        await tx.commit()
        for racer in (first, second):
            with pytest.raises(Conflict, match="'t_1' already names a job"):
                await asyncio.wait_for(racer, 30)
        assert await store.job_array_get("alice:t") is None
        assert await pool.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE 'alice:t\\_%'") == 1
    finally:
        await blocker.close()


def test_a_router_connection_killed_mid_array_writes_nothing_and_the_retry_writes_it_all(routed, database_url):
    """kill -9 of the router's transaction (its backend terminated) while it writes an
    array: nothing of it stays; the user's retry writes the whole array once."""
    async def block() -> tuple[asyncpg.Connection, object]:
        conn = await asyncpg.connect(database_url)
        tx = conn.transaction()
        await tx.start()
        await Store(conn).job_insert_batch([user_job("alice", "k_7")])
        return conn, tx

    conn, tx = routed.run(block())
    try:
        pending = asyncio.run_coroutine_threadsafe(routed.client.request(
            f"{routed.prefix}.submit.alice", json.dumps({"job_id": "k", "command": ["true"], "array": 10}).encode(),
            timeout=20), routed.loop)
        routed.run(wait_for(lambda: _blocked_on(routed.pool, 1), "the router's insert to wait on k_7"))
        victim = routed.run(routed.pool.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"))
        assert routed.run(routed.pool.fetchval("SELECT pg_terminate_backend($1)", victim))
        answer = json.loads(pending.result(20).data)
        assert answer["error"]["code"] in ("unavailable", "internal"), answer
        assert answer["error"]["code"] == "unavailable", answer  # a lost connection: retry, not a bug report
    finally:
        routed.run(tx.rollback())
        routed.run(conn.close())
    assert _array_rows(routed) == (0, 0)
    retried = _submit(routed, "alice", job_id="k", array=10)
    assert (retried["state"], retried["duplicate"]) == ("queued", False)
    assert _array_rows(routed) == (1, 10)
    routed.run(assert_changelog_replays(Store(routed.pool)))


# ---------------------------------------------------------------- slots, ends and invariant 16


async def _held(pool, array_id: str) -> dict[str, tuple[str, bool, int]]:
    rows = await pool.fetch("SELECT job_id, state, array_held, deps_pending FROM jobs WHERE array_id = $1", array_id)
    return {r["job_id"].rpartition("_")[2]: (r["state"], r["array_held"], r["deps_pending"]) for r in rows}


async def test_a_requeued_element_keeps_its_slot(pool):
    store = Store(pool)
    jobs, _ = await insert_array(store, _request(job_id="q", array=3, array_parallel=1), QUEUE, "q", "alice")
    await assign_jobs(store, jobs[:1], "gpu-west")
    await start_jobs(store, jobs[:1], "gpu-west")
    # Its peer lost it (or it was preempted): queued again, still holding the slot.
    await store.job_move(Move("alice:q_0", JobState.RUNNING, JobState.QUEUED, 1, actor="tick", owner_peer_id=None,
                              reason="requeued"))
    held = await _held(pool, "alice:q")
    assert held["0"] == ("queued", False, 0) and held["1"] == ("queued", True, 1)
    await assign_jobs(store, jobs[:1], "gpu-west", epoch=1)
    await start_jobs(store, jobs[:1], "gpu-west", epoch=2)
    assert (await _held(pool, "alice:q"))["1"] == ("queued", True, 1)
    await store.job_finish_batch("gpu-west", [("alice:q_0", 2, 1, False)])  # failed: a slot freed all the same
    held = await _held(pool, "alice:q")
    assert held["1"] == ("queued", False, 0) and held["2"] == ("queued", True, 1)
    await assert_changelog_replays(store)


async def test_after_an_array_waits_for_its_held_elements_too(pool):
    """Invariant 16 with arrays: a job after an array is claimable only once every
    element ended as its condition asks, held ones included; one that can no longer be
    met ends it at once."""
    store = Store(pool)
    jobs, _ = await insert_array(store, _request(job_id="h", array=3, array_parallel=1), QUEUE, "h", "alice")
    any_, _ = await insert_array(store, _request(job_id="any", array=2, after=[{"job_id": "h", "when": "any"}]),
                                 QUEUE, "any", "alice")
    ok, _ = await insert_array(store, _request(job_id="ok", array=1, after=[{"job_id": "h"}]), QUEUE, "ok", "alice")
    failed, _ = await insert_array(store, _request(job_id="fl", array=1, after=[{"job_id": "h", "when": "failed"}]),
                                   QUEUE, "fl", "alice")

    async def claimable() -> set[str]:
        rows = await pool.fetch("SELECT job_id FROM jobs WHERE state = 'queued' AND deps_pending = 0")
        return {r["job_id"] for r in rows}

    assert await claimable() == {"alice:h_0"}
    await assign_jobs(store, jobs[:1], "gpu-west")
    await start_jobs(store, jobs[:1], "gpu-west")
    await store.job_finish_batch("gpu-west", [("alice:h_0", 1, 3, False)])  # failed
    assert await claimable() == {"alice:h_1"}
    assert (await store.job_get("alice:ok_0")).state == "unschedulable"
    # The held element ends (cancelled while held): it frees nothing, and counts as ended.
    await store.job_move(Move("alice:h_2", JobState.QUEUED, JobState.KILLED, 0, actor="router",
                              owner_peer_id=None, reason="cancelled"))
    assert await claimable() == {"alice:h_1"}
    assert await pool.fetchval("SELECT deps_pending FROM jobs WHERE job_id = 'alice:any_0'") == 1
    # The last element succeeds: `any` is met; `failed` is broken by it.
    await assign_jobs(store, [jobs[1]], "gpu-west")
    await start_jobs(store, [jobs[1]], "gpu-west")
    await store.job_finish_batch("gpu-west", [("alice:h_1", 1, 0, False)])
    assert await claimable() == {"alice:any_0", "alice:any_1"}
    assert (await store.job_get("alice:fl_0")).state == "unschedulable"
    assert [f.job_id for f in failed + ok + any_] == ["alice:fl_0", "alice:ok_0", "alice:any_0", "alice:any_1"]
    await assert_changelog_replays(store)


async def _kill_the_listener(pool, tick):
    """Start ``tick`` and place the first element of array ``l`` (3 jobs, 1 at once),
    then terminate the connection the tick listens on (as a Postgres restart would)."""
    store = Store(pool)
    await tick.start()
    await wait_for(lambda: returns(tick.released is not None and tick.released.alive()), "the tick to listen")
    await wait_for(lambda: _state_is(store, "alice:l_0", "assigned"), "the first element to be placed")
    await store.job_start_batch("gpu-west", [("alice:l_0", 1, None, "started")])
    first = tick.released
    assert await pool.fetchval("SELECT pg_terminate_backend($1)", first._conn.get_server_pid())
    return first


@pytest.fixture
async def listening(pool):
    from irisfed.services.tick.service import Tick

    await advertise(Store(pool), "gpu-west", slots=4, ttl_s=3600, device_type="gpu")
    await insert_array(Store(pool), _request(job_id="l", array=3, array_parallel=1), QUEUE, "l", "alice")
    tick = Tick(make_config(tick_interval_s=0.5, heartbeat_ttl_s=3600), pool, None)
    yield tick
    await tick.close()


async def test_releases_are_placed_after_the_ticks_listener_was_killed(pool, listening):
    store = Store(pool)
    await _kill_the_listener(pool, listening)
    await store.job_finish_batch("gpu-west", [("alice:l_0", 1, 0, False)])
    await wait_for(lambda: _state_is(store, "alice:l_1", "assigned"), "the released element to be placed")
    assert (await store.job_get("alice:l_2")).state == "queued"


async def test_an_element_ending_while_a_job_after_its_array_is_submitted_never_strands_it(pool, database_url):
    """Forced interleaving: the submit has locked the array's elements and counted them
    pending when one ends; the end waits for the submit's commit, then counts down."""
    from irisfed.services.router.dependencies import insert_with_dependencies
    from irisfed.services.router.plan import plan_new_job

    store = Store(pool)
    jobs, _ = await insert_array(store, _request(job_id="m", array=2), QUEUE, "m", "alice")
    await assign_jobs(store, jobs[:1], "gpu-west")
    await start_jobs(store, jobs[:1], "gpu-west")
    request = _request(job_id="dep", after=[{"job_id": "m"}])
    job, reply = plan_new_job(request, QUEUE, "dep", "alice")
    blocker, ender = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        tx = blocker.transaction()
        await tx.start()
        await Store(blocker).job_insert_batch([user_job("alice", "dep")])  # holds the submit after its locks
        submit = asyncio.ensure_future(insert_with_dependencies(store, request, job, reply, "alice"))
        await wait_for(lambda: _blocked_on(pool, 1), "the submit to wait on its own id")
        end = asyncio.ensure_future(Store(ender).job_finish_batch("gpu-west", [("alice:m_0", 1, 0, False)]))
        await wait_for(lambda: _blocked_on(pool, 2), "the end to wait on the submit's lock")
        await tx.rollback()
        written, _ = await asyncio.wait_for(submit, 30)
        await asyncio.wait_for(end, 30)
    finally:
        await blocker.close()
        await ender.close()
    assert written.reason == "waiting for its dependencies: m_0 (running), m_1 (queued)"
    assert await pool.fetchval("SELECT deps_pending FROM jobs WHERE job_id = 'alice:dep'") == 1
    await assert_changelog_replays(store)


async def test_the_ticks_listener_killed_listens_again(pool, listening):
    first = await _kill_the_listener(pool, listening)
    await wait_for(lambda: returns(listening.released is not first and listening.released is not None),
                   "the tick to listen again", timeout=10)
    assert await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%' "
                               "AND datname = current_database()") == 1


async def _state_is(store: Store, job_id: str, state: str) -> bool:
    return (await store.job_get(job_id)).state == state
