"""The same-run baselines every bench figure is compared with: raw NATS request/reply
and raw asyncpg commits, batched inserts and SKIP LOCKED claims."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg

from irisfed.bench.deployment import bench_env, python_module
from irisfed.bench.load import closed_loop, median, spread
from irisfed.bench.report import Bench, Figure
from irisfed.services.common.bus import connect_client
from irisfed.tooling.federation import Supervisor


async def nats_baseline(bench: Bench, nats_url: str) -> None:
    subject = f"bench.echo.{uuid.uuid4().hex[:6]}"
    supervisor = Supervisor(bench.folder)
    supervisor.start("echo", python_module("irisfed.bench.echo", nats_url, subject), bench_env())
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
        supervisor.stop_all()


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


