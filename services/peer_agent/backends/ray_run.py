"""A Ray job the ``ray`` backend follows: its handle, its log and its outcome.

``_RayRun`` is one run's handle. ``wait`` returns once the backend's poller saw the
job end (``end``): its logs come into the run folder, and its exit code, or
``RunLost``, from its Ray job's state (``ray_text.exit_code``); while it runs, the
Jobs API's log tail is followed into ``<run dir>/stdout``. ``kill`` is ``stop_job``,
asked again at every poll until the job ends. ``_RayGang`` is a gang's: ``started``
once its driver's log says every task runs, given up (lost) when it has not
``GANG_START_GRACE_S`` after its start timeout; its outcome, each task's state, node
and exit code and each task's output come from the driver's log
(``ray_gang_text``). Every call to the head goes through the backend
(``RayBackend``), which also runs the poller.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from irisfed.services.common.log import EventLogger
from irisfed.services.peer_agent.backends import ray_gang_text as gang_text
from irisfed.services.peer_agent.backends import ray_text as text
from irisfed.services.peer_agent.backends.contract import (
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_RUNNING,
    RunLost,
    TaskStatus,
)

log = EventLogger("peer-agent")

# A gang's driver enforces its start timeout itself, from its own start; the backend
# stops a gang whose driver has not said its tasks run this long after that timeout
# (a job Ray keeps PENDING, a driver that hangs) and counts it lost. Room for the
# driver to start, import Ray and join the cluster on a busy node.
GANG_START_GRACE_S = 60.0
# How long a kill waits for the job to end past Ray's own stop timeout: Ray's SIGKILL,
# the supervisor's report, and a poll or two to see it.
STOP_SETTLE_S = 5.0


class _Backend(Protocol):
    """What a run asks of its backend (``RayBackend``): calls to the head, and its poller."""

    engine_calls: Counter[str]

    def log_dir(self, job_id: str, epoch: int) -> str: ...

    def follow(self, run: _RayRun) -> None: ...

    async def stop(self, submission_id: str) -> None: ...

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any: ...

    async def _connect(self) -> Any: ...


def _text_length(path: Path) -> int:
    """How many characters of a job's log ``path`` holds (0: none)."""
    try:
        return len(path.read_bytes().decode("utf-8", "replace"))
    except OSError:
        return 0


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(text)


def _write_outputs(run_dir: Path, stdout: str, stderr: str,
                   tasks: dict[int, tuple[str, str]] | None = None, tailed: bool = False) -> None:
    """The run's ``stdout``/``stderr``, and each gang task's in ``task-<i>/``. ``tailed``:
    ``stdout`` already holds the start of the log (followed while it ran): only the rest
    is added (the log only grows), so what was shipped stays as it is."""
    run_dir.mkdir(parents=True, exist_ok=True)
    have = _text_length(run_dir / "stdout") if tailed else 0
    if tailed and len(stdout) >= have:
        _append(run_dir / "stdout", stdout[have:])
    else:
        (run_dir / "stdout").write_text(stdout)
    (run_dir / "stderr").write_text(stderr)
    for index, (task_out, task_err) in (tasks or {}).items():
        task_dir = run_dir / f"task-{index}"
        task_dir.mkdir(exist_ok=True)
        (task_dir / "stdout").write_text(task_out)
        (task_dir / "stderr").write_text(task_err)


class _RayRun:
    """One Ray job, followed by its backend's poller until it ends."""

    def __init__(self, backend: _Backend, submission_id: str, job_id: str, epoch: int) -> None:
        self.backend = backend
        self.submission_id = submission_id
        self.job_id = job_id
        self.epoch = epoch
        self.log_dir = backend.log_dir(job_id, epoch)
        self.kill_requested = False
        self.since_poll = 0  # polls started before it was followed cannot have listed it
        self.ended = asyncio.Event()
        self.state: text.JobState | None = None
        self.lost = ""  # why the run was lost, when the poller knows it was
        self.forgotten = False  # the head no longer has the job (nor its logs)
        self._result: tuple[str, int] | None = None  # (why lost, exit code), settled once
        self._settling = asyncio.Lock()
        self._tail: asyncio.Task | None = None  # follows the log into stdout while it runs

    def end(self, state: text.JobState | None = None, forgotten: str = "") -> None:
        """It ended as ``state`` says, or the head ``forgotten`` it (why)."""
        self.state, self.lost, self.forgotten = state, forgotten, bool(forgotten)
        self.ended.set()

    async def wait(self) -> int:
        self.backend.follow(self)
        if self.tails and self._tail is None and not self.ended.is_set():
            self._tail = asyncio.ensure_future(self._follow_log())
        await self.ended.wait()
        async with self._settling:
            if self._result is None:
                if self._tail is not None:
                    self._tail.cancel()
                    with contextlib.suppress(BaseException):
                        await self._tail
                self._result = await self._settle()
        lost, code = self._result
        if lost:
            raise RunLost(lost)
        return code

    async def kill(self, grace_s: float) -> None:
        """Ask Ray to stop the job (again at every poll until it ends): SIGTERM, SIGKILL
        after the stop timeout its submission set (``ray_text.stop_env``: its grace; a
        gang's driver gives its tasks the grace itself). Waits for it to end, up to that
        timeout and ``STOP_SETTLE_S`` more (a job Ray keeps pending ends later)."""
        if self.ended.is_set():
            return
        self.kill_requested = True
        self.backend.follow(self)
        await self.backend.stop(self.submission_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ended.wait(),
                                   timeout=text.stop_wait_s(grace_s, isinstance(self, _RayGang)) + STOP_SETTLE_S)

    tails = True  # its log is followed into stdout while it runs (a gang's comes at its end)

    async def _follow_log(self) -> None:
        """The Jobs API's log tail into ``stdout`` as the job writes (the agent ships it
        from there); what the file holds already (an agent before this one followed it)
        is not written again. Ends when the job does, or is cancelled."""
        path = Path(self.log_dir) / "stdout"
        try:
            client = await self.backend._connect()
            skip = await asyncio.to_thread(_text_length, path)
            self.backend.engine_calls["tail_job_logs"] += 1
            async for chunk in client.tail_job_logs(self.submission_id):
                if skip >= len(chunk):
                    skip -= len(chunk)
                    continue
                chunk, skip = chunk[skip:], 0
                await asyncio.to_thread(_append, path, chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the log comes whole at the end all the same
            log.info("ray_log_tail_ended", job_id=self.job_id, epoch=self.epoch, error=repr(exc))

    def outcome(self, logs: str | None) -> int:
        """The exit code of the ended job (``logs``: its log, None when unreadable);
        raises ``RunLost``."""
        assert self.state is not None
        return text.exit_code(self.state, self.kill_requested)

    def task_outputs(self, logs: str) -> dict[int, tuple[str, str]]:
        """Each task's (stdout, stderr) to write apart: none for a single task."""
        return {}

    async def _settle(self) -> tuple[str, int]:
        """Once: the job's logs into ``stdout`` (``stderr`` says what went wrong, if
        anything), and its outcome: (why it was lost or "", exit code)."""
        logs: str | None = None
        problem = ""
        if not self.forgotten:  # a forgotten job has no logs left
            try:
                logs = await self.backend.call("get_job_logs", self.submission_id)
            except Exception as exc:  # noqa: BLE001 - the outcome matters more than the logs
                problem = f"irisfed: could not fetch the Ray job's logs: {exc!r}\n"
                log.warning("ray_logs_unavailable", job_id=self.job_id, epoch=self.epoch, error=repr(exc))
        lost, code = self.lost, 0
        if not lost:
            try:
                code = self.outcome(logs)
            except RunLost as exc:
                lost = str(exc)
        stderr = (f"irisfed: run lost: {lost}\n" if lost else "") + problem
        try:
            await asyncio.to_thread(_write_outputs, Path(self.log_dir), logs or "", stderr,
                                    self.task_outputs(logs or ""), self.tails)
        except OSError as exc:
            log.warning("ray_logs_not_written", job_id=self.job_id, epoch=self.epoch, error=repr(exc))
        return lost, code


class _RayGang(_RayRun):
    """A gang's Ray job: its driver (ray_gang.py) runs ``replicas`` tasks, one a node.
    ``started`` is set once the driver's log says every task runs (the poller reads
    the log of a RUNNING gang until it does); the outcome, each task's state, node and
    exit code, and each task's output come from the log once the job ended."""

    tails = False  # its tasks' output is split out of the driver's log at the end

    def __init__(self, backend: _Backend, submission_id: str, job_id: str, epoch: int, replicas: int,
                 start_timeout_s: float, submitted_at: float) -> None:
        super().__init__(backend, submission_id, job_id, epoch)
        self.replicas = replicas
        self.start_timeout_s = start_timeout_s
        self.submitted_at = submitted_at  # wall clock (time.time()): Ray's start_time when adopted
        self.started = asyncio.Event()
        self.nodes: list[str | None] = [None] * replicas
        self.start_timed_out = ""  # why the backend stopped it before its tasks all ran
        self.gang_log: gang_text.GangLog | None = None

    def start_overdue(self, now: float) -> bool:
        return not self.started.is_set() and now > self.submitted_at + self.start_timeout_s + GANG_START_GRACE_S

    def saw_start(self, nodes: list[str | None]) -> None:
        self.nodes = (list(nodes) + [None] * self.replicas)[:self.replicas]
        self.started.set()

    def outcome(self, logs: str | None) -> int:
        assert self.state is not None
        if logs is not None:
            self.gang_log = gang_text.read_gang_log(logs, self.replicas)
            if self.gang_log.started is not None and not self.started.is_set():
                self.saw_start(self.gang_log.started)
        return gang_text.gang_exit_code(self.state, self.gang_log if logs is not None else None,
                                        self.kill_requested, self.start_timed_out)

    def task_outputs(self, logs: str) -> dict[int, tuple[str, str]]:
        gang_log = self.gang_log or gang_text.read_gang_log(logs, self.replicas)
        return {index: (gang_log.outputs.get((index, "out"), ""), gang_log.outputs.get((index, "err"), ""))
                for index in range(self.replicas)}

    def tasks(self) -> list[TaskStatus]:
        """Each task as the driver last said: pending until ``started``, then running,
        then as its ``end`` line says (running ones of a run lost without one: lost)."""
        end = self.gang_log.end if self.gang_log is not None else None
        states = [TASK_RUNNING if self.started.is_set() else TASK_PENDING] * self.replicas
        codes: list[int | None] = [None] * self.replicas
        nodes = list(self.nodes)
        if end is not None:
            states = _listed(end.get("states"), self.replicas, states)
            codes = _listed(end.get("codes"), self.replicas, codes)
            nodes = _listed(end.get("nodes"), self.replicas, nodes)
        elif self._result is not None and self._result[0]:  # lost, and the driver did not say how
            states = [TASK_LOST if state == TASK_RUNNING else state for state in states]
        elif self._result is not None:  # stopped before the driver said how
            states = [TASK_KILLED if state == TASK_RUNNING else state for state in states]
        return [TaskStatus(i, nodes[i], states[i], codes[i], str(Path(self.log_dir) / f"task-{i}"))
                for i in range(self.replicas)]

    async def look_for_start(self) -> None:
        """Read the log of the RUNNING job for the driver's ``started`` line (a failure
        is only logged: asked again at the next poll)."""
        try:
            logs = await self.backend.call("get_job_logs", self.submission_id)
        except Exception as exc:  # noqa: BLE001 - asked again at the next poll
            log.warning("ray_gang_log_unavailable", submission_id=self.submission_id, error=repr(exc))
            return
        nodes = gang_text.gang_started(logs)
        if nodes is not None and not self.started.is_set():
            self.saw_start(nodes)

    async def give_up_start(self, status: str) -> None:
        """Its tasks did not all start in time: stop the job (again at every poll until
        it ends); it is lost."""
        self.start_timed_out = (f"its {self.replicas} tasks did not all start within {self.start_timeout_s:g}s "
                                f"(the Ray job was {status} {GANG_START_GRACE_S:g}s after that)")
        log.warning("ray_gang_start_overdue", submission_id=self.submission_id, why=self.start_timed_out)
        self.kill_requested = True
        await self.backend.stop(self.submission_id)


def _listed(values: Any, length: int, default: list) -> list:
    """``values`` when it is a list of ``length`` items (a driver's ``end`` line), else ``default``."""
    return list(values) if isinstance(values, list) and len(values) == length else default
