"""A nats-server that hangs (SIGSTOP) instead of resetting, with a real router, agent
and Postgres: no request waits past its own timeout, Postgres still gets what the
agent did, and once the server runs again a retried submit finds the one job, which
runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import nats
import pytest

from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.services.router.service import Router, RouterSettings
from irisfed.tooling.invariants import assert_changelog_replays
from irisfed.tooling.servers import start_nats
from tests.infra.factories import make_config
from tests.infra.probes import ask, changelog_of, in_state, returns
from tests.infra.waiting import wait_for

WAIT_S = 30  # bounds a hang on a slow machine; never an assertion about time






async def test_a_sigstopped_nats_server_loses_nothing_and_runs_nothing_twice(pool, tmp_path, subject_prefix):
    """nats-server stopped (not killed) while a producer submits and an agent finishes a
    job: the producer's request gives up at its own timeout (no hang past it), the agent
    writes its result to Postgres regardless, and after SIGCONT the retried submit is a
    duplicate of the one job, which ran once."""
    server = start_nats(tmp_path / "nats")
    store = Store(pool)
    config = make_config(subject_prefix=subject_prefix)
    svc = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    agent_nc = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    producer = await connect_client(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    router = Router(config, pool, svc, RouterSettings(writers=1))
    agent = PeerAgent(config, pool, agent_nc, AgentSettings(
        peer_id="home", backends=(BackendSpec("main", "simulated", {}, 4),), work_root=tmp_path / "work",
        heartbeat_interval_s=0.1, heartbeat_ttl_s=1.0, reconcile_interval_s=0.2, simulated_duration_s=0.5))
    stopped = False
    try:
        await agent.start()
        await router.start()
        await wait_for(lambda: returns("home" in router.view.reachable_ids()), "the local agent heard")
        running = await ask(producer, subject_prefix, "submit", {"job_id": "stopped-nats-a", "command": ["true"]})
        assert running["disposition"] == "local"
        await wait_for(lambda: in_state(store, "stopped-nats-a", "running"), "the first job running")
        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        # The agent finishes its job while NATS hangs: Postgres gets it anyway.
        await wait_for(lambda: in_state(store, "stopped-nats-a", "succeeded"), "the finish written while NATS hangs")
        body = {"job_id": "stopped-nats-b", "command": ["true"]}
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await asyncio.wait_for(producer.request(f"{subject_prefix}.submit", json.dumps(body).encode(),
                                                    timeout=1.0), WAIT_S)
        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        reply = await wait_for(lambda: _retry(producer, subject_prefix, body), "the retried submit answered")
        assert reply["job_id"] == "stopped-nats-b" and "error" not in reply
        await wait_for(lambda: in_state(store, "stopped-nats-b", "succeeded"), "the second job run")
        for job_id in ("stopped-nats-a", "stopped-nats-b"):
            history = [(r[1], r[2]) for r in await changelog_of(pool, job_id)]
            assert history.count(("assigned", "running")) == 1, history
            assert (await store.job_get(job_id)).attempts == 1
        assert await pool.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE 'stopped-nats-%'") == 2
        await assert_changelog_replays(store)
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            await router.close()
        with contextlib.suppress(Exception):
            await agent.close()
        for nc in (producer, agent_nc, svc):
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()


async def _retry(nc, prefix: str, body: dict) -> dict | None:
    try:
        reply = json.loads((await nc.request(f"{prefix}.submit", json.dumps(body).encode(), timeout=2.0)).data)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
        return None
    return None if reply.get("error", {}).get("code") == "unavailable" else reply
