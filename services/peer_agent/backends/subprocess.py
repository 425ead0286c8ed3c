"""The ``subprocess`` backend: each job a real process group under the peer's work folder.

It records every run it launches so that any later agent run on this peer finds it
again (see ``SubprocessBackend``); a recorded pid that now names another process is
never listed and never killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from irisfed.services.peer_agent.backends import LaunchError, LiveRun, RunSpec

# Only these of the agent's own variables reach a job: the agent's environment
# holds database and NATS credentials that jobs must never see.
PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")


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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _environ_names(pid: int, job_id: str, epoch: int) -> bool:
    """Whether process ``pid`` was started for this job and epoch (by its environment)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"IRISFED_JOB_ID={job_id}".encode() in environ and f"IRISFED_EPOCH={epoch}".encode() in environ


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

    @classmethod
    def parse(cls, text: str) -> _RunRecord:
        raw = json.loads(text)
        return cls(str(raw["job_id"]), int(raw["epoch"]), int(raw.get("pid", 0)),
                   int(raw.get("start_ticks", 0)), str(raw.get("boot_id", "")))

    def dump(self) -> str:
        return json.dumps(asdict(self)) + "\n"


class _ProcessRun:
    def __init__(self, process: asyncio.subprocess.Process, log_dir: Path,
                 backend: SubprocessBackend | None = None, record: _RunRecord | None = None) -> None:
        self.process = process
        self.log_dir = str(log_dir)
        self.backend = backend
        self.record = record

    def _ended(self, exit_code: int) -> None:
        if self.backend is not None and self.record is not None:
            self.backend.mark_ended(self.record, f"exit {exit_code}")

    async def wait(self) -> int:
        code = await self.process.wait()
        self._ended(code)
        return code

    async def kill(self, grace_s: float) -> None:
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), timeout=grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            await self.process.wait()
        # Children that ignored SIGTERM may outlive the leader.
        if _process_group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        self._ended(self.process.returncode)


def _open_outputs(run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    return open(run_dir / "stdout", "wb"), open(run_dir / "stderr", "wb")  # noqa: SIM115


class SubprocessBackend:
    """Runs each job as a real process group under ``work_root/<job_id>/epoch-<n>``.

    What it records, so that any later agent run on this peer finds its runs:

    - ``<job>/epoch-<n>/run.json``: the process's pid, its start time (field 22
      of ``/proc/<pid>/stat``) and the boot id — a pid that now names another
      process (reuse, reboot) never matches, so it is never killed;
    - ``<job>/epoch-<n>/pid`` (the pid alone, for people and tools) and, once the
      run is seen to end, ``exit`` (how it ended);
    - ``.live/<job>.epoch-<n>.json``: the index of runs not yet seen to end, written
      just before the process starts and removed when it ends. ``list_runs`` reads
      only this index (one small file per live run), never the whole work tree.
    """

    kind = "subprocess"
    discovers = False
    runs_outlive_agent = False
    INDEX = ".live"

    def __init__(self, work_root: Path) -> None:
        self.work_root = work_root
        self.index = work_root / self.INDEX
        self.boot_id = _boot_id()
        # Runs this backend object launched and has not yet seen end (pid 0: starting).
        self._active: dict[tuple[str, int], _RunRecord] = {}

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.work_root / job_id / f"epoch-{epoch}"

    def log_dir(self, job_id: str, epoch: int) -> str:
        return str(self.run_dir(job_id, epoch).resolve())

    def _marker(self, job_id: str, epoch: int) -> Path:
        return self.index / f"{job_id}.epoch-{epoch}.json"

    def _mark_live(self, record: _RunRecord) -> None:
        self.index.mkdir(parents=True, exist_ok=True)
        _write_atomic(self._marker(record.job_id, record.epoch), record.dump())

    def _record_started(self, run_dir: Path, record: _RunRecord) -> None:
        _write_atomic(run_dir / "run.json", record.dump())
        (run_dir / "pid").write_text(str(record.pid))
        self._mark_live(record)

    def mark_ended(self, record: _RunRecord, how: str) -> None:
        """The run is over: say how in its folder and drop it from the live index."""
        self._active.pop((record.job_id, record.epoch), None)
        with contextlib.suppress(OSError):
            run_dir = self.run_dir(record.job_id, record.epoch)
            if run_dir.is_dir():
                _write_atomic(run_dir / "exit", how + "\n")
        with contextlib.suppress(FileNotFoundError):
            self._marker(record.job_id, record.epoch).unlink()

    async def launch(self, spec: RunSpec) -> _ProcessRun:
        run_dir = self.run_dir(spec.job_id, spec.epoch)
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(spec.env)
        env.update({"IRISFED_JOB_ID": spec.job_id, "IRISFED_EPOCH": str(spec.epoch)})
        record = _RunRecord(spec.job_id, spec.epoch, boot_id=self.boot_id)
        key = (spec.job_id, spec.epoch)
        self._active[key] = record
        try:
            out, err = await asyncio.to_thread(_open_outputs, run_dir)
            try:
                # Marked live before it exists: an agent killed right after the start
                # still leaves a trace its next run follows (by the run's environment).
                await asyncio.to_thread(self._mark_live, record)
                process = await asyncio.create_subprocess_exec(
                    *spec.command, cwd=run_dir, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True,
                )
            finally:
                out.close()
                err.close()
        except OSError as exc:
            self._active.pop(key, None)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._marker(spec.job_id, spec.epoch).unlink)
            raise LaunchError(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        try:
            stat = _proc_stat(process.pid)  # our unreaped child: readable even if it ended
            record = replace(record, pid=process.pid, start_ticks=stat[1] if stat else 0)
            self._active[key] = record
            await asyncio.to_thread(self._record_started, run_dir, record)
        except OSError as exc:
            # A run we cannot find again could outlive us unseen: never leave it running.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            self.mark_ended(record, "killed: its record could not be written")
            raise LaunchError(f"cannot record the run of {spec.command[0]!r}: {exc.strerror or exc}") from exc
        return _ProcessRun(process, run_dir, self, record)

    # ------------------------------------------------------------ runs left behind

    async def list_runs(self) -> list[LiveRun]:
        return await asyncio.to_thread(self._list_runs)

    async def adopt(self, run: LiveRun) -> None:
        """Never: a process another agent run started is not our child, so its exit
        code cannot be learned; the agent kills it and hands the job back."""
        return None

    async def kill_run(self, run: LiveRun) -> bool:
        return await asyncio.to_thread(self._kill_recorded, run.job_id, run.epoch)

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        return await asyncio.to_thread(self._kill_leftover, job_id, epoch)

    async def discover(self) -> None:
        return None  # advertises its configuration (--resource, --attr)

    async def close(self) -> None:
        return None

    def _kill_leftover(self, job_id: str, epoch: int) -> bool:
        """Kill a process group a previous agent run left behind for this job, if any."""
        if self._marker(job_id, epoch).exists():
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

    def _list_runs(self) -> list[LiveRun]:
        self._index_unrecorded_runs_once()
        live = []
        try:
            markers = sorted(self.index.glob("*.json"))
        except OSError:
            return []
        for marker in markers:
            try:
                record = _RunRecord.parse(marker.read_text())
            except FileNotFoundError:
                continue  # ended meanwhile
            except (OSError, ValueError, KeyError, TypeError):
                marker.unlink(missing_ok=True)  # not ours to read (never written half: atomic)
                continue
            active = self._active.get((record.job_id, record.epoch))
            if active is not None:  # launched by this object: alive until its wait says otherwise
                if active.pid:
                    live.append(LiveRun(active.job_id, active.epoch, str(active.pid)))
                continue
            pid = self._alive_pid(record)
            if pid is None:
                self.mark_ended(record, "ended while no agent watched it")
                continue
            live.append(LiveRun(record.job_id, record.epoch, str(pid)))
        return live

    def _alive_pid(self, record: _RunRecord) -> int | None:
        """The pid of the recorded run's process if it still runs, else None."""
        if record.boot_id and self.boot_id and record.boot_id != self.boot_id:
            return None  # the machine restarted since: every process of that boot is gone
        if record.pid == 0:
            # The agent died between marking the run and learning its pid.
            pid = self._find_by_environment(record.job_id, record.epoch)
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

    @staticmethod
    def _find_by_environment(job_id: str, epoch: int) -> int | None:
        """A session leader started for (job, epoch); scans /proc (only after a rare crash)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                session = int(fields[3])  # field 6
            except (OSError, IndexError, ValueError):
                continue
            if session == pid and _environ_names(pid, job_id, epoch):
                return pid
        return None

    def _kill_recorded(self, job_id: str, epoch: int) -> bool:
        try:
            record = _RunRecord.parse(self._marker(job_id, epoch).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return False
        pid = self._alive_pid(record)  # checked again right before the signal
        if pid is None:
            self.mark_ended(record, "ended while no agent watched it")
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        self.mark_ended(record, "killed: left behind by an earlier agent run")
        return True

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
