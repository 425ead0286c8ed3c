"""The ``engines`` section: irisfed on a real Slurm cluster and a real Ray head, beside
the engines' own clients measured in the same run.

- **Submit → start**, Slurm and Ray: the same trivial job (``date +%s.%N > FILE``)
  submitted directly (``sbatch``; ``JobSubmissionClient.submit_job``) and through a
  whole irisfed deployment (router, tick and a peer agent on that engine), one job
  at a time, alternating which goes first, each on an idle engine. Both are timed
  from just before the submit call to the wall-clock stamp the job itself writes,
  so nobody's polling latency is in either figure. Target: irisfed adds ≤ 10% at p50.
- **Status polling with many runs**, Slurm: the Slurm backend in this process with
  N runs of ``sleep 600`` in flight (most PENDING on the single node): engine calls
  per poll interval (one ``squeue`` for all runs, whatever N) and the CPU it costs.

Engines are started here (``irisfed.tooling.engines``: a single-node Slurm cluster in the
bench folder, needing root and ``slurm-wlm``/``munge``; a Ray head, needing
``ray[default]``); a part whose engine cannot start here is skipped with the reason.
Run it with ``irisfed bench --sections engines`` (``--quick`` for small counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from pathlib import Path

import msgspec

from irisfed.bench.deployment import Deployment, cpu_seconds
from irisfed.bench.report import Bench, Figure
from irisfed.services.common.bus import connect_client
from irisfed.services.peer_agent.backends import DEFAULT_POLL_INTERVAL_S
from irisfed.tooling.federation import Peer, write_config

HOME = "home"  # the federation's local cluster: configured, never started, so jobs go through the tick
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
AGENT_POLL_INTERVAL_S = DEFAULT_POLL_INTERVAL_S  # as deployed (job starts are stamped by the jobs)
STAMP_TIMEOUT_S = 120.0  # a bound on a hang, not an expectation (Ray's first job of a head: ~18 s)
OVERHEAD_TARGET = 1.10  # irisfed / engine at p50
SLURM_POLL_INTERVAL_S = 1.0  # the in-process backend of the polling figure
POLL_WINDOW_S = 10.0


async def engines_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    from irisfed.tooling.engines.ray import ray_available
    from irisfed.tooling.engines.slurm import slurm_available

    slurm = slurm_available()
    if slurm:
        await slurm_figures(bench, admin_url, nats_url)
    else:
        print(f"  skipped the Slurm figures: {slurm.reason}", flush=True)
    ray = ray_available()
    if ray:
        await ray_figures(bench, admin_url, nats_url)
    else:
        print(f"  skipped the Ray figures: {ray.reason}", flush=True)


# ---------------------------------------------------------------- shared


async def _stamp(path: Path, limit_s: float = STAMP_TIMEOUT_S) -> float:
    """The epoch seconds the job wrote to ``path`` (``date +%s.%N``), once it is there."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return float((await asyncio.to_thread(path.read_text)).strip())
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no start stamp in {path} after {limit_s:g} s")


async def _wait_for(check, what: str, limit_s: float, every: float = 0.1) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(every)
    raise TimeoutError(f"{what} after {limit_s:g} s")


def _stamp_command(path: Path) -> str:
    return f"date +%s.%N > {path}"


class _Federation:
    """A fresh database, router, tick and one agent on an engine (``peer``, started with
    ``agent_args`` and ``agent_env``); submits over NATS, one job at a time."""

    def __init__(self, bench: Bench, admin_url: str, nats_url: str, name: str, peer: Peer) -> None:
        self.peer = peer
        self.dep = Deployment(bench, admin_url, nats_url, name, [(HOME, {"device_type": "cpu"}, 1)],
                              interval=HEARTBEAT_INTERVAL_S, ttl=HEARTBEAT_TTL_S)
        # Deployment's peers run the simulated backend; this one names its engine.
        self.dep.config = write_config(
            self.dep.config_path, [Peer(HOME, {"device_type": "cpu"}, 1, "simulated"), peer],
            local_cluster=HOME, subject_prefix=self.dep.prefix, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
            heartbeat_ttl_s=HEARTBEAT_TTL_S, tick_interval_s=0.5)
        self.nc = None
        # When each job's `running` event arrived: its agent publishes it once the
        # engine took the job (sbatch or submit_job returned).
        self.handed_over: dict[str, float] = {}

    async def _on_event(self, msg) -> None:
        event = msgspec.json.decode(msg.data)
        if event.get("state") == "running":
            self.handed_over.setdefault(event["job_id"], time.time())

    async def start(self, agent_args: list[str], agent_env: dict[str, str], limit_s: float) -> None:
        await self.dep.create()
        self.dep.start("router")
        self.dep.start("tick")
        self.dep.services.start(self.peer.id, *agent_args, env=agent_env)
        self.nc = await connect_client(self.dep.nats_url)
        await self.nc.subscribe(f"{self.dep.prefix}.events.*", cb=self._on_event)
        await self.dep.wait_router(self.nc)

        async def advertised() -> bool:  # heard, with what its engine has (discovery ran)
            rows = await self.dep.store.peer_heartbeat_list()
            return any(r.peer_id == self.peer.id and r.reachable and any(b.get("resources") for b in r.backends)
                       for r in rows)

        await _wait_for(advertised, f"agent {self.peer.id} advertising its engine", limit_s, 0.25)

    async def submit(self, job_id: str, command: str) -> float:
        """Submit ``sh -c command`` to the engine peer; the time just before the request."""
        body = msgspec.json.encode({"command": ["sh", "-c", command], "job_id": job_id,
                                    "constraints": [{"key": "engine", "op": "eq", "value": self.peer.backend}]})
        sent = time.time()
        reply = msgspec.json.decode((await self.nc.request(f"{self.dep.prefix}.submit", body, timeout=10)).data)
        if reply.get("disposition") != "queue":
            raise RuntimeError(f"submit of {job_id} was not queued: {reply}")
        return sent

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()
        if hasattr(self.dep, "pool"):  # created (a failed create has nothing to drop)
            await self.dep.close()
        else:
            self.dep.services.supervisor.stop_all()


async def _compare(bench: Bench, engine: str, count: int, direct, fed: _Federation, idle) -> None:
    """``count`` pairs, alternating which goes first, each after the engine is idle; the
    p50 of each and their ratio as figures. ``direct`` takes a stamp path and a name and
    returns the time before its submit call; ``idle`` waits until no job is live."""
    folder = bench.folder / f"{engine.lower()}-stamps"
    folder.mkdir(exist_ok=True)
    latencies: dict[str, list[float]] = {"direct": [], "irisfed": []}
    handed_over: list[float] = []  # irisfed: submit → its agent's engine call returned

    async def through(path: Path, name: str) -> float:
        return await fed.submit(name, _stamp_command(path))

    ways = {"direct": direct, "irisfed": through}
    for i in range(-1, count):  # -1: a warm-up pair (first submits, connections), not measured
        for way in (("direct", "irisfed") if i % 2 == 0 else ("irisfed", "direct")):
            name = f"{way}-{i + 1}"
            path = folder / name
            sent = await ways[way](path, name)
            started = await _stamp(path)
            if i >= 0:
                latencies[way].append(started - sent)
                if way == "irisfed" and name in fed.handed_over:
                    handed_over.append(fed.handed_over[name] - sent)
            await idle()
    direct_p50, ours_p50 = statistics.median(latencies["direct"]), statistics.median(latencies["irisfed"])
    ratio = ours_p50 / direct_p50
    client = "sbatch" if engine == "Slurm" else "JobSubmissionClient.submit_job"

    def spread(values: list[float]) -> str:
        return f"{len(values)} runs, {min(values) * 1e3:,.0f}–{max(values) * 1e3:,.0f} ms"

    bench.add(Figure("engines", f"{engine}: {client} → job start p50", direct_p50 * 1e3, "ms",
                     runs=spread(latencies["direct"]),
                     note="the engine's own client; start = the job's own clock stamp"))
    bench.add(Figure("engines", f"{engine}: irisfed submit → job start p50", ours_p50 * 1e3, "ms",
                     f"{client} → start p50", ratio, f"irisfed adds ≤ {OVERHEAD_TARGET - 1:.0%} at p50",
                     ratio <= OVERHEAD_TARGET, spread(latencies["irisfed"]),
                     f"router → tick → agent (--backend {engine.lower()}) → engine; "
                     f"{(ours_p50 - direct_p50) * 1e3:+,.0f} ms at p50; irisfed's own path (submit → the agent's "
                     f"{engine} call returned: its `running` event) p50 {statistics.median(handed_over) * 1e3:,.0f} ms; "
                     "pairs alternate which goes first"))


# ---------------------------------------------------------------- Slurm


async def slurm_figures(bench: Bench, admin_url: str, nats_url: str) -> None:
    from irisfed.tooling.engines.slurm import start_slurm

    print("  starting a Slurm cluster", flush=True)
    cluster = await asyncio.to_thread(start_slurm, bench.folder / "slurm")
    try:
        await slurm_submit_to_start(bench, admin_url, nats_url, cluster)
        await slurm_polling(bench, cluster)
    finally:
        await asyncio.to_thread(cluster.stop)


async def slurm_submit_to_start(bench: Bench, admin_url: str, nats_url: str, cluster) -> None:
    count = bench.profile.n(5, 20)
    output = bench.folder / "slurm-direct"
    output.mkdir(exist_ok=True)
    peer = Peer("slurm1", {"engine": "slurm"}, 100, "slurm", slurm_partition=cluster.partition)
    fed = _Federation(bench, admin_url, nats_url, "engslurm", peer)
    try:
        await fed.start(["--backend", "slurm", "--poll-interval", str(AGENT_POLL_INTERVAL_S)],
                        cluster.env, limit_s=60)

        async def direct(path: Path, name: str) -> float:
            # The shape irisfed's backend asks for a job that names no resources: 1 cpu, 1 GiB.
            args = ["sbatch", "--parsable", "-J", name, "-c", "1", "--mem", "1024", "-D", str(output),
                    "-o", str(output / f"{name}.out"), "--wrap", _stamp_command(path)]
            sent = time.time()
            await asyncio.to_thread(cluster.run, *args)
            return sent

        async def idle() -> None:
            async def empty() -> bool:
                return not (await asyncio.to_thread(cluster.run, "squeue", "-h", "-o", "%i", check=False)).strip()
            await _wait_for(empty, "Slurm's queue to empty", 60)

        await _compare(bench, "Slurm", count, direct, fed, idle)
    finally:
        await fed.close()


async def slurm_polling(bench: Bench, cluster) -> None:
    """The Slurm backend in this process, ``count`` runs of ``sleep 600`` in flight: engine
    calls per poll interval, and this process's CPU, over ``POLL_WINDOW_S``."""
    from irisfed.services.peer_agent.backends import RunSpec
    from irisfed.services.peer_agent.backends.slurm import SlurmBackend

    count = bench.profile.n(200, 1000)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf_path)  # the backend's commands inherit it
    backend = SlurmBackend(bench.folder / "slurm-runs", "bench-peer", partition=cluster.partition,
                           poll_interval_s=SLURM_POLL_INTERVAL_S)
    try:
        started = time.perf_counter()
        for i in range(count):  # set-up, not measured
            await backend.launch(RunSpec(f"inflight-{i}", 1, ["sleep", "600"], resources={"cpu": 1}))
        launch_s = time.perf_counter() - started
        await asyncio.sleep(SLURM_POLL_INTERVAL_S * 1.5)  # the poller past its first round with all of them
        calls, polls = sum(backend.engine_calls.values()), backend.polls
        children = os.times()
        ctld = cluster.processes[1].pid  # munged, slurmctld, slurmd
        ctld_cpu = cpu_seconds(ctld)
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(POLL_WINDOW_S)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        after = os.times()
        child_cpu = (after.children_user + after.children_system
                     - children.children_user - children.children_system)
        ctld_cpu = cpu_seconds(ctld) - ctld_cpu
        calls, polls = sum(backend.engine_calls.values()) - calls, backend.polls - polls
        intervals = wall / SLURM_POLL_INTERVAL_S
        per_interval = calls / intervals
        states = await asyncio.to_thread(cluster.run, "squeue", "-h", "-o", "%T")
        running = states.split().count("RUNNING")
        bench.add(Figure("engines", f"Slurm: status polls per interval with {count:,} runs", per_interval,
                         "calls/interval", target="= 1 per interval", met=per_interval <= 1.05,
                         runs=f"{POLL_WINDOW_S:g} s window",
                         note=f"{calls} engine calls ({polls} squeue polls) in {wall:.1f} s at a "
                              f"{SLURM_POLL_INTERVAL_S:g} s interval; {running} running, the rest pending; "
                              f"launching them took {launch_s:.1f} s (not measured)"))
        bench.add(Figure("engines", f"Slurm: agent CPU with {count:,} runs in flight", cpu / wall * 100, "% core",
                         runs=f"{POLL_WINDOW_S:g} s window",
                         note=f"this process (the backend's poller); squeue children {child_cpu / wall * 100:.1f}%, "
                              f"slurmctld {ctld_cpu / wall * 100:.1f}% of a core"))
    finally:
        await backend.close()
        await asyncio.to_thread(cluster.run, "scancel", f"--partition={cluster.partition}", check=False)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


# ---------------------------------------------------------------- Ray


async def ray_figures(bench: Bench, admin_url: str, nats_url: str) -> None:
    from irisfed.tooling.engines.ray import start_ray

    print("  starting a Ray head", flush=True)
    head = await asyncio.to_thread(start_ray, bench.folder / "ray")
    try:
        await ray_submit_to_start(bench, admin_url, nats_url, head)
    finally:
        await asyncio.to_thread(head.stop)


async def ray_submit_to_start(bench: Bench, admin_url: str, nats_url: str, head) -> None:
    count = bench.profile.n(3, 10)
    client = await asyncio.to_thread(head.job_client)
    peer = Peer("ray1", {"engine": "ray"}, 100, "ray", ray_address=head.address)
    fed = _Federation(bench, admin_url, nats_url, "engray", peer)
    try:
        await fed.start(["--backend", "ray", "--ray-address", head.address,
                         "--poll-interval", str(AGENT_POLL_INTERVAL_S)], head.env, limit_s=120)

        submitted: dict[str, str] = {}  # direct: name → Ray's submission id

        async def direct(path: Path, name: str) -> float:
            # 1 cpu, as irisfed's backend asks for a job that names no resources.
            sent = time.time()
            submitted[name] = await asyncio.to_thread(
                client.submit_job, entrypoint=_stamp_command(path), entrypoint_num_cpus=1)
            return sent

        async def idle() -> None:
            async def done() -> bool:
                jobs = await asyncio.to_thread(client.list_jobs)
                return all(job.status.is_terminal() for job in jobs)
            await _wait_for(done, "every Ray job to end", 120, 0.25)

        await _compare(bench, "Ray", count, direct, fed, idle)
        _ray_entrypoint_figure(bench, head, count, submitted)
    finally:
        await fed.close()


def _ray_entrypoint_figure(bench: Bench, head, count: int, submitted: dict[str, str]) -> None:
    """Where a Ray job's start goes: from its supervisor spawning the entrypoint (the
    moment Ray wrote ``Running entrypoint ...``, its driver log's last write: these
    jobs print nothing) to the job's stamp, irisfed's runs against the direct ones.
    What is left of submit → start is Ray's: a new worker process for the job's
    supervisor actor, every job, either way."""
    if head.temp_dir is None:
        return
    logs = head.temp_dir / "session_latest" / "logs"
    stamps = bench.folder / "ray-stamps"
    spans: dict[str, list[float]] = {"direct": [], "irisfed": []}
    for i in range(1, count + 1):
        for way, sub_id in (("direct", submitted.get(f"direct-{i}")), ("irisfed", f"irisfed-irisfed-{i}-e1")):
            with contextlib.suppress(OSError, ValueError):
                spawned = (logs / f"job-driver-{sub_id}.log").stat().st_mtime
                spans[way].append(float((stamps / f"{way}-{i}").read_text()) - spawned)
    if not spans["direct"] or not spans["irisfed"]:
        return
    direct_p50, ours_p50 = statistics.median(spans["direct"]), statistics.median(spans["irisfed"])
    bench.add(Figure("engines", "Ray: entrypoint spawned → job start p50 (irisfed)", ours_p50 * 1e3, "ms",
                     runs=f"{len(spans['irisfed'])} runs",
                     note=f"direct submits {direct_p50 * 1e3:,.0f} ms; irisfed's entrypoint sets the job's env "
                          "(base64 -d, eval) and runs `sh -c`; the rest of submit → start is Ray starting a "
                          "worker for the job's supervisor, for both"))
