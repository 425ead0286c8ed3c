"""The ``preemption`` section: what a job of a higher band pays when it has to stop
lower-band work to get in (docs/design.md §3.3), each figure a ratio within this run.

- *preempting dispatch*: submit → running of an ``interactive`` job on a federation
  whose gpu slots all run ``batch`` sleeps (subprocess backends: real processes, so the
  victim's kill is a real one, and quick), one job at a time, each needing a victim;
  against the same job on the same federation idle, measured before the fill and
  after it is cancelled (so drift falls on both sides).
- *preempting tick pass*: one ``Tick.run_once(full=False)`` over a queue of
  ``interactive`` jobs on peers full of running ``batch`` jobs (each queued job
  preempts one); against the same pass over the same queue and running set, the
  running jobs ``interactive`` too, so nothing is preemptible and the pass only
  explains why each job waits. Every pass on a fresh database, the two sides
  alternating.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import asyncpg
import msgspec

from irisfed.bench.deployment import Deployment, PeerSpec, is_ack
from irisfed.bench.load import Run
from irisfed.bench.report import Bench, Figure, paired_figure
from irisfed.bench.sections import KINDS, DispatchProbe, _bench_job
from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.shared.bands import BATCH, INTERACTIVE, MAX_PREEMPTIONS_LIMIT, band_rank
from irisfed.shared.lifecycle import JobState
from irisfed.shared.postgres import with_database

if TYPE_CHECKING:
    from irisfed.services.tick.service import TickResult

# The targets (the bands issue): the preempting job's p50 at most this many times the
# same job's on an idle federation; the preempting pass at most this many times the
# pass that preempts nothing.
DISPATCH_TARGET = 3.0
TICK_TARGET = 2.0

# The dispatch figure's federation: the local cluster (cpu, unused here) and two gpu
# peers of PREEMPT_SLOTS slots each, all with subprocess backends.
PREEMPT_SLOTS = 4
PREEMPT_PEERS: list[PeerSpec] = [("home", {"device_type": "cpu"}, 2)] + [
    (f"gpu{i}", {"device_type": "gpu"}, PREEMPT_SLOTS) for i in range(2)]
FILL_SLEEP_S = 300  # the batch jobs outlast the figure; the agents kill them when they stop
SETTLE_TIMEOUT_S = 30.0  # for the federation to be full (or empty) again between samples

# Where a preempting job's history says so (job_assign_batch's detail; shared/sql/jobs.sql).
PREEMPTED_DETAIL = "placed; preempted "


def batch_body(prefix: str, sleep_s: int = FILL_SLEEP_S):
    """Job ``i``'s submit: a gpu ``sleep``, id ``<prefix>-<i>``, band ``batch``, never
    failed for being preempted too often (each sample preempts the newest batch run,
    often the same job)."""
    def body(i: int) -> bytes:
        return msgspec.json.encode({"command": ["sleep", str(sleep_s)], "job_id": f"{prefix}-{i}", "band": BATCH,
                                    "max_preemptions": MAX_PREEMPTIONS_LIMIT,
                                    "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]})
    return body


DISPATCH_NAME = "interactive job preempting a batch job: submit → running p50"


def dispatch_figure(preempting: Run, idle: Run, sent: int, hops: list[str], idle_hops: list[str],
                    slots: int = 2 * PREEMPT_SLOTS) -> Figure:
    """The preempting dispatch row: ``preempting``'s p50 (the samples whose placement
    did preempt, of ``sent`` submitted) against ``idle``'s (the same job on the idle
    federation), judged against DISPATCH_TARGET. Not judged unless at least half the
    jobs sent preempted and there are idle samples: a p50 of a few leftovers is no
    figure (the usual cause: batch jobs stored without their band)."""
    setup = (f"an interactive `true` on {slots} gpu slots all running batch sleeps (subprocess backends), "
             "one job at a time, each preempting one")
    judged = bool(idle.latencies) and preempting.done > 0 and 2 * preempting.done >= sent
    if not judged:
        why = f"{preempting.done}/{sent} jobs preempted" if idle.latencies else "no idle sample"
        return Figure("preemption", DISPATCH_NAME, preempting.pct(0.5) * 1e3, "ms", "same job, idle federation",
                      None, f"≤ {DISPATCH_TARGET:g}× idle", None, f"{preempting.done} + {idle.done} samples",
                      f"not judged: {why}; {setup}")
    p50, base = preempting.pct(0.5), idle.pct(0.5)
    ratio = p50 / base
    note = (f"{setup}; {preempting.done}/{sent} preempted (only those counted); p90 {preempting.pct(0.9) * 1e3:.1f} "
            f"ms against idle {idle.pct(0.9) * 1e3:.1f} ms ({idle.done} idle samples, half before the fill and half "
            f"after it is cancelled); hop p50 ms: {' '.join(hops) or 'none seen'}; idle (before the fill): "
            f"{' '.join(idle_hops) or 'none seen'}")
    return Figure("preemption", DISPATCH_NAME, p50 * 1e3, "ms", f"same job, idle federation (p50 {base * 1e3:.1f} ms)",
                  ratio, f"≤ {DISPATCH_TARGET:g}× idle", ratio <= DISPATCH_TARGET,
                  f"{preempting.done} + {idle.done} samples", note)


def tick_figure(preempting: list[float], plain: list[float], running: int, peers: int, queued: int,
                preempted: list[int], waited: list[int]) -> Figure:
    """The preempting tick pass row: the median of ``preempting`` pass times (s) against
    the median of ``plain`` ones (the same queue, nothing preemptible), judged against
    TICK_TARGET. Judged only when every preempting pass preempted (and placed) the
    whole queue, one victim each, and every plain pass left it all waiting: else the
    passes did not do what the figure says (``preempted``, ``waited``: per pass)."""
    as_said = all(n == queued for n in preempted) and all(n == queued for n in waited)
    note = (f"{queued:,} interactive jobs queued, {running:,} batch jobs running ({running // peers} a peer, every "
            f"slot), one Tick.run_once(full=False) on a fresh database each; preempted "
            f"{_span(preempted)}/{queued:,}; the plain pass (the running jobs interactive) left "
            f"{_span(waited)}/{queued:,} waiting, explained")
    name = f"tick pass preempting for {queued:,} queued, {running:,} running × {peers} peers"
    return paired_figure("preemption", name, preempting, plain, "same pass, nothing preemptible", TICK_TARGET,
                         f"≤ {TICK_TARGET:g}× not preempting", as_said,
                         "the passes did not preempt (or leave waiting) the whole queue", note)


def _span(values: list[int]) -> str:
    low, high = min(values, default=0), max(values, default=0)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


async def preemption_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await preempting_dispatch(bench, admin_url, nats_url)
    await preempting_tick(bench, admin_url, nats_url)


# ---------------------------------------------------------------- preempting dispatch


async def _settled(dep: Deployment, running: int, band: int | None = None,
                   timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until exactly ``running`` jobs of ``band`` (None: any) run and nothing else
    is live or queued: every slot full of that work (or, with 0, the federation idle)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        row = await dep.pool.fetchrow(
            "SELECT count(*) FILTER (WHERE band = coalesce($1, band) AND state = 'running') AS wanted, "
            "count(*) FILTER (WHERE band <> coalesce($1, band) OR state <> 'running') AS other "
            "FROM jobs WHERE state IN ('queued', 'assigned', 'running')", band)
        if row["wanted"] == running and row["other"] == 0:
            return
        if time.perf_counter() > deadline:
            raise RuntimeError(f"preemption bench: waited {timeout_s:g} s for {running} jobs running and nothing "
                               f"else live; {row['wanted']} running, {row['other']} other")
        await asyncio.sleep(0.01)


async def _preempting(dep: Deployment, job_ids: list[str]) -> set[str]:
    """Those of ``job_ids`` whose placement preempted (their history says whom)."""
    rows = await dep.pool.fetch(
        "SELECT job_id FROM federation_changelog WHERE job_id = ANY($1::text[]) AND to_state = 'assigned' "
        "AND starts_with(detail, $2)", job_ids, PREEMPTED_DETAIL)
    return {r["job_id"] for r in rows}


async def preempting_dispatch(bench: Bench, admin_url: str, nats_url: str) -> None:
    dep = Deployment(bench, admin_url, nats_url, "preemptdispatch", PREEMPT_PEERS, interval=0.5, ttl=3.0,
                     backend="subprocess")
    fill = 2 * PREEMPT_SLOTS
    samples = bench.profile.n(10, 40)
    await dep.create()
    nc = None
    try:
        dep.start("router")
        dep.start("tick")
        for peer_id, _, _ in PREEMPT_PEERS:
            dep.start(peer_id)
        nc = await connect_client(nats_url)
        probe = DispatchProbe(dep, nc, 0)
        await probe.open(len(PREEMPT_PEERS))
        await probe.one_at_a_time(2, "pw")  # not measured: connections, statements, first launches
        idle_before, idle_hops = await probe.one_at_a_time(samples // 2, "pi")
        for i in range(fill):
            reply = await nc.request(f"{dep.prefix}.submit", batch_body("fill")(i), timeout=10)
            if not is_ack(reply.data):
                raise RuntimeError(f"preemption bench: a batch submit was refused: {reply.data[:200]!r}")
        await _settled(dep, fill)
        bands = await dep.pool.fetchval("SELECT array_agg(DISTINCT band) FROM jobs WHERE job_id LIKE 'fill-%'")
        sent: dict[str, float] = {}
        latencies: list[float] = []
        hops: list[str] = []
        if bands != [band_rank(BATCH)]:  # a router that ignores the band: nothing to preempt, nothing to wait for
            print(f"  the router stored the batch jobs with bands {bands}, not {band_rank(BATCH)}: "
                  "nothing can be preempted", flush=True)
        else:
            async def full() -> None:
                await _settled(dep, fill, band_rank(BATCH))

            await probe.one_at_a_time(1, "pwp", ready=full)  # not measured: the first preemption's statements
            _, hops = await probe.one_at_a_time(samples, "pp", ready=full)
            sent = dict(probe.sent)
            running = dict(probe.seen[JobState.RUNNING])
            did = await _preempting(dep, list(sent))
            latencies = [running[j] - sent[j] for j in sent if j in running and j in did]
        preempting = Run(len(latencies), 0.0, latencies)
        # The federation idle again (the batch jobs cancelled), and the rest of the idle samples.
        for i in range(fill):
            await nc.request(f"{dep.prefix}.cancel", msgspec.json.encode({"job_id": f"fill-{i}"}), timeout=10)
        await _settled(dep, 0)
        idle_after, _ = await probe.one_at_a_time(samples - samples // 2, "pa")
        idle = Run(idle_before.done + idle_after.done, 0.0, idle_before.latencies + idle_after.latencies,
                   errors=idle_before.errors + idle_after.errors)
        bench.add(dispatch_figure(preempting, idle, len(sent), hops, idle_hops, fill))
    finally:
        if nc is not None:
            await nc.close()
        await dep.close()  # the agents kill the batch sleeps still running as they stop


# ---------------------------------------------------------------- preempting tick pass


def _database_url(admin_url: str, name: str) -> str:
    return with_database(admin_url, name)


async def _copy_database(admin_url: str, template: str, name: str) -> None:
    """``name``, a fresh copy of ``template`` (no one may be connected to it)."""
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await conn.close()


async def _drop_database(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


class TickPasses:
    """Fresh databases for single tick passes over one federation: ``peer_count``
    peers of ``running // peer_count`` slots (mixed kinds, as in the tick section),
    every slot taken by a running job, and ``queued`` interactive jobs of the same
    kinds queued. :meth:`prepare` builds one template per band of the running jobs
    (migrated, peers advertised, rows inserted, ANALYZE, CHECKPOINT: all not
    measured); :meth:`run` copies one and times one pass on the copy, so every pass
    starts from the same pages."""

    def __init__(self, bench: Bench, admin_url: str, nats_url: str, running: int, peer_count: int,
                 queued: int) -> None:
        self.admin_url = admin_url
        self.running, self.peer_count, self.queued = running, peer_count, queued
        self.per_peer = running // peer_count
        self.peers = [(f"p{i}", {"device_type": KINDS[i % 3], "zone": f"z{i % 4}"}, self.per_peer)
                      for i in range(peer_count)]
        self.base = Deployment(bench, admin_url, nats_url, "preempttick", self.peers)
        self.templates: dict[str, str] = {}  # band of the running jobs → its template database

    async def prepare(self, bands: tuple[str, ...]) -> None:
        base = self.base
        await base.create()
        await base.advertise(self.peers)
        await base.pool.close()
        template = f"bench_{base.name}"
        live = [msgspec.structs.replace(_bench_job(i, JobState.RUNNING, kind=KINDS[i % self.peer_count % 3]),
                                        owner_peer_id=f"p{i % self.peer_count}", backend="simulated", epoch=1)
                for i in range(self.per_peer * self.peer_count)]
        waiting = [msgspec.structs.replace(_bench_job(i), band=band_rank(INTERACTIVE)) for i in range(self.queued)]
        for band in bands:
            name = self.templates[band] = f"{template}_{band}"
            await _copy_database(self.admin_url, template, name)
            pool = await dbmod.connect(_database_url(self.admin_url, name), max_size=2)
            try:
                store = Store(pool)
                rows = [msgspec.structs.replace(j, band=band_rank(band)) for j in live] + waiting
                for first in range(0, len(rows), 5000):
                    await store.job_insert_batch(rows[first:first + 5000])
                await pool.execute("ANALYZE jobs")
                await pool.execute("CHECKPOINT")
            finally:
                await pool.close()

    async def run(self, band: str) -> tuple[float, TickResult]:
        """One ``Tick.run_once(full=False)`` on a fresh copy of ``band``'s template: its
        seconds and its TickResult."""
        from irisfed.services.tick.service import Tick

        name = f"{self.templates[band]}_pass"
        await _copy_database(self.admin_url, self.templates[band], name)
        try:
            pool = await dbmod.connect(_database_url(self.admin_url, name), max_size=4)  # as a Deployment's
            try:
                tick = Tick(self.base.config, pool, None)
                await tick.refresh_view()
                started = time.perf_counter()
                result = await tick.run_once(full=False)
                return time.perf_counter() - started, result
            finally:
                await pool.close()
        finally:
            await _drop_database(self.admin_url, name)

    async def close(self) -> None:
        for name in self.templates.values():
            await _drop_database(self.admin_url, name)
        await self.base.close()


async def preempting_tick(bench: Bench, admin_url: str, nats_url: str) -> None:
    running, peers, queued = 10_000, 100, bench.profile.n(200, 1000)
    pairs = bench.profile.n(3, 5)
    passes = TickPasses(bench, admin_url, nats_url, running, peers, queued)
    times: dict[str, list[float]] = {BATCH: [], INTERACTIVE: []}
    preempted: list[int] = []
    waited: list[int] = []
    try:
        await passes.prepare((BATCH, INTERACTIVE))
        for i in range(pairs):  # which side goes first alternates
            for victims in (BATCH, INTERACTIVE) if i % 2 == 0 else (INTERACTIVE, BATCH):
                seconds, result = await passes.run(victims)
                times[victims].append(seconds)
                if victims == BATCH:
                    preempted.append(min(len(result.preempted), len(result.assigned)))
                else:
                    waited.append(result.waiting if not result.assigned else 0)
    finally:
        await passes.close()
    bench.add(tick_figure(times[BATCH], times[INTERACTIVE], running, peers, queued, preempted, waited))
