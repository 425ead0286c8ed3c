"""The ``ray`` backend: each run a job of a Ray cluster, through the Ray Jobs API.

Every call to the head (``JobSubmissionClient``, blocking HTTP) runs in one of the
backend's own threads (``CALL_THREADS``) with a timeout, so a slow or silent head never
stalls the agent's loop nor takes the threads the rest of the agent uses; the client
is made on first use (making it asks the head its version) and ``ray`` is imported
only here (it is an optional extra). ``tooling/engines/ray.py`` records how the
API behaves; ``ray_text.py``, ``ray_gang_text.py`` and ``ray_capacity.py`` hold the pure
mapping both ways, ``ray_run.py`` the handle on a run (its log tail, its outcome).

- Launch submits ``irisfed-<job_id>-e<epoch>`` with metadata naming our peer, job
  and epoch (peers sharing a cluster never list, adopt or kill each other's jobs) and
  a nonce first kept in the run folder (``NONCE_FILE``): anyone who reaches the
  dashboard can submit a job with that name and metadata, so launch and ``adopt``
  take only a job carrying the recorded nonce for our run (``ray_text.submitted_by_us``),
  the command as one quoted shell line, the job's environment (never the agent's)
  and its resources as entrypoint resources. A request no node could ever hold is
  refused here (``LaunchError``): Ray itself would keep it pending for 15 minutes
  and then fail it. A submission id Ray already has with our nonce is that run:
  launch returns it; without it, launch fails (someone else's job).
- One poller task, started on the first launch or adoption and ended when nothing
  is left to follow (or by ``close``), asks ``list_jobs`` once per interval for all
  runs together, never once per run. ``engine_calls`` counts every call by name.
- While a run runs, its log follows the Jobs API's tail (``tail_job_logs``, a
  websocket) into ``<run dir>/stdout``, which the agent ships (docs/design.md §3.6).
  A run ended: ``wait`` adds what the tail had not brought of its logs
  (``get_job_logs``: stdout and stderr interleaved, among a few lines of Ray's own;
  the log only grows, so the file's characters are its start) and returns its exit
  code, or raises ``RunLost`` when Ray failed it before its command ended
  or the head no longer lists it (a restarted head forgets every job).
- Kill is ``stop_job``; Ray ignores it while the job is PENDING (the command
  would start once resources free up), so the poller asks again at every poll
  until the job ends. Ray gives a running job SIGTERM (its entrypoint's process
  and every descendant it has then), then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S``
  (3 s by default), which its job supervisor reads from the job's runtime env: each
  submission sets it to the run's grace (``ray_text.stop_env``; a gang's, longer, as
  its driver gives each task's command the grace itself: ``ray_gang.py``).
- A submit whose answer was lost (a timeout) may have created the job all the
  same; it is then a run the agent does not know, which its next leftover scan
  (``list_runs``) finds and kills.
- A gang (``replicas`` > 1) is one Ray job too, same name, metadata (plus
  ``irisfed_tasks`` and its start timeout) and nonce: its entrypoint runs a driver
  (``ray_gang.py``, shipped zlib+base64 in the job's runtime env and run by the head's
  ``python3``) that places one task a node in a ``STRICT_SPREAD`` placement group and
  prints what happens; the backend reads that back from the job's log
  (``ray_gang_text.read_gang_log``). ``started`` is set once the log of the RUNNING job
  holds the driver's ``started`` line: one ``get_job_logs`` per poll for each gang
  that is running and has not started yet (the job's status alone says only that the
  driver runs; its metadata cannot change). The end: the driver's ``end`` line says
  each task's state, node and exit code, and whether the run was lost (a task's node
  died, a task could not start, not all started within the start timeout: ``RunLost``);
  each task's output goes to ``<run dir>/task-<i>/stdout`` and ``stderr``. A gang
  whose driver has not said its tasks run ``GANG_START_GRACE_S`` after its start
  timeout (a job Ray keeps PENDING) is stopped and lost. A gang the cluster could
  never hold (too few alive nodes whose totals hold a task, sharing one ``group_by``
  label value) is refused at launch (``ray_gang_text.gang_problem``).
- Discovery: ``GET /api/cluster_status`` (totals and free, cluster-wide and per node
  in ``usageByNode``) then ``GET /api/v0/nodes`` (which nodes are alive, their labels),
  in one of the backend's threads; alive nodes grouped with their labels as
  attributes (``ray_capacity.cluster_report``). Measured on a head and three worker
  raylets (ray 2.60, 2 loaded cores): 3.1 KB in 3-6 ms and 1.4 KB in 3-11 ms; the
  dashboard's ``/nodes?view=summary`` has no free amounts and is 13 KB a node. A node
  the resource report (refreshed every few seconds) has not seen yet offers nothing
  free until it has.

Limits (measured with ray 2.60): a job sees the environment of the Ray node that
runs it plus its own variables. Ray expands ``$NAME`` and ``${NAME}`` in
``runtime_env.env_vars`` values, so those travel base64-encoded and the entrypoint's
shell decodes them (``base64 -d`` on the node) and sets them verbatim before it
``exec``s the command (``ray_text.entrypoint``). Anyone who can reach the dashboard reads a
job's variables (``list_jobs``). The
fit check counts the nodes the cluster has now: an autoscaler's nodes not yet
started do not count. ``list_jobs`` answers with every job since the head started,
so each poll grows with the head's history, not with our runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import secrets
import shutil
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from irisfed.services.common.log import EventLogger
from irisfed.services.peer_agent.backends import (
    ray_gang,
)
from irisfed.services.peer_agent.backends import ray_gang_text as gang_text
from irisfed.services.peer_agent.backends import ray_text as text
from irisfed.services.peer_agent.backends.contract import (
    DEFAULT_POLL_INTERVAL_S,
    OUTPUT_FOLDER,
    WORKSPACE_FOLDER,
    Discovered,
    LaunchError,
    LiveRun,
    RunSpec,
)
from irisfed.services.peer_agent.backends.devices import RESOURCES_VARIABLE, resources_json
from irisfed.services.peer_agent.backends.ray_capacity import ClusterReport, cluster_report
from irisfed.services.peer_agent.backends.ray_run import _RayGang, _RayRun
from irisfed.shared.errors import ConfigError
from irisfed.shared.workspace import copy_tree

log = EventLogger("peer-agent")

# How long one call to the head may take (a generous bound on a busy head, not an
# expectation: calls take well under a second).
CALL_TIMEOUT_S = 30.0
# Threads for calls to the head, the backend's own: a head that accepts connections and
# never answers holds each call's thread for CALL_TIMEOUT_S, and must not hold the
# event loop's default executor (file writes, host name lookups for reconnects).
CALL_THREADS = 4
# In a run's folder, written before it is submitted: the nonce in its Ray metadata.
NONCE_FILE = "ray-submission"
# The most nodes one ``/api/v0/nodes`` answer lists (the state API's own cap: 10,000).
NODES_LIMIT = 10_000
# The driver's source, read once: what every gang's job runs (ray_gang.py).
_DRIVER_PAYLOAD = gang_text.driver_payload(inspect.getsource(ray_gang))


def _make_client(address: str, timeout_s: float) -> Any:
    """A ``JobSubmissionClient`` whose every HTTP request times out: the client sets
    none, and a request that never returns would hold its thread for ever."""
    JobSubmissionClient = _job_submission_client()

    class _Client(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return _Client(address)


def _job_submission_client() -> type:
    """Ray's ``JobSubmissionClient`` class (Ray is an optional extra: a clear error without it)."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:
        raise ConfigError("the ray backend needs Ray: pip install 'irisfed[ray]'") from exc
    return JobSubmissionClient


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _cluster_payloads(address: str, timeout_s: float) -> tuple[Any, Any]:
    """The resource report and the node list, one after the other in one thread (each
    answers in milliseconds; one thread per discovery, however silent the head)."""
    deadline = time.monotonic() + timeout_s
    status = _get_json(address + "/api/cluster_status", timeout_s)
    nodes = _get_json(address + f"/api/v0/nodes?limit={NODES_LIMIT}", max(0.1, deadline - time.monotonic()))
    return status, nodes


def _not_found(error: BaseException) -> bool:
    """Whether a Jobs API call failed because the head has no such job (HTTP 404)."""
    return "status code 404" in str(error)


def _prepare_run_dir(run_dir: Path, spec: RunSpec | None = None) -> str:
    """Make the run folder, its outputs folder, its copy of its workspace (with a file
    naming the run: Ray caches a working_dir by its content, so each run's is its own)
    and its nonce (kept: a second launch of the run reuses it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OUTPUT_FOLDER).mkdir(exist_ok=True)
    if spec is not None and spec.workspace is not None:
        copy = run_dir / WORKSPACE_FOLDER
        if os.path.lexists(copy):
            shutil.rmtree(copy)
        copy_tree(spec.workspace, copy)
        (copy / ".irisfed-run").write_text(f"{spec.job_id} {spec.epoch}\n")
    path = run_dir / NONCE_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    nonce = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(nonce)
    return nonce


def _recorded_nonce(run_dir: Path) -> str | None:
    """The nonce a run folder recorded; "" for a folder without one (an older agent's),
    None when there is no folder (this peer never submitted that run)."""
    try:
        return (run_dir / NONCE_FILE).read_text().strip()
    except FileNotFoundError:
        return "" if run_dir.is_dir() else None


RAY_IGNORE_GITIGNORE = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"  # ray._private.ray_constants


class RayBackend:
    """Runs each job as a Ray job of the cluster whose dashboard is at ``address``
    (``http://head:8265``); output under ``work_root/<job_id>/epoch-<n>``."""

    kind = "ray"
    discovers = True
    runs_outlive_agent = True

    def __init__(self, address: str, work_root: Path, peer_id: str,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 call_timeout_s: float = CALL_TIMEOUT_S, python: str = "python3") -> None:
        self.address = address.rstrip("/")
        self.work_root = work_root
        self.peer_id = peer_id
        self.poll_interval_s = poll_interval_s
        self.call_timeout_s = call_timeout_s
        self.python = python  # on the head's PATH, with Ray: what runs a gang's driver
        self.engine_calls: Counter[str] = Counter()  # calls to the head, by name
        self.polls = 0  # poller rounds: one list_jobs each, whatever the number of runs
        self._client: Any = None
        self._connecting = asyncio.Lock()
        self._threads = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix=f"irisfed-ray-{peer_id}")
        # A workspace travels whole: Ray's upload of a working_dir would otherwise leave out
        # what a .gitignore in it lists (the producer chose what to leave out when packing).
        os.environ[RAY_IGNORE_GITIGNORE] = "1"
        self._discovery: asyncio.Future[Discovered] | None = None  # the one in flight
        self._runs: dict[str, _RayRun] = {}  # followed, by submission id
        self._poller: asyncio.Task[None] | None = None
        self._report: ClusterReport | None = None
        # Importing Ray takes about a second of CPU holding the GIL: done here, while the
        # agent starts and before its first heartbeat, not inside the first launch, where
        # it would starve the event loop (and its heartbeats) of a running agent.
        _job_submission_client()

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.work_root / job_id / f"epoch-{epoch}"

    def log_dir(self, job_id: str, epoch: int) -> str:
        return str(self.run_dir(job_id, epoch).resolve())

    def output_dirs(self, job_id: str, epoch: int, tasks: int) -> list[tuple[int, Path]]:
        """The run's ``IRISFED_OUTPUT_DIR`` (one for all of a gang's tasks), in the agent's
        work dir: Ray's nodes must reach it (the same machine, or a shared filesystem)."""
        return [(0, self.run_dir(job_id, epoch) / OUTPUT_FOLDER)]

    # ------------------------------------------------------------ calls to the head

    async def _connect(self) -> Any:
        async with self._connecting:
            if self._client is None:
                self.engine_calls["connect"] += 1
                # Twice the call timeout: importing ray takes seconds on a busy machine.
                self._client = await asyncio.wait_for(
                    self._in_thread(_make_client, self.address, self.call_timeout_s),
                    timeout=2 * self.call_timeout_s)
        return self._client

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``JobSubmissionClient.<name>(...)`` in a thread, within the call timeout."""
        client = await self._connect()
        self.engine_calls[name] += 1
        return await asyncio.wait_for(self._in_thread(getattr(client, name), *args, **kwargs),
                                      timeout=self.call_timeout_s)

    def _in_thread(self, function: Any, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """``function(...)`` in one of the backend's own threads (``CALL_THREADS``)."""
        return asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(function, *args, **kwargs))

    async def _job_info(self, submission_id: str) -> Any | None:
        """The head's ``JobDetails`` of a job, None when it has no such job."""
        try:
            return await self.call("get_job_info", submission_id)
        except RuntimeError as exc:
            if _not_found(exc):
                return None
            raise

    async def stop(self, submission_id: str) -> None:
        """``stop_job``; a failure is only logged (the poller asks again)."""
        try:
            await self.call("stop_job", submission_id)
        except Exception as exc:  # noqa: BLE001 - asked again at the next poll
            if not _not_found(exc):
                log.warning("ray_stop_failed", submission_id=submission_id, error=repr(exc))

    # ------------------------------------------------------------ launching

    async def launch(self, spec: RunSpec) -> _RayRun:
        submission_id = text.submission_id(spec.job_id, spec.epoch)
        report = self._report
        if report is None:
            try:
                await self.discover()
            except Exception as exc:  # noqa: BLE001 - any failure to reach the head
                raise LaunchError(f"cannot learn what the Ray cluster at {self.address} has: {exc!r}") from exc
            report = self._report
            assert report is not None
        try:
            submission = self._submission(spec, report)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        problem = text.too_big(spec.resources, report)
        if problem is None and spec.replicas > 1:
            problem = gang_text.gang_problem(spec.resources, spec.replicas, spec.group_by, report)
        if problem is not None:
            raise LaunchError(problem)
        try:
            nonce = await asyncio.to_thread(_prepare_run_dir, self.run_dir(spec.job_id, spec.epoch), spec)
        except OSError as exc:
            raise LaunchError(f"cannot make the run folder: {exc.strerror or exc}") from exc
        if spec.workspace is not None:  # its own copy, uploaded by Ray as the job's working_dir
            submission["runtime_env"]["working_dir"] = str(self.run_dir(spec.job_id, spec.epoch).resolve()
                                                           / WORKSPACE_FOLDER)
        submitted_at = time.time()
        try:
            await self.call(
                "submit_job", submission_id=submission_id,
                metadata=text.metadata(self.peer_id, spec.job_id, spec.epoch, nonce, spec.replicas,
                                       spec.start_timeout_s),
                **submission,
            )
        except Exception as exc:  # noqa: BLE001 - any failure to submit is a launch error
            if not text.already_exists(exc):
                # The head may have taken the job all the same (its answer lost or late):
                # failing the launch would hand the job back and run its command twice.
                made = await self._submitted_anyway(spec, submission_id, exc)
                if made is None:
                    raise LaunchError(f"Ray did not take job {submission_id}: {exc!r}") from exc
                return made
            try:  # launched before by this peer (the nonce says so): that is the run
                handle = await self.adopt(LiveRun(spec.job_id, spec.epoch, submission_id))
            except Exception as info_exc:  # noqa: BLE001
                raise LaunchError(f"Ray has job {submission_id} but cannot say whose: {info_exc!r}") from exc
            if handle is None:
                raise LaunchError(f"Ray job {submission_id} exists and is not this peer's run") from exc
            return handle
        gang = (spec.replicas, spec.start_timeout_s) if spec.replicas > 1 else None
        return self.track(submission_id, spec.job_id, spec.epoch, gang, submitted_at)

    def _submission(self, spec: RunSpec, report: ClusterReport) -> dict[str, Any]:
        """``submit_job``'s entrypoint, runtime env and resources for ``spec``: the command
        itself, or for a gang the driver, which holds nothing (its tasks' placement group
        does). Raises ValueError for what cannot be passed. Either way the runtime env
        sets Ray's stop timeout for this job to its grace (``ray_text.stop_env``)."""
        env = {**spec.env, "IRISFED_OUTPUT_DIR": str(self.run_dir(spec.job_id, spec.epoch).resolve() / OUTPUT_FOLDER),
               RESOURCES_VARIABLE: resources_json(spec.resources)}  # devices: Ray binds num_gpus' own
        if spec.replicas <= 1:
            return {"entrypoint": text.entrypoint(spec.command, env),
                    "runtime_env": {"env_vars": {**text.job_env(env, spec.job_id, spec.epoch),
                                                 **text.stop_env(spec.grace_s)}},
                    **text.submit_resources(spec.resources, report.ray_names)}
        bundle = gang_text.gang_bundle(spec.resources, report.ray_names)
        env_vars = gang_text.gang_env(spec.command, env, spec.job_id, spec.epoch, spec.replicas, bundle,
                                      spec.group_by, spec.start_timeout_s, _DRIVER_PAYLOAD,
                                      grace_s=spec.grace_s)
        env_vars.update(text.stop_env(spec.grace_s, gang=True))
        return {"entrypoint": gang_text.gang_entrypoint(self.python), "runtime_env": {"env_vars": env_vars},
                "entrypoint_num_cpus": 0}

    async def _submitted_anyway(self, spec: RunSpec, submission_id: str, failure: Exception) -> _RayRun | None:
        """Our run of ``spec`` when a failed ``submit_job`` created it all the same (the
        nonce in its run folder says it is ours); None when the head has none or cannot
        be asked (then the leftover scan stops any that shows up later)."""
        try:
            made = await self.adopt(LiveRun(spec.job_id, spec.epoch, submission_id))
        except Exception as exc:  # noqa: BLE001 - cannot tell: the launch fails
            log.warning("ray_submit_unconfirmed", submission_id=submission_id, error=repr(failure), lookup=repr(exc))
            return None
        if made is not None:
            log.warning("ray_submit_answer_lost", submission_id=submission_id, job_id=spec.job_id,
                        epoch=spec.epoch, error=repr(failure))
        return made

    # ------------------------------------------------------------ following runs

    def track(self, submission_id: str, job_id: str, epoch: int, gang: tuple[int, float] | None = None,
              submitted_at: float = 0.0) -> _RayRun:
        """The followed run of ``submission_id`` (a new one when none is followed; a gang's
        of (tasks, start timeout) when ``gang`` says so)."""
        run = self._runs.get(submission_id)
        if run is None or (gang is not None and not isinstance(run, _RayGang)):
            was = self._runs.pop(submission_id, None)  # followed as a single task, to stop it
            run = self._handle(submission_id, job_id, epoch, gang, submitted_at)
            run.kill_requested = was is not None and was.kill_requested
            self.follow(run)
        return run

    def _handle(self, submission_id: str, job_id: str, epoch: int, gang: tuple[int, float] | None,
                submitted_at: float) -> _RayRun:
        if gang is None:
            return _RayRun(self, submission_id, job_id, epoch)
        return _RayGang(self, submission_id, job_id, epoch, gang[0], gang[1], submitted_at or time.time())

    def follow(self, run: _RayRun) -> None:
        """Have the poller follow ``run`` until it ends (starting the poller if needed)."""
        if run.ended.is_set():
            return
        if run.submission_id not in self._runs:
            run.since_poll = self.polls
            self._runs[run.submission_id] = run
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever(), name="ray-poller")

    async def _poll_forever(self) -> None:
        while self._runs:
            try:
                await self._poll_once()
            except Exception as exc:  # noqa: BLE001 - a head away: asked again next interval
                log.warning("ray_poll_failed", address=self.address, error=repr(exc))
            await asyncio.sleep(self.poll_interval_s)
        self._poller = None  # nothing left to follow: the next launch or adoption starts another

    async def _poll_once(self) -> None:
        """One ``list_jobs`` for every followed run: end those that ended or that the
        head forgot; ask again to stop those being killed."""
        self.polls += 1
        started = self.polls
        jobs = await self.call("list_jobs")
        listed = {job.submission_id: job for job in jobs if job.submission_id}
        now = time.time()
        asking = []
        for submission_id, run in list(self._runs.items()):
            job = listed.get(submission_id)
            if job is None:
                if run.since_poll < started:  # this answer would list it if the head knew it
                    del self._runs[submission_id]
                    run.end(forgotten=text.forgotten(submission_id))
                continue
            state = text.job_state(job)
            if state.terminal:
                del self._runs[submission_id]
                run.end(state)
            elif run.kill_requested:  # Ray ignores stop_job while a job is PENDING
                asking.append(self.stop(submission_id))
            elif isinstance(run, _RayGang) and not run.started.is_set():
                if run.start_overdue(now):
                    asking.append(run.give_up_start(state.status))
                elif state.status == "RUNNING":  # only its driver's log says when its tasks run
                    asking.append(run.look_for_start())
        if asking:
            await asyncio.gather(*asking)

    # ------------------------------------------------------------ runs left behind

    async def list_runs(self) -> list[LiveRun]:
        runs = []
        for job in await self.call("list_jobs"):
            owned = text.owned_run(job.submission_id, job.metadata, self.peer_id)
            if owned is not None and not text.job_state(job).terminal:
                runs.append(LiveRun(owned[0], owned[1], job.submission_id))
        return runs

    async def adopt(self, run: LiveRun) -> _RayRun | None:
        """Follow our Ray job of (job, epoch): found by ``run.handle`` (its submission id)
        or by its name; one that already ended gives its outcome at once. None when
        the head has no such job of ours."""
        submission_id = run.handle or text.submission_id(run.job_id, run.epoch)
        info = await self._job_info(submission_id)
        if not self._ours(info, submission_id, run.job_id, run.epoch):
            return None
        recorded = await asyncio.to_thread(_recorded_nonce, self.run_dir(run.job_id, run.epoch))
        if not text.submitted_by_us(info.metadata, recorded):
            log.warning("ray_job_not_adopted", submission_id=submission_id, job_id=run.job_id, epoch=run.epoch,
                        why="not submitted by this peer (no matching nonce in its run folder)")
            return None
        state = text.job_state(info)
        gang = text.gang_of(info.metadata)
        submitted_at = (getattr(info, "start_time", None) or 0) / 1000  # Ray's: epoch milliseconds
        if not state.terminal:
            return self.track(submission_id, run.job_id, run.epoch, gang, submitted_at)
        handle = self._runs.pop(submission_id, None)
        if handle is None or (gang is not None and not isinstance(handle, _RayGang)):
            handle = self._handle(submission_id, run.job_id, run.epoch, gang, submitted_at)
        handle.end(state)
        return handle

    def _ours(self, info: Any | None, submission_id: str, job_id: str, epoch: int) -> bool:
        """Whether the head's job ``info`` is our peer's run of (job, epoch)."""
        return info is not None and text.owned_run(submission_id, info.metadata, self.peer_id) == (job_id, epoch)

    async def kill_run(self, run: LiveRun) -> bool:
        submission_id = run.handle or text.submission_id(run.job_id, run.epoch)
        return await self._stop_ours(submission_id, run.job_id, run.epoch)

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        return await self._stop_ours(text.submission_id(job_id, epoch), job_id, epoch)

    async def _stop_ours(self, submission_id: str, job_id: str, epoch: int) -> bool:
        """Stop our Ray job of (job, epoch) if it has not ended; False when there is none
        (or it is not ours). Followed until it ends, so a pending one is stopped too."""
        info = await self._job_info(submission_id)
        if not self._ours(info, submission_id, job_id, epoch):
            return False
        if text.job_state(info).terminal:
            return False
        self.track(submission_id, job_id, epoch).kill_requested = True
        await self.stop(submission_id)
        return True

    # ------------------------------------------------------------ capacity

    async def discover(self) -> Discovered:
        """What the cluster has now and its alive nodes, from ``GET /api/cluster_status``
        and ``GET /api/v0/nodes`` (no driver needed); kept for launch's check that a
        request fits. One discovery at a time: a caller that gives up (the agent's
        discovery loop does, after two heartbeat intervals) leaves it to finish, and the
        next caller waits for that one instead of starting another (a silent head would
        otherwise take more threads every heartbeat)."""
        if self._discovery is None or self._discovery.done():
            self._discovery = asyncio.ensure_future(self._discover_once())
            self._discovery.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(self._discovery)

    async def _discover_once(self) -> Discovered:
        self.engine_calls["cluster_status"] += 1
        self.engine_calls["nodes"] += 1
        status, nodes = await asyncio.wait_for(
            self._in_thread(_cluster_payloads, self.address, self.call_timeout_s), timeout=self.call_timeout_s)
        self._report = cluster_report(status, nodes)
        return self._report.discovered

    async def close(self) -> None:
        """Stop the poller; the runs go on in Ray (a later agent run adopts them)."""
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        if self._discovery is not None:
            self._discovery.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)  # a call still hung ends by its own timeout
