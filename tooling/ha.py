"""Past one machine, on one machine: a Postgres primary with a synchronous standby
under Patroni (with etcd), and a NATS cluster of three, all on loopback in a folder,
every process stopped by its PID (docs/design.md §7; docs/operations.md, "High
availability").

``start_patroni(folder)`` starts etcd (Debian's ``etcd-server``) and two Postgres nodes
under Patroni (Debian's ``patroni``, which runs on Debian's own python3 with its
``python3-etcd``), ``synchronous_mode: true``, ``use_pg_rewind: true`` and
``wal_log_hints: on``, each Patroni as the ``postgres`` user with every ``PG*`` variable
stripped from its environment (libpq's ``PGPASSWORD`` would override the replication
passfile, and a rejoin by rewind then fails). Postgres parameters go under
``bootstrap.dcs.postgresql.parameters``: Patroni overrides local ones. It returns once a
leader serves writes and a synchronous standby is streaming. ``PatroniCluster.url(db)``
is the multi-host URL every service takes
(``postgresql://postgres@h:p1,h:p2/db?target_session_attrs=read-write``).

``start_nats_cluster(folder)`` starts three ``nats-server``s routed to each other, JetStream
on (clustered: the object store's buckets take a replica per node); its ``url`` lists all
three (nats-py reconnects across them). JetStream answers once the three elected a meta
leader, a few seconds after they listen: ``ensure_buckets(..., wait_s=)`` waits for it.

Measured here (patroni 3.0.2, etcd 3.4.23, Postgres 15, 2 cores): first leader ~2 s,
synchronous standby ~8 s, failover after the leader's SIGKILL ~10 s at ``ttl: 10``,
the old leader back as a standby by pg_rewind ~5 s, ~160 MB in all.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from irisfed.shared.errors import ConfigError
from irisfed.tooling.servers import (
    STARTUP_TIMEOUT_S,
    ServerProcess,
    _give_to,
    _postgres_user,
    _reachable_by,
    _relocated_for,
    _started,
    _wait_for_port,
    find_nats_server,
    find_postgres_bin,
    free_port,
)

# Patroni's timings: a leader's key lives TTL seconds; each node's loop runs every
# LOOP_WAIT. A failover takes about TTL after the leader dies (docs/operations.md).
TTL_S = 10
LOOP_WAIT_S = 2
RETRY_TIMEOUT_S = 5
# A generous bound on a slow shared machine's start, not an expectation.
HA_START_TIMEOUT_S = 120.0
PATRONI = "/usr/bin/patroni"
PATRONICTL = "/usr/bin/patronictl"
ETCD = "/usr/bin/etcd"
INSTALL_HINT = "apt-get install -y patroni etcd-server"
REPLICATION_PASSWORD = "irisfed-replication"  # loopback only, a throwaway cluster's


def ha_available() -> str:
    """Why :func:`start_patroni` cannot work here ("" when it can)."""
    missing = [path for path in (PATRONI, PATRONICTL, ETCD) if not Path(path).exists()]
    if missing:
        return f"Patroni/etcd not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
    if find_postgres_bin() is None:
        return "no Postgres binaries (apt-get install -y postgresql)"
    if os.geteuid() != 0:
        return "Patroni runs Postgres as the postgres user: start it as root"
    return ""


def _without_pg_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _get(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class PatroniNode:
    name: str
    pg_port: int
    rest_port: int
    process: ServerProcess

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def role(self) -> str:
        """``primary`` (Patroni 3.0: ``master``), ``replica`` or "" (not answering), as its REST API says."""
        status, doc = _get(f"{self.rest}/patroni")
        return str(doc.get("role", "")) if status else ""


@dataclass
class PatroniCluster:
    folder: Path
    etcd: ServerProcess
    etcd_url: str
    nodes: list[PatroniNode]
    scope: str
    stopped: list[str] = field(default_factory=list)

    def url(self, database: str = "postgres") -> str:
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def node_url(self, node: PatroniNode, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{node.pg_port}/{database}"

    async def create_database(self, name: str) -> str:
        """Create ``name`` on the leader and return its multi-host URL once every
        streaming standby has replayed it: a synchronous commit is flushed on the
        standby, not yet applied, and a client whose URL names the standby first gets
        "database does not exist" there (asyncpg moves to the next host only when a
        host cannot be reached, not when it answers with an error)."""
        conn = await asyncpg.connect(self.url("postgres"))
        try:
            await conn.execute(f'CREATE DATABASE "{name.replace(chr(34), chr(34) * 2)}"')
        finally:
            await conn.close()
        deadline = time.monotonic() + HA_START_TIMEOUT_S
        members = await asyncio.to_thread(self._members)
        standbys = [n for n in self.nodes if n.process.running()
                    and members.get(n.name, {}).get("role") in ("replica", "sync_standby")
                    and members.get(n.name, {}).get("state") in ("running", "streaming")]
        for node in standbys:
            while not await _has_database(self.node_url(node), name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"database {name!r} not on standby {node.name} within {HA_START_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.05)
        return self.url(name)

    def _members(self) -> dict[str, dict]:
        """The cluster's members as its DCS says (the first running node's ``/cluster``)."""
        for node in self.nodes:
            if node.process.running():
                status, doc = _get(f"{node.rest}/cluster")
                if status == 200 and isinstance(doc.get("members"), list):
                    return {str(m.get("name")): m for m in doc["members"] if isinstance(m, dict)}
        return {}

    def leader(self) -> PatroniNode | None:
        """The node holding the leader key whose own REST API says it is the primary
        (either alone can be stale for a moment: a restarted node's, a dead leader's key)."""
        members = self._members()
        for node in self.nodes:
            member = members.get(node.name, {})
            if node.process.running() and member.get("role") == "leader" and member.get("state") == "running" \
                    and _get(f"{node.rest}/primary")[0] == 200:
                return node
        return None

    def sync_standby(self) -> PatroniNode | None:
        """The node the leader now replicates to synchronously: ``sync_standby`` in the
        DCS's view (the leader names it once it streams caught up), running, not the
        leader. A node's own ``/sync`` is not enough: a leader just promoted answers 200
        from the key it held as the standby, and a failover then has nowhere to go."""
        leader = self.leader()
        if leader is None:
            return None
        members = self._members()
        for node in self.nodes:
            member = members.get(node.name, {})
            if node is not leader and node.process.running() and member.get("role") == "sync_standby" \
                    and member.get("state") in ("running", "streaming") and _get(f"{node.rest}/sync")[0] == 200:
                return node
        return None

    def wait_leader(self, timeout: float = HA_START_TIMEOUT_S, not_: PatroniNode | None = None) -> PatroniNode:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None and leader is not not_:
                return leader
            time.sleep(0.2)
        raise RuntimeError(f"no Patroni leader within {timeout:.0f}s:\n{self.logs()}")

    def wait_sync_standby(self, timeout: float = HA_START_TIMEOUT_S) -> PatroniNode:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            standby = self.sync_standby()
            if standby is not None:
                return standby
            time.sleep(0.2)
        raise RuntimeError(f"no synchronous standby within {timeout:.0f}s:\n{self.logs()}")

    def kill_leader(self) -> PatroniNode:
        """SIGKILL the leader's Patroni and its postmaster (the machine died): its
        Postgres is gone at once, its leader key expires after the TTL."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError("no leader to kill")
        postmaster = _postmaster_pid(leader)
        leader.process.kill()
        if postmaster is not None:
            try:
                os.killpg(postmaster, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.kill(postmaster, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leader

    def restart(self, node: PatroniNode) -> None:
        """Start a node's Patroni again (it rejoins, by rewind if it must)."""
        node.process = _spawn_patroni(self.folder / node.name, node.name)

    def switchover(self, timeout: float = 60.0) -> PatroniNode:
        """A planned switchover (``patronictl switchover --force``) to the standby."""
        leader = self.leader()
        done = subprocess.run(
            [PATRONICTL, "-c", str(self.folder / self.nodes[0].name / "patroni.yml"), "switchover", "--force",
             self.scope],
            capture_output=True, text=True, timeout=timeout, env=_without_pg_env(), check=False)
        if done.returncode != 0:
            raise RuntimeError(f"patronictl switchover failed: {done.stdout}{done.stderr}")
        return self.wait_leader(timeout, not_=leader)

    def logs(self, lines: int = 15) -> str:
        parts = []
        for node in self.nodes:
            tail = node.process.log_path.read_text(errors="replace").splitlines()[-lines:] \
                if node.process.log_path.exists() else []
            parts.append(f"--- {node.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        for node in self.nodes:
            postmaster = _postmaster_pid(node)
            node.process.stop(timeout=30)
            if postmaster is not None:  # Patroni stops its Postgres; a crash may not have
                for kill in (os.killpg, os.kill):
                    try:
                        kill(postmaster, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        self.etcd.stop()


async def _has_database(url: str, name: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (TimeoutError, OSError, asyncpg.PostgresError):
        return False
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


def _postmaster_pid(node: PatroniNode) -> int | None:
    pid_file = Path(node.process.extra.get("data", "")) / "postmaster.pid"
    try:
        return int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def start_etcd(folder: Path) -> tuple[ServerProcess, str]:
    folder.mkdir(parents=True, exist_ok=True)
    client, peer = free_port(), free_port()
    log_path = folder / "etcd.log"
    url = f"http://127.0.0.1:{client}"
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    process = subprocess.Popen(
        [ETCD, "--name", "irisfed", "--data-dir", str(folder / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
         f"http://127.0.0.1:{peer}", "--initial-cluster", f"irisfed=http://127.0.0.1:{peer}",
         "--log-level", "warn"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    server = ServerProcess("etcd", url, client, process, log_path)
    _started(server, lambda: _wait_for_port(server))
    return server, url


def _patroni_config(name: str, scope: str, data: Path, pg_port: int, rest_port: int, etcd_host: str,
                    bin_dir: Path, folder: Path) -> str:
    """Patroni's YAML (written as JSON, which YAML reads)."""
    config = {
        "scope": scope, "name": name,
        "restapi": {"listen": f"127.0.0.1:{rest_port}", "connect_address": f"127.0.0.1:{rest_port}"},
        "etcd3": {"host": etcd_host},
        "bootstrap": {
            "dcs": {
                "ttl": TTL_S, "loop_wait": LOOP_WAIT_S, "retry_timeout": RETRY_TIMEOUT_S,
                "maximum_lag_on_failover": 1048576, "synchronous_mode": True,
                "postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": {
                    "wal_log_hints": "on", "max_connections": 300, "shared_buffers": "128MB",
                    "wal_level": "replica", "hot_standby": "on", "max_wal_senders": 10,
                    "max_replication_slots": 10, "synchronous_commit": "on"}},
            },
            "initdb": [{"encoding": "UTF8"}, "no-locale", {"auth-host": "trust"}, {"auth-local": "trust"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{pg_port}", "connect_address": f"127.0.0.1:{pg_port}",
            "data_dir": str(data), "bin_dir": str(bin_dir), "pgpass": str(folder / "pgpass"),
            "authentication": {
                # No superuser password: initdb refuses an empty one, and loopback is trusted.
                "superuser": {"username": "postgres"},
                "replication": {"username": "replicator", "password": REPLICATION_PASSWORD},
                "rewind": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(folder)},
            "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                       "host replication replicator 127.0.0.1/32 trust"],
        },
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
    }
    return json.dumps(config, indent=1)


def _spawn_patroni(folder: Path, name: str) -> ServerProcess:
    log_path = folder / "patroni.log"
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    _give_to(_postgres_user(), log_path)
    process = subprocess.Popen(
        [PATRONI, str(folder / "patroni.yml")], user=_postgres_user(), env=_without_pg_env(), cwd=folder,
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    port = int(json.loads((folder / "patroni.yml").read_text())["restapi"]["listen"].rsplit(":", 1)[1])
    return ServerProcess(f"patroni-{name}", f"http://127.0.0.1:{port}", port, process, log_path,
                         extra={"data": str(folder / "data")})


def start_patroni(folder: Path, nodes: int = 2, scope: str | None = None) -> PatroniCluster:
    """etcd and ``nodes`` Patroni-managed Postgres nodes (one leader, synchronous
    standbys) in ``folder``; returns once the leader serves writes and a synchronous
    standby streams. As root (Patroni runs Postgres as ``postgres``)."""
    why = ha_available()
    if why:
        raise ConfigError(why)
    folder.mkdir(parents=True, exist_ok=True)
    user = _postgres_user()
    if user is not None and not _reachable_by(user, folder):
        folder = _relocated_for(user, folder)
    etcd, etcd_url = start_etcd(folder / "etcd")
    scope = scope or f"irisfed-{os.getpid()}-{int(time.time())}"
    cluster = PatroniCluster(folder, etcd, etcd_url, [], scope)
    try:
        bin_dir = find_postgres_bin()
        for i in range(nodes):
            name = f"pg{i}"
            home = folder / name
            home.mkdir(parents=True, exist_ok=True)
            pg_port, rest_port = free_port(), free_port()
            (home / "patroni.yml").write_text(_patroni_config(
                name, scope, home / "data", pg_port, rest_port, etcd_url.removeprefix("http://"), bin_dir, home))
            _give_to(user, home, home / "patroni.yml")
            os.chmod(home, 0o700)
            cluster.nodes.append(PatroniNode(name, pg_port, rest_port, _spawn_patroni(home, name)))
            if i == 0:
                cluster.wait_leader()  # the first bootstraps; the others clone it
        if nodes > 1:
            cluster.wait_sync_standby()
        return cluster
    except BaseException:
        cluster.stop()
        raise


# ---------------------------------------------------------------- NATS


@dataclass
class NatsCluster:
    servers: list[ServerProcess]
    routes: list[int]
    folder: Path
    config_file: Path | None = None

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def restart(self, index: int) -> None:
        old = self.servers[index]
        self.servers[index] = _spawn_nats(self.folder / f"n{index}", old.port, self.routes[index], self.routes,
                                          self.config_file)


def _spawn_nats(folder: Path, port: int, route: int, routes: Iterable[int], config_file: Path | None) -> ServerProcess:
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "nats.log"
    others = ",".join(f"nats://127.0.0.1:{r}" for r in routes if r != route)
    args = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-l", str(log_path),
            "--cluster_name", "irisfed", "--cluster", f"nats://127.0.0.1:{route}", "--routes", others,
            # JetStream clustered (the object store's buckets, one replica per node): a
            # server name each, kept across a restart with the store folder.
            "-js", "-sd", str(folder / "jetstream"), "--server_name", f"irisfed-{folder.name}"]
    if config_file is not None:
        args += ["-c", str(config_file)]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    server = ServerProcess(f"nats-server-{folder.name}", f"nats://127.0.0.1:{port}", port, process, log_path)
    _started(server, lambda: _wait_for_port(server, STARTUP_TIMEOUT_S))
    return server


def start_nats_cluster(folder: Path, size: int = 3, config_file: Path | None = None) -> NatsCluster:
    """``size`` nats-servers routed to each other (one cluster), on loopback."""
    ports, routes = [free_port() for _ in range(size)], [free_port() for _ in range(size)]
    cluster = NatsCluster([], routes, folder, config_file)
    try:
        for i in range(size):
            cluster.servers.append(_spawn_nats(folder / f"n{i}", ports[i], routes[i], routes, config_file))
        return cluster
    except BaseException:
        cluster.stop()
        raise
