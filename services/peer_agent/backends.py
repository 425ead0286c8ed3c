"""Where a peer agent runs jobs, behind one small interface.

- ``subprocess``: really runs the command in a per-job working directory,
  stdout/stderr to files, in its own process group (cancel kills the group).
- ``simulated``: no process; finishes after ``sim.duration_s`` (a job label,
  default 0) with ``sim.exit_code`` (default 0). For demos and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# Only these of the agent's own variables reach a job: the agent's environment
# holds database and NATS credentials that jobs must never see.
PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
KILLED_EXIT_CODE = -int(signal.SIGTERM)


class LaunchError(Exception):
    """The backend could not start the job (an infrastructure failure, retried)."""


@dataclass(frozen=True)
class RunSpec:
    job_id: str
    epoch: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class RunHandle(Protocol):
    log_dir: str | None

    async def wait(self) -> int: ...

    async def kill(self, grace_s: float) -> None: ...


class Backend(Protocol):
    kind: str

    async def launch(self, spec: RunSpec) -> RunHandle: ...


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _ProcessRun:
    def __init__(self, process: asyncio.subprocess.Process, log_dir: Path) -> None:
        self.process = process
        self.log_dir = str(log_dir)

    async def wait(self) -> int:
        return await self.process.wait()

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


def _open_outputs(run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    return open(run_dir / "stdout", "wb"), open(run_dir / "stderr", "wb")  # noqa: SIM115


class SubprocessBackend:
    """Runs each job as a real process group under ``work_root/<job_id>/epoch-<n>``."""

    kind = "subprocess"

    def __init__(self, work_root: Path) -> None:
        self.work_root = work_root

    def run_dir(self, job_id: str, epoch: int) -> Path:
        return self.work_root / job_id / f"epoch-{epoch}"

    async def launch(self, spec: RunSpec) -> _ProcessRun:
        run_dir = self.run_dir(spec.job_id, spec.epoch)
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(spec.env)
        env.update({"IRISFED_JOB_ID": spec.job_id, "IRISFED_EPOCH": str(spec.epoch)})
        try:
            out, err = await asyncio.to_thread(_open_outputs, run_dir)
            try:
                process = await asyncio.create_subprocess_exec(
                    *spec.command, cwd=run_dir, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True,
                )
            finally:
                out.close()
                err.close()
            await asyncio.to_thread((run_dir / "pid").write_text, str(process.pid))
        except OSError as exc:
            raise LaunchError(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        return _ProcessRun(process, run_dir)

    def kill_leftover(self, job_id: str, epoch: int) -> bool:
        """Kill a process group a previous agent run left behind for this job, if any."""
        pid_file = self.run_dir(job_id, epoch) / "pid"
        try:
            pid = int(pid_file.read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError):
            return False
        # The pid may have been reused: only kill it if it really is this job's run.
        if f"IRISFED_JOB_ID={job_id}\0".encode() not in environ + b"\0":
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return True


class _SimulatedRun:
    log_dir = None

    def __init__(self, duration_s: float, exit_code: int) -> None:
        self.exit_code = exit_code
        self.done = asyncio.Event()
        self.duration_s = duration_s

    async def wait(self) -> int:
        if self.duration_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), timeout=self.duration_s)
        return self.exit_code

    async def kill(self, grace_s: float) -> None:
        self.exit_code = KILLED_EXIT_CODE
        self.done.set()


class SimulatedBackend:
    """Pretends to run jobs: duration and exit code come from the job's labels."""

    kind = "simulated"

    def __init__(self, default_duration_s: float = 0.0) -> None:
        self.default_duration_s = default_duration_s

    async def launch(self, spec: RunSpec) -> _SimulatedRun:
        try:
            duration = float(spec.labels.get("sim.duration_s", self.default_duration_s))
            exit_code = int(spec.labels.get("sim.exit_code", 0))
        except ValueError as exc:
            raise LaunchError(f"bad simulation label: {exc}") from exc
        return _SimulatedRun(duration, exit_code)

    def kill_leftover(self, job_id: str, epoch: int) -> bool:
        return False
