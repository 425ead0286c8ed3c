"""A bench deployment: a fresh database, a federation config, and irisfed services as
subprocesses (through the shared harness, ``irisfed.tooling.federation``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats

from irisfed.bench.report import Bench
from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.nats_auth import NatsAuth
from irisfed.services.common.store import Store
from irisfed.shared.postgres import with_database
from irisfed.tooling.federation import LocalFederation, Peer, Supervisor, write_config

# (peer id, attributes, slots): one simulated backend each.
PeerSpec = tuple[str, dict[str, str], int]

GPU_PEERS: list[PeerSpec] = [("home", {"device_type": "cpu"}, 1000)] + [
    (f"gpu{i}", {"device_type": "gpu"}, 1000) for i in range(4)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_env() -> dict[str, str]:
    """The environment of the bench's children: this one's (they import the same irisfed)."""
    return dict(os.environ)


class Deployment:
    """A fresh database, a config, and irisfed services as subprocesses.

    ``users``: the config's ``[[users]]`` tables (``id``, ``weight``, ``quota`` ...; none:
    every job is the user ``default``'s, as in v1). ``auth``: the NATS server's users
    (``start_secured_nats``, made for :func:`prefix_of` ``name``); each service connects
    as its own role, otherwise without credentials. ``backend``: every peer's
    (``simulated``: no process, a job's run ends when its labels say; ``subprocess``:
    each job a real process group under the bench's folder)."""

    def __init__(self, bench: Bench, admin_url: str, nats_url: str, name: str,
                 peers: list[PeerSpec], interval: float = 1.0, ttl: float = 3600.0,
                 users: Sequence[Mapping[str, Any]] = (), auth: NatsAuth | None = None,
                 backend: str = "simulated") -> None:
        self.bench = bench
        self.admin_url = admin_url
        self.name = name
        self.database_url = with_database(admin_url, f"bench_{name}")
        self.nats_url = nats_url
        self.auth = auth
        self.prefix = prefix_of(name)
        self.config_path = bench.folder / f"{name}.toml"
        self.config = write_config(
            self.config_path, [Peer(peer_id, attrs, slots, backend) for peer_id, attrs, slots in peers],
            users=users, local_cluster=peers[0][0], subject_prefix=self.prefix, heartbeat_interval_s=interval,
            heartbeat_ttl_s=ttl, tick_interval_s=0.5)
        log_level = os.environ.get("IRISFED_BENCH_LOG_LEVEL", "warning")
        self.services = LocalFederation(
            Supervisor(bench.folder), self.config_path, self.database_url, nats_url,
            env={**bench_env(), "IRISFED_CONFIG": str(self.config_path)}, work_dir=bench.folder / "work",
            auth=auth, args=["--log-level", log_level], log_prefix=f"{name}-")

    def nats_url_as(self, role: str) -> str:
        """The NATS URL a client acting as ``role`` (``admin``, ``producer``, ``user-<id>``)
        connects with: with that role's credentials when the server has users."""
        return self.auth.url(self.nats_url, role) if self.auth is not None else self.nats_url

    @property
    def processes(self):
        return self.services.processes

    async def create(self) -> None:
        conn = await asyncpg.connect(self.admin_url)
        await conn.execute(f'DROP DATABASE IF EXISTS "bench_{self.name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "bench_{self.name}"')
        await conn.close()
        await asyncio.to_thread(dbmod.migrate, self.database_url)
        self.pool = await dbmod.connect(self.database_url, max_size=4)
        self.store = Store(self.pool)

    async def advertise(self, peers: list[PeerSpec], ttl: float = 3600.0) -> None:
        for peer_id, attrs, slots in peers:
            await self.store.peer_heartbeat_upsert(
                peer_id, "bench", 1, [{"name": "simulated", "attributes": {k: [v] for k, v in attrs.items()},
                                       "capacity": {"total": slots, "free": slots}}], ttl, datetime.now(UTC))

    def start(self, service: str, *args: str):
        """Start ``router``, ``tick`` or a peer's agent; the process."""
        return self.services.start(service, *args)

    async def wait_router(self, nc: nats.NATS) -> None:
        for _ in range(400):
            try:
                await nc.request(f"{self.prefix}.cancel", b'{"job_id": "probe"}', timeout=0.25)
                return
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.05)
        raise RuntimeError("router did not start")

    async def close(self) -> None:
        self.services.supervisor.stop_all()
        await self.pool.close()
        # Gone, so its autovacuum and dirty pages do not run into the next figure.
        conn = await asyncpg.connect(self.admin_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "bench_{self.name}" WITH (FORCE)')
        finally:
            await conn.close()


def submit_body(prefix: str, device_type: str = "gpu"):
    """Job ``i``'s submit: ``true``, id ``<prefix>-<i>``, constrained to ``device_type``.
    In the bench's deployments the local cluster (the first peer) is the cpu one, so
    gpu jobs are QUEUE jobs (router → tick → agent) and cpu jobs LOCAL ones (router →
    the local agent, no tick)."""
    def body(i: int) -> bytes:
        return msgspec.json.encode({"command": ["true"], "job_id": f"{prefix}-{i}",
                                    "constraints": [{"key": "device_type", "op": "eq", "value": device_type}]})
    return body


def is_ack(data: bytes) -> bool:
    return b'"disposition"' in data


def prefix_of(name: str) -> str:
    """The subject prefix of the deployment called ``name``."""
    return f"b{name}"


@contextlib.asynccontextmanager
async def routed(bench: Bench, admin_url: str, nats_url: str, name: str, peers: list[PeerSpec], advertised=None,
                 users: Sequence[Mapping[str, Any]] = (), auth: NatsAuth | None = None):
    """A fresh deployment, its peers advertised and a router answering; closed on exit.
    The client it yields is the NATS ``admin`` when the server has users (``auth``)."""
    dep = Deployment(bench, admin_url, nats_url, name, peers, users=users, auth=auth)
    await dep.create()
    await dep.advertise(peers if advertised is None else advertised)
    dep.start("router")
    nc = await connect_client(dep.nats_url_as("admin"))
    try:
        await dep.wait_router(nc)
        yield dep, nc
    finally:
        await nc.close()
        await dep.close()


def python_module(*args: str) -> list[str]:
    """``python -m ARGS`` with this interpreter."""
    return [sys.executable, "-m", *args]
