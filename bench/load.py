"""Load generation and statistics for the benchmarks (closed and open loop)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
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


class _Inbox:
    """Requests with our own reply subjects: one wildcard subscription, no future per request.

    ``nc.request`` costs a future, a timer and a fresh inbox token per call; in a
    Python load generator sharing two cores with the system under test that cost
    would be measured as if it were the server's. Here a request is one publish
    and its reply one callback.
    """

    def __init__(self, nc: nats.NATS, subject: str, body: Callable[[int], bytes], total: int,
                 check: Callable[[bytes], bool] | None, inbox: str = "_BENCH") -> None:
        self.nc, self.subject, self.body, self.total, self.check = nc, subject, body, total, check
        self.prefix = f"{inbox}.{uuid.uuid4().hex}."
        self.sent_at = [0.0] * total
        self.latencies: list[float] = []
        self.errors = 0
        self.answered = 0
        self.done = asyncio.Event()
        self.on_answer: Callable[[], Awaitable[None]] | None = None

    async def open(self) -> None:
        self.sub = await self.nc.subscribe(self.prefix + "*", cb=self._reply, pending_msgs_limit=-1,
                                           pending_bytes_limit=-1)
        await self.nc.flush()

    async def send(self, i: int, at: float | None = None) -> None:
        self.sent_at[i] = time.perf_counter() if at is None else at
        await self.nc.publish(self.subject, self.body(i), reply=f"{self.prefix}{i}")

    async def _reply(self, msg) -> None:
        i = int(msg.subject[len(self.prefix):])
        self.latencies.append(time.perf_counter() - self.sent_at[i])
        # A "no responders" status arrives as an empty reply with headers.
        if (self.check is not None and not self.check(msg.data)) or (not msg.data and msg.headers):
            self.errors += 1
        self.answered += 1
        if self.answered >= self.total:
            self.done.set()
        if self.on_answer is not None:
            await self.on_answer()

    async def wait(self, patience_s: float) -> None:
        try:
            await asyncio.wait_for(self.done.wait(), patience_s)
        except TimeoutError:
            self.errors += self.total - self.answered  # never answered
        await self.sub.unsubscribe()


async def closed_loop(nc: nats.NATS, subject: str, body: Callable[[int], bytes], concurrency: int,
                      total: int, check: Callable[[bytes], bool] | None = None, patience_s: float = 300,
                      inbox_prefix: str = "_BENCH") -> Run:
    """Keep ``concurrency`` requests in flight until ``total`` are answered. Replies come
    to ``<inbox_prefix>.<random>.<i>``: a NATS user with permissions may read only its
    own inbox (``inbox_prefix_for_url`` of its URL)."""
    inbox = _Inbox(nc, subject, body, total, check, inbox_prefix)
    await inbox.open()
    next_i = min(concurrency, total)

    async def refill() -> None:
        nonlocal next_i
        if next_i < total:
            next_i += 1
            await inbox.send(next_i - 1)

    inbox.on_answer = refill
    started = time.perf_counter()
    for i in range(next_i):
        await inbox.send(i)
    await inbox.wait(patience_s)
    return Run(len(inbox.latencies), time.perf_counter() - started, inbox.latencies, inbox.errors)


@dataclass
class Client:
    """One load generator's connection: where it sends, and the inbox its NATS user may read."""

    nc: nats.NATS
    subject: str
    inbox_prefix: str = "_BENCH"


async def closed_loops(clients: list[Client], body: Callable[[int, int], bytes], concurrency: int, total: int,
                       check: Callable[[bytes], bool] | None = None) -> Run:
    """:func:`closed_loop` on every client at once, ``concurrency`` and ``total`` split
    evenly between them (``body(client, i)``: client's ``i``-th request); one Run over
    the wall time of all of them."""
    each, share = max(1, concurrency // len(clients)), max(1, total // len(clients))
    started = time.perf_counter()
    runs = await asyncio.gather(*(
        closed_loop(c.nc, c.subject, lambda i, n=n: body(n, i), each, share, check, inbox_prefix=c.inbox_prefix)
        for n, c in enumerate(clients)))
    return Run(sum(r.done for r in runs), time.perf_counter() - started,
               [latency for r in runs for latency in r.latencies], sum(r.errors for r in runs))


async def open_loop(nc: nats.NATS, subject: str, body: Callable[[int], bytes], rate: float,
                    seconds: float, sent_at: Callable[[int, float], None] | None = None,
                    check: Callable[[bytes], bool] | None = None) -> Run:
    """Send at a fixed rate whatever the replies do; latency counts from the scheduled time."""
    total = int(rate * seconds)
    inbox = _Inbox(nc, subject, body, total, check)
    await inbox.open()
    started = time.perf_counter()
    for i in range(total):
        scheduled = started + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sent_at is not None:
            sent_at(i, scheduled)
        await inbox.send(i, at=scheduled)
    await inbox.wait(60)
    return Run(len(inbox.latencies), time.perf_counter() - started, inbox.latencies, inbox.errors)
