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
- the batch script records in the run folder that the run started
  (``STARTED_MARKER``), sets the job's environment, runs its command without ever
  letting the shell interpret a value (each word single-quoted) and records its
  exit code (``EXIT_STATUS_FILE``): once Slurm forgot a job, that folder alone says
  how the run ended (``forgotten_outcome``).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from irisfed.shared.resources import CPU, GPU, MEMORY_MB, RESOURCE_NAME_PATTERN, fmt_amount

NAME_PREFIX = "irisfed-"
COMMENT_PREFIX = "irisfed:"
# `squeue -O`: a field's suffix is printed after it, and a field without a width is
# printed whole (no padding, no truncation). The comment, free text, comes last.
SQUEUE_FORMAT = "JobID:|,State:|,exit_code:|,Name:|,Comment:"
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

    @property
    def live(self) -> bool:
        return self.state not in TERMINAL_STATES  # an unknown new state: still waited for


def parse_squeue_line(line: str, comment: str) -> SlurmJob | None:
    """A line of ``squeue -h -O SQUEUE_FORMAT`` → the run, when it is a run with this
    ``comment``; None for any other job (another peer's, a person's, a malformed line).

    Name and comment may both hold ``|``: the comment is recognised as the line's end.
    """
    line = line.rstrip("\n")
    head = line.split("|", 3)
    if len(head) != 4 or not line.endswith("|" + comment):
        return None
    slurm_id, state, status, rest = head
    name = rest[: len(rest) - len(comment) - 1]
    run = parse_job_name(name)
    if run is None or not slurm_id.isdigit():
        return None  # array and heterogeneous job ids (`12_3`, `12+1`) are none of ours
    return SlurmJob(slurm_id, state.split()[0] if state.strip() else "", _int(status), run[0], run[1])


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
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
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


def node_usable(state: str) -> bool:
    """Whether a node in ``State=...`` (``IDLE+DRAIN``, ``DOWN*``) may run new jobs."""
    if not state or "*" in state:  # `*`: the node does not respond
        return False
    return not any(word in UNUSABLE_NODE_STATES for word in state.split("+"))


def parse_node(fields: Mapping[str, str]) -> Node:
    """A node of ``scontrol show node -o -d`` (one parsed line)."""
    gres, gpu_types = parse_gres(fields.get("Gres", ""))
    gres_used, _ = parse_gres(fields.get("GresUsed", ""))
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
                total, used, tuple(gpu_types.get(GPU, ())))


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
        for name, amount in node.total.items():
            totals[name] = totals.get(name, 0) + amount
            spare = max(0, amount - node.used.get(name, 0)) if node.usable else 0
            free[name] = free.get(name, 0) + spare
        gpu_types += [kind for kind in node.gpu_types if kind not in gpu_types]
    return Capacity({name: (totals[name], free[name]) for name in totals}, sorted(gpu_types), shapes)


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


# ---------------------------------------------------------------- the batch script


def shell_word(value: str) -> str:
    """``value`` as one shell word the shell never interprets. A carriage return is
    written as ``$(printf '\\r')`` (sbatch refuses scripts holding ``\\r\\n``)."""
    return "\"$(printf '\\r')\"".join(shlex.quote(part) for part in value.split("\r"))


def batch_script(command: Sequence[str], env: Mapping[str, str], run_dir: str) -> str:
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
    Raises ScriptError for what cannot be passed.
    """
    if not command:
        raise ScriptError("the job has no command")
    words = [*command, *env, *env.values()]
    if any("\0" in word for word in words):
        raise ScriptError("a NUL character cannot be passed to a job (command or environment)")
    bad = [name for name in env if not name or "=" in name]
    if bad:
        raise ScriptError(f"environment variable name {bad[0]!r} is empty or holds '='")
    folder = run_dir.rstrip("/") or "/"
    started, status = (shell_word(f"{folder}/{name}") for name in (STARTED_MARKER, EXIT_STATUS_FILE))
    status_tmp = shell_word(f"{folder}/{EXIT_STATUS_FILE}.tmp")
    lines = ["#!/bin/sh",
             "# Written by the irisfed peer agent: a start marker, the job's environment, its command, its exit.",
             f"printf '%s\\n' \"${{SLURM_JOB_ID-}}\" > {started} || {{ printf 'irisfed: cannot write %s: "
             f"the command was not run\\n' {started} >&2; exit 1; }}"]
    lines += [f"export {name}={shell_word(value)}" for name, value in env.items()
              if _SHELL_NAME.fullmatch(name)]
    others = [f"{name}={value}" for name, value in env.items() if not _SHELL_NAME.fullmatch(name)]
    if others or command[0].startswith("-"):  # sh would take neither for a command, env does
        if "=" in command[0]:
            why = (f"the environment names {others[0].split('=')[0]!r}, not a shell name" if others
                   else "it starts with '-'")
            raise ScriptError(f"the program {command[0]!r} holds '=' and must be started through env "
                              f"({why}), which would read it as a variable")
        run = " ".join(["(exec /usr/bin/env --", *map(shell_word, others), *map(shell_word, command)]) + ")"
    else:  # exec in a subshell: a program, never a builtin of the same name (echo, kill ...)
        run = " ".join(["(exec", *map(shell_word, command)]) + ")"
    # After the exports: a job variable of the same name cannot preset them.
    lines += ["irisfed_signal=", "trap 'irisfed_signal=15' TERM", run, "irisfed_status=$?",
              # Killed by SIGTERM (sh says 143) is Slurm's TERM whichever process it reached first.
              '[ "$irisfed_status" != 143 ] || irisfed_signal=15',
              'irisfed_code=$irisfed_status',
              '[ -z "$irisfed_signal" ] || irisfed_code=-$irisfed_signal',
              f"printf '%s\\n' \"$irisfed_code\" > {status_tmp} && command -p mv -f {status_tmp} {status}",
              '[ -z "$irisfed_signal" ] || { trap - TERM; kill -s TERM "$$"; }',
              'exit "$irisfed_status"']
    return "\n".join(lines) + "\n"
