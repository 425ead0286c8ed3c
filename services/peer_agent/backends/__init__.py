"""Where a peer agent runs jobs, behind one small interface (``Backend``).

- ``subprocess`` (``backends/subprocess.py``): really runs the command in a per-job
  working directory, stdout/stderr to files, in its own process group (cancel
  kills the group).
- ``simulated`` (``backends/simulated.py``): no process; finishes after
  ``sim.duration_s`` (a job label, default 0) with ``sim.exit_code`` (default 0).
  For demos and benchmarks.
- ``slurm`` (``backends/slurm.py``): a Slurm cluster, through ``sbatch``,
  ``squeue``/``scontrol`` and ``scancel``.
- ``ray`` (``backends/ray.py``): a Ray cluster, through the Ray Jobs API.

Every backend can list the runs it launched that are still alive, including
those of an earlier agent run on this peer (``list_runs``), kill one of them
(``kill_run``), and, when the engine can still report on it, follow it again
(``adopt``): runs may outlive a crashed agent; a restarted agent adopts those that
are still its job at their epoch and kills the ones the federation has since taken
away from it (fencing, invariant 3). Launch is idempotent per (job, epoch): a
second launch of a run the engine already has returns that run. Real engines
report what they have (``discover``: attributes and each resource's total and
free amount) and poll the status of all their runs in one engine call per
interval, never one per run. A new kind of backend implements ``Backend`` and is
added to ``make_backend``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from irisfed.services.peer_agent.backends.contract import (
    DEFAULT_POLL_INTERVAL_S,
    KILLED_EXIT_CODE,
    OUTPUT_FOLDER,
    TASK_ENDED,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    WORKSPACE_FOLDER,
    Backend,
    CommandNotStarted,
    Discovered,
    LaunchError,
    LiveRun,
    RunHandle,
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
    TaskStatus,
)
from irisfed.services.peer_agent.backends.nodes import LocalNodes
from irisfed.services.peer_agent.backends.simulated import SimulatedBackend
from irisfed.services.peer_agent.backends.subprocess import PASSED_THROUGH_ENV, SubprocessBackend


def make_backend(kind: str, work_root: Path, simulated_duration_s: float = 0.0,
                 options: Mapping[str, str] | None = None, peer_id: str = "",
                 nodes: LocalNodes | None = None) -> Backend:
    """The backend of ``kind``: ``simulated``; ``subprocess`` (under ``work_root``);
    ``slurm`` (``options``: ``partition``, ``poll_interval_s``, ``call_timeout_s``; output
    files under ``work_root``); ``ray`` (``options``: ``address``, ``poll_interval_s``,
    ``call_timeout_s``). Engine
    backends tag their runs with ``peer_id`` so that peers sharing one cluster never
    list, adopt or kill each other's runs."""
    options = options or {}
    if kind == "simulated":
        return SimulatedBackend(simulated_duration_s, nodes)
    if kind == "slurm":
        from irisfed.services.peer_agent.backends.slurm import SlurmBackend

        return SlurmBackend(work_root, peer_id, partition=options.get("partition", ""),
                            poll_interval_s=float(options.get("poll_interval_s", DEFAULT_POLL_INTERVAL_S)),
                            **_timeout(options, "command_timeout_s"))
    if kind == "ray":
        from irisfed.services.peer_agent.backends.ray import (
            RayBackend,  # imports ray: only when asked for
        )

        return RayBackend(options["address"], work_root, peer_id,
                          poll_interval_s=float(options.get("poll_interval_s", DEFAULT_POLL_INTERVAL_S)),
                          **_timeout(options, "call_timeout_s"))
    return SubprocessBackend(work_root, nodes)


def _timeout(options: Mapping[str, str], parameter: str) -> dict[str, float]:
    """``--engine-timeout`` as the engine backend's own keyword; absent: its default."""
    return {parameter: float(options["call_timeout_s"])} if "call_timeout_s" in options else {}



__all__ = ["DEFAULT_POLL_INTERVAL_S", "KILLED_EXIT_CODE", "OUTPUT_FOLDER", "TASK_ENDED", "WORKSPACE_FOLDER",
           "CommandNotStarted", "PASSED_THROUGH_ENV", "TASK_FAILED", "TASK_KILLED",
           "TASK_LOST", "TASK_PENDING", "TASK_RUNNING", "TASK_SUCCEEDED", "Backend", "Discovered", "LaunchError",
           "LiveRun", "LocalNodes", "RunHandle", "RunLost", "RunOutcomeUnknown", "RunSpec", "SimulatedBackend",
           "SubprocessBackend", "TaskStatus", "make_backend"]
