"""The ``web`` section: what the dashboard (``irisfed web``) costs.

- *Jobs page on a big table.* ``jobs`` is filled by COPY with N rows (quick 100k,
  full 1M) of mixed states, owners, names and labels over 30 days; then, in the
  same run, the bare keyset SELECT of a page (asyncpg) and ``GET /jobs`` of a
  running ``irisfed web`` (its ``Server-Timing`` header: the app's own time), each
  for the first page, a page 90% deep through the cursor, a state filter and a
  label filter. Target: the page's server time ≤ 3× the bare SELECT of the same page.
- *Live viewers against dispatch.* Submit → running at 500/s (``DispatchProbe``,
  as in ``dispatch``) without the dashboard, and with ``irisfed web`` running and
  100 server-sent-event clients on ``/events`` (raw sockets in a process of their
  own, ``irisfed.bench.viewers``, every event counted). Target: the p50 with viewers ≤ 1.10× the p50 without.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache

import asyncpg
import httpx

from irisfed.bench.deployment import Deployment, bench_env
from irisfed.bench.load import Run, median
from irisfed.bench.report import Bench, Figure
from irisfed.bench.sections import DISPATCH_PEERS, Dispatched, DispatchProbe, dispatch_deployment
from irisfed.bench.viewers import ViewerProcess
from irisfed.services.common.bus import connect_client
from irisfed.services.web.filters import JobFilter
from irisfed.services.web.reads import job_page
from irisfed.shared.lifecycle import JobState
from irisfed.tooling.servers import free_port

# ---------------------------------------------------------------- the rows (pure)

PAGE = 50  # rows per page: the dashboard's default page_size
SPAN_S = 30 * 86400  # the table's jobs were submitted over 30 days
SAME_INSTANT = 4  # jobs submitted together share submitted_at (the cursor's job_id tiebreak matters)
TEAMS = ("vision", "speech", "nlp", "rl", "infra", "genomics", "climate", "robotics")
PROJECTS = tuple(f"p{n:02d}" for n in range(40))
STEPS = ("train", "eval", "sweep", "preprocess", "export", "finetune", "ablation", "bench")
ENVS = ("prod", "dev", "staging")
PEERS = ("home", "gpu0", "gpu1", "gpu2", "gpu3", "tpu0")
KINDS = {"home": "cpu", "tpu0": "tpu"}  # the rest: gpu
# Terminal states of older jobs, per 100 (by a hash of the row number).
TERMINAL_MIX = ((JobState.SUCCEEDED, 85), (JobState.FAILED, 9), (JobState.KILLED, 4),
                (JobState.REJECTED, 1), (JobState.UNSCHEDULABLE, 1))
# The newest jobs are still live, per 10.
LIVE_MIX = ((JobState.RUNNING, 5), (JobState.QUEUED, 4), (JobState.ASSIGNED, 1))
LABEL_FILTER = ("team", TEAMS[1])  # one job in eight
STATE_FILTER = JobState.FAILED  # one job in eleven

COPY_COLUMNS = ("job_id", "spec", "spec_hash", "state", "disposition", "owner_peer_id", "backend", "epoch",
                "attempts", "max_retries", "priority", "submitted_at", "updated_at", "assigned_at", "started_at",
                "finished_at", "exit_code", "log_dir", "reason", "explanation", "submit_reply", "resources")


def _pick(mix: tuple[tuple[JobState, int], ...], n: int) -> JobState:
    for state, share in mix:
        if n < share:
            return state
        n -= share
    raise ValueError(n)


def live_window(total: int) -> int:
    """How many of the newest jobs are still queued, assigned or running."""
    return max(100, total // 500)


def row_state(i: int, total: int) -> JobState:
    """Job ``i`` (0 the oldest) of ``total``: live among the newest, else terminal."""
    newest_rank = total - 1 - i
    if newest_rank < live_window(total):
        return _pick(LIVE_MIX, newest_rank % 10)
    return _pick(TERMINAL_MIX, (i * 2654435761 >> 7) % 100)


@lru_cache(maxsize=4096)
def _spec(team: str, project: str, env: str, step: str, peer: str, priority: int) -> tuple[str, str, str]:
    """A spec's JSON, its hash and the job's name (a few thousand distinct, cached)."""
    name = f"{project}-{step}-{team}"
    kind = KINDS.get(peer, "gpu")
    spec = json.dumps({
        "command": ["python", "-m", f"{team}.{step}", "--project", project, "--epochs", "20"],
        "name": name, "labels": {"team": team, "project": project, "env": env}, "priority": priority,
        "constraints": [{"key": "device_type", "op": "eq", "value": kind}]}, separators=(",", ":"))
    return spec, hashlib.sha256(spec.encode()).hexdigest(), name


def web_job(i: int, total: int, newest: datetime) -> tuple:
    """Row ``i`` of ``total`` (0 the oldest, ``total - 1`` submitted at ``newest``), as
    COPY_COLUMNS: mixed states, owners, names and labels."""
    state = row_state(i, total)
    step_of = SPAN_S / max(1, total) * SAME_INSTANT
    submitted = newest - timedelta(seconds=((total - 1 - i) // SAME_INSTANT) * step_of)
    team, project, env = TEAMS[i % 8], PROJECTS[(i // 8) % len(PROJECTS)], ENVS[i % 3]
    peer = PEERS[(i // 3) % len(PEERS)]
    priority = (i // 5) % 3
    spec, spec_hash, _ = _spec(team, project, env, STEPS[(i // 40) % len(STEPS)], peer, priority)
    job_id = f"{team[:3]}-{i:07d}-{(i * 2654435761) % 4294967296:08x}"
    placed = state not in (JobState.QUEUED, JobState.REJECTED, JobState.UNSCHEDULABLE)
    started = state in (JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.KILLED)
    ended = state.is_terminal
    runtime = timedelta(seconds=60 + i % 3600)
    finished = submitted + runtime if ended else None
    exit_code = {JobState.SUCCEEDED: 0, JobState.FAILED: 1 + i % 3, JobState.KILLED: 137}.get(state)
    reason = {JobState.REJECTED: "no peer matches device_type=" + KINDS.get(peer, "gpu"),
              JobState.UNSCHEDULABLE: "deadline passed while queued", JobState.QUEUED: "waiting for a free slot",
              JobState.FAILED: f"exit code {exit_code}"}.get(state, "")
    submit_reply = (f'{{"job_id":"{job_id}","disposition":"queue","state":"queued","peer_id":"",'
                    f'"duplicate":false,"reason":"queued","verdicts":[]}}')
    return (job_id, spec, spec_hash, state.value, "reject" if state == JobState.REJECTED else "queue",
            peer if placed else None, "simulated" if placed else None, 1 if placed else 0, 1 if started else 0,
            2, priority, submitted, finished or submitted + timedelta(seconds=1),
            submitted + timedelta(milliseconds=20) if placed else None,
            submitted + timedelta(milliseconds=40) if started else None, finished, exit_code,
            f"/var/lib/irisfed/work/{peer}/{job_id}" if started else None, reason,
            '{"by":"tick","rule":"placed","peers":[]}', submit_reply, '{"cpu":1}')


def web_jobs(total: int, newest: datetime) -> Iterator[tuple]:
    return (web_job(i, total, newest) for i in range(total))


# ---------------------------------------------------------------- what is read back (pure)

_SERVER_TIMING = re.compile(r"(?:^|,)\s*app\s*;(?:[^,]*;)?\s*dur=([0-9.]+)")


def server_time_ms(header: str | None) -> float | None:
    """The ``app`` entry's ``dur`` of a ``Server-Timing`` header (ms), None when absent."""
    if not header:
        return None
    found = _SERVER_TIMING.search(header)
    return float(found.group(1)) if found else None


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p99(values: list[float]) -> float:
    return Run(len(values), 1, values).pct(0.99)


# ---------------------------------------------------------------- the jobs page

BARE_COLUMNS = ("j.job_id, coalesce(j.spec->>'name', '') AS name, j.state, j.owner_peer_id, j.submitted_at, "
                "j.updated_at, j.exit_code, j.spec->'command' AS command, j.spec->'labels' AS labels")


@dataclass
class PageCase:
    """One way into the job list: the bare SELECT (and its arguments) and the dashboard's filter.
    ``via_listing``: the way in walks ``job_listing`` (l) and joins ``jobs`` (j) by key, as the
    store's read does (migration 0011); otherwise it reads ``jobs`` (j) alone."""

    name: str  # in the figure's name
    bare_where: str
    bare_args: tuple
    jobs: JobFilter
    via_listing: bool = True

    @property
    def bare_sql(self) -> str:
        where = f"WHERE {self.bare_where} " if self.bare_where else ""
        source, key = ("job_listing l JOIN jobs j ON j.job_id = l.job_id", "l") if self.via_listing else ("jobs j", "j")
        return (f"SELECT {BARE_COLUMNS} FROM {source} {where}"
                f"ORDER BY {key}.submitted_at DESC, {key}.job_id DESC LIMIT {PAGE}")


async def fill_jobs(database_url: str, total: int) -> float:
    """COPY ``total`` rows into ``jobs`` (its secondary indexes dropped first and built
    again after, as a bulk load does), then VACUUM ANALYZE and CHECKPOINT; seconds taken.
    A plain connection: the store's pool decodes jsonb as text, which COPY cannot send."""
    started = time.perf_counter()
    conn = await asyncpg.connect(database_url)
    try:
        indexes = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename IN ('jobs', 'job_listing') "
            "AND indexname NOT IN (SELECT conname FROM pg_constraint "
            "WHERE conrelid IN ('jobs'::regclass, 'job_listing'::regclass))")
        for row in indexes:
            await conn.execute(f'DROP INDEX "{row["indexname"]}"')
        # Only the columns this schema has (a later migration may move one, e.g. the
        # explanation into its own table; the list page reads neither).
        present = {r["column_name"] for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'jobs'")}
        keep = [i for i, name in enumerate(COPY_COLUMNS) if name in present]
        records = (tuple(row[i] for i in keep) for row in web_jobs(total, datetime.now(UTC)))
        await conn.copy_records_to_table("jobs", records=records, columns=[COPY_COLUMNS[i] for i in keep])
        # Each job's listing row, as the router's insert writes it (migration 0011).
        await conn.execute(
            "INSERT INTO job_listing (job_id, submitted_at, labels, search_text) "
            "SELECT job_id, submitted_at, coalesce(spec->'labels', '{}'::jsonb), "
            "job_id || ' ' || coalesce(spec->>'name', '') FROM jobs")
        await conn.execute("SET maintenance_work_mem = '256MB'")
        for row in indexes:
            await conn.execute(row["indexdef"])
        # A table that has been around: hint bits and the visibility map set, statistics
        # fresh, and the load's dirty pages written now rather than during a figure.
        await conn.execute("VACUUM (ANALYZE) jobs")
        await conn.execute("VACUUM (ANALYZE) job_listing")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def page_cases(pool: asyncpg.Pool, total: int) -> list[PageCase]:
    deep_at, deep_id = await pool.fetchrow(
        "SELECT submitted_at, job_id FROM job_listing ORDER BY submitted_at DESC, job_id DESC OFFSET $1 LIMIT 1",
        total * 9 // 10)
    label = dict([LABEL_FILTER])  # the pool's codec encodes jsonb (a JSON string here would match nothing)
    return [
        PageCase("first page", "", (), JobFilter()),
        PageCase("page 90% deep (cursor)", "(l.submitted_at, l.job_id) < ($1, $2)", (deep_at, deep_id),
                 JobFilter(after=(deep_at, deep_id))),
        PageCase(f"state={STATE_FILTER.value}", "j.state = $1", (STATE_FILTER.value,), JobFilter(state=STATE_FILTER.value),
                 via_listing=False),
        PageCase(f"label {LABEL_FILTER[0]}={LABEL_FILTER[1]}", "l.labels @> $1::jsonb", (label,),
                 JobFilter(labels=(LABEL_FILTER,))),
    ]


@dataclass
class PageTimes:
    """One way into the job list, measured: milliseconds of each call, by who measured it."""

    bare_ms: list[float] = field(default_factory=list)  # the bare SELECT (asyncpg, this process)
    store_ms: list[float] = field(default_factory=list)  # the dashboard's read (job_page, this process)
    server_ms: list[float] = field(default_factory=list)  # GET /jobs: the app's Server-Timing
    client_ms: list[float] = field(default_factory=list)  # GET /jobs: the whole HTTP round trip
    rows: set[int] = field(default_factory=set)  # rows on the pages served
    bare_rows: set[int] = field(default_factory=set)  # rows the bare SELECT returned
    errors: int = 0


async def measure_case(case: PageCase, dep: Deployment, client: httpx.AsyncClient, url: str, times: PageTimes,
                       count: int, measured: bool = True) -> None:
    """``count`` times: the bare SELECT, the dashboard's read, then ``GET url``, one after
    the other, so a burst of load elsewhere on the machine falls on all three alike."""
    for _ in range(count):
        started = time.perf_counter()
        bare = await dep.pool.fetch(case.bare_sql, *case.bare_args)
        bare_done = time.perf_counter()
        await job_page(dep.store, case.jobs, PAGE)
        store_done = time.perf_counter()
        response = await client.get(url)
        done = time.perf_counter()
        server = server_time_ms(response.headers.get("server-timing"))
        if response.status_code != 200 or server is None or len(bare) != PAGE:
            times.errors += 1  # a bare SELECT short of a page would be no baseline
        elif measured:
            times.bare_ms.append((bare_done - started) * 1e3)
            times.store_ms.append((store_done - bare_done) * 1e3)
            times.server_ms.append(server)
            times.client_ms.append((done - store_done) * 1e3)
            times.rows.add(response.text.count('data-testid="job-row"'))
            times.bare_rows.add(len(bare))


async def wait_web(client: httpx.AsyncClient, base: str, patience_s: float = 60) -> dict:
    """The dashboard's /healthz once it answers and hears NATS (it connects in the
    background; until then its pages poll Postgres)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            response = await client.get(base + "/healthz")
            if response.status_code == 200 and response.json().get("live") is True:
                return response.json()
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"irisfed web did not answer, hearing NATS, at {base} within {patience_s:.0f} s")
        await asyncio.sleep(0.1)


def start_web(dep: Deployment) -> str:
    """``irisfed web`` for ``dep`` on a free port; its base URL."""
    port = free_port()
    dep.start("web", "--port", str(port))
    return f"http://127.0.0.1:{port}"


async def jobs_page_bench(bench: Bench, admin_url: str, nats_url: str, calls: int = 200, rounds: int = 4,
                         warm: int = 10) -> None:
    total = bench.profile.n(100_000, 1_000_000)
    dep = Deployment(bench, admin_url, nats_url, "webjobs", [("home", {"device_type": "cpu"}, 10)])
    await dep.create()
    try:
        fill_s = await fill_jobs(dep.database_url, total)
        print(f"  filled {total:,} jobs in {fill_s:.0f} s (COPY, indexes built after, VACUUM ANALYZE)", flush=True)
        cases = await page_cases(dep.pool, total)
        base = start_web(dep)
        times = {case.name: PageTimes() for case in cases}
        async with httpx.AsyncClient(timeout=30) as client:
            await wait_web(client, base)
            urls = {case.name: base + "/jobs" + case.jobs.query_string(case.jobs.after) for case in cases}
            for case in cases:  # warm-up: connections, prepared statements, templates
                await measure_case(case, dep, client, urls[case.name], times[case.name], warm, measured=False)
            for _ in range(rounds):  # the cases take turns, so each sees the machine's busy and quiet spells
                for case in cases:
                    await measure_case(case, dep, client, urls[case.name], times[case.name], calls // rounds)
    finally:
        await dep.close()
    for case in cases:
        got = times[case.name]
        if case.name == "first page" or case.name.startswith("page "):
            bench.add(Figure("web", f"bare keyset SELECT p50, {case.name}, {total:,} rows", p50(got.bare_ms), "ms",
                             runs=f"{len(got.bare_ms)} calls", note=f"p99 {p99(got.bare_ms):.2f} ms; asyncpg, "
                                                                    f"{PAGE} rows, the page's columns"))
        ratio = p50(got.server_ms) / p50(got.bare_ms)
        bench.add(Figure(
            "web", f"/jobs server time p50, {case.name}, {total:,} rows", p50(got.server_ms), "ms",
            f"bare keyset SELECT, {case.name}", ratio, "≤ 3× bare keyset", ratio <= 3 and not got.errors,
            f"{len(got.server_ms)} requests",
            f"Server-Timing p99 {p99(got.server_ms):.2f} ms; bare SELECT p50 {p50(got.bare_ms):.2f} ms; the "
            f"dashboard's read (job_page, this process) p50 {p50(got.store_ms):.2f} ms; whole HTTP round trip "
            f"(httpx) p50 {p50(got.client_ms):.2f} ms; rows per page {sorted(got.rows)} (bare SELECT "
            f"{sorted(got.bare_rows)}); errors {got.errors}"))


# ---------------------------------------------------------------- live viewers against dispatch


async def viewers_bench(bench: Bench, admin_url: str, nats_url: str, rate: int = 500, viewers: int = 100) -> None:
    pairs = bench.profile.n(3, 5)  # odd: the medians are real runs; pairs alternate which arm goes first
    seconds = bench.profile.s(3, 10)
    dep = await dispatch_deployment(bench, admin_url, nats_url, "webdispatch")
    nc = await connect_client(nats_url)
    without: list[Dispatched] = []
    watched: list[Dispatched] = []
    received: list[str] = []
    try:
        probe = DispatchProbe(dep, nc, rate)
        await probe.open(len(DISPATCH_PEERS))
        async with httpx.AsyncClient(timeout=10) as client:
            for pair in range(pairs):
                for with_web in ((False, True) if pair % 2 == 0 else (True, False)):
                    if not with_web:
                        without.append(await probe.measure(seconds, f"n{pair}"))
                        continue
                    base = start_web(dep)
                    try:
                        await wait_web(client, base)
                        streams = await ViewerProcess.start(base, viewers, bench_env())
                        try:
                            before, _ = await streams.snapshot()
                            watched.append(await probe.measure(seconds, f"v{pair}"))
                            after, ended = await streams.snapshot()
                        finally:
                            await streams.close()
                    finally:
                        dep.services.supervisor.stop("web")
                    got = [sum(a.values()) - sum(b.values()) for a, b in zip(after, before, strict=True)]
                    jobs = [a.get("jobs", 0) - b.get("jobs", 0) for a, b in zip(after, before, strict=True)]
                    still_open = ended.count(False)
                    receiving = sum(1 for n in jobs if n > 0)
                    received.append(f"{receiving}/{viewers} clients got jobs events, {min(got)}–{max(got)} events "
                                    f"each ({sum(got):,} in all), {still_open} streams still open")
                    if receiving < viewers:
                        print(f"  only {receiving}/{viewers} live clients received jobs events", flush=True)
    finally:
        await nc.close()
        await dep.close()

    def ms(arms: list[Dispatched], q: float) -> list[float]:
        return [a.run.pct(q) * 1e3 for a in arms]

    value, base_value = median(ms(watched, 0.5)), median(ms(without, 0.5))
    ratio = value / base_value
    ratios = [w / n for w, n in zip(ms(watched, 0.5), ms(without, 0.5), strict=True)]
    runs = (f"{pairs} pair" if pairs == 1 else
            f"{pairs} pairs (medians), ratios {min(ratios):.2f}–{max(ratios):.2f}") + ", alternating"

    def listed(values: list[float]) -> str:
        return ", ".join(f"{v:.1f}" for v in values)

    bench.add(Figure("web", f"submit → running p50 at {rate}/s, {viewers} live dashboard clients", value, "ms",
                     f"same without dashboard (p50 {base_value:.1f} ms)", ratio, "≤ 1.10×", ratio <= 1.10, runs,
                     f"with: p50 {listed(ms(watched, 0.5))} ms, p99 {listed(ms(watched, 0.99))} ms; without: p50 "
                     f"{listed(ms(without, 0.5))} ms, p99 {listed(ms(without, 0.99))} ms; {'; '.join(received)}; "
                     f"last with: {watched[-1].note()}; last without: {without[-1].note()}"))
    web_cpu = [a.cpu.get("web", 0.0) * 100 for a in watched]
    others = median([sum(v for k, v in a.cpu.items() if k != "web") * 100 for a in watched])
    others_without = median([sum(a.cpu.values()) * 100 for a in without])
    bench.add(Figure("web", f"irisfed web CPU, {viewers} live clients, {rate} submits/s", median(web_cpu), "% core",
                     runs=f"{len(web_cpu)} run{'s' if len(web_cpu) > 1 else ''}" + (
                         f", {min(web_cpu):.0f}–{max(web_cpu):.0f}" if len(web_cpu) > 1 else ""),
                     note=f"router, tick and agents together: {others:.0f}% of a core with the dashboard, "
                          f"{others_without:.0f}% without"))


async def web_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await jobs_page_bench(bench, admin_url, nats_url)
    await viewers_bench(bench, admin_url, nats_url)
