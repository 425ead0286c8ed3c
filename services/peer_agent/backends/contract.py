"""What every backend implements and returns (``Backend``, ``RunHandle``, ``RunSpec``,
task states, errors): the contract, apart from the backends themselves, so each of them
imports it without importing the package that lists them (``backends/__init__.py``)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from irisfed.shared.messages import DEFAULT_GRACE_S

KILLED_EXIT_CODE = -int(signal.SIGTERM)
# How often a real engine's backend asks it about all its runs (one call each time).
DEFAULT_POLL_INTERVAL_S = 1.0


class LaunchError(Exception):
    """The backend could not start the job (an infrastructure failure, retried)."""


class CommandNotStarted(LaunchError):
    """The job's command cannot be started (not found, not executable): the job's own
    failure, never retried (docs/design.md §3.7). The message names the command."""


class RunLost(Exception):
    """A run ended through no fault of the job (node failure, preemption, boot failure,
    the engine forgot it): an infrastructure failure, retried elsewhere. Raised by
    ``RunHandle.wait``."""


class RunOutcomeUnknown(Exception):
    """A run started, then its engine forgot it, and nothing recorded how it ended
    (Slurm after ``MinJobAge`` with no exit status in the run folder). It may have
    done its work, so it must not run again: the job fails (killed when a cancel was
    requested), never retried. Raised by ``RunHandle.wait``."""


@dataclass(frozen=True)
class RunSpec:
    """What to run: the job's command, environment and labels, under one epoch. A gang
    (``replicas`` > 1) runs that many tasks of the command, each asking ``resources``, on
    distinct nodes sharing a ``group_by`` value, all started within ``start_timeout_s``
    (each task's environment: docs/design.md §3.4)."""

    job_id: str
    epoch: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)  # the job's normalised request (each task's)
    replicas: int = 1
    group_by: str = ""
    start_timeout_s: float = 300.0
    # The job's unpacked workspace (the agent's cache, read only to backends): each run
    # starts in a fresh copy of it (docs/design.md §3.5). None: an empty folder.
    workspace: Path | None = None
    # The run contract (docs/design.md §3.7): SIGTERM to SIGKILL when the run is stopped
    # (a gang's tasks too, when a sibling failed), and its running time at most (None: no
    # limit). The agent enforces the limit; an engine with one of its own (Slurm's
    # ``--time``) is given it as a backstop.
    grace_s: float = DEFAULT_GRACE_S
    time_limit_s: float | None = None


# In a run's folder (each task's, for a gang): what it leaves for its agent to store
# (IRISFED_OUTPUT_DIR), and its copy of its workspace, where it starts (docs/design.md §3.5).
OUTPUT_FOLDER = "outputs"
WORKSPACE_FOLDER = "workspace"

# A task's state (``job_tasks.state``, migration 0016). Append only.
TASK_PENDING = "pending"
TASK_RUNNING = "running"
TASK_SUCCEEDED = "succeeded"
TASK_FAILED = "failed"
TASK_KILLED = "killed"
TASK_LOST = "lost"
# How a task ended: a row in one of these states is final for its run.
TASK_ENDED = frozenset({TASK_SUCCEEDED, TASK_FAILED, TASK_KILLED, TASK_LOST})


@dataclass(frozen=True)
class TaskStatus:
    """One task of a gang's run as its backend knows it: where, in what state, its exit
    code and its log folder (None: not known yet)."""

    index: int
    node: str | None
    state: str
    exit_code: int | None = None
    log_path: str | None = None


class RunHandle(Protocol):
    """One launched (or adopted) run: wait for its exit code, or kill it. A gang's handle
    also has ``tasks()`` (a TaskStatus each) and ``started`` (an asyncio.Event set once
    every task runs); its exit code is 0 when every task succeeded, else the first
    failing task's (the others killed), and ``wait`` raises ``RunLost`` when a task's
    infrastructure failed or the tasks did not all start within the start timeout."""

    log_dir: str | None

    async def wait(self) -> int:
        """The run's exit code once it ended (``KILLED_EXIT_CODE`` when killed);
        raises ``RunLost`` when it ended through no fault of the job, and
        ``RunOutcomeUnknown`` when it started and how it ended is lost."""
        ...

    async def kill(self, grace_s: float) -> None:
        """Stop the run: SIGTERM to its processes (each task's), SIGKILL after ``grace_s``
        (docs/design.md §3.7); returns once it ended."""
        ...


@dataclass(frozen=True)
class Discovered:
    """What an engine says it has: attributes, each resource's (total, free), and its
    nodes as heartbeat node groups (shared.nodes.group_nodes)."""

    attributes: dict[str, list[str]] = field(default_factory=dict)
    resources: dict[str, tuple[float, float]] = field(default_factory=dict)
    nodes: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class LiveRun:
    """A run this backend launched that is still alive (perhaps from an earlier agent run)."""

    job_id: str
    epoch: int
    handle: str  # the backend's own reference: a process group id here; a Slurm/Ray job id there


class Backend(Protocol):
    """A place to run jobs, and to find (and stop) the runs it launched earlier."""

    kind: str
    # Runs live in an engine that outlasts the agent (Slurm, Ray): a stopping agent
    # leaves them running and its next start adopts them. False: the agent kills its
    # runs when it stops (they would die with it or could not be followed).
    runs_outlive_agent: bool
    # Its engine says what it has (``discover``): until it first answers, the agent
    # advertises this backend as ``discovering`` (shape unknown). False: the
    # configuration is its shape from the start.
    discovers: bool

    async def launch(self, spec: RunSpec) -> RunHandle:
        """Start (job, epoch); if the engine already has that run, return it instead.
        Raises ``LaunchError`` when it cannot start (infrastructure: retried elsewhere)."""
        ...

    def log_dir(self, job_id: str, epoch: int) -> str | None:
        """Where (job, epoch)'s output will be, recorded with its acceptance (None: nowhere)."""
        ...

    async def list_runs(self) -> list[LiveRun]:
        """Every run this backend launched on this peer that is still alive, whoever launched it."""
        ...

    async def adopt(self, run: LiveRun) -> RunHandle | None:
        """Follow the run of (``run.job_id``, ``run.epoch``) that an earlier agent run
        launched — still live, or ended while no agent watched (its outcome is then
        ``wait()``'s at once) — found by ``run.handle`` or, when that is empty, by its
        name. None when the engine has no such run or this backend cannot follow
        one (the agent then kills any copy and hands the job back)."""
        ...

    async def kill_run(self, run: LiveRun) -> bool:
        """Kill a run ``list_runs`` returned; False when it is gone (or no longer ours)."""
        ...

    async def kill_leftover(self, job_id: str, epoch: int) -> bool:
        """Kill the run of (job, epoch) an earlier agent run left behind, if there is one."""
        ...

    async def discover(self) -> Discovered | None:
        """What the engine has now; None: this backend advertises its configuration only."""
        ...

    async def close(self) -> None:
        """Stop background work (pollers); runs go on in the engine."""
        ...
