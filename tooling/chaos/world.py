"""The federation under chaos: its peers and timings, the servers it restarts, and
its services, each behind proxies of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.db_roles import apply_roles
from irisfed.services.common.nats_auth import NatsAuth
from irisfed.shared.bands import INTERACTIVE, PRODUCTION
from irisfed.shared.config import DATABASE_URL_ENV, NATS_URL_ENV, FederationConfig, parse_config
from irisfed.shared.postgres import with_database
from irisfed.shared.users import DEFAULT_MAX_BAND, DEFAULT_USER
from irisfed.tooling.federation import (
    LocalFederation,
    Peer,
    Supervisor,
    harness_env,
    nats_role,
    render_config,
)
from irisfed.tooling.ha import NatsCluster, PatroniCluster, start_nats_cluster, start_patroni
from irisfed.tooling.proxy import TcpProxy
from irisfed.tooling.servers import start_nats, start_postgres, start_secured_nats

PEERS = {
    "home": {"device_type": "cpu"},
    "gpu-a": {"device_type": "gpu", "device_variant": "h100"},
    "gpu-b": {"device_type": "gpu", "device_variant": "a100"},
    "tpu": {"device_type": "tpu"},
}
# These agents run real processes; the others are simulated. Both are gpu peers, so
# unpinned gpu work can move between two real backends.
SUBPROCESS_PEERS = ("gpu-a", "gpu-b")
# Users beside `default` (v1's producer, on P.submit and P.cancel), each submitting and
# cancelling with its own NATS user (user-<id>, on P.submit.<id> and P.cancel.<id>).
# The peers advertise slots only, so quotas alone hold these back: alice may have two
# jobs live at once; bob's jobs ask 0.5 to 1.5 cores (his gpu ones a gpu too) and he may
# hold 2 cores and 1 gpu. Both burst past their quotas now and then (workload.py).
# Bands (§3.3): alice may submit production work; bob and default (unconfigured) at
# most interactive, the default max_band.
USERS: dict[str, dict] = {
    "alice": {"max_band": PRODUCTION, "quota": {"slots": 2}},
    "bob": {"max_band": INTERACTIVE, "weight": 2.0, "quota": {"cpu": 2, "gpu": 1}},
}
SUBMITTERS = (DEFAULT_USER, *USERS)
QUOTAS = {user: spec["quota"] for user, spec in USERS.items() if spec.get("quota")}
# Each submitter's highest band (a user not in USERS has the default max_band).
MAX_BAND = {user: USERS.get(user, {}).get("max_band", DEFAULT_MAX_BAND) for user in SUBMITTERS}
SERVICES = ("router", "tick", *PEERS)
CONVERGE_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 2.0
HEARTBEAT_INTERVAL_S = 0.2  # also the agents' reconcile interval
HEARTBEAT_TTL_S = 1.0
ASSIGN_GRACE_S = 0.5
# Services' own limits, small so that stalls exercise them: one statement or a free
# connection (--db-timeout), and a submit's wait at each step (--submit-timeout;
# answered within twice that, under the producer's REQUEST_TIMEOUT_S).
SERVICE_DB_TIMEOUT_S = 2.0
SUBMIT_TIMEOUT_S = 0.8
# Jobs last at most this: shorter than TTL + grace, so a copy started before its
# agent went silent has ended before the tick may requeue the job elsewhere.
MAX_JOB_S = 0.9
SAMPLE_PERIOD_S = 0.05
# An older epoch's process may be alive together with a newer epoch's only if it
# was killed (it did not run to its end), and for at most this long.
FENCING_WINDOW_S = 2 * HEARTBEAT_INTERVAL_S + 0.4
# A placement on a peer whose agent died more than its TTL + this ago is a violation.
DOWN_SLACK_S = 0.5


# Every peer's slots: few, so that a burst of batch work fills them and a job of a
# higher band preempts (workload.py, Schedule._squeeze).
SLOTS_PER_PEER = 3
# Gangs (§3.4) run where nodes are configured: gpu-b (real processes) has three nodes,
# two in slice b1 and one in b2; tpu (simulated) four, two per slice. Each node holds
# two one-cpu tasks, so single jobs and gangs share them; the start timeout is short so
# a gang placed on a view a heartbeat old is requeued whole within a schedule.
NODES = {
    "gpu-b": [{"count": 2, "resources": {"cpu": 2, "gpu": 1}, "attributes": {"slice": "b1"}},
              {"count": 1, "resources": {"cpu": 2, "gpu": 1}, "attributes": {"slice": "b2"}}],
    "tpu": [{"count": 2, "resources": {"cpu": 2}, "attributes": {"slice": "t1"}},
            {"count": 2, "resources": {"cpu": 2}, "attributes": {"slice": "t2"}}],
}
GANG_START_TIMEOUT_S = 3.0


def config_text(prefix: str) -> str:
    peers = [Peer(peer_id, attrs, slots=SLOTS_PER_PEER,
                  backend="subprocess" if peer_id in SUBPROCESS_PEERS else "simulated",
                  nodes=NODES.get(peer_id, ()),
                  gang_start_timeout_s=GANG_START_TIMEOUT_S if peer_id in NODES else None)
             for peer_id, attrs in PEERS.items()]
    return render_config(peers, users=[{"id": user, **spec} for user, spec in USERS.items()],
                         local_cluster="home", subject_prefix=prefix,
                         heartbeat_interval_s=HEARTBEAT_INTERVAL_S, heartbeat_ttl_s=HEARTBEAT_TTL_S,
                         tick_interval_s=HEARTBEAT_INTERVAL_S, assign_grace_s=ASSIGN_GRACE_S)


def chaos_config(prefix: str = "chaos") -> FederationConfig:
    """The federation's configuration as its services read it."""
    return parse_config(tomllib.loads(config_text(prefix)))


class ChaosFederation(LocalFederation):
    """The services of one schedule, restartable one by one.

    ``db_urls`` maps each service (router, tick, peer ids) to the Postgres URL it
    connects with (its own login role in restricted mode). Every service's Postgres
    connections pass through a proxy of its own (``db_proxies``), the agents' NATS
    connections too (``nats_proxies``).
    """

    def __init__(self, folder: Path, db_urls: dict[str, str], nats_url: str, auth: NatsAuth) -> None:
        config_path = folder / "federation.toml"
        super().__init__(Supervisor(folder), config_path, db_urls["router"], nats_url, auth=auth,
                         env=harness_env(IRISFED_CONFIG=str(config_path)), work_dir=folder / "work",
                         args=["--db-timeout", str(SERVICE_DB_TIMEOUT_S)])
        self.db_urls = db_urls
        self.db_proxies: dict[str, TcpProxy] = {}
        self.nats_proxies: dict[str, TcpProxy] = {}
        # When each agent was killed and restarted (time.time()): [killed, restarted or None].
        self.down: dict[str, list[list[float | None]]] = defaultdict(list)

    def start(self, name: str) -> None:  # type: ignore[override]
        if self.running(name):
            return  # a peer killed twice is restarted once
        if name not in self.db_proxies:
            self.db_proxies[name] = self.supervisor.proxy(self.db_urls[name])
        env = {DATABASE_URL_ENV: self.db_proxies[name].url_for(self.db_urls[name])}
        extra = []
        if name in PEERS:
            if name not in self.nats_proxies:
                self.nats_proxies[name] = self.supervisor.proxy(self.nats_url)
            env[NATS_URL_ENV] = self.nats_proxies[name].url_for(self.nats_url_for(nats_role(name)))
            if self.down[name] and self.down[name][-1][1] is None:
                self.down[name][-1][1] = time.time()
        elif name == "router":
            extra = ["--submit-timeout", str(SUBMIT_TIMEOUT_S)]
        super().start(name, *extra, env=env)

    def running(self, name: str) -> bool:
        return self.supervisor.running(name)

    def reap(self) -> list[str]:
        """Services that exited by themselves (never by our hand): each is a finding."""
        exited = []
        for name in self.supervisor.exited():
            process = self.supervisor.processes.pop(name)
            if name in PEERS:
                self.down[name].append([time.time(), None])
            exited.append(f"{name} exited by itself with code {process.returncode} (see {name}.log)")
        return exited

    def kill(self, name: str) -> None:
        """SIGKILL the service's process alone: runs it started live on in their own sessions."""
        alive = self.running(name)
        self.supervisor.kill(name)
        if alive and name in PEERS:
            self.down[name].append([time.time(), None])

    def close(self) -> None:
        self.supervisor.close()


class Servers:
    """NATS and Postgres this chaos run owns (it restarts them). With ``ha``: Postgres as
    a primary and a synchronous standby under Patroni, and NATS as a cluster of three
    (``irisfed chaos --ha``); its faults fail the primary over and kill NATS nodes."""

    def __init__(self, folder: Path, ha: bool = False) -> None:
        self.folder = folder
        self.ha = ha
        self.patroni: PatroniCluster | None = None
        self.nats_cluster: NatsCluster | None = None
        # Subject prefixes differ per schedule (one token each): permissions for "*".
        # Every user gets its own NATS user (user-<id>), allowed only its own subjects.
        if ha:
            self.auth = NatsAuth.create("*", PEERS, USERS)
            self.auth_conf, _ = self.auth.write(folder / "nats-auth")
            self.nats_cluster = start_nats_cluster(folder / "nats", 3, self.auth_conf)
        else:
            self.nats, self.auth = start_secured_nats(folder / "nats", "*", PEERS, auth_dir=folder / "nats-auth",
                                                      user_ids=USERS)
            self.auth_conf = self.nats.extra["config_file"]
        # Durable (fsync, synchronous_commit): an acknowledged submit must survive a crash.
        try:
            if ha:
                self.patroni = start_patroni(folder / "pg")
            else:
                self.postgres = start_postgres(folder / "pg", durable=True)
        except BaseException:  # a signal or a failure mid-start: NATS is not left behind
            self._stop_nats()
            raise

    @property
    def nats_url(self) -> str:
        return self.nats_cluster.url if self.nats_cluster is not None else self.nats.url

    @property
    def nats_logs(self) -> list[Path]:
        """Every NATS server's log (one per cluster node)."""
        if self.nats_cluster is not None:
            return [server.log_path for server in self.nats_cluster.servers]
        return [self.nats.log_path]

    def _admin_url(self) -> str:
        return self.patroni.url("postgres") if self.patroni is not None else self.postgres.url

    def database_url(self, name: str) -> str:
        if self.patroni is not None:
            return self.patroni.url(name)
        return with_database(self.postgres.url, name)

    async def admin(self, sql: str) -> None:
        conn = await dbmod.with_retry(lambda: asyncpg.connect(self._admin_url()), attempts=100)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def restart_nats(self) -> None:
        port = self.nats.port
        self.nats.stop()
        self.nats = start_nats(self.folder / "nats", port=port, config_file=self.auth_conf)

    def restart_postgres(self, how: str = "fast") -> None:
        """Stop Postgres and start it again on the same port and data.

        ``fast``: SIGINT, a clean shutdown (sessions rolled back, checkpoint).
        ``immediate``: SIGQUIT, what ``pg_ctl stop -m immediate`` sends: every
        process quits at once, no checkpoint, crash recovery at the next start.
        ``kill``: SIGKILL to the postmaster and all its backends (its process
        group), like a machine losing power bar the disk cache.
        """
        port, process = self.postgres.port, self.postgres.process
        if how == "fast":
            self.postgres.stop()
        elif how == "immediate":
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGQUIT)
            process.wait(timeout=30)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the group is its pid
            process.wait(timeout=30)
        wait_group_gone(process.pid)  # no backend may still hold the old shared memory
        # Crash recovery of a durable cluster on a loaded machine has taken over 30 s
        # (two long runs stopped on it): give it time rather than abort the run.
        self.postgres = start_postgres(self.folder / "pg", port=port, durable=True,
                                       ready_timeout_s=CRASH_RECOVERY_TIMEOUT_S)

    # ------------------------------------------------------------ past one machine (--ha)

    def healthy(self) -> None:
        """Every Patroni node up, a leader and a synchronous standby (so the next
        failover loses nothing); every NATS node up."""
        assert self.patroni is not None and self.nats_cluster is not None
        for node in self.patroni.nodes:
            if not node.process.running():
                self.patroni.restart(node)
        self.patroni.wait_leader()
        self.patroni.wait_sync_standby()
        for index, server in enumerate(self.nats_cluster.servers):
            if not server.running():
                self.nats_cluster.restart(index)

    def failover_postgres(self) -> str:
        """SIGKILL the primary's Patroni and postmaster (its machine died) once the cluster
        is healthy; return once the standby is promoted. The dead node stays down until
        :meth:`healthy` (the next failover, or the end of the schedule) restarts it."""
        assert self.patroni is not None
        self.healthy()
        old = self.patroni.kill_leader()
        self.patroni.wait_leader(not_=old)
        return old.name

    def kill_nats_node(self, index: int) -> None:
        assert self.nats_cluster is not None
        self.nats_cluster.servers[index].kill()

    def restart_nats_node(self, index: int) -> None:
        assert self.nats_cluster is not None
        if not self.nats_cluster.servers[index].running():
            self.nats_cluster.restart(index)

    def _stop_nats(self) -> None:
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        else:
            self.nats.stop()

    def close(self) -> None:
        self._stop_nats()
        if self.patroni is not None:
            self.patroni.stop()
        else:
            self.postgres.stop()


CRASH_RECOVERY_TIMEOUT_S = 180.0


def live_state(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid`` from /proc, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parens
    return fields[0], int(fields[2])


def wait_group_gone(pgid: int, timeout: float = 15.0) -> None:
    """Wait until no live (non-zombie) process remains in process group ``pgid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                found = live_state(int(entry))
                if found is not None and found[1] == pgid and found[0] not in "ZX":
                    alive = True
                    break
        if not alive:
            return
        time.sleep(0.05)


async def create_roles(database_url: str) -> dict[str, str]:
    """``irisfed db-roles`` for the chaos federation (roles are cluster-wide; their
    peer mapping is copied with the template to every schedule's database)."""
    config = chaos_config()
    conn = await asyncpg.connect(database_url)
    try:
        return await apply_roles(conn, config)
    finally:
        await conn.close()
