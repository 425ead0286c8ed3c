"""A federation of real service subprocesses against the session's real servers.

Each test gets its own database and subject prefix, short heartbeats so fault
tests are quick, and, when it ends, every process stopped by PID and the
changelog-replay invariant checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common import db as dbmod
from services.common.nats_auth import NatsAuth
from services.common.store import Store
from tests.infra.waiting import wait_for
from tooling.invariants import assert_changelog_replays
from tooling.proxy import TcpProxy, proxy_for

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"succeeded", "failed", "killed", "rejected", "unschedulable"}

PEERS = {
    "home": {"device_type": "cpu"},
    "gpu-west": {"device_type": "gpu", "device_variant": "h100"},
    "tpu-east": {"device_type": "tpu"},
    "gpu-east": {"device_type": "gpu", "device_variant": "a100"},
}


def config_text(prefix: str) -> str:
    lines = [
        'local_cluster = "home"',
        f'subject_prefix = "{prefix}"',
        "heartbeat_interval_s = 0.25",
        "heartbeat_ttl_s = 1.5",
        "tick_interval_s = 0.25",
        "assign_grace_s = 1.0",
    ]
    for peer_id, attrs in PEERS.items():
        inline = ", ".join(f'{k} = "{v}"' for k, v in attrs.items())
        lines += ["", "[[peers]]", f'id = "{peer_id}"', f"attributes = {{ {inline} }}", "slots = 2"]
    return "\n".join(lines) + "\n"


@dataclass
class Federation:
    """Start, stop and crash services; submit and wait like a user would."""

    tmp: Path
    database_url: str
    nats_url: str  # without credentials
    prefix: str
    nats: object
    store: Store
    auth: NatsAuth | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    proxies: list[TcpProxy] = field(default_factory=list)
    # Service name → the Postgres URL of its own login role (after use_db_roles()).
    db_urls: dict[str, str] = field(default_factory=dict)

    def nats_url_for(self, role: str) -> str:
        return self.auth.url(self.nats_url, role) if self.auth else self.nats_url

    def database_url_for(self, name: str) -> str:
        """The Postgres URL service ``name`` connects with (the admin's unless roles are on)."""
        return self.db_urls.get(name, self.database_url)

    async def use_db_roles(self) -> None:
        """Run services started from now on as their least-privilege login roles.

        What `irisfed db-roles` sets up: ``irisfed_svc_router``, ``irisfed_svc_tick`` and
        one ``irisfed_peer_<id>`` per peer, each with its own password in its URL.
        """
        from urllib.parse import quote, urlsplit, urlunsplit

        import asyncpg

        from services.common.db_roles import apply_roles, peer_role
        from shared.config import load_config

        config = load_config(self.config_path)
        conn = await asyncpg.connect(self.database_url)
        try:
            passwords = await apply_roles(conn, config)
        finally:
            await conn.close()
        parts = urlsplit(self.database_url)
        host = parts.netloc.rsplit("@", 1)[-1]

        def url(role: str) -> str:
            return urlunsplit(parts._replace(netloc=f"{quote(role, safe='')}:{quote(passwords[role], safe='')}@{host}"))
        self.db_urls = {"router": url("irisfed_svc_router"), "tick": url("irisfed_svc_tick")}
        self.db_urls.update({peer: url(peer_role(peer)) for peer in config.peer_ids})

    @property
    def config_path(self) -> Path:
        return self.tmp / "federation.toml"

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
        env.update({
            "IRISFED_DATABASE_URL": self.database_url,
            "IRISFED_NATS_URL": self.nats_url_for("operator"),  # what the CLI uses
            "IRISFED_CONFIG": str(self.config_path),
            "PYTHONPATH": str(ROOT),
        })
        return env

    def start(self, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        module = {"router": "services.router", "tick": "services.tick"}.get(name, "services.peer_agent")
        role = name if module != "services.peer_agent" else f"agent-{name}"
        env = {"IRISFED_NATS_URL": self.nats_url_for(role), "IRISFED_DATABASE_URL": self.database_url_for(name),
               **(env or {})}
        args = [sys.executable, "-m", module, "--log-level", "debug", *extra]
        if module == "services.peer_agent":
            args += ["--peer-id", name, "--work-dir", str(self.tmp / "work")]
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(args, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=self.tmp, start_new_session=True)
        log.close()
        self.processes[name] = process
        return process

    def stop(self, name: str) -> int:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def start_behind_proxies(self, name: str, *extra: str) -> tuple[TcpProxy, TcpProxy]:
        """Start an agent whose NATS and Postgres connections go through proxies."""
        nats_proxy, db_proxy = proxy_for(self.nats_url), proxy_for(self.database_url)
        self.proxies += [nats_proxy, db_proxy]
        self.start(name, *extra, env={"IRISFED_NATS_URL": nats_proxy.url_for(self.nats_url_for(f"agent-{name}")),
                                      "IRISFED_DATABASE_URL": db_proxy.url_for(self.database_url_for(name))})
        return nats_proxy, db_proxy

    def kill(self, name: str) -> None:
        """Crash a service (SIGKILL): no clean-up of any kind."""
        process = self.processes.pop(name)
        process.kill()
        process.wait()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    async def start_federation(self, *agents: str) -> None:
        self.start("router")
        self.start("tick")
        for agent in agents:
            self.start(agent)
        await self.wait_router()
        for agent in agents:
            await self.wait_agent(agent)

    async def wait_router(self) -> None:
        async def answered():
            reply = await self.request("cancel", {"job_id": "readiness-probe"})
            return reply is not None
        await wait_for(answered, "the router to answer")

    async def wait_agent(self, peer_id: str) -> None:
        async def advertised():
            rows = await self.store.peer_heartbeat_list()
            return any(r["peer_id"] == peer_id and r["reachable"] for r in rows)
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
            return job if job is not None and job["state"] in states else None
        return await wait_for(reached, f"{job_id} to reach {states}", timeout=timeout)

    async def run_pid(self, job_id: str) -> int:
        """The pid of the job's running process (the agent writes it just after launch)."""
        job = await self.wait_state(job_id, "running")
        pid_file = Path(job["log_dir"]) / "pid"

        async def written():
            try:
                return int(pid_file.read_text())
            except (OSError, ValueError):
                return None
        return await wait_for(written, f"{job_id}'s pid file")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args], env=self.env, cwd=self.tmp,
            capture_output=True, text=True, timeout=60, check=False,
        )

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.restore()  # let stopping agents say goodbye
        for name in list(self.processes):
            self.stop(name)
        for proxy in self.proxies:
            proxy.close()
        self.proxies.clear()


@pytest.fixture
async def federation(tmp_path, database_url, servers, subject_prefix, nats_client):
    pool = await dbmod.connect(database_url, max_size=4)
    fed = Federation(tmp_path, database_url, servers.nats_plain_url or servers.nats_url, subject_prefix,
                     nats_client, Store(pool), auth=servers.nats_auth)
    fed.config_path.write_text(config_text(subject_prefix))
    try:
        yield fed
    finally:
        fed.close()
        try:
            await assert_changelog_replays(fed.store)
        finally:
            await pool.close()
