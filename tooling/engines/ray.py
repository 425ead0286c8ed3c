"""A local Ray cluster in a folder, for backend tests (docs/design.md §7).

``start_ray(folder)`` runs ``ray start --head --block`` in its own process group
with its own ports (GCS, dashboard on 127.0.0.1, and every other port Ray opens),
``--num-cpus 2 --num-gpus 0 --resources '{"TPU": 4}'``, a 200 MB object store,
``--temp-dir`` in ``folder`` and usage stats off, and returns a ``RayHead`` once
the Jobs API answers. ``workers=[RayWorkerSpec(...)]`` adds worker raylets on this
host (``ray start --address HEAD --block``, each in its own process group, with its
own CPUs, memory, custom resources and node labels), joined before it returns: a
multi-node cluster on one machine, for gangs (one task a node). ``RayHead.stop()``
SIGKILLs by PID every tagged process outside the head's group (workers' raylets,
Ray's workers, job supervisors and entrypoints, which run in process groups of
their own: found by a tag in their inherited environment, ``IRISFED_RAY_HEAD``),
then sends SIGTERM to the head's ``ray start`` (which stops raylet, GCS and
dashboard) and SIGKILLs by PID whatever is left. ``RayWorker.kill_raylet()`` kills
one worker's raylet by PID (a node dying under its tasks) and
``RayHead.replace_worker`` starts another like it. ``ray_available()`` says why it
cannot. Every process of the cluster has this Python's folder first on its PATH, so
``python3`` in a job is the Python that has Ray (the gang driver runs with it), as on
a real cluster.

Measured here (ray 2.60.0, Python 3.11, 2 cores at load average ~8):
``pip install 'ray[default]'`` ~100 s (a 79 MB wheel plus 45 dependencies; the
venv grows by ~290 MB, ray itself 240 MB); ``start_ray`` 11-25 s (Jobs API up,
then the first resource report); a trivial job (``echo hi``) 3-5 s from submit to
SUCCEEDED, the very first one of a head up to ~18 s; ``stop()`` 4-9 s. Two worker
raylets (started together once the head answers) join in ~5-10 s more; a gang of 3
(driver, placement group, one task a node) ran in ~3.5 s end to end, started in
1.3-4.5 s; killing a worker's raylet under a running gang failed its task
(``NodeDiedError``) within ~1.3 s.

What a backend calls (``JobSubmissionClient(head.address)``; the address is the
dashboard's ``http://127.0.0.1:PORT``; ``RAY_ADDRESS`` works too):

Submit
    ``submit_job(entrypoint="shell command", submission_id="irisfed-<job>-e<epoch>",
    entrypoint_num_cpus=1, entrypoint_num_gpus=0, entrypoint_resources={"TPU": 2},
    entrypoint_memory=BYTES, runtime_env={"env_vars": {...}}, metadata={...})``
    returns the submission id. The entrypoint runs through a shell on the head,
    with the head's environment plus ``env_vars``. Resources not given count as
    0 (not 1 CPU). A submission id already used: ``RuntimeError("Request failed
    with status code 500: ... ValueError: Job with submission_id X already
    exists. ...")``. Ray does not refuse what it can never run (e.g.
    ``{"TPU": 8}`` on a head with 4): the job stays PENDING with message ``Job
    has not started yet. It may be waiting for resources ...`` until
    RAY_JOB_START_TIMEOUT_SECONDS (900 s by default; ``job_start_timeout_s``
    here) and then FAILS (``Job supervisor actor failed to start within ...``).
    Compare with the totals (below) before submitting.

Poll
    ``get_job_status(id)`` → ``JobStatus``: PENDING, RUNNING, then terminal
    (``.is_terminal()``) SUCCEEDED, FAILED or STOPPED. ``get_job_info(id)`` →
    ``JobDetails`` with ``status``, ``message``, ``error_type`` (e.g.
    ``JOB_ENTRYPOINT_COMMAND_ERROR``), ``driver_exit_code`` (the entrypoint's exit
    status: 0, 7 ...; None when stopped), ``start_time``/``end_time`` (epoch ms),
    ``metadata``, ``entrypoint``. Unknown id: ``RuntimeError("Request failed with
    status code 404: Job nope does not exist.")``. ``list_jobs()`` → every
    ``JobDetails`` since the head started, finished ones too (``list_runs``:
    filter on the submission id prefix or ``metadata``). ``delete_job(id)``
    forgets a terminal job.

Logs
    ``get_job_logs(id)`` → one string: the entrypoint's stdout and stderr
    interleaved, among Ray's own lines (``... INFO job_manager.py:581 -- Runtime
    env is setting up.`` and ``Running entrypoint for job ID: CMD``, not
    necessarily first). ``tail_job_logs(id)`` is the async follower.

Stop
    ``stop_job(id)`` → True; a running entrypoint's process tree gets SIGTERM
    (RAY_JOB_STOP_SIGNAL), then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s); the
    job ends STOPPED, ``message="Job was intentionally stopped."``,
    ``driver_exit_code=None`` (a backend reports KILLED_EXIT_CODE). On a job still
    PENDING for resources, ``stop_job`` returns True but the job stays PENDING:
    the entrypoint starts once resources free up and is only then killed (an
    entrypoint that finishes first, like ``echo``, made Ray 2.60 report FAILED
    with a ``psutil.NoSuchProcess`` traceback as the message).

Capacity without a driver (no ``ray.init``)
    ``GET {address}/api/cluster_status`` →
    ``data.clusterStatus.loadMetricsReport.usage``: ``{"CPU": [used, total],
    "TPU": [1.0, 4.0], "memory": [used, total bytes], "objectStoreMemory": [...],
    "node:<ip>": [0.0, 1.0], "node:InternalHead": [...]}``, summed over the
    cluster: free = total - used. Running jobs' entrypoint resources count as used
    (TPU ``[1.0, 4.0]`` while a job with ``{"TPU": 1}`` ran). Totals per node:
    ``GET {address}/nodes?view=summary`` → ``data.summary[i].raylet.resourcesTotal``
    (no free amounts there). ``ray status --address GCS_ADDRESS`` prints the same
    as ``Total Usage: 0.0/2.0 CPU`` lines (used/total) but costs ~8 s of Python
    start-up per call.

Nodes without a driver
    ``/api/cluster_status`` also has ``loadMetricsReport.usageByNode``: ``{node id:
    {resource: [used, total]}}`` for each node the autoscaler monitor last saw
    (refreshed every few seconds). ``GET {address}/api/v0/nodes?limit=N`` (the
    state API) lists every node the GCS knows, dead ones too: ``node_id``,
    ``state`` (``ALIVE``/``DEAD``), ``is_head_node``, ``resources_total`` and
    ``labels`` (``--labels k=v,...`` of ``ray start``, plus Ray's own
    ``ray.io/node-id``); no free amounts. Measured on a head and three workers
    (idle, 2 cores at load ~2.5): ``cluster_status`` 3.1 KB in 3-6 ms,
    ``api/v0/nodes`` 1.4 KB in 3-11 ms (a state filter adds nothing measurable),
    ``/nodes?view=summary`` 39 KB (per node: host stats, raylet ports and
    ``resourcesTotal``, no free amounts). A placement group's bundles count as used
    on their nodes (their ``<name>_group_<id>`` resources are bookkeeping).

Gotchas: Ray replaces ``--node-ip-address 127.0.0.1`` with the machine's address,
and GCS and raylet listen on all interfaces whatever it is given (only the
dashboard honours 127.0.0.1); on SIGTERM, ``ray start`` drains the node for 30 s
unless RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 (set here); unix socket paths
under ``--temp-dir`` must stay under 108 bytes, hence the short fallback temp dir.
Every raylet of one host detects the whole host's memory (~24 GB each here, each a
little different): workers are given ``--memory`` so that alike workers are alike.
Labels need Ray >= 2.10 (``--labels`` is a hidden option of ``ray start`` in 2.60).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.tooling.engines.procs import (
    Availability,
    EngineError,
    GroupProcess,
    group_members,
    kill_tagged,
    log_tail,
    spawn,
    wait_until,
)
from irisfed.tooling.servers import free_port

INSTALL_HINT = "pip install 'ray[default]'"
# A generous bound on a hang of a slow shared machine, not an expectation (the head
# was ready in 11-25 s on a busy 2-core machine).
START_TIMEOUT_S = 120.0
WORKER_START_ATTEMPTS = 3  # a worker raylet that missed Ray's 30 s registration is started again
HEAD_START_ATTEMPTS = 2  # likewise a head (its workers' attempts are theirs)
# The object store is not what the tests exercise: keep it small (Ray's minimum is 75 MB).
OBJECT_STORE_BYTES = 200 * 1024 * 1024
WORKER_OBJECT_STORE_BYTES = 80 * 1024 * 1024
# How long `ray start --block` gets to stop its children before SIGKILL.
STOP_GRACE_S = 15.0
# Put in the environment of `ray start`; every process Ray starts inherits it. Ray
# workers, job supervisors and job entrypoints run in process groups of their own,
# so this is how ``stop`` finds them.
TAG_ENV = "IRISFED_RAY_HEAD"
# Ray puts unix sockets under --temp-dir/session_<date>_<pid>/sockets/ (about 70
# bytes); sun_path holds 107.
MAX_TEMP_DIR_LEN = 36
MIB = 1024 * 1024


def ray_available() -> Availability:
    """Can ``start_ray`` work here? (``ray[default]`` is installed in this Python)."""
    if _ray_cli() is None:
        return Availability(False, f"the `ray` command is not installed: {INSTALL_HINT}")
    try:
        import ray.dashboard  # noqa: F401
        import ray.job_submission  # noqa: F401
    except ImportError as exc:
        return Availability(False, f"ray's Jobs API is missing ({exc}): {INSTALL_HINT}")
    return Availability(True)


def _ray_cli() -> str | None:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray")


@dataclass(frozen=True)
class RayWorkerSpec:
    """A worker raylet of a test cluster: what its node offers and says of itself."""

    name: str
    num_cpus: int = 1
    memory_mb: int = 1024
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass
class RayWorker:
    """A running worker raylet: its ``ray start --block`` process group and its node."""

    spec: RayWorkerSpec
    process: GroupProcess
    node_manager_port: int
    node_id: str = ""

    def raylet_pid(self) -> int | None:
        """The PID of this worker's raylet (a member of its process group), None when gone."""
        for pid in group_members(self.process.pid):
            try:
                program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if program.endswith(b"/raylet"):
                return pid
        return None

    def kill_raylet(self) -> int:
        """SIGKILL this worker's raylet (by PID): its node dies under whatever runs there.
        Returns the PID."""
        pid = self.raylet_pid()
        if pid is None:
            raise EngineError(f"worker {self.spec.name} has no raylet left")
        os.kill(pid, signal.SIGKILL)
        return pid


@dataclass
class RayHead:
    """A running (or given) Ray head and how to reach it.

    ``address`` is the dashboard's HTTP address, which the Jobs API
    (``JobSubmissionClient(address)``) and the REST calls use; ``gcs_address`` is what
    ``ray status --address`` and ``ray.init(address=...)`` take (empty for a head we
    were only given the HTTP address of). ``process`` is None for a head we did not
    start; ``stop`` then does nothing. ``workers``: the worker raylets we started.
    """

    address: str
    gcs_address: str = ""
    num_cpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    folder: Path | None = None
    temp_dir: Path | None = None
    process: GroupProcess | None = None
    tag: str = ""
    workers: list[RayWorker] = field(default_factory=list)
    node_id: str = ""
    ports: set[int] = field(default_factory=set)  # every port given to one of its processes
    worker_temp_dirs: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs: RAY_ADDRESS (the Jobs API and `ray job` read it)."""
        return {"RAY_ADDRESS": self.address}

    def job_client(self):
        """A ``ray.job_submission.JobSubmissionClient`` for this head."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address)

    def usage(self) -> dict[str, tuple[float, float]]:
        """``{resource: (used, total)}`` now (``cluster_usage``)."""
        return cluster_usage(self.address)

    def nodes(self) -> list[dict]:
        """Every node the head knows (``/api/v0/nodes``), dead ones too."""
        return list_nodes(self.address)

    def start_workers(self, specs: Sequence[RayWorkerSpec], timeout: float = START_TIMEOUT_S) -> list[RayWorker]:
        """Start a worker raylet per spec (all at once), joined to this head; return once
        every one is alive and in the head's resource report. A worker whose ``ray start``
        exits first is started again (WORKER_START_ATTEMPTS in all, within ``timeout``):
        Ray gives a raylet a fixed 30 s to register with the GCS, which a loaded machine
        can miss."""
        if self.process is None or self.folder is None or self.temp_dir is None:
            raise EngineError("workers can only join a head this process started")
        started = [self._spawn_worker(spec) for spec in specs]
        self.workers.extend(started)
        deadline = time.monotonic() + timeout
        for attempt in range(1, WORKER_START_ATTEMPTS + 1):
            try:
                wait_until(lambda: self._joined(started), f"{len(started)} Ray worker(s) to join",
                           max(1.0, deadline - time.monotonic()),
                           [self.process, *(worker.process for worker in started)])
                return started
            except EngineError:
                exited = [worker for worker in started if not worker.process.running()]
                if attempt == WORKER_START_ATTEMPTS or not exited or not self.process.running() \
                        or time.monotonic() >= deadline:
                    raise
                for worker in exited:
                    worker.process.stop(signal.SIGKILL, timeout=STOP_GRACE_S)  # what it left behind
                    again = self._spawn_worker(worker.spec, attempt + 1)
                    self.workers[self.workers.index(worker)] = started[started.index(worker)] = again
        raise AssertionError("unreachable")

    def replace_worker(self, worker: RayWorker, timeout: float = START_TIMEOUT_S) -> RayWorker:
        """Stop ``worker`` (what is left of it) and start another like it in its place."""
        # Its `ray start` and raylet; Ray's workers of that node exit once their raylet
        # is gone (what their tasks started is the session's: ``stop`` kills it by tag).
        worker.process.stop(signal.SIGKILL, timeout=STOP_GRACE_S)
        self.workers.remove(worker)
        (new,) = self.start_workers([worker.spec], timeout)
        return new

    def _spawn_worker(self, spec: RayWorkerSpec, attempt: int = 1) -> RayWorker:
        assert self.folder is not None and self.temp_dir is not None
        node_manager_port, *others = _free_ports(6, self.ports)
        args = [
            _ray_cli(), "start", "--block", "--disable-usage-stats", "--address", self.gcs_address,
            "--num-cpus", str(spec.num_cpus), "--num-gpus", "0",
            "--memory", str(spec.memory_mb * MIB),
            "--resources", json.dumps(dict(spec.resources)),
            "--object-store-memory", str(WORKER_OBJECT_STORE_BYTES),
            "--node-manager-port", str(node_manager_port),
            *_port_flags(["--object-manager-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                          "--runtime-env-agent-port", "--metrics-export-port"], others),
        ]
        if spec.labels:
            args += ["--labels", ",".join(f"{key}={value}" for key, value in spec.labels.items())]
        # A temp dir of its own: raylets sharing one pick their socket names (raylet.N)
        # by looking at what is there, and two starting at once took the same one.
        # Each attempt its own folder and log (a failed attempt's log stays to read).
        suffix = "" if attempt == 1 else f"-{attempt}"
        temp_dir = _short_temp_dir(self.folder / f"ray-{spec.name}{suffix}")
        self.worker_temp_dirs.append(temp_dir)
        args += ["--temp-dir", str(temp_dir)]
        log = self.folder / f"ray-worker-{spec.name}{suffix}.log"
        process = spawn(f"ray worker {spec.name}", args, log, env=_cluster_env(self.tag, self.temp_dir),
                        cwd=self.folder)
        return RayWorker(spec, process, node_manager_port)

    def _joined(self, workers: Sequence[RayWorker]) -> bool:
        """Whether every worker is an alive node (its id learned) in the resource report."""
        try:
            with urllib.request.urlopen(self.address + "/nodes?view=summary", timeout=10) as response:
                summary = json.loads(response.read())["data"]["summary"]
            reported = _usage_by_node(self.address)
        except (OSError, KeyError, ValueError):
            return False
        by_port = {node["raylet"].get("nodeManagerPort"): node["raylet"] for node in summary
                   if node.get("raylet", {}).get("state") == "ALIVE"}
        for worker in workers:
            raylet = by_port.get(worker.node_manager_port)
            if raylet is None or raylet["nodeId"] not in reported:
                return False
            worker.node_id = raylet["nodeId"]
        return True

    def stop(self) -> None:
        """Stop the workers' raylets and the ``ray start --block`` process group (raylet,
        gcs_server, dashboard, workers ...) and remove the temp dir when it was one of our
        own."""
        if self.process is None:
            return
        # Worker raylets, Ray's workers, job supervisors and job entrypoints (outside the
        # group, carrying our tag) first: `ray start` would wait on them. Then SIGTERM to
        # the leader only: it stops raylet, GCS and dashboard in order (SIGTERM to the
        # whole group at once left it hanging). Whatever is left gets SIGKILL by PID.
        try:
            kill_tagged(TAG_ENV, self.tag, spare_group=self.process.pid)
            for worker in self.workers:
                worker.process.stop(signal.SIGKILL, timeout=STOP_GRACE_S)
            self.process.stop(signal.SIGTERM, timeout=STOP_GRACE_S, leader_only=True)
        finally:
            kill_tagged(TAG_ENV, self.tag)
            self.process = None
            self.workers = []
        for temp_dir in [self.temp_dir, *self.worker_temp_dirs]:
            if temp_dir is not None and self.folder is not None and not _inside(temp_dir, self.folder):
                shutil.rmtree(temp_dir, ignore_errors=True)


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def cluster_usage(address: str, timeout: float = 10.0) -> dict[str, tuple[float, float]]:
    """``{resource: (used, total)}`` over the whole cluster, from the dashboard's
    ``/api/cluster_status`` (no driver needed). Memory amounts are bytes."""
    report = _get_json(address + "/api/cluster_status", timeout)
    usage = report["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
    return {name: (float(used), float(total)) for name, (used, total) in usage.items()}


def _usage_by_node(address: str, timeout: float = 10.0) -> dict[str, dict]:
    report = _get_json(address + "/api/cluster_status", timeout)
    return report["data"]["clusterStatus"]["loadMetricsReport"].get("usageByNode") or {}


def list_nodes(address: str, timeout: float = 10.0) -> list[dict]:
    """Every node the head knows, dead ones too (``/api/v0/nodes``: ``node_id``, ``state``,
    ``resources_total``, ``labels`` ...)."""
    return _get_json(address + "/api/v0/nodes?limit=10000", timeout)["data"]["result"]["result"]


# Resources every Ray node has; the rest are custom ones (TPU here).
BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "objectStoreMemory",
                               "object_store_memory"})


def connect_ray(address: str) -> RayHead:
    """An existing Ray head by its dashboard address (``http://host:8265``); its CPUs
    and custom resources as it reports them. ``stop`` leaves it alone."""
    address = address.rstrip("/")
    totals = {name: total for name, (_, total) in cluster_usage(address).items()}
    resources = {
        name: total for name, total in totals.items()
        if name not in BUILTIN_RESOURCES and not name.startswith(("node:", "accelerator_type:"))
    }
    return RayHead(address=address, num_cpus=totals.get("CPU", 0.0), resources=resources)


def _short_temp_dir(wanted: Path) -> Path:
    """``wanted`` when unix sockets fit under it, else a short one under /tmp (made)."""
    if len(str(wanted)) > MAX_TEMP_DIR_LEN:
        return Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    wanted.mkdir(exist_ok=True)
    return wanted


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` ports free now, none of them in ``taken`` (which gets them): two calls
    of ``free_port`` may answer the same port, and Ray refuses one port for two uses."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    return ports


def _port_flags(flags: Sequence[str], ports: Sequence[int]) -> list[str]:
    return [word for flag, port in zip(flags, ports, strict=True) for word in (flag, str(port))]


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _cluster_env(tag: str, temp_dir: Path) -> dict[str, str]:
    """The environment of every ``ray start`` of one cluster."""
    env = {
        **os.environ, "RAY_USAGE_STATS_ENABLED": "0", TAG_ENV: tag,
        # The dashboard's multiprocessing leaves pymp-* folders in TMPDIR when it is
        # killed; keep them (and the jobs' temp files) in the temp dir.
        "TMPDIR": str(temp_dir / "tmp"),
        # On SIGTERM, Ray otherwise drains the node for up to 30 s (waiting on
        # running jobs) before it stops anything.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # `python3` in a job is the Python with Ray, as on a real cluster (the gang
        # driver of the ray backend runs with it).
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    env.pop("RAY_ADDRESS", None)  # `ray start --head` must not join someone else's cluster
    return env


class _HeadExited(EngineError):
    """The head's ``ray start`` exited while it started (Ray's own start timed out)."""


def start_ray(
    folder: Path, *, num_cpus: int = 2, resources: dict[str, float] | None = None,
    job_start_timeout_s: float | None = None, timeout: float = START_TIMEOUT_S,
    workers: Sequence[RayWorkerSpec] = (),
) -> RayHead:
    """Start ``ray start --head --block`` in its own process group, on free ports (the
    dashboard on 127.0.0.1), with ``num_cpus`` CPUs, no GPUs and ``resources`` (default
    ``{"TPU": 4}``), and a worker raylet per ``workers`` spec; return once the Jobs API
    answers, the first resource report is in (``usage()`` is empty before) and every
    worker joined. Logs go to ``folder``; Ray's own temp dir (sessions, sockets, job
    logs) is ``folder/ray`` when that path is short enough for unix sockets, else a short
    one under /tmp removed by ``stop``.

    ``job_start_timeout_s`` sets RAY_JOB_START_TIMEOUT_SECONDS on the head: how long
    a job waits PENDING for its entrypoint resources before Ray fails it (Ray's
    default is 900 s).

    A head whose ``ray start`` exits while it starts (Ray gives its raylet a fixed 30 s
    to register, which a loaded machine can miss) is started again, in
    ``folder/attempt-N``, HEAD_START_ATTEMPTS in all.
    """
    available = ray_available()
    if not available:
        raise EngineError(available.reason)
    resources = {"TPU": 4} if resources is None else resources
    for attempt in range(1, HEAD_START_ATTEMPTS + 1):
        try:
            return _start_ray_once(folder if attempt == 1 else folder / f"attempt-{attempt}", num_cpus=num_cpus,
                                   resources=resources, job_start_timeout_s=job_start_timeout_s, timeout=timeout,
                                   workers=workers)
        except _HeadExited as exc:
            if attempt == HEAD_START_ATTEMPTS:
                raise
            print(f"ray head start {attempt} of {HEAD_START_ATTEMPTS} failed; starting it again: "
                  f"{str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _start_ray_once(folder: Path, *, num_cpus: int, resources: dict[str, float], job_start_timeout_s: float | None,
                    timeout: float, workers: Sequence[RayWorkerSpec]) -> RayHead:
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    temp_dir = _short_temp_dir(folder / "ray")
    ports: set[int] = set()
    gcs_port, dashboard_port, *others = _free_ports(9, ports)
    args = [
        _ray_cli(), "start", "--head", "--block", "--disable-usage-stats",
        # No --node-ip-address: Ray turns 127.0.0.1 into this machine's address anyway,
        # and GCS and raylet listen on all interfaces whatever it is given.
        "--port", str(gcs_port),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard_port),
        # Every other port too, so two heads (or someone's own Ray) never collide.
        *_port_flags(["--ray-client-server-port", "--object-manager-port", "--node-manager-port",
                      "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                      "--metrics-export-port"], others),
        "--num-cpus", str(num_cpus), "--num-gpus", "0",
        "--resources", json.dumps(resources),
        "--object-store-memory", str(OBJECT_STORE_BYTES),
        "--temp-dir", str(temp_dir),
    ]
    tag = uuid.uuid4().hex
    (temp_dir / "tmp").mkdir(exist_ok=True)
    env = _cluster_env(tag, temp_dir)
    if job_start_timeout_s is not None:
        env["RAY_JOB_START_TIMEOUT_SECONDS"] = str(job_start_timeout_s)
    process = spawn("ray head", args, folder / "ray-head.log", env=env, cwd=folder)
    head = RayHead(
        address=f"http://127.0.0.1:{dashboard_port}", gcs_address=f"127.0.0.1:{gcs_port}",
        num_cpus=float(num_cpus), resources={k: float(v) for k, v in resources.items()},
        folder=folder, temp_dir=temp_dir, process=process, tag=tag, ports=ports,
    )
    try:
        wait_until(lambda: _jobs_api_answers(head), "the Ray Jobs API to answer", timeout,
                   [process])
        # The capacity report stays empty until the autoscaler monitor's first round.
        wait_until(lambda: _reports_usage(head), "Ray's first resource report", timeout,
                   [process])
        head.node_id = next(node["node_id"] for node in head.nodes() if node.get("is_head_node"))
        if workers:
            head.start_workers(workers, timeout)
        return head
    except BaseException as exc:
        exited = not process.running()
        logs = [folder / "ray-head.log", *(worker.process.log_path for worker in head.workers)]  # stop() forgets them
        head.stop()
        if isinstance(exc, EngineError):
            raise (_HeadExited if exited else EngineError)(
                f"{exc}\n" + "\n".join(log_tail(log) for log in logs)) from None
        raise


def _jobs_api_answers(head: RayHead) -> bool:
    try:
        head.job_client().list_jobs()
        return True
    except Exception:  # noqa: BLE001 - not up yet: connection refused, 5xx while starting
        return False


def _reports_usage(head: RayHead) -> bool:
    try:
        return "CPU" in head.usage()
    except (OSError, KeyError, ValueError):  # not up yet, or no report in the answer yet
        return False
