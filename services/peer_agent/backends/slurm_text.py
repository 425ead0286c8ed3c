"""What the Slurm backend writes to and reads from Slurm's commands. Pure: no I/O.

Kept apart from ``slurm.py`` (which runs the commands) so that every format and
every decision about a Slurm answer is unit-tested from sample lines. The formats
are those of Slurm 22.05, measured in ``tooling/engines/slurm.py``'s docstring:

- a run is the Slurm job named ``irisfed-<job_id>-e<epoch>`` whose comment is
  ``irisfed:<peer_id>``: the name says which run it is, the comment whose it is
  (peers sharing one cluster never touch each other's runs);
- jobs are listed (and polled) with ``squeue -O`` (``SQUEUE_FORMAT``): id, state,
  wait status (``exit_code``, as ``wait(2)`` encodes it: ``768`` is exit 3, ``9``
  SIGKILL), name and comment, ``|``-separated, the free-text comment last;
- nodes come from ``scontrol show node -o -d``: one ``KEY=VALUE ...`` line each;
  each node's resources (total, free) and its features as attributes
  (``feature_attribute``) make the heartbeat's node groups (``node_groups``);
- the batch script records in the run folder that the run started
  (``STARTED_MARKER``), sets the job's environment, runs its command without ever
  letting the shell interpret a value (each word single-quoted) and records its
  exit code (``EXIT_STATUS_FILE``): once Slurm forgot a job, that folder alone says
  how the run ended (``forgotten_outcome``);
- a gang is one batch job of N nodes, one task each (``gang_args``), whose script
  (``gang_batch_script``) runs ``srun --kill-on-bad-exit=1`` over a task wrapper
  (``task_script``) that records each task's node and exit code in ``task-<i>/``:
  the gang's outcome and its tasks come from those records (``gang_outcome``,
  ``gang_tasks``).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from irisfed.services.peer_agent.backends import (
    KILLED_EXIT_CODE,
    TASK_FAILED,
    TASK_KILLED,
    TASK_LOST,
    TASK_PENDING,
    TASK_RUNNING,
    TASK_SUCCEEDED,
    TaskStatus,
)
from irisfed.shared.nodes import group_nodes
from irisfed.shared.resources import CPU, GPU, MEMORY_MB, RESOURCE_NAME_PATTERN, fmt_amount

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
# A gang's run folder also holds: its task wrapper, what the agent needs to follow it
# after a restart (``GangFile``), and a folder per task, ``task-<i>``, with the task's
# ``stdout``/``stderr``, its ``STARTED_MARKER`` (holding its node's name) and its
# ``EXIT_STATUS_FILE``.
TASK_SCRIPT = "task.sh"
GANG_FILE = "irisfed-gang"
# The port task 0 may listen on: BASE + the Slurm job id modulo SPAN. Below Linux's
# ephemeral range (32768 and up), so never taken by an outgoing connection; two gangs
# on one node share it only when their job ids are SPAN apart (documented).
COORDINATOR_PORT_BASE = 20000
COORDINATOR_PORT_SPAN = 10000
# The most tasks a gang may have (docs/design.md §3.4: replicas 1-4096).
MAX_GANG_TASKS = 4096
# The environment a gang's task gets from its wrapper: ours, never the job's own.
TASK_ENV = ("IRISFED_TASK_INDEX", "IRISFED_NUM_TASKS", "IRISFED_COORDINATOR", "IRISFED_NODE",
            "IRISFED_OUTPUT_DIR")

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

# Node state words (`State=IDLE+DRAIN`, `DOWN*`) of a node that runs nothing new.
UNUSABLE_NODE_STATES = frozenset({
    "DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "INVAL", "NOT_RESPONDING",
    "FUTURE", "UNKNOWN",
})

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESOURCE_NAME = re.compile(RESOURCE_NAME_PATTERN)
_COUNT = re.compile(r"(\d+)([KMG]?)")
_COUNT_SCALE = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


class ScriptError(ValueError):
    """A job that cannot be written as a batch script; the message says why."""


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


def output_path(path: str) -> str:
    """A path as ``sbatch -o/-e`` takes it literally (``%`` starts a pattern there)."""
    return path.replace("%", "%%")


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


# ---------------------------------------------------------------- GRES


def parse_gres(text: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """``gpu:h100:4(S:0-1),fpga:2`` → ({"gpu": 4, "fpga": 2}, {"gpu": ["h100"]}).

    Reads ``Gres`` and ``GresUsed`` alike (``gpu:h100:2(IDX:0-1)``); ``(null)`` and
    ``N/A`` are none. A count may carry a K/M/G suffix; no count means 1.
    """
    counts: dict[str, int] = {}
    types: dict[str, list[str]] = {}
    for item in _split_outside_parens(text):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        name = parts[0]
        if not name or name in ("(null)", "N/A"):
            continue
        count_match = _COUNT.fullmatch(parts[-1]) if len(parts) > 1 else None
        count = int(count_match.group(1)) * _COUNT_SCALE[count_match.group(2)] if count_match else 1
        kind = parts[1] if len(parts) > 2 or (len(parts) == 2 and count_match is None) else ""
        counts[name] = counts.get(name, 0) + count
        if kind and kind not in types.setdefault(name, []):
            types[name].append(kind)
    return counts, {name: kinds for name, kinds in types.items() if kinds}


def _split_outside_parens(text: str) -> list[str]:
    return _split_outside(text, "(", ")")


def _split_outside(text: str, opening: str, closing: str) -> list[str]:
    """``text`` split at the commas outside ``opening``...``closing`` pairs."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {opening: 1, closing: -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


# ---------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Node:
    """One node as ``scontrol show node -o -d`` reports it, in irisfed resource names."""

    name: str
    partitions: tuple[str, ...]
    usable: bool  # not down, drained, failed, invalid or not responding
    total: dict[str, float]
    used: dict[str, float]
    gpu_types: tuple[str, ...] = ()
    features: tuple[str, ...] = ()  # AvailableFeatures, as Slurm spells them

    def free(self) -> dict[str, float]:
        """What is not allocated, per resource; nothing on a node that runs nothing new."""
        return {name: max(0, amount - self.used.get(name, 0)) if self.usable else 0
                for name, amount in self.total.items()}

    def attributes(self) -> dict[str, list[str]]:
        """Its features as attributes (``feature_attribute``): what a gang's ``group_by`` names."""
        attributes: dict[str, list[str]] = {}
        for feature in self.features:
            key, value = feature_attribute(feature)
            if value not in attributes.setdefault(key, []):
                attributes[key].append(value)
        return attributes


def node_usable(state: str) -> bool:
    """Whether a node in ``State=...`` (``IDLE+DRAIN``, ``DOWN*``) may run new jobs."""
    if not state or "*" in state:  # `*`: the node does not respond
        return False
    return not any(word in UNUSABLE_NODE_STATES for word in state.split("+"))


def parse_node(fields: Mapping[str, str]) -> Node:
    """A node of ``scontrol show node -o -d`` (one parsed line)."""
    gres, gpu_types = parse_gres(fields.get("Gres", ""))
    # GresUsed comes with `-d`; without it, AllocTRES names GRES only where the cluster
    # accounts for them (AccountingStorageTRES=gres/gpu).
    gres_used = (parse_gres(fields["GresUsed"])[0] if "GresUsed" in fields
                 else tres_gres(fields.get("AllocTRES", "")))
    total: dict[str, float] = {CPU: _int(fields.get("CPUTot", "0")),
                               MEMORY_MB: _int(fields.get("RealMemory", "0"))}
    used: dict[str, float] = {CPU: _int(fields.get("CPUAlloc", "0")),
                              MEMORY_MB: _int(fields.get("AllocMem", "0"))}
    for name, count in gres.items():
        if name == GPU or (_RESOURCE_NAME.fullmatch(name) and name not in total):
            total[name] = count
            used[name] = gres_used.get(name, 0)
    partitions = tuple(p for p in fields.get("Partitions", "").split(",") if p)
    return Node(fields.get("NodeName", ""), partitions, node_usable(fields.get("State", "")),
                total, used, tuple(gpu_types.get(GPU, ())), parse_features(fields.get("AvailableFeatures", "")))


def tres_gres(text: str) -> dict[str, int]:
    """GRES counts of a TRES list: ``cpu=1,mem=1G,gres/gpu=2,gres/gpu:h100=2`` →
    ``{"gpu": 2}`` (a typed count repeats its untyped one, so only untyped ones count)."""
    counts: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.startswith("gres/") and ":" not in key and value.isdigit():
            counts[key[len("gres/"):]] = int(value)
    return counts


# Characters of Slurm's constraint syntax (``--constraint``): a feature holding one
# cannot be named in a constraint, so it is advertised as nothing.
_CONSTRAINT_SYNTAX = frozenset("&|[]()*,! ")


def parse_features(text: str) -> tuple[str, ...]:
    """``AvailableFeatures`` (``rack:a,ssd``; ``(null)`` when none) as a tuple of features,
    those a constraint could not name left out."""
    return tuple(f for f in text.split(",") if f and f != "(null)" and not set(f) & _CONSTRAINT_SYNTAX)


FEATURE_KEY = "feature"


def feature_attribute(feature: str) -> tuple[str, str]:
    """The attribute a node feature stands for: ``KEY:VALUE`` and ``KEY=VALUE`` (Slurm
    22.05 takes both in ``Features=``) are attribute KEY with VALUE, split at the first
    ``:`` or ``=``; any other feature is a value of the attribute ``feature``."""
    match = re.fullmatch(r"([^:=]+)[:=](.+)", feature)
    return (match.group(1), match.group(2)) if match else (FEATURE_KEY, feature)


def parse_nodes(text: str) -> list[Node]:
    """Every node of a ``scontrol show node -o -d`` answer."""
    return [parse_node(fields) for fields in parse_scontrol_lines(text) if "NodeName" in fields]


@dataclass(frozen=True)
class Capacity:
    """What a set of nodes has: each resource's (total, free), GPU types, node shapes."""

    resources: dict[str, tuple[float, float]] = field(default_factory=dict)
    gpu_types: list[str] = field(default_factory=list)
    shapes: list[dict[str, float]] = field(default_factory=list)  # each node's total

    def attributes(self) -> dict[str, list[str]]:
        """``device_type`` (gpu when any node has a GPU, else cpu) and ``device_variant``
        (the GPU types)."""
        has_gpu = self.resources.get(GPU, (0, 0))[0] > 0
        attributes = {"device_type": [GPU if has_gpu else CPU]}
        if self.gpu_types:
            attributes["device_variant"] = list(self.gpu_types)
        return attributes


def capacity(nodes: Iterable[Node]) -> Capacity:
    """Sum of the nodes' resources. Unusable nodes count in the total, never as free."""
    totals: dict[str, float] = {}
    free: dict[str, float] = {}
    gpu_types: list[str] = []
    shapes = []
    for node in nodes:
        shapes.append(dict(node.total))
        spare = node.free()
        for name, amount in node.total.items():
            totals[name] = totals.get(name, 0) + amount
            free[name] = free.get(name, 0) + spare[name]
        gpu_types += [kind for kind in node.gpu_types if kind not in gpu_types]
    return Capacity({name: (totals[name], free[name]) for name in totals}, sorted(gpu_types), shapes)


def node_groups(nodes: Iterable[Node]) -> list[dict]:
    """The heartbeat's node groups (shared.nodes.group_nodes): each node's features as
    attributes and each resource's (total, free) on it, identical nodes counted together."""
    return group_nodes((node.attributes(), {name: (amount, node.free()[name]) for name, amount in node.total.items()})
                       for node in nodes)


def expand_hostlist(text: str) -> list[str]:
    """The node names of a Slurm hostlist, in order: ``gn[1-3,5],vm`` → gn1 gn2 gn3 gn5
    vm; ``r[1-2]n[01-02]`` → r1n01 r1n02 r2n01 r2n02 (zero padding kept). Empty text,
    ``(null)`` and ``None``: no nodes. Malformed ranges are kept as written."""
    if not text or text in ("(null)", "None", "N/A"):
        return []
    names: list[str] = []
    for item in _split_outside(text, "[", "]"):
        parts: list[list[str]] = []
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if literal:
                parts.append([literal])
            if ranges:
                parts.append(_expand_ranges(ranges))
        expanded = [""]
        for options in parts:
            expanded = [head + option for head in expanded for option in options]
        names += [name for name in expanded if name]
    return names


def _expand_ranges(text: str) -> list[str]:
    values = []
    for piece in text.split(","):
        low, sep, high = piece.partition("-")
        if sep and low.isdigit() and high.isdigit() and int(low) <= int(high):
            values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
        else:
            values.append(piece)
    return values


# ---------------------------------------------------------------- what a run asks


def slurm_request(resources: Mapping[str, float], memory_mb_per_cpu: int) -> dict[str, int]:
    """What Slurm is asked for a job's normalised resources: whole cpus (at least 1),
    memory_mb (``memory_mb_per_cpu`` per cpu when the job names none), GRES counts."""
    cpus = max(1, math.ceil(float(resources.get(CPU, 1)) - 1e-9))
    memory = int(resources.get(MEMORY_MB, 0)) or memory_mb_per_cpu * cpus
    request = {CPU: cpus, MEMORY_MB: memory}
    request.update({name: int(amount) for name, amount in sorted(resources.items())
                    if name not in (CPU, MEMORY_MB) and amount > 0})
    return request


def resource_args(request: Mapping[str, int]) -> list[str]:
    """``sbatch`` options for a ``slurm_request``: ``-c``, ``--mem``, ``--gres``."""
    args = ["-c", str(request[CPU]), f"--mem={request[MEMORY_MB]}"]
    gres = [f"{name}:{amount}" for name, amount in request.items() if name not in (CPU, MEMORY_MB)]
    if gres:
        args.append("--gres=" + ",".join(gres))
    return args


def misfit(request: Mapping[str, int], shapes: Sequence[Mapping[str, float]], partition: str) -> str | None:
    """Why no single node of ``partition`` (its ``shapes``) can ever hold ``request``;
    None when one can."""
    if any(all(shape.get(name, 0) >= amount for name, amount in request.items()) for shape in shapes):
        return None
    if not shapes:
        return f"Slurm partition {partition} has no nodes"
    over = [f"{name}: asked {fmt_amount(amount)}, the largest node has "
            f"{fmt_amount(max(shape.get(name, 0) for shape in shapes))}"
            for name, amount in request.items() if all(shape.get(name, 0) < amount for shape in shapes)]
    if over:
        return f"the job does not fit one node of Slurm partition {partition}: " + "; ".join(over)
    asked = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in request.items())
    return f"no single node of Slurm partition {partition} has {asked} together"


def gang_args(replicas: int, request: Mapping[str, int], constraint: str = "") -> list[str]:
    """``sbatch`` options for a gang of ``replicas`` tasks, each asking ``request``: one
    task per node (``--nodes=N --ntasks=N --ntasks-per-node=1``), so the per-node
    ``--mem`` and ``--gres`` of ``resource_args`` are per task, as ``-c`` is."""
    args = [f"--nodes={replicas}", f"--ntasks={replicas}", "--ntasks-per-node=1", *resource_args(request)]
    return args + ([f"--constraint={constraint}"] if constraint else [])


def group_constraint(key: str, nodes: Iterable[Node]) -> str | None:
    """Slurm's "matching OR" over every feature of ``nodes`` that stands for attribute
    ``key``: ``[rack:a|rack:b]`` — all of a job's nodes have the same one of them
    (sbatch(1), ``--constraint``). None when no node has such a feature."""
    features = sorted({feature for node in nodes for feature in node.features
                       if feature_attribute(feature)[0] == key})
    return "[" + "|".join(features) + "]" if features else None


def gang_misfit(request: Mapping[str, int], replicas: int, group_by: str, nodes: Sequence[Node],
                partition: str) -> str | None:
    """Why ``nodes`` (a partition's) can never hold ``replicas`` tasks of ``request``, one a
    node, sharing one value of ``group_by`` when it names one; None when they can."""
    fitting = [node for node in nodes if all(node.total.get(name, 0) >= amount for name, amount in request.items())]
    if group_by:
        by_value: dict[str, int] = {}
        for node in fitting:
            for value in node.attributes().get(group_by, []):
                by_value[value] = by_value.get(value, 0) + 1
        most = max(by_value.values(), default=0)
    else:
        most = len(fitting)
    if most >= replicas:
        return None
    asked = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in request.items())
    sharing = f" sharing one {group_by} (its node features {group_by}:VALUE)" if group_by else ""
    return (f"the gang needs {replicas} nodes of Slurm partition {partition} with {asked}{sharing}: "
            f"it has at most {most}")


# ---------------------------------------------------------------- the batch script


def shell_word(value: str) -> str:
    """``value`` as one shell word the shell never interprets. A carriage return is
    written as ``$(printf '\\r')`` (sbatch refuses scripts holding ``\\r\\n``)."""
    return "\"$(printf '\\r')\"".join(shlex.quote(part) for part in value.split("\r"))


def batch_script(command: Sequence[str], env: Mapping[str, str], run_dir: str, workdir: str = "") -> str:
    """A ``/bin/sh`` batch script that records in ``run_dir`` that the run started,
    sets ``env``, runs ``command`` and records its exit code there.

    ``STARTED_MARKER`` (Slurm's job id) is written first; the command is not run
    when it cannot be. Names that are shell identifiers are exported; any other
    name goes through ``env -- 'NAME=VALUE' ... command`` (as does a program whose
    name starts with ``-``); the program's name then must not hold ``=``, or env
    would take it for a variable. The command is ``exec``ed in a subshell (a
    program, never a shell builtin; the shell's trap is reset there), as the
    shell's child, so that the shell outlives it and writes ``EXIT_STATUS_FILE``
    (tmp file, then ``mv``: a reader sees all of it or nothing): its exit status,
    or ``-15`` when the job got SIGTERM (``scancel``, the time limit: Slurm signals
    every process of the job, in no set order, so the command gets it too; a
    command that sh says ended by SIGTERM, 143, counts the same). The shell then
    ends as the command did, or by SIGTERM itself, so Slurm still says COMPLETED,
    FAILED, CANCELLED or TIMEOUT with the same status as before (a command killed
    by another signal exits ``128 + N``, as sh reports it). The shell's own
    words use builtins, ``command -p`` and quoted expansions only, so the job's
    ``PATH`` or ``IFS`` cannot change them. No job-controlled text is on a line
    before the first command, so no value can be read as an ``#SBATCH`` directive.
    ``workdir``: the folder the command runs in (its workspace's copy), entered in the
    command's subshell so the shell's own files stay in ``run_dir``.
    Raises ScriptError for what cannot be passed.
    """
    exports, run = _job_lines(command, env, workdir)
    folder = run_dir.rstrip("/") or "/"
    started, status = (shell_word(f"{folder}/{name}") for name in (STARTED_MARKER, EXIT_STATUS_FILE))
    status_tmp = shell_word(f"{folder}/{EXIT_STATUS_FILE}.tmp")
    lines = ["#!/bin/sh",
             "# Written by the irisfed peer agent: a start marker, the job's environment, its command, its exit.",
             f"printf '%s\\n' \"${{SLURM_JOB_ID-}}\" > {started} || {{ printf 'irisfed: cannot write %s: "
             f"the command was not run\\n' {started} >&2; exit 1; }}"]
    return "\n".join(lines + exports + _run_and_record(run, status, status_tmp)) + "\n"


def _job_lines(command: Sequence[str], env: Mapping[str, str], workdir: str = "") -> tuple[list[str], str]:
    """The ``export`` lines of ``env`` and the line that runs ``command`` (batch_script's
    rules), in ``workdir`` when one is given; ScriptError for what cannot be passed."""
    if not command:
        raise ScriptError("the job has no command")
    words = [*command, *env, *env.values()]
    if any("\0" in word for word in words):
        raise ScriptError("a NUL character cannot be passed to a job (command or environment)")
    bad = [name for name in env if not name or "=" in name]
    if bad:
        raise ScriptError(f"environment variable name {bad[0]!r} is empty or holds '='")
    exports = [f"export {name}={shell_word(value)}" for name, value in env.items() if _SHELL_NAME.fullmatch(name)]
    others = [f"{name}={value}" for name, value in env.items() if not _SHELL_NAME.fullmatch(name)]
    if others or command[0].startswith("-"):  # sh would take neither for a command, env does
        if "=" in command[0]:
            why = (f"the environment names {others[0].split('=')[0]!r}, not a shell name" if others
                   else "it starts with '-'")
            raise ScriptError(f"the program {command[0]!r} holds '=' and must be started through env "
                              f"({why}), which would read it as a variable")
        run = " ".join(["exec /usr/bin/env --", *map(shell_word, others), *map(shell_word, command)])
    else:  # exec in a subshell: a program, never a builtin of the same name (echo, kill ...)
        run = " ".join(["exec", *map(shell_word, command)])
    if "\0" in workdir:
        raise ScriptError("a NUL character cannot be in a working directory")
    enter = f"cd -- {shell_word(workdir)} && " if workdir else ""
    return exports, f"({enter}{run})"


def _run_and_record(run: str, status: str, status_tmp: str) -> list[str]:
    """Run the line ``run`` as the shell's child and record how it ended in ``status``
    (batch_script's rules). After the exports: a job variable of the same name cannot
    preset these."""
    return ["irisfed_signal=", "trap 'irisfed_signal=15' TERM", run, "irisfed_status=$?",
            # Killed by SIGTERM (sh says 143) is Slurm's TERM whichever process it reached first.
            '[ "$irisfed_status" != 143 ] || irisfed_signal=15',
            'irisfed_code=$irisfed_status',
            '[ -z "$irisfed_signal" ] || irisfed_code=-$irisfed_signal',
            f"printf '%s\\n' \"$irisfed_code\" > {status_tmp} && command -p mv -f {status_tmp} {status}",
            '[ -z "$irisfed_signal" ] || { trap - TERM; kill -s TERM "$$"; }',
            'exit "$irisfed_status"']


# ---------------------------------------------------------------- a gang's scripts


def gang_batch_script(run_dir: str, replicas: int, cpus_per_task: int) -> str:
    """The batch script of a gang: records the run's start in ``run_dir`` as
    ``batch_script`` does, then runs all ``replicas`` tasks as one job step, ``srun
    --kill-on-bad-exit=1`` over ``run_dir``'s ``TASK_SCRIPT`` (a task exiting non-zero
    makes Slurm end its siblings: SIGTERM, then SIGKILL after KillWait), and records
    srun's exit status. The step's shape is spelled out rather than read from the
    ``SLURM_*`` variables srun inherits. The job's own environment is set by each task's
    wrapper, never here, so none of it can change how srun runs (``SLURM_NTASKS``...);
    ``srun`` is found on the agent's ``PATH``, which the job inherits."""
    folder = run_dir.rstrip("/") or "/"
    started, status = (shell_word(f"{folder}/{name}") for name in (STARTED_MARKER, EXIT_STATUS_FILE))
    status_tmp = shell_word(f"{folder}/{EXIT_STATUS_FILE}.tmp")
    step = (f"(exec srun --kill-on-bad-exit=1 --nodes={replicas} --ntasks={replicas} --ntasks-per-node=1 "
            f"--cpus-per-task={cpus_per_task} /bin/sh {shell_word(f'{folder}/{TASK_SCRIPT}')})")
    lines = ["#!/bin/sh",
             "# Written by the irisfed peer agent: a start marker, the gang's tasks as one srun step, its exit.",
             f"printf '%s\\n' \"${{SLURM_JOB_ID-}}\" > {started} || {{ printf 'irisfed: cannot write %s: "
             f"the tasks were not run\\n' {started} >&2; exit 1; }}"]
    return "\n".join(lines + _run_and_record(step, status, status_tmp)) + "\n"


def task_script(command: Sequence[str], env: Mapping[str, str], run_dir: str, workspace: bool = False) -> str:
    """The wrapper srun runs as each task of a gang, on the task's node: it enters
    ``run_dir/task-<i>`` (``i`` = ``SLURM_PROCID``; made when missing: the task's working
    directory), sends its output to ``stdout`` and ``stderr`` there, records its node
    (``SLURMD_NODENAME``) in ``STARTED_MARKER`` — the task is not run when it cannot —
    sets the task's variables, then ``env`` (the job's, without ``TASK_ENV`` names), runs
    ``command`` and records its exit code as ``batch_script`` does (-15: Slurm's SIGTERM).
    A task that got Slurm's SIGTERM itself then exits 0 (srun ends with the highest exit
    code of its tasks: a sibling's 143 would hide the failed task's code); one whose
    command alone died by SIGTERM exits 143, a failure.

    ``IRISFED_TASK_INDEX`` = ``SLURM_PROCID``, ``IRISFED_NUM_TASKS`` = ``SLURM_NTASKS``,
    ``IRISFED_NODE`` = ``SLURMD_NODENAME``, ``IRISFED_COORDINATOR`` =
    ``SLURM_LAUNCH_NODE_IPADDR`` (the address srun runs from: the batch host, the
    allocation's first node, where task 0 runs) and a port of ``COORDINATOR_PORT_BASE``
    + the job id modulo ``COORDINATOR_PORT_SPAN``. They are set before the job's own
    variables, from Slurm's, so the job cannot change them. Paths after the ``cd`` are
    relative: a job variable cannot redirect them. ``IRISFED_OUTPUT_DIR`` is the task
    folder's ``outputs`` (made here); with ``workspace`` the command runs in the task
    folder's ``workspace`` (the agent copied it there before submitting).
    """
    exports, run = _job_lines(command, {name: value for name, value in env.items() if name not in TASK_ENV},
                              "workspace" if workspace else "")
    folder = shell_word(run_dir.rstrip("/") or "/")
    task_dir = '"task-${SLURM_PROCID-}"'
    port = f"$(({COORDINATOR_PORT_BASE} + ${{SLURM_JOB_ID:-0}} % {COORDINATOR_PORT_SPAN}))"
    lines = ["#!/bin/sh",
             "# Written by the irisfed peer agent: one task of a gang, run by srun on its node: its folder,",
             "# output and start marker, the task's and the job's environment, its command, its exit.",
             f"cd {folder} && command -p mkdir -p {task_dir} && cd {task_dir} || {{ printf 'irisfed: cannot enter "
             f"%s: the task was not run\\n' {task_dir} >&2; exit 1; }}",
             "exec >stdout 2>stderr",
             f"printf '%s\\n' \"${{SLURMD_NODENAME-}}\" > {STARTED_MARKER} || {{ printf 'irisfed: cannot write %s: "
             f"the task was not run\\n' {STARTED_MARKER} >&2; exit 1; }}",
             'export IRISFED_TASK_INDEX="${SLURM_PROCID-}" IRISFED_NUM_TASKS="${SLURM_NTASKS-}" '
             'IRISFED_NODE="${SLURMD_NODENAME-}"',
             f'export IRISFED_COORDINATOR="${{SLURM_LAUNCH_NODE_IPADDR-}}:{port}"',
             'command -p mkdir -p outputs && export IRISFED_OUTPUT_DIR="$PWD/outputs"']
    status_tmp = f"{EXIT_STATUS_FILE}.tmp"
    ending = ["irisfed_signal=", "trap 'irisfed_signal=15' TERM", run, "irisfed_status=$?",
              'irisfed_code=$irisfed_status',
              # Killed by SIGTERM (sh says 143), or this shell got it: Slurm's TERM, recorded as -15.
              '[ "$irisfed_status" != 143 ] && [ -z "$irisfed_signal" ] || irisfed_code=-15',
              f"printf '%s\\n' \"$irisfed_code\" > {status_tmp} && command -p mv -f {status_tmp} {EXIT_STATUS_FILE}",
              # Slurm ended the step (a sibling failed, a cancel, the time limit): the gang's fate
              # is decided there, so srun hears 0 from this task and its own exit code stays the
              # failed sibling's (srun exits with the highest of its tasks', 128 + N for a signal).
              '[ -z "$irisfed_signal" ] || exit 0',
              'exit "$irisfed_status"']
    return "\n".join(lines + exports + ending) + "\n"


class GangFile(NamedTuple):
    """What a restarted agent needs to follow a gang (its run folder's ``GANG_FILE``):
    its task count, its start timeout, and, as a Unix time, when its tasks must run by."""

    replicas: int
    start_timeout_s: float
    start_by: float


def gang_file_text(gang: GangFile) -> str:
    return f"{gang.replicas} {gang.start_timeout_s:.3f} {gang.start_by:.3f}\n"


def parse_gang_file(text: str | None) -> GangFile | None:
    """A ``GANG_FILE``'s text (None: no file) → GangFile; None for anything else."""
    number = r"([0-9]{1,12}(?:\.[0-9]{1,6})?)"
    match = re.fullmatch(rf"\s*([0-9]{{1,5}}) {number} {number}\s*", text or "")
    if match is None or not 1 <= int(match.group(1)) <= MAX_GANG_TASKS:
        return None
    return GangFile(int(match.group(1)), float(match.group(2)), float(match.group(3)))


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
