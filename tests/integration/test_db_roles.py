"""Least privilege in Postgres: a peer's role can change only the rows of its own peer."""

from datetime import UTC, datetime

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.db_roles import peer_role
from irisfed.services.common.store import Store
from irisfed.shared.errors import PermanentStoreError
from irisfed.shared.lifecycle import JobState
from tests.infra.db_roles import as_role
from tests.infra.factories import assign_jobs, insert_jobs, make_job


async def _assigned(store, peer):
    job = make_job()
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], peer)
    return job.job_id


async def test_peer_role_changes_only_its_own_jobs(database_url, pool, roles):
    admin = Store(pool)
    mine = await _assigned(admin, "gpu-west")
    theirs = await _assigned(admin, "tpu-east")
    # Skip the schema check: it is what we test next, separately.
    gpu_pool = await dbmod.connect(as_role(database_url, peer_role("gpu-west")))
    try:
        gpu = Store(gpu_pool)
        assert mine in await gpu.job_start_batch("gpu-west", [(mine, 1, None, "running")])
        # invisible: the CAS finds no row
        assert await gpu.job_start_batch("gpu-west", [(theirs, 1, None, "stolen")]) == {}
        assert await gpu.job_get(theirs) is None
        # job_get joins the explanations: it works for an agent, which sees none of them
        # (they name other peers and what they lack).
        own = await gpu.job_get(mine)
        assert own is not None and own.explanation is None
        assert (await admin.job_get(mine)).explanation is not None
        assert await gpu_pool.fetchval("SELECT count(*) FROM job_explanations") == 0
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute("INSERT INTO job_explanations (key, explanation) VALUES ('k', '{}')")
        assert [r.job_id for r in await gpu.job_list_live_for_owner("tpu-east")] == []
        # Jobs change only through the agent functions (migration 0004), never directly.
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute("UPDATE jobs SET reason = 'pwned' WHERE job_id = $1", theirs)
        # It may hand its own job back to the queue, but never to another peer.
        assert await gpu.job_end_run("gpu-west", mine, 1, JobState.QUEUED, "handed back") is not None
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute("UPDATE jobs SET owner_peer_id = 'tpu-east' WHERE job_id = $1", mine)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute(
                "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
                "VALUES ('x', '{}', 'h', 'queued', 'queue')")
        with pytest.raises(PermanentStoreError) as refused:  # the store's words for it
            await gpu.peer_heartbeat_upsert("tpu-east", "r", 1, [], 6.0, datetime.now(UTC))
        assert (refused.value.sqlstate, refused.value.error_class) == ("42501", "InsufficientPrivilegeError")
        await gpu.peer_heartbeat_upsert("gpu-west", "r", 1, [], 6.0, datetime.now(UTC))
        with pytest.raises(PermanentStoreError) as refused:
            await gpu.sync_state_upsert(theirs, "tpu-east", 1, 1)
        assert refused.value.sqlstate == "42501"  # insufficient privilege
    finally:
        await gpu_pool.close()
    row = await admin.job_get(theirs)
    assert (row.state, row.reason) == ("assigned", "assigned to tpu-east")


async def test_router_and_tick_roles_have_only_what_they_use(database_url, pool, roles):
    router = await asyncpg.connect(as_role(database_url, "irisfed_svc_router"))
    try:
        await dbmod.check_schema(router)  # services can still verify the schema head
        assert await router.fetchval("SELECT count(*) FROM peer_heartbeat") == 0
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await router.execute("DELETE FROM jobs")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await router.execute("UPDATE peer_heartbeat SET seq = 0")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await router.execute("SELECT * FROM federation_sync_state")
        await router.execute("INSERT INTO job_explanations (key, explanation) VALUES ('r', '{}')")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await router.execute("DELETE FROM job_explanations")
    finally:
        await router.close()
    tick = await asyncpg.connect(as_role(database_url, "irisfed_svc_tick"))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await tick.execute(
                "INSERT INTO jobs (job_id, spec, spec_hash, state, disposition) "
                "VALUES ('x', '{}', 'h', 'queued', 'queue')")
    finally:
        await tick.close()
    assert set(roles) == {"irisfed_svc_router", "irisfed_svc_tick", "irisfed_svc_web", "irisfed_peer_home",
                          "irisfed_peer_gpu-west", "irisfed_peer_tpu-east"}


async def test_the_web_role_reads_every_row_and_writes_none(database_url, pool, roles):
    admin = Store(pool)
    theirs = await _assigned(admin, "gpu-west")
    queued = make_job()
    await insert_jobs(admin, [queued])
    await admin.peer_heartbeat_upsert("gpu-west", "run", 1, [], 5.0, datetime.now(UTC))
    web = await asyncpg.connect(as_role(database_url, "irisfed_svc_web"))
    try:
        await dbmod.check_schema(web)  # it starts like the other services
        assert {r["job_id"] for r in await web.fetch("SELECT job_id FROM jobs")} == {theirs, queued.job_id}
        assert await web.fetchval("SELECT count(*) FROM federation_changelog") >= 3
        assert await web.fetchval("SELECT count(*) FROM peer_heartbeat") == 1
        assert await web.fetchval("SELECT count(*) FROM job_explanations") >= 1  # the dashboard's job page joins it
        await web.fetch("SELECT * FROM federation_sync_state")
        for statement in ("UPDATE jobs SET reason = 'x'", "DELETE FROM jobs",
                          f"INSERT INTO federation_changelog (job_id, to_state, epoch, actor) "
                          f"VALUES ('{theirs}', 'killed', 1, 'web')",
                          "UPDATE peer_heartbeat SET seq = 0", "DELETE FROM federation_sync_state",
                          "INSERT INTO job_explanations (key, explanation) VALUES ('w', '{}')",
                          "CREATE TABLE web_was_here (x int)"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await web.execute(statement)
    finally:
        await web.close()
    assert (await admin.job_get(theirs)).reason != "x"
