"""The ``simulated`` backend: no process; duration and exit code come from job labels.

A gang's tasks take nodes of their own (``LocalNodes``, waiting for them as a real
backend would), each "runs" for the same duration, and ``sim.failing_task`` (a task
index) makes only that task end with ``sim.exit_code``, the others then killed.
"""

from __future__ import annotations

import asyncio
import contextlib

from irisfed.services.peer_agent.backends.contract import (
    KILLED_EXIT_CODE,
    TASK_FAILED,
    TASK_KILLED,
    TASK_PENDING,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    LaunchError,
    LiveRun,
    RunLost,
    RunSpec,
    TaskStatus,
)
from irisfed.services.peer_agent.backends.nodes import LocalNodes


class _SimulatedRun:
    log_dir = None

    def __init__(self, duration_s: float, exit_code: int, nodes: LocalNodes | None = None,
                 key: tuple[str, int] | None = None) -> None:
        self.exit_code = exit_code
        self.done = asyncio.Event()
        self.duration_s = duration_s
        self.nodes = nodes
        self.key = key

    async def wait(self) -> int:
        try:
            if self.duration_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.done.wait(), timeout=self.duration_s)
            return self.exit_code
        finally:
            if self.nodes is not None and self.key is not None:
                self.nodes.release(self.key)

    async def kill(self, grace_s: float) -> None:
        self.exit_code = KILLED_EXIT_CODE
        self.done.set()


class _SimulatedGang:
    """A simulated gang: nodes of its own, then every task ends after ``duration_s``."""

    log_dir = None

    def __init__(self, spec: RunSpec, nodes: LocalNodes, duration_s: float, exit_code: int,
                 failing_task: int | None) -> None:
        self.spec = spec
        self.nodes_of = nodes
        self.duration_s = duration_s
        self.exit_code = exit_code
        self.failing_task = failing_task
        self.nodes: list[str] = []
        self.states = [TASK_PENDING] * spec.replicas
        self.codes: list[int | None] = [None] * spec.replicas
        self.started = asyncio.Event()
        self.killed = asyncio.Event()

    def tasks(self) -> list[TaskStatus]:
        return [TaskStatus(i, self.nodes[i] if i < len(self.nodes) else None, self.states[i], self.codes[i])
                for i in range(self.spec.replicas)]

    async def wait(self) -> int:
        key = (self.spec.job_id, self.spec.epoch)
        try:
            found = await self.nodes_of.wait_for_gang(key, self.spec.resources, self.spec.replicas,
                                                      self.spec.group_by, self.spec.start_timeout_s, self.killed)
            if found is None:
                if self.killed.is_set():
                    return KILLED_EXIT_CODE
                raise RunLost(f"its {self.spec.replicas} tasks did not all start within "
                              f"{self.spec.start_timeout_s:g}s (no {self.spec.replicas} free nodes here)")
            self.nodes = found
            self.states = [TASK_RUNNING] * self.spec.replicas
            self.started.set()
            if self.duration_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.killed.wait(), timeout=self.duration_s)
            if self.killed.is_set():
                self._end_all(KILLED_EXIT_CODE, TASK_KILLED)
                return KILLED_EXIT_CODE
            if self.exit_code != 0 and self.failing_task is not None:
                # One task fails; its siblings are killed (one fate).
                self._end_all(KILLED_EXIT_CODE, TASK_KILLED)
                self.codes[self.failing_task], self.states[self.failing_task] = self.exit_code, TASK_FAILED
                return self.exit_code
            self._end_all(self.exit_code, TASK_SUCCEEDED if self.exit_code == 0 else TASK_FAILED)
            return self.exit_code
        finally:
            self.nodes_of.release(key)

    def _end_all(self, code: int, state: str) -> None:
        self.codes = [code] * self.spec.replicas
        self.states = [state] * self.spec.replicas

    async def kill(self, grace_s: float) -> None:
        self.killed.set()


class SimulatedBackend:
    """Pretends to run jobs: duration and exit code come from the job's labels."""

    kind = "simulated"
    discovers = False
    runs_outlive_agent = False

    def __init__(self, default_duration_s: float = 0.0, nodes: LocalNodes | None = None) -> None:
        self.default_duration_s = default_duration_s
        self.nodes = nodes if nodes is not None else LocalNodes((), {})

    def node_groups(self) -> list[dict]:
        return self.nodes.groups()

    async def launch(self, spec: RunSpec) -> _SimulatedRun | _SimulatedGang:
        try:
            duration = float(spec.labels.get("sim.duration_s", self.default_duration_s))
            exit_code = int(spec.labels.get("sim.exit_code", 0))
            failing = spec.labels.get("sim.failing_task")
            failing_task = int(failing) if failing is not None else None
        except ValueError as exc:
            raise LaunchError(f"bad simulation label: {exc}") from exc
        if spec.replicas > 1:
            return _SimulatedGang(spec, self.nodes, duration, exit_code, failing_task)
        key = (spec.job_id, spec.epoch)
        self.nodes.place_one(key, spec.resources)
        return _SimulatedRun(duration, exit_code, self.nodes, key)

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
