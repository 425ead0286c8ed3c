"""A federation of real service subprocesses against the session's real servers.

Each test gets its own database and subject prefix, short heartbeats so fault
tests are quick, and, when it ends, every process stopped by PID and the
changelog-replay invariant checked. Processes start through the one harness
(``irisfed.tooling.federation``) that ``irisfed up``, chaos and bench use too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.logstore import ensure_log_streams
from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState
from irisfed.tooling.federation import (
    LocalFederation,
    Peer,
    Supervisor,
    harness_env,
    login_role_urls,
)
from irisfed.tooling.ha import PatroniCluster, ha_available, start_patroni
from irisfed.tooling.invariants import assert_changelog_replays
from irisfed.tooling.proxy import TcpProxy
from tests.engines.fixtures import _unavailable
from tests.infra.configs import federation_config
from tests.infra.waiting import wait_for


def interrupt_and_collect(process: subprocess.Popen, timeout: float = 120.0) -> str:
    """SIGINT ``process`` (``irisfed up``) and return the rest of its output. If it does
    not stop, SIGTERM (then SIGKILL) before failing: a failing test must never leave
    it and its services running for the rest of the suite."""
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        raise

ROOT = Path(__file__).resolve().parents[2]  # the checkout: README, examples, docs
TERMINAL = TERMINAL_STATES

PEERS = {
    "home": {"device_type": "cpu"},
    "gpu-west": {"device_type": "gpu", "device_variant": "h100"},
    "tpu-east": {"device_type": "tpu"},
    "gpu-east": {"device_type": "gpu", "device_variant": "a100"},
}


def config_text(prefix: str) -> str:
    return federation_config([Peer(peer_id, attrs, slots=2) for peer_id, attrs in PEERS.items()], prefix)


class Federation(LocalFederation):
    """Start, stop and crash services; submit and wait like a user would."""

    def __init__(self, tmp: Path, database_url: str, nats_url: str, prefix: str, nats, store: Store,
                 auth=None) -> None:
        super().__init__(Supervisor(tmp), tmp / "federation.toml", database_url, nats_url, auth=auth,
                         env=harness_env(IRISFED_CONFIG=str(tmp / "federation.toml")), work_dir=tmp / "work",
                         args=["--log-level", "debug"], cwd=tmp)
        self.tmp = tmp
        self.prefix = prefix
        self.nats = nats
        self.store = store

    def configure(self, peers: list[Peer], **timings) -> None:
        """Write this federation's config: ``peers`` on its subject prefix, with
        ``federation_config``'s short timings (``ttl_s=``, ``grace_s=`` ... change them)."""
        self.config_path.write_text(federation_config(peers, self.prefix, **timings))

    async def ensure_buckets(self) -> None:
        """The object store's buckets for this federation's users and peers (what `irisfed up` does)."""
        from irisfed.services.common.objects import ensure_buckets

        await ensure_buckets(self.nats, self.prefix, peers=list(PEERS))

    @property
    def proxies(self) -> list[TcpProxy]:
        return self.supervisor.proxies

    async def use_db_roles(self) -> None:
        """Run services started from now on as their least-privilege login roles.

        What `irisfed db-roles` sets up: ``irisfed_svc_router``, ``irisfed_svc_tick`` and
        one ``irisfed_peer_<id>`` per peer, each with its own password in its URL.
        """
        import asyncpg

        from irisfed.services.common.db_roles import apply_roles
        from irisfed.shared.config import load_config

        config = load_config(self.config_path)
        conn = await asyncpg.connect(self.database_url)
        try:
            passwords = await apply_roles(conn, config)
        finally:
            await conn.close()
        self.db_urls = login_role_urls(self.database_url, config.peer_ids, passwords)

    @property
    def env(self) -> dict[str, str]:
        """What the CLI runs with: the admin's Postgres URL and the operator's NATS user."""
        return harness_env(IRISFED_DATABASE_URL=self.database_url, IRISFED_NATS_URL=self.nats_url_for("operator"),
                           IRISFED_CONFIG=str(self.config_path))

    def stop(self, name: str) -> int:
        return self.supervisor.stop(name, timeout=20)

    def start_behind_proxies(self, name: str, *extra: str) -> tuple[TcpProxy, TcpProxy]:
        """Start an agent whose NATS and Postgres connections go through proxies."""
        nats_proxy, db_proxy = self.supervisor.proxy(self.nats_url), self.supervisor.proxy(self.database_url)
        self.start(name, *extra, env={"IRISFED_NATS_URL": nats_proxy.url_for(self.nats_url_for(f"agent-{name}")),
                                      "IRISFED_DATABASE_URL": db_proxy.url_for(self.database_url_for(name))})
        return nats_proxy, db_proxy

    def kill(self, name: str) -> None:
        """Crash a service (SIGKILL): no clean-up of any kind."""
        self.supervisor.kill(name)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    async def start_federation(self, *agents: str | tuple[str, ...]) -> None:
        """Router, tick and ``agents`` (a peer id, or ``(peer_id, *flags)``), and wait until each serves."""
        started = [(agent,) if isinstance(agent, str) else agent for agent in agents]
        self.start("router")
        self.start("tick")
        for peer_id, *flags in started:
            self.start(peer_id, *flags)
        await self.wait_router()
        for peer_id, *_ in started:
            await self.wait_agent(peer_id)

    async def wait_router(self) -> None:
        async def answered():
            reply = await self.request("cancel", {"job_id": "readiness-probe"})
            return reply is not None
        await wait_for(answered, "the router to answer")

    async def wait_agent(self, peer_id: str) -> None:
        async def advertised():
            rows = await self.store.peer_heartbeat_list()
            return any(r.peer_id == peer_id and r.reachable for r in rows)
        await wait_for(advertised, f"{peer_id} to advertise")

    async def request(self, verb: str, body: dict | bytes, timeout: float = 2.0) -> dict | None:
        import nats

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            reply = await self.nats.request(f"{self.prefix}.{verb}", data, timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return None
        return json.loads(reply.data)

    async def submit(self, body: dict) -> dict:
        reply = await wait_for(lambda: self.request("submit", body), "a submit reply")
        return reply

    async def cancel(self, job_id: str) -> dict:
        return await wait_for(lambda: self.request("cancel", {"job_id": job_id}), "a cancel reply")

    async def job(self, job_id: str):
        return await self.store.job_get(job_id)

    async def wait_state(self, job_id: str, *states: str, timeout: float = 60.0):
        async def reached():
            job = await self.store.job_get(job_id)
            return job if job is not None and job.state in states else None
        return await wait_for(reached, f"{job_id} to reach {states}", timeout=timeout)

    async def run_pid(self, job_id: str) -> int:
        """The pid of the job's running process (the agent writes it just after launch)."""
        job = await self.wait_state(job_id, JobState.RUNNING)
        pid_file = Path(job.log_dir) / "pid"

        async def written():
            try:
                return int(pid_file.read_text())
            except (OSError, ValueError):
                return None
        return await wait_for(written, f"{job_id}'s pid file")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "irisfed.cli", *args], env=self.env, cwd=self.tmp,
            capture_output=True, text=True, timeout=60, check=False,
        )

    def close(self) -> None:
        self.supervisor.close()


@pytest.fixture
async def federation(tmp_path, database_url, servers, subject_prefix, nats_client):
    pool = await dbmod.connect(database_url, max_size=4)
    fed = Federation(tmp_path, database_url, servers.nats_plain_url or servers.nats_url, subject_prefix,
                     nats_client, Store(pool), auth=servers.nats_auth)
    fed.config_path.write_text(config_text(subject_prefix))
    await ensure_log_streams(nats_client, subject_prefix, list(PEERS))  # as `irisfed up` does
    try:
        yield fed
    finally:
        fed.close()
        try:
            await assert_changelog_replays(fed.store)
        finally:
            await pool.close()


@pytest.fixture(scope="module")
def patroni(tmp_path_factory) -> PatroniCluster:
    """A Patroni cluster (a primary, a synchronous standby, etcd) started once for each
    test module that asks for it (~12 s), stopped when the module ends; tests/infra/ha.py
    makes it healthy again between tests. Skipped (failed under CI) without Patroni."""
    why = ha_available()
    if why:
        _unavailable(why)
    cluster = start_patroni(tmp_path_factory.mktemp("patroni"))
    try:
        yield cluster
    finally:
        cluster.stop()
