"""What the ``ray`` backend says to and reads from the Ray Jobs API about a run. Pure,
no I/O.

- Names: each run is the Ray job ``irisfed-<job_id>-e<epoch>`` (its submission id),
  tagged with metadata naming our peer, job and epoch; a job whose metadata names
  another peer (or none) is never ours, whatever its id says.
- Submission: the command as one shell line (``shlex.join``: Ray runs the
  entrypoint through a shell, so every argument is quoted and reaches the program
  literally) after a shell-only prefix that sets the job's environment plus
  ``IRISFED_JOB_ID``/``IRISFED_EPOCH`` verbatim (``entrypoint``, ``job_env``), and
  its resources as Ray's entrypoint resources (``submit_resources``). Ray never
  refuses a job it can never run (it waits PENDING, then fails it after 15
  minutes): ``too_big`` says so before submitting.
- Stopping: Ray's stop timeout for the job, its grace (``stop_env``).
- Outcomes: a terminal Ray job → its exit code, or ``RunLost`` when Ray's own
  machinery failed it (``exit_code``).

What the cluster has (``GET /api/cluster_status``, ``GET /api/v0/nodes``) is read by
``ray_capacity.py``; a gang's driver job and its log by ``ray_gang_text.py``. See
tooling/engines/ray.py for the measured behaviour of the API these follow.
"""

from __future__ import annotations

import base64
import hmac
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from irisfed.services.peer_agent.backends import ray_gang as driver
from irisfed.services.peer_agent.backends.contract import (
    KILLED_EXIT_CODE,
    RunLost,
)
from irisfed.services.peer_agent.backends.ray_capacity import MIB, TPU, ClusterReport
from irisfed.shared.resources import CPU, GPU, MEMORY_MB, fmt_amount

PREFIX = "irisfed-"
META_PEER, META_JOB, META_EPOCH = "irisfed_peer", "irisfed_job", "irisfed_epoch"
# A random value per run, kept in its run folder before it is submitted: anyone who
# reaches the dashboard can submit a job with our name and metadata, but not this.
META_NONCE = "irisfed_nonce"
# A gang's run (more than one task): how many, and its start timeout (for adoption).
META_TASKS, META_START_TIMEOUT = "irisfed_tasks", "irisfed_start_timeout_s"
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# The longest part of a Ray message quoted in a RunLost (Ray's messages carry up to
# 20,000 characters of log tail).
MESSAGE_CHARS = 500

_SUBMISSION_RE = re.compile(r"^irisfed-(.+)-e(\d+)$")


# ------------------------------------------------------------------ names


def submission_id(job_id: str, epoch: int) -> str:
    return f"{PREFIX}{job_id}-e{epoch}"


def parse_submission_id(text: str | None) -> tuple[str, int] | None:
    """(job id, epoch) of one of our submission ids, None for any other id."""
    match = _SUBMISSION_RE.match(text or "")
    return (match.group(1), int(match.group(2))) if match else None


def metadata(peer_id: str, job_id: str, epoch: int, nonce: str = "", tasks: int = 1,
             start_timeout_s: float = 0.0) -> dict[str, str]:
    meta = {META_PEER: peer_id, META_JOB: job_id, META_EPOCH: str(epoch)}
    if nonce:
        meta[META_NONCE] = nonce
    if tasks > 1:
        meta.update({META_TASKS: str(tasks), META_START_TIMEOUT: f"{start_timeout_s:g}"})
    return meta


def gang_of(meta: Mapping[str, str] | None) -> tuple[int, float] | None:
    """(tasks, start timeout) of a gang's run by its metadata; None for a single task."""
    meta = meta or {}
    tasks = meta.get(META_TASKS, "")
    if not tasks.isdigit() or int(tasks) < 2:
        return None
    try:
        start_timeout_s = float(meta.get(META_START_TIMEOUT, ""))
    except ValueError:
        start_timeout_s = 0.0
    return int(tasks), start_timeout_s


def submitted_by_us(meta: Mapping[str, str] | None, recorded: str | None) -> bool:
    """Whether a Ray job whose metadata names our run was submitted by this peer, given
    the nonce its run folder ``recorded`` before submitting ("": a folder without one,
    made by an agent that predates nonces; None: no run folder, so never submitted).
    A job someone else made under our name (the name and metadata are no secret)
    carries no nonce, or another one."""
    if recorded is None:
        return False
    given = (meta or {}).get(META_NONCE, "")
    return hmac.compare_digest(given.encode(), recorded.encode())


def owned_run(sub_id: str | None, meta: Mapping[str, str] | None, peer_id: str) -> tuple[str, int] | None:
    """(job id, epoch) when a Ray job is a run of ``peer_id`` (its metadata names it and
    agrees with the submission id); None otherwise."""
    meta = meta or {}
    if meta.get(META_PEER) != peer_id:
        return None
    job_id, epoch_text = meta.get(META_JOB), meta.get(META_EPOCH, "")
    if not job_id or not epoch_text.isdigit():
        return None
    epoch = int(epoch_text)
    return (job_id, epoch) if sub_id == submission_id(job_id, epoch) else None


# ------------------------------------------------------------------ submission


# Ray expands ``$NAME`` and ``${NAME}`` in ``runtime_env.env_vars`` values (and drops
# unknown ``${NAME}``), so the job's own variables travel in one variable, base64 (no
# ``$`` in that alphabet) of shell text that sets them (``_env_script``). The
# entrypoint's shell decodes it with ``base64 -d`` (coreutils or busybox on the node),
# ``eval``s it and ``exec``s the command: builtins and one small process, where a
# Python wrapper started an interpreter before every job (340 ms, 940 ms through a
# pyenv shim, against 9 ms for ``sh -c true`` on 2 loaded cores). A failed decode
# stops the line (``&&``): the command never runs without its variables.
ENV_VARIABLE = "IRISFED_ENV_B64"
_DECODED = "irisfed_env"  # the shell variable holding the decoded text (unset by it)
# The most one argument may hold (Linux MAX_ARG_STRLEN, 128 KiB with its NUL): Ray
# runs the entrypoint as ``sh -c <line>``, and starts its job supervisor's worker with
# the whole runtime env (``env_vars`` included) serialised in one argument. Past it the
# exec fails (E2BIG), and Ray retries the worker for minutes before it fails the job
# (JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE), which would count as lost and be retried. So
# a longer entrypoint, or an encoded env beyond ``ENV_MAX_CHARS`` (room left for the
# rest of that argument), is refused before submitting. Quoting for the shell can make
# a value five times longer (each ``'`` is ``'"'"'``): a 64 KB submit may not fit.
ARG_MAX_CHARS = 128 * 1024 - 1
ENV_MAX_CHARS = 96 * 1024
_UNWRAP = f'{_DECODED}=$(printf %s "${ENV_VARIABLE}" | base64 -d) && eval "${_DECODED}" && exec'
# Names ``export`` takes; any other goes to ``env`` as a NAME=VALUE argument.
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check(command: Sequence[str], env: Mapping[str, str]) -> None:
    """Raises ValueError for what no process can be given (the message says why)."""
    if not command:
        raise ValueError("the job has no command")
    if any("\0" in word for word in [*command, *env, *env.values()]):
        raise ValueError("a NUL character cannot be passed to a job (command or environment)")
    bad = [name for name in env if not name or "=" in name]
    if bad:
        raise ValueError(f"environment variable name {bad[0]!r} is empty or holds '='")


def _through_env(command: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the command starts through ``/usr/bin/env``: for a name ``export`` cannot
    set, or a program whose name starts with ``-`` (``exec`` would take it for an option)."""
    return command[0].startswith("-") or any(not _SHELL_NAME.fullmatch(name) for name in env)


def entrypoint(command: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The shell line Ray runs: set the job's variables ``env`` from ``ENV_VARIABLE``
    (``job_env``), then ``exec`` the command, each argument quoted so none is
    expanded by the shell. Raises ValueError for what cannot be passed (a line
    longer than ``ARG_MAX_CHARS``)."""
    env = env or {}
    _check(command, env)
    if not _through_env(command, env):
        line = f"{_UNWRAP} {shlex.join(command)}"
    elif "=" in command[0]:
        raise ValueError(f"the program {command[0]!r} holds '=' and must be started through env (an "
                         "environment name that is not a shell name, or a leading '-'), which would "
                         "read it as a variable")
    else:
        line = f'{_UNWRAP} /usr/bin/env -- "$@" {shlex.join(command)}'
    if len(line.encode()) > ARG_MAX_CHARS:
        raise ValueError(f"the command is {len(line.encode())} bytes once quoted for Ray's shell; "
                         f"a Ray entrypoint may hold at most {ARG_MAX_CHARS}")
    return line


def _env_script(variables: Mapping[str, str]) -> str:
    """Shell text that sets ``variables`` verbatim: ``export NAME='VALUE'`` for shell
    names, the rest as ``NAME=VALUE`` words in ``"$@"`` for ``/usr/bin/env``. It first
    unsets the encoded variable and itself, so the command sees neither (unless the
    job names them)."""
    lines = [f"unset {_DECODED} {ENV_VARIABLE}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in variables.items()
              if _SHELL_NAME.fullmatch(name)]
    others = [shlex.quote(f"{name}={value}") for name, value in variables.items() if not _SHELL_NAME.fullmatch(name)]
    if others:
        lines.append("set -- " + " ".join(others))
    return "\n".join(lines) + "\n"


def job_env(env: Mapping[str, str], job_id: str, epoch: int) -> dict[str, str]:
    """What goes in ``runtime_env.env_vars``: the job's own variables and its identity,
    encoded (see ``ENV_VARIABLE``); nothing of the agent's environment. Raises
    ValueError for a variable no process can be given."""
    _check(["-"], env)
    variables = {**env, "IRISFED_JOB_ID": job_id, "IRISFED_EPOCH": str(epoch)}
    encoded = base64.b64encode(_env_script(variables).encode()).decode()
    if len(encoded) > ENV_MAX_CHARS:
        raise ValueError(f"the job's environment is {len(encoded)} characters once quoted and encoded for "
                         f"Ray; at most {ENV_MAX_CHARS} fit (Ray passes it to a process as one argument)")
    return {ENV_VARIABLE: encoded, "IRISFED_JOB_ID": job_id, "IRISFED_EPOCH": str(epoch)}


def ray_name(name: str, ray_names: Mapping[str, str]) -> str:
    """Ray's name for an extended resource: the one discovery saw, else ``TPU`` for
    ``tpu`` and the name itself for the rest."""
    return ray_names.get(name) or ("TPU" if name == TPU else name)


def submit_resources(request: Mapping[str, float],
                     ray_names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``submit_job`` keyword arguments for a normalised request. ``cpu`` is always
    given (Ray counts an unnamed one as 0, not 1; an absent ``cpu`` means 1 here as
    everywhere in irisfed); memory goes in bytes."""
    ray_names = ray_names or {}
    kwargs: dict[str, Any] = {"entrypoint_num_cpus": request.get(CPU, 1)}
    custom: dict[str, float] = {}
    for name, amount in request.items():
        if name == CPU or not amount:
            continue
        if name == GPU:
            kwargs["entrypoint_num_gpus"] = amount
        elif name == MEMORY_MB:
            kwargs["entrypoint_memory"] = int(amount * MIB)
        else:
            custom[ray_name(name, ray_names)] = amount
    if custom:
        kwargs["entrypoint_resources"] = custom
    return kwargs


def too_big(request: Mapping[str, float], report: ClusterReport) -> str | None:
    """Why Ray could never start ``request`` (a resource asked beyond what any one node
    has; the entrypoint runs on one node), or None when some node could."""
    asked = {name: amount for name, amount in request.items() if amount and name != CPU}
    if request.get(CPU, 1):
        asked[CPU] = request.get(CPU, 1)
    nodes = ([node.totals() for node in report.nodes]
             or [{name: total for name, (total, _) in report.discovered.resources.items()}])
    for name, amount in sorted(asked.items()):
        most = max(node.get(name, 0) for node in nodes)
        if amount > most + 1e-9:
            cluster = report.discovered.resources.get(name, (0, 0))[0]
            return (f"the job asks for {name}={fmt_amount(amount)} but the largest Ray node has "
                    f"{name}={fmt_amount(most)} ({fmt_amount(cluster)} in the whole cluster): "
                    "Ray would keep it pending until it fails it")
    if not any(all(amount <= node.get(name, 0) + 1e-9 for name, amount in asked.items()) for node in nodes):
        wanted = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in sorted(asked.items()))
        return f"no single Ray node has all of {wanted}: Ray would keep the job pending until it fails it"
    return None


def already_exists(error: BaseException) -> bool:
    """Whether ``submit_job`` failed because the submission id is taken (HTTP 500 with
    ``ValueError: Job with submission_id X already exists``)."""
    return "already exists" in str(error)


# ------------------------------------------------------------------ stopping (docs/design.md §3.7)


# Ray's job supervisor reads this from its own environment, which holds the job's
# ``runtime_env.env_vars``: for that job alone, the seconds between ``stop_job``'s
# SIGTERM (to the entrypoint's process and every descendant it has then) and its
# SIGKILL, a whole number (3 when unset). Ray 2.60, job_supervisor.py.
STOP_WAIT_VARIABLE = "RAY_JOB_STOP_WAIT_TIME_S"
# A gang's driver, stopped, cancels its tasks (each command: SIGTERM, SIGKILL a grace
# later), forces a cancel not done ``FORCE_AFTER_S`` after that and gives it up as long
# again, then prints its end line: Ray waits that much longer before it SIGKILLs the driver.
GANG_STOP_MARGIN_S = 2 * driver.FORCE_AFTER_S + 5


def stop_wait_s(grace_s: float, gang: bool = False) -> int:
    """``STOP_WAIT_VARIABLE``'s seconds for a run with this grace: the grace, whole
    seconds up (a gang's: with ``GANG_STOP_MARGIN_S`` more, for its driver)."""
    return math.ceil(max(0.0, grace_s) + (GANG_STOP_MARGIN_S if gang else 0) - 1e-9)


def stop_env(grace_s: float, gang: bool = False) -> dict[str, str]:
    """What goes in a job's ``runtime_env.env_vars`` so that Ray's ``stop_job`` gives it
    its grace (``stop_wait_s``) before SIGKILL. The job's own variables travel encoded
    (``job_env``): none of them can change it."""
    return {STOP_WAIT_VARIABLE: str(stop_wait_s(grace_s, gang))}


# ------------------------------------------------------------------ outcomes


@dataclass(frozen=True)
class JobState:
    """What the poller keeps of a Ray ``JobDetails``."""

    status: str
    driver_exit_code: int | None = None
    error_type: str | None = None
    message: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def status_name(status: object) -> str:
    """``JobStatus.FAILED`` (a str enum) or ``"FAILED"`` → ``"FAILED"``."""
    return str(getattr(status, "value", status))


def job_state(details: Any) -> JobState:
    """The fields of a ``JobDetails`` (or ``JobInfo``) an outcome depends on."""
    error_type = getattr(details, "error_type", None)
    return JobState(status_name(details.status), getattr(details, "driver_exit_code", None),
                    None if error_type is None else status_name(error_type),
                    getattr(details, "message", None))


def exit_code(state: JobState, kill_requested: bool = False) -> int:
    """The run's exit code once its Ray job ended; raises ``RunLost`` when Ray failed it
    without the entrypoint ever exiting (supervisor died or never started, runtime
    environment setup failed, waited too long for resources ...).

    SUCCEEDED → 0; STOPPED → ``KILLED_EXIT_CODE``; FAILED with a driver exit code →
    that code (the job's own failure). FAILED without one after we asked to stop it
    is a kill too: Ray 2.60 reports FAILED when the entrypoint of a pending job it
    was asked to stop ended on its own first.
    """
    if state.status == "SUCCEEDED":
        return 0
    if state.status == "STOPPED":
        return KILLED_EXIT_CODE
    if state.status != "FAILED":
        raise ValueError(f"the Ray job has not ended (status {state.status})")
    if state.driver_exit_code is not None:
        return int(state.driver_exit_code)
    if kill_requested:
        return KILLED_EXIT_CODE
    message = (state.message or "no message").strip()
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + "..."
    why = state.error_type or "no error type"
    raise RunLost(f"Ray failed the job before its command ended ({why}): {message}")


def forgotten(sub_id: str) -> str:
    """Why a run is lost whose Ray job the head no longer lists (a restarted head
    forgets every job)."""
    return f"the Ray head no longer knows job {sub_id} (restarted, or the job was deleted)"
