"""The chaos suite: seeded random faults against a real federation, then the invariants.

Each schedule gets a fresh database and subject prefix, a router, a tick and four
peer agents: two run real short processes (``subprocess`` backend, ``sh -c``
jobs in their own sessions, which outlive a SIGKILLed agent), two are
``simulated``. Every service's Postgres connections, and the agents' NATS ones,
go through proxies. Postgres runs durable (fsync and synchronous_commit on), so
a crash that loses an acknowledged submit is a finding, not an artefact.

A seeded schedule mixes submits, cancels and faults: agent kills (also while its
real runs go on), partitions (NATS, Postgres or both), Postgres stalls (a
server that hangs: the proxy holds every byte, nothing is reset) for one
service or all, a rogue agent user publishing forged heartbeats (naming other
peers, huge TTLs) and replaying old ones while their peer's agent is down,
router/tick kills, NATS restarts, and Postgres restarts: clean (fast shutdown)
or crashes (``SIGQUIT`` as ``pg_ctl stop -m immediate``, or SIGKILL of the
postmaster and every backend). After the faults stop and everything is
restored, it waits for every acknowledged job to end and checks DESIGN.md §6:
nothing lost, the changelog replays to ``jobs``, epochs never go back, pinned
jobs only on their pin, no double success, never-started cancels never started;
no unpinned job placed on a peer whose agent had been down for over a TTL; no
two live processes of one job under different epochs (see ``RunWatcher``); and no
service exiting by itself or logging a dead background task (``task_died``).

``ChaosSettings.restricted_roles`` runs the services on their own Postgres login
roles (``irisfed db-roles``: row-level security) instead of the owner.

Schedule ``i`` of seed ``S`` always draws the same faults, so a failing seed
reproduces: ``irisfed chaos --seed S --schedules 1 --first i`` (what a fault hits,
e.g. which jobs are running, still depends on timing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats

from services.common import db as dbmod
from services.common.bus import connect_client
from services.common.db_roles import apply_roles, peer_role
from services.common.nats_auth import NatsAuth
from services.common.store import Store
from shared.config import parse_config
from tooling.invariants import changelog_violations
from tooling.proxy import TcpProxy, proxy_for
from tooling.servers import start_nats, start_postgres

PEERS = {
    "home": {"device_type": "cpu"},
    "gpu-a": {"device_type": "gpu", "device_variant": "h100"},
    "gpu-b": {"device_type": "gpu", "device_variant": "a100"},
    "tpu": {"device_type": "tpu"},
}
# These agents run real processes; the others are simulated. Both are gpu peers, so
# unpinned gpu work can move between two real backends.
SUBPROCESS_PEERS = ("gpu-a", "gpu-b")
TERMINAL = {"succeeded", "failed", "killed", "rejected", "unschedulable"}
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
# What every job runs on the subprocess peers ($1 seconds, exit $2, log to $3).
# The simulated peers read the same duration and exit code from the labels.
JOB_SCRIPT = ('echo "start $IRISFED_JOB_ID $IRISFED_EPOCH $$ $PWD" >> "$3"; sleep "$1"; '
              'echo "end $IRISFED_JOB_ID $IRISFED_EPOCH $$" >> "$3"; exit "$2"')


@dataclass
class ChaosSettings:
    schedules: int = 20
    seed: int = 1
    steps: int = 8
    first: int = 0  # index of the first schedule (to replay one schedule of a seed)
    keep: bool = False  # keep the temporary folder (logs) for inspection
    # Services and agents connect as their own login roles (irisfed db-roles), not the owner.
    restricted_roles: bool = False


@dataclass
class ScheduleResult:
    index: int
    faults: int = 0
    jobs: int = 0
    violations: list[str] = field(default_factory=list)
    log_dir: str = ""
    kinds: Counter = field(default_factory=Counter)  # faults by kind
    runs: int = 0  # real job processes seen
    fenced_overlaps: int = 0  # stale copies seen alive with a newer epoch, killed in the window
    converge_s: float = 0.0  # from "everything restored" to every acknowledged job ended

    def fault(self, kind: str) -> None:
        self.faults += 1
        self.kinds[kind] += 1


@dataclass
class ChaosSummary:
    seed: int
    results: list[ScheduleResult]
    restricted_roles: bool = False

    @property
    def faults(self) -> int:
        return sum(r.faults for r in self.results)

    @property
    def kinds(self) -> Counter:
        return sum((r.kinds for r in self.results), Counter())

    @property
    def jobs(self) -> int:
        return sum(r.jobs for r in self.results)

    @property
    def violations(self) -> list[str]:
        return [f"schedule {r.index}: {v}" for r in self.results for v in r.violations]

    def line(self) -> str:
        kinds = " ".join(f"{kind}={n}" for kind, n in sorted(self.kinds.items()))
        runs = sum(r.runs for r in self.results)
        return (f"chaos: schedules={len(self.results)} faults={self.faults} jobs={self.jobs} "
                f"violations={len(self.violations)} seed={self.seed} "
                f"roles={'restricted' if self.restricted_roles else 'owner'} runs={runs} "
                f"| faults by kind: {kinds or 'none'}")


def _config(prefix: str) -> str:
    lines = [
        'local_cluster = "home"', f'subject_prefix = "{prefix}"',
        f"heartbeat_interval_s = {HEARTBEAT_INTERVAL_S}", f"heartbeat_ttl_s = {HEARTBEAT_TTL_S}",
        f"tick_interval_s = {HEARTBEAT_INTERVAL_S}", f"assign_grace_s = {ASSIGN_GRACE_S}",
    ]
    for peer_id, attrs in PEERS.items():
        inline = ", ".join(f'{k} = "{v}"' for k, v in attrs.items())
        backend = "subprocess" if peer_id in SUBPROCESS_PEERS else "simulated"
        lines += ["[[peers]]", f'id = "{peer_id}"', f"attributes = {{ {inline} }}",
                  "slots = 3", f'backend = "{backend}"']
    return "\n".join(lines) + "\n"


class Federation:
    """The services of one schedule, restartable one by one.

    ``db_urls`` maps each service (router, tick, peer ids) to the Postgres URL it
    connects with (its own login role in restricted mode). Every service's Postgres
    connections pass through a proxy of its own (``db_proxies``), the agents' NATS
    connections too (``nats_proxies``).
    """

    def __init__(self, folder: Path, db_urls: dict[str, str], nats_url: str, auth: NatsAuth) -> None:
        self.folder = folder
        self.db_urls = db_urls
        self.nats_url = nats_url
        self.auth = auth
        self.processes: dict[str, subprocess.Popen] = {}
        self.db_proxies: dict[str, TcpProxy] = {}
        self.nats_proxies: dict[str, TcpProxy] = {}
        # When each agent was killed and restarted (time.time()): [killed, restarted or None].
        self.down: dict[str, list[list[float | None]]] = defaultdict(list)
        root = Path(__file__).resolve().parents[2]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
        self.env.update({"IRISFED_CONFIG": str(folder / "federation.toml"), "PYTHONPATH": str(root)})

    def start(self, name: str) -> None:
        if self.running(name):
            return  # a peer killed twice is restarted once
        env = dict(self.env)
        if name not in self.db_proxies:
            self.db_proxies[name] = proxy_for(self.db_urls[name])
        env["IRISFED_DATABASE_URL"] = self.db_proxies[name].url_for(self.db_urls[name])
        limits = ["--db-timeout", str(SERVICE_DB_TIMEOUT_S)]
        if name in PEERS:
            if name not in self.nats_proxies:
                self.nats_proxies[name] = proxy_for(self.nats_url)
            env["IRISFED_NATS_URL"] = self.nats_proxies[name].url_for(self.auth.url(self.nats_url, f"agent-{name}"))
            args = ["services.peer_agent", "--peer-id", name, "--work-dir", str(self.folder / "work"), *limits]
            if self.down[name] and self.down[name][-1][1] is None:
                self.down[name][-1][1] = time.time()
        else:
            env["IRISFED_NATS_URL"] = self.auth.url(self.nats_url, name)
            args = [f"services.{name}", *limits]
            if name == "router":
                args += ["--submit-timeout", str(SUBMIT_TIMEOUT_S)]
        with open(self.folder / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def reap(self) -> list[str]:
        """Services that exited by themselves (never by our hand): each is a finding."""
        exited = []
        for name, process in list(self.processes.items()):
            if process.poll() is not None:
                del self.processes[name]
                if name in PEERS:
                    self.down[name].append([time.time(), None])
                exited.append(f"{name} exited by itself with code {process.returncode} (see {name}.log)")
        return exited

    def kill(self, name: str) -> None:
        """SIGKILL the service's process alone: runs it started live on in their own sessions."""
        process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
            if name in PEERS:
                self.down[name].append([time.time(), None])

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        for proxy in [*self.nats_proxies.values(), *self.db_proxies.values()]:
            proxy.close()
        self.nats_proxies.clear()
        self.db_proxies.clear()


class Servers:
    """NATS and Postgres this chaos run owns (it restarts them)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Subject prefixes differ per schedule (one token each): permissions for "*".
        self.auth = NatsAuth.create("*", PEERS)
        self.auth_conf, _ = self.auth.write(folder / "nats-auth")
        self.nats = start_nats(folder / "nats", config_file=self.auth_conf)
        # Durable (fsync, synchronous_commit): an acknowledged submit must survive a crash.
        self.postgres = start_postgres(folder / "pg", durable=True)

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
        _wait_group_gone(process.pid)  # no backend may still hold the old shared memory
        self.postgres = start_postgres(self.folder / "pg", port=port, durable=True)

    def close(self) -> None:
        for server in (self.nats, self.postgres):
            server.stop()


def _live_state(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid`` from /proc, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parens
    return fields[0], int(fields[2])


def _wait_group_gone(pgid: int, timeout: float = 15.0) -> None:
    """Wait until no live (non-zombie) process remains in process group ``pgid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                found = _live_state(int(entry))
                if found is not None and found[1] == pgid and found[0] not in "ZX":
                    alive = True
                    break
        if not alive:
            return
        time.sleep(0.05)


def _as_role(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))


async def _create_roles(database_url: str) -> dict[str, str]:
    """``irisfed db-roles`` for the chaos federation (roles are cluster-wide; their
    peer mapping is copied with the template to every schedule's database)."""
    config = parse_config(tomllib.loads(_config("chaos")))
    conn = await asyncpg.connect(database_url)
    try:
        return await apply_roles(conn, config)
    finally:
        await conn.close()


@dataclass
class _Run:
    """One real job process (the ``sh`` of JOB_SCRIPT), as its own log lines tell."""

    job_id: str
    epoch: int
    peer_id: str
    pid: int
    first_seen: float
    last_seen: float
    gone_at: float | None = None
    ended: bool = False  # it wrote its "end" line: it ran to its end, it was not killed


class RunWatcher:
    """Samples which real job processes are alive, every SAMPLE_PERIOD_S, in a thread.

    Each job's script appends ``start JOB EPOCH PID CWD`` to a log as it begins and
    ``end JOB EPOCH PID`` when its sleep is over (never when killed); the watcher
    reads new lines and checks each known pid in /proc (zombies count as dead).
    Whenever one job has live processes under two epochs it records the overlap.

    The rule (DESIGN.md §6.3, fencing), checked by :meth:`violations`: a job never
    has live processes under two epochs at once, except that an older copy may
    still be alive for at most FENCING_WINDOW_S after a newer one starts, and only
    if it is then killed (it never writes its "end" line). Jobs last at most
    MAX_JOB_S, less than TTL + grace, so a copy left by a dead or cut-off agent
    has ended on its own before the tick may hand its job out again; any overlap
    at all means a stale copy outlived the moment its job moved on (e.g. a
    restarted agent that failed to kill what its previous run left behind).
    """

    def __init__(self, log_path: Path, work_dir: Path) -> None:
        self.log_path = log_path
        self.work_dir = work_dir
        self.offset = 0
        self.runs: dict[int, _Run] = {}
        self.overlaps: dict[tuple[str, int, int], list[float]] = {}  # (job, old, new) → [first, last]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="chaos-run-watcher", daemon=True)

    def start(self) -> None:
        self.log_path.touch()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sweep()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self.sweep()

    def _read_log(self) -> None:
        with open(self.log_path, "rb") as log:
            log.seek(self.offset)
            data = log.read()
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        now = time.time()
        for line in data[:complete].decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0] == "start":
                try:
                    peer = Path(parts[4]).relative_to(self.work_dir).parts[0]
                except (ValueError, IndexError):
                    peer = "?"
                self.runs[int(parts[3])] = _Run(parts[1], int(parts[2]), peer, int(parts[3]), now, now)
            elif len(parts) >= 4 and parts[0] == "end" and int(parts[3]) in self.runs:
                self.runs[int(parts[3])].ended = True

    def sweep(self) -> None:
        with self._lock:
            self._read_log()
            now = time.time()
            live: dict[str, set[int]] = defaultdict(set)
            for run in self.runs.values():
                if run.gone_at is not None:
                    continue
                found = _live_state(run.pid)
                if found is None or found[0] in "ZX":
                    run.gone_at = now
                    continue
                run.last_seen = now
                live[run.job_id].add(run.epoch)
            for job_id, epochs in live.items():
                newest = max(epochs)
                for old in epochs - {newest}:
                    seen = self.overlaps.setdefault((job_id, old, newest), [now, now])
                    seen[1] = now

    def live_on(self, peer_id: str) -> bool:
        with self._lock:
            return any(r.gone_at is None and r.peer_id == peer_id for r in self.runs.values())

    def live_pids(self) -> list[int]:
        with self._lock:
            return [r.pid for r in self.runs.values() if r.gone_at is None]

    def violations(self) -> tuple[list[str], int]:
        """Overlaps that break the rule above, and how many overlaps kept it."""
        problems, fenced = [], 0
        for (job_id, old, new), (first, last) in sorted(self.overlaps.items()):
            stale = [r for r in self.runs.values() if r.job_id == job_id and r.epoch == old]
            where = ",".join(sorted({r.peer_id for r in stale}))
            newer = ",".join(sorted({r.peer_id for r in self.runs.values()
                                     if r.job_id == job_id and r.epoch == new}))
            lasted = last - first + SAMPLE_PERIOD_S
            if any(r.ended for r in stale):
                problems.append(f"{job_id}: epoch {old} ran to its end on {where} while epoch {new} "
                                f"was running on {newer} (both alive for ~{lasted:.2f}s)")
            elif lasted > FENCING_WINDOW_S:
                problems.append(f"{job_id}: epoch {old} on {where} stayed alive ~{lasted:.2f}s while "
                                f"epoch {new} ran on {newer} (fencing window {FENCING_WINDOW_S:.1f}s)")
            else:
                fenced += 1
        return problems, fenced


async def _admin(servers: Servers, sql: str) -> None:
    conn = await asyncpg.connect(servers.postgres.url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


# Constraints only that peer satisfies (home has none: its work is LOCAL, placed by the router).
ONLY_ON = {
    "gpu-a": [{"key": "device_variant", "op": "eq", "value": "h100"}],
    "gpu-b": [{"key": "device_variant", "op": "eq", "value": "a100"}],
    "tpu": [{"key": "device_type", "op": "eq", "value": "tpu"}],
}


def _job_body(rng: random.Random, job_id: str, run_log: Path, kind: str | None = None,
              pin: str | None = None, min_s: float = 0.0) -> dict:
    """A random job; ``kind`` forces its kind (``only:PEER``: constrained to that peer alone)."""
    kind = kind or rng.choice(["local", "gpu", "gpu", "tpu", "pinned", "impossible", "variant"])
    duration = f"{rng.uniform(min_s, MAX_JOB_S):.2f}"
    exit_code = "1" if rng.random() < 0.1 else "0"
    body: dict = {
        "job_id": job_id,
        # Real on the subprocess peers; the simulated ones read the labels instead.
        "command": ["sh", "-c", JOB_SCRIPT, "chaos-job", duration, exit_code, str(run_log)],
        "max_retries": rng.randint(0, 2),
        "labels": {"sim.duration_s": duration, "sim.exit_code": exit_code},
        "priority": rng.randint(0, 3),
    }
    if kind in ("gpu", "tpu"):
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": kind}]
    elif kind == "variant":
        body["constraints"] = [{"key": "device_variant", "op": "in", "value": ["h100", "a100"]}]
    elif kind == "pinned":
        body["cluster_pin"] = pin or rng.choice(sorted(PEERS))
    elif kind == "impossible":
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": "fpga"}]
    elif kind.startswith("only:"):
        body["constraints"] = ONLY_ON[kind.split(":", 1)[1]]
    return body


class Schedule:
    """One seeded schedule: faults, then convergence, then the invariant checks."""

    def __init__(self, servers: Servers, folder: Path, index: int, seed: int, steps: int,
                 template: str, say: Callable[[str], None], passwords: dict[str, str] | None = None) -> None:
        self.servers = servers
        self.passwords = passwords or {}  # login role → password: restricted-roles mode
        self.folder = folder
        self.index = index
        self.rng = random.Random(seed * 100_003 + index)
        self.steps = steps
        self.template = template
        self.say = say
        self.result = ScheduleResult(index, log_dir=str(folder))
        self.acked: dict[str, dict] = {}  # job_id → first successful reply
        self.never_started: set[str] = set()
        self.pending_restarts: list[tuple[float, str]] = []
        self.partitions: list[tuple[float, TcpProxy]] = []
        self.stalls: list[tuple[float, TcpProxy, bool]] = []  # until, proxy, drop on restore
        self.rogues: list[asyncio.Task] = []
        self.heard: dict[str, list[bytes]] = {}  # peer → [its first heartbeat, its latest]
        self.run_log = folder / "runs.log"
        self.watcher = RunWatcher(self.run_log, folder / "work")

    async def run(self) -> ScheduleResult:
        prefix = f"c{self.index}x{self.rng.randrange(1 << 30):x}"
        dbname = f"chaos_{self.index}_{os.getpid()}"
        await _admin(self.servers, f'DROP DATABASE IF EXISTS "{dbname}"')
        await _admin(self.servers, f'CREATE DATABASE "{dbname}" TEMPLATE "{self.template}"')
        database_url = self.servers.postgres.url.rsplit("/", 1)[0] + f"/{dbname}"
        (self.folder / "federation.toml").write_text(_config(prefix))
        self.fed = Federation(self.folder, self._db_urls(database_url), self.servers.nats.url, self.servers.auth)
        self.watcher.start()
        for name in ("router", "tick", *PEERS):
            self.fed.start(name)
        async def quiet(exc: Exception) -> None:  # NATS restarts are the point here
            pass

        # As a producer would: its own user, so its own inbox prefix (_INBOX_producer).
        self.nc = await connect_client(self.servers.auth.url(self.servers.nats.url, "producer"),
                                       max_reconnect_attempts=-1,
                                       reconnect_time_wait=0.2, error_cb=quiet)
        self.prefix = prefix
        self.spy = None
        try:
            await self._wait_ready(database_url)
            await self._listen_to_heartbeats()
            for _ in range(self.steps):
                await self._step()
                await self._housekeeping()
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
            await self._restore_everything()
            await self._converge_and_check(database_url)
        finally:
            await self._stop_rogues()
            if self.spy is not None:
                await self.spy.close()
            await self.nc.close()
            self.result.violations.extend(self.fed.reap())
            self.fed.stop_all()
            self._check_runs()
            self._check_logs()
        return self.result

    def _check_logs(self) -> None:
        """A background task that died is a bug by the services' own rule: report each."""
        for log in sorted(self.folder.glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if '"event":"task_died"' in line.replace(" ", ""):
                    self.result.violations.append(f"{log.stem}: a task died: {line[:300]}")

    def _db_urls(self, database_url: str) -> dict[str, str]:
        """The Postgres URL of each service: the owner's, or its own login role's."""
        if not self.passwords:
            return {name: database_url for name in ("router", "tick", *PEERS)}
        roles = {"router": "irisfed_svc_router", "tick": "irisfed_svc_tick",
                 **{peer: peer_role(peer) for peer in PEERS}}
        return {name: _as_role(database_url, role, self.passwords[role]) for name, role in roles.items()}

    async def _listen_to_heartbeats(self) -> None:
        """Record real heartbeats off the wire, for the rogue to replay later."""
        async def quiet(exc: Exception) -> None:
            pass

        async def heard(msg) -> None:
            peer = msg.subject.rsplit(".", 1)[1]
            seen = self.heard.setdefault(peer, [msg.data, msg.data])
            seen[1] = msg.data

        self.spy = await connect_client(self.servers.auth.url(self.servers.nats.url, "admin"),
                                        max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)
        await self.spy.subscribe(f"{self.prefix}.heartbeat.*", cb=heard)
        await self.spy.flush()

    def _check_runs(self) -> None:
        """Stop watching processes; kill (by pid) any job process a killed agent left; judge overlaps."""
        self.watcher.stop()
        for pid in self.watcher.live_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # JOB_SCRIPT's shell leads its own session
        problems, fenced = self.watcher.violations()
        self.result.violations.extend(problems)
        self.result.fenced_overlaps = fenced
        self.result.runs = len(self.watcher.runs)

    async def _wait_ready(self, database_url: str) -> None:
        deadline = time.monotonic() + 60
        pool = await dbmod.connect(database_url, max_size=1)
        try:
            while time.monotonic() < deadline:
                rows = await Store(pool).peer_heartbeat_list()
                if len([r for r in rows if r["reachable"]]) == len(PEERS):
                    if await self._request("cancel", {"job_id": "ready-probe"}) is not None:
                        return
                await asyncio.sleep(0.1)
        finally:
            await pool.close()
        raise RuntimeError("the federation did not come up")

    async def _request(self, verb: str, body: dict) -> dict | None:
        try:
            reply = await self.nc.request(f"{self.prefix}.{verb}", json.dumps(body).encode(),
                                          timeout=REQUEST_TIMEOUT_S)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError):
            return None
        return json.loads(reply.data)

    # ------------------------------------------------------------ steps

    ACTIONS = {  # action → weight
        "submit": 5, "cancel": 2, "kill_agent": 1, "kill_agent_with_runs": 2, "partition": 2,
        "stall_postgres": 2, "rogue_heartbeats": 1, "kill_router": 1, "kill_tick": 1,
        "restart_nats": 1, "restart_postgres": 2,
    }
    POSTGRES_RESTARTS = {"fast": "restart_postgres", "immediate": "crash_postgres_immediate",
                         "kill": "crash_postgres_sigkill"}

    async def _step(self) -> None:
        rng = self.rng
        action = rng.choices(list(self.ACTIONS), weights=list(self.ACTIONS.values()))[0]
        if action == "submit" or not self.acked and action == "cancel":
            # Producers in parallel (each retrying on its own); drawn in order, so seeded.
            bodies = [self._new_job() for _ in range(rng.randint(1, 4))]
            await asyncio.gather(*(self._send(body) for body in bodies))
            return
        if action == "cancel":
            await self._cancel(rng.choice(sorted(self.acked)))
        elif action == "kill_agent":
            peer = rng.choice(sorted(PEERS))
            self.result.fault(action)
            self.fed.kill(peer)
            self.pending_restarts.append((time.monotonic() + rng.uniform(0.2, 2.5), peer))
        elif action == "kill_agent_with_runs":
            self.result.fault(action)
            await self._kill_agent_with_runs()
        elif action == "partition":
            peer = rng.choice(sorted(PEERS))
            nats_proxy, db_proxy = self.fed.nats_proxies[peer], self.fed.db_proxies[peer]
            which = rng.choice([[nats_proxy], [db_proxy], [nats_proxy, db_proxy]])
            until = time.monotonic() + rng.uniform(0.3, 3.0)
            self.result.fault(action)
            for proxy in which:
                proxy.cut()
                self.partitions.append((until, proxy))
        elif action == "stall_postgres":
            # Postgres hangs for one service (or everyone): connections stay open, no byte
            # moves, nothing is reset; then it resumes, or the connections are reset.
            target = rng.choice(["all", "router", "tick", *sorted(PEERS)])
            until = time.monotonic() + rng.uniform(0.5, 4.0)
            drop = rng.random() < 0.5
            self.result.fault("stall_postgres_all" if target == "all" else "stall_postgres")
            for name in ("router", "tick", *PEERS) if target == "all" else (target,):
                self.fed.db_proxies[name].stall()
                self.stalls.append((until, self.fed.db_proxies[name], drop))
        elif action == "rogue_heartbeats":
            target = rng.choice(sorted(ONLY_ON))
            rogue = rng.choice(sorted(set(PEERS) - {target}))
            # Down for longer than a TTL, so a forgery that worked shows as a placement.
            until = time.monotonic() + rng.uniform(2.4, 3.2)
            self.result.fault(action)
            self.fed.kill(target)
            self.pending_restarts.append((until, target))
            self.rogues.append(asyncio.create_task(self._forge(rogue, target, until)))
            # Once the real heartbeats have expired, offer work only the dead peer could
            # take: if a lie is believed, the tick places it there.
            await asyncio.sleep(HEARTBEAT_TTL_S + DOWN_SLACK_S + 0.1)
            for _ in range(2):
                await self._submit(kind=f"only:{target}")
        elif action in ("kill_router", "kill_tick"):
            name = action.split("_")[1]
            self.result.fault(action)
            self.fed.kill(name)
            self.fed.start(name)
        elif action == "restart_nats":
            self.result.fault(action)
            await asyncio.to_thread(self.servers.restart_nats)
        elif action == "restart_postgres":
            how = rng.choice(sorted(self.POSTGRES_RESTARTS))
            self.result.fault(self.POSTGRES_RESTARTS[how])
            await asyncio.to_thread(self.servers.restart_postgres, how)

    async def _kill_agent_with_runs(self) -> None:
        """SIGKILL a subprocess peer's agent while real runs of it go on (own sessions)."""
        rng = self.rng
        peer = rng.choice(SUBPROCESS_PEERS)
        await self._submit(kind="pinned", pin=peer, min_s=0.5)
        await self._submit(kind="gpu", min_s=0.5)
        for _ in range(int(1.5 / SAMPLE_PERIOD_S)):  # its agent may be down or cut off: no run starts
            if self.watcher.live_on(peer):
                break
            await asyncio.sleep(SAMPLE_PERIOD_S)
        self.fed.kill(peer)
        self.pending_restarts.append((time.monotonic() + rng.uniform(0.2, 2.5), peer))

    async def _forge(self, rogue: str, target: str, until: float) -> None:
        """A rogue agent user lies about ``target`` while ``target``'s agent is down.

        With ``rogue``'s own credentials, on its own subject: fresh heartbeats naming
        ``target`` with a huge TTL, and ``target``'s first heartbeat replayed. With
        ``target``'s credentials (stolen), on ``target``'s subject: that old
        heartbeat replayed verbatim (old run, seq and sent_at).
        """
        async def quiet(exc: Exception) -> None:
            pass

        auth, url = self.servers.auth, self.servers.nats.url
        clients = []
        try:
            for user in (f"agent-{rogue}", f"agent-{target}"):
                clients.append(await connect_client(auth.url(url, user), max_reconnect_attempts=-1,
                                                    reconnect_time_wait=0.2, error_cb=quiet))
            liar, thief = clients
            old = self.heard.get(target, [None])[0]
            body = json.loads(old) if old else {"backends": [{
                "name": "simulated", "attributes": {k: [v] for k, v in PEERS[target].items()},
                "capacity": {"total": 3, "free": 3}}]}
            run_id, seq = uuid.uuid4().hex, 1 << 40
            while time.monotonic() < until:
                seq += 1
                forged = {**body, "peer_id": target, "seq": seq, "run_id": run_id, "ttl_s": 1e6,
                          "sent_at": datetime.now(UTC).isoformat()}
                await liar.publish(f"{self.prefix}.heartbeat.{rogue}", json.dumps(forged).encode())
                if old is not None:
                    await liar.publish(f"{self.prefix}.heartbeat.{rogue}", old)
                    await thief.publish(f"{self.prefix}.heartbeat.{target}", old)
                await asyncio.sleep(0.1)
        finally:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()

    async def _stop_rogues(self) -> None:
        for task in self.rogues:
            task.cancel()
        await asyncio.gather(*self.rogues, return_exceptions=True)
        self.rogues.clear()

    async def _submit(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0) -> None:
        await self._send(self._new_job(kind, pin, min_s))

    def _new_job(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0) -> dict:
        self.result.jobs += 1
        job_id = f"s{self.index}-j{self.result.jobs}-{self.rng.randrange(1 << 20):x}"
        return _job_body(self.rng, job_id, self.run_log, kind, pin, min_s)

    async def _send(self, body: dict) -> None:
        job_id = body["job_id"]
        for _ in range(3):  # producers retry with the same job_id: idempotent
            reply = await self._request("submit", body)
            if reply is None or reply.get("error", {}).get("code") == "unavailable":
                await asyncio.sleep(0.2)
                continue
            if "error" in reply:
                self.result.violations.append(f"{job_id}: unexpected error {reply['error']}")
            else:
                self.acked.setdefault(job_id, reply)
            break

    async def _cancel(self, job_id: str) -> None:
        reply = await self._request("cancel", {"job_id": job_id})
        if reply and reply.get("outcome") == "never_started":
            self.never_started.add(job_id)

    async def _housekeeping(self) -> None:
        # Like a supervisor (restart: unless-stopped), start again what exited by
        # itself, and report it: services are meant to ride out every fault here.
        for exited in self.fed.reap():
            self.result.violations.append(exited)
            self.fed.start(exited.split()[0])
        now = time.monotonic()
        for until, proxy in [p for p in self.partitions if p[0] <= now]:
            proxy.restore()
            self.partitions.remove((until, proxy))
        for stall in [s for s in self.stalls if s[0] <= now]:
            stall[1].restore(drop=stall[2])
            self.stalls.remove(stall)
        for when, peer in [r for r in self.pending_restarts if r[0] <= now]:
            self.fed.start(peer)
            self.pending_restarts.remove((when, peer))

    async def _restore_everything(self) -> None:
        await self._stop_rogues()
        self.result.violations.extend(self.fed.reap())
        for _, proxy in self.partitions:
            proxy.restore()
        self.partitions.clear()
        for _, proxy, drop in self.stalls:
            proxy.restore(drop=drop)
        self.stalls.clear()
        for _, peer in self.pending_restarts:
            self.fed.start(peer)
        self.pending_restarts.clear()
        for name in ("router", "tick", *PEERS):
            if not self.fed.running(name):
                self.fed.start(name)

    # ------------------------------------------------------------ checks

    async def _converge_and_check(self, database_url: str) -> None:
        pool = await dbmod.with_retry(lambda: dbmod.connect(database_url, max_size=2), attempts=50)
        store = Store(pool)
        try:
            began = time.monotonic()
            deadline = began + CONVERGE_TIMEOUT_S
            while True:
                rows = {r["job_id"]: r for r in await store.job_states_all()}
                open_jobs = [j for j in self.acked if j not in rows or rows[j]["state"] not in TERMINAL]
                if not open_jobs or time.monotonic() > deadline:
                    self.result.converge_s = time.monotonic() - began
                    break
                for exited in self.fed.reap():
                    self.result.violations.append(exited)
                    self.fed.start(exited.split()[0])
                await asyncio.sleep(0.2)
            violations = self.result.violations
            for job_id, reply in self.acked.items():
                row = rows.get(job_id)
                if row is None:
                    violations.append(f"{job_id}: acknowledged ({reply['disposition']}) but not in Postgres")
                elif row["state"] not in TERMINAL:
                    job = await store.job_get(job_id)
                    violations.append(f"{job_id}: still {row['state']} after convergence ({job['reason']})")
            for job_id in self.never_started:
                job = await store.job_get(job_id)
                if job["started_at"] is not None:
                    violations.append(f"{job_id}: cancel said never_started but it started")
            violations.extend(await changelog_violations(store))
            violations.extend(await self._placed_on_dead_agents(pool))
        finally:
            await pool.close()


    async def _placed_on_dead_agents(self, pool: asyncpg.Pool) -> list[str]:
        """Unpinned jobs the tick placed on a peer whose agent was dead for over a TTL.

        A heartbeat sent just before the kill keeps the peer reachable for its TTL
        (plus DOWN_SLACK_S for heartbeats the tick writes to Postgres a moment after
        hearing them); after that, only a forged or replayed heartbeat could make
        the peer look alive until its agent is started again.
        """
        rows = await pool.fetch(
            "SELECT c.job_id, c.peer_id, extract(epoch FROM c.at)::float8 AS at "
            "FROM federation_changelog c JOIN jobs j USING (job_id) "
            "WHERE c.to_state = 'assigned' AND c.actor = 'tick' AND j.pinned_peer_id IS NULL")
        problems = []
        for row in rows:
            for killed, restarted in self.fed.down.get(row["peer_id"], []):
                if killed + HEARTBEAT_TTL_S + DOWN_SLACK_S < row["at"] < (restarted or float("inf")):
                    problems.append(f"{row['job_id']}: placed on {row['peer_id']} "
                                    f"{row['at'] - killed:.1f}s after its agent was killed "
                                    f"(TTL {HEARTBEAT_TTL_S:g}s) and before it was started again")
        return problems


def run_chaos(settings: ChaosSettings, say: Callable[[str], None] = print) -> ChaosSummary:
    """Run ``settings.schedules`` schedules on servers of its own; return the summary."""
    root = Path(tempfile.mkdtemp(prefix="irisfed-chaos-"))
    os.chmod(root, 0o755)
    servers = Servers(root / "servers")
    results = []
    try:
        template = f"chaos_template_{os.getpid()}"
        template_url = servers.postgres.url.rsplit("/", 1)[0] + f"/{template}"
        asyncio.run(_admin(servers, f'CREATE DATABASE "{template}"'))
        dbmod.migrate(template_url)
        passwords = asyncio.run(_create_roles(template_url)) if settings.restricted_roles else {}
        for index in range(settings.first, settings.first + settings.schedules):
            folder = root / f"schedule-{index}"
            folder.mkdir()
            schedule = Schedule(servers, folder, index, settings.seed, settings.steps, template, say, passwords)
            started = time.monotonic()
            result = asyncio.run(schedule.run())
            results.append(result)
            status = "ok" if not result.violations else f"{len(result.violations)} VIOLATIONS"
            kinds = ",".join(f"{kind}:{n}" for kind, n in sorted(result.kinds.items()))
            fenced = f" fenced={result.fenced_overlaps}" if result.fenced_overlaps else ""
            say(f"  schedule {index}: faults={result.faults} ({kinds}) jobs={result.jobs} runs={result.runs}{fenced} "
                f"{status} ({time.monotonic() - started:.1f}s, converged in {result.converge_s:.1f}s)")
            for violation in result.violations:
                say(f"    {violation}")
    finally:
        servers.close()
        failed = any(r.violations for r in results)
        if settings.keep or failed:
            say(f"  logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return ChaosSummary(settings.seed, results, settings.restricted_roles)
