"""A hostile peer login role against the agent functions and row security (0003/0004/0006).

The peer holds its own Postgres credentials (``irisfed_peer_gpu-west``) and tries to
act as another peer: through temp objects shadowing what SECURITY DEFINER code
reads, by naming another peer to the functions, and by writing rows directly.
"""

from __future__ import annotations

import asyncpg
import pytest

from irisfed.services.common.db_roles import peer_role
from irisfed.services.common.store import Store
from tests.infra.factories import (
    advertise,
    make_config,
    running_job,
)
from tests.integration.test_db_roles import as_role


@pytest.fixture
async def gpu(database_url, roles):
    conn = await asyncpg.connect(as_role(database_url, peer_role("gpu-west")))
    yield conn
    await conn.close()


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
