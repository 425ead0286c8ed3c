"""The ``subprocess`` backend: each job a real process group under the peer's work folder
(a gang: one per task, each on a configured node of its own).

It records every run it launches so that any later agent run on this peer finds it
again (see ``SubprocessBackend``); a recorded pid that now names another process is
never listed and never killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from irisfed.services.peer_agent.backends.contract import (
    KILLED_EXIT_CODE,
    OUTPUT_FOLDER,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    WORKSPACE_FOLDER,
    CommandNotStarted,
    LaunchError,
    LiveRun,
    RunLost,
    RunSpec,
    TaskStatus,
)
from irisfed.services.peer_agent.backends.devices import (
    RESOURCES_VARIABLE,
    parse_devices,
    resources_json,
)
from irisfed.services.peer_agent.backends.nodes import LocalNodes
from irisfed.shared.workspace import copy_tree

# What exec says of a command that cannot run as given: the job's own failure (§3.7).
COMMAND_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.EISDIR,
                            errno.ELOOP, errno.ENAMETOOLONG, errno.E2BIG})

_EXIT = re.compile(r"exit (-?\d+)")  # a run's ``exit`` file when its own end was seen

# Only these of the agent's own variables reach a job: the agent's environment
# holds database and NATS credentials that jobs must never see.
PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of process group ``pgid`` (nothing: nothing happens)."""
    if _process_group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parens
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def _processes():
    """(pid, state, process group, session) of every process /proc shows now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            yield int(entry.name), fields[0], int(fields[2]), int(fields[3])  # fields 1, 3, 5, 6 of proc(5)
        except (OSError, IndexError, ValueError):
            continue


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _environ_names(pid: int, job_id: str, epoch: int, task: int = -1) -> bool:
    """Whether process ``pid`` was started for this job and epoch (and task of a gang) by
    its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    if f"IRISFED_JOB_ID={job_id}".encode() not in environ or f"IRISFED_EPOCH={epoch}".encode() not in environ:
        return False
    return task < 0 or f"IRISFED_TASK_INDEX={task}".encode() in environ


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class _RunRecord:
    """What identifies a run's process across agent restarts (pid alone may be reused)."""

    job_id: str
    epoch: int
    pid: int = 0  # 0: marked just before the process was started
    start_ticks: int = 0  # /proc/<pid>/stat field 22
    boot_id: str = ""
    task: int = -1  # a gang's task index (-1: a single-task run)
    node: str = ""  # the configured node it runs on
    devices: dict[str, list[int]] = field(default_factory=dict)  # the indices it holds there (absent: none)

    @classmethod
    def parse(cls, text: str) -> _RunRecord:
        raw = json.loads(text)
        return cls(str(raw["job_id"]), int(raw["epoch"]), int(raw.get("pid", 0)),
                   int(raw.get("start_ticks", 0)), str(raw.get("boot_id", "")), int(raw.get("task", -1)),
                   str(raw.get("node", "")), parse_devices(raw.get("devices")))

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.epoch, self.task)

    def dump(self) -> str:
        return json.dumps(asdict(self)) + "\n"


class _ProcessRun:
    def __init__(self, process: asyncio.subprocess.Process, log_dir: Path,
                 backend: SubprocessBackend | None = None, record: _RunRecord | None = None,
                 node: str = "", holds_node: bool = False) -> None:
        self.process = process
        self.log_dir = str(log_dir)
        self.backend = backend
        self.record = record
        self.node = node
        self.holds_node = holds_node  # a single-task run: its node's room is given back when it ends
        self.term_at: float | None = None  # when SIGTERM was sent (once per run: docs/design.md §3.7)

    def _ended(self, exit_code: int) -> None:
        # The run is its process group: what its leader left running (a child in the
        # background) goes with it, before its room and devices are given back.
        _kill_group(self.process.pid)
        if self.backend is not None and self.record is not None:
            how = f"stopped with its agent (exit {exit_code})" if self.backend.stopping else f"exit {exit_code}"
            self.backend.mark_ended(self.record, how)
            if self.holds_node:
                self.backend.nodes.release((self.record.job_id, self.record.epoch))

    async def wait(self) -> int:
        code = await self.process.wait()
        self._ended(code)
        return code

    async def kill(self, grace_s: float) -> None:
        """SIGTERM once (a second stop of the same run waits out what is left of the first
        one's grace instead), then SIGKILL when the grace is over."""
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        now = asyncio.get_running_loop().time()
        if self.term_at is None:
            self.term_at = now
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), timeout=max(0.0, self.term_at + grace_s - now))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            await self.process.wait()
        self._ended(self.process.returncode)  # children that ignored SIGTERM go too


class _EndedRun:
    """A run that ended while no agent watched it, its exit code recorded (``adopt``)."""

    def __init__(self, exit_code: int, log_dir: str) -> None:
        self.exit_code, self.log_dir = exit_code, log_dir

    async def wait(self) -> int:
        return self.exit_code

    async def kill(self, grace_s: float) -> None:
        return None


class _GangRun:
    """A gang's run: its tasks, one process group each on a node of their own (shared
    fate: docs/design.md §3.4). ``wait`` waits for the nodes (``LocalNodes``; the start
    timeout, then ``RunLost``), starts every task, then returns 0 when all succeed, or
    the first non-zero exit after killing the others; a task that cannot start is the
    infrastructure's failure (``RunLost``: the gang is requeued whole)."""

    def __init__(self, backend: SubprocessBackend, spec: RunSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.log_dir = backend.log_dir(spec.job_id, spec.epoch)
        self.runs: list[_ProcessRun] = []
        self.nodes: list[str] = []
        self.states: list[str] = [TASK_PENDING] * spec.replicas
        self.codes: list[int | None] = [None] * spec.replicas
        self.started = asyncio.Event()  # every task started
        self.killed = False
        self._kill_requested = asyncio.Event()

    def tasks(self) -> list[TaskStatus]:
        return [TaskStatus(i, self.nodes[i] if i < len(self.nodes) else None, self.states[i], self.codes[i],
                           str(Path(self.log_dir) / f"task-{i}")) for i in range(self.spec.replicas)]

    async def wait(self) -> int:
        key = (self.spec.job_id, self.spec.epoch)
        try:
            if not await self._nodes_found():
                if self.killed:
                    return KILLED_EXIT_CODE
                raise RunLost(f"its {self.spec.replicas} tasks did not all start within "
                              f"{self.spec.start_timeout_s:g}s (no {self.spec.replicas} free nodes here)")
            # Every node is this host: task 0 may listen on a port free here now.
            coordinator = f"127.0.0.1:{_free_port()}"
            try:
                for index, node in enumerate(self.nodes):
                    self.runs.append(await self.backend.start_task(self.spec, index, node, coordinator))
                    self.states[index] = TASK_RUNNING
            except LaunchError as exc:
                await self._kill_all(0.0)
                failed = isinstance(exc, CommandNotStarted)  # the job's command: its own failure
                for index in range(self.spec.replicas):
                    self.states[index] = (TASK_KILLED if index < len(self.runs)
                                          else TASK_FAILED if failed and index == len(self.runs) else TASK_LOST)
                if failed:
                    raise CommandNotStarted(f"task {len(self.runs)}: {exc}") from exc
                raise RunLost(f"task {len(self.runs)} could not start: {exc}") from exc
            self.started.set()
            if self.killed:  # a kill that came while the tasks were starting
                await self._kill_all(self.spec.grace_s)
            return await self._one_fate()
        finally:
            self.backend.nodes.release(key)

    async def _nodes_found(self) -> bool:
        found = await self.backend.nodes.wait_for_gang(
            (self.spec.job_id, self.spec.epoch), self.spec.resources, self.spec.replicas, self.spec.group_by,
            self.spec.start_timeout_s, self._kill_requested)
        if found is None:
            return False
        self.nodes = found
        return True

    async def _one_fate(self) -> int:
        pending = {asyncio.ensure_future(run.wait()): i for i, run in enumerate(self.runs)}
        failed: int | None = None
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                code = future.result()
                self.codes[index] = code
                self.states[index] = (TASK_KILLED if self.killed or failed is not None and code < 0
                                      else TASK_SUCCEEDED if code == 0 else TASK_FAILED)
                if code != 0 and failed is None and not self.killed:
                    failed = code  # one fate: the others are stopped, with the job's grace
                    await self._kill_all(self.spec.grace_s, except_index=index)
        if self.killed:
            return KILLED_EXIT_CODE
        return failed if failed is not None else 0

    async def _kill_all(self, grace_s: float, except_index: int | None = None) -> None:
        await asyncio.gather(*(run.kill(grace_s) for i, run in enumerate(self.runs) if i != except_index))

    async def kill(self, grace_s: float) -> None:
        self.killed = True
        self._kill_requested.set()
        await self._kill_all(grace_s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _open_outputs(run_dir: Path, workspace: Path | None):
    """The run's folder: its logs, its output directory and (with a workspace) a fresh
    copy of the workspace to start in; the log files, opened; and the run's cwd."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OUTPUT_FOLDER).mkdir(exist_ok=True)
    cwd = run_dir
    if workspace is not None:
        cwd = run_dir / WORKSPACE_FOLDER
        if os.path.lexists(cwd):  # a copy an earlier start of this run left half made
            shutil.rmtree(cwd)
        copy_tree(workspace, cwd)
    return open(run_dir / "stdout", "wb"), open(run_dir / "stderr", "wb"), cwd  # noqa: SIM115


class SubprocessBackend:
    """Runs each job as a real process group under ``work_root/<job_id>/epoch-<n>`` (a
    gang: one per task, under ``task-<i>`` there, on nodes of ``nodes``).

    What it records, so that any later agent run on this peer finds its runs:

    - ``<job>/epoch-<n>/run.json`` (a task's: ``task-<i>/run.json``): the process's
      pid, its start time (field 22 of ``/proc/<pid>/stat``) and the boot id — a pid
      that now names another process (reuse, reboot) never matches, so it is never
      killed;
    - ``pid`` beside it (the pid alone, for people and tools) and, once the run is
      seen to end, ``exit`` (how it ended);
    - ``.live/<job>.epoch-<n>.json`` (a task's: ``.epoch-<n>.task-<i>.json``): the index
      of processes not yet seen to end, written just before each starts and removed
      when it ends. ``list_runs`` reads only this index (one small file per live
      process), never the whole work tree; a gang is one run however many tasks live.
    """

    kind = "subprocess"
    discovers = False
    runs_outlive_agent = False
    INDEX = ".live"

    def __init__(self, work_root: Path, nodes: LocalNodes | None = None) -> None:
        self.work_root = work_root
        self.index = work_root / self.INDEX
        self.boot_id = _boot_id()
        self.nodes = nodes if nodes is not None else LocalNodes((), {})
        self.stopping = False  # its agent is stopping: the runs it stops record no outcome of their own
        # Processes this backend object started and has not yet seen end (pid 0: starting).
        self._active: dict[tuple[str, int, int], _RunRecord] = {}
        # Whether the live index was read since this object was made: until then a run an
        # earlier agent left may hold device indices that ``nodes`` does not know of.
        self._scanned = False

    def run_dir(self, job_id: str, epoch: int, task: int = -1) -> Path:
        base = self.work_root / job_id / f"epoch-{epoch}"
        return base if task < 0 else base / f"task-{task}"

    def log_dir(self, job_id: str, epoch: int) -> str:
        return str(self.run_dir(job_id, epoch).resolve())

    def output_dirs(self, job_id: str, epoch: int, tasks: int) -> list[tuple[int, Path]]:
        """Each task's ``IRISFED_OUTPUT_DIR`` of a run (task 0 for a single-task job)."""
        if tasks <= 1:
            return [(0, self.run_dir(job_id, epoch) / OUTPUT_FOLDER)]
        return [(i, self.run_dir(job_id, epoch, i) / OUTPUT_FOLDER) for i in range(tasks)]

    def node_groups(self) -> list[dict]:
        return self.nodes.groups()

    def _marker(self, job_id: str, epoch: int, task: int = -1) -> Path:
        suffix = "" if task < 0 else f".task-{task}"
        return self.index / f"{job_id}.epoch-{epoch}{suffix}.json"

    def _markers(self, job_id: str, epoch: int) -> list[Path]:
        """The live-index files of (job, epoch): its process, or each of its tasks'."""
        return [self._marker(job_id, epoch), *sorted(self.index.glob(f"{job_id}.epoch-{epoch}.task-*.json"))]

    def _mark_live(self, record: _RunRecord) -> None:
        self.index.mkdir(parents=True, exist_ok=True)
        _write_atomic(self._marker(record.job_id, record.epoch, record.task), record.dump())

    def _record_started(self, run_dir: Path, record: _RunRecord) -> None:
        _write_atomic(run_dir / "run.json", record.dump())
        (run_dir / "pid").write_text(str(record.pid))
        self._mark_live(record)

    def mark_ended(self, record: _RunRecord, how: str) -> None:
        """The process is over: say how in its folder and drop it from the live index."""
        self._active.pop(record.key, None)
        with contextlib.suppress(OSError):
            run_dir = self.run_dir(record.job_id, record.epoch, record.task)
            if run_dir.is_dir():
                _write_atomic(run_dir / "exit", how + "\n")
        with contextlib.suppress(FileNotFoundError):
            self._marker(record.job_id, record.epoch, record.task).unlink()

    async def launch(self, spec: RunSpec) -> _ProcessRun | _GangRun:
        if not self._scanned:
            await self.list_runs()  # devices that runs left by an earlier agent still hold
        if spec.replicas > 1:
            return _GangRun(self, spec)
        key = (spec.job_id, spec.epoch)
        node = self.nodes.place_one(key, spec.resources)
        try:
            missing = self.nodes.missing_devices(key)
            if missing:  # placed on a view a heartbeat old: never bound to a held device
                raise LaunchError("no node here has that many devices free now ("
                                  + ", ".join(f"{n} more {name}" for name, n in sorted(missing.items()))
                                  + " than are free on the roomiest); handed back to be placed again")
            devices, device_vars = self.nodes.binding(key)
            run = await self._start(spec, -1, {"IRISFED_NODE": node, **device_vars}, node, devices)
        except BaseException:
            self.nodes.release((spec.job_id, spec.epoch))
            raise
        run.node, run.holds_node = node, True
        return run

    async def start_task(self, spec: RunSpec, index: int, node: str, coordinator: str) -> _ProcessRun:
        """Start task ``index`` of a gang on ``node`` (its environment: docs/design.md §3.4)."""
        devices, device_vars = self.nodes.binding((spec.job_id, spec.epoch), index)
        run = await self._start(spec, index, {
            "IRISFED_TASK_INDEX": str(index), "IRISFED_NUM_TASKS": str(spec.replicas),
            "IRISFED_COORDINATOR": coordinator, "IRISFED_NODE": node, **device_vars}, node, devices)
        run.node = node
        return run

    async def _start(self, spec: RunSpec, task: int, extra_env: dict[str, str], node: str = "",
                     devices: dict[str, list[int]] | None = None) -> _ProcessRun:
        run_dir = self.run_dir(spec.job_id, spec.epoch, task)
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(spec.env)
        env.update({"IRISFED_JOB_ID": spec.job_id, "IRISFED_EPOCH": str(spec.epoch),
                    "IRISFED_OUTPUT_DIR": str((run_dir / OUTPUT_FOLDER).resolve())})
        env[RESOURCES_VARIABLE] = resources_json(spec.resources)
        env.update(extra_env)  # after the job's own: its device variables cannot be overridden
        record = _RunRecord(spec.job_id, spec.epoch, boot_id=self.boot_id, task=task, node=node,
                            devices=dict(devices or {}))
        self._active[record.key] = record
        spawning = False
        try:
            out, err, cwd = await asyncio.to_thread(_open_outputs, run_dir, spec.workspace)
            try:
                # Marked live before it exists: an agent killed right after the start
                # still leaves a trace its next run follows (by the run's environment).
                await asyncio.to_thread(self._mark_live, record)
                spawning = True
                process = await asyncio.create_subprocess_exec(
                    *spec.command, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True,
                )
            finally:
                out.close()
                err.close()
        except OSError as exc:
            self._active.pop(record.key, None)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._marker(spec.job_id, spec.epoch, task).unlink)
            # The command itself (not found, not executable): the job's failure, not ours.
            error = CommandNotStarted if spawning and exc.errno in COMMAND_ERRNOS else LaunchError
            raise error(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        try:
            stat = _proc_stat(process.pid)  # our unreaped child: readable even if it ended
            record = replace(record, pid=process.pid, start_ticks=stat[1] if stat else 0)
            self._active[record.key] = record
            written = asyncio.ensure_future(asyncio.to_thread(self._record_started, run_dir, record))
            await asyncio.shield(written)
        except OSError as exc:
            # A run we cannot find again could outlive us unseen: never leave it running.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            self.mark_ended(record, "killed: its record could not be written")
            raise LaunchError(f"cannot record the run of {spec.command[0]!r}: {exc.strerror or exc}") from exc
        except asyncio.CancelledError:
            # Our caller went away (its agent stopping) before the run was handed over:
            # nobody would ever stop it. It goes as its agent's other runs go, and its
            # next start hands the job back (no exit code recorded).
            _kill_group(process.pid)
            try:
                with contextlib.suppress(Exception):
                    await written  # the record's files, so that its end is written after them
            finally:  # even when cancelled again meanwhile
                self.mark_ended(record, "stopped with its agent before it was handed over")
            raise
        return _ProcessRun(process, run_dir, self, record)

    # ------------------------------------------------------------ runs left behind

    async def list_runs(self) -> list[LiveRun]:
        live, alive = await asyncio.to_thread(self._list_runs)
        # Back on the event loop (``nodes`` is never touched from a thread): the devices of
        # processes earlier agents left are held exactly while they are seen alive.
        self.nodes.leftovers_alive([(record.key, record.node, record.devices) for record in alive])
        self._scanned = True
        return live

    async def adopt(self, run: LiveRun) -> _EndedRun | None:
        """A single-task run that ended, its exit code written in its folder before its
        agent died, has that outcome (reported as if watched: never run again). Any other
        is never adopted: a process another agent run started is not our child, so its
        exit code cannot be learned; the agent kills it (every task of a gang) and hands
        the job back. A run an agent stopped because it was itself stopping wrote no
        exit code (``stopping``): it is handed back too."""
        code = await asyncio.to_thread(self._recorded_exit, run.job_id, run.epoch)
        return None if code is None else _EndedRun(code, self.log_dir(run.job_id, run.epoch))

    def _recorded_exit(self, job_id: str, epoch: int) -> int | None:
        if self._marker(job_id, epoch).exists():
            return None  # not seen to end
        try:
            match = _EXIT.fullmatch((self.run_dir(job_id, epoch) / "exit").read_text().strip())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    async def kill_run(self, run: LiveRun) -> bool:
        killed = await asyncio.to_thread(self._kill_recorded, run.job_id, run.epoch)
        self.nodes.release_leftovers(run.job_id, run.epoch)
        return killed

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        killed = await asyncio.to_thread(self._kill_leftover, job_id, epoch)
        self.nodes.release_leftovers(job_id, epoch)
        return killed

    async def discover(self) -> None:
        return None  # advertises its configuration (--resource, --attr, --node)

    async def close(self) -> None:
        return None

    def _kill_leftover(self, job_id: str, epoch: int) -> bool:
        """Kill the process groups a previous agent run left behind for this job, if any."""
        if any(marker.exists() for marker in self._markers(job_id, epoch)):
            return self._kill_recorded(job_id, epoch)
        # A run started before runs were recorded: only its pid file, checked by environment.
        try:
            pid = int((self.run_dir(job_id, epoch) / "pid").read_text())
        except (OSError, ValueError):
            return False
        # The pid may have been reused: only kill it if it really is this job's run.
        if not _environ_names(pid, job_id, epoch):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return True

    def _list_runs(self) -> tuple[list[LiveRun], list[_RunRecord]]:
        """The live runs, and the records of those an earlier agent started that live."""
        self._index_unrecorded_runs_once()
        live: dict[tuple[str, int], LiveRun] = {}
        alive: list[_RunRecord] = []
        try:
            markers = sorted(self.index.glob("*.json"))
        except OSError:
            return [], []
        for marker in markers:
            try:
                record = _RunRecord.parse(marker.read_text())
            except FileNotFoundError:
                continue  # ended meanwhile
            except (OSError, ValueError, KeyError, TypeError):
                marker.unlink(missing_ok=True)  # not ours to read (never written half: atomic)
                continue
            active = self._active.get(record.key)
            if active is not None:  # launched by this object: alive until its wait says otherwise
                if active.pid:
                    live.setdefault((record.job_id, record.epoch), LiveRun(active.job_id, active.epoch,
                                                                           str(active.pid)))
                continue
            pid = self._alive_pid(record)
            if pid is None:
                self._ended_unwatched(record)
                continue
            live.setdefault((record.job_id, record.epoch), LiveRun(record.job_id, record.epoch, str(pid)))
            alive.append(record)
        return list(live.values()), alive

    def _alive_pid(self, record: _RunRecord) -> int | None:
        """The pid of the recorded process if it still runs, else None."""
        if record.boot_id and self.boot_id and record.boot_id != self.boot_id:
            return None  # the machine restarted since: every process of that boot is gone
        if record.pid == 0:
            # The agent died between marking the run and learning its pid.
            pid = self._find_by_environment(record.job_id, record.epoch, record.task)
            if pid is None:
                return None
            stat = _proc_stat(pid)
            if stat is None:
                return None
            with contextlib.suppress(OSError):
                self._mark_live(replace(record, pid=pid, start_ticks=stat[1], boot_id=self.boot_id))
            return pid
        stat = _proc_stat(record.pid)
        if stat is None or stat[0] in ("Z", "X"):
            return None
        if stat[1] != record.start_ticks:
            return None  # the pid now names another process: not ours, never killed
        return record.pid

    def _ended_unwatched(self, record: _RunRecord) -> None:
        """A run whose leader ended while no agent watched it: what it left running in its
        process group (a child in the background, holding its devices) goes too, as it
        would have had an agent seen the end."""
        left = False
        if record.pid and (not record.boot_id or record.boot_id == self.boot_id):
            left = any(self._group_members_of(record))
            if left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(record.pid, signal.SIGKILL)
        self.mark_ended(record, "ended while no agent watched it" + ("; what it left running was killed" if left
                                                                      else ""))

    @staticmethod
    def _group_members_of(record: _RunRecord):
        """Live processes of the run's process group started for its job and epoch."""
        for pid, state, group, _session in _processes():
            if group == record.pid and state not in ("Z", "X") and \
                    _environ_names(pid, record.job_id, record.epoch, record.task):
                yield pid

    @staticmethod
    def _find_by_environment(job_id: str, epoch: int, task: int = -1) -> int | None:
        """A session leader started for (job, epoch, task); scans /proc (only after a rare crash)."""
        return next((pid for pid, _state, _group, session in _processes()
                     if session == pid and _environ_names(pid, job_id, epoch, task)), None)

    def _kill_recorded(self, job_id: str, epoch: int) -> bool:
        """Kill every recorded process of (job, epoch) — each task of a gang — still alive."""
        killed = False
        for marker in self._markers(job_id, epoch):
            try:
                record = _RunRecord.parse(marker.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            pid = self._alive_pid(record)  # checked again right before the signal
            if pid is None:
                self._ended_unwatched(record)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.mark_ended(record, "killed: left behind by an earlier agent run")
            killed = True
        return killed

    def _index_unrecorded_runs_once(self) -> None:
        """Runs started by an agent that predates the live index: found once per work root."""
        done = self.index / ".indexed"
        if done.exists():
            return
        self.index.mkdir(parents=True, exist_ok=True)
        for pid_file in self.work_root.glob("*/epoch-*/pid"):
            run_dir = pid_file.parent
            if (run_dir / "run.json").exists() or (run_dir / "exit").exists():
                continue
            try:
                job_id, epoch = run_dir.parent.name, int(run_dir.name.removeprefix("epoch-"))
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            stat = _proc_stat(pid)
            if stat is None or stat[0] in ("Z", "X") or not _environ_names(pid, job_id, epoch):
                continue
            with contextlib.suppress(OSError):
                self._mark_live(_RunRecord(job_id, epoch, pid, stat[1], self.boot_id))
        done.write_text("")

