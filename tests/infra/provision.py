"""Real Postgres and NATS for the tests (docs/design.md §7).

In order of preference: URLs from IRISFED_TEST_DATABASE_URL / IRISFED_TEST_NATS_URL;
testcontainers when a Docker engine answers; else local ``nats-server`` and
Postgres processes in a temporary folder (Postgres as the `postgres` user when
the tests run as root). Everything started here is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from irisfed.services.common.nats_auth import NatsAuth
from irisfed.tooling.servers import ServerProcess, start_postgres, start_secured_nats

DATABASE_URL_ENV = "IRISFED_TEST_DATABASE_URL"
NATS_URL_ENV = "IRISFED_TEST_NATS_URL"
# Every peer id the tests use; the NATS users are generated for these. Tests use
# one-token subject prefixes, so the permissions are written for the prefix "*".
TEST_PEERS = ("home", "gpu-west", "tpu-east", "gpu-east")
# Every configured user the tests use (their NATS users are user-<id>).
TEST_USERS = ("alice", "bob")


@dataclass
class Servers:
    """Where the test servers are, and how they were provided."""

    database_url: str  # an admin connection (may CREATE DATABASE)
    nats_url: str  # the admin user's URL (everything allowed)
    how: str
    nats_plain_url: str = ""
    nats_auth: NatsAuth | None = None  # None when the NATS server came from elsewhere
    postgres: ServerProcess | None = None
    nats: ServerProcess | None = None
    folder: Path | None = None
    _cleanups: list[Callable[[], None]] = field(default_factory=list)

    def nats_url_for(self, role: str) -> str:
        """The URL a service of ``role`` connects with (its own user when auth is on)."""
        if self.nats_auth is None:
            return self.nats_plain_url or self.nats_url
        return self.nats_auth.url(self.nats_plain_url, role)

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                pass
        self._cleanups.clear()


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name``."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        client.ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means "no engine here"
        return False


def provision_servers() -> Servers:
    env_db, env_nats = os.environ.get(DATABASE_URL_ENV), os.environ.get(NATS_URL_ENV)
    servers = Servers(database_url="", nats_url="", how="")
    try:
        how = []
        if env_db:
            servers.database_url = env_db
            how.append("postgres from env")
        if env_nats:
            servers.nats_url = env_nats
            how.append("nats from env")
        missing_db, missing_nats = not env_db, not env_nats
        if (missing_db or missing_nats) and docker_answers():
            _start_containers(servers, missing_db, missing_nats)
            how.append("testcontainers")
        elif missing_db or missing_nats:
            folder = Path(tempfile.mkdtemp(prefix="irisfed-test-"))
            os.chmod(folder, 0o755)
            servers.folder = folder
            servers._cleanups.append(lambda: shutil.rmtree(folder, ignore_errors=True))
            if missing_nats:
                # Local NATS runs with auth on: every service gets its own user.
                servers.nats, servers.nats_auth = start_secured_nats(folder / "nats", "*", TEST_PEERS,
                                                                     auth_dir=folder / "nats-auth",
                                                                     user_ids=TEST_USERS)
                servers._cleanups.append(servers.nats.stop)
                servers.nats_plain_url = servers.nats.url
                servers.nats_url = servers.nats_auth.url(servers.nats.url, "admin")
            if missing_db:
                servers.postgres = start_postgres(folder / "pg", durable=False)
                servers._cleanups.append(servers.postgres.stop)
                servers.database_url = servers.postgres.url
            how.append("local processes")
        servers.how = ", ".join(how)
        return servers
    except BaseException:
        servers.close()
        raise


def _start_containers(servers: Servers, want_db: bool, want_nats: bool) -> None:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    if want_db:
        from testcontainers.postgres import PostgresContainer

        pg = PostgresContainer("postgres:16-alpine", driver=None)
        pg.start()
        servers._cleanups.append(pg.stop)
        servers.database_url = pg.get_connection_url()
    if want_nats:
        nats = DockerContainer("nats:2.10-alpine").with_command("-js").with_exposed_ports(4222)
        nats.start()
        servers._cleanups.append(nats.stop)
        wait_for_logs(nats, "Server is ready")
        host, port = nats.get_container_host_ip(), nats.get_exposed_port(4222)
        servers.nats_url = f"nats://{host}:{port}"
