"""A peer agent and its gangs against the real Postgres (simulated backend, in process):
a gang stays ``assigned`` until all its tasks run, is then accepted (``running``) with
its tasks recorded; one whose tasks do not all start within the start timeout is handed
back whole (a retry) or, out of retries, fails; the node groups it advertises; the
``--node`` flag."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from irisfed.services.common.store import Store
from irisfed.services.peer_agent.flags import add_flags, parse_node_flags, settings
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.config import NodeSpec
from irisfed.shared.errors import ConfigError
from irisfed.shared.lifecycle import JobState
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import assign_jobs, insert_jobs, make_config, make_job
from tests.infra.waiting import wait_for

SLICES = (NodeSpec(2, {"cpu": 1}, {"slice": ("a",)}), NodeSpec(2, {"cpu": 1}, {"slice": ("b",)}))


@contextlib.asynccontextmanager
async def agent_for(pool, nc, prefix: str, tmp_path, timeout_s: float = 30.0) -> AsyncIterator[PeerAgent]:
    """A started agent (its loops running: reconcile every 50 ms, reports at once); closed
    at the end."""
    spec = BackendSpec("main", "simulated", {}, 8, {}, nodes=SLICES)
    agent = PeerAgent(make_config(subject_prefix=prefix), pool, nc,
                      AgentSettings(peer_id="gpu-west", backends=(spec,), work_root=tmp_path / "work",
                                    reconcile_interval_s=0.05, report_linger_s=0.0, gang_start_timeout_s=timeout_s))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.close()


def gang(replicas: int = 2, seconds: float = 0.5, **fields):
    """A simulated gang of ``seconds``; one of two tasks shares a slice."""
    coschedule = {"coschedule": {"group_by": "slice"}} if replicas == 2 else {}
    return make_job(replicas=replicas, labels={"sim.duration_s": str(seconds)}, **coschedule, **fields)


async def state_of(store: Store, job_id: str):
    return (await store.job_get(job_id)).state


async def test_a_gang_is_running_only_once_its_tasks_all_run(pool, nats_client, subject_prefix, tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path) as agent:
        hogs = [gang(seconds=30) for _ in range(2)]  # both slices busy
        waiting = gang(seconds=0.1)
        await insert_jobs(store, [*hogs, waiting])
        await assign_jobs(store, hogs, "gpu-west")
        await agent.reconcile()
        for hog in hogs:
            await wait_for(lambda hog=hog: _is_running(store, hog.job_id), "a hog gang to run")
        await assign_jobs(store, [waiting], "gpu-west")  # given once both hogs hold their slices
        await agent.reconcile()
        assert await state_of(store, waiting.job_id) is JobState.ASSIGNED  # launched, waiting for nodes
        assert await store.job_tasks_list(waiting.job_id) == []
        (ad,) = agent.advertisement()
        assert sum(g.count for g in ad.nodes) == 4
        assert all(v.free == 0 for g in ad.nodes for v in g.resources.values())
        for run in (agent.runs[h.job_id] for h in hogs):
            await run.handle.kill(0.0)  # the hogs end: the waiting gang gets a slice
        await wait_for(lambda: _is_state(store, waiting.job_id, JobState.SUCCEEDED), "the waiting gang to succeed")
        history = [(r.from_state, r.to_state) for r in await store.changelog_list_for_job(waiting.job_id)]
        assert history[-2:] == [(JobState.ASSIGNED, JobState.RUNNING), (JobState.RUNNING, JobState.SUCCEEDED)]
        tasks = await store.job_tasks_list(waiting.job_id)
        assert [(t.task_index, t.state) for t in tasks] == [(0, "succeeded"), (1, "succeeded")]
        assert len({t.node for t in tasks}) == 2
        await assert_changelog_replays(store)


async def test_tasks_not_all_started_in_time_hand_the_gang_back_whole_then_fail_it(pool, nats_client, subject_prefix,
                                                                                  tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path, timeout_s=0.3) as agent:
        hog = gang(replicas=4, seconds=60, max_retries=0)  # takes every node
        late = gang(max_retries=1)
        await insert_jobs(store, [hog, late])
        await assign_jobs(store, [hog], "gpu-west")
        await agent.reconcile()
        await wait_for(lambda: _is_running(store, hog.job_id), "the hog to run")
        await assign_jobs(store, [late], "gpu-west")  # placed on a stale view: no node is free
        await agent.reconcile()
        row = await wait_for(lambda: _is_state(store, late.job_id, JobState.QUEUED), "the late gang handed back")
        assert (row.epoch, row.owner_peer_id, row.attempts) == (2, None, 1), row
        assert "did not all start within 0.3s" in row.reason and row.reason.endswith("retrying")
        handed = (await store.changelog_list_for_job(late.job_id))[-1]
        assert (handed.from_state, handed.to_state, handed.actor) == (JobState.ASSIGNED, JobState.QUEUED, "gpu-west")
        assert all(t.state == "lost" for t in await store.job_tasks_list(late.job_id))
        # Placed there again (epoch 3) and still no room: out of retries, it fails.
        await assign_jobs(store, [late], "gpu-west", epoch=2)
        await agent.reconcile()
        row = await wait_for(lambda: _is_state(store, late.job_id, JobState.FAILED), "the late gang to fail")
        assert row.attempts == 2 and row.reason.endswith("no retries left"), row
        await assert_changelog_replays(store)


async def test_a_gang_cancelled_while_its_tasks_wait_never_runs(pool, nats_client, subject_prefix, tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path) as agent:
        hog = gang(replicas=4, seconds=60)
        late = gang()
        await insert_jobs(store, [hog, late])
        await assign_jobs(store, [hog, late], "gpu-west")
        await agent.reconcile()
        await wait_for(lambda: _is_running(store, hog.job_id), "the hog to run")
        # The router's cancel of an assigned job: killed at once, its owner told.
        from irisfed.shared.records import Move
        async with store.transaction() as tx:
            assert await tx.job_move(Move(late.job_id, JobState.ASSIGNED, JobState.KILLED, 1, actor="router",
                                          owner_peer_id="gpu-west", reason="cancelled by user default")) is not None
        await agent.reconcile()  # fences the launched, not yet accepted gang
        await wait_for(lambda: _gone(agent, late.job_id), "its run to end")
        assert await state_of(store, late.job_id) is JobState.KILLED
        assert [r.to_state for r in await store.changelog_list_for_job(late.job_id)] == [
            JobState.QUEUED, JobState.ASSIGNED, JobState.KILLED]  # never running


def test_node_flags_parse_and_refuse_what_would_not_work():
    assert parse_node_flags(["4:cpu=2,gpu=1:slice=v5e-a", "1"]) == (
        NodeSpec(4, {"cpu": 2.0, "gpu": 1.0}, {"slice": ("v5e-a",)}), NodeSpec(1, {}, {}))
    for bad in (["x:cpu=1"], ["0:cpu=1"], ["2:cpu=-1"], ["2:GPU=1"], ["2:cpu=1:slice"], ["2:cpu=1:=a"]):
        with pytest.raises(ConfigError):
            parse_node_flags(bad)
    parser = argparse.ArgumentParser()
    add_flags(parser)
    config = make_config(peers=[{"id": "home"}, {"id": "gpu-west", "nodes": [{"count": 2, "resources": {"cpu": 4}}],
                                                 "gang_start_timeout_s": 12}])
    made = settings(parser.parse_args(["--peer-id", "gpu-west"]), config)
    assert made.backends[0].nodes == (NodeSpec(2, {"cpu": 4.0}, {}),) and made.gang_start_timeout_s == 12
    with pytest.raises(ConfigError, match="reports its own nodes"):
        settings(parser.parse_args(["--peer-id", "gpu-west", "--backend", "ray", "--ray-address", "http://h:1",
                                    "--node", "2:cpu=1"]), config)
    with pytest.raises(ConfigError, match="unknown keys"):
        make_config(peers=[{"id": "home", "nodes": [{"count": 1, "gpus": 2}]}])


async def _is_running(store: Store, job_id: str):
    return await _is_state(store, job_id, JobState.RUNNING)


async def _is_state(store: Store, job_id: str, state: JobState):
    row = await store.job_get(job_id)
    return row if row.state is state else None


async def _gone(agent: PeerAgent, job_id: str) -> bool:
    await asyncio.sleep(0)
    return job_id not in agent.runs
