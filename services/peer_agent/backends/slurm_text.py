"""What the Slurm backend reads from Slurm's answers about its runs, and how a run
ended. Pure: no I/O.

Kept apart from ``slurm.py`` (which runs the commands) so that every format and
every decision about a Slurm answer is unit-tested from sample lines. The formats
are those of Slurm 22.05, measured in ``tooling/engines/slurm.py``'s docstring. What
the backend hands ``sbatch`` and ``scancel`` (options, the batch script, a gang's task
wrapper) is ``slurm_script.py``; the nodes ``scontrol show node`` lists, and whether a
job fits them, ``slurm_nodes.py``.

- a run is the Slurm job named ``irisfed-<job_id>-e<epoch>`` whose comment is
  ``irisfed:<peer_id>``: the name says which run it is, the comment whose it is
  (peers sharing one cluster never touch each other's runs);
- ``scontrol show ... -o`` answers are one ``KEY=VALUE ...`` line each
  (``parse_scontrol_line``);
- jobs are listed (and polled) with ``squeue -O`` (``SQUEUE_FORMAT``): id, state,
  wait status (``exit_code``, as ``wait(2)`` encodes it: ``768`` is exit 3, ``9``
  SIGKILL), name and comment, ``|``-separated, the free-text comment last; a job's
  state says how it ended (``outcome``);
- the batch script records in the run folder that the run started
  (``STARTED_MARKER``) and its command's exit code (``EXIT_STATUS_FILE``): once
  Slurm forgot a job, that folder alone says how the run ended
  (``forgotten_outcome``);
- a gang's outcome and its tasks come from what each task's wrapper recorded in
  ``task-<i>/`` (``gang_outcome``, ``gang_tasks``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from irisfed.services.peer_agent.backends.contract import (
    KILLED_EXIT_CODE,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    TaskStatus,
)

NAME_PREFIX = "irisfed-"
COMMENT_PREFIX = "irisfed:"
# `squeue -O`: a field's suffix is printed after it, and a field without a width is
# printed whole (no padding, no truncation). The comment, free text, comes last; the
# node list (empty while pending) and the reason hold no `|`.
SQUEUE_FORMAT = "JobID:|,State:|,exit_code:|,NodeList:|,Reason:|,Name:|,Comment:"
# What the batch script leaves in its run folder: the run started (holding Slurm's
# job id), and how its command ended (an exit code). Names a job is unlikely to use.
STARTED_MARKER = "irisfed-started"
EXIT_STATUS_FILE = "irisfed-exit-status"

# JobState values that may still change (`squeue` %T, `scontrol` JobState).
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED",
    "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
})
# Ended by the job itself (its exit code, or the signal that ended it, is the job's).
USER_ENDED_STATES = frozenset({"FAILED", "OUT_OF_MEMORY", "DEADLINE", "TIMEOUT", "SPECIAL_EXIT"})
# Ended through no fault of the job: the run is lost and retried elsewhere.
LOST_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "REVOKED"})
TERMINAL_STATES = USER_ENDED_STATES | LOST_STATES | {"COMPLETED", "CANCELLED"}
# Live states in which a job's tasks do not run yet: a gang still in one of them after
# its start timeout is cancelled (and lost). CONFIGURING: nodes still booting.
NOT_STARTED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"})


# ---------------------------------------------------------------- scontrol lines


def parse_scontrol_line(text: str) -> dict[str, str]:
    """``KEY=VALUE KEY=VALUE ...`` of one ``scontrol show ... -o`` line.

    Values may hold spaces (``Reason=Not responding``, ``Command=/bin/sh -c x``):
    a value runs until the next `` KEY=`` (a word of letters, digits, ``:``, ``/``,
    ``_`` or ``.`` followed by ``=``). Values are stripped (scontrol pads some).
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    keys = list(re.finditer(r"(?:^| )([A-Za-z][A-Za-z0-9_:/.]*)=", line))
    fields = {}
    for i, match in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        fields[match.group(1)] = line[match.end():end].strip()
    return fields


def parse_scontrol_lines(text: str) -> list[dict[str, str]]:
    """Every non-empty line of a ``scontrol show ... -o`` answer, parsed."""
    return [parse_scontrol_line(line) for line in text.splitlines() if "=" in line]


def default_partition(partitions: Iterable[Mapping[str, str]]) -> str | None:
    """The name of the partition marked ``Default=YES``, None when there is none."""
    return next((p.get("PartitionName") for p in partitions if p.get("Default") == "YES"), None)


# ---------------------------------------------------------------- names


def job_name(job_id: str, epoch: int) -> str:
    """The Slurm job name of (job, epoch): ``irisfed-<job_id>-e<epoch>``."""
    return f"{NAME_PREFIX}{job_id}-e{epoch}"


def parse_job_name(name: str) -> tuple[str, int] | None:
    """(job id, epoch) of a name ``job_name`` wrote; None for any other name."""
    if not name.startswith(NAME_PREFIX):
        return None
    job_id, sep, epoch = name[len(NAME_PREFIX):].rpartition("-e")
    if not sep or not job_id or not epoch.isdigit() or not epoch.isascii():
        return None
    return job_id, int(epoch)


def comment_for(peer_id: str) -> str:
    """The comment that marks a Slurm job as this peer's run."""
    return f"{COMMENT_PREFIX}{peer_id}"


def sbatch_job_id(stdout: str) -> str:
    """The job id of ``sbatch --parsable``'s answer: ``<id>`` or ``<id>;<cluster>``."""
    job_id = stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise ValueError(f"sbatch answered {stdout.strip()!r}, not a job id")
    return job_id


# ---------------------------------------------------------------- squeue lines


@dataclass(frozen=True)
class SlurmJob:
    """One of our runs as ``squeue`` lists it."""

    slurm_id: str
    state: str
    wait_status: int  # as wait(2) encodes it: exit status << 8 | terminating signal
    job_id: str
    epoch: int
    nodes: str = ""  # its NodeList (``gn[1-2]``; empty while pending)
    reason: str = ""  # why it waits (``Resources``) or ended; ``None`` when there is none

    @property
    def live(self) -> bool:
        return self.state not in TERMINAL_STATES  # an unknown new state: still waited for

    @property
    def started(self) -> bool:
        """Slurm no longer holds it back (pending, configuring, requeued): it runs (its
        tasks launched) or has ended."""
        return self.state not in NOT_STARTED_STATES


def parse_squeue_line(line: str, comment: str) -> SlurmJob | None:
    """A line of ``squeue -h -O SQUEUE_FORMAT`` → the run, when it is a run with this
    ``comment``; None for any other job (another peer's, a person's, a malformed line).

    Name and comment may both hold ``|``: the comment is recognised as the line's end.
    """
    line = line.rstrip("\n")
    head = line.split("|", 5)
    if len(head) != 6 or not line.endswith("|" + comment):
        return None
    slurm_id, state, status, nodes, reason, rest = head
    name = rest[: len(rest) - len(comment) - 1]
    run = parse_job_name(name)
    if run is None or not slurm_id.isdigit():
        return None  # array and heterogeneous job ids (`12_3`, `12+1`) are none of ours
    return SlurmJob(slurm_id, state.split()[0] if state.strip() else "", _int(status), run[0], run[1],
                    nodes.strip(), reason.strip())


def parse_squeue(text: str, comment: str) -> list[SlurmJob]:
    """Every run with this ``comment`` in a ``squeue -h -O SQUEUE_FORMAT`` answer."""
    return [job for line in text.splitlines() if (job := parse_squeue_line(line, comment))]


def choose_run(jobs: Iterable[SlurmJob], slurm_id: str = "") -> SlurmJob | None:
    """Which of one (job, epoch)'s Slurm jobs to follow: a live one (the given id first),
    else the given id, else the latest; None when there are none."""
    ordered = sorted(jobs, key=lambda j: (j.live, j.slurm_id == slurm_id, int(j.slurm_id)))
    return ordered[-1] if ordered else None


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        return 0


# ---------------------------------------------------------------- how a run ended


class Outcome(NamedTuple):
    """How a terminal Slurm job ended: the run's exit code, why it was lost, or why
    how it ended is unknown."""

    exit_code: int | None
    lost: str = ""  # set when the infrastructure, not the job, ended it (retried)
    unknown: str = ""  # set when it started and nothing says how it ended (never retried)


def outcome(state: str, wait_status: int, slurm_id: str, killed_exit_code: int) -> Outcome | None:
    """The outcome of a Slurm job in ``state``; None while it is still live.

    COMPLETED → 0; FAILED, OUT_OF_MEMORY, DEADLINE, TIMEOUT (SPECIAL_EXIT) → the
    job's: ``-signal`` when a signal ended it, else its exit status (a FAILED job
    with status 0, e.g. one that could not start, → 1); CANCELLED →
    ``killed_exit_code``; NODE_FAIL, BOOT_FAIL, PREEMPTED (REVOKED) → lost.
    """
    status, signal = (wait_status >> 8) & 0xFF, wait_status & 0x7F
    if state == "COMPLETED":
        return Outcome(0)
    if state == "CANCELLED":
        return Outcome(killed_exit_code)
    if state in USER_ENDED_STATES:
        return Outcome(-signal if signal else status or 1)
    if state in LOST_STATES:
        return Outcome(None, f"Slurm job {slurm_id} ended {state}: not the job's fault")
    return None


def forgotten_outcome(slurm_id: str, started: str | None, exit_status: str | None, run_dir: str) -> Outcome:
    """The outcome of a run Slurm no longer knows, from what its batch script left in
    its run folder ``run_dir``: ``started``, the text of its ``STARTED_MARKER`` and
    ``exit_status``, of its ``EXIT_STATUS_FILE`` (None: no such file; ``""``: something
    is there that is not a readable file).

    An exit status → that exit code (the run ended; it must not run again). Started
    (or an unreadable exit status) but no exit status → unknown: it may have done its
    work, so it is failed, never retried. Nothing → lost: it never started, and
    running it elsewhere runs it once. ``slurm_id`` names the job in the reasons (""
    when the caller does not know it: the started marker's, when it holds one).
    """
    if not slurm_id and started and started.strip().isdigit() and started.strip().isascii():
        slurm_id = started.strip()
    job = f"job {slurm_id}" if slurm_id else "the job"
    code = _exit_code(exit_status) if exit_status is not None else None
    if code is not None:
        return Outcome(code)
    if exit_status is not None:
        return Outcome(None, unknown=f"Slurm forgot {job} after it started; its outcome is unknown "
                                     f"(unreadable exit status {exit_status[:40]!r} in {run_dir})")
    if started is not None:
        return Outcome(None, unknown=f"Slurm forgot {job} after it started; its outcome is unknown "
                                     f"(no exit status in {run_dir})")
    return Outcome(None, f"Slurm no longer knows {job}, and it never started (nothing in {run_dir})")


def _exit_code(text: str) -> int | None:
    """The exit code an ``EXIT_STATUS_FILE`` holds (0-255, or -signal), None when it holds none."""
    word = text.strip()
    if not re.fullmatch(r"-?[0-9]{1,3}", word):
        return None
    code = int(word)
    return code if -64 <= code <= 255 else None


# ---------------------------------------------------------------- a gang's outcome and tasks


class TaskRecord(NamedTuple):
    """What a task's wrapper left in ``task-<i>``: its ``STARTED_MARKER``'s text (the
    node's name; None: it never started), its ``EXIT_STATUS_FILE``'s (None: none), and
    when that was written (ns), which orders the tasks' failures."""

    started: str | None = None
    exit_status: str | None = None
    ended_ns: int = 0


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def _task_exit_code(record: TaskRecord) -> int | None:
    return _exit_code(record.exit_status) if record.exit_status is not None else None


def gang_outcome(job: Outcome, cancelled: bool, records: Sequence[TaskRecord], slurm_id: str) -> Outcome:
    """A gang's outcome, from its batch job's (``job``; ``cancelled``: Slurm says
    CANCELLED) and its tasks' ``records`` (empty: unreadable).

    Succeeded, cancelled, lost or unknown: the job's. Failed: the exit code of the task
    that failed first (non-zero, not the -15 of a sibling Slurm ended); when none did
    and a task never started, the tasks could not all start: lost (the gang is retried
    whole); otherwise the job's own exit code (the time limit, srun's own failure).
    """
    if job.exit_code is None or job.exit_code == 0 or cancelled:
        return job
    failed = sorted((record.ended_ns, index, code) for index, record in enumerate(records)
                    if (code := _task_exit_code(record)) not in (None, 0, KILLED_EXIT_CODE))
    if failed:
        return Outcome(failed[0][2])
    never = [index for index, record in enumerate(records) if record.started is None]
    if never:
        return Outcome(None, f"Slurm job {slurm_id} ended with {len(never)} of its {len(records)} tasks never "
                             f"started (task {never[0]} first): not the job's fault")
    return job


def gang_tasks(replicas: int, started: bool, ended: Outcome | None, records: Sequence[TaskRecord],
               nodes: Sequence[str], log_dir: str) -> list[TaskStatus]:
    """Each task of a gang as the agent reports it: its node (what its wrapper recorded,
    else the job's ``nodes`` in order: one task a node, task i on the i-th), its state
    and exit code (its record; else from the job: pending until Slurm ``started`` it,
    then running until it ``ended``), and its folder under ``log_dir``. A task with no
    exit status of an ended gang: succeeded when the gang did, lost when it was lost,
    failed when its outcome is unknown, else killed (a sibling failed, or a cancel)."""
    tasks = []
    for index in range(replicas):
        record = records[index] if index < len(records) else TaskRecord()
        recorded = (record.started or "").strip()
        node = recorded if _NODE_NAME.fullmatch(recorded) else (nodes[index] if index < len(nodes) else None)
        code = _task_exit_code(record)
        if code is not None:
            state = TASK_SUCCEEDED if code == 0 else TASK_KILLED if code == KILLED_EXIT_CODE else TASK_FAILED
        elif ended is None:
            state = TASK_RUNNING if started else TASK_PENDING
        elif ended.exit_code == 0:
            state, code = TASK_SUCCEEDED, 0
        elif ended.lost:
            state = TASK_LOST
        elif ended.unknown:
            state = TASK_FAILED
        else:
            state = TASK_KILLED
        tasks.append(TaskStatus(index, node, state, code, f"{log_dir.rstrip('/')}/task-{index}"))
    return tasks
