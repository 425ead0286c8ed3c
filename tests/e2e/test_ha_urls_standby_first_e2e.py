"""Multi-host database URLs as operators write them, on a real Patroni cluster.

- The STANDBY listed first (nobody knows which node is the primary today): every
  service, ``irisfed migrate``, ``irisfed db-roles``, the CLI (``submit --wait``,
  ``jobs``, ``job``, ``users``) and ``irisfed.client`` work, and the writes land on the
  primary (``target_session_attrs=read-write`` skips the standby).
- One host down (connection refused) in front of them: the same.
- No primary among the hosts (only the standby named), or every host down: each command
  says so in one line and exits non-zero; no traceback, never the password.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid

import asyncpg
import pytest

from irisfed.migrations import head_revision
from irisfed.services.common import db as dbmod
from irisfed.services.common.logstore import ensure_log_streams
from irisfed.services.common.store import Store
from irisfed.tooling.federation import Peer, harness_env, render_config
from irisfed.tooling.ha import PatroniCluster, PatroniNode
from tests.e2e.conftest import Federation
from tests.infra.ha import healthy, other_node

pytestmark = pytest.mark.e2e

PASSWORD = "Sup3r-s3cret-pw"  # Patroni's loopback trusts every login: the password is only to be hidden


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _url(ports: list[int], database: str, password: str = PASSWORD) -> str:
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"postgresql://postgres:{password}@{hosts}/{database}?target_session_attrs=read-write"


@pytest.fixture
async def fresh(patroni):
    """A new, empty database on a healthy cluster: (cluster, leader, standby, name)."""
    await asyncio.to_thread(healthy, patroni)
    name = f"urls_{uuid.uuid4().hex[:10]}"
    await patroni.create_database(name)
    leader = patroni.leader()
    return patroni, leader, other_node(patroni, leader), name


def _irisfed(*args: str, env: dict[str, str], cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "irisfed.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)


async def _schema_on(cluster: PatroniCluster, node: PatroniNode, name: str) -> str | None:
    conn = await asyncpg.connect(cluster.node_url(node, name))
    try:
        if not await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL"):
            return None
        return await conn.fetchval("SELECT version_num FROM alembic_version")
    finally:
        await conn.close()


async def _run_everything_on(url: str, cluster, leader, name, tmp_path, servers, subject_prefix, nats_client):
    """migrate, db-roles, the services, the CLI and the client, all on ``url``."""
    from irisfed.client import Client

    config = tmp_path / "federation.toml"
    config.write_text(render_config(
        [Peer("home", {"device_type": "cpu"}, slots=8, backend="subprocess")], local_cluster="home",
        subject_prefix=subject_prefix, heartbeat_interval_s=0.5, heartbeat_ttl_s=20.0, tick_interval_s=0.25))
    env = harness_env(IRISFED_DATABASE_URL=url, IRISFED_CONFIG=str(config))
    migrated = _irisfed("migrate", env=env, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert await _schema_on(cluster, leader, name) == head_revision()  # written on the primary
    roles = _irisfed("db-roles", "--out", str(tmp_path / "db-creds.json"), env=env, cwd=tmp_path)
    assert roles.returncode == 0, roles.stdout + roles.stderr

    pool = await dbmod.connect(cluster.url(name), max_size=2)
    fed = Federation(tmp_path, url, servers.nats_plain_url or servers.nats_url, subject_prefix, nats_client,
                     Store(pool), auth=servers.nats_auth)
    await ensure_log_streams(nats_client, subject_prefix, ["home"])  # as `irisfed up` does
    try:
        await fed.start_federation("home")
        submitted = fed.cli("submit", "--wait", "--id", "cli-1", "--", "true")
        assert submitted.returncode == 0 and "succeeded" in submitted.stderr, submitted.stdout + submitted.stderr
        for args in (("jobs",), ("job", "cli-1"), ("users",)):
            shown = fed.cli(*args)
            assert shown.returncode == 0, (args, shown.stdout + shown.stderr)
        assert "cli-1" in fed.cli("jobs").stdout
        client = await Client.connect(fed.nats_url_for("operator"), url, prefix=subject_prefix)
        try:
            reply = await client.submit(["true"], job_id="client-1")
            assert reply.job_id == "client-1"
            event = await client.wait("client-1", timeout=60)
            assert event.state == "succeeded", event
            assert (await client.get("cli-1")).state == "succeeded"
        finally:
            await client.close()
        on_primary = await asyncpg.connect(cluster.node_url(leader, name))
        try:
            ids = {r["job_id"] for r in await on_primary.fetch("SELECT job_id FROM jobs")}
        finally:
            await on_primary.close()
        assert {"cli-1", "client-1"} <= ids
        for service in ("router", "tick", "home"):
            assert "read-only" not in fed.log(service) and "25006" not in fed.log(service), service
    finally:
        fed.close()
        await pool.close()


async def test_everything_works_with_the_standby_listed_first(fresh, tmp_path, servers, subject_prefix,
                                                              nats_client):
    cluster, leader, standby, name = fresh
    url = _url([standby.pg_port, leader.pg_port], name)
    await _run_everything_on(url, cluster, leader, name, tmp_path, servers, subject_prefix, nats_client)


async def test_everything_works_with_a_refused_host_then_the_standby_then_the_primary(
        fresh, tmp_path, servers, subject_prefix, nats_client):
    cluster, leader, standby, name = fresh
    url = _url([_closed_port(), standby.pg_port, leader.pg_port], name)
    await _run_everything_on(url, cluster, leader, name, tmp_path, servers, subject_prefix, nats_client)


COMMANDS = [("migrate",), ("jobs",), ("job", "some-job"), ("users",), ("peers",),
            ("db-roles", "--out", "creds.json")]


def _assert_clear_refusal(result: subprocess.CompletedProcess, args, what: str) -> None:
    out = result.stdout + result.stderr
    assert result.returncode != 0, (what, args, out)
    assert "Traceback" not in out, f"{what}: `irisfed {' '.join(args)}` printed a traceback:\n{out[-2500:]}"
    assert PASSWORD not in out, f"{what}: `irisfed {' '.join(args)}` printed the password:\n{out}"
    assert result.stderr.strip().startswith("irisfed: "), (what, args, out)


async def test_a_url_with_no_primary_among_its_hosts_is_a_clear_error(fresh, tmp_path):
    """Only the standby named (or a URL written when the other node was the primary, and
    that node is down now): every command must say it found no writable server."""
    cluster, leader, standby, name = fresh
    # A schema first (through the primary), so the commands get past "not migrated".
    await asyncio.to_thread(dbmod.migrate, cluster.url(name))
    config = tmp_path / "federation.toml"
    config.write_text(render_config([Peer("home")], local_cluster="home"))
    for ports in ([standby.pg_port], [_closed_port(), standby.pg_port]):
        env = harness_env(IRISFED_DATABASE_URL=_url(ports, name), IRISFED_CONFIG=str(config))
        for args in COMMANDS:
            result = _irisfed(*args, env=env, cwd=tmp_path)
            _assert_clear_refusal(result, args, f"hosts {ports} (a standby only)")


async def test_every_host_down_is_a_clear_error(tmp_path):
    config = tmp_path / "federation.toml"
    config.write_text(render_config([Peer("home")], local_cluster="home"))
    env = harness_env(IRISFED_DATABASE_URL=_url([_closed_port(), _closed_port()], "irisfed"),
                      IRISFED_CONFIG=str(config))
    for args in COMMANDS:
        _assert_clear_refusal(_irisfed(*args, env=env, cwd=tmp_path), args, "every host refused")
