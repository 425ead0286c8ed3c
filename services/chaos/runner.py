"""The chaos suite: seeded random faults against a real federation, then the invariants.

Each schedule gets a fresh database and subject prefix, a router, a tick and four
peer agents (``simulated`` backend) whose NATS and Postgres connections go
through proxies. A seeded schedule then mixes submits, cancels, agent kills and
restarts, partitions (NATS, Postgres or both), router/tick kills, and NATS and
Postgres restarts. After the faults stop and everything is restored, it waits
for every acknowledged job to end and checks DESIGN.md §6: nothing lost, the
changelog replays to ``jobs``, epochs never go back, pinned jobs only on their
pin, no double success, never-started cancels never started.

Schedule ``i`` of seed ``S`` always draws the same faults, so a failing seed
reproduces: ``irisfed chaos --seed S --schedules 1 --first i``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import nats

from services.common import db as dbmod
from services.common.invariants import changelog_violations
from services.common.nats_auth import NatsAuth
from services.common.proxy import TcpProxy, proxy_for
from services.common.servers import start_nats, start_postgres
from services.common.store import Store

PEERS = {
    "home": {"device_type": "cpu"},
    "gpu-a": {"device_type": "gpu", "device_variant": "h100"},
    "gpu-b": {"device_type": "gpu", "device_variant": "a100"},
    "tpu": {"device_type": "tpu"},
}
TERMINAL = {"succeeded", "failed", "killed", "rejected", "unschedulable"}
CONVERGE_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 2.0


@dataclass
class ChaosSettings:
    schedules: int = 20
    seed: int = 1
    steps: int = 8
    first: int = 0  # index of the first schedule (to replay one schedule of a seed)
    keep: bool = False  # keep the temporary folder (logs) for inspection


@dataclass
class ScheduleResult:
    index: int
    faults: int = 0
    jobs: int = 0
    violations: list[str] = field(default_factory=list)
    log_dir: str = ""


@dataclass
class ChaosSummary:
    seed: int
    results: list[ScheduleResult]

    @property
    def faults(self) -> int:
        return sum(r.faults for r in self.results)

    @property
    def jobs(self) -> int:
        return sum(r.jobs for r in self.results)

    @property
    def violations(self) -> list[str]:
        return [f"schedule {r.index}: {v}" for r in self.results for v in r.violations]

    def line(self) -> str:
        return (f"chaos: schedules={len(self.results)} faults={self.faults} jobs={self.jobs} "
                f"violations={len(self.violations)} seed={self.seed}")


def _config(prefix: str) -> str:
    lines = [
        'local_cluster = "home"', f'subject_prefix = "{prefix}"',
        "heartbeat_interval_s = 0.2", "heartbeat_ttl_s = 1.0",
        "tick_interval_s = 0.2", "assign_grace_s = 0.5",
    ]
    for peer_id, attrs in PEERS.items():
        inline = ", ".join(f'{k} = "{v}"' for k, v in attrs.items())
        lines += ["[[peers]]", f'id = "{peer_id}"', f"attributes = {{ {inline} }}",
                  "slots = 3", 'backend = "simulated"']
    return "\n".join(lines) + "\n"


class Federation:
    """The services of one schedule, restartable one by one."""

    def __init__(self, folder: Path, database_url: str, nats_url: str, auth: NatsAuth) -> None:
        self.folder = folder
        self.database_url = database_url
        self.nats_url = nats_url
        self.auth = auth
        self.processes: dict[str, subprocess.Popen] = {}
        self.proxies: dict[str, tuple[TcpProxy, TcpProxy]] = {}
        root = Path(__file__).resolve().parents[2]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("IRISFED_")}
        self.env.update({"IRISFED_CONFIG": str(folder / "federation.toml"), "PYTHONPATH": str(root)})

    def start(self, name: str) -> None:
        if self.running(name):
            return  # a peer killed twice is restarted once
        env = dict(self.env)
        if name in PEERS:
            if name not in self.proxies:
                self.proxies[name] = (proxy_for(self.nats_url), proxy_for(self.database_url))
            nats_proxy, db_proxy = self.proxies[name]
            env["IRISFED_NATS_URL"] = nats_proxy.url_for(self.auth.url(self.nats_url, f"agent-{name}"))
            env["IRISFED_DATABASE_URL"] = db_proxy.url_for(self.database_url)
            args = ["services.peer_agent", "--peer-id", name, "--work-dir", str(self.folder / "work")]
        else:
            env["IRISFED_NATS_URL"] = self.auth.url(self.nats_url, name)
            env["IRISFED_DATABASE_URL"] = self.database_url
            args = [f"services.{name}"]
        with open(self.folder / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def kill(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

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
        for nats_proxy, db_proxy in self.proxies.values():
            nats_proxy.close()
            db_proxy.close()
        self.proxies.clear()


class Servers:
    """NATS and Postgres this chaos run owns (it restarts them)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Subject prefixes differ per schedule (one token each): permissions for "*".
        self.auth = NatsAuth.create("*", PEERS)
        self.auth_conf, _ = self.auth.write(folder / "nats-auth")
        self.nats = start_nats(folder / "nats", config_file=self.auth_conf)
        self.postgres = start_postgres(folder / "pg", durable=False)

    def restart_nats(self) -> None:
        port = self.nats.port
        self.nats.stop()
        self.nats = start_nats(self.folder / "nats", port=port, config_file=self.auth_conf)

    def restart_postgres(self) -> None:
        port = self.postgres.port
        self.postgres.stop()
        self.postgres = start_postgres(self.folder / "pg", port=port, durable=False)

    def close(self) -> None:
        for server in (self.nats, self.postgres):
            server.stop()


async def _admin(servers: Servers, sql: str) -> None:
    conn = await asyncpg.connect(servers.postgres.url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _job_body(rng: random.Random, job_id: str) -> dict:
    kind = rng.choice(["local", "gpu", "gpu", "tpu", "pinned", "impossible", "variant"])
    body: dict = {
        "job_id": job_id,
        "command": ["simulated"],
        "max_retries": rng.randint(0, 2),
        "labels": {"sim.duration_s": f"{rng.uniform(0, 1.5):.2f}",
                   "sim.exit_code": "1" if rng.random() < 0.1 else "0"},
        "priority": rng.randint(0, 3),
    }
    if kind in ("gpu", "tpu"):
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": kind}]
    elif kind == "variant":
        body["constraints"] = [{"key": "device_variant", "op": "in", "value": ["h100", "a100"]}]
    elif kind == "pinned":
        body["cluster_pin"] = rng.choice(sorted(PEERS))
    elif kind == "impossible":
        body["constraints"] = [{"key": "device_type", "op": "eq", "value": "fpga"}]
    return body


class Schedule:
    """One seeded schedule: faults, then convergence, then the invariant checks."""

    def __init__(self, servers: Servers, folder: Path, index: int, seed: int, steps: int,
                 template: str, say: Callable[[str], None]) -> None:
        self.servers = servers
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

    async def run(self) -> ScheduleResult:
        prefix = f"c{self.index}x{self.rng.randrange(1 << 30):x}"
        dbname = f"chaos_{self.index}_{os.getpid()}"
        await _admin(self.servers, f'DROP DATABASE IF EXISTS "{dbname}"')
        await _admin(self.servers, f'CREATE DATABASE "{dbname}" TEMPLATE "{self.template}"')
        database_url = self.servers.postgres.url.rsplit("/", 1)[0] + f"/{dbname}"
        (self.folder / "federation.toml").write_text(_config(prefix))
        self.fed = Federation(self.folder, database_url, self.servers.nats.url, self.servers.auth)
        for name in ("router", "tick", *PEERS):
            self.fed.start(name)
        async def quiet(exc: Exception) -> None:  # NATS restarts are the point here
            pass

        self.nc = await nats.connect(self.servers.auth.url(self.servers.nats.url, "producer"),
                                     max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.2, error_cb=quiet)
        self.prefix = prefix
        try:
            await self._wait_ready(database_url)
            for _ in range(self.steps):
                await self._step()
                await self._housekeeping()
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
            await self._restore_everything()
            await self._converge_and_check(database_url)
        finally:
            await self.nc.close()
            self.fed.stop_all()
        return self.result

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

    async def _step(self) -> None:
        rng = self.rng
        action = rng.choices(
            ["submit", "cancel", "kill_agent", "partition", "kill_router", "kill_tick",
             "restart_nats", "restart_postgres"],
            weights=[5, 2, 2, 3, 1, 1, 1, 1],
        )[0]
        if action == "submit" or not self.acked and action == "cancel":
            for _ in range(rng.randint(1, 4)):
                await self._submit()
            return
        self.result.faults += action != "cancel"
        if action == "cancel":
            await self._cancel(rng.choice(sorted(self.acked)))
        elif action == "kill_agent":
            peer = rng.choice(sorted(PEERS))
            self.fed.kill(peer)
            self.pending_restarts.append((time.monotonic() + rng.uniform(0.2, 2.5), peer))
        elif action == "partition":
            peer = rng.choice(sorted(PEERS))
            nats_proxy, db_proxy = self.fed.proxies[peer]
            which = rng.choice([[nats_proxy], [db_proxy], [nats_proxy, db_proxy]])
            until = time.monotonic() + rng.uniform(0.3, 3.0)
            for proxy in which:
                proxy.cut()
                self.partitions.append((until, proxy))
        elif action in ("kill_router", "kill_tick"):
            name = action.split("_")[1]
            self.fed.kill(name)
            self.fed.start(name)
        elif action == "restart_nats":
            await asyncio.to_thread(self.servers.restart_nats)
        elif action == "restart_postgres":
            await asyncio.to_thread(self.servers.restart_postgres)

    async def _submit(self) -> None:
        job_id = f"s{self.index}-j{len(self.acked) + self.result.jobs + 1}-{self.rng.randrange(1 << 20):x}"
        body = _job_body(self.rng, job_id)
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
        self.result.jobs += 1

    async def _cancel(self, job_id: str) -> None:
        reply = await self._request("cancel", {"job_id": job_id})
        if reply and reply.get("outcome") == "never_started":
            self.never_started.add(job_id)

    async def _housekeeping(self) -> None:
        now = time.monotonic()
        for until, proxy in [p for p in self.partitions if p[0] <= now]:
            proxy.restore()
            self.partitions.remove((until, proxy))
        for when, peer in [r for r in self.pending_restarts if r[0] <= now]:
            self.fed.start(peer)
            self.pending_restarts.remove((when, peer))

    async def _restore_everything(self) -> None:
        for _, proxy in self.partitions:
            proxy.restore()
        self.partitions.clear()
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
            deadline = time.monotonic() + CONVERGE_TIMEOUT_S
            while True:
                rows = {r["job_id"]: r for r in await store.job_states_all()}
                open_jobs = [j for j in self.acked if j not in rows or rows[j]["state"] not in TERMINAL]
                if not open_jobs or time.monotonic() > deadline:
                    break
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
        finally:
            await pool.close()


def run_chaos(settings: ChaosSettings, say: Callable[[str], None] = print) -> ChaosSummary:
    """Run ``settings.schedules`` schedules on servers of its own; return the summary."""
    root = Path(tempfile.mkdtemp(prefix="irisfed-chaos-"))
    os.chmod(root, 0o755)
    servers = Servers(root / "servers")
    results = []
    try:
        template = f"chaos_template_{os.getpid()}"
        asyncio.run(_admin(servers, f'CREATE DATABASE "{template}"'))
        dbmod.migrate(servers.postgres.url.rsplit("/", 1)[0] + f"/{template}")
        for index in range(settings.first, settings.first + settings.schedules):
            folder = root / f"schedule-{index}"
            folder.mkdir()
            schedule = Schedule(servers, folder, index, settings.seed, settings.steps, template, say)
            started = time.monotonic()
            result = asyncio.run(schedule.run())
            results.append(result)
            status = "ok" if not result.violations else f"{len(result.violations)} VIOLATIONS"
            say(f"  schedule {index}: faults={result.faults} jobs={result.jobs} {status} "
                f"({time.monotonic() - started:.1f}s)")
            for violation in result.violations:
                say(f"    {violation}")
    finally:
        servers.close()
        failed = any(r.violations for r in results)
        if settings.keep or failed:
            say(f"  logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return ChaosSummary(settings.seed, results)
