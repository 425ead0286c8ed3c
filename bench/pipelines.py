"""The ``pipelines`` section: what job dependencies cost (docs/design.md §3.8), each
figure a ratio within this run.

- *a chain*: router, tick and agents (the dispatch deployment, simulated backends);
  100 (quick 10) QUEUE ``true`` jobs, each ``after`` the one before (``ok``),
  all submitted behind a gate (a long run the first waits for, ``any``) which is then
  cancelled. Each link, from the dependency's end to the dependent's ``running``, both
  times from ``federation_changelog`` (``at``: each writing transaction's start);
  against the same run's lone jobs on the same federation, one at a time, submit
  (their ``queued`` row) → ``running`` on the same clock, half before the chain and
  half after it. p50 of each; the link's at most 1.5× the lone job's.
- *one job's many dependents*: 10,000 jobs (quick 200) submitted through a router
  ``after`` one running job, then (router stopped) one agent's report of that job's
  end (``job_finish_batch``: the trigger releases them) and one
  ``Tick.run_once(full=False)`` placing them, timed together in the bench process;
  against the same report and pass over as many plain queued jobs, submitted alike.
  Each pass on a fresh copy of its template; pairs alternate; at most 1.5×.
- *waiting jobs*: one ``Tick.run_once(full=False)`` placing WAITING_PLACED queued jobs
  with 100,000 (quick 2,000) more queued behind running jobs (rows written
  directly, each with one ``ok`` edge), nothing released; against the same pass
  without them. Pairs alternate on fresh copies; at most 1.1×.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from itertools import pairwise

import msgspec
import nats

from irisfed.bench.deployment import Deployment, PeerSpec, is_ack
from irisfed.bench.load import Run, closed_loop, median
from irisfed.bench.preemption import _copy_database, _database_url, _drop_database
from irisfed.bench.report import Bench, Figure, paired_figure
from irisfed.bench.sections import (
    DISPATCH_PEERS,
    KINDS,
    DispatchProbe,
    _bench_job,
    dispatch_deployment,
)
from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState

# The targets: a link's p50 at most this many times a lone job's submit → running p50;
# releasing and placing a job's dependents at most this many times placing as many
# plain queued jobs; a pass with jobs waiting at most this many times one without.
CHAIN_TARGET = 1.5
FANOUT_TARGET = 1.5
WAITING_TARGET = 1.1

WAIT_S = 30.0  # for a job to run, or a submit's reply
GATE_SLEEP_S = "600"  # the gate's simulated run outlasts the submits; it is cancelled
WAITING_PLACED = 1000  # the waiting figure's pass places this many plain queued jobs (one claim batch)
WAITING_PEERS = 20
GATES = 20  # the running jobs the waiting rows wait for, one a peer


def _gpu(job: dict) -> dict:
    return {**job, "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}


# ---------------------------------------------------------------- the figures


def _p50(values: Sequence[float]) -> float:
    return Run(len(values), 0.0, list(values)).pct(0.5)


def _times(rows: Iterable[tuple[str, str, datetime]]) -> tuple[dict, dict]:
    """(job → its first terminal ``at``, (job, state) → the first ``at`` it entered
    that state) from changelog rows (job_id, to_state, at) in ``seq`` order."""
    ended: dict[str, datetime] = {}
    entered: dict[tuple[str, str], datetime] = {}
    for job_id, to_state, at in rows:
        entered.setdefault((job_id, to_state), at)
        if to_state in TERMINAL_STATES:
            ended.setdefault(job_id, at)
    return ended, entered


def link_latencies(rows: Iterable[tuple[str, str, datetime]], chain: Sequence[str],
                   state: str = JobState.RUNNING) -> list[float]:
    """Each link of ``chain`` (job k waits for job k-1), in seconds: from the changelog
    row that ended job k-1 to the one that moved job k to ``state``; a link missing
    either row is left out. ``rows``: (job_id, to_state, at), in ``seq`` order."""
    ended, entered = _times(rows)
    return [(entered[(b, state)] - ended[a]).total_seconds()
            for a, b in pairwise(chain) if a in ended and (b, state) in entered]


def submit_latencies(rows: Iterable[tuple[str, str, datetime]], job_ids: Iterable[str]) -> list[float]:
    """Each job's ``queued`` row (the router's insert) to its ``running`` row, in
    seconds, on the changelog's clock; a job missing either is left out."""
    _, entered = _times(rows)
    return [(entered[(j, JobState.RUNNING)] - entered[(j, JobState.QUEUED)]).total_seconds()
            for j in job_ids if (j, JobState.QUEUED) in entered and (j, JobState.RUNNING) in entered]


def chain_figure(links: list[float], lone: list[float], jobs: int, problem: str = "",
                 assigned: list[float] | None = None, lone_bench_p50: float | None = None) -> Figure:
    """The chain row: the links' p50 (s) against the lone jobs' submit → running p50,
    judged against CHAIN_TARGET. Not judged when ``problem`` says what went wrong, or
    fewer than half the chain's links or no lone job were timed. ``assigned``: each
    link to the dependent's ``assigned`` row (where the time goes); ``lone_bench_p50``:
    the lone jobs' p50 on the bench's clock (send → ``running`` event)."""
    name = f"chain of {jobs:,}: dependency's end → dependent running p50"
    runs = f"{len(links)} links + {len(lone)} lone jobs"
    p50, base = _p50(links), _p50(lone)
    note = (f"QUEUE `true` jobs, each after the one before (ok), behind a cancelled gate; times from "
            f"federation_changelog; p90 {Run(0, 0, links).pct(0.9) * 1e3:.1f} ms")
    if assigned:
        note += f"; end → assigned p50 {_p50(assigned) * 1e3:.1f} ms"
    note += f"; lone jobs queued → running p90 {Run(0, 0, lone).pct(0.9) * 1e3:.1f} ms"
    if lone_bench_p50 is not None:
        note += f", on the bench's clock (send → event) p50 {lone_bench_p50 * 1e3:.1f} ms"
    judged = not problem and bool(lone) and 2 * len(links) >= jobs - 1 and len(links) > 0
    if not judged:
        why = problem or f"{len(links)} of {jobs - 1} links and {len(lone)} lone jobs timed"
        return Figure("pipelines", name, p50 * 1e3, "ms", "lone job, submit → running p50", None,
                      f"≤ {CHAIN_TARGET:g}× lone job", None, runs, f"not judged: {why}; {note}")
    ratio = p50 / base
    return Figure("pipelines", name, p50 * 1e3, "ms", f"lone job, submit → running p50 ({base * 1e3:.1f} ms)",
                  ratio, f"≤ {CHAIN_TARGET:g}× lone job", ratio <= CHAIN_TARGET, runs, note)


def fanout_figure(ours: list[float], plain: list[float], jobs: int, released: list[int], placed: list[int],
                  plain_placed: list[int], release_s: list[float]) -> Figure:
    """The many-dependents row: the median of ``ours`` (s: the one job's end reported,
    its ``jobs`` dependents released, and the pass placing them) against the median of
    ``plain`` (the same report and a pass over as many plain queued jobs), judged
    against FANOUT_TARGET. Judged only when every pass released (``released``) and
    placed (``placed``, ``plain_placed``) all ``jobs``."""
    as_said = all(n == jobs for n in released) and all(n == jobs for n in placed + plain_placed)
    note = (f"submitted through a router after one running job; timed in the bench process: the agent's report "
            f"of its end (job_finish_batch, whose trigger releases them: median {median(release_s) * 1e3:,.1f} ms) "
            f"and one Tick.run_once(full=False); released {_span(released)}, placed {_span(placed)}, plain placed "
            f"{_span(plain_placed)} of {jobs:,}")
    return paired_figure("pipelines", f"{jobs:,} jobs after one: its end → all placed", ours, plain,
                         f"{jobs:,} plain queued jobs placed", FANOUT_TARGET, f"≤ {FANOUT_TARGET:g}× plain",
                         as_said, "the passes did not release and place every job", note)


def waiting_figure(ours: list[float], plain: list[float], waiting: int, queued: int, placed: list[int],
                   plain_placed: list[int], still_waiting: list[int]) -> Figure:
    """The waiting-jobs row: the median pass (s) with ``waiting`` jobs waiting on
    dependencies against the same pass without them, judged against WAITING_TARGET.
    Judged only when every pass placed the ``queued`` plain jobs and no more, and every
    waiting job was still waiting after it (``still_waiting``)."""
    as_said = all(n == queued for n in placed + plain_placed) and all(n == waiting for n in still_waiting)
    note = (f"{waiting:,} queued jobs each waiting on one of {GATES} running jobs (rows written directly), "
            f"{queued:,} plain queued jobs × {WAITING_PEERS} peers; one Tick.run_once(full=False) on a fresh "
            f"copy each; placed {_span(placed)} and {_span(plain_placed)} of {queued:,}, still waiting "
            f"{_span(still_waiting)}")
    return paired_figure("pipelines", f"tick pass placing {queued:,} with {waiting:,} waiting on dependencies",
                         ours, plain, "same pass, none waiting", WAITING_TARGET,
                         f"≤ {WAITING_TARGET:g}× none waiting", as_said, "a pass placed other than the plain jobs, or released a waiting one", note)


def _span(values: list[int]) -> str:
    low, high = min(values, default=0), max(values, default=0)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


# ---------------------------------------------------------------- a chain


async def _request(nc: nats.NATS, subject: str, body: dict) -> bytes:
    reply = await nc.request(subject, msgspec.json.encode(body), timeout=WAIT_S)
    return reply.data


async def _state(dep: Deployment, job_id: str, states: Iterable[str], timeout_s: float) -> str | None:
    """Until ``job_id`` is in one of ``states``: its state, or None after ``timeout_s``."""
    wanted = {str(s) for s in states}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await dep.pool.fetchval("SELECT state FROM jobs WHERE job_id = $1", job_id)
        if state in wanted:
            return state
        await asyncio.sleep(0.05)
    return None


async def chain_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    jobs, lone = bench.profile.n(10, 100), bench.profile.n(20, 60)
    dep = await dispatch_deployment(bench, admin_url, nats_url, "pipechain")
    nc = await connect_client(nats_url)
    chain = [f"c-{k}" for k in range(jobs)]
    problem = ""
    try:
        probe = DispatchProbe(dep, nc, 0)
        await probe.open(len(DISPATCH_PEERS))
        await probe.one_at_a_time(2, "cw")  # not measured: connections, statements, first launches
        before, _ = await probe.one_at_a_time(lone // 2, "cl")
        lone_ids = list(probe.sent)
        # The gate: a long run the whole chain is submitted behind, then cancelled.
        gate = "c-gate"
        if not is_ack(await _request(nc, f"{dep.prefix}.submit", _gpu(
                {"command": ["true"], "job_id": gate, "labels": {"sim.duration_s": GATE_SLEEP_S}}))):
            raise RuntimeError("pipelines bench: the gate's submit was refused")
        if await _state(dep, gate, [JobState.RUNNING], WAIT_S) is None:
            raise RuntimeError(f"pipelines bench: the gate did not run within {WAIT_S:g} s")
        for k, job_id in enumerate(chain):
            after = {"job_id": chain[k - 1], "when": "ok"} if k else {"job_id": gate, "when": "any"}
            reply = await _request(nc, f"{dep.prefix}.submit", _gpu({"command": ["true"], "job_id": job_id,
                                                                    "after": [after]}))
            if not is_ack(reply):
                raise RuntimeError(f"pipelines bench: a chain submit was refused: {reply[:200]!r}")
        await _request(nc, f"{dep.prefix}.cancel", {"job_id": gate})
        ended = await _state(dep, chain[-1], TERMINAL_STATES, WAIT_S + 5.0 * jobs)
        states = dict(await dep.pool.fetch("SELECT job_id, state FROM jobs WHERE job_id = ANY($1::text[])", chain))
        fine = sum(1 for j in chain if states.get(j) == JobState.SUCCEEDED)
        if ended is None or fine < jobs:
            problem = f"{fine} of {jobs} chain jobs succeeded, the last {ended or 'not ended in time'}"
        after_chain, _ = await probe.one_at_a_time(lone - lone // 2, "cm")
        lone_ids += list(probe.sent)
        rows = [tuple(r) for r in await dep.pool.fetch(
            "SELECT job_id, to_state, at FROM federation_changelog WHERE job_id = ANY($1::text[]) ORDER BY seq",
            chain + lone_ids)]
    finally:
        await nc.close()
        await dep.close()
    links = link_latencies(rows, chain)
    bench.add(chain_figure(links, submit_latencies(rows, lone_ids), jobs, problem,
                           link_latencies(rows, chain, JobState.ASSIGNED),
                           _p50(before.latencies + after_chain.latencies)))


# ---------------------------------------------------------------- timed passes on copies


async def _on_copy(admin_url: str, config, template: str, before: Callable[[Store], Awaitable[None]] | None,
                   check: Callable[[Store], Awaitable[int]]) -> tuple[float, float, int, int]:
    """On a fresh copy of ``template``: ``before`` (if any) then one
    ``Tick.run_once(full=False)``, timed together, then ``check`` (not timed). Returns
    (seconds, of which ``before``'s, jobs the pass placed, ``check``'s count)."""
    from irisfed.services.tick.service import Tick

    name = f"{template}_pass"
    await _copy_database(admin_url, template, name)
    try:
        pool = await dbmod.connect(_database_url(admin_url, name), max_size=4)  # as a Deployment's
        try:
            await pool.execute("CHECKPOINT")  # the copy's pages written now, not during the pass
            store = Store(pool)
            tick = Tick(config, pool, None)
            await tick.refresh_view()
            started = time.perf_counter()
            if before is not None:
                await before(store)
            released = time.perf_counter()
            result = await tick.run_once(full=False)
            elapsed = time.perf_counter() - started
            return elapsed, released - started, len(result.assigned), await check(store)
        finally:
            await pool.close()
    finally:
        await _drop_database(admin_url, name)


async def _settle_template(pool) -> None:
    """Set-up is not measured: dead row versions gone, statistics fresh, pages written."""
    await pool.execute("VACUUM ANALYZE jobs")
    await pool.execute("VACUUM ANALYZE job_dependencies")
    await pool.execute("CHECKPOINT")


# ---------------------------------------------------------------- one job's many dependents


def fanout_body(label: str, gate: str | None):
    """Job ``i``: a gpu ``true``, id ``<label>-<i>``, after ``gate`` (ok) when given."""
    def body(i: int) -> bytes:
        job = _gpu({"command": ["true"], "job_id": f"{label}-{i}"})
        if gate is not None:
            job["after"] = [{"job_id": gate, "when": "ok"}]
        return msgspec.json.encode(job)
    return body


FANOUT_GATE = "r0"  # _bench_job(0, RUNNING): the running job they all wait for
FANOUT_GATE_PEER = "gpu0"


async def _fanout_template(bench: Bench, admin_url: str, nats_url: str, name: str, peers: list[PeerSpec],
                           jobs: int, dependents: bool) -> Deployment:
    """A database with one gpu job running on FANOUT_GATE_PEER and ``jobs`` gpu jobs
    queued, submitted through a router (in-flight 100), each after that job when
    ``dependents``; the router stopped, the pool closed: ready to copy."""
    dep = Deployment(bench, admin_url, nats_url, name, peers)
    await dep.create()
    try:
        await _fill_fanout(dep, nats_url, peers, jobs, dependents)
    except BaseException:
        await dep.close()
        raise
    return dep


async def _fill_fanout(dep: Deployment, nats_url: str, peers: list[PeerSpec], jobs: int, dependents: bool) -> None:
    await dep.advertise(peers)
    gate = msgspec.structs.replace(_bench_job(0, JobState.RUNNING, kind="gpu"), owner_peer_id=FANOUT_GATE_PEER,
                                   backend="simulated", epoch=1)
    await dep.store.job_insert_batch([gate])
    dep.start("router")
    nc = await connect_client(nats_url)
    try:
        await dep.wait_router(nc)
        sent = await closed_loop(nc, f"{dep.prefix}.submit", fanout_body("f", FANOUT_GATE if dependents else None),
                                 100, jobs, check=is_ack)
    finally:
        await nc.close()
        dep.services.supervisor.stop_all()
    waiting = await dep.pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'queued' AND deps_pending > 0")
    queued = await dep.pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'queued'")
    if sent.errors or queued != jobs or waiting != (jobs if dependents else 0):
        raise RuntimeError(f"pipelines bench: {sent.errors} submits refused; {queued} queued, {waiting} waiting "
                           f"of {jobs}")
    await _settle_template(dep.pool)
    await dep.pool.close()


async def fanout_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    jobs, pairs = bench.profile.n(200, 10_000), bench.profile.n(5, 7)
    peers: list[PeerSpec] = [("home", {"device_type": "cpu"}, 10)] + [
        (f"gpu{i}", {"device_type": "gpu"}, max(2, 2 * jobs // 10)) for i in range(10)]
    deps: list[Deployment] = []
    ours: list[float] = []
    plain: list[float] = []
    release_s: list[float] = []
    released: list[int] = []
    placed: list[int] = []
    plain_placed: list[int] = []

    async def end_gate(store: Store) -> None:
        ended = await store.job_finish_batch(FANOUT_GATE_PEER, [(FANOUT_GATE, 1, 0, False)])
        if FANOUT_GATE not in ended:
            raise RuntimeError("pipelines bench: the agent's report of the gate's end moved nothing")

    async def queued_ready(store: Store) -> int:  # placed or placeable: none left waiting
        return await store.db.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE 'f-%' AND deps_pending = 0")

    try:
        for dependents in (True, False):
            deps.append(await _fanout_template(bench, admin_url, nats_url, f"pipefan{'deps' if dependents else 'plain'}",
                                               peers, jobs, dependents))
        templates = {True: f"bench_{deps[0].name}", False: f"bench_{deps[1].name}"}
        for dependents in (True, False):  # not measured: the first passes' statements and code paths
            await _on_copy(admin_url, deps[0].config, templates[dependents], end_gate, queued_ready)
        for i in range(pairs):  # which side goes first alternates
            for dependents in (True, False) if i % 2 == 0 else (False, True):
                seconds, release, n, ready = await _on_copy(admin_url, deps[0].config, templates[dependents],
                                                            end_gate, queued_ready)
                if dependents:
                    ours.append(seconds)
                    release_s.append(release)
                    placed.append(n)
                    released.append(ready)
                else:
                    plain.append(seconds)
                    plain_placed.append(n)
    finally:
        for dep in deps:
            await dep.close()
    bench.add(fanout_figure(ours, plain, jobs, released, placed, plain_placed, release_s))


# ---------------------------------------------------------------- waiting jobs


async def waiting_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    waiting, queued, pairs = bench.profile.n(2000, 100_000), WAITING_PLACED, bench.profile.n(5, 9)
    peers = [(f"p{i}", {"device_type": KINDS[i % 3], "zone": f"z{i % 4}"}, 2 * queued // WAITING_PEERS + 1)
             for i in range(WAITING_PEERS)]
    base = Deployment(bench, admin_url, nats_url, "pipewaiting", peers)
    with_waiting = f"bench_{base.name}_waiting"
    await base.create()
    try:
        await base.advertise(peers)
        # One running job a peer (its kind's), and the plain queue: q0 .. q<queued - 1>.
        gates = [msgspec.structs.replace(_bench_job(g, JobState.RUNNING, kind=KINDS[g % 3]), owner_peer_id=f"p{g}",
                                         backend="simulated", epoch=1) for g in range(GATES)]
        await base.store.job_insert_batch(gates)
        for first in range(0, queued, 5000):
            await base.store.job_insert_batch([_bench_job(i) for i in range(first, min(queued, first + 5000))])
        await _settle_template(base.pool)
        await base.pool.close()
        await _copy_database(admin_url, f"bench_{base.name}", with_waiting)
        # The waiting rows: q<queued> onwards, each after one of the running jobs (ok).
        pool = await dbmod.connect(_database_url(admin_url, with_waiting), max_size=2)
        try:
            store = Store(pool)
            for first in range(queued, queued + waiting, 5000):
                rows = [_bench_job(i) for i in range(first, min(queued + waiting, first + 5000))]
                await store.job_insert_batch(rows)
                await pool.copy_records_to_table(
                    "job_dependencies", columns=("job_id", "needs", "condition"),
                    records=[(r.job_id, gates[i % GATES].job_id, "ok") for i, r in enumerate(rows, first)])
                await pool.execute("UPDATE jobs SET deps_pending = 1 WHERE job_id = ANY($1::text[])",
                                   [r.job_id for r in rows])
            await _settle_template(pool)
        finally:
            await pool.close()

        async def still_waiting(store: Store) -> int:
            return await store.db.fetchval("SELECT count(*) FROM jobs WHERE state = 'queued' AND deps_pending > 0")

        times: dict[bool, list[float]] = {True: [], False: []}
        placed: dict[bool, list[int]] = {True: [], False: []}
        left: list[int] = []
        templates = {True: with_waiting, False: f"bench_{base.name}"}
        for side in (True, False):  # not measured: the first passes' statements and code paths
            await _on_copy(admin_url, base.config, templates[side], None, still_waiting)
        for i in range(pairs):  # which side goes first alternates
            for side in (True, False) if i % 2 == 0 else (False, True):
                seconds, _, n, count = await _on_copy(admin_url, base.config, templates[side], None, still_waiting)
                times[side].append(seconds)
                placed[side].append(n)
                if side:
                    left.append(count)
    finally:
        await _drop_database(admin_url, with_waiting)
        await base.close()
    bench.add(waiting_figure(times[True], times[False], waiting, queued, placed[True], placed[False], left))


async def pipelines_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await chain_bench(bench, admin_url, nats_url)
    await fanout_bench(bench, admin_url, nats_url)
    await waiting_bench(bench, admin_url, nats_url)
