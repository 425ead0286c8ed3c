"""The bench sections: irisfed's figures, each beside its same-run baseline.

``submit`` (durable submits, closed and open loop; per-user subjects against v1's),
``dispatch`` (submit → running
of QUEUE jobs through router, tick and agents, and of LOCAL jobs through the router
and the local agent), ``tick`` (placements per second, by slots,
with multi-resource requests, and many users' queues under fair share and quotas),
``heartbeat`` (fan-in cost) and ``scale`` (submit and tick cost against rows in
``jobs`` and against the number of peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import msgspec
import nats

from irisfed.bench.deployment import (
    GPU_PEERS,
    Deployment,
    PeerSpec,
    cpu_seconds,
    is_ack,
    prefix_of,
    routed,
    submit_body,
)
from irisfed.bench.load import Client, Run, closed_loop, closed_loops, median, open_loop, spread
from irisfed.bench.report import Bench, Figure
from irisfed.services.common.bus import connect_client
from irisfed.services.common.nats_auth import user_role
from irisfed.shared.lifecycle import JobState
from irisfed.shared.nats_urls import inbox_prefix_for_url
from irisfed.shared.users import DEFAULT_USER


async def submit_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    async with routed(bench, admin_url, nats_url, "submit", GPU_PEERS) as (dep, nc):
        targets = {1: None, 100: 0.40, 2000: 0.35}
        for conc, total in ((1, bench.profile.n(1000, 5000)), (100, bench.profile.n(10_000, 50_000)),
                            (2000, bench.profile.n(20_000, 100_000))):
            runs: list[Run] = []
            for attempt in range(3):
                runs.append(await closed_loop(nc, f"{dep.prefix}.submit", submit_body(f"c{conc}a{attempt}"),
                                              conc, total, check=is_ack))
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
        run = await open_loop(nc, f"{dep.prefix}.submit", submit_body("open"), rate, bench.profile.s(2, 5),
                              check=is_ack)
        bench.add(Figure("submit", f"open loop at {rate}/s: ack p99", run.pct(0.99) * 1e3, "ms",
                         note=f"p50 {run.pct(0.5) * 1e3:.2f} ms, p999 {run.pct(0.999) * 1e3:.2f} ms, "
                              f"achieved {run.rate:,.0f}/s, errors {run.errors}"))
        jobs = await dep.pool.fetchval("SELECT count(*) FROM jobs")
        bench.add(Figure("submit", "jobs committed (all acked submits)", jobs, "rows"))
    await submit_users_bench(bench, admin_url, nats_url)


SUBMIT_USERS = [f"team{n}" for n in range(10)]  # the per-user submit figure's users (no peer's ids)
SUBMIT_USERS_ROUNDS = 5  # runs of each side, alternating: a shared machine's drift falls on both


async def submit_users_bench(bench: Bench, admin_url: str, nats_url: str, concurrency: int = 100) -> None:
    """Durable submits on per-user subjects against v1's, in one deployment on a NATS
    server with users (``start_secured_nats``): the same closed loop (``concurrency`` in
    flight) over one connection per configured user, once as the user ``default``
    (NATS user ``producer``, every connection on ``P.submit``) and once as the users
    themselves (``user-U`` on ``P.submit.U``). Only the subjects and credentials
    differ, so the ratio is what users cost a submit. SUBMIT_USERS_ROUNDS rounds, each
    a run of both sides, which goes first alternating (so neither always follows the
    other's writes); each side's median is its figure, and the note gives each
    round's own ratio (two runs seconds apart: the least drift between them).
    ``nats_url`` is not used: the bench's own server has no users, so this figure
    starts one that has."""
    from irisfed.tooling.servers import start_secured_nats

    name, users = "submitusers", SUBMIT_USERS
    total = bench.profile.n(5_000, 25_000)  # per run; 2 × SUBMIT_USERS_ROUNDS runs
    server, auth = start_secured_nats(bench.folder / "nats-users", prefix_of(name), [p for p, _, _ in GPU_PEERS],
                                      user_ids=users, jetstream=False)
    connections = []
    try:
        async with routed(bench, admin_url, server.url, name, GPU_PEERS, users=[{"id": u} for u in users],
                          auth=auth) as (dep, _):
            async def client(role: str, subject: str) -> Client:
                url = dep.nats_url_as(role)
                nc = await connect_client(url)
                connections.append(nc)
                return Client(nc, subject, inbox_prefix_for_url(url))

            default, own = [], []
            for user in users:  # made in turn, so neither side has all the older connections
                default.append(await client("producer", f"{dep.prefix}.submit"))
                own.append(await client(user_role(user), f"{dep.prefix}.submit.{user}"))

            def body(label: str):
                return lambda n, i: submit_body(f"{label}c{n}")(i)

            # Not measured: connections, the router's batches and prepared statements warm.
            for side, label in ((default, "wd"), (own, "wu")):
                await closed_loops(side, body(label), concurrency, total // 5, check=is_ack)
            runs: dict[str, list[Run]] = {"default": [], "users": []}
            for attempt in range(SUBMIT_USERS_ROUNDS):  # which side goes first alternates
                order = (("default", default), ("users", own))
                for side, side_clients in order if attempt % 2 == 0 else reversed(order):
                    runs[side].append(await closed_loops(side_clients, body(f"{side[0]}{attempt}"), concurrency,
                                                         total, check=is_ack))
            # Each side's jobs are stored as its own (user_id from the subject).
            stored = dict(await dep.pool.fetch("SELECT user_id, count(*) FROM jobs GROUP BY user_id"))
    finally:
        for nc in connections:
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()
    best = {side: sorted(r, key=lambda run: run.rate)[len(r) // 2] for side, r in runs.items()}
    rounds = " ".join(f"{u.rate / d.rate:.2f}" for d, u in zip(runs["default"], runs["users"], strict=True))
    setup = f"{len(users)} connections × {concurrency // len(users)} in flight, NATS with users"

    def note(run: Run) -> str:
        return (f"{setup}; p50 {run.pct(0.5) * 1e3:.2f} ms, p99 {run.pct(0.99) * 1e3:.2f} ms, "
                f"errors {run.errors}")

    theirs = best["default"].rate
    bench.add(Figure("submit", f"durable submits/s as the default user on P.submit, {concurrency} in flight",
                     theirs, "req/s", runs=spread([r.rate for r in runs["default"]]), note=note(best["default"])))
    ratio = best["users"].rate / theirs
    bench.add(Figure("submit", f"durable submits/s as {len(users)} users on P.submit.<user>, {concurrency} in flight",
                     best["users"].rate, "req/s", f"default user on P.submit ({theirs:,.0f} req/s)", ratio,
                     "≥ 0.95× default user", ratio >= 0.95, spread([r.rate for r in runs["users"]]),
                     f"{note(best['users'])}; round ratios {rounds}; rows stored: "
                     f"{stored.get(DEFAULT_USER, 0):,} the default user's, "
                     f"{sum(n for u, n in stored.items() if u != DEFAULT_USER):,} over "
                     f"{len(stored.keys() - {DEFAULT_USER})} users"))


DISPATCH_PEERS: list[PeerSpec] = [("home", {"device_type": "cpu"}, 1000)] + [
    (f"gpu{i}", {"device_type": "gpu"}, 1000) for i in range(2)]


def hop_medians(sent: dict[str, float], seen: dict[str, dict[str, float]]) -> list[str]:
    """Where the time goes: the median of each hop (``→<state> <ms>``), from the submit
    times and the events each service publishes (``seen``: state → job → when, in path
    order). A stage none of the jobs passed is skipped and the next hop measured from
    the stage before it: a LOCAL job is created assigned, never queued."""
    hops, previous = [], sent
    for state, times in seen.items():
        gaps = sorted(times[j] - previous[j] for j in sent if j in times and j in previous)
        if gaps:
            hops.append(f"→{state} {Run(len(gaps), 1, gaps).pct(0.5) * 1e3:.1f}")
            previous = times
    return hops


@dataclasses.dataclass
class Dispatched:
    """One measured window of submit → running: the latencies (s), how many were sent,
    submit errors, each hop's median (text) and each service's CPU (fraction of a core)."""

    run: Run
    sent: int
    errors: int
    hops: list[str]
    cpu: dict[str, float]

    def note(self) -> str:
        return (f"{self.run.done}/{self.sent} reached running, {self.errors} submit errors; "
                f"hop p50 ms: {' '.join(self.hops) or 'none seen'}; "
                f"CPU % core: {', '.join(f'{k} {v * 100:.0f}' for k, v in self.cpu.items())}")


class DispatchProbe:
    """Submit → running through a running deployment (router, tick, agents): open-loop
    submits at ``rate``, each job's stages timed from the events the services publish."""

    def __init__(self, dep: Deployment, nc: nats.NATS, rate: int) -> None:
        self.dep, self.nc, self.rate = dep, nc, rate
        self.seen: dict[str, dict[str, float]] = {JobState.QUEUED: {}, JobState.ASSIGNED: {}, JobState.RUNNING: {}}
        self.expected = 0  # known once every submit is out
        self.all_running = asyncio.Event()
        self.alone: tuple[str, asyncio.Event] | None = None  # the job one_at_a_time waits for
        self.sent: dict[str, float] = {}  # one_at_a_time's jobs: when each was submitted

    async def on_event(self, msg) -> None:
        event = msgspec.json.decode(msg.data)
        stage = self.seen.get(event["state"])
        if stage is not None and event["job_id"] not in stage:
            stage[event["job_id"]] = time.perf_counter()
            if self.expected and len(self.seen[JobState.RUNNING]) >= self.expected:
                self.all_running.set()
            if event["state"] == JobState.RUNNING and self.alone is not None and event["job_id"] == self.alone[0]:
                self.alone[1].set()

    async def open(self, peers: int) -> None:
        """Subscribe to the deployment's events; wait for the router and ``peers`` agents."""
        await self.nc.subscribe(f"{self.dep.prefix}.events.*", cb=self.on_event)
        await self.dep.wait_router(self.nc)
        for _ in range(200):  # every agent advertising
            rows = await self.dep.store.peer_heartbeat_list()
            if len([r for r in rows if r.reachable]) == peers:
                break
            await asyncio.sleep(0.05)

    async def measure(self, seconds: float, label: str, device_type: str = "gpu") -> Dispatched:
        """Warm up for 0.5 s (not measured), then ``seconds`` of submits with ids
        ``<label>-<i>``, constrained to ``device_type`` (gpu: QUEUE jobs; the local
        cluster's cpu: LOCAL jobs, see ``submit_body``)."""
        dep, nc, rate, seen = self.dep, self.nc, self.rate, self.seen
        running = seen[JobState.RUNNING]
        self.expected = 0
        self.all_running.clear()
        # Warm up (connections, prepared statements, first placements), then measure.
        warm = await open_loop(nc, f"{dep.prefix}.submit", submit_body(f"{label}w", device_type), rate, 0.5,
                               check=is_ack)
        for _ in range(200):
            if sum(1 for j in running if j.startswith(f"{label}w-")) >= warm.done:
                break
            await asyncio.sleep(0.05)
        for stage in seen.values():
            stage.clear()
        sent: dict[str, float] = {}
        cpu_before = {name: cpu_seconds(p.pid) for name, p in dep.processes.items()}
        started = time.perf_counter()
        acks = await open_loop(nc, f"{dep.prefix}.submit", submit_body(label, device_type), rate, seconds,
                               sent_at=lambda i, at: sent.__setitem__(f"{label}-{i}", at), check=is_ack)
        cpu = {name: (cpu_seconds(p.pid) - cpu_before[name]) / (time.perf_counter() - started)
               for name, p in dep.processes.items()}
        self.expected = len(sent)
        if len(running) < len(sent):
            try:
                await asyncio.wait_for(self.all_running.wait(), timeout=30)
            except TimeoutError:
                pass
        missing = [j for j in sent if j not in running]
        if missing:  # say where they are, so a stuck hop is visible
            rows = await dep.pool.fetch("SELECT job_id, state, owner_peer_id, reason FROM jobs "
                                        "WHERE job_id = ANY($1::text[]) LIMIT 5", missing)
            print(f"  not seen running: {len(missing)}, e.g. {[tuple(r) for r in rows]}", flush=True)
        latencies = sorted(running[j] - sent[j] for j in sent if j in running)
        return Dispatched(Run(len(latencies), seconds, latencies), len(sent), acks.errors,
                          hop_medians(sent, seen), cpu)

    async def one_at_a_time(self, jobs: int, label: str, pause_s: float = 0.02,
                            ready: Callable[[], Awaitable[None]] | None = None,
                            body: Callable[[int], bytes] | None = None) -> tuple[Run, list[str]]:
        """Submit → running with nothing else in flight: each job submitted once the one
        before runs, after ``pause_s`` (and, with ``ready``, once it returns: not timed).
        What the path's hand-offs cost by themselves, the floor under the figure at a
        rate. Its latencies, and each hop's median (text); ``sent`` keeps when each job
        was submitted, until the next call. ``body(i)``: job i's submit (default: a QUEUE
        job, ``submit_body``), its id ``<label>-<i>``."""
        body = body or submit_body(label)
        sent: dict[str, float] = {}
        self.sent = sent
        for stage in self.seen.values():
            stage.clear()
        for i in range(jobs):
            if ready is not None:
                await ready()
            job_id = f"{label}-{i}"
            self.alone = (job_id, asyncio.Event())
            sent[job_id] = time.perf_counter()
            reply = await self.nc.request(f"{self.dep.prefix}.submit", body(i), timeout=10)
            if is_ack(reply.data):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.alone[1].wait(), timeout=10)
            await asyncio.sleep(pause_s)
        self.alone = None
        running = self.seen[JobState.RUNNING]
        latencies = [running[j] - sent[j] for j in sent if j in running]
        return Run(len(latencies), 0.0, latencies, errors=len(sent) - len(latencies)), hop_medians(sent, self.seen)


async def dispatch_deployment(bench: Bench, admin_url: str, nats_url: str, name: str) -> Deployment:
    """A deployment for submit → running: router, tick and the DISPATCH_PEERS' agents started."""
    dep = Deployment(bench, admin_url, nats_url, name, DISPATCH_PEERS, interval=0.5, ttl=3.0)
    await dep.create()
    dep.start("router")
    dep.start("tick")
    for peer_id, _, _ in DISPATCH_PEERS:
        dep.start(peer_id)
    return dep


async def dispatch_bench(bench: Bench, admin_url: str, nats_url: str, rate: int = 500) -> None:
    """Submit → running at ``rate``/s of QUEUE jobs (gpu: router → tick → a gpu agent),
    the same path one job at a time, and LOCAL jobs at the same rate (cpu, which the
    local cluster ``home`` hosts: the router creates them assigned to it and notifies
    its agent; no tick), each from the submit's scheduled send to the ``running`` event."""
    dep = await dispatch_deployment(bench, admin_url, nats_url, "dispatch")
    nc = await connect_client(nats_url)
    try:
        probe = DispatchProbe(dep, nc, rate)
        await probe.open(len(DISPATCH_PEERS))
        seconds = bench.profile.s(3, 10)
        result = await probe.measure(seconds, "d")
        run = result.run
        alone, alone_hops = await probe.one_at_a_time(bench.profile.n(50, 200), "a")
        local = await probe.measure(seconds, "l", device_type="cpu")
        bench.add(Figure("dispatch", "submit → running p50, one job at a time", alone.pct(0.5) * 1e3, "ms",
                         note=f"QUEUE jobs; the path's hand-offs alone, the floor under the rate's figure; "
                              f"{alone.done} jobs, p90 {alone.pct(0.9) * 1e3:.1f} ms, {alone.errors} not seen "
                              f"running; hop p50 ms: {' '.join(alone_hops)}"))
        bench.add(Figure("dispatch", f"submit → running p50 at {rate}/s, QUEUE job", run.pct(0.5) * 1e3, "ms",
                         "one job at a time", run.pct(0.5) / alone.pct(0.5),
                         target="≤ 10 ms", met=run.pct(0.5) <= 0.010,
                         note="router → tick → agent; " + result.note()))
        bench.add(Figure("dispatch", f"submit → running p99 at {rate}/s, QUEUE job", run.pct(0.99) * 1e3, "ms",
                         target="≤ 50 ms", met=run.pct(0.99) <= 0.050))
        bench.add(Figure("dispatch", f"LOCAL job: submit → running p50 at {rate}/s", local.run.pct(0.5) * 1e3, "ms",
                         f"QUEUE path p50 ({run.pct(0.5) * 1e3:.1f} ms)", local.run.pct(0.5) / run.pct(0.5),
                         note="router → the local cluster's agent, no tick; " + local.note()))
        bench.add(Figure("dispatch", f"LOCAL job: submit → running p99 at {rate}/s", local.run.pct(0.99) * 1e3,
                         "ms"))
    finally:
        await nc.close()
        await dep.close()


KINDS = ("cpu", "gpu", "tpu")


def _bench_job(i: int, state: JobState = JobState.QUEUED, resources: bool = False, user: str = DEFAULT_USER,
               kind: str | None = None):
    """A job row as the router builds it: mixed kinds (``KINDS[i % 3]`` unless ``kind``
    says) and priorities; ``state`` for fillers; with ``resources``, the mixed request
    of :func:`_job_resources`; ``user``'s (its id stored as ``<user>:<id>``, its
    ``user_id`` set, as the router does from the subject)."""
    from irisfed.services.router.plan import plan_new_job, route
    from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
    from irisfed.shared.messages import SubmitRequest

    raw = {"command": ["true"], "job_id": f"{state[0]}{i}", "priority": i % 5,
           "constraints": [{"key": "device_type", "op": "eq", "value": kind or KINDS[i % 3]}]}
    if resources:
        raw["resources"] = _job_resources(i)
    request = msgspec.convert(raw, SubmitRequest)
    new, _ = plan_new_job(request, route(SubmitPlan(SubmitDisposition.QUEUE, reason="bench"), "p0", None),
                          f"{state[0]}{i}", user)
    return new if state == JobState.QUEUED else msgspec.structs.replace(new, state=state)


async def _insert_jobs(dep: Deployment, start: int, stop: int, state: JobState = JobState.QUEUED,
                       resources: bool = False, user_of: Callable[[int], str] | None = None) -> None:
    """Jobs ``start`` to ``stop`` (:func:`_bench_job`), job ``i`` the user ``user_of(i)``'s
    (all ``default``'s without it)."""
    for first in range(start, stop, 5000):
        await dep.store.job_insert_batch([_bench_job(i, state, resources,
                                                     DEFAULT_USER if user_of is None else user_of(i))
                                          for i in range(first, min(stop, first + 5000))])
    # Set-up is not measured: statistics fresh, and the fill's dirty pages written now
    # rather than by a checkpoint in the middle of the figure that follows.
    await dep.pool.execute("ANALYZE jobs")
    await dep.pool.execute("CHECKPOINT")


# The tick with many users: every QUOTA_EVERY-th user has a quota of half its jobs' cpu.
QUOTA_EVERY = 10


def _tick_users(users: int, jobs: int) -> list[dict]:
    """``[[users]]`` for ``jobs`` queued jobs of ``users`` users (``u<n>``, weights 1–4):
    every QUOTA_EVERY-th with a cpu quota of half of what its jobs ask (each asks one
    cpu), so half its jobs wait with the code ``quota``."""
    per_user = jobs // users
    return [{"id": f"u{n}", "weight": float(1 + n % 4),
             **({"quota": {"cpu": max(1, per_user // 2)}} if n % QUOTA_EVERY == 0 else {})}
            for n in range(users)]


async def tick_bench(bench: Bench, admin_url: str, nats_url: str, jobs: int, peer_count: int,
                     filler: int = 0, label: str = "", resources: bool = False,
                     placed: list[int] | None = None, users: int = 0,
                     waited: list[int] | None = None) -> float:
    """Assignments per second of one ``Tick.run_once()`` over ``jobs`` queued jobs and
    ``peer_count`` peers, each with twice the slots (and, with ``resources``, twice the
    resources) its share of the queue needs, so every job is placed. ``placed`` gets
    how many were, ``waited`` how many were left queued (explained).

    With ``users``, the jobs belong to that many configured users (:func:`_tick_users`:
    consecutive blocks of ``jobs // users``), placed in fair-share order, the quota'd
    users' beyond their quota left waiting; without, all are the user ``default``'s."""
    from irisfed.services.tick.service import Tick

    peers = [(f"p{i}", {"device_type": KINDS[i % 3], "zone": f"z{i % 4}"}, max(1, 2 * jobs // peer_count))
             for i in range(peer_count)]
    configured = _tick_users(users, jobs) if users else []
    per_user = jobs // users if users else jobs
    dep = Deployment(bench, admin_url, nats_url, f"tick{jobs}x{peer_count}{label}", peers, users=configured)
    await dep.create()
    try:
        if resources:
            await _advertise_resources(dep, peers, _peer_nodes(jobs, peer_count))
        else:
            await dep.advertise(peers)
        await _insert_jobs(dep, 0, filler, JobState.SUCCEEDED)
        await _insert_jobs(dep, 0, jobs, resources=resources,
                           user_of=(lambda i: f"u{min(i // per_user, users - 1)}") if users else None)
        tick = Tick(dep.config, dep.pool, None)
        await tick.refresh_view()
        started = time.perf_counter()
        result = await tick.run_once()
        elapsed = time.perf_counter() - started
        if placed is not None:
            placed.append(len(result.assigned))
        if waited is not None:
            waited.append(result.waiting)
        return len(result.assigned) / elapsed
    finally:
        await dep.close()


# Multi-resource placement: what jobs ask and what peers have.
NODE_CPUS = (64, 128, 192, 256)  # a peer is a cluster of identical nodes of one of these sizes
NODE_MEMORY_MB_PER_CPU = 4096
ACCELERATORS_PER_NODE = 8  # gpu on gpu-kind peers, tpu on tpu-kind peers


def _job_resources(i: int) -> dict[str, int]:
    """Job ``i``'s request: cpu 1–8 and memory 1–8 GiB, plus gpu 1–4 (gpu jobs) or
    tpu 1–4 (tpu jobs); the kind is ``KINDS[i % 3]`` as in ``_bench_job``."""
    j = i // 3
    request = {"cpu": 1 + j % 8, "memory_mb": 1024 * (1 + (j // 8) % 8)}
    kind = KINDS[i % 3]
    if kind != "cpu":
        request[kind] = 1 + (j // 64) % 4
    return request


def _node_shape(peer: int) -> dict[str, int]:
    """One node of peer ``peer`` (kind ``KINDS[peer % 3]``)."""
    cpus = NODE_CPUS[(peer // 3) % len(NODE_CPUS)]
    shape = {"cpu": cpus, "memory_mb": cpus * NODE_MEMORY_MB_PER_CPU}
    kind = KINDS[peer % 3]
    if kind != "cpu":
        shape[kind] = ACCELERATORS_PER_NODE
    return shape


def _peer_nodes(jobs: int, peer_count: int) -> list[int]:
    """Nodes per peer: enough that each peer has at least twice its share (of its kind's
    queue, split evenly between the peers of that kind) in every resource, like the
    slots, so every job fits and the figure counts placements, not waiting."""
    demand = {kind: {} for kind in KINDS}
    for i in range(jobs):
        asked = demand[KINDS[i % 3]]
        for name, amount in _job_resources(i).items():
            asked[name] = asked.get(name, 0) + amount
    of_kind = {kind: sum(1 for p in range(peer_count) if KINDS[p % 3] == kind) for kind in KINDS}
    nodes = []
    for p in range(peer_count):
        kind, shape = KINDS[p % 3], _node_shape(p)
        nodes.append(max(1, *(-(-2 * total // (of_kind[kind] * shape[name]))
                              for name, total in demand[kind].items())))
    return nodes


async def _advertise_resources(dep: Deployment, peers, nodes: list[int], ttl: float = 3600.0) -> None:
    """Like ``Deployment.advertise``, with each backend's ``resources`` ({name: {total,
    free}}, the heartbeat's BackendAd): ``nodes[i]`` nodes of ``_node_shape(i)``."""
    for i, (peer_id, attrs, slots) in enumerate(peers):
        amounts = {name: {"total": float(per_node * nodes[i]), "free": float(per_node * nodes[i])}
                   for name, per_node in _node_shape(i).items()}
        await dep.store.peer_heartbeat_upsert(
            peer_id, "bench", 1, [{"name": "simulated", "attributes": {k: [v] for k, v in attrs.items()},
                                   "capacity": {"total": slots, "free": slots}, "resources": amounts}],
            ttl, datetime.now(UTC))


async def _submit_rate(bench: Bench, dep: Deployment, nc: nats.NATS, label: str) -> float:
    """Median of three closed-loop runs at 100 in flight."""
    total = bench.profile.n(5000, 20_000)
    runs = [await closed_loop(nc, f"{dep.prefix}.submit", submit_body(f"{label}r{i}"), 100, total, check=is_ack)
            for i in range(3)]
    return median([r.rate for r in runs])


def _row_counts(bench: Bench) -> tuple[int, ...]:
    """Rows already in ``jobs`` for the scale curves."""
    return (10_000, 50_000) if bench.profile.quick else (10_000, 100_000, 1_000_000)


def _peer_counts(bench: Bench) -> tuple[int, ...]:
    return (10, 100) if bench.profile.quick else (10, 100, 1000)


def _scale_figure(bench: Bench, what: str, unit: str, rate: float, first: float, sizes: tuple[int, ...],
                  size: int, runs: str = "1 run") -> None:
    """``what`` with ``size`` rows in jobs, against the same at the first size (within 1.5×)."""
    bench.add(Figure("scale", f"{what} with {size:,} rows in jobs", rate, unit, f"same at {sizes[0]:,} rows",
                     rate / first, "within 1.5×", first / rate <= 1.5, runs))


async def submit_scale(bench: Bench, admin_url: str, nats_url: str) -> None:
    """Submit cost against rows already in ``jobs``, and against the number of peers."""
    sizes = _row_counts(bench)
    async with routed(bench, admin_url, nats_url, "submitscale", GPU_PEERS) as (dep, nc):
        await _submit_rate(bench, dep, nc, "warm")
        first, filled = None, 0
        for size in sizes:
            await _insert_jobs(dep, filled, size, JobState.SUCCEEDED)
            filled = size
            rate = await _submit_rate(bench, dep, nc, f"s{size}")
            first = first or rate
            _scale_figure(bench, "submits/s (100 in flight)", "req/s", rate, first, sizes, size, "3 runs (median)")
    for count in _peer_counts(bench):
        peers = [(f"g{i}", {"device_type": "gpu"}, 1000) for i in range(count)]
        async with routed(bench, admin_url, nats_url, f"submitpeers{count}",
                           [("home", {"device_type": "cpu"}, 10)] + peers, advertised=peers) as (dep, nc):
            await _submit_rate(bench, dep, nc, "warm")
            rate = await _submit_rate(bench, dep, nc, f"p{count}")
            bench.add(Figure("scale", f"submits/s (100 in flight) with {count} peers", rate, "req/s",
                             runs="3 runs (median)"))


async def heartbeat_load(bench: Bench, admin_url: str, nats_url: str, name: str, peers: list[PeerSpec],
                         backends: Callable[[int], list]) -> tuple[dict[str, float], float]:
    """Every one of ``peers`` heartbeats at 1 Hz (advertising ``backends(slots)``) for
    the profile's time to a fresh deployment's router and tick: the share of a core
    each used ("router", "tick"), and Postgres commits/s meanwhile."""
    dep = Deployment(bench, admin_url, nats_url, name, peers, interval=1.0, ttl=3.0)
    await dep.create()
    router, tick = dep.start("router"), dep.start("tick")
    nc = await connect_client(nats_url)
    try:
        await dep.wait_router(nc)
        seconds = bench.profile.s(4, 10)
        run_id = uuid.uuid4().hex
        stats = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        commits_before = await dep.pool.fetchval(stats)
        cpu_before = {p.pid: cpu_seconds(p.pid) for p in (router, tick)}
        started = time.perf_counter()
        beat = 0
        while time.perf_counter() - started < seconds:
            beat += 1
            for peer_id, _, slots in peers:
                body = msgspec.json.encode({
                    "peer_id": peer_id, "seq": beat, "sent_at": datetime.now(UTC).isoformat(), "ttl_s": 3.0,
                    "run_id": run_id, "backends": backends(slots)})
                await nc.publish(f"{dep.prefix}.heartbeat.{peer_id}", body)
            await nc.flush()
            await asyncio.sleep(max(0.0, started + beat - time.perf_counter()))
        elapsed = time.perf_counter() - started
        cpu = {p.pid: (cpu_seconds(p.pid) - cpu_before[p.pid]) / elapsed for p in (router, tick)}
        commits = (await dep.pool.fetchval(stats) - commits_before) / elapsed
    finally:
        await nc.close()
        await dep.close()
    return {"router": cpu[router.pid], "tick": cpu[tick.pid]}, commits


async def heartbeat_bench(bench: Bench, admin_url: str, nats_url: str) -> None:
    count = bench.profile.n(200, 1000)
    peers = [(f"hb{i}", {"device_type": "gpu"}, 4) for i in range(count)]
    cpu, commits = await heartbeat_load(bench, admin_url, nats_url, "heartbeat", peers, lambda slots: [{
        "name": "simulated", "attributes": {"device_type": ["gpu"]}, "capacity": {"total": slots, "free": slots}}])
    bench.add(Figure("heartbeat", f"router CPU with {count} peers at 1 Hz", cpu["router"] * 100, "% core",
                     target="< 10%", met=cpu["router"] < 0.10))
    bench.add(Figure("heartbeat", f"tick CPU with {count} peers at 1 Hz", cpu["tick"] * 100, "% core"))
    bench.add(Figure("heartbeat", "Postgres commits/s (control plane)", commits, "commits/s",
                     note="peers here publish on NATS only; see docs/performance.md"))


async def tick_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    jobs, peers = bench.profile.n(10_000, 100_000), bench.profile.n(20, 100)
    # The jobs of one user (``default``, as in v1), and the same jobs and peers as the
    # jobs of many users: claimed per user, placed in weighted dominant-share order,
    # quotas checked as placed and again under the users' locks at commit. Runs
    # alternate, so a shared machine's drift falls on both alike.
    users = bench.profile.n(100, 1000)
    rates, user_rates, placed, waited = [], [], [], []
    for i in range(3):
        rates.append(await tick_bench(bench, admin_url, nats_url, jobs, peers, label=f"r{i}"))
        user_rates.append(await tick_bench(bench, admin_url, nats_url, jobs, peers, label=f"u{i}", users=users,
                                           placed=placed, waited=waited))
    single = median(rates)
    ratio = single / bench.baselines["pg_claim"]
    bench.add(Figure("tick", f"assignments/s, {jobs:,} queued × {peers} peers", single, "jobs/s",
                     "batched claim", ratio, "≥ 25,000/s and ≥ 0.5× claim",
                     single >= 25_000 and ratio >= 0.5, spread(rates)))
    ratio = median(user_rates) / single
    quota_users = len(range(0, users, QUOTA_EVERY))
    bench.add(Figure("tick", f"assignments/s, {jobs:,} queued of {users:,} users × {peers} peers, fair share",
                     median(user_rates), "jobs/s", f"single user, same jobs and peers ({single:,.0f}/s)", ratio,
                     "≥ 0.85× single user", ratio >= 0.85, spread(user_rates),
                     f"{jobs // users} jobs per user, weights 1–4; every {QUOTA_EVERY}th user ({quota_users}) "
                     f"with a cpu quota of half its jobs; placed {_span(placed)}/{jobs:,}, left waiting "
                     f"{_span(waited)} (quota)"))
    # The same through multi-resource placement: every job asks cpu and memory (and gpu
    # or tpu), every peer advertises each resource's total and free amount.
    placed: list[int] = []
    rates = [await tick_bench(bench, admin_url, nats_url, jobs, peers, label=f"m{i}", resources=True,
                              placed=placed) for i in range(3)]
    ratio = median(rates) / bench.baselines["pg_claim"]
    nodes = _peer_nodes(jobs, peers)
    bench.add(Figure("tick", f"assignments/s, {jobs:,} queued × {peers} peers, multi-resource", median(rates),
                     "jobs/s", "batched claim", ratio, "≥ 25,000/s and ≥ 0.5× claim",
                     median(rates) >= 25_000 and ratio >= 0.5, spread(rates),
                     f"jobs: cpu 1–8, memory 1–8 GiB, gpu or tpu 1–4; peers: {min(nodes)}–{max(nodes)} "
                     f"nodes of cpu 64–256, 4 GiB/cpu, 8 gpu or tpu; placed {min(placed):,}/{jobs:,}"))


def _span(values: list[int]) -> str:
    """``9,500`` or ``9,480–9,500``: what several runs counted."""
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


async def scale_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await submit_scale(bench, admin_url, nats_url)
    sizes = _row_counts(bench)
    await tick_bench(bench, admin_url, nats_url, 5000, 20, label="warm")  # not measured: a cold first run
    first = None
    for size in sizes:
        rate = await tick_bench(bench, admin_url, nats_url, 5000, 20, filler=size, label=f"s{size}")
        first = first or rate
        _scale_figure(bench, "tick assignments/s", "jobs/s", rate, first, sizes, size)
    for peers in _peer_counts(bench):
        rate = await tick_bench(bench, admin_url, nats_url, 5000, peers, label=f"p{peers}")
        bench.add(Figure("scale", f"tick assignments/s with {peers} peers", rate, "jobs/s"))
