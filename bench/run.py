"""``irisfed bench``: irisfed against raw NATS and Postgres, measured in the same run.

Every figure stands beside a baseline from the same run, as a ratio, because
absolute numbers drift on shared machines. Servers are started here (Postgres
with fsync on, NATS), like the tests do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import msgspec
import nats

from bench.load import Run, closed_loop, median, open_loop, spread
from services.common import db as dbmod
from services.common.bus import connect_client
from services.common.store import Store
from shared.config import parse_config
from tooling.servers import start_nats, start_postgres

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Figure:
    section: str
    name: str
    value: float
    unit: str
    baseline: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    runs: str = "1 run"
    note: str = ""


@dataclass
class Profile:
    quick: bool

    def n(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def s(self, quick: float, full: float) -> float:
        return quick if self.quick else full


@dataclass
class Bench:
    profile: Profile
    folder: Path
    figures: list[Figure] = field(default_factory=list)
    baselines: dict[str, float] = field(default_factory=dict)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        print(f"  {figure.section:<10} {figure.name:<44} {figure.value:>12,.1f} {figure.unit}"
              + (f"  ({figure.ratio:.2f}× {figure.baseline})" if figure.ratio is not None else ""), flush=True)
        return figure


# ---------------------------------------------------------------- processes


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _config_text(prefix: str, peers: list[tuple[str, dict[str, str], int]], interval: float = 1.0,
                 ttl: float = 3600.0) -> str:
    lines = [f'local_cluster = "{peers[0][0]}"', f'subject_prefix = "{prefix}"',
             f"heartbeat_interval_s = {interval}", f"heartbeat_ttl_s = {ttl}", "tick_interval_s = 0.5"]
    for peer_id, attrs, slots in peers:
        inline = ", ".join(f'{k} = "{v}"' for k, v in attrs.items())
        lines += ["[[peers]]", f'id = "{peer_id}"', f"attributes = {{ {inline} }}", f"slots = {slots}",
                  'backend = "simulated"']
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- baselines


async def nats_baseline(bench: Bench, nats_url: str) -> None:
    subject = f"bench.echo.{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    echo = _spawn(["bench.echo", nats_url, subject], env, bench.folder / "echo.log")
    try:
        nc = await connect_client(nats_url)
        for _ in range(100):  # wait for the responder
            try:
                await nc.request(subject, b"ping", timeout=0.2)
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.05)
        body = b'{"command": ["true"]}'
        for conc, total in ((1, bench.profile.n(1000, 5000)), (100, bench.profile.n(10_000, 50_000)),
                            (2000, bench.profile.n(20_000, 100_000))):
            runs = [await closed_loop(nc, subject, lambda i: body, conc, total) for _ in range(3)]
            best = sorted(runs, key=lambda r: r.rate)[1]
            bench.baselines[f"nats_rr_{conc}"] = best.rate
            bench.baselines[f"nats_rr_{conc}_p50"] = best.pct(0.5)
            bench.add(Figure("baseline", f"NATS request/reply, {conc} in flight", best.rate, "req/s",
                             runs=spread([r.rate for r in runs]),
                             note=f"p50 {best.pct(0.5) * 1e3:.2f} ms, p99 {best.pct(0.99) * 1e3:.2f} ms"))
        await nc.close()
    finally:
        _stop([echo])


async def postgres_baselines(bench: Bench, url: str) -> None:
    conn = await asyncpg.connect(url)
    await conn.execute("CREATE TABLE IF NOT EXISTS bench_rows (id bigserial PRIMARY KEY, payload text)")
    await conn.execute("CREATE TABLE IF NOT EXISTS bench_claim (id bigint PRIMARY KEY, state text)")
    # The same kind of partial index the tick's claim uses, so the baseline is fair.
    await conn.execute("CREATE INDEX IF NOT EXISTS bench_claim_queued ON bench_claim (id) WHERE state = 'queued'")
    await conn.close()
    seconds = bench.profile.s(1.5, 5.0)

    async def single_commits(workers: int) -> float:
        conns = [await asyncpg.connect(url) for _ in range(workers)]
        count = 0
        deadline = time.perf_counter() + seconds

        async def worker(c: asyncpg.Connection) -> None:
            nonlocal count
            while time.perf_counter() < deadline:
                await c.execute("INSERT INTO bench_rows (payload) VALUES ($1)", "x" * 100)
                count += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        elapsed = time.perf_counter() - started
        for c in conns:
            await c.close()
        return count / elapsed

    for workers in (1, 8):
        rates = [await single_commits(workers) for _ in range(3)]
        bench.baselines[f"pg_commit_{workers}"] = median(rates)
        bench.add(Figure("baseline", f"asyncpg single-row commits, {workers} conn", median(rates),
                         "rows/s", runs=spread(rates)))

    conn = await asyncpg.connect(url)
    rates = []
    for _ in range(3):
        rows = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            await conn.execute("INSERT INTO bench_rows (payload) SELECT unnest($1::text[])", ["x" * 100] * 1000)
            rows += 1000
        rates.append(rows / (time.perf_counter() - started))
    bench.baselines["pg_unnest"] = median(rates)
    bench.add(Figure("baseline", "asyncpg batched unnest insert (1000/stmt)", median(rates), "rows/s",
                     runs=spread(rates)))

    total = bench.profile.n(50_000, 200_000)
    rates = []
    for _ in range(3):
        await conn.execute("TRUNCATE bench_claim")
        await conn.execute("INSERT INTO bench_claim SELECT g, 'queued' FROM generate_series(1, $1) g", total)
        await conn.execute("ANALYZE bench_claim")
        started = time.perf_counter()
        claimed = 0
        while True:
            result = await conn.execute(
                "UPDATE bench_claim SET state = 'claimed' WHERE id IN (SELECT id FROM bench_claim "
                "WHERE state = 'queued' ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED)")
            moved = int(result.split()[-1])
            if moved == 0:
                break
            claimed += moved
        rates.append(claimed / (time.perf_counter() - started))
    bench.baselines["pg_claim"] = median(rates)
    bench.add(Figure("baseline", "batched claim (SKIP LOCKED, 1000/stmt)", median(rates), "rows/s",
                     runs=spread(rates)))
    await conn.close()


# ---------------------------------------------------------------- irisfed


class Deployment:
    """A fresh database, a config, and irisfed services as subprocesses."""

    def __init__(self, bench: Bench, admin_url: str, nats_url: str, name: str,
                 peers: list[tuple[str, dict[str, str], int]], interval: float = 1.0, ttl: float = 3600.0) -> None:
        self.bench = bench
        self.admin_url = admin_url
        self.name = name
        self.database_url = admin_url.rsplit("/", 1)[0] + f"/bench_{name}"
        self.nats_url = nats_url
        self.prefix = f"b{name}"
        self.config_path = bench.folder / f"{name}.toml"
        self.config_path.write_text(_config_text(self.prefix, peers, interval, ttl))
        self.config = parse_config(__import__("tomllib").loads(self.config_path.read_text()))
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "IRISFED_CONFIG": str(self.config_path),
                    "IRISFED_DATABASE_URL": self.database_url, "IRISFED_NATS_URL": nats_url}

    async def create(self) -> None:
        conn = await asyncpg.connect(self.admin_url)
        await conn.execute(f'DROP DATABASE IF EXISTS "bench_{self.name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "bench_{self.name}"')
        await conn.close()
        await asyncio.to_thread(dbmod.migrate, self.database_url)
        self.pool = await dbmod.connect(self.database_url, max_size=4)
        self.store = Store(self.pool)

    async def advertise(self, peers: list[tuple[str, dict[str, str], int]], ttl: float = 3600.0) -> None:
        for peer_id, attrs, slots in peers:
            await self.store.peer_heartbeat_upsert(
                peer_id, "bench", 1, [{"name": "simulated", "attributes": {k: [v] for k, v in attrs.items()},
                                       "capacity": {"total": slots, "free": slots}}], ttl, datetime.now(UTC))

    def start(self, service: str, *args: str) -> subprocess.Popen:
        module = {"router": "services.router", "tick": "services.tick"}.get(service, "services.peer_agent")
        extra = list(args)
        if module == "services.peer_agent":
            extra = ["--peer-id", service, "--work-dir", str(self.bench.folder / "work"), *extra]
        process = _spawn([module, "--log-level", os.environ.get("IRISFED_BENCH_LOG_LEVEL", "warning"), *extra], self.env,
                         self.bench.folder / f"{self.name}-{service}.log")
        self.processes[service] = process
        return process

    async def wait_router(self, nc: nats.NATS) -> None:
        for _ in range(400):
            try:
                await nc.request(f"{self.prefix}.cancel", b'{"job_id": "probe"}', timeout=0.25)
                return
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.05)
        raise RuntimeError("router did not start")

    async def close(self) -> None:
        _stop(list(self.processes.values()))
        await self.pool.close()
        # Gone, so its autovacuum and dirty pages do not run into the next figure.
        conn = await asyncpg.connect(self.admin_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "bench_{self.name}" WITH (FORCE)')
        finally:
            await conn.close()


GPU_PEERS = [("home", {"device_type": "cpu"}, 1000)] + [
    (f"gpu{i}", {"device_type": "gpu"}, 1000) for i in range(4)]


def _submit_body(prefix: str):
    def body(i: int) -> bytes:
        return msgspec.json.encode({"command": ["true"], "job_id": f"{prefix}-{i}",
                                    "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]})
    return body


def _is_ack(data: bytes) -> bool:
    return b'"disposition"' in data


@contextlib.asynccontextmanager
async def _routed(bench: Bench, admin_url: str, nats_url: str, name: str,
                  peers: list[tuple[str, dict[str, str], int]], advertised=None):
    """A fresh deployment, its peers advertised and a router answering; closed on exit."""
    dep = Deployment(bench, admin_url, nats_url, name, peers)
    await dep.create()
    await dep.advertise(peers if advertised is None else advertised)
    dep.start("router")
    nc = await connect_client(nats_url)
    try:
        await dep.wait_router(nc)
        yield dep, nc
    finally:
        await nc.close()
        await dep.close()


async def submit_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    async with _routed(bench, admin_url, nats_url, "submit", GPU_PEERS) as (dep, nc):
        targets = {1: None, 100: 0.40, 2000: 0.35}
        for conc, total in ((1, bench.profile.n(1000, 5000)), (100, bench.profile.n(10_000, 50_000)),
                            (2000, bench.profile.n(20_000, 100_000))):
            runs: list[Run] = []
            for attempt in range(3):
                runs.append(await closed_loop(nc, f"{dep.prefix}.submit", _submit_body(f"c{conc}a{attempt}"),
                                              conc, total, check=_is_ack))
            best = sorted(runs, key=lambda r: r.rate)[1]
            base = bench.baselines[f"nats_rr_{conc}"]
            note = (f"p50 {best.pct(0.5) * 1e3:.2f} ms, p99 {best.pct(0.99) * 1e3:.2f} ms, "
                    f"p999 {best.pct(0.999) * 1e3:.2f} ms, errors {best.errors}")
            if conc == 1:
                ratio = best.pct(0.5) / bench.baselines["nats_rr_1_p50"]
                bench.add(Figure("submit", "durable submit ack p50, 1 in flight", best.pct(0.5) * 1e3, "ms",
                                 "NATS round trip p50", ratio, "≤ 3.5×", ratio <= 3.5,
                                 spread([r.rate for r in runs]), note))
                continue
            ratio = best.rate / base
            met = ratio >= targets[conc]
            target = f"≥ {targets[conc]}× NATS"
            if conc == 100:
                met = met and best.pct(0.99) <= 0.010
                target += ", p99 ≤ 10 ms"
            bench.add(Figure("submit", f"durable submits/s, {conc} in flight", best.rate, "req/s",
                             f"NATS r/r {conc}", ratio, target, met, spread([r.rate for r in runs]), note))
            if conc == 2000:
                vs_pg = best.rate / bench.baselines["pg_commit_8"]
                bench.add(Figure("submit", "durable submits/s vs 8-conn single commits", best.rate, "req/s",
                                 "pg single-row, 8 conn", vs_pg, "≥ 5×", vs_pg >= 5))
        rate = bench.profile.n(2000, 5000)  # below capacity: latency, not queueing
        run = await open_loop(nc, f"{dep.prefix}.submit", _submit_body("open"), rate, bench.profile.s(2, 5),
                              check=_is_ack)
        bench.add(Figure("submit", f"open loop at {rate}/s: ack p99", run.pct(0.99) * 1e3, "ms",
                         note=f"p50 {run.pct(0.5) * 1e3:.2f} ms, p999 {run.pct(0.999) * 1e3:.2f} ms, "
                              f"achieved {run.rate:,.0f}/s, errors {run.errors}"))
        jobs = await dep.pool.fetchval("SELECT count(*) FROM jobs")
        bench.add(Figure("submit", "jobs committed (all acked submits)", jobs, "rows"))


async def dispatch_bench(bench: Bench, admin_url: str, nats_url: str, rate: int = 500) -> None:
    peers = [("home", {"device_type": "cpu"}, 1000)] + [(f"gpu{i}", {"device_type": "gpu"}, 1000) for i in range(2)]
    dep = Deployment(bench, admin_url, nats_url, "dispatch", peers, interval=0.5, ttl=3.0)
    await dep.create()
    dep.start("router")
    dep.start("tick")
    for peer_id, _, _ in peers:
        dep.start(peer_id)
    nc = await connect_client(nats_url)
    sent: dict[str, float] = {}
    seen: dict[str, dict[str, float]] = {"queued": {}, "assigned": {}, "running": {}}
    running = seen["running"]
    all_running = asyncio.Event()
    expected = [0]  # known once every submit is out

    async def on_event(msg) -> None:
        event = msgspec.json.decode(msg.data)
        stage = seen.get(event["state"])
        if stage is not None and event["job_id"] not in stage:
            stage[event["job_id"]] = time.perf_counter()
            if expected[0] and len(running) >= expected[0]:
                all_running.set()

    try:
        await nc.subscribe(f"{dep.prefix}.events.*", cb=on_event)
        await dep.wait_router(nc)
        for _ in range(200):  # every agent advertising
            rows = await dep.store.peer_heartbeat_list()
            if len([r for r in rows if r["reachable"]]) == len(peers):
                break
            await asyncio.sleep(0.05)
        # Warm up (connections, prepared statements, first placements), then measure.
        warm = await open_loop(nc, f"{dep.prefix}.submit", _submit_body("warm"), rate, 0.5, check=_is_ack)
        for _ in range(200):
            if sum(1 for j in running if j.startswith("warm-")) >= warm.done:
                break
            await asyncio.sleep(0.05)
        for stage in seen.values():
            stage.clear()
        seconds = bench.profile.s(3, 10)
        cpu_before = {name: _cpu_seconds(p.pid) for name, p in dep.processes.items()}
        started = time.perf_counter()
        acks = await open_loop(nc, f"{dep.prefix}.submit", _submit_body("d"), rate, seconds,
                               sent_at=lambda i, at: sent.__setitem__(f"d-{i}", at), check=_is_ack)
        cpu = {name: (_cpu_seconds(p.pid) - cpu_before[name]) / (time.perf_counter() - started)
               for name, p in dep.processes.items()}
        expected[0] = len(sent)
        if len(running) < len(sent):
            try:
                await asyncio.wait_for(all_running.wait(), timeout=30)
            except TimeoutError:
                pass
        missing = [j for j in sent if j not in running]
        if missing:  # say where they are, so a stuck hop is visible
            rows = await dep.pool.fetch("SELECT job_id, state, owner_peer_id, reason FROM jobs "
                                        "WHERE job_id = ANY($1::text[]) LIMIT 5", missing)
            print(f"  not seen running: {len(missing)}, e.g. {[tuple(r) for r in rows]}", flush=True)
        latencies = sorted(running[j] - sent[j] for j in sent if j in running)
        run = Run(len(latencies), seconds, latencies)
        # Where the time goes: the median of each hop, from the events each service publishes.
        hops, previous = [], sent
        for state, times in seen.items():
            gaps = sorted(times[j] - previous[j] for j in sent if j in times and j in previous)
            if gaps:
                hops.append(f"→{state} {Run(len(gaps), 1, gaps).pct(0.5) * 1e3:.1f}")
            previous = times
        bench.add(Figure("dispatch", f"submit → running p50 at {rate}/s", run.pct(0.5) * 1e3, "ms",
                         target="≤ 10 ms", met=run.pct(0.5) <= 0.010,
                         note=f"{len(latencies)}/{len(sent)} reached running, {acks.errors} submit errors; hop p50 ms: {' '.join(hops)}; "
                              f"CPU % core: {', '.join(f'{k} {v * 100:.0f}' for k, v in cpu.items())}"))
        bench.add(Figure("dispatch", f"submit → running p99 at {rate}/s", run.pct(0.99) * 1e3, "ms",
                         target="≤ 50 ms", met=run.pct(0.99) <= 0.050))
    finally:
        await nc.close()
        await dep.close()


KINDS = ("cpu", "gpu", "tpu")


def _bench_job(i: int, state: str = "queued"):
    """A job row as the router builds it: mixed kinds and priorities; ``state`` for fillers."""
    from services.router.plan import plan_new_job, route
    from shared.federation.router import SubmitDisposition, SubmitPlan
    from shared.messages import SubmitRequest

    request = msgspec.convert({"command": ["true"], "job_id": f"{state[0]}{i}", "priority": i % 5,
                               "constraints": [{"key": "device_type", "op": "eq", "value": KINDS[i % 3]}]},
                              SubmitRequest)
    new, _ = plan_new_job(request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="bench"), "p0", None),
                          f"{state[0]}{i}")
    return new if state == "queued" else dataclasses.replace(new, state=state)


async def _insert_jobs(dep: Deployment, start: int, stop: int, state: str = "queued") -> None:
    for first in range(start, stop, 5000):
        async with dep.pool.acquire() as conn:
            await dep.store.job_insert_batch(conn, [_bench_job(i, state) for i in range(first, min(stop, first + 5000))])
    # Set-up is not measured: statistics fresh, and the fill's dirty pages written now
    # rather than by a checkpoint in the middle of the figure that follows.
    await dep.pool.execute("ANALYZE jobs")
    await dep.pool.execute("CHECKPOINT")


async def tick_bench(bench: Bench, admin_url: str, nats_url: str, jobs: int, peer_count: int,
                     filler: int = 0, label: str = "") -> float:
    from services.tick.service import Tick

    peers = [(f"p{i}", {"device_type": KINDS[i % 3], "zone": f"z{i % 4}"}, max(1, 2 * jobs // peer_count))
             for i in range(peer_count)]
    dep = Deployment(bench, admin_url, nats_url, f"tick{jobs}x{peer_count}{label}", peers)
    await dep.create()
    try:
        await dep.advertise(peers)
        await _insert_jobs(dep, 0, filler, "succeeded")
        await _insert_jobs(dep, 0, jobs)
        tick = Tick(dep.config, dep.pool, None)
        await tick.refresh_view()
        started = time.perf_counter()
        result = await tick.run_once()
        elapsed = time.perf_counter() - started
        return len(result.assigned) / elapsed
    finally:
        await dep.close()


async def _submit_rate(bench: Bench, dep: Deployment, nc: nats.NATS, label: str) -> float:
    """Median of three closed-loop runs at 100 in flight."""
    total = bench.profile.n(5000, 20_000)
    runs = [await closed_loop(nc, f"{dep.prefix}.submit", _submit_body(f"{label}r{i}"), 100, total, check=_is_ack)
            for i in range(3)]
    return median([r.rate for r in runs])


async def submit_scale(bench: Bench, admin_url: str, nats_url: str) -> None:
    """Submit cost against rows already in ``jobs``, and against the number of peers."""
    sizes = (10_000, 50_000) if bench.profile.quick else (10_000, 100_000, 1_000_000)
    async with _routed(bench, admin_url, nats_url, "submitscale", GPU_PEERS) as (dep, nc):
        await _submit_rate(bench, dep, nc, "warm")
        first, filled = None, 0
        for size in sizes:
            await _insert_jobs(dep, filled, size, "succeeded")
            filled = size
            rate = await _submit_rate(bench, dep, nc, f"s{size}")
            first = first or rate
            bench.add(Figure("scale", f"submits/s (100 in flight) with {size:,} rows in jobs", rate, "req/s",
                             f"same at {sizes[0]:,} rows", rate / first, "within 1.5×", first / rate <= 1.5,
                             "3 runs (median)"))
    for count in ((10, 100) if bench.profile.quick else (10, 100, 1000)):
        peers = [(f"g{i}", {"device_type": "gpu"}, 1000) for i in range(count)]
        async with _routed(bench, admin_url, nats_url, f"submitpeers{count}",
                           [("home", {"device_type": "cpu"}, 10)] + peers, advertised=peers) as (dep, nc):
            await _submit_rate(bench, dep, nc, "warm")
            rate = await _submit_rate(bench, dep, nc, f"p{count}")
            bench.add(Figure("scale", f"submits/s (100 in flight) with {count} peers", rate, "req/s",
                             runs="3 runs (median)"))


async def heartbeat_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    count = bench.profile.n(200, 1000)
    peers = [(f"hb{i}", {"device_type": "gpu"}, 4) for i in range(count)]
    dep = Deployment(bench, admin_url, nats_url, "heartbeat", peers, interval=1.0, ttl=3.0)
    await dep.create()
    router, tick = dep.start("router"), dep.start("tick")
    nc = await connect_client(nats_url)
    try:
        await dep.wait_router(nc)
        seconds = bench.profile.s(4, 10)
        run_id = uuid.uuid4().hex
        stats = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        commits_before = await dep.pool.fetchval(stats)
        cpu_before = {p.pid: _cpu_seconds(p.pid) for p in (router, tick)}
        started = time.perf_counter()
        beat = 0
        while time.perf_counter() - started < seconds:
            beat += 1
            for peer_id, _, slots in peers:
                body = msgspec.json.encode({
                    "peer_id": peer_id, "seq": beat, "sent_at": datetime.now(UTC).isoformat(), "ttl_s": 3.0,
                    "run_id": run_id, "backends": [{"name": "simulated", "attributes": {"device_type": ["gpu"]},
                                                    "capacity": {"total": slots, "free": slots}}]})
                await nc.publish(f"{dep.prefix}.heartbeat.{peer_id}", body)
            await nc.flush()
            await asyncio.sleep(max(0.0, started + beat - time.perf_counter()))
        elapsed = time.perf_counter() - started
        cpu = {p.pid: (_cpu_seconds(p.pid) - cpu_before[p.pid]) / elapsed for p in (router, tick)}
        commits = (await dep.pool.fetchval(stats) - commits_before) / elapsed
        bench.add(Figure("heartbeat", f"router CPU with {count} peers at 1 Hz", cpu[router.pid] * 100, "% core",
                         target="< 10%", met=cpu[router.pid] < 0.10))
        bench.add(Figure("heartbeat", f"tick CPU with {count} peers at 1 Hz", cpu[tick.pid] * 100, "% core"))
        bench.add(Figure("heartbeat", "Postgres commits/s (control plane)", commits, "commits/s",
                         note="peers here publish on NATS only; see docs/performance.md"))
    finally:
        await nc.close()
        await dep.close()


# ---------------------------------------------------------------- driver


async def _run(bench: Bench, admin_url: str, nats_url: str, sections: set[str]) -> None:
    print("baselines", flush=True)
    await nats_baseline(bench, nats_url)
    await postgres_baselines(bench, admin_url)
    if "submit" in sections:
        print("submit", flush=True)
        await submit_bench(bench, admin_url, nats_url)
    if "dispatch" in sections:
        print("dispatch", flush=True)
        await dispatch_bench(bench, admin_url, nats_url)
    if "tick" in sections:
        print("tick", flush=True)
        jobs, peers = bench.profile.n(10_000, 100_000), bench.profile.n(20, 100)
        rates = [await tick_bench(bench, admin_url, nats_url, jobs, peers, label=f"r{i}") for i in range(3)]
        ratio = median(rates) / bench.baselines["pg_claim"]
        bench.add(Figure("tick", f"assignments/s, {jobs:,} queued × {peers} peers", median(rates), "jobs/s",
                         "batched claim", ratio, "≥ 25,000/s and ≥ 0.5× claim",
                         median(rates) >= 25_000 and ratio >= 0.5, spread(rates)))
    if "heartbeat" in sections:
        print("heartbeat fan-in", flush=True)
        await heartbeat_bench(bench, admin_url, nats_url)
    if "scale" in sections:
        print("scale curve", flush=True)
        await submit_scale(bench, admin_url, nats_url)
        sizes = (10_000, 50_000) if bench.profile.quick else (10_000, 100_000, 1_000_000)
        await tick_bench(bench, admin_url, nats_url, 5000, 20, label="warm")  # not measured: a cold first run
        first = None
        for size in sizes:
            rate = await tick_bench(bench, admin_url, nats_url, 5000, 20, filler=size, label=f"s{size}")
            first = first or rate
            bench.add(Figure("scale", f"tick assignments/s with {size:,} rows in jobs", rate, "jobs/s",
                             f"same at {sizes[0]:,} rows", rate / first, "within 1.5×", first / rate <= 1.5))
        for peers in ((10, 100) if bench.profile.quick else (10, 100, 1000)):
            rate = await tick_bench(bench, admin_url, nats_url, 5000, peers, label=f"p{peers}")
            bench.add(Figure("scale", f"tick assignments/s with {peers} peers", rate, "jobs/s"))


def run_bench(quick: bool, out: Path | None, sections: set[str]) -> list[Figure]:
    folder = Path(tempfile.mkdtemp(prefix="irisfed-bench-"))
    os.chmod(folder, 0o755)
    bench = Bench(Profile(quick), folder)
    nats_server = start_nats(folder / "nats", jetstream=False)
    postgres = start_postgres(folder / "pg", durable=True)  # fsync on: the real cost of a commit
    try:
        asyncio.run(_run(bench, postgres.url, nats_server.url, sections))
    finally:
        nats_server.stop()
        postgres.stop()
        shutil.rmtree(folder, ignore_errors=True)
    _print_table(bench)
    if out is not None:
        out.write_text(json.dumps({
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "when": datetime.now(UTC).isoformat(), "quick": quick,
            "figures": [asdict(f) for f in bench.figures]}, indent=2))
    return bench.figures


def _print_table(bench: Bench) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"irisfed bench ({'quick' if bench.profile.quick else 'full'}), "
                        f"{os.cpu_count()} cores")
    for column in ("section", "figure", "value", "vs baseline", "target", "met", "runs", "notes"):
        table.add_column(column, overflow="fold")
    for f in bench.figures:
        ratio = f"{f.ratio:.2f}× {f.baseline}" if f.ratio is not None else ""
        met = "" if f.met is None else ("[green]yes[/]" if f.met else "[red]no[/]")
        table.add_row(f.section, f.name, f"{f.value:,.2f} {f.unit}", ratio, f.target, met, f.runs, f.note)
    Console(width=200).print(table)
