"""The ``slurm`` backend: each run a Slurm batch job, through ``sbatch``, ``squeue``,
``scontrol`` and ``scancel`` (on PATH; the cluster is the one ``SLURM_CONF`` in the
agent's environment names, or the host's).

How a run maps to Slurm (formats and parsing in ``slurm_text.py``, ``slurm_nodes.py``
and ``slurm_script.py``; the handle on a run and its run folder in ``slurm_run.py``):

- the job ``irisfed-<job_id>-e<epoch>`` with comment ``irisfed:<peer_id>``: the
  name finds a run again after an agent restart (``list_runs``, ``adopt``,
  idempotent ``launch``, and a failed ``sbatch`` that created the job all the same),
  the comment keeps peers sharing a cluster apart; only the agent's own Unix user's
  jobs are ever listed (``squeue --me``), so other users cannot pass for our runs;
- a batch script in the run's folder ``work_root/<job_id>/epoch-<n>`` (also the
  job's working directory, with its ``stdout`` and ``stderr``: the folder must be
  reachable from the compute nodes) that marks the run started, exports the job's
  environment, runs its command and records its exit code, every value
  single-quoted: nothing is ever interpreted by a shell. Slurm's commands run with
  ``client_env`` (``PASSED_THROUGH_ENV`` and
  Slurm's own settings), which ``--export=ALL`` hands to the job: the agent's own
  variables (database and NATS credentials) never reach a job;
- resources as ``-c`` (whole cpus), ``--mem`` (``DEFAULT_MEMORY_MB_PER_CPU`` per
  cpu when the job names no memory) and ``--gres``;
- a time limit as ``--time``, a backstop a little past the agent's own stop
  (``slurm_script.time_limit_args``); a stop (``kill``) as SIGTERM alone to the job's
  processes (``scancel --signal=TERM``: ``slurm_script.term_commands``), then a plain
  ``scancel`` when the job has not ended ``grace_s`` later (docs/design.md §3.7).

Status: one background task asks ``squeue --me -t all`` once per poll interval
about every run it follows, however many there are (``squeue``'s ``exit_code``
field holds the wait status, so no per-job ``scontrol`` call is needed), and
settles each run that ended (``slurm_text.outcome``).

Slurm forgets a finished job ``MinJobAge`` seconds after it ends (300 by default;
no ``sacct`` is assumed), so an agent down longer than that, or a run missing from
``MISSES_BEFORE_LOST`` polls, is settled from its run folder instead
(``slurm_text.forgotten_outcome``): the exit code its batch script recorded; a run
that started but recorded none fails (``RunOutcomeUnknown``: it may have done its
work, and is never run again); only a run that never started is lost (retried).
``engine_calls`` counts the commands run, ``polls`` the polls.

Capacity (``discover``): one ``scontrol show node -o -d`` call, kept to the nodes
whose ``Partitions`` name the partition (so nodes added to it later count without
a restart): totals, attributes, and each node's resources and features as node
groups (``slurm_nodes.node_groups``); the nodes are kept to refuse, before ``sbatch``,
a job no single node could ever hold, or a gang no set of nodes could.

Gangs (``RunSpec.replicas`` > 1): one batch job of N nodes, one task each
(``slurm_script.gang_args``; ``group_by`` KEY as ``--constraint=[KEY:v1|KEY:v2...]``,
Slurm's "matching OR": all nodes share one of the values), whose script runs the
tasks as one ``srun --kill-on-bad-exit=1`` step, each through a wrapper that records
its node and exit code in ``task-<i>/`` of the run folder. The handle's ``started``
is set once Slurm runs the job; a gang Slurm still has pending past its start
timeout (persisted in the run folder, so an adopted gang keeps it) is cancelled and
lost. Its outcome and ``tasks()`` come from the task folders when it ends
(``slurm_text.gang_outcome``, ``gang_tasks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from irisfed.services.common.log import EventLogger
from irisfed.services.peer_agent.backends.contract import (
    DEFAULT_POLL_INTERVAL_S,
    KILLED_EXIT_CODE,
    OUTPUT_FOLDER,
    WORKSPACE_FOLDER,
    Discovered,
    LaunchError,
    LiveRun,
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
)
from irisfed.services.peer_agent.backends.devices import RESOURCES_VARIABLE, resources_json
from irisfed.services.peer_agent.backends.slurm_nodes import (
    Node,
    capacity,
    gang_misfit,
    misfit,
    node_groups,
    parse_nodes,
)
from irisfed.services.peer_agent.backends.slurm_run import (
    _Followed,
    _fresh_copy,
    _gang_of,
    _result,
    _SlurmRun,
    _task_view,
    read_gang_file,
    read_task_records,
    run_evidence,
)
from irisfed.services.peer_agent.backends.slurm_script import (
    GANG_FILE,
    TASK_SCRIPT,
    GangFile,
    ScriptError,
    batch_script,
    gang_args,
    gang_batch_script,
    gang_file_text,
    group_constraint,
    output_path,
    resource_args,
    slurm_request,
    task_script,
    term_commands,
    time_limit_args,
)
from irisfed.services.peer_agent.backends.slurm_text import (
    SQUEUE_FORMAT,
    Outcome,
    SlurmJob,
    TaskRecord,
    choose_run,
    comment_for,
    default_partition,
    gang_outcome,
    job_name,
    outcome,
    parse_scontrol_line,
    parse_scontrol_lines,
    parse_squeue,
    sbatch_job_id,
)
from irisfed.services.peer_agent.backends.subprocess import PASSED_THROUGH_ENV
from irisfed.shared.resources import CPU

log = EventLogger("peer-agent")

# Memory asked per cpu for a job that names no memory_mb: without --mem a job gets
# the cluster's DefMemPerCPU, and on clusters without one it takes a whole node's
# memory (and so the whole node).
DEFAULT_MEMORY_MB_PER_CPU = 1024
# The longest a Slurm command may take before it counts as hung (Slurm's own RPC
# timeout, MessageTimeout, is 10 s by default, retried).
COMMAND_TIMEOUT_S = 30.0
# Polls in a row that must miss a run before it counts as forgotten by Slurm.
MISSES_BEFORE_LOST = 2
# The longest ``scancel --signal`` may take before the run is cancelled outright: Slurm
# signals only running jobs, and ``scancel`` retries one in a transitional state (pending,
# configuring, completing) for ~95 s (Slurm 22.05, measured) before it gives up.
SIGNAL_TIMEOUT_S = 10.0


# Slurm's own settings (SLURM_CONF, SBATCH_ACCOUNT ...) the clients read from their
# environment; with PASSED_THROUGH_ENV, all of the agent's environment they get.
SLURM_SETTINGS_PREFIXES = ("SLURM_", "SBATCH_", "SQUEUE_", "SCANCEL_", "SCONTROL_", "SINFO_")


def client_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment Slurm's commands run with: ``PASSED_THROUGH_ENV`` and Slurm's own
    settings, never the agent's credentials. ``sbatch --export=ALL`` hands it to the job
    (plus what the job's script exports): faster than ``--export=NONE``, which makes
    Slurm 22.05 rebuild the submitting user's login environment (~1 s per job)."""
    return {name: value for name, value in environ.items()
            if name in PASSED_THROUGH_ENV or name.startswith(SLURM_SETTINGS_PREFIXES)}


class SlurmError(Exception):
    """A Slurm command failed or did not answer; the message says which and why."""

class SlurmBackend:
    """Runs each (job, epoch) as one Slurm batch job in ``partition`` (default: the
    cluster's default partition, resolved once and then named with ``-p`` like a
    configured one), with output under ``work_root``."""

    kind = "slurm"
    discovers = True
    runs_outlive_agent = True

    def __init__(self, work_root: Path, peer_id: str, partition: str = "",
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 command_timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.work_root = work_root
        self.comment = comment_for(peer_id)
        self.partition = partition
        self.poll_interval_s = poll_interval_s
        self.command_timeout_s = command_timeout_s
        self.engine_calls: Counter[str] = Counter()  # command name → times run
        self.polls = 0  # polls that got an answer, one squeue call each
        self._followed: dict[str, _Followed] = {}  # Slurm job id → what is followed of it
        self._poller: asyncio.Task[None] | None = None
        self._poll_failing = False
        self._launch_lock = asyncio.Lock()
        self._partition_name: str | None = None  # resolved once
        self._shapes: list[dict[str, float]] | None = None  # each node's resources, at the last discover
        self._nodes: list[Node] = []  # the partition's nodes, at the last discover

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.work_root / job_id / f"epoch-{epoch}"

    def log_dir(self, job_id: str, epoch: int) -> str:
        return str(self.run_dir(job_id, epoch).resolve())

    # ------------------------------------------------------------ commands

    async def _run(self, *args: str, timeout_s: float | None = None) -> str:
        """Run one Slurm command; its stdout. SlurmError when it fails or hangs (takes more
        than ``timeout_s``, default ``command_timeout_s``)."""
        timeout_s = self.command_timeout_s if timeout_s is None else timeout_s
        self.engine_calls[args[0]] += 1
        try:
            process = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=client_env(os.environ))
        except OSError as exc:
            raise SlurmError(f"cannot run {args[0]}: {exc.strerror or exc}") from exc
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:  # never leave a command behind
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            if isinstance(exc, TimeoutError):
                raise SlurmError(f"{args[0]} did not answer within {timeout_s:g} s") from None
            raise
        if process.returncode != 0:
            what = " ".join(arg for arg in args[:3] if not arg.startswith("-"))  # "sbatch", "scancel 12"
            why = " ".join((err or out).decode(errors="replace").split()) or "no message"
            raise SlurmError(f"{what} exited {process.returncode}: {why}")
        return out.decode(errors="replace")

    async def _jobs(self, name: str = "") -> list[SlurmJob]:
        """Our runs Slurm still knows (live or recently ended), all or those named ``name``."""
        args = ["squeue", "--me", "-h", "-t", "all", "-O", SQUEUE_FORMAT]
        return parse_squeue(await self._run(*args, *(["-n", name] if name else [])), self.comment)

    async def scancel(self, slurm_id: str) -> None:
        await self._run("scancel", slurm_id)

    async def terminate(self, slurm_id: str, gang: bool) -> bool:
        """SIGTERM alone to a running job's processes (``slurm_script.term_commands``, in
        order, stopping at the first Slurm refuses); whether the first was sent. Slurm
        refuses a job that ended, retries one still pending or completing (each call is
        cut at ``SIGNAL_TIMEOUT_S``), or may not answer: the caller then cancels it
        outright."""
        sent = False
        for command in term_commands(slurm_id, gang):
            try:
                await self._run(*command, timeout_s=min(SIGNAL_TIMEOUT_S, self.command_timeout_s))
            except SlurmError as exc:
                log.debug("slurm_signal_not_sent", slurm_job=slurm_id, error=str(exc))
                break
            sent = True
        return sent

    async def _partition(self) -> str:
        """The partition runs go to: the one configured (checked to exist), else the default."""
        if self._partition_name is None:
            partitions = parse_scontrol_lines(await self._run(
                "scontrol", "show", "partition", "-o", *([self.partition] if self.partition else [])))
            name = self.partition or default_partition(partitions)
            if not name or not any(p.get("PartitionName") == name for p in partitions):
                raise SlurmError(f"Slurm has no partition {self.partition}" if self.partition
                                 else "Slurm has no default partition (set the backend's partition)")
            self._partition_name = name
        return self._partition_name

    # ------------------------------------------------------------ launching

    async def launch(self, spec: RunSpec) -> _SlurmRun:
        name = job_name(spec.job_id, spec.epoch)
        async with self._launch_lock:  # the check for an existing run and the submission: never interleaved
            try:
                existing = [job for job in await self._jobs(name) if job.live]
                if existing:
                    gang = await asyncio.to_thread(read_gang_file, self.run_dir(spec.job_id, spec.epoch))
                    return self.follow(choose_run(existing).slurm_id, spec.job_id, spec.epoch,
                                       gang or _gang_of(spec))
                request = slurm_request(spec.resources, DEFAULT_MEMORY_MB_PER_CPU)
                partition = await self._check_fits(request, spec)
                shape = resource_args(request) if spec.replicas <= 1 else gang_args(
                    spec.replicas, request, self._constraint(spec.group_by))
                gang = _gang_of(spec)
                script = await asyncio.to_thread(self._write_script, spec, gang)
                try:
                    stdout = await self._run(
                        "sbatch", "--parsable", "-J", name, f"--comment={self.comment}", "-p", partition,
                        "-D", str(script.parent), "-o", output_path(str(script.parent / "stdout")),
                        "-e", output_path(str(script.parent / "stderr")), "--export=ALL",
                        # irisfed retries elsewhere; Slurm's own requeue (after a node failure,
                        # JobRequeue=1 by default) would run the command again in the same folder.
                        "--no-requeue",
                        # The agent enforces the time limit; Slurm's is a backstop, a little later.
                        *time_limit_args(spec.time_limit_s, spec.grace_s),
                        *shape, str(script))
                except SlurmError as exc:
                    # sbatch may fail (or time out) after slurmctld took the job ("Socket
                    # timed out on send/recv"): that job is this run, started or not. Failing
                    # the launch would hand the job back and run its command twice.
                    made = await self._submitted_anyway(name, exc)
                    if made is None:
                        raise
                    log.warning("slurm_submit_answer_lost", job_id=spec.job_id, epoch=spec.epoch,
                                slurm_job=made.slurm_id, error=str(exc))
                    return self.follow(made.slurm_id, spec.job_id, spec.epoch, gang)
                slurm_id = sbatch_job_id(stdout)
            except (SlurmError, ScriptError, ValueError) as exc:
                raise LaunchError(str(exc)) from exc
            except OSError as exc:
                raise LaunchError(f"cannot write the batch script of {name}: {exc.strerror or exc}") from exc
        log.debug("slurm_job_submitted", job_id=spec.job_id, epoch=spec.epoch, slurm_job=slurm_id,
                  partition=partition, tasks=spec.replicas)
        return self.follow(slurm_id, spec.job_id, spec.epoch, gang)

    async def _submitted_anyway(self, name: str, failure: SlurmError) -> SlurmJob | None:
        """The job a failed ``sbatch`` of ``name`` created all the same, if Slurm lists one
        (none was live before it ran: ``launch`` checked); None when it lists none or cannot
        be asked (then the leftover scan cancels any that shows up later)."""
        try:
            made = choose_run(await self._jobs(name))
            return made if made is not None and await self._ran(made) else None
        except SlurmError as exc:
            log.warning("slurm_submit_unconfirmed", slurm_job_name=name, error=str(failure), lookup=str(exc))
            return None

    async def _ran(self, job: SlurmJob) -> bool:
        """Whether a listed job is a run (live, or ended after it started) and not a
        submission Slurm refused: it keeps those as FAILED with Reason=BadConstraints."""
        if job.live:
            return True
        fields = parse_scontrol_line(await self._run("scontrol", "show", "job", "-o", job.slurm_id))
        return fields.get("Reason") != "BadConstraints"

    async def _check_fits(self, request: dict[str, int], spec: RunSpec) -> str:
        """The partition's name, once sure one of its nodes can hold ``request`` (a gang:
        that ``spec.replicas`` of them can, sharing a ``spec.group_by`` value)."""
        if self._shapes is None:
            await self.discover()
        partition = await self._partition()
        why = misfit(request, self._shapes or [], partition)
        if not why and spec.replicas > 1:
            why = gang_misfit(request, spec.replicas, spec.group_by, self._nodes, partition)
        if why:
            raise LaunchError(why)
        return partition

    def _constraint(self, group_by: str) -> str:
        """``--constraint`` for a gang's ``group_by`` over the partition's features ("":
        none asked; ``gang_misfit`` refused a key no node has)."""
        return (group_constraint(group_by, self._nodes) or "") if group_by else ""

    def output_dirs(self, job_id: str, epoch: int, tasks: int) -> list[tuple[int, Path]]:
        """Each task's ``IRISFED_OUTPUT_DIR`` (on the cluster's shared filesystem, which the
        agent reads like its work dir)."""
        base = self.run_dir(job_id, epoch)
        if tasks <= 1:
            return [(0, base / OUTPUT_FOLDER)]
        return [(i, base / f"task-{i}" / OUTPUT_FOLDER) for i in range(tasks)]

    def _write_script(self, spec: RunSpec, gang: GangFile | None = None) -> Path:
        """The run folder's batch script (a gang's: also its task wrapper and ``GANG_FILE``),
        and the folders the run starts with: its outputs folder and, with a workspace, a
        fresh copy of it (each task's own, for a gang) on the cluster's shared filesystem."""
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(spec.env)
        env.update({"IRISFED_JOB_ID": spec.job_id, "IRISFED_EPOCH": str(spec.epoch),
                    RESOURCES_VARIABLE: resources_json(spec.resources)})  # devices: --gres, bound by Slurm
        run_dir = self.run_dir(spec.job_id, spec.epoch).resolve()
        if gang is None:
            env["IRISFED_OUTPUT_DIR"] = str(run_dir / OUTPUT_FOLDER)
            workdir = str(run_dir / WORKSPACE_FOLDER) if spec.workspace is not None else ""
            text = batch_script(spec.command, env, str(run_dir), workdir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / OUTPUT_FOLDER).mkdir(exist_ok=True)
            if spec.workspace is not None:
                _fresh_copy(spec.workspace, run_dir / WORKSPACE_FOLDER)
        else:
            cpus = slurm_request(spec.resources, DEFAULT_MEMORY_MB_PER_CPU)[CPU]
            text = gang_batch_script(str(run_dir), gang.replicas, cpus)
            wrapper = task_script(spec.command, env, str(run_dir), workspace=spec.workspace is not None)
            run_dir.mkdir(parents=True, exist_ok=True)
            if spec.workspace is not None:
                for index in range(gang.replicas):
                    _fresh_copy(spec.workspace, run_dir / f"task-{index}" / WORKSPACE_FOLDER)
            (run_dir / TASK_SCRIPT).write_text(wrapper)
            (run_dir / GANG_FILE).write_text(gang_file_text(gang))
        script = run_dir / "job.sh"
        script.write_text(text)
        script.chmod(0o700)
        return script

    # ------------------------------------------------------------ following runs

    def follow(self, slurm_id: str, job_id: str, epoch: int, gang: GangFile | None = None) -> _SlurmRun:
        """A handle on Slurm job ``slurm_id`` as (job, epoch)'s run, settled by the poller;
        a gang's (``gang``) is cancelled and lost when Slurm has not started it by
        ``gang.start_by`` (Unix time)."""
        followed = self._followed.get(slurm_id)
        if followed is None:
            followed = _Followed(asyncio.get_running_loop().create_future(), self.run_dir(job_id, epoch),
                                 self.log_dir(job_id, epoch))
            if gang is not None and gang.replicas > 1:
                followed.replicas = gang.replicas
                # Persisted as a Unix time (it outlives the agent); followed on the loop's clock.
                followed.start_by = asyncio.get_running_loop().time() + (gang.start_by - time.time())
                followed.start_timeout_s = gang.start_timeout_s
            self._followed[slurm_id] = followed
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_forever(), name="slurm-poller")
        return _SlurmRun(self, slurm_id, followed)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            if not self._followed:
                continue
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - the next poll asks again
                if not self._poll_failing:  # once per outage, not once per interval
                    log.warning("slurm_poll_failed", error=str(exc))
                self._poll_failing = True
            else:
                if self._poll_failing:
                    log.info("slurm_poll_recovered")
                self._poll_failing = False

    async def poll(self) -> None:
        """One squeue call; settle every followed run it shows ended, or no longer shows
        (from its run folder, read in a thread); cancel every gang it shows still
        pending past its start timeout."""
        asked = list(self._followed)  # runs followed before the call: Slurm knew them then
        jobs = {job.slurm_id: job for job in await self._jobs()}
        self.polls += 1
        now = asyncio.get_running_loop().time()
        ended: list[tuple[str, Outcome, bool]] = []
        forgotten, overdue = [], []
        for slurm_id in asked:
            followed = self._followed.get(slurm_id)
            if followed is None:
                continue  # settled meanwhile
            job = jobs.get(slurm_id)
            if job is None:
                followed.misses += 1
                if followed.misses >= MISSES_BEFORE_LOST:
                    forgotten.append(slurm_id)
                continue
            followed.misses = 0
            followed.saw(job)
            result = outcome(job.state, job.wait_status, slurm_id, KILLED_EXIT_CODE)
            if result is not None:
                ended.append((slurm_id, result, job.state == "CANCELLED"))
            elif followed.overdue(job, now):
                overdue.append(job)
        for slurm_id, result, cancelled in ended:
            await self._end(slurm_id, result, cancelled)
        for slurm_id in forgotten:
            followed = self._followed.get(slurm_id)
            if followed is None:
                continue  # settled meanwhile
            try:
                result = await asyncio.to_thread(run_evidence, slurm_id, followed.run_dir)
            except OSError as exc:  # cannot tell how it ended: the next poll reads again
                log.warning("slurm_run_folder_unreadable", slurm_job=slurm_id, run_dir=str(followed.run_dir),
                            error=str(exc))
                continue
            log.warning("slurm_job_forgotten", slurm_job=slurm_id, run_dir=str(followed.run_dir),
                        exit_code=result.exit_code, why=result.unknown or result.lost)
            await self._end(slurm_id, result, False)
        for job in overdue:
            await self._cancel_unstarted(job)

    async def _cancel_unstarted(self, job: SlurmJob) -> None:
        """Cancel a gang Slurm has not started within its start timeout: it ends lost (the
        agent requeues it whole). A failed scancel is tried again at the next poll."""
        followed = self._followed.get(job.slurm_id)
        if followed is None:
            return
        followed.timed_out = (f"its {followed.replicas} tasks did not all start within "
                              f"{followed.start_timeout_s:g}s: Slurm job {job.slurm_id} was still {job.state}"
                              + (f" ({job.reason})" if job.reason and job.reason != "None" else "")
                              + ", cancelled")
        try:
            await self.scancel(job.slurm_id)
        except SlurmError as exc:
            followed.timed_out = ""
            log.warning("slurm_gang_cancel_failed", slurm_job=job.slurm_id, error=str(exc))
            return
        log.warning("slurm_gang_start_timeout", job_id=job.job_id, epoch=job.epoch, slurm_job=job.slurm_id,
                    why=followed.timed_out)

    async def _end(self, slurm_id: str, ended: Outcome, cancelled: bool) -> None:
        """Settle a run that ended as ``ended`` (``cancelled``: Slurm says CANCELLED): a
        gang's outcome and tasks from its task folders (read in a thread; unreadable: the
        job's outcome alone), a gang cancelled for its start timeout as lost."""
        followed = self._followed.get(slurm_id)
        if followed is None:
            return
        records: tuple[TaskRecord, ...] = ()
        if followed.replicas > 1:
            try:
                records = await asyncio.to_thread(read_task_records, followed.run_dir, followed.replicas)
            except OSError as exc:
                log.warning("slurm_task_folders_unreadable", slurm_job=slurm_id, run_dir=str(followed.run_dir),
                            error=str(exc))
            if followed.timed_out and cancelled:
                ended = Outcome(None, followed.timed_out)
            else:
                ended = gang_outcome(ended, cancelled, records, slurm_id)
            if records and all(record.started is not None for record in records):
                followed.started.set()  # every task ran (perhaps between two polls)
        followed.tasks = _task_view(followed, ended, records)
        self._settle(slurm_id, _result(ended))

    def _settle(self, slurm_id: str, result: int | RunLost | RunOutcomeUnknown) -> None:
        followed = self._followed.pop(slurm_id, None)
        if followed is None or followed.done.done():
            return
        if isinstance(result, Exception):
            followed.done.set_exception(result)
        else:
            followed.done.set_result(result)

    # ------------------------------------------------------------ runs left behind

    async def list_runs(self) -> list[LiveRun]:
        return [LiveRun(job.job_id, job.epoch, job.slurm_id) for job in await self._jobs() if job.live]

    async def adopt(self, run: LiveRun) -> _SlurmRun | None:
        """Follow (job, epoch)'s Slurm job, live or ended while no agent watched (then its
        outcome comes with the next poll); a gang as a gang (its run folder's
        ``GANG_FILE``: its tasks and the start timeout it was launched with). When
        Slurm knows no such job of ours (it may have forgotten it), the run folder says
        how it ended: a handle already settled with the recorded exit code, or with
        ``RunOutcomeUnknown`` when it started and recorded none. None when the folder
        shows it never started, or Slurm lists only a submission it refused (an agent
        killed before it handed the job back)."""
        chosen = choose_run(await self._jobs(job_name(run.job_id, run.epoch)), run.handle)
        if chosen is None:
            return await self._from_folder(run.job_id, run.epoch)
        if not await self._ran(chosen):
            return None  # a refused submission is no run: the job is handed back and retried
        gang = await asyncio.to_thread(read_gang_file, self.run_dir(run.job_id, run.epoch))
        handle = self.follow(chosen.slurm_id, run.job_id, run.epoch, gang)
        handle.followed.saw(chosen)  # before the first poll: a kill right away knows whether it runs
        return handle

    async def _from_folder(self, job_id: str, epoch: int) -> _SlurmRun | None:
        """A handle settled from (job, epoch)'s run folder; None when it never started.
        An unreadable folder raises (OSError): the agent asks again at its next reconcile."""
        run_dir = self.run_dir(job_id, epoch)
        ended = await asyncio.to_thread(run_evidence, "", run_dir)
        if ended.lost:
            return None
        followed = _Followed(asyncio.get_running_loop().create_future(), run_dir, self.log_dir(job_id, epoch))
        gang = await asyncio.to_thread(read_gang_file, run_dir)
        records: tuple[TaskRecord, ...] = ()
        if gang is not None and gang.replicas > 1:
            followed.replicas = gang.replicas
            records = await asyncio.to_thread(read_task_records, run_dir, gang.replicas)
            ended = gang_outcome(ended, False, records, "")
        followed.tasks = _task_view(followed, ended, records)
        result = _result(ended)
        if isinstance(result, Exception):
            followed.done.set_exception(result)
        else:
            followed.done.set_result(result)
        log.warning("slurm_job_forgotten", job_id=job_id, epoch=epoch, run_dir=str(run_dir),
                    exit_code=ended.exit_code, why=ended.unknown or ended.lost)
        return _SlurmRun(self, "", followed)

    async def kill_run(self, run: LiveRun) -> bool:
        live = [job for job in await self._jobs(job_name(run.job_id, run.epoch))
                if job.live and (job.slurm_id == run.handle or not run.handle)]
        for job in live:
            await self.scancel(job.slurm_id)
        return bool(live)

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        return await self.kill_run(LiveRun(job_id, epoch, ""))

    # ------------------------------------------------------------ capacity

    async def discover(self) -> Discovered:
        """The partition's nodes (one ``scontrol show node`` call): each resource's total
        and free amount, ``device_type`` and ``device_variant``, and the nodes themselves
        as node groups (their features as attributes; identical nodes counted together)."""
        partition = await self._partition()
        nodes = [node for node in parse_nodes(await self._run("scontrol", "show", "node", "-o", "-d"))
                 if partition in node.partitions]
        found = capacity(nodes)
        self._shapes, self._nodes = found.shapes, nodes
        return Discovered(found.attributes(), found.resources, node_groups(nodes))

    async def close(self) -> None:
        """Stop polling; the runs go on in Slurm (a next agent run adopts them)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
