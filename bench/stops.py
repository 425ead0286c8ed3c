"""The ``stops`` section: what the run contract costs (docs/design.md §3.7; issue 39's
"Measured"), each figure a ratio within this run.

- *the stop path*: a router and one subprocess-backend agent (real processes), the
  job LOCAL (router → the agent, no tick). Rounds alternate two jobs: a ``sleep 300``,
  timed from just before its cancel (``<prefix>.cancel``) until its process is gone
  (``/proc/<pid>`` absent or a zombie: today's cancel → killed), and a shell trapping
  SIGTERM, timed from just before its cancel to the time its trap stamps (cancel →
  SIGTERM delivered). Each job's cancel is sent once it runs (its run folder's ``pid``
  file is there) and the next round starts once it has ended. p50 of each; the trap's
  at most 2× the kill's.
- *device bookkeeping*: one simulated-backend agent on a single node with as many
  cpus and gpus as a batch has runs (``--node 1:cpu=N,gpu=N``), a batch's runs all
  submitted within their length (so live together, each holding one device index;
  the note gives the peak): the agent's CPU (``/proc``) for batches of 1,000 runs
  (quick 300) asking ``gpu=1``, against as many asking ``fpga=1`` (a resource counted
  the same way that no index is bound for, so only the device bookkeeping differs),
  batches alternating; at most 5% more.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats

from irisfed.bench.deployment import Deployment, PeerSpec, cpu_seconds, is_ack
from irisfed.bench.load import closed_loop, median
from irisfed.bench.report import Bench, Figure
from irisfed.services.common.bus import connect_client
from irisfed.shared.lifecycle import TERMINAL_STATES, JobState

# The targets (issue 39): the trapping job's cancel → SIGTERM p50 at most this many
# times the sleep's cancel → killed p50; the gpu runs' agent CPU at most this much more.
STOP_TARGET = 2.0
DEVICE_TARGET = 0.05

STOP_PEERS: list[PeerSpec] = [("home", {"device_type": "cpu"}, 4)]
KILLED = ["sleep", "300"]
TRAPPED = ["sh", "-c", 'trap "date +%s.%N > $STAMP; exit 0" TERM; echo ready > $READY; while :; do sleep 0.05; done']
WAIT_S = 30.0  # for a job to run, to stop, or a stamp to appear
POLL_S = 0.0005  # how often the bench looks at /proc or a stamp while it times a stop

SIM_DURATION_S = 3.0  # a simulated run's length: long enough for a whole batch to be accepted within it
SUBMITS_IN_FLIGHT = 50
BATCH_WAIT_S = 180.0  # for a batch's runs all to end


# ---------------------------------------------------------------- the figures


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stop_figures(term: list[float], killed: list[float], rounds: int) -> list[Figure]:
    """The stop path's rows from the delays (s) of ``rounds`` rounds: the sleep's cancel →
    killed p50, then the trapping job's cancel → SIGTERM p50 against it, judged against
    STOP_TARGET (not judged unless at least half the rounds of each side were timed)."""
    runs = f"{len(term)} + {len(killed)} of {rounds} rounds each, alternating"
    base, ours = _pct(killed, 0.5), _pct(term, 0.5)
    setup = "a router and one subprocess agent, LOCAL jobs; the cancel sent once the job's pid file is there"
    rows = [Figure("stops", "cancel → killed p50, a `sleep 300`", base * 1e3, "ms", runs=runs,
                   note=f"today's stop: from just before the cancel to /proc/<pid> gone or a zombie; p90 "
                        f"{_pct(killed, 0.9) * 1e3:.1f} ms; {setup}")]
    judged = 2 * len(term) >= rounds and 2 * len(killed) >= rounds
    ratio = ours / base if judged and base > 0 else None
    note = (f"from just before the cancel to the time the job's TERM trap stamps (`date +%s.%N`); p90 "
            f"{_pct(term, 0.9) * 1e3:.1f} ms against {_pct(killed, 0.9) * 1e3:.1f} ms")
    if ratio is None:
        note = f"not judged: {len(term)} and {len(killed)} of {rounds} rounds timed; {note}"
    rows.append(Figure("stops", "cancel → SIGTERM delivered p50, a job trapping TERM", ours * 1e3, "ms",
                       f"cancel → killed p50 ({base * 1e3:.1f} ms)", ratio, f"≤ {STOP_TARGET:g}×",
                       None if ratio is None else ratio <= STOP_TARGET, runs, note))
    return rows


def device_figure(gpu_cpu: list[float], plain_cpu: list[float], runs: int, finished: str,
                  peak: int | None = None) -> Figure:
    """The device bookkeeping row: the agent's CPU seconds over batches of ``runs`` runs
    asking ``gpu=1`` (``gpu_cpu``, one per batch) against as many asking fpga=1
    (``plain_cpu``), summed per side; the extra in %, judged against DEVICE_TARGET.
    ``finished``: "" when every run of every batch succeeded, else what went wrong (not
    judged); ``peak``: the fewest runs any batch had running at once, as seen."""
    ours, theirs = sum(gpu_cpu), sum(plain_cpu)
    ratio = ours / theirs if theirs > 0 else float("nan")
    extra = (ratio - 1) * 100
    pairs = " ".join(f"{g / p:.2f}" for g, p in zip(gpu_cpu, plain_cpu, strict=False) if p > 0)
    note = (f"the agent's user + system time: {ours:.2f} s against {theirs:.2f} s over {len(gpu_cpu)} batches each "
            f"(median {median(gpu_cpu):.2f} against {median(plain_cpu):.2f} s); pair ratios {pairs}; one node of "
            f"{runs:,} cpus and {runs:,} gpus, runs of {SIM_DURATION_S:g} s"
            + ("" if peak is None else f", at least {peak:,} of a batch's running at once"))
    if finished:
        note = f"not judged: {finished}; {note}"
    return Figure("stops", f"device bookkeeping: agent CPU, {runs:,} simulated runs asking gpu=1", extra,
                  "% more CPU", "the same runs asking fpga=1 (no index bound)", ratio, f"≤ {DEVICE_TARGET:.0%}",
                  None if finished else ratio <= 1 + DEVICE_TARGET,
                  f"{len(gpu_cpu)} + {len(plain_cpu)} batches, alternating", note)


# ---------------------------------------------------------------- the stop path


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: /proc/<pid> absent, or a zombie (its parent, the
    agent, has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float) -> float | None:
    """(In a thread.) time.time() once ``pid`` has ended; None if it did not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return time.time()
        time.sleep(POLL_S)
    return None


def _wait_stamp(path: Path, timeout_s: float) -> float | None:
    """(In a thread.) The time a job's trap wrote to ``path`` (``date +%s.%N``); None if none within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text.endswith("\n"):
            return float(text)
        time.sleep(POLL_S)
    return None


class StopRounds:
    """Jobs submitted to a running deployment, each cancelled once it runs and timed."""

    def __init__(self, dep: Deployment, nc: nats.NATS, folder: Path) -> None:
        self.dep, self.nc, self.folder = dep, nc, folder
        self.errors: list[str] = []

    async def _submit(self, body: dict) -> None:
        reply = await self.nc.request(f"{self.dep.prefix}.submit", msgspec.json.encode(body), timeout=10)
        if not is_ack(reply.data):
            raise RuntimeError(f"stops bench: a submit was refused: {reply.data[:200]!r}")

    async def _running_pid(self, job_id: str) -> int:
        """The pid of ``job_id``'s process once it runs (the agent writes it just after the start)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            job = await self.dep.store.job_get(job_id)
            if job is not None and job.state == JobState.RUNNING and job.log_dir:
                with_pid = Path(job.log_dir) / "pid"
                if with_pid.exists() and (text := with_pid.read_text().strip()):
                    return int(text)
            if job is not None and job.state in TERMINAL_STATES:
                raise RuntimeError(f"stops bench: {job_id} ended {job.state} before it was cancelled: {job.reason}")
            await asyncio.sleep(0.01)
        raise RuntimeError(f"stops bench: {job_id} did not run within {WAIT_S:g} s")

    async def _ended(self, job_id: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            job = await self.dep.store.job_get(job_id)
            if job is not None and job.state in TERMINAL_STATES:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"stops bench: {job_id} did not end within {WAIT_S:g} s of its cancel")

    async def _cancel(self, job_id: str) -> None:
        reply = await self.nc.request(f"{self.dep.prefix}.cancel", msgspec.json.encode({"job_id": job_id}),
                                      timeout=10)
        if b"error" in reply.data:
            self.errors.append(f"{job_id}: {reply.data[:200]!r}")

    async def killed(self, job_id: str) -> float | None:
        """A ``sleep 300``: cancel → its process gone (s), or None if it outlived WAIT_S."""
        await self._submit({"command": KILLED, "job_id": job_id})
        pid = await self._running_pid(job_id)
        started = time.time()
        gone, _ = await asyncio.gather(asyncio.to_thread(_wait_gone, pid, WAIT_S), self._cancel(job_id))
        await self._ended(job_id)
        return None if gone is None else gone - started

    async def trapped(self, job_id: str) -> float | None:
        """A shell trapping TERM: cancel → its trap's stamp (s), or None if it wrote none."""
        stamp, ready = self.folder / f"{job_id}.stamp", self.folder / f"{job_id}.ready"
        await self._submit({"command": TRAPPED, "job_id": job_id, "env": {"STAMP": str(stamp), "READY": str(ready)}})
        await self._running_pid(job_id)
        deadline = time.monotonic() + WAIT_S
        while not ready.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"stops bench: {job_id} runs but did not say it was ready within {WAIT_S:g} s")
            await asyncio.sleep(0.01)
        started = time.time()
        stamped, _ = await asyncio.gather(asyncio.to_thread(_wait_stamp, stamp, WAIT_S), self._cancel(job_id))
        await self._ended(job_id)
        return None if stamped is None else stamped - started


async def stop_path(bench: Bench, admin_url: str, nats_url: str) -> None:
    rounds = bench.profile.n(8, 30)
    folder = bench.folder / "stops"
    folder.mkdir(parents=True, exist_ok=True)  # the jobs write their stamps here
    dep = Deployment(bench, admin_url, nats_url, "stops", STOP_PEERS, interval=0.5, ttl=3.0, backend="subprocess")
    await dep.create()
    nc = None
    term: list[float] = []
    killed: list[float] = []
    try:
        dep.start("router")
        dep.start(STOP_PEERS[0][0])
        nc = await connect_client(nats_url)
        await dep.wait_router(nc)
        await _reachable(dep, len(STOP_PEERS))
        probe = StopRounds(dep, nc, folder)
        await probe.killed("warm-k")  # not measured: connections, statements, first launches
        await probe.trapped("warm-t")
        for r in range(rounds):  # which side goes first alternates
            for side in ("k", "t") if r % 2 == 0 else ("t", "k"):
                if side == "k":
                    delay = await probe.killed(f"k-{r}")
                    if delay is not None:
                        killed.append(delay)
                else:
                    delay = await probe.trapped(f"t-{r}")
                    if delay is not None:
                        term.append(delay)
        if probe.errors:
            print(f"  cancels answered with errors: {probe.errors[:3]}", flush=True)
    finally:
        if nc is not None:
            await nc.close()
        await dep.close()
    for row in stop_figures(term, killed, rounds):
        bench.add(row)


async def _reachable(dep: Deployment, peers: int, timeout_s: float = WAIT_S) -> None:
    """Until ``peers`` agents advertise (their heartbeats reachable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = await dep.store.peer_heartbeat_list()
        if len([r for r in rows if r.reachable]) >= peers:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"stops bench: {peers} agents did not advertise within {timeout_s:g} s")


# ---------------------------------------------------------------- device bookkeeping


def device_body(label: str, gpu: bool):
    """Run ``i`` of a batch: a simulated ``true`` of SIM_DURATION_S, id ``<label>-<i>``,
    asking ``gpu=1`` or ``fpga=1`` (counted alike, no index bound), and the default cpu 1."""
    def body(i: int) -> bytes:
        job = {"command": ["true"], "job_id": f"{label}-{i}", "labels": {"sim.duration_s": f"{SIM_DURATION_S:g}"}}
        job["resources"] = {"gpu": 1} if gpu else {"fpga": 1}
        return msgspec.json.encode(job)
    return body


async def _local(dep: Deployment, nc: nats.NATS) -> None:
    """Until the router would take both kinds of run LOCAL (it has heard the agent's nodes)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        dispositions = set()
        for gpu in (True, False):
            job = msgspec.json.decode(device_body("probe", gpu)(0))
            reply = await nc.request(f"{dep.prefix}.submit", msgspec.json.encode({**job, "dry_run": True}), timeout=10)
            dispositions.add(msgspec.json.decode(reply.data).get("disposition"))
        if dispositions == {"local"}:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"stops bench: the router does not take the runs LOCAL: {sorted(map(str, dispositions))}")


async def _batch(dep: Deployment, nc: nats.NATS, label: str, runs: int, gpu: bool) -> tuple[float, int, str]:
    """Submit ``runs`` runs and wait for them all to end: the agent's CPU seconds meanwhile,
    the most seen running at once, and "" if every one succeeded LOCAL, else what happened."""
    agent = dep.processes[STOP_PEERS[0][0]].pid
    before = cpu_seconds(agent)
    sent = await closed_loop(nc, f"{dep.prefix}.submit", device_body(label, gpu), SUBMITS_IN_FLIGHT, runs,
                             check=is_ack)
    deadline = time.monotonic() + BATCH_WAIT_S
    terminal = [s.value for s in TERMINAL_STATES]
    peak = 0
    while True:
        row = await dep.pool.fetchrow(
            "SELECT count(*) FILTER (WHERE state = ANY($2::text[])) AS ended, "
            "count(*) FILTER (WHERE state = 'running') AS running, "
            "count(*) FILTER (WHERE state = 'succeeded' AND disposition = 'local') AS fine "
            "FROM jobs WHERE job_id LIKE $1", f"{label}-%", terminal)
        peak = max(peak, row["running"])
        if row["ended"] >= runs - sent.errors or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    cpu = cpu_seconds(agent) - before
    problem = "" if sent.errors == 0 and row["fine"] == runs else \
        f"batch {label}: {sent.errors} submits refused, {row['ended']} ended, {row['fine']} succeeded LOCAL of {runs}"
    return cpu, peak, problem


async def device_bookkeeping(bench: Bench, admin_url: str, nats_url: str) -> None:
    runs, pairs = bench.profile.n(300, 1000), bench.profile.n(3, 9)
    peer = STOP_PEERS[0][0]
    dep = Deployment(bench, admin_url, nats_url, "stopsdevices", [(peer, {"device_type": "cpu"}, 2 * runs)])
    await dep.create()
    nc = None
    gpu_cpu: list[float] = []
    plain_cpu: list[float] = []
    problems: list[str] = []
    peaks: list[int] = []
    try:
        dep.start("router")
        dep.start(peer, "--node", f"1:cpu={runs},gpu={runs},fpga={runs}")
        nc = await connect_client(nats_url)
        await dep.wait_router(nc)
        await _reachable(dep, 1)
        await _local(dep, nc)
        for gpu in (True, False):  # not measured: connections, statements, first placements
            await _batch(dep, nc, f"w{int(gpu)}", 20, gpu)
        for r in range(pairs):  # which side goes first alternates
            for gpu in (True, False) if r % 2 == 0 else (False, True):
                cpu, peak, problem = await _batch(dep, nc, f"{'g' if gpu else 'c'}{r}", runs, gpu)
                (gpu_cpu if gpu else plain_cpu).append(cpu)
                peaks.append(peak)
                if problem:
                    problems.append(problem)
    finally:
        if nc is not None:
            await nc.close()
        await dep.close()
    bench.add(device_figure(gpu_cpu, plain_cpu, runs, "; ".join(problems[:2]), min(peaks, default=None)))


async def stops_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await stop_path(bench, admin_url, nats_url)
    await device_bookkeeping(bench, admin_url, nats_url)
