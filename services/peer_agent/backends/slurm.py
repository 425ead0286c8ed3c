"""The ``slurm`` backend: each run a Slurm batch job, through ``sbatch``, ``squeue``,
``scontrol`` and ``scancel`` (on PATH; the cluster is the one ``SLURM_CONF`` in the
agent's environment names, or the host's).

How a run maps to Slurm (formats and parsing in ``slurm_text.py``):

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
  cpu when the job names no memory) and ``--gres``.

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
a restart); each node's shape is kept to refuse, before ``sbatch``, a job no single
node could ever hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from irisfed.services.common.log import EventLogger
from irisfed.services.peer_agent.backends import (
    DEFAULT_POLL_INTERVAL_S,
    KILLED_EXIT_CODE,
    Discovered,
    LaunchError,
    LiveRun,
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
)
from irisfed.services.peer_agent.backends.slurm_text import (
    EXIT_STATUS_FILE,
    SQUEUE_FORMAT,
    STARTED_MARKER,
    Outcome,
    ScriptError,
    SlurmJob,
    batch_script,
    capacity,
    choose_run,
    comment_for,
    default_partition,
    forgotten_outcome,
    job_name,
    misfit,
    outcome,
    output_path,
    parse_nodes,
    parse_scontrol_line,
    parse_scontrol_lines,
    parse_squeue,
    resource_args,
    sbatch_job_id,
    slurm_request,
)
from irisfed.services.peer_agent.backends.subprocess import PASSED_THROUGH_ENV

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


# The most of a marker file read: an exit code or a job id fits many times over.
MARKER_MAX_BYTES = 64


def read_marker(path: Path) -> str | None:
    """The text of a marker the batch script wrote (its first ``MARKER_MAX_BYTES``);
    None when there is none; ``""`` when something else is there (a symlink, a FIFO,
    a folder: the job's own doing), which still shows the run started. Never follows
    a symlink nor blocks. Other OSErrors (folder unreadable, file system away)
    propagate: the caller cannot tell, and asks again later."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        if os.path.lexists(path):
            return ""
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MARKER_MAX_BYTES).decode(errors="replace")
    finally:
        os.close(fd)


def run_evidence(slurm_id: str, run_dir: Path) -> Outcome:
    """How a run Slurm forgot ended, from its run folder (file I/O: call it in a thread)."""
    run_dir = run_dir.resolve()
    return forgotten_outcome(slurm_id, read_marker(run_dir / STARTED_MARKER),
                             read_marker(run_dir / EXIT_STATUS_FILE), str(run_dir))


def _result(ended: Outcome) -> int | RunLost | RunOutcomeUnknown:
    if ended.exit_code is not None:
        return ended.exit_code
    return RunOutcomeUnknown(ended.unknown) if ended.unknown else RunLost(ended.lost)


class _SlurmRun:
    """A Slurm job this backend follows: ``wait`` resolves when a poll sees it end."""

    def __init__(self, backend: SlurmBackend, slurm_id: str, log_dir: str,
                 done: asyncio.Future[int]) -> None:
        self.backend = backend
        self.slurm_id = slurm_id
        self.log_dir = log_dir
        self.done = done

    async def wait(self) -> int:
        return await asyncio.shield(self.done)  # a cancelled waiter leaves the run followed

    async def kill(self, grace_s: float) -> None:
        """``scancel`` (SIGTERM, then SIGKILL after the cluster's KillWait, not ``grace_s``);
        returns once a poll sees the job end. Nothing to do for a run that has ended."""
        if not self.done.done():
            await self.backend.scancel(self.slurm_id)
        await asyncio.wait({self.done})


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
        self._followed: dict[str, asyncio.Future[int]] = {}  # Slurm job id → its outcome
        self._run_dirs: dict[str, Path] = {}  # Slurm job id → its run folder (read once Slurm forgets it)
        self._misses: Counter[str] = Counter()
        self._poller: asyncio.Task[None] | None = None
        self._poll_failing = False
        self._launch_lock = asyncio.Lock()
        self._partition_name: str | None = None  # resolved once
        self._shapes: list[dict[str, float]] | None = None  # each node's resources, at the last discover

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.work_root / job_id / f"epoch-{epoch}"

    def log_dir(self, job_id: str, epoch: int) -> str:
        return str(self.run_dir(job_id, epoch).resolve())

    # ------------------------------------------------------------ commands

    async def _run(self, *args: str) -> str:
        """Run one Slurm command; its stdout. SlurmError when it fails or hangs."""
        self.engine_calls[args[0]] += 1
        try:
            process = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=client_env(os.environ))
        except OSError as exc:
            raise SlurmError(f"cannot run {args[0]}: {exc.strerror or exc}") from exc
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout=self.command_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:  # never leave a command behind
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            if isinstance(exc, TimeoutError):
                raise SlurmError(f"{args[0]} did not answer within {self.command_timeout_s:g} s") from None
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
                    return self.follow(choose_run(existing).slurm_id, spec.job_id, spec.epoch)
                request = slurm_request(spec.resources, DEFAULT_MEMORY_MB_PER_CPU)
                partition = await self._check_fits(request)
                script = await asyncio.to_thread(self._write_script, spec)
                try:
                    stdout = await self._run(
                        "sbatch", "--parsable", "-J", name, f"--comment={self.comment}", "-p", partition,
                        "-D", str(script.parent), "-o", output_path(str(script.parent / "stdout")),
                        "-e", output_path(str(script.parent / "stderr")), "--export=ALL",
                        # irisfed retries elsewhere; Slurm's own requeue (after a node failure,
                        # JobRequeue=1 by default) would run the command again in the same folder.
                        "--no-requeue",
                        *resource_args(request), str(script))
                except SlurmError as exc:
                    # sbatch may fail (or time out) after slurmctld took the job ("Socket
                    # timed out on send/recv"): that job is this run, started or not. Failing
                    # the launch would hand the job back and run its command twice.
                    made = await self._submitted_anyway(name, exc)
                    if made is None:
                        raise
                    log.warning("slurm_submit_answer_lost", job_id=spec.job_id, epoch=spec.epoch,
                                slurm_job=made.slurm_id, error=str(exc))
                    return self.follow(made.slurm_id, spec.job_id, spec.epoch)
                slurm_id = sbatch_job_id(stdout)
            except (SlurmError, ScriptError, ValueError) as exc:
                raise LaunchError(str(exc)) from exc
            except OSError as exc:
                raise LaunchError(f"cannot write the batch script of {name}: {exc.strerror or exc}") from exc
        log.debug("slurm_job_submitted", job_id=spec.job_id, epoch=spec.epoch, slurm_job=slurm_id,
                  partition=partition)
        return self.follow(slurm_id, spec.job_id, spec.epoch)

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

    async def _check_fits(self, request: dict[str, int]) -> str:
        """The partition's name, once sure one of its nodes can hold ``request``."""
        if self._shapes is None:
            await self.discover()
        partition = await self._partition()
        why = misfit(request, self._shapes or [], partition)
        if why:
            raise LaunchError(why)
        return partition

    def _write_script(self, spec: RunSpec) -> Path:
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(spec.env)
        env.update({"IRISFED_JOB_ID": spec.job_id, "IRISFED_EPOCH": str(spec.epoch)})
        run_dir = self.run_dir(spec.job_id, spec.epoch).resolve()
        text = batch_script(spec.command, env, str(run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        script = run_dir / "job.sh"
        script.write_text(text)
        script.chmod(0o700)
        return script

    # ------------------------------------------------------------ following runs

    def follow(self, slurm_id: str, job_id: str, epoch: int) -> _SlurmRun:
        """A handle on Slurm job ``slurm_id`` as (job, epoch)'s run, settled by the poller."""
        done = self._followed.get(slurm_id)
        if done is None:
            done = asyncio.get_running_loop().create_future()
            self._followed[slurm_id] = done
            self._run_dirs[slurm_id] = self.run_dir(job_id, epoch)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_forever(), name="slurm-poller")
        return _SlurmRun(self, slurm_id, self.log_dir(job_id, epoch), done)

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
        (from its run folder, read in a thread)."""
        asked = list(self._followed)  # runs followed before the call: Slurm knew them then
        jobs = {job.slurm_id: job for job in await self._jobs()}
        self.polls += 1
        forgotten = []
        for slurm_id in asked:
            job = jobs.get(slurm_id)
            if job is None:
                self._misses[slurm_id] += 1
                if self._misses[slurm_id] >= MISSES_BEFORE_LOST:
                    forgotten.append(slurm_id)
                continue
            self._misses.pop(slurm_id, None)
            ended = outcome(job.state, job.wait_status, slurm_id, KILLED_EXIT_CODE)
            if ended is not None:
                self._settle(slurm_id, _result(ended))
        for slurm_id in forgotten:
            run_dir = self._run_dirs.get(slurm_id)
            if run_dir is None:
                continue  # settled meanwhile
            try:
                ended = await asyncio.to_thread(run_evidence, slurm_id, run_dir)
            except OSError as exc:  # cannot tell how it ended: the next poll reads again
                log.warning("slurm_run_folder_unreadable", slurm_job=slurm_id, run_dir=str(run_dir),
                            error=str(exc))
                continue
            log.warning("slurm_job_forgotten", slurm_job=slurm_id, run_dir=str(run_dir),
                        exit_code=ended.exit_code, why=ended.unknown or ended.lost)
            self._settle(slurm_id, _result(ended))

    def _settle(self, slurm_id: str, result: int | RunLost | RunOutcomeUnknown) -> None:
        done = self._followed.pop(slurm_id, None)
        self._misses.pop(slurm_id, None)
        self._run_dirs.pop(slurm_id, None)
        if done is None or done.done():
            return
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)

    # ------------------------------------------------------------ runs left behind

    async def list_runs(self) -> list[LiveRun]:
        return [LiveRun(job.job_id, job.epoch, job.slurm_id) for job in await self._jobs() if job.live]

    async def adopt(self, run: LiveRun) -> _SlurmRun | None:
        """Follow (job, epoch)'s Slurm job, live or ended while no agent watched (then its
        outcome comes with the next poll). When Slurm knows no such job of ours (it may
        have forgotten it), the run folder says how it ended: a handle already settled
        with the recorded exit code, or with ``RunOutcomeUnknown`` when it started and
        recorded none. None when the folder shows it never started, or Slurm lists only
        a submission it refused (an agent killed before it handed the job back)."""
        chosen = choose_run(await self._jobs(job_name(run.job_id, run.epoch)), run.handle)
        if chosen is None:
            return await self._from_folder(run.job_id, run.epoch)
        if not await self._ran(chosen):
            return None  # a refused submission is no run: the job is handed back and retried
        return self.follow(chosen.slurm_id, run.job_id, run.epoch)

    async def _from_folder(self, job_id: str, epoch: int) -> _SlurmRun | None:
        """A handle settled from (job, epoch)'s run folder; None when it never started.
        An unreadable folder raises (OSError): the agent asks again at its next reconcile."""
        run_dir = self.run_dir(job_id, epoch)
        ended = await asyncio.to_thread(run_evidence, "", run_dir)
        if ended.lost:
            return None
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        result = _result(ended)
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)
        log.warning("slurm_job_forgotten", job_id=job_id, epoch=epoch, run_dir=str(run_dir),
                    exit_code=ended.exit_code, why=ended.unknown)
        return _SlurmRun(self, "", self.log_dir(job_id, epoch), done)

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
        and free amount, ``device_type`` and ``device_variant``."""
        partition = await self._partition()
        nodes = [node for node in parse_nodes(await self._run("scontrol", "show", "node", "-o", "-d"))
                 if partition in node.partitions]
        found = capacity(nodes)
        self._shapes = found.shapes
        return Discovered(found.attributes(), found.resources)

    async def close(self) -> None:
        """Stop polling; the runs go on in Slurm (a next agent run adopts them)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
