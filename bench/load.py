"""Load generation and statistics for the benchmarks (closed and open loop)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats


@dataclass
class Run:
    """One measured run: completed requests, wall time, latencies (s), errors."""

    done: int
    seconds: float
    latencies: list[float]
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: list[float]) -> str:
    """'median (min–max, n runs)' for a figure measured several times."""
    if len(values) == 1:
        return "1 run"
    return f"{len(values)} runs, {min(values):,.0f}–{max(values):,.0f}"


def median(values: list[float]) -> float:
    return statistics.median(values)


async def closed_loop(nc: nats.NATS, subject: str, body: Callable[[int], bytes], concurrency: int,
                      total: int, check: Callable[[bytes], bool] | None = None) -> Run:
    """Keep ``concurrency`` requests in flight until ``total`` complete."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(total))

    async def worker() -> None:
        nonlocal errors
        for i in counter:
            start = time.perf_counter()
            try:
                reply = await nc.request(subject, body(i), timeout=30)
            except Exception:  # noqa: BLE001 - counted, not fatal
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)
            if check is not None and not check(reply.data):
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(len(latencies), time.perf_counter() - started, latencies, errors)


async def open_loop(nc: nats.NATS, subject: str, body: Callable[[int], bytes], rate: float,
                    seconds: float) -> Run:
    """Send at a fixed rate whatever the replies do; latency counts from the scheduled time."""
    latencies: list[float] = []
    errors = 0
    pending: set[asyncio.Task] = set()

    async def one(i: int, scheduled: float) -> None:
        nonlocal errors
        try:
            await nc.request(subject, body(i), timeout=30)
            latencies.append(time.perf_counter() - scheduled)
        except Exception:  # noqa: BLE001
            errors += 1

    started = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        scheduled = started + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i, scheduled))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)
    return Run(len(latencies), time.perf_counter() - started, latencies, errors)
