"""pgqueuer, the plain Postgres job queue a team might use instead: a same-run peer
baseline for ``dispatch`` (submit → running) and ``submit`` (durable submits).

On the bench's own Postgres (same server, fsync on), each part in a fresh database
with pgqueuer's schema installed by its own installer (``Queries.install``, what
``pgq install`` runs):

- *enqueue → start at 500 jobs/s*: one consumer process (``python -m irisfed.bench.pgqueuer
  URL``: ``pgqueuer.run``, what ``pgq run`` runs, on uvloop as ``pgq run`` picks it,
  default batch size 10) whose entrypoint notes the time it starts each job;
  open-loop single enqueues (one statement and one commit each) from this process,
  each timed from just before its call.
- *100 concurrent single enqueues*: 100 coroutines sharing an asyncpg pool of
  asyncpg's default size (10), each enqueueing one job at a time (closed loop, a
  commit per job); jobs/s and the enqueue call's latency (the producer's ack). No
  consumer runs, as no tick or agent runs in irisfed's submit figures.

Needs the ``bench`` extra (``pip install -e '.[bench]'``; ``dev`` includes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import asyncpg

from irisfed.bench.deployment import bench_env, cpu_seconds, python_module
from irisfed.bench.load import Run, spread
from irisfed.bench.report import Bench, Figure
from irisfed.shared.postgres import with_database

ENTRYPOINT = "bench"
RATE = 500  # jobs/s, as irisfed's dispatch figure
PRODUCERS = 100  # as irisfed's "100 in flight"
POOL_SIZE = 10  # asyncpg's default pool size
BATCH_SIZE = 10  # pgqueuer's default (`pgq run --batch-size`)
REQUIREMENT = "pgqueuer>=1.6,<2"


def missing() -> str | None:
    """Why pgqueuer cannot be measured here (not installed, or not the 1.x line); None if it can."""
    try:
        import pgqueuer
    except ImportError:
        return f"pgqueuer is not installed (pip install -e '.[bench]', or '{REQUIREMENT}')"
    major = pgqueuer.__version__.split(".", 1)[0]
    if major != "1":
        return f"pgqueuer {pgqueuer.__version__} is installed; the bench measures the 1.x line ({REQUIREMENT})"
    return None


def clock() -> float:
    """CLOCK_MONOTONIC, named: one clock for every process on the machine, so the
    consumer's start times and this process's enqueue times can be subtracted."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def start_line(job: bytes, at: float) -> bytes:
    """What the consumer writes per started job: its payload (the bench's job id) and when."""
    return b"%s %.6f\n" % (job, at)


def parse_start(line: bytes) -> tuple[str, float]:
    job, at = line.split()
    return job.decode(), float(at)


def start_latencies(sent: dict[str, float], started: dict[str, float]) -> list[float]:
    """Enqueue → start of every sent job that started, in seconds, sorted."""
    return sorted(started[job] - at for job, at in sent.items() if job in started)


# --- the consumer: runs in its own process, as `pgq run` would run it ----------------

@contextlib.asynccontextmanager
async def consumer(args: list[str]):
    """``pgq run`` factory (``args``: the database URL): a PgQueuer on one connection,
    as pgqueuer's docs set one up, with one entrypoint that notes when it starts a job
    and writes it to stdout."""
    from pgqueuer import AsyncpgDriver, Job, PgQueuer

    connection = await asyncpg.connect(args[0])
    pgq = PgQueuer(AsyncpgDriver(connection))
    pending: list[bytes] = []

    @pgq.entrypoint(ENTRYPOINT)
    async def start(job: Job) -> None:
        pending.append(start_line(job.payload or b"", clock()))

    async def report() -> None:
        # The times are taken in the entrypoint; this only hands them over, a few
        # hundred bytes per 10 ms to a pipe the bench drains, so the write never waits.
        out = sys.stdout.buffer
        while True:
            await asyncio.sleep(0.01)
            if pending:
                out.write(b"".join(pending))
                pending.clear()
                out.flush()

    reporter = asyncio.create_task(report())
    try:
        yield pgq
    finally:
        reporter.cancel()
        await connection.close()


async def consume(url: str) -> None:
    """``pgq run bench.pgqueuer:consumer -- URL`` through its Python API
    (``pgqueuer.run``); SIGTERM stops it. (The CLI itself logs to stdout, where the
    start times go, and 1.6's ``--log-level WARNING`` fails as it parses the level.)"""
    import functools
    import signal

    import pgqueuer

    shutdown = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, shutdown.set)
    await pgqueuer.run(functools.partial(consumer, [url]), batch_size=BATCH_SIZE, shutdown=shutdown)


def main(url: str) -> None:
    try:  # as `pgq run` does: uvloop when it is there (pgqueuer depends on it)
        import uvloop
    except ImportError:
        asyncio.run(consume(url))
    else:
        uvloop.run(consume(url))


class Consumer:
    """The consumer process, its start times as they arrive (job → CLOCK_MONOTONIC)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.started: dict[str, float] = {}
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, bench: Bench, url: str) -> Consumer:
        log = await asyncio.to_thread(open, bench.folder / "pgqueuer-consumer.log", "ab")
        with log:
            process = await asyncio.create_subprocess_exec(
                *python_module("irisfed.bench.pgqueuer", url),
                stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL,
                env=bench_env(), cwd=bench.folder, start_new_session=True)
        return cls(process)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            job, at = parse_start(line)
            self.started[job] = at

    async def wait_for(self, jobs, patience_s: float) -> bool:
        """Whether every one of ``jobs`` started within ``patience_s`` seconds."""
        deadline = clock() + patience_s
        while clock() < deadline:
            if all(job in self.started for job in jobs):
                return True
            if self.process.returncode is not None:
                return False
            await asyncio.sleep(0.02)
        return False

    async def stop(self) -> None:
        """SIGTERM to its own PID (it shuts down on it); SIGKILL after 10 s."""
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        await self.reader


# --- the bench side ---------------------------------------------------------------

@contextlib.asynccontextmanager
async def pgqueuer_database(admin_url: str, name: str):
    """A fresh database with pgqueuer's schema installed by its own installer; its URL.
    Dropped on exit, so its autovacuum and dirty pages do not run into the next figure."""
    from pgqueuer import Queries

    database = f"bench_{name}"
    conn = await asyncpg.connect(admin_url)
    await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    await conn.execute(f'CREATE DATABASE "{database}"')
    await conn.close()
    url = with_database(admin_url, database)
    conn = await asyncpg.connect(url)
    try:
        await Queries.from_asyncpg_connection(conn).install()
    finally:
        await conn.close()
    try:
        yield url
    finally:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            await conn.close()


async def enqueue_open_loop(queries, rate: float, seconds: float, label: str,
                            sent: dict[str, float]) -> Run:
    """Single enqueues of jobs ``<label>-<i>`` at ``rate`` for ``seconds``, each its own
    task (so a slow commit does not hold back the next); ``sent`` gets when each call
    began. The Run's latencies are the enqueue calls' (the producer's ack)."""
    acks: list[float] = []

    async def one(job: str) -> None:
        at = clock()
        sent[job] = at
        await queries.enqueue(ENTRYPOINT, job.encode())
        acks.append(clock() - at)

    tasks = []
    total = int(rate * seconds)
    started = clock()
    for i in range(total):
        delay = started + i / rate - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(f"{label}-{i}")))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = sum(1 for o in outcomes if isinstance(o, BaseException))
    return Run(len(acks), clock() - started, acks, errors)


async def enqueue_closed_loop(queries, producers: int, seconds: float, label: str) -> Run:
    """``producers`` coroutines, each enqueueing one job at a time (its own statement
    and commit) until ``seconds`` are up; every enqueue call's latency."""
    latencies: list[float] = []
    errors = 0

    async def producer(p: int) -> None:
        nonlocal errors
        i = 0
        while clock() < deadline:
            at = clock()
            try:
                await queries.enqueue(ENTRYPOINT, f"{label}-{p}-{i}".encode())
            except Exception:  # noqa: BLE001 - counted, and the figure says how many
                errors += 1
            else:
                latencies.append(clock() - at)
            i += 1

    deadline = clock() + seconds
    started = clock()
    await asyncio.gather(*(producer(p) for p in range(producers)))
    return Run(len(latencies), clock() - started, latencies, errors)


async def concurrent_enqueues(bench: Bench, admin_url: str) -> None:
    from pgqueuer import Queries

    seconds = bench.profile.s(1.5, 5.0)
    async with pgqueuer_database(admin_url, "pgqueuer_enqueue") as url:
        pool = await asyncpg.create_pool(url, min_size=POOL_SIZE, max_size=POOL_SIZE)
        try:
            queries = Queries.from_asyncpg_pool(pool)
            await enqueue_closed_loop(queries, PRODUCERS, 0.3, "warm")  # prepared statements, not measured
            runs = [await enqueue_closed_loop(queries, PRODUCERS, seconds, f"r{attempt}") for attempt in range(3)]
        finally:
            await pool.close()
    best = sorted(runs, key=lambda r: r.rate)[1]
    bench.baselines["pgq_enqueue_100"] = best.rate
    bench.baselines["pgq_enqueue_100_p50"] = best.pct(0.5)
    bench.baselines["pgq_enqueue_100_p99"] = best.pct(0.99)
    bench.add(Figure("pgqueuer", f"pgqueuer enqueues/s, {PRODUCERS} concurrent producers", best.rate, "jobs/s",
                     runs=spread([r.rate for r in runs]),
                     note=f"ack p50 {best.pct(0.5) * 1e3:.2f} ms, p99 {best.pct(0.99) * 1e3:.2f} ms, "
                          f"errors {best.errors}; one statement and commit per job, pool of {POOL_SIZE}"))


async def enqueue_to_start(bench: Bench, admin_url: str) -> None:
    from pgqueuer import Queries

    seconds = bench.profile.s(3, 10)
    async with pgqueuer_database(admin_url, "pgqueuer_start") as url:
        consumer = await Consumer.start(bench, url)
        pool = await asyncpg.create_pool(url, min_size=4, max_size=10)
        try:
            queries = Queries.from_asyncpg_pool(pool)
            # Up once a probe job starts (schema checked, LISTEN in place).
            for probe in range(300):
                await queries.enqueue(ENTRYPOINT, f"ready-{probe}".encode())
                if await consumer.wait_for([f"ready-{probe}"], 0.1) or consumer.process.returncode is not None:
                    break
            if not consumer.started:
                raise RuntimeError(f"the pgqueuer consumer did not start a job (see {bench.folder}/"
                                   "pgqueuer-consumer.log)")
            warm: dict[str, float] = {}
            await enqueue_open_loop(queries, RATE, 0.5, "w", warm)  # not measured
            await consumer.wait_for(warm, 30)
            sent: dict[str, float] = {}
            cpu_before, wall_before = cpu_seconds(consumer.process.pid), clock()
            acks = await enqueue_open_loop(queries, RATE, seconds, "d", sent)
            cpu = (cpu_seconds(consumer.process.pid) - cpu_before) / (clock() - wall_before)
            await consumer.wait_for(sent, 30)
        finally:
            await pool.close()
            await consumer.stop()
    latencies = start_latencies(sent, consumer.started)
    run = Run(len(latencies), seconds, latencies)
    bench.baselines["pgq_start_p50"] = run.pct(0.5)
    bench.baselines["pgq_start_p99"] = run.pct(0.99)
    # Below the offered rate, its enqueues queue for the commit lock: a backlog, not a latency.
    bench.baselines["pgq_start_kept_up"] = acks.rate / RATE
    note = (f"{run.done}/{len(sent)} started, {acks.errors} enqueue errors, enqueues done at "
            f"{acks.rate:,.0f}/s; enqueue ack p50 "
            f"{acks.pct(0.5) * 1e3:.2f} ms, p99 {acks.pct(0.99) * 1e3:.2f} ms; consumer (pgq run, batch "
            f"{BATCH_SIZE}) {cpu * 100:.0f}% of a core")
    bench.add(Figure("pgqueuer", f"pgqueuer enqueue → start p50 at {RATE}/s", run.pct(0.5) * 1e3, "ms", note=note))
    bench.add(Figure("pgqueuer", f"pgqueuer enqueue → start p99 at {RATE}/s", run.pct(0.99) * 1e3, "ms"))


async def pgqueuer_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    reason = missing()
    if reason is not None:
        raise RuntimeError(reason)
    await concurrent_enqueues(bench, admin_url)
    await enqueue_to_start(bench, admin_url)


if __name__ == "__main__":
    main(sys.argv[1])
