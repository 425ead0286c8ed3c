"""What a peer agent may do in Postgres under `irisfed db-roles` (migration 0004).

Agents change jobs only through narrowly scoped functions: accept, finish, and hand
back / fail / kill their own running jobs, each a compare-and-set that writes the
changelog row (actor: the peer itself) and the sync state in the same statement.
They have no direct INSERT/UPDATE on `jobs` or `federation_changelog`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common import metrics
from irisfed.services.common.db_roles import apply_roles, peer_role
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.report import Run
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.errors import PermanentStoreError
from irisfed.shared.lifecycle import JobState
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.db_roles import as_role
from tests.infra.factories import (
    assign_jobs,
    insert_jobs,
    make_config,
    make_job,
    running_job,
)
from tests.infra.waiting import wait_for


@pytest.fixture
async def gpu_pool(database_url, roles):
    pool = await dbmod.connect(as_role(database_url, peer_role("gpu-west")), max_size=4)
    yield pool
    await pool.close()


def _agent(pool, nats_client, subject_prefix, tmp_path: Path, peer: str = "gpu-west") -> PeerAgent:
    settings = AgentSettings(peer, (BackendSpec("main", "subprocess", {}, 2),), work_root=tmp_path / "work",
                             reconcile_interval_s=0.1, report_linger_s=0.0)
    return PeerAgent(make_config(subject_prefix=subject_prefix), pool, nats_client, settings)


async def _poison(admin_pool, job_id: str) -> None:
    """Make every write of ``job_id``'s sync state fail with a permanent error."""
    await admin_pool.execute(f"""
        CREATE FUNCTION test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.job_id = '{job_id}' THEN
                RAISE EXCEPTION 'poisoned row' USING ERRCODE = 'insufficient_privilege';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER test_poison BEFORE INSERT OR UPDATE ON federation_sync_state
            FOR EACH ROW EXECUTE FUNCTION test_poison();
    """)


async def test_agent_role_requeues_fails_and_kills_its_own_running_jobs(
        pool, gpu_pool, nats_client, subject_prefix, tmp_path):
    admin, gpu = Store(pool), Store(gpu_pool)
    retried = await running_job(admin, "gpu-west", gpu, max_retries=1)
    out_of_retries = await running_job(admin, "gpu-west", gpu, max_retries=0)
    cancelled = await running_job(admin, "gpu-west", gpu, max_retries=3)
    launch_failed = await running_job(admin, "gpu-west", gpu, max_retries=2)
    await admin.job_request_cancel(cancelled)
    agent = _agent(gpu_pool, nats_client, subject_prefix, tmp_path)
    # A restarted agent finds three running jobs it has no process for.
    rows = {r.job_id: r for r in await gpu.job_list_live_for_owner("gpu-west")}
    for job_id in (retried, out_of_retries, cancelled):
        await agent._recover_orphan(rows[job_id])
    # A launch error on a job with retries left hands it back to the queue.
    run = Run(launch_failed, 1, "main", exit_code=-1, launch_error="no such program")
    agent.runs[launch_failed] = run
    await agent.reports.report([run])

    expected = {
        retried: ("queued", 2, None),
        out_of_retries: ("queued", 2, None),  # its agent's restart spends no retry (docs/design.md §3.7)
        cancelled: ("killed", 1, "gpu-west"),
        launch_failed: ("queued", 2, None),
    }
    for job_id, (state, epoch, owner) in expected.items():
        job = await admin.job_get(job_id)
        assert (job.state, job.epoch, job.owner_peer_id) == (state, epoch, owner), job_id
        last = (await admin.changelog_list_for_job(job_id))[-1]
        assert (last.from_state, last.to_state, last.actor, last.epoch) == \
            ("running", state, "gpu-west", epoch)
        [sync] = await admin.sync_state_get(job_id)
        assert (sync.peer_id, sync.changelog_seq, sync.epoch) == ("gpu-west", last.seq, epoch)
    assert (await admin.job_get(retried)).cancel_requested is False
    assert [(await admin.job_get(j)).restarts for j in (retried, out_of_retries, cancelled, launch_failed)] == [
        1, 1, 0, 0]
    assert agent.runs == {}
    # Handed back: the agent no longer sees the row, but still reads its history and
    # may leave a note in its own sync state (what a fenced stale copy does).
    assert await gpu.job_get(retried) is None
    assert (await gpu.changelog_get_last_for_job(retried)).to_state == "queued"
    await agent.reports.record_fenced(retried, 1)
    [sync] = await admin.sync_state_get(retried)
    assert sync.note == "stale copy killed: epoch 1 superseded by 2"
    await assert_changelog_replays(admin)


async def test_agent_moves_only_its_own_jobs_and_only_in_its_own_name(pool, gpu_pool):
    admin, gpu = Store(pool), Store(gpu_pool)
    theirs = await running_job(admin, "tpu-east")
    assigned = make_job()
    await insert_jobs(admin, [assigned])
    await assign_jobs(admin, [assigned], "tpu-east")
    # Claiming to be another peer is refused outright.
    for refused in (gpu.job_start_batch("tpu-east", [(assigned.job_id, 1, None, "stolen")]),
                    gpu.job_finish_batch("tpu-east", [(theirs, 1, 0, False)]),
                    gpu.job_end_run("tpu-east", theirs, 1, JobState.QUEUED, "stolen")):
        with pytest.raises(PermanentStoreError) as caught:
            await refused
        assert caught.value.error_class == "InsufficientPrivilegeError"
    # In its own name, another peer's job is simply not there: the CAS finds nothing.
    assert await gpu.job_end_run("gpu-west", theirs, 1, JobState.FAILED, "stolen") is None
    assert await gpu.job_start_batch("gpu-west", [(assigned.job_id, 1, None, "x")]) == {}
    assert await gpu.job_finish_batch("gpu-west", [(theirs, 1, 0, False)]) == {}
    # Only the moves an agent makes this way: not back to assigned, not succeeded (only
    # a finish with exit code 0 is), and nothing but a state name.
    mine = await running_job(admin, "gpu-west", gpu)
    for bad in ("assigned", "running", "succeeded", "rejected", None):
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await gpu_pool.fetchval("SELECT irisfed_job_end_run('gpu-west', $1, 1, $2, 'nope')", mine, bad)
    # The admin (migration owner: no roles set up) may act for any peer.
    assert await admin.job_end_run("tpu-east", theirs, 1, JobState.QUEUED, "handed back") is not None
    job = await admin.job_get(theirs)
    assert (job.state, job.epoch, job.owner_peer_id, job.backend) == ("queued", 2, None, None)
    assert (await admin.job_get(assigned.job_id)).state == "assigned"
    assert (await admin.job_get(mine)).state == "running"
    await assert_changelog_replays(admin)


async def test_agent_frees_only_its_own_preempted_jobs(pool, gpu_pool):
    """A preempted job waits for its old run's peer to say the run is gone: another
    peer cannot say it for it (a job would run twice), and none can free a job that
    is not waiting (its stopping_on is all the function writes)."""
    admin, gpu = Store(pool), Store(gpu_pool)
    east_run = await running_job(admin, "tpu-east")
    west_run = await running_job(admin, "gpu-west", gpu)
    await pool.execute("UPDATE jobs SET state = 'queued', epoch = epoch + 1, owner_peer_id = NULL, "
                       "stopping_on = CASE job_id WHEN $1 THEN 'tpu-east' ELSE 'gpu-west' END "
                       "WHERE job_id = ANY($2)", east_run, [east_run, west_run])
    with pytest.raises(PermanentStoreError) as caught:
        await gpu.job_runs_stopped("tpu-east", [east_run])
    assert caught.value.error_class == "InsufficientPrivilegeError"
    assert await gpu.job_runs_stopped("gpu-west", [east_run]) == []
    assert await gpu.job_runs_stopped("gpu-west", keep=[west_run]) == []  # still running here
    assert await gpu.job_runs_stopped("gpu-west") == [west_run]
    assert (await admin.job_get(east_run)).stopping_on == "tpu-east"
    assert not await pool.fetchval("SELECT has_function_privilege('irisfed_svc_router', "
                                   "'irisfed_job_runs_stopped(text, text[], text[])', 'EXECUTE')")


async def test_agent_role_cannot_write_jobs_or_history_directly(pool, gpu_pool):
    admin = Store(pool)
    mine = await running_job(admin, "gpu-west", Store(gpu_pool))
    theirs = await running_job(admin, "tpu-east")
    await admin.job_request_cancel(mine)
    before = await admin.changelog_list_all()
    forgeries = [
        # History for another peer's job, in the tick's name.
        ("INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor) "
         f"VALUES ('{theirs}', 'running', 'succeeded', NULL, 1, 'tick')"),
        # Even for its own job, in its own name: only the functions write history.
        ("INSERT INTO federation_changelog (job_id, from_state, to_state, peer_id, epoch, actor) "
         f"VALUES ('{mine}', 'running', 'succeeded', 'gpu-west', 1, 'gpu-west')"),
        # Rewrite its own rows: spec, epoch back to 0, cancel cleared.
        "UPDATE jobs SET spec = '{\"command\": [\"evil\"]}', epoch = 0, cancel_requested = false",
        f"UPDATE jobs SET state = 'succeeded' WHERE job_id = '{mine}'",
        "DELETE FROM jobs",
        "DELETE FROM federation_changelog",
    ]
    for statement in forgeries:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await gpu_pool.execute(statement)
    # The internal caller check is no entry point of its own.
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await gpu_pool.execute("SELECT irisfed_check_caller('tpu-east')")
    job = await admin.job_get(mine)
    assert (job.state, job.epoch, job.cancel_requested, job.spec["command"]) == \
        ("running", 1, True, ["true"])
    assert len(await admin.changelog_list_all()) == len(before)
    # What it does need still works: its own job, its heartbeat, a finish that honours the cancel.
    assert (await Store(gpu_pool).job_get(mine)).state == "running"
    moved = await Store(gpu_pool).job_finish_batch("gpu-west", [(mine, 1, 0, False)])
    assert moved[mine].state is JobState.KILLED


async def test_report_loop_sets_a_permanent_error_aside_and_reports_the_rest(
        pool, gpu_pool, nats_client, subject_prefix, tmp_path):
    admin, gpu = Store(pool), Store(gpu_pool)
    poisoned = await running_job(admin, "gpu-west", gpu)
    fine = await running_job(admin, "gpu-west", gpu)
    later = await running_job(admin, "gpu-west", gpu)
    await _poison(pool, poisoned)
    agent = _agent(gpu_pool, nats_client, subject_prefix, tmp_path)
    errors = metrics.AGENT_REPORT_ERRORS.labels("finish")
    counted = errors._value.get()
    loop = asyncio.create_task(agent.reports.loop(0.0, 0.1, agent.start_wanted.set))
    try:
        for job_id in (poisoned, fine):  # one batch: the bad row must not sink the other
            agent.runs[job_id] = run = Run(job_id, 1, "main", exit_code=0)
            agent.reports.finished.put_nowait(run)

        async def landed(job_id):
            return (await admin.job_get(job_id)).state == "succeeded"
        await wait_for(lambda: landed(fine), "the good run's report", timeout=10)
        agent.runs[later] = run = Run(later, 1, "main", exit_code=3)
        agent.reports.finished.put_nowait(run)
        await wait_for(lambda: _state_is(admin, later, "failed"), "a later run's report", timeout=10)
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
    assert (await admin.job_get(poisoned)).state == "running"  # set aside, not retried forever
    assert agent.runs == {}
    assert errors._value.get() == counted + 1


async def _state_is(store: Store, job_id: str, state: str) -> bool:
    return (await store.job_get(job_id)).state == state


async def test_a_permanent_error_recovering_an_orphan_does_not_stop_the_agent(
        pool, gpu_pool, nats_client, subject_prefix, tmp_path):
    admin, gpu = Store(pool), Store(gpu_pool)
    poisoned = await running_job(admin, "gpu-west", gpu, max_retries=1)
    fine = await running_job(admin, "gpu-west", gpu, max_retries=1)
    await _poison(pool, poisoned)
    agent = _agent(gpu_pool, nats_client, subject_prefix, tmp_path)
    errors = metrics.AGENT_REPORT_ERRORS.labels("orphan")
    counted = errors._value.get()
    await agent.reconcile()  # what start() does first
    assert (await admin.job_get(fine)).state == "queued"
    assert (await admin.job_get(poisoned)).state == "running"
    await agent.reconcile()  # set aside once, not retried (and logged) every interval
    assert agent.reconciled == 2
    assert errors._value.get() == counted + 1


async def test_migration_0004_downgrades_to_0003_and_back(empty_database_url):
    url = empty_database_url
    await asyncio.to_thread(dbmod.migrate, url)
    conn = await asyncpg.connect(url)
    try:
        await apply_roles(conn, make_config())
        functions = "SELECT count(*) FROM pg_proc WHERE proname LIKE 'irisfed_job_%'"
        # 0004's three, 0015's irisfed_job_runs_stopped, 0016's irisfed_job_tasks_report and _hand_back
        assert await conn.fetchval(functions) == 6
        await asyncio.to_thread(dbmod.downgrade, url, "0003")
        assert await conn.fetchval(functions) == 0
        # 0003's rights are back as they were.
        assert await conn.fetchval("SELECT has_table_privilege('irisfed_agent', 'jobs', 'UPDATE')")
        assert await conn.fetchval(
            "SELECT has_table_privilege('irisfed_agent', 'federation_changelog', 'INSERT')")
        await asyncio.to_thread(dbmod.migrate, url)
        assert await conn.fetchval(functions) == 6
        assert not await conn.fetchval("SELECT has_table_privilege('irisfed_agent', 'jobs', 'UPDATE')")
        assert await conn.fetchval("SELECT has_table_privilege('irisfed_agent', 'jobs', 'SELECT')")
        assert not await conn.fetchval(
            "SELECT has_table_privilege('irisfed_agent', 'federation_changelog', 'INSERT')")
        assert not await conn.fetchval(
            "SELECT has_function_privilege('irisfed_svc_router', 'irisfed_job_end_run("
            "text, text, bigint, text, text, integer, boolean)', 'EXECUTE')")
        assert await conn.fetchval(
            "SELECT has_function_privilege('irisfed_agent', 'irisfed_job_end_run("
            "text, text, bigint, text, text, integer, boolean)', 'EXECUTE')")
    finally:
        await conn.close()


async def test_a_migration_owner_without_superuser_may_act_for_any_peer(servers, empty_database_url):
    """Managed Postgres has no superuser: the role that migrated (the functions' owner)
    is what services use when no roles are set up, and it may act for every peer."""
    import uuid
    from urllib.parse import urlsplit

    owner = f"irisfed_owner_{uuid.uuid4().hex[:8]}"
    database = urlsplit(empty_database_url).path.lstrip("/")
    admin = await asyncpg.connect(empty_database_url)
    try:
        await admin.execute(f"CREATE ROLE {owner} LOGIN CREATEROLE")
        await admin.execute(f'ALTER DATABASE "{database}" OWNER TO {owner}')
        url = as_role(empty_database_url, owner)
        await asyncio.to_thread(dbmod.migrate, url)
        pool = await dbmod.connect(url, max_size=2)
        try:
            store = Store(pool)
            job_id = await running_job(store, "tpu-east")
            assert await store.job_end_run("tpu-east", job_id, 1, JobState.QUEUED, "handed back") is not None
            assert (await store.job_get(job_id)).epoch == 2
            async with pool.acquire() as conn:
                await apply_roles(conn, make_config())
            peer = await asyncpg.connect(as_role(empty_database_url, peer_role("gpu-west")))
            try:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await peer.fetchval("SELECT irisfed_job_end_run('tpu-east', $1, 2, 'failed', 'x')", job_id)
            finally:
                await peer.close()
        finally:
            await pool.close()
    finally:
        await admin.execute(f"REASSIGN OWNED BY {owner} TO CURRENT_USER")
        await admin.execute(f"DROP OWNED BY {owner}")
        await admin.close()
        # Its privileges in the template and other databases: none were granted there.
        conn = await asyncpg.connect(servers.database_url)
        try:
            await conn.execute(f"DROP ROLE {owner}")
        finally:
            await conn.close()
