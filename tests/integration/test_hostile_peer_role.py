"""A hostile peer login role against the agent functions and row security (0003/0004/0006,
0012's finish).

The peer holds its own Postgres credentials (``irisfed_peer_gpu-west``) and tries to
act as another peer: through temp objects shadowing what SECURITY DEFINER code
reads, by naming another peer to the functions, and by writing rows directly. It feeds
its own functions ids that do not exist, other peers' jobs, duplicates, NULLs, arrays
of different lengths and stale or future epochs: only its own runs at their epoch
move, once, and the changelog says exactly that (it still replays to ``jobs``).
"""

from __future__ import annotations

import asyncpg
import pytest

from irisfed.services.common.store import Store
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.db_roles import as_role
from tests.infra.factories import (
    advertise,
    assign_jobs,
    insert_jobs,
    make_config,
    make_job,
    running_job,
)

FINISH = "SELECT job_id, state FROM irisfed_job_finish_batch($1, $2, $3, $4, $5)"
START = "SELECT job_id FROM irisfed_job_start_batch($1, $2, $3, $4, $5)"


async def test_temp_peer_roles_table_does_not_make_a_peer_another(pool, gpu):
    """pg_temp is searched first for tables unless a function's search_path lists it:
    a session's own temp `peer_roles` must not decide who the session is."""
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    await gpu.execute("CREATE TEMP TABLE peer_roles (role_name text, peer_id text)")
    await gpu.execute("INSERT INTO peer_roles VALUES (session_user, 'tpu-east')")
    assert await gpu.fetchval("SELECT irisfed_current_peer()") == "gpu-west"
    assert await gpu.fetch("SELECT job_id FROM jobs WHERE job_id = $1", theirs) == []
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await gpu.fetchval("SELECT irisfed_job_end_run('tpu-east', $1, 1, 'queued', 'x')", theirs)
    job = await admin.job_get(theirs)
    assert (job.state, job.owner_peer_id) == ("running", "tpu-east")


async def test_temp_objects_do_not_shadow_what_agent_functions_read(pool, gpu):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    for table in ("jobs", "federation_changelog", "federation_sync_state", "peer_roles", "pg_roles"):
        await gpu.execute(f"CREATE TEMP TABLE {table} (x int)")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await gpu.fetchval("SELECT irisfed_job_end_run('tpu-east', $1, 1, 'queued', 'x')", theirs)
    assert (await admin.job_get(theirs)).state == "running"


async def test_peer_cannot_move_write_or_read_another_peers_rows(pool, gpu):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    await advertise(admin, "tpu-east")
    for sql in (
        f"SELECT * FROM irisfed_job_finish_batch('tpu-east', ARRAY['{theirs}'], ARRAY[1::bigint], ARRAY[0], ARRAY[false])",
        f"SELECT * FROM irisfed_job_start_batch('tpu-east', ARRAY['{theirs}'], ARRAY[1::bigint], ARRAY[''], ARRAY[''])",
        f"UPDATE jobs SET cancel_requested = true WHERE job_id = '{theirs}'",
        "UPDATE jobs SET spec = '{}', epoch = 99",
        "INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor, detail) "
        f"VALUES ('{theirs}', 'running', 'succeeded', 'gpu-west', 1, 'operator', 'forged')",
        "INSERT INTO peer_heartbeat (peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, "
        "expires_at) VALUES ('tpu-east', 'r', 1, '[]', 60, now(), now(), now() + interval '1 day')",
        "UPDATE peer_roles SET peer_id = 'tpu-east'",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu.fetch(sql)
    # Other peers' heartbeat and sync state rows are invisible; updates touch nothing.
    assert await gpu.fetch("SELECT * FROM peer_heartbeat WHERE peer_id = 'tpu-east'") == []
    assert await gpu.fetch("SELECT * FROM federation_sync_state WHERE peer_id = 'tpu-east'") == []
    assert await gpu.execute("UPDATE peer_heartbeat SET ttl_s = 1e9 WHERE peer_id = 'tpu-east'") == "UPDATE 0"
    # Its own functions on another's job, in its own name, lose the compare-and-set.
    assert await gpu.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, 1, 'queued', 'x')", theirs) is None
    job = await admin.job_get(theirs)
    assert (job.state, job.owner_peer_id, job.epoch, job.cancel_requested) == ("running", "tpu-east", 1, False)


async def test_service_roles_cannot_call_agent_functions(pool, database_url, roles):
    admin = Store(pool)
    theirs = await running_job(admin, "tpu-east")
    for role in ("irisfed_svc_router", "irisfed_svc_tick"):
        conn = await asyncpg.connect(as_role(database_url, role))
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.fetchval("SELECT irisfed_job_end_run('tpu-east', $1, 1, 'queued', 'x')", theirs)
        finally:
            await conn.close()
    assert (await admin.job_get(theirs)).state == "running"


async def test_a_peers_malformed_heartbeat_row_does_not_break_other_services_views(pool, gpu):
    """A peer may write its own `peer_heartbeat` row directly; whatever it puts in
    `backends`, the router's and tick's view refresh must go on for every other peer
    (the row is skipped, not trusted)."""
    from irisfed.services.common.peer_view import PeerView
    admin = Store(pool)
    await advertise(admin, "tpu-east", slots=3)
    await gpu.execute(
        "INSERT INTO peer_heartbeat (peer_id, run_id, seq, backends, ttl_s, sent_at, received_at, expires_at) "
        "VALUES ('gpu-west', 'r', 1, '[{\"name\": \"main\", \"capacity\": \"lots\"}]', 1, now(), now(), "
        "now() + interval '1 day')")
    view = PeerView(make_config())
    view.apply_rows(await admin.peer_heartbeat_list())
    assert "tpu-east" in view.reachable_ids()
    assert "gpu-west" not in view.reachable_ids()
    # Well-formed JSON with the wrong types (a string where slots are counted) too.
    await gpu.execute("""UPDATE peer_heartbeat SET seq = 2, backends = '[{"name": "main", "attributes": {},
        "capacity": {"total": "x", "free": "y"}}]'""")
    view = PeerView(make_config())
    view.apply_rows(await admin.peer_heartbeat_list())
    assert view.reachable_ids() == ["tpu-east"]


async def test_agent_functions_write_history_only_for_what_they_really_move(pool, conns):
    admin, agent = Store(pool), conns["agent"]
    jobs = [make_job() for _ in range(3)]
    await insert_jobs(admin, jobs)
    await assign_jobs(admin, jobs, "gpu-west")
    a, b, c = (j.job_id for j in jobs)
    theirs = await running_job(admin, "tpu-east")
    start = "SELECT job_id FROM irisfed_job_start_batch('gpu-west', $1, $2, $3, $4)"
    finish = "SELECT job_id FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)"
    # Ids that do not exist, another peer's, a duplicate, a NULL; epochs shorter than ids
    # (unnest pads NULLs), forged epochs.
    started = await agent.fetch(start, ["ghost", a, a, None, theirs, b, c], [1, 1, 1, 1, 1, 99], ["x"], None)
    assert [r["job_id"] for r in started] == [a]
    assert await agent.fetch(start, None, None, None, None) == []
    assert [r["job_id"] for r in await agent.fetch(start, [b], [1], None, None)] == [b]
    # A duplicate with different outcomes: one move, one row.
    finished = await agent.fetch(finish, [a, a, "ghost", theirs], [1, 1, 1, 1], [0, 1, 0, 0], [False, None, False, False])
    assert [r["job_id"] for r in finished] == [a]
    # A NULL exit code is refused outright (reason NOT NULL): nothing moves, nothing is logged.
    with pytest.raises(asyncpg.NotNullViolationError):
        await agent.fetch(finish, [b], [1], [None], [False])
    for args in (("ghost", 1, "queued"), (None, None, "failed"), (theirs, 1, "killed"), (c, 1, "queued"),
                 (b, 2, "queued")):
        assert await agent.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, $2, $3, 'x')", *args) is None, args
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await agent.fetch("SELECT * FROM irisfed_job_start_batch(NULL, $1, $2, NULL, NULL)", [c], [1])
    counts = dict(await pool.fetch("SELECT job_id, count(*) FROM federation_changelog WHERE job_id = ANY($1) "
                                   "GROUP BY job_id", [a, b, c, theirs, "ghost"]))
    assert counts == {a: 4, b: 3, c: 2, theirs: 3}
    await assert_changelog_replays(admin)


async def test_only_agents_run_the_finish_and_only_for_their_own_peer(pool, conns):
    admin = Store(pool)
    mine = await running_job(admin, "gpu-west")
    args = (["x"], [1], [0], [False])
    for name in ("router", "tick", "web"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conns[name].fetch(FINISH, "gpu-west", [mine], [1], [0], [False])
    for peer in ("tpu-east", None, "", "GPU-WEST", "gpu-west "):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conns["agent"].fetch(FINISH, peer, *args)
    assert (await admin.job_get(mine)).state == "running"
    # 0012 replaced the body only: who may run it is 0004's (not PUBLIC, the agents).
    acl = await pool.fetchval("SELECT proacl::text FROM pg_proc WHERE proname = 'irisfed_job_finish_batch'")
    entries = acl.strip("{}").split(",")
    assert any(e.startswith("irisfed_agent=X/") for e in entries), acl
    assert not any(e.startswith(("=", "irisfed_router", "irisfed_tick", "irisfed_web")) for e in entries), acl


async def test_the_finish_moves_only_the_peers_running_jobs_at_their_epoch(pool, conns):
    """Others' jobs, stale or future epochs, jobs not running (queued, assigned, finished),
    ids that do not exist, NULLs, duplicates and ragged arrays, as the start function is
    fed above: only what is really this peer's running run at its epoch moves, once, and
    history says exactly that."""
    admin, agent = Store(pool), conns["agent"]
    ok = await running_job(admin, "gpu-west")
    dup = await running_job(admin, "gpu-west")
    cancelled = await running_job(admin, "gpu-west")
    nulled = await running_job(admin, "gpu-west")
    theirs = await running_job(admin, "tpu-east")
    queued, assigned = make_job(), make_job()
    await insert_jobs(admin, [queued, assigned])
    await assign_jobs(admin, [assigned], "gpu-west")
    done = await running_job(admin, "gpu-west")
    assert await admin.job_finish_batch("gpu-west", [(done, 1, 0, False)])
    await admin.job_request_cancel(cancelled)
    rows = "SELECT job_id, state, epoch, exit_code, reason FROM jobs"
    before = {r["job_id"]: tuple(r) for r in await pool.fetch(rows)}

    # Nothing of these moves: stale and future epochs, not running, not theirs, ghosts, NULLs.
    for ids, epochs in (([ok], [0]), ([ok], [2]), ([ok], [None]), ([queued.job_id], [0]),
                        ([assigned.job_id], [1]), ([done], [1]), ([theirs], [1]), (["ghost"], [1]),
                        ([None], [1]), ([ok, ok], [None, 7])):
        assert await agent.fetch(FINISH, "gpu-west", ids, epochs, [0] * len(ids), [False] * len(ids)) == [], ids
    assert await agent.fetch(FINISH, "gpu-west", None, None, None, None) == []
    assert await agent.fetch(FINISH, "gpu-west", [], [], [], []) == []
    # Epochs shorter than ids: unnest pads NULL epochs, which match nothing (as the start's).
    assert await agent.fetch(FINISH, "gpu-west", [theirs, ok], [1], [0, 0], [False, False]) == []
    # A NULL exit code fails the whole call (reason is NOT NULL), as 0004's did: nothing moves.
    with pytest.raises(asyncpg.NotNullViolationError):
        await agent.fetch(FINISH, "gpu-west", [ok, nulled], [1, 1], [0], [False, False])
    after = {r["job_id"]: tuple(r) for r in await pool.fetch(rows)}
    assert after == before

    # A duplicate with different endings: one move, and the row, reply and history agree.
    moved = await agent.fetch(FINISH, "gpu-west", [dup, dup, ok, cancelled, nulled], [1, 1, 1, 1, 1],
                              [0, 5, 0, 0, 3], [False, True, False, None, None])
    assert sorted(r["job_id"] for r in moved) == sorted([dup, ok, cancelled, nulled])
    states = {r["job_id"]: r["state"] for r in moved}
    row = await admin.job_get(dup)
    assert (row.state, row.exit_code, row.reason) in {("succeeded", 0, "exit code 0"),
                                                     ("killed", 5, "cancelled by request")}
    assert states[dup] == row.state
    assert (states[ok], states[cancelled], states[nulled]) == ("succeeded", "killed", "failed")
    for job_id in (dup, ok, cancelled, nulled):
        history = await admin.changelog_list_for_job(job_id)
        assert [(c.from_state, c.to_state, c.actor, c.epoch) for c in history][-1] == (
            "running", states[job_id], "gpu-west", 1)
        assert len(history) == 4
    # A second report moves nothing and writes nothing.
    assert await agent.fetch(FINISH, "gpu-west", [dup, ok], [1, 1], [0, 0], [False, False]) == []
    assert len(await admin.changelog_list_for_job(ok)) == 4
    # The start refuses the same junk the same way.
    assert await agent.fetch(START, "gpu-west", [ok, theirs, queued.job_id], [1, 1, 0], None, None) == []
    assert [r["job_id"] for r in await agent.fetch(START, "gpu-west", [assigned.job_id], [1], None, None)] == [
        assigned.job_id]
    await assert_changelog_replays(admin)


async def test_the_peers_own_role_cannot_move_a_job_with_a_stale_or_future_epoch_or_anothers(pool, gpu):
    admin = Store(pool)
    mine = await running_job(admin, "gpu-west")  # running, epoch 1
    theirs = await running_job(admin, "tpu-east")
    queued = make_job()
    await insert_jobs(admin, [queued])
    await assign_jobs(admin, [queued], "gpu-west")  # assigned, epoch 1
    before = await pool.fetchval("SELECT count(*) FROM federation_changelog")
    for epoch in (0, 2, 2**62, -1):
        assert await gpu.fetch("SELECT * FROM irisfed_job_start_batch('gpu-west', $1, $2, $3, $4)",
                               [queued.job_id], [epoch], [None], ["x"]) == []
        assert await gpu.fetch("SELECT * FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)",
                               [mine], [epoch], [0], [False]) == []
        for to_state in ("queued", "failed", "killed"):
            assert await gpu.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, $2, $3, 'x')",
                                      mine, epoch, to_state) is None
    # Another peer's job at its true epoch, named as the caller's own peer: nothing moves.
    assert await gpu.fetch("SELECT * FROM irisfed_job_finish_batch('gpu-west', $1, $2, $3, $4)",
                           [theirs], [1], [0], [False]) == []
    assert await gpu.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, 1, 'queued', 'x')", theirs) is None
    assert await pool.fetchval("SELECT count(*) FROM federation_changelog") == before
    states = {r["job_id"]: (r["state"], r["epoch"]) for r in await pool.fetch("SELECT job_id, state, epoch FROM jobs")}
    assert states == {mine: ("running", 1), theirs: ("running", 1), queued.job_id: ("assigned", 1)}
