"""A cancel racing with a gang's acceptance (real Postgres, the agent in process,
simulated backend): the router's cancel of an ``assigned`` gang (killed at once) lands
between the agent reading the row (assigned, its epoch) and its accepting CAS. The CAS
loses, the launched tasks are killed, the job ends ``killed`` once and never ``running``."""

from __future__ import annotations

from irisfed.services.common.store import Store
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.shared.config import NodeSpec
from irisfed.shared.lifecycle import JobState
from irisfed.shared.records import Move
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import assign_jobs, insert_jobs, make_config, make_job
from tests.infra.waiting import wait_for


async def agent_for(pool, nc, prefix: str, tmp_path) -> PeerAgent:
    spec = BackendSpec("main", "simulated", {}, 8, {}, nodes=(NodeSpec(4, {"cpu": 1}, {}),))
    agent = PeerAgent(make_config(subject_prefix=prefix), pool, nc,
                      AgentSettings(peer_id="gpu-west", backends=(spec,), work_root=tmp_path / "work",
                                    reconcile_interval_s=0.05, report_linger_s=0.0))
    await agent.start()
    return agent


def gang(seconds: float):
    return make_job(replicas=2, labels={"sim.duration_s": str(seconds)})


async def test_a_cancel_between_the_agents_read_and_its_accepting_cas_wins(pool, nats_client, subject_prefix,
                                                                          tmp_path, monkeypatch):
    store = Store(pool)
    agent = await agent_for(pool, nats_client, subject_prefix, tmp_path)
    job = gang(seconds=30)
    accept = agent.store.job_start_batch
    raced = []

    async def cancelled_first(peer, jobs):
        if any(j[0] == job.job_id for j in jobs) and not raced:
            async with store.transaction() as tx:  # the router's cancel of an assigned job
                raced.append(await tx.job_move(Move(job.job_id, JobState.ASSIGNED, JobState.KILLED, 1,
                                                    actor="router", owner_peer_id="gpu-west",
                                                    reason="cancelled by user default")))
        return await accept(peer, jobs)

    monkeypatch.setattr(agent.store, "job_start_batch", cancelled_first)
    try:
        await insert_jobs(store, [job])
        await assign_jobs(store, [job], "gpu-west")
        await agent.reconcile()

        async def gone():
            return raced and job.job_id not in agent.runs
        await wait_for(gone, "the gang's run to be fenced and end")
        assert raced[0] is not None
        row = await store.job_get(job.job_id)
        assert (row.state, row.epoch) == (JobState.KILLED, 1), row
        states = [r.to_state for r in await store.changelog_list_for_job(job.job_id)]
        assert states == [JobState.QUEUED, JobState.ASSIGNED, JobState.KILLED], states
        await assert_changelog_replays(store)
    finally:
        await agent.close()
