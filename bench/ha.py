"""The ``ha`` section: what a Postgres primary with a synchronous standby under Patroni
costs irisfed, and how long a failover leaves it unable to take a job (docs/design.md
§7; docs/operations.md, "High availability").

- *durable submits with a synchronous standby*: the submit section's closed loop (100
  in flight) through a router on the Patroni cluster's multi-host URL, against the
  same loop through a router on the bench's single server (fsync on both), in rounds
  alternating which goes first. Target: ≥ 0.5× (a commit waits for the standby's
  flush too).
- *submit → running, one job at a time*: the dispatch section's probe (router → tick →
  an agent) on each; its p50 beside the single server's.
- *unavailability*: a router on the cluster, a producer submitting every 50 ms (each
  submit with a fresh id, answered or timed out on its own); the leader's Patroni and
  postmaster SIGKILLed (the machine died); seconds from the kill to the first
  acknowledgement of a submit sent after it. The old leader is restarted and rejoins
  as the synchronous standby before the next one. p50 over 5 failovers (2 in
  --quick). Target: ≤ Patroni's TTL + 5 s (the leader key's expiry, then a loop of
  the standby's, its promotion, and the router's pool finding it).

Patroni and etcd come from Debian's packages (``apt-get install -y patroni
etcd-server``) and run as the ``postgres`` user, so this needs root; without them the
section is skipped with the reason. ``irisfed bench --sections ha``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from irisfed.bench.deployment import GPU_PEERS, is_ack, routed, submit_body
from irisfed.bench.load import closed_loop, median, spread
from irisfed.bench.report import Bench, Figure
from irisfed.bench.sections import DispatchProbe, dispatch_deployment
from irisfed.services.common.bus import connect_client
from irisfed.tooling.ha import LOOP_WAIT_S, TTL_S, PatroniCluster, ha_available, start_patroni

SUBMIT_IN_FLIGHT = 100
SUBMIT_TARGET = 0.5  # HA submits/s at least this much of the single server's
UNAVAILABLE_SLACK_S = 5.0  # beyond the TTL
PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 5.0  # above the router's answer bound on a database that is away
FAILOVER_LIMIT_S = 120.0  # a bound on a hang, not an expectation


async def ha_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    why = ha_available()
    if why:
        print(f"  skipped: {why}", flush=True)
        return
    cluster = await asyncio.to_thread(start_patroni, bench.folder / "patroni")
    try:
        ha_url = cluster.url("postgres")
        await submit_figures(bench, admin_url, ha_url, nats_url)
        await dispatch_figures(bench, admin_url, ha_url, nats_url)
        await unavailability_figure(bench, cluster, nats_url)
    finally:
        await asyncio.to_thread(cluster.stop)


async def submit_figures(bench: Bench, single_url: str, ha_url: str, nats_url: str) -> None:
    total, rounds = bench.profile.n(5_000, 30_000), bench.profile.n(2, 3)
    rates: dict[str, list[float]] = {"single": [], "ha": []}
    async with routed(bench, single_url, nats_url, "hasingle", GPU_PEERS) as (single, single_nc), \
            routed(bench, ha_url, nats_url, "hasync", GPU_PEERS) as (ha, ha_nc):
        sides = {"single": (single, single_nc), "ha": (ha, ha_nc)}
        for r in range(rounds):
            for side in ("single", "ha") if r % 2 == 0 else ("ha", "single"):
                dep, nc = sides[side]
                run = await closed_loop(nc, f"{dep.prefix}.submit", submit_body(f"s{side}{r}"), SUBMIT_IN_FLIGHT,
                                        total, check=is_ack)
                rates[side].append(run.rate)
        committed = await ha.pool.fetchval("SELECT count(*) FROM jobs")
    on_ha, on_single = median(rates["ha"]), median(rates["single"])
    ratio = on_ha / on_single
    bench.add(Figure("ha", f"durable submits/s, synchronous standby, {SUBMIT_IN_FLIGHT} in flight", on_ha,
                     "req/s", f"single server ({on_single:,.0f}/s)", ratio, f"≥ {SUBMIT_TARGET}×",
                     ratio >= SUBMIT_TARGET, spread(rates["ha"]),
                     f"single server {spread(rates['single'])}; {committed:,} jobs on the cluster"))


async def dispatch_figures(bench: Bench, single_url: str, ha_url: str, nats_url: str) -> None:
    jobs = bench.profile.n(50, 200)
    p50: dict[str, float] = {}
    notes: dict[str, str] = {}
    for side, url in (("single", single_url), ("ha", ha_url)):
        dep = await dispatch_deployment(bench, url, nats_url, f"hadispatch{side}")
        nc = await connect_client(nats_url)
        try:
            probe = DispatchProbe(dep, nc, rate=1)
            await probe.open(3)
            run, hops = await probe.one_at_a_time(jobs, f"a{side}")
            p50[side] = run.pct(0.5)
            notes[side] = f"{run.done} jobs, p90 {run.pct(0.9) * 1e3:.1f} ms, hop p50 ms: {' '.join(hops)}"
        finally:
            await nc.close()
            await dep.close()
    bench.add(Figure("ha", "submit → running p50, one job at a time, synchronous standby", p50["ha"] * 1e3, "ms",
                     f"single server ({p50['single'] * 1e3:.1f} ms)", p50["ha"] / p50["single"],
                     note=f"QUEUE jobs, router → tick → agent; {notes['ha']}"))


class _Prober:
    """Submits every PROBE_EVERY_S, each on its own: when each acknowledgement came,
    by when its submit was sent."""

    def __init__(self, nc, subject: str) -> None:
        self.nc, self.subject = nc, subject
        self.acks: list[tuple[float, float]] = []  # (sent, acknowledged), monotonic
        self.tasks: set[asyncio.Task] = set()
        self.n = 0

    async def _one(self, i: int) -> None:
        sent = time.monotonic()
        with contextlib.suppress(Exception):
            reply = await self.nc.request(self.subject, submit_body("u")(i), timeout=PROBE_TIMEOUT_S)
            if is_ack(reply.data):
                self.acks.append((sent, time.monotonic()))

    async def run(self) -> None:
        while True:
            self.n += 1
            task = asyncio.create_task(self._one(self.n))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(PROBE_EVERY_S)

    def first_ack_after(self, moment: float) -> float | None:
        return min((acked for sent, acked in self.acks if sent >= moment), default=None)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _failover(cluster: PatroniCluster, prober: _Prober) -> tuple[float, float]:
    """Kill the leader; seconds to the first acknowledgement of a submit sent after it,
    and seconds for the old leader, restarted then, to be the synchronous standby."""
    old = await asyncio.to_thread(cluster.kill_leader)
    killed_at = time.monotonic()  # its Postgres is gone: every submit from now on needs the standby
    deadline = killed_at + FAILOVER_LIMIT_S
    while (acked := prober.first_ack_after(killed_at)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no submit acknowledged {FAILOVER_LIMIT_S:.0f} s after the failover:\n"
                               f"{cluster.logs()}")
        await asyncio.sleep(0.05)
    restarted_at = time.monotonic()
    await asyncio.to_thread(cluster.restart, old)
    await asyncio.to_thread(cluster.wait_sync_standby)
    return acked - killed_at, time.monotonic() - restarted_at


async def unavailability_figure(bench: Bench, cluster: PatroniCluster, nats_url: str) -> None:
    failovers = bench.profile.n(2, 5)
    seconds: list[float] = []
    rejoins: list[float] = []
    async with routed(bench, cluster.url("postgres"), nats_url, "hafailover", GPU_PEERS) as (dep, nc):
        prober = _Prober(nc, f"{dep.prefix}.submit")
        probing = asyncio.create_task(prober.run())
        try:
            await asyncio.sleep(1.0)  # acknowledging before the first kill
            if not prober.acks:
                raise RuntimeError("no submit acknowledged on the cluster before any failover")
            for _ in range(failovers):
                unavailable, rejoined = await _failover(cluster, prober)
                seconds.append(unavailable)
                rejoins.append(rejoined)
                print(f"  failover: first acknowledgement after {unavailable:.1f} s; the old leader the "
                      f"synchronous standby again {rejoined:.1f} s after its restart", flush=True)
        finally:
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probing
            await prober.close()
    bound = TTL_S + UNAVAILABLE_SLACK_S
    p50 = median(seconds)
    bench.add(Figure("ha", f"unavailability: leader SIGKILL → first acknowledged submit, p50 of {failovers}",
                     p50, "s", f"Patroni TTL {TTL_S} s, loop wait {LOOP_WAIT_S} s", p50 / TTL_S,
                     f"≤ TTL + {UNAVAILABLE_SLACK_S:.0f} s", p50 <= bound,
                     f"{failovers} runs, {min(seconds):.1f}–{max(seconds):.1f}",
                     "each: " + ", ".join(f"{s:.1f}" for s in seconds) + " s; the old leader restarted was the "
                     f"synchronous standby again after {median(rejoins):.1f} s (p50)"))
