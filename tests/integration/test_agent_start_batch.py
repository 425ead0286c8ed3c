"""The peer agent's start batch and its leftover runs, against the real Postgres.

NATS is a stub here on purpose: what is tested is the agent's own handling of a
publish that fails (a fault a real server cannot be made to produce at an exact
point of the loop); every database effect is real.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from irisfed.services.common.store import Store
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from tests.infra.factories import assign_jobs, insert_jobs, make_config, make_job
from tests.infra.flaky_nats import FlakyNats
from tests.infra.probes import alive, kill_group, returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _agent(pool, nc, tmp_path: Path, kind: str, slots: int = 4) -> PeerAgent:
    settings = AgentSettings(peer_id="gpu-west", backends=(BackendSpec("main", kind, {}, slots),),
                             work_root=tmp_path / "work", kill_grace_s=1.0, reconcile_interval_s=0.2)
    return PeerAgent(make_config(), pool, nc, settings)


async def _assigned(store: Store, pool, *jobs) -> None:
    await insert_jobs(store, list(jobs))
    moved = await assign_jobs(store, list(jobs), "gpu-west")
    assert len(moved) == len(jobs)


async def test_a_publish_failing_mid_batch_still_launches_every_accepted_job(pool, tmp_path):
    store = Store(pool)
    jobs = [make_job(labels={"sim.duration_s": "30"}) for _ in range(3)]
    await _assigned(store, pool, *jobs)
    nc = FlakyNats(ok=1)
    agent = _agent(pool, nc, tmp_path, "simulated")
    try:
        await agent.reconcile()  # accepts all three in one batch; the second publish fails
        for job in jobs:
            row = await store.job_get(job.job_id)
            assert (row.state, row.owner_peer_id) == ("running", "gpu-west")
            run = agent.runs.get(job.job_id)
            assert run is not None and run.handle is not None and not run.launch_error, job.job_id
        assert len(nc.published) == 1
    finally:
        await agent.close()


async def _crash(agent: PeerAgent) -> None:
    """What SIGKILL leaves: the agent's tasks gone, its runs (own sessions) still running."""
    await agent.tasks.close()


async def test_a_restarted_agent_kills_leftovers_it_no_longer_owns_and_recovers_the_rest(pool, tmp_path):
    store = Store(pool)
    moved_away, still_ours = make_job(command=["sleep", "300"]), make_job(command=["sleep", "300"], max_retries=1)
    await _assigned(store, pool, moved_away, still_ours)
    first = _agent(pool, FlakyNats(ok=10**6), tmp_path, "subprocess")
    await first.reconcile()
    pids = {}
    for job in (moved_away, still_ours):
        row = await store.job_get(job.job_id)
        assert row.state == "running"
        pids[job.job_id] = int((Path(row.log_dir) / "pid").read_text())
    try:
        await _crash(first)
        # The peer is lost meanwhile: one job is requeued and placed elsewhere (epoch 3).
        assert await store.job_move(Move(moved_away.job_id, JobState.RUNNING, JobState.QUEUED, 1, "tick", None,
                                         new_epoch=2, reason="peer lost"))
        assert await assign_jobs(store, [moved_away], "tpu-east", epoch=2)

        second = _agent(pool, FlakyNats(ok=10**6), tmp_path, "subprocess")
        try:
            await second.reconcile()
            # Not ours any more: killed and recorded as a stale copy.
            await wait_for(lambda: returns(not alive(pids[moved_away.job_id])), "the moved job's copy to die")
            sync = {r.peer_id: r for r in await store.sync_state_get(moved_away.job_id)}
            assert sync["gpu-west"].note == "stale copy killed: epoch 1 superseded by 3"
            # Still ours at the same epoch: orphan recovery, as before (killed, requeued).
            await wait_for(lambda: returns(not alive(pids[still_ours.job_id])), "the orphan's copy to die")
            row = await store.job_get(still_ours.job_id)
            assert (row.state, row.epoch) == ("queued", 2)
            assert await second.backends["main"].list_runs() == []
        finally:
            await second.close()
    finally:
        for pid in pids.values():
            kill_group(pid)
