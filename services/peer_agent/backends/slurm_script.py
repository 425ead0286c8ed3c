"""What the Slurm backend hands ``sbatch`` and ``scancel``: options and batch scripts.
Pure: no I/O.

- ``sbatch`` options for what a run asks (``slurm_request``: ``resource_args``,
  ``gang_args``, ``time_limit_args``, ``group_constraint``, ``output_path``), and the
  ``scancel`` calls that stop it (``term_commands``);
- the batch script (``batch_script``) records in the run folder that the run started
  (``STARTED_MARKER``), sets the job's environment, runs its command without ever
  letting the shell interpret a value (each word single-quoted: ``shell_word``) and
  records its exit code (``EXIT_STATUS_FILE``), which ``slurm_text.forgotten_outcome``
  reads once Slurm forgot the job;
- a gang is one batch job of N nodes, one task each (``gang_args``), whose script
  (``gang_batch_script``) runs ``srun --kill-on-bad-exit=1`` over a task wrapper
  (``task_script``) that records each task's node and exit code in ``task-<i>/``
  (read back by ``slurm_text.gang_outcome`` and ``gang_tasks``); ``GANG_FILE``
  (``GangFile``) keeps what a restarted agent needs to follow it.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from irisfed.services.peer_agent.backends.slurm_nodes import Node, feature_attribute
from irisfed.services.peer_agent.backends.slurm_text import EXIT_STATUS_FILE, STARTED_MARKER
from irisfed.shared.resources import CPU, MEMORY_MB

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

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ScriptError(ValueError):
    """A job that cannot be written as a batch script; the message says why."""


def output_path(path: str) -> str:
    """A path as ``sbatch -o/-e`` takes it literally (``%`` starts a pattern there)."""
    return path.replace("%", "%%")


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


def gang_args(replicas: int, request: Mapping[str, int], constraint: str = "") -> list[str]:
    """``sbatch`` options for a gang of ``replicas`` tasks, each asking ``request``: one
    task per node (``--nodes=N --ntasks=N --ntasks-per-node=1``), so the per-node
    ``--mem`` and ``--gres`` of ``resource_args`` are per task, as ``-c`` is."""
    args = [f"--nodes={replicas}", f"--ntasks={replicas}", "--ntasks-per-node=1", *resource_args(request)]
    return args + ([f"--constraint={constraint}"] if constraint else [])


# ---------------------------------------------------------------- time limit and stop (docs/design.md §3.7)


def time_limit_args(time_limit_s: float | None, grace_s: float) -> list[str]:
    """``sbatch`` options for a run's time limit (none without one): ``--time`` in whole
    minutes, ceil((``time_limit_s`` + ``grace_s``) / 60) + 1. The agent stops the run
    itself at its limit (SIGTERM, SIGKILL ``grace_s`` later); Slurm's limit is the
    backstop for when no agent does, a little later. Slurm ends a run past it as
    TIMEOUT (SIGTERM, SIGKILL after KillWait; it checks limits about every 30 s), which
    ``outcome`` makes the job's own failure, never a loss."""
    if time_limit_s is None:
        return []
    return [f"--time={math.ceil((time_limit_s + grace_s) / 60 - 1e-9) + 1}"]


def term_commands(slurm_id: str, gang: bool) -> list[list[str]]:
    """The ``scancel`` calls, in order, that send SIGTERM alone to a running run's
    processes (Slurm refuses them for a pending job, and changes no job state: the
    run ends as its processes do).

    A single run: ``--signal=TERM --full``, the batch shell and every process under it
    (the command; without ``--full`` only job steps are signalled, and a single run has
    none; ``--batch`` alone reaches the shell, not its children). The shell records
    -15 (``batch_script``) once the command ends, then ends by SIGTERM itself: Slurm says
    FAILED, ``ExitCode=0:15``, and ``outcome`` -15, killed.

    A gang: the batch shell alone (``--batch``), then the job's steps (no option): the
    tasks, each of which records -15 and exits 0 (``task_script``). Never ``--full``:
    ``srun`` turns a SIGTERM of its own into SIGKILL for every task ("forcing job
    termination"), which would leave them no grace. The shell first, so that a gang
    whose tasks got SIGTERM always ends as killed, never succeeded."""
    if not gang:
        return [["scancel", "--signal=TERM", "--full", slurm_id]]
    return [["scancel", "--signal=TERM", "--batch", slurm_id], ["scancel", "--signal=TERM", slurm_id]]


def group_constraint(key: str, nodes: Iterable[Node]) -> str | None:
    """Slurm's "matching OR" over every feature of ``nodes`` that stands for attribute
    ``key``: ``[rack:a|rack:b]`` — all of a job's nodes have the same one of them
    (sbatch(1), ``--constraint``). None when no node has such a feature."""
    features = sorted({feature for node in nodes for feature in node.features
                       if feature_attribute(feature)[0] == key})
    return "[" + "|".join(features) + "]" if features else None


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
