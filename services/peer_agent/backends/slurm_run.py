"""A Slurm run the backend follows, and what its run folder records. No Slurm command of
its own: it asks its backend (``SlurmBackend``) to signal or cancel a job.

- ``_Followed``: one Slurm job as the backend's poller sees it (its outcome, its
  nodes, whether Slurm runs it, a gang's start deadline), shared by every handle on
  it; ``_SlurmRun`` is the handle: ``wait``, ``kill`` (SIGTERM to the job's processes,
  then ``scancel`` once its grace is up) and a gang's ``tasks()`` (``_task_view``:
  ``slurm_text.gang_tasks``);
- the run folder, read back (file I/O: called in a thread): the markers its batch
  script and task wrappers wrote (``read_marker``, ``read_task_records``), a gang's
  ``GANG_FILE`` (``read_gang_file``) and how a run Slurm forgot ended
  (``run_evidence``: ``slurm_text.forgotten_outcome``); and written at launch: a
  fresh copy of the workspace (``_fresh_copy``), what a gang records (``_gang_of``);
- ``_result``: how a run ended (``slurm_text.Outcome``) as its handle gives it, an
  exit code, ``RunLost`` or ``RunOutcomeUnknown``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from irisfed.services.peer_agent.backends.contract import (
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
    TaskStatus,
)
from irisfed.services.peer_agent.backends.slurm_nodes import expand_hostlist
from irisfed.services.peer_agent.backends.slurm_script import GANG_FILE, GangFile, parse_gang_file
from irisfed.services.peer_agent.backends.slurm_text import (
    EXIT_STATUS_FILE,
    STARTED_MARKER,
    Outcome,
    SlurmJob,
    TaskRecord,
    forgotten_outcome,
    gang_tasks,
)
from irisfed.shared.workspace import copy_tree


class _Backend(Protocol):
    """What a handle asks of its backend (``SlurmBackend``) to stop its job."""

    async def terminate(self, slurm_id: str, gang: bool) -> bool: ...

    async def scancel(self, slurm_id: str) -> None: ...


# The most of a marker file read: an exit code or a job id fits many times over.
MARKER_MAX_BYTES = 64
# The longest a stop waits to read a run's start marker (a shared file system away):
# then it takes the run for not started, as before any poll saw it run.
MARKER_READ_TIMEOUT_S = 2.0


def read_marker(path: Path) -> str | None:
    """The text of a marker the batch script wrote (its first ``MARKER_MAX_BYTES``);
    None when there is none; ``""`` when something else is there (a symlink, a FIFO,
    a folder: the job's own doing), which still shows the run started. Never follows
    a symlink nor blocks. Other OSErrors (folder unreadable, file system away)
    propagate: the caller cannot tell, and asks again later."""
    return _read_marker(path)[0]


def _read_marker(path: Path) -> tuple[str | None, int]:
    """``read_marker``'s text, and when the marker was last written (ns; 0: unknown)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, 0
    except OSError:
        if os.path.lexists(path):
            return "", 0
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return "", 0
        return os.read(fd, MARKER_MAX_BYTES).decode(errors="replace"), status.st_mtime_ns
    finally:
        os.close(fd)


def _fresh_copy(workspace: Path, dest: Path) -> None:
    """A run's own copy of its workspace at ``dest`` (a copy left half made by an earlier
    start of the same run is replaced)."""
    if os.path.lexists(dest):
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    copy_tree(workspace, dest)


def read_task_records(run_dir: Path, replicas: int) -> tuple[TaskRecord, ...]:
    """What each task of a gang left in ``run_dir/task-<i>`` (file I/O: call it in a
    thread); OSError when a folder cannot be read."""
    run_dir = run_dir.resolve()
    records = []
    for index in range(replicas):
        folder = run_dir / f"task-{index}"
        started = read_marker(folder / STARTED_MARKER)
        exit_status, ended_ns = _read_marker(folder / EXIT_STATUS_FILE)
        records.append(TaskRecord(started, exit_status, ended_ns))
    return tuple(records)


def read_gang_file(run_dir: Path) -> GangFile | None:
    """A run folder's ``GANG_FILE`` (file I/O: call it in a thread); None: not a gang."""
    return parse_gang_file(read_marker(run_dir.resolve() / GANG_FILE))


def run_evidence(slurm_id: str, run_dir: Path) -> Outcome:
    """How a run Slurm forgot ended, from its run folder (file I/O: call it in a thread)."""
    run_dir = run_dir.resolve()
    return forgotten_outcome(slurm_id, read_marker(run_dir / STARTED_MARKER),
                             read_marker(run_dir / EXIT_STATUS_FILE), str(run_dir))


def _gang_of(spec: RunSpec) -> GangFile | None:
    """What a gang's run folder records of it at launch (None: not a gang)."""
    if spec.replicas <= 1:
        return None
    return GangFile(spec.replicas, spec.start_timeout_s, time.time() + spec.start_timeout_s)


def _result(ended: Outcome) -> int | RunLost | RunOutcomeUnknown:
    if ended.exit_code is not None:
        return ended.exit_code
    return RunOutcomeUnknown(ended.unknown) if ended.unknown else RunLost(ended.lost)


@dataclass(eq=False)
class _Followed:
    """A Slurm job this backend follows, shared by every handle on it: its outcome (set
    by the poller) and what the polls saw of it."""

    done: asyncio.Future[int]
    run_dir: Path
    log_dir: str
    replicas: int = 1
    start_by: float | None = None  # a gang: the loop time its tasks must run by (its start timeout)
    start_timeout_s: float = 0.0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    nodes: list[str] = field(default_factory=list)  # the job's NodeList, once Slurm allocated it
    tasks: list[TaskStatus] | None = None  # settled: each task's end
    timed_out: str = ""  # set when it was cancelled for not starting in time: why
    misses: int = 0  # polls in a row that did not list it
    stop_at: float | None = None  # once a kill sent SIGTERM: the loop time of its plain scancel

    def saw(self, job: SlurmJob) -> None:
        if job.nodes and not self.nodes:
            self.nodes = expand_hostlist(job.nodes)
        if job.live and job.started:
            self.started.set()  # Slurm runs the batch script once every node is allocated

    def overdue(self, job: SlurmJob, now: float) -> bool:
        """A gang Slurm has not started by its start timeout (and was not cancelled for it yet)."""
        return self.start_by is not None and not job.started and now >= self.start_by and not self.timed_out


class _SlurmRun:
    """A Slurm job this backend follows: ``wait`` resolves when a poll sees it end. A
    gang's tasks (``tasks()``) and ``started`` (Slurm runs it) come from the same polls."""

    def __init__(self, backend: _Backend, slurm_id: str, followed: _Followed) -> None:
        self.backend = backend
        self.slurm_id = slurm_id
        self.followed = followed
        self.log_dir = followed.log_dir
        self.done = followed.done
        self.started = followed.started

    def tasks(self) -> list[TaskStatus]:
        """Each task: its node, state and exit code (pending, then running once Slurm runs
        the job; how each ended once it ended), its log folder."""
        followed = self.followed
        if followed.tasks is not None:
            return list(followed.tasks)
        return _task_view(followed, None, ())

    async def wait(self) -> int:
        return await asyncio.shield(self.done)  # a cancelled waiter leaves the run followed

    async def kill(self, grace_s: float) -> None:
        """SIGTERM to the job's processes (``slurm_script.term_commands``), then, unless a
        poll saw the job end within ``grace_s``, a plain ``scancel`` (SIGTERM again,
        SIGKILL after the cluster's KillWait: CANCELLED). A job not running yet (Slurm
        signals only running jobs: neither a poll nor, for a single run, its start marker
        says it runs), or one Slurm would not signal, gets the ``scancel`` at once.
        Either way the run ends -15, killed (``slurm_text.outcome``), unless it ended by
        itself first. A second kill sends no
        second SIGTERM: it waits for the first one's ``scancel``. Returns once a poll sees
        the job end. Nothing to do for a run that has ended."""
        followed, loop = self.followed, asyncio.get_running_loop()
        if self.done.done():
            return
        if followed.stop_at is None:
            if grace_s > 0 and not followed.started.is_set() and followed.replicas == 1 \
                    and await self._marked_started():
                followed.started.set()  # its batch script ran since the last poll: Slurm runs it
            followed.stop_at = loop.time() + max(0.0, grace_s)
            if (grace_s <= 0 or not followed.started.is_set()
                    or not await self.backend.terminate(self.slurm_id, followed.replicas > 1)):
                followed.stop_at = loop.time()
        await asyncio.wait({self.done}, timeout=max(0.0, followed.stop_at - loop.time()))
        if not self.done.done():
            await self.backend.scancel(self.slurm_id)
        await asyncio.wait({self.done})


    async def _marked_started(self) -> bool:
        """Whether this job's batch script wrote its start marker (Slurm's job id: a
        marker of an earlier submission to the same folder is not this job's). A folder
        unreadable or slower than ``MARKER_READ_TIMEOUT_S`` says no: a stop never waits
        on a file system."""
        try:
            text = await asyncio.wait_for(asyncio.to_thread(read_marker, self.followed.run_dir / STARTED_MARKER),
                                          MARKER_READ_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        return text is not None and text.strip() == self.slurm_id


def _task_view(followed: _Followed, ended: Outcome | None, records: Sequence[TaskRecord]) -> list[TaskStatus]:
    """``gang_tasks`` of a followed run; a single-task run is its one task, its log the run folder."""
    if followed.replicas > 1:
        return gang_tasks(followed.replicas, followed.started.is_set(), ended, records, followed.nodes,
                          followed.log_dir)
    single = (TaskRecord(None, str(ended.exit_code) if ended and ended.exit_code is not None else None),)
    [task] = gang_tasks(1, followed.started.is_set(), ended, single, followed.nodes, followed.log_dir)
    return [dataclasses.replace(task, log_path=followed.log_dir)]
