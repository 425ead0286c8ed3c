"""Where a peer agent runs jobs, behind one small interface (``Backend``).

- ``subprocess`` (``backends/subprocess.py``): really runs the command in a per-job
  working directory, stdout/stderr to files, in its own process group (cancel
  kills the group).
- ``simulated`` (``backends/simulated.py``): no process; finishes after
  ``sim.duration_s`` (a job label, default 0) with ``sim.exit_code`` (default 0).
  For demos and benchmarks.

Every backend can list the runs it launched that are still alive, including
those of an earlier agent run on this peer (``list_runs``), and kill one of them
(``kill_run``): runs may outlive a crashed agent, and a restarted agent must stop
any that the federation has since taken away from it (fencing, invariant 3).
A new kind of backend (a batch system, a cluster engine) implements ``Backend``
and is added to ``make_backend``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

KILLED_EXIT_CODE = -int(signal.SIGTERM)


class LaunchError(Exception):
    """The backend could not start the job (an infrastructure failure, retried)."""


@dataclass(frozen=True)
class RunSpec:
    """What to run: the job's command, environment and labels, under one epoch."""

    job_id: str
    epoch: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class RunHandle(Protocol):
    """One launched run: wait for its exit code, or kill it."""

    log_dir: str | None

    async def wait(self) -> int: ...

    async def kill(self, grace_s: float) -> None: ...


@dataclass(frozen=True)
class LiveRun:
    """A run this backend launched that is still alive (perhaps from an earlier agent run)."""

    job_id: str
    epoch: int
    handle: str  # the backend's own reference: a process group id here; a Slurm/Ray job id there


class Backend(Protocol):
    """A place to run jobs, and to find (and stop) the runs it launched earlier."""

    kind: str

    async def launch(self, spec: RunSpec) -> RunHandle: ...

    def log_dir(self, job_id: str, epoch: int) -> str | None:
        """Where (job, epoch)'s output will be, recorded with its acceptance (None: nowhere)."""
        ...

    async def list_runs(self) -> list[LiveRun]:
        """Every run this backend launched on this peer that is still alive, whoever launched it."""
        ...

    async def kill_run(self, run: LiveRun) -> bool:
        """Kill a run ``list_runs`` returned; False when it is gone (or no longer ours)."""
        ...

    def kill_leftover(self, job_id: str, epoch: int) -> bool:
        """Kill the run of (job, epoch) an earlier agent run left behind, if there is one."""
        ...


def make_backend(kind: str, work_root: Path, simulated_duration_s: float = 0.0) -> Backend:
    """The backend of ``kind``: ``simulated``, or ``subprocess`` (under ``work_root``)."""
    if kind == "simulated":
        return SimulatedBackend(simulated_duration_s)
    return SubprocessBackend(work_root)


from services.peer_agent.backends.simulated import SimulatedBackend  # noqa: E402 - they implement the above
from services.peer_agent.backends.subprocess import PASSED_THROUGH_ENV, SubprocessBackend  # noqa: E402

__all__ = ["KILLED_EXIT_CODE", "PASSED_THROUGH_ENV", "Backend", "LaunchError", "LiveRun", "RunHandle", "RunSpec",
           "SimulatedBackend", "SubprocessBackend", "make_backend"]
