"""Live updates: what changed, gathered and sent to each viewer as server-sent events.

Changes come from NATS (``events.<job>``, ``heartbeat.<peer>``) or, while NATS is
away, from polling Postgres. The broker gathers them and, at most once per
``flush_s``, hands every viewer one small batch: which jobs moved (or "many"),
whether peers changed, and the live mode when it changed. A viewer has a bounded
queue of batches; one that falls behind (a slow connection) loses its queue and
gets one "resync" instead, so it never grows memory or slows the others. The page
then re-fetches its fragments (app.js turns each event into a DOM event that htmx
triggers on).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from prometheus_client import Counter, Gauge

VIEWERS = Gauge("irisfed_web_viewers", "Open live-update streams (/events) of the dashboard")
RESYNCS = Counter("irisfed_web_resyncs_total", "Viewers that fell behind and were told to re-fetch everything")
LIVE = Gauge("irisfed_web_live", "1 while the dashboard hears NATS, 0 while it polls Postgres")

MAX_IDS = 100  # job ids per batch; more changes at once are sent as "many jobs changed"
RETRY_MS = 3000  # how soon a browser reconnects a broken stream


@dataclass(frozen=True, slots=True)
class Batch:
    """What changed since the last flush (``all_jobs``: too many to name)."""

    jobs: tuple[str, ...] = ()
    all_jobs: bool = False
    peers: bool = False
    live: bool | None = None  # the live mode, when it changed
    resync: bool = False  # re-fetch everything (this viewer missed batches)


RESYNC = Batch(resync=True)


class Pending:
    """Changes gathered between two flushes (bounded: at most MAX_IDS job ids)."""

    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self.max_ids = max_ids
        self._jobs: dict[str, None] = {}  # insertion-ordered set
        self._all_jobs = False
        self._peers = False
        self._live: bool | None = None
        self._resync = False

    def job(self, job_id: str) -> None:
        if self._all_jobs:
            return
        self._jobs[job_id] = None
        if len(self._jobs) > self.max_ids:
            self._jobs.clear()
            self._all_jobs = True

    def all_jobs(self) -> None:
        self._jobs.clear()
        self._all_jobs = True

    def peers(self) -> None:
        self._peers = True

    def live(self, live: bool) -> None:
        self._live = live

    def resync(self) -> None:
        self._resync = True

    def __bool__(self) -> bool:
        return bool(self._jobs or self._all_jobs or self._peers or self._live is not None or self._resync)

    def take(self) -> Batch | None:
        """The batch gathered so far (None: nothing), and start afresh."""
        if not self:
            return None
        batch = Batch(tuple(self._jobs), self._all_jobs, self._peers, self._live, self._resync)
        self._jobs, self._all_jobs, self._peers, self._live, self._resync = {}, False, False, None, False
        return batch


def sse_event(name: str, data: object) -> str:
    """One server-sent event (JSON data on one line: JSON never holds a raw newline)."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@lru_cache(maxsize=8)  # every viewer is sent the same batch: format it once
def sse_lines(batch: Batch) -> str:
    """A batch as server-sent events: ``mode``, ``resync``, ``jobs``, ``peers``."""
    out = []
    if batch.live is not None:
        out.append(sse_event("mode", {"live": batch.live}))
    if batch.resync:
        out.append(sse_event("resync", {}))
    if batch.all_jobs:
        out.append(sse_event("jobs", {"all": True, "ids": []}))
    elif batch.jobs:
        out.append(sse_event("jobs", {"all": False, "ids": list(batch.jobs)}))
    if batch.peers:
        out.append(sse_event("peers", {}))
    return "".join(out)


class Viewer:
    """One open stream (of ``client``): its bounded queue of batches (None: the stream ends)."""

    def __init__(self, size: int, client: str = "-") -> None:
        self.queue: asyncio.Queue[Batch | None] = asyncio.Queue(maxsize=size)
        self.client = client
        self.dropped = 0

    def offer(self, batch: Batch) -> None:
        """Queue ``batch``; when the queue is full, drop it all for one resync."""
        try:
            self.queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.dropped += 1
            RESYNCS.inc()
            self._replace_with(RESYNC)

    def end(self) -> None:
        self._replace_with(None)

    def _replace_with(self, last: Batch | None) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(last)


class Refused(Enum):
    """Why a new stream was not opened."""

    FULL = "full"  # max_viewers streams are open
    CLIENT_FULL = "client_full"  # this client holds viewers_per_client of them already


def client_key(host: str) -> str:
    """Whose share of the live streams a client address counts against: an IPv6
    client by its /64 (one host or home network gets a whole /64, so counting each
    address alone let one client take every slot), an IPv4-mapped IPv6 address as
    the IPv4 one; anything else (``-``, a name) as it is."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Broker:
    """Gathers changes and fans them out to every viewer, at most once per ``flush_s``.

    At most ``max_viewers`` streams at once, and ``viewers_per_client`` of them per
    client (its address), so one client cannot take every slot of the live view.
    """

    def __init__(self, flush_s: float = 0.5, queue_batches: int = 16, max_viewers: int = 200,
                 live: bool = False, viewers_per_client: int | None = None) -> None:
        self.flush_s = flush_s
        self.queue_batches = queue_batches
        self.max_viewers = max_viewers
        self.viewers_per_client = viewers_per_client or max_viewers
        self._per_client: dict[str, int] = {}
        self.live = live
        LIVE.set(1 if live else 0)
        self._pending = Pending()
        self._wake = asyncio.Event()
        self._viewers: set[Viewer] = set()
        self._closed = False

    # ------------------------------------------------------------ changes in

    def job_changed(self, job_id: str) -> None:
        self._pending.job(job_id)
        self._wake.set()

    def jobs_changed(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            self._pending.job(job_id)
        self._wake.set()

    def all_jobs_changed(self) -> None:
        self._pending.all_jobs()
        self._wake.set()

    def peers_changed(self) -> None:
        self._pending.peers()
        self._wake.set()

    def resync(self) -> None:
        self._pending.resync()
        self._wake.set()

    def set_live(self, live: bool) -> bool:
        """Record the live mode; True when it changed (viewers are told)."""
        if live == self.live:
            return False
        self.live = live
        LIVE.set(1 if live else 0)
        self._pending.live(live)
        self._wake.set()
        return True

    # ------------------------------------------------------------ batches out

    def flush(self) -> Batch | None:
        """Hand what was gathered to every viewer now (the loop's step; tests call it)."""
        batch = self._pending.take()
        if batch is not None:
            for viewer in list(self._viewers):
                viewer.offer(batch)
        return batch

    async def run(self, before_flush: Callable[[], Awaitable[None]] | None = None) -> None:
        """Flush whenever something changed, at most once per ``flush_s`` (after awaiting
        ``before_flush``: the service renews a spent NATS subscription there)."""
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if before_flush is not None:
                await before_flush()
            self.flush()
            await asyncio.sleep(self.flush_s)

    # ------------------------------------------------------------ viewers

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def join(self, client: str = "-") -> Viewer | None:
        """A new viewer for ``client``, or None when it may not have one (``refusal`` says
        why): the broker is closed or full, or the client holds its share."""
        client = client_key(client)
        if self.refusal(client) is not None:
            return None
        viewer = Viewer(self.queue_batches, client)
        self._viewers.add(viewer)
        self._per_client[client] = self._per_client.get(client, 0) + 1
        VIEWERS.set(len(self._viewers))
        return viewer

    def refusal(self, client: str = "-") -> Refused | None:
        """Why ``client`` may not open a stream now (None: it may)."""
        if self._closed or len(self._viewers) >= self.max_viewers:
            return Refused.FULL
        if self._per_client.get(client_key(client), 0) >= self.viewers_per_client:
            return Refused.CLIENT_FULL
        return None

    def leave(self, viewer: Viewer) -> None:
        if viewer not in self._viewers:
            return
        self._viewers.discard(viewer)
        left = self._per_client.get(viewer.client, 0) - 1
        if left > 0:
            self._per_client[viewer.client] = left
        else:
            self._per_client.pop(viewer.client, None)
        VIEWERS.set(len(self._viewers))

    def close(self) -> None:
        """End every stream (shutting down)."""
        self._closed = True
        self._wake.set()
        for viewer in list(self._viewers):
            viewer.end()

    async def stream(self, viewer: Viewer, keepalive_s: float) -> AsyncIterator[str]:
        """``viewer``'s server-sent events until it leaves or the broker closes.

        It opens with the current mode; a comment every ``keepalive_s`` of silence keeps
        proxies from closing it and finds browsers that left.
        """
        try:
            yield f"retry: {RETRY_MS}\n\n" + sse_event("mode", {"live": self.live})
            while True:
                try:
                    batch = await asyncio.wait_for(viewer.queue.get(), keepalive_s)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if batch is None:
                    return
                yield sse_lines(batch)
        finally:
            self.leave(viewer)


class ChangeTail:
    """Which changelog rows are new since the last look (the polling fallback).

    Positions are handed out when a row is written but become visible when its
    transaction commits, so a later look may find a lower position than one seen
    before: every look re-reads the last ``overlap`` positions and keeps only rows not
    yet seen. Everything at or below ``floor`` counts as seen (at first: the rows that
    were there before the dashboard started).
    """

    def __init__(self, top: int, overlap: int = 500) -> None:
        self.floor = top
        self.top = top
        self.overlap = overlap
        self._seen: set[int] = set()

    def since(self) -> int:
        """Read rows after this position."""
        return self.floor

    def new(self, rows: Iterable[tuple[int, str]]) -> list[str]:
        """The job ids of the (seq, job_id) ``rows`` not seen before (in order, each once)."""
        fresh: dict[str, None] = {}
        for seq, job_id in rows:
            if seq <= self.floor or seq in self._seen:
                continue
            self._seen.add(seq)
            fresh[job_id] = None
            self.top = max(self.top, seq)
        self.floor = max(self.floor, self.top - self.overlap)
        self._seen = {seq for seq in self._seen if seq > self.floor}
        return list(fresh)
