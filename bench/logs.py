"""The ``logs`` section: what shipping runs' output home costs (docs/design.md §3.6).

- *follow lag*: 100 runs on one peer each writing 10 KiB/s (a 1 KiB line every
  0.1 s, stamped with its time), shipped by an agent's ``LogShipper`` in a process
  of its own (``bench/shipper.py``), read back by followers asking the stream as often
  as ``irisfed logs --follow`` does (``FOLLOW_POLL_S``): each line's write → read time, p50 and
  p99 (targets 250 ms and 1 s), and the shipping process's CPU (≤ 10% of a core).
- *throughput*: one run writing as fast as it can (64 MiB; quick 16) shipped whole,
  against a bare JetStream publish loop of the same 256 KiB pieces (≥ 0.5×).
- *a user's jobs*: ``irisfed jobs`` over NATS (the router's ``store_read`` for one
  user, answered in this process) against the operator's direct read of as many rows,
  with 1,000,000 rows in the table (quick 100,000): ≤ 2×.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time

from irisfed.bench.deployment import Deployment, bench_env, cpu_seconds, prefix_of
from irisfed.bench.load import median
from irisfed.bench.report import Bench, Figure
from irisfed.bench.sections import _insert_jobs
from irisfed.logs import FOLLOW_POLL_S
from irisfed.remote_reads import RemoteReads
from irisfed.services.common.bus import connect_client
from irisfed.services.common.logstore import LogStore, ensure_log_streams
from irisfed.services.peer_agent.logs import LogShipper
from irisfed.services.router.reads import Reads
from irisfed.shared.logs import MESSAGE_BYTES, log_subject, split
from irisfed.shared.messages import StoreReadRequest, decode_request, encoder

PEER = "bench-peer"
RUNS = 100
LINE = 1024


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _follow_lag(bench: Bench, nats_url: str) -> None:
    prefix = prefix_of("logs-follow")
    folder = bench.folder / "logs-runs"
    for i in range(RUNS):
        (folder / f"job-{i}" / "epoch-1").mkdir(parents=True, exist_ok=True)
        (folder / f"job-{i}" / "epoch-1" / "stdout").write_bytes(b"")
    nc = await connect_client(nats_url)
    await ensure_log_streams(nc, prefix, [PEER])
    store = LogStore(nc, prefix, PEER)
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "irisfed.bench.shipper", nats_url, prefix, PEER,
                                                 str(folder), str(RUNS), stdout=asyncio.subprocess.PIPE, env=bench_env())
    seconds = bench.profile.n(4, 12)
    lags: list[float] = []
    try:
        if (await asyncio.wait_for(child.stdout.readline(), 60)).strip() != b"ready":
            raise RuntimeError("the bench's shipper process did not start")
        stop = asyncio.Event()

        async def write() -> None:
            handles = [open(folder / f"job-{i}" / "epoch-1" / "stdout", "ab", buffering=0)  # noqa: SIM115, ASYNC230
                       for i in range(RUNS)]
            try:
                while not stop.is_set():
                    for handle in handles:
                        stamp = f"{time.time():.6f} ".encode()
                        handle.write(stamp + b"x" * (LINE - len(stamp) - 1) + b"\n")
                    await asyncio.sleep(0.1)
            finally:
                for handle in handles:
                    handle.close()

        async def follow(i: int) -> None:
            subject, seq, rest = log_subject(prefix, PEER, f"job-{i}", 1, 0, "stdout"), 1, b""
            while not stop.is_set():
                pieces = await store.read(subject, seq)
                now = time.time()
                for piece in pieces:
                    rest += piece.data
                    seq = piece.seq + 1
                *lines, rest = rest.split(b"\n")
                lags.extend(now - float(line.split(b" ", 1)[0]) for line in lines if line)
                await asyncio.sleep(FOLLOW_POLL_S)

        writer = asyncio.ensure_future(write())
        followers = [asyncio.ensure_future(follow(i)) for i in range(RUNS)]
        await asyncio.sleep(2.0)  # warm: every file followed, the first passes done
        lags.clear()
        cpu_before, started = cpu_seconds(child.pid), time.monotonic()
        await asyncio.sleep(seconds)
        cpu = (cpu_seconds(child.pid) - cpu_before) / (time.monotonic() - started)
        stop.set()
        await asyncio.gather(writer, *followers)
    finally:
        child.kill()
        await child.wait()
        await nc.close()
        shutil.rmtree(folder, ignore_errors=True)
    p50, p99 = _percentile(lags, 0.5) * 1e3, _percentile(lags, 0.99) * 1e3
    runs = f"{len(lags):,} lines over {seconds} s"
    bench.add(Figure("logs", f"follow lag p50, {RUNS} runs × 10 KiB/s on one peer", p50, "ms", target="≤ 250 ms",
                     met=p50 <= 250, runs=runs, note=f"write → read by a follower asking every {FOLLOW_POLL_S:g} s"))
    bench.add(Figure("logs", f"follow lag p99, {RUNS} runs × 10 KiB/s on one peer", p99, "ms", target="≤ 1000 ms",
                     met=p99 <= 1000, runs=runs))
    bench.add(Figure("logs", f"shipping CPU, {RUNS} runs × 10 KiB/s", cpu * 100, "% of a core", target="≤ 10%",
                     met=cpu <= 0.10, runs=runs, note="the shipping process's user + system time"))


async def _throughput(bench: Bench, nats_url: str) -> None:
    prefix = prefix_of("logs-fast")
    size = bench.profile.n(16, 64) << 20
    run_dir = bench.folder / "logs-fast" / "epoch-1"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    (run_dir / "stdout").write_bytes(data)
    nc = await connect_client(nats_url)
    try:
        await ensure_log_streams(nc, prefix, [PEER])
        store = LogStore(nc, prefix, PEER)
        shipped, bare = [], []
        for r in range(3):
            ship = LogShipper(store, prefix, PEER, max_bytes=size + (1 << 20))
            started = time.perf_counter()
            assert await ship.finish(f"fast-{r}", 1, 1, str(run_dir))
            shipped.append(time.perf_counter() - started)
            subject = log_subject(prefix, PEER, f"bare-{r}", 1, 0, "stdout")
            started = time.perf_counter()
            for offset, piece in split(data, 0, MESSAGE_BYTES):
                await store.publish(subject, offset, piece)
            bare.append(time.perf_counter() - started)
    finally:
        await nc.close()
        shutil.rmtree(bench.folder / "logs-fast", ignore_errors=True)
    mib, ship_s, bare_s = size / (1 << 20), median(shipped), median(bare)
    bench.add(Figure("logs", f"one run writing as fast as it can: {mib:,.0f} MiB shipped", mib / ship_s, "MiB/s",
                     f"a bare JetStream publish loop of the same {MESSAGE_BYTES >> 10} KiB pieces", bare_s / ship_s,
                     target="≥ 0.5×", met=bare_s / ship_s >= 0.5, runs="median of 3",
                     note=f"shipped {ship_s:.2f} s, bare loop {bare_s:.2f} s"))


async def _user_reads(bench: Bench, admin_url: str, nats_url: str) -> None:
    rows = bench.profile.n(100_000, 1_000_000)
    dep = Deployment(bench, admin_url, nats_url, "logs-reads", [("home", {"device_type": "cpu"}, 10)])
    await dep.create()
    nc = await connect_client(nats_url)
    try:
        await _insert_jobs(dep, 0, rows, user_of=lambda i: f"u{i % 100}")
        reads = Reads(nc, dep.prefix, dep.store)

        async def answer(msg) -> None:
            request = decode_request(StoreReadRequest, msg.data)
            await msg.respond(encoder.encode(await reads.store_read("u1", request)))
        sub = await nc.subscribe(f"{dep.prefix}.read.store.u1", cb=answer)
        remote = RemoteReads(nc, dep.prefix, "u1")
        direct_s, remote_s = [], []
        for _ in range(bench.profile.n(20, 50)):
            started = time.perf_counter()
            await dep.store.job_list(None, 50, user_id="u1")
            direct_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            listed = await remote.job_list(None, 50)
            remote_s.append(time.perf_counter() - started)
        assert len(listed) == 50
        await sub.unsubscribe()
    finally:
        await nc.close()
        await dep.close()
    ours, theirs = median(remote_s) * 1e3, median(direct_s) * 1e3
    bench.add(Figure("logs", f"a user's jobs over NATS, {rows:,} rows", ours, "ms",
                     "the operator's direct read of the same 50 rows", ours / theirs, target="≤ 2×",
                     met=ours / theirs <= 2, runs="median of each",
                     note=f"over NATS {ours:.2f} ms, direct {theirs:.2f} ms"))


async def logs_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await _follow_lag(bench, nats_url)
    await _throughput(bench, nats_url)
    await _user_reads(bench, admin_url, nats_url)
