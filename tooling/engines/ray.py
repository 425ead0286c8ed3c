"""A local Ray head in a folder, for backend tests (docs/design.md §7).

``start_ray(folder)`` runs ``ray start --head --block`` in its own process group
with its own ports (GCS, dashboard on 127.0.0.1, and every other port Ray opens),
``--num-cpus 2 --num-gpus 0 --resources '{"TPU": 4}'``, a 200 MB object store,
``--temp-dir`` in ``folder`` and usage stats off, and returns a ``RayHead`` once
the Jobs API answers. ``RayHead.stop()`` sends SIGTERM to ``ray start`` (which
stops raylet, GCS and dashboard), then SIGKILLs by PID whatever is left: Ray's
workers, job supervisors and job entrypoints run in process groups of their own
(``setsid``), so they are found by a tag in their inherited environment
(``IRISFED_RAY_HEAD``). ``ray_available()`` says why it cannot.

Measured here (ray 2.60.0, Python 3.11, 2 cores at load average ~8):
``pip install 'ray[default]'`` ~100 s (a 79 MB wheel plus 45 dependencies; the
venv grows by ~290 MB, ray itself 240 MB); ``start_ray`` 11-25 s (Jobs API up,
then the first resource report); a trivial job (``echo hi``) 3-5 s from submit to
SUCCEEDED, the very first one of a head up to ~18 s; ``stop()`` 4-9 s.

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

Gotchas: Ray replaces ``--node-ip-address 127.0.0.1`` with the machine's address,
and GCS and raylet listen on all interfaces whatever it is given (only the
dashboard honours 127.0.0.1); on SIGTERM, ``ray start`` drains the node for 30 s
unless RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 (set here); unix socket paths
under ``--temp-dir`` must stay under 108 bytes, hence the short fallback temp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from irisfed.tooling.engines.procs import (
    Availability,
    EngineError,
    GroupProcess,
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
# The object store is not what the tests exercise: keep it small (Ray's minimum is 75 MB).
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# How long `ray start --block` gets to stop its children before SIGKILL.
STOP_GRACE_S = 15.0
# Put in the environment of `ray start`; every process Ray starts inherits it. Ray
# workers, job supervisors and job entrypoints run in process groups of their own,
# so this is how ``stop`` finds them.
TAG_ENV = "IRISFED_RAY_HEAD"
# Ray puts unix sockets under --temp-dir/session_<date>_<pid>/sockets/ (about 70
# bytes); sun_path holds 107.
MAX_TEMP_DIR_LEN = 36


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


@dataclass
class RayHead:
    """A running (or given) Ray head and how to reach it.

    ``address`` is the dashboard's HTTP address, which the Jobs API
    (``JobSubmissionClient(address)``) and the REST calls use; ``gcs_address`` is what
    ``ray status --address`` and ``ray.init(address=...)`` take (empty for a head we
    were only given the HTTP address of). ``process`` is None for a head we did not
    start; ``stop`` then does nothing.
    """

    address: str
    gcs_address: str = ""
    num_cpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    folder: Path | None = None
    temp_dir: Path | None = None
    process: GroupProcess | None = None
    tag: str = ""

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

    def stop(self) -> None:
        """Stop the ``ray start --block`` process group (raylet, gcs_server, dashboard,
        workers ...) and remove the temp dir when it was one of our own."""
        if self.process is None:
            return
        # Workers, job supervisors and job entrypoints (outside the group, carrying
        # our tag) first: `ray start` would wait on them. Then SIGTERM to the leader
        # only: it stops raylet, GCS and dashboard in order (SIGTERM to the whole
        # group at once left it hanging). Whatever is left gets SIGKILL by PID.
        try:
            kill_tagged(TAG_ENV, self.tag, spare_group=self.process.pid)
            self.process.stop(signal.SIGTERM, timeout=STOP_GRACE_S, leader_only=True)
        finally:
            kill_tagged(TAG_ENV, self.tag)
            self.process = None
        if self.temp_dir is not None and self.folder is not None and not _inside(
            self.temp_dir, self.folder
        ):
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def cluster_usage(address: str, timeout: float = 10.0) -> dict[str, tuple[float, float]]:
    """``{resource: (used, total)}`` over the whole cluster, from the dashboard's
    ``/api/cluster_status`` (no driver needed). Memory amounts are bytes."""
    with urllib.request.urlopen(address + "/api/cluster_status", timeout=timeout) as response:
        report = json.loads(response.read())
    usage = report["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
    return {name: (float(used), float(total)) for name, (used, total) in usage.items()}


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


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def start_ray(
    folder: Path, *, num_cpus: int = 2, resources: dict[str, float] | None = None,
    job_start_timeout_s: float | None = None, timeout: float = START_TIMEOUT_S,
) -> RayHead:
    """Start ``ray start --head --block`` in its own process group, on free ports (the
    dashboard on 127.0.0.1), with ``num_cpus`` CPUs, no GPUs and ``resources`` (default
    ``{"TPU": 4}``); return once the Jobs API answers and the first resource report is
    in (``usage()`` is empty before). Logs go to ``folder``; Ray's
    own temp dir (sessions, sockets, job logs) is ``folder/ray`` when that path is
    short enough for unix sockets, else a short one under /tmp removed by ``stop``.

    ``job_start_timeout_s`` sets RAY_JOB_START_TIMEOUT_SECONDS on the head: how long
    a job waits PENDING for its entrypoint resources before Ray fails it (Ray's
    default is 900 s).
    """
    available = ray_available()
    if not available:
        raise EngineError(available.reason)
    resources = {"TPU": 4} if resources is None else resources
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    temp_dir = folder / "ray"
    if len(str(temp_dir)) > MAX_TEMP_DIR_LEN:
        temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    temp_dir.mkdir(exist_ok=True)
    gcs_port, dashboard_port = free_port(), free_port()
    args = [
        _ray_cli(), "start", "--head", "--block", "--disable-usage-stats",
        # No --node-ip-address: Ray turns 127.0.0.1 into this machine's address anyway,
        # and GCS and raylet listen on all interfaces whatever it is given.
        "--port", str(gcs_port),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard_port),
        # Every other port too, so two heads (or someone's own Ray) never collide.
        "--ray-client-server-port", str(free_port()),
        "--object-manager-port", str(free_port()),
        "--node-manager-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--dashboard-agent-grpc-port", str(free_port()),
        "--runtime-env-agent-port", str(free_port()),
        "--metrics-export-port", str(free_port()),
        "--num-cpus", str(num_cpus), "--num-gpus", "0",
        "--resources", json.dumps(resources),
        "--object-store-memory", str(OBJECT_STORE_BYTES),
        "--temp-dir", str(temp_dir),
    ]
    tag = uuid.uuid4().hex
    scratch = temp_dir / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {
        **os.environ, "RAY_USAGE_STATS_ENABLED": "0", TAG_ENV: tag,
        # The dashboard's multiprocessing leaves pymp-* folders in TMPDIR when it is
        # killed; keep them (and the jobs' temp files) in the temp dir.
        "TMPDIR": str(scratch),
        # On SIGTERM, Ray otherwise drains the node for up to 30 s (waiting on
        # running jobs) before it stops anything.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    if job_start_timeout_s is not None:
        env["RAY_JOB_START_TIMEOUT_SECONDS"] = str(job_start_timeout_s)
    env.pop("RAY_ADDRESS", None)  # `ray start --head` must not join someone else's cluster
    process = spawn("ray head", args, folder / "ray-head.log", env=env, cwd=folder)
    head = RayHead(
        address=f"http://127.0.0.1:{dashboard_port}", gcs_address=f"127.0.0.1:{gcs_port}",
        num_cpus=float(num_cpus), resources={k: float(v) for k, v in resources.items()},
        folder=folder, temp_dir=temp_dir, process=process, tag=tag,
    )
    try:
        wait_until(lambda: _jobs_api_answers(head), "the Ray Jobs API to answer", timeout,
                   [process])
        # The capacity report stays empty until the autoscaler monitor's first round.
        wait_until(lambda: _reports_usage(head), "Ray's first resource report", timeout,
                   [process])
        return head
    except BaseException as exc:
        head.stop()
        if isinstance(exc, EngineError):
            raise EngineError(f"{exc}\n{log_tail(folder / 'ray-head.log')}") from None
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
