"""The ``simulated`` backend: no process; duration and exit code come from job labels."""

from __future__ import annotations

import asyncio
import contextlib

from irisfed.services.peer_agent.backends import KILLED_EXIT_CODE, LaunchError, LiveRun, RunSpec


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
    discovers = False
    runs_outlive_agent = False

    def __init__(self, default_duration_s: float = 0.0) -> None:
        self.default_duration_s = default_duration_s

    async def launch(self, spec: RunSpec) -> _SimulatedRun:
        try:
            duration = float(spec.labels.get("sim.duration_s", self.default_duration_s))
            exit_code = int(spec.labels.get("sim.exit_code", 0))
        except ValueError as exc:
            raise LaunchError(f"bad simulation label: {exc}") from exc
        return _SimulatedRun(duration, exit_code)

    def log_dir(self, job_id: str, epoch: int) -> None:
        return None  # no output

    async def list_runs(self) -> list[LiveRun]:
        return []  # its runs live in the agent's memory and die with it

    async def adopt(self, run: LiveRun) -> None:
        return None

    async def kill_run(self, run: LiveRun) -> bool:
        return False

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        return False

    async def discover(self) -> None:
        return None  # advertises its configuration

    async def close(self) -> None:
        return None
