"""What the ``ray`` backend says to and reads from the Ray Jobs API. Pure, no I/O.

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
- Outcomes: a terminal Ray job → its exit code, or ``RunLost`` when Ray's own
  machinery failed it (``exit_code``).
- Capacity: ``GET /api/cluster_status`` and ``GET /api/v0/nodes`` → ``Discovered``,
  its nodes grouped (``cluster_report``).
- Gangs: the driver's job (``ray_gang.py``: its source, its run in one variable, a
  bootstrap entrypoint), a placement group bundle per task (``gang_bundle``), whether
  the cluster could ever hold the gang (``gang_problem``), and its log read back: the
  ``started`` line, the ``end`` line and each task's output (``read_gang_log``,
  ``gang_exit_code``).

See tooling/engines/ray.py for the measured behaviour of the API these follow.
"""

from __future__ import annotations

import base64
import hmac
import json
import re
import shlex
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from irisfed.services.peer_agent.backends import KILLED_EXIT_CODE, Discovered, RunLost
from irisfed.services.peer_agent.backends import ray_gang as driver
from irisfed.shared.nodes import group_nodes
from irisfed.shared.resources import CPU, GPU, MEMORY_MB, RESOURCE_NAME_PATTERN, SLOTS, fmt_amount

PREFIX = "irisfed-"
META_PEER, META_JOB, META_EPOCH = "irisfed_peer", "irisfed_job", "irisfed_epoch"
# A random value per run, kept in its run folder before it is submitted: anyone who
# reaches the dashboard can submit a job with our name and metadata, but not this.
META_NONCE = "irisfed_nonce"
# A gang's run (more than one task): how many, and its start timeout (for adoption).
META_TASKS, META_START_TIMEOUT = "irisfed_tasks", "irisfed_start_timeout_s"
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
MIB = 1024 * 1024
TPU = "tpu"
# The longest part of a Ray message quoted in a RunLost (Ray's messages carry up to
# 20,000 characters of log tail).
MESSAGE_CHARS = 500

_SUBMISSION_RE = re.compile(r"^irisfed-(.+)-e(\d+)$")
_NAME_RE = re.compile(RESOURCE_NAME_PATTERN)
# Ray's own resources besides CPU, GPU and memory: never advertised.
_NOT_ADVERTISED = frozenset({"objectStoreMemory", "object_store_memory"})
# Our names Ray's custom resources may not take (they are Ray's built-in ones, or reserved).
_RESERVED = frozenset({CPU, GPU, MEMORY_MB, SLOTS, "memory"})


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


# ------------------------------------------------------------------ gangs


# The driver (ray_gang.py) travels in one variable, zlib then base64 (about 9 KB): the
# entrypoint is a bootstrap that decodes and runs it, because Ray echoes the entrypoint
# into the job's log and ``message``, and ``list_jobs`` answers with every job's
# entrypoint. ``''`` (the current folder, where ``-c`` puts it) leaves ``sys.path``
# first: the head's folder may hold a ``ray`` folder (Ray's temp dir) that ``import
# ray`` would take for Ray.
DRIVER_VARIABLE = "IRISFED_GANG_DRIVER"
_BOOTSTRAP = (
    "import base64,os,sys,zlib\n"
    "if sys.path and sys.path[0]=='':del sys.path[0]\n"
    f"exec(compile(zlib.decompress(base64.b64decode(os.environ['{DRIVER_VARIABLE}'])),'irisfed-gang-driver','exec'))\n"
)


def driver_payload(source: str) -> str:
    """The driver's source as ``DRIVER_VARIABLE`` carries it."""
    return base64.b64encode(zlib.compress(source.encode(), 9)).decode()


def gang_entrypoint(python: str = "python3") -> str:
    """The shell line of a gang's Ray job: the node's ``python`` runs the driver."""
    return f"exec {shlex.quote(python)} -c {shlex.quote(_BOOTSTRAP)}"


def gang_bundle(request: Mapping[str, float], ray_names: Mapping[str, str] | None = None) -> dict[str, float]:
    """One task's placement group bundle in Ray's names: ``CPU`` (1 when not asked, as
    everywhere in irisfed), ``GPU``, ``memory`` (bytes) and custom resources. Raises
    ValueError for a task asking nothing (Ray refuses an empty bundle)."""
    asked = submit_resources(request, ray_names)
    bundle = {"CPU": asked["entrypoint_num_cpus"], "GPU": asked.get("entrypoint_num_gpus", 0),
              "memory": asked.get("entrypoint_memory", 0), **asked.get("entrypoint_resources", {})}
    bundle = {name: amount for name, amount in bundle.items() if amount}
    if not bundle:
        raise ValueError("a gang's task asks for no resource at all, and a Ray placement group "
                         "bundle cannot be empty")
    return bundle


def gang_env(command: Sequence[str], env: Mapping[str, str], job_id: str, epoch: int, replicas: int,
             bundle: Mapping[str, float], group_by: str, start_timeout_s: float, payload: str) -> dict[str, str]:
    """``runtime_env.env_vars`` of a gang's job: the driver (``payload``) and its run,
    base64 of JSON (no ``$`` for Ray to expand; the job's variables reach each task
    verbatim, with ``IRISFED_JOB_ID``, ``IRISFED_EPOCH`` and ``IRISFED_NUM_TASKS``; the
    driver adds the task's own). Raises ValueError for what cannot be passed, or
    when it all passes ``ENV_MAX_CHARS`` (Ray hands the runtime env to every worker it
    starts as one argument)."""
    _check(command, env)
    task_env = {**env, "IRISFED_JOB_ID": job_id, "IRISFED_EPOCH": str(epoch), "IRISFED_NUM_TASKS": str(replicas)}
    spec = {"command": list(command), "env": task_env, "replicas": replicas, "bundle": dict(bundle),
            "group_by": group_by, "start_timeout_s": start_timeout_s}
    encoded = base64.b64encode(json.dumps(spec).encode()).decode()
    if len(encoded) + len(payload) > ENV_MAX_CHARS:
        raise ValueError(f"the job's command and environment are {len(encoded)} characters once encoded for "
                         f"Ray; with the gang's driver ({len(payload)}) at most {ENV_MAX_CHARS} fit (Ray "
                         "passes them to a process as one argument)")
    return {driver.SPEC_VARIABLE: encoded, DRIVER_VARIABLE: payload, "IRISFED_JOB_ID": job_id,
            "IRISFED_EPOCH": str(epoch)}


def gang_problem(request: Mapping[str, float], replicas: int, group_by: str, report: ClusterReport) -> str | None:
    """Why Ray could never start a gang of ``replicas`` tasks each asking ``request``:
    too few alive nodes whose totals hold one task (sharing one value of the node label
    ``group_by``); None when enough could, or the head reports no nodes."""
    if not report.nodes:
        return None
    asked = {name: amount for name, amount in request.items() if amount}
    asked[CPU] = request.get(CPU, 1)
    fitting = [node for node in report.nodes
               if all(amount <= node.resources.get(name, (0.0, 0.0))[0] + 1e-9 for name, amount in asked.items()
                      if amount)]
    if group_by:
        per_value: dict[str, int] = {}
        for node in fitting:
            for value in node.attributes.get(group_by, []):
                per_value[value] = per_value.get(value, 0) + 1
        most = max(per_value.values(), default=0)
    else:
        most = len(fitting)
    if most >= replicas:
        return None
    task = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in sorted(asked.items()) if amount)
    shared = f" sharing one {group_by}" if group_by else ""
    return (f"the gang needs {replicas} Ray nodes{shared} that can each hold {task}; the cluster has "
            f"{most}: Ray would keep it waiting until its start timeout")


@dataclass(frozen=True)
class GangLog:
    """A gang's job log read back: the ``started`` line's nodes (None: not there), the
    ``end`` line's fields (None: not there) and each task's output, ``{(index, "out" or
    "err"): text}``."""

    started: list[str | None] | None = None
    end: dict[str, Any] | None = None
    outputs: dict[tuple[int, str], str] = field(default_factory=dict)


_TASK_LINE = re.compile(rf"^{re.escape(driver.TASK_MARK)} (\d+) (out|err)([{re.escape(driver.LINE_END)}"
                        rf"{re.escape(driver.PIECE_END)}]) (.*)$")
_GANG_LINE = re.compile(rf"^{re.escape(driver.GANG_MARK)} (started|end) (\{{.*\}})$")


def _gang_fields(line: str) -> tuple[str, dict] | None:
    match = _GANG_LINE.match(line)
    if match is None:
        return None
    try:
        fields = json.loads(match.group(2))
    except ValueError:
        return None
    return (match.group(1), fields) if isinstance(fields, dict) else None


def gang_started(log: str) -> list[str | None] | None:
    """The nodes of the ``started`` line of a gang's log (every task runs), None before it."""
    for line in log.splitlines():
        found = _gang_fields(line)
        if found is not None and found[0] == "started":
            nodes = found[1].get("nodes")
            return list(nodes) if isinstance(nodes, list) else []
    return None


def read_gang_log(log: str, replicas: int) -> GangLog:
    """What a gang's driver said in its job's log: each task's stdout and stderr put back
    together (a ``|`` line had a newline, a ``~`` piece did not), and its ``started`` and
    ``end`` lines. Every other line (Ray's own) is ignored."""
    started, end = None, None
    pieces: dict[tuple[int, str], list[str]] = {}
    for line in log.split("\n"):
        match = _TASK_LINE.match(line)
        if match is not None:
            index = int(match.group(1))
            if index < replicas:
                text = match.group(4) + ("\n" if match.group(3) == driver.LINE_END else "")
                pieces.setdefault((index, match.group(2)), []).append(text)
            continue
        found = _gang_fields(line)
        if found is None:
            continue
        if found[0] == "started" and started is None:
            nodes = found[1].get("nodes")
            started = list(nodes) if isinstance(nodes, list) else []
        elif found[0] == "end":
            end = found[1]
    return GangLog(started, end, {key: "".join(parts) for key, parts in pieces.items()})


def gang_exit_code(state: JobState, log: GangLog | None, kill_requested: bool = False,
                   start_timed_out: str = "") -> int:
    """A gang's exit code once its Ray job ended, read from its driver's ``end`` line:
    0 when every task succeeded, else the first failing task's code; ``KILLED_EXIT_CODE``
    when it was stopped. Raises ``RunLost`` when the driver said the run was lost (a
    task's node died, a task could not start, not all started in time), when the
    backend stopped it for not starting in time (``start_timed_out`` says why), and
    when the driver ended without an ``end`` line though nobody stopped it (it never
    ran, or Ray failed it). ``log`` None (the log could not be read): the driver's own
    exit status stands in for the first failing task's."""
    end = log.end if log is not None else None
    if end is not None and not end.get("killed"):
        if end.get("lost"):
            raise RunLost(str(end["lost"]))
        return int(end.get("exit") or 0)
    if start_timed_out:
        raise RunLost(start_timed_out)
    if state.status == "STOPPED" or (end is not None and end.get("killed")):
        return KILLED_EXIT_CODE
    if log is None:
        return exit_code(state, kill_requested)
    if state.status == "FAILED" and kill_requested:
        return KILLED_EXIT_CODE
    message = (state.message or "no message").strip()[:MESSAGE_CHARS]
    raise RunLost(f"the gang's driver ended ({state.status}) without saying how its tasks did: {message}")


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


# ------------------------------------------------------------------ capacity


# Node labels that name one node alone: advertised, they would make every node a group
# of its own (and a heartbeat of 1,000 nodes 1,000 entries).
PER_NODE_LABELS = frozenset({"ray.io/node-id", "ray.io/tpu-worker-id"})


@dataclass(frozen=True)
class RayNode:
    """One alive node of a Ray cluster: its labels as attributes (``{key: [value]}``) and
    each resource's (total, free) under our names."""

    node_id: str
    attributes: dict[str, list[str]] = field(default_factory=dict)
    resources: dict[str, tuple[float, float]] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        return {name: total for name, (total, _free) in self.resources.items()}


@dataclass(frozen=True)
class ClusterReport:
    """What a Ray cluster has: ``discovered`` (summed over nodes, and its node groups),
    each alive node (``nodes``), and Ray's name of each extended resource
    (``ray_names``: ``{"tpu": "TPU"}``)."""

    discovered: Discovered
    nodes: list[RayNode] = field(default_factory=list)
    ray_names: dict[str, str] = field(default_factory=dict)


def _our_name(ray_resource: str) -> str | None:
    """Our name of a Ray resource, None for one that is never advertised: Ray's
    bookkeeping (``node:<ip>``, ``accelerator_type:<type>``, object store memory,
    placement group ``<name>_group_<id>`` resources) and names that are not valid
    irisfed resource names once lower-cased."""
    if ray_resource == "CPU":
        return CPU
    if ray_resource == "GPU":
        return GPU
    if ray_resource == "memory":
        return MEMORY_MB
    if (ray_resource in _NOT_ADVERTISED or ray_resource.startswith(("node:", "accelerator_type:"))
            or "_group_" in ray_resource):
        return None
    name = ray_resource.lower()
    if name in _RESERVED or not _NAME_RE.match(name):
        return None
    return name


def _pairs(usage: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """``{ray name: (used, total)}``, dropping entries that are not two numbers."""
    pairs = {}
    for name, value in usage.items():
        try:
            used, total = (float(v) for v in value)
        except (TypeError, ValueError):
            continue
        pairs[name] = (used, total)
    return pairs


def _named(pairs: Mapping[str, tuple[float, float]],
           ray_names: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``{our name: (total, free)}``; memory in whole MiB. The first Ray name (sorted)
    of a lower-cased name wins (``TPU`` over ``tpu``)."""
    named: dict[str, tuple[float, float]] = {}
    for ray_resource in sorted(pairs):
        name = _our_name(ray_resource)
        if name is None or (name in named):
            continue
        used, total = pairs[ray_resource]
        free = max(0.0, total - used)
        if name == MEMORY_MB:
            total, free = float(int(total // MIB)), float(int(free // MIB))
        named[name] = (total, free)
        if name not in (CPU, GPU, MEMORY_MB):
            ray_names.setdefault(name, ray_resource)
    return named


def node_attributes(labels: Any) -> dict[str, list[str]]:
    """A node's labels as attributes, but those naming one node alone (``PER_NODE_LABELS``)."""
    if not isinstance(labels, Mapping):
        return {}
    return {str(key): [str(value)] for key, value in sorted(labels.items())
            if key not in PER_NODE_LABELS and isinstance(value, str)}


def _alive_nodes(listed: Iterable[Any], by_node: Mapping[str, Any], ray_names: dict[str, str]) -> list[RayNode]:
    """The nodes the state API says are ALIVE: labels from it, (total, free) from the
    resource report's ``usageByNode``. A node not in that report yet (it refreshes every
    few seconds) offers nothing free until it is."""
    nodes = []
    for entry in listed:
        if not isinstance(entry, Mapping) or entry.get("state") != "ALIVE" or not entry.get("node_id"):
            continue
        node_id = str(entry["node_id"])
        usage = by_node.get(node_id)
        if isinstance(usage, Mapping):
            resources = _named(_pairs(usage), ray_names)
        else:
            totals = entry.get("resources_total") if isinstance(entry.get("resources_total"), Mapping) else {}
            resources = {name: (total, 0.0) for name, (total, _free) in _named(
                _pairs({name: (0.0, amount) for name, amount in totals.items()}), ray_names).items()}
        nodes.append(RayNode(node_id, node_attributes(entry.get("labels")), resources))
    return nodes


def _summed(nodes: Iterable[RayNode]) -> dict[str, tuple[float, float]]:
    """Every node's (total, free) added up, per resource."""
    summed: dict[str, tuple[float, float]] = {}
    for node in nodes:
        for name, (total, free) in node.resources.items():
            had_total, had_free = summed.get(name, (0.0, 0.0))
            summed[name] = (had_total + total, had_free + free)
    return summed


def node_list(payload: Mapping[str, Any]) -> list[Any]:
    """The nodes of a ``GET /api/v0/nodes`` answer; raises ValueError for any other answer."""
    try:
        listed = payload["data"]["result"]["result"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the Ray node list holds no nodes ({exc!r} missing)") from None
    if not isinstance(listed, list):
        raise ValueError("the Ray node list holds no nodes")
    return listed


def cluster_report(payload: Mapping[str, Any], nodes_payload: Mapping[str, Any] | None = None) -> ClusterReport:
    """A ``GET /api/cluster_status`` answer (and the ``GET /api/v0/nodes`` one) → what the
    cluster has.

    Resources: cpu, gpu, memory_mb (whole MiB) and every custom resource whose
    lower-cased name is a valid irisfed resource name (``TPU`` → ``tpu``), each as
    (total, free = total − used). Attributes: ``device_type`` ``gpu`` and/or ``tpu``
    when the cluster has any, else ``cpu``; ``device_variant`` the lower-cased
    ``accelerator_type:<type>`` names (``a100``). Nodes: each alive node, its labels as
    attributes (``node_attributes``) and its resources, grouped into
    ``discovered.nodes`` (shared.nodes.group_nodes), and the resources are their sum;
    without ``nodes_payload``, every node of the resource report, without attributes,
    and the resources its cluster-wide sum. Raises ``ValueError`` when the
    answer holds no resource report (the head's first one comes some seconds after it
    starts) or the node list is not one.
    """
    try:
        metrics = payload["data"]["clusterStatus"]["loadMetricsReport"]
        usage = metrics["usage"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the Ray cluster status holds no resource report ({exc!r} missing)") from None
    pairs = _pairs(usage or {})
    if "CPU" not in pairs:
        raise ValueError("the Ray cluster status holds no resource report yet")
    ray_names: dict[str, str] = {}
    resources = _named(pairs, ray_names)
    by_node = metrics.get("usageByNode") or {}
    if nodes_payload is None:
        nodes = [RayNode(str(node_id), {}, _named(_pairs(node_usage), ray_names))
                 for node_id, node_usage in by_node.items() if isinstance(node_usage, Mapping)]
    else:
        nodes = _alive_nodes(node_list(nodes_payload), by_node, ray_names)
        # The summed report keeps a dead node's resources for a while (seen: 10 s and more
        # after its raylet was killed): the alive nodes' sum is the cluster now.
        resources = _summed(nodes)
    device_type = [kind for kind in (GPU, TPU) if resources.get(kind, (0, 0))[0] > 0] or [CPU]
    attributes = {"device_type": device_type}
    variants = sorted({name.removeprefix("accelerator_type:").lower() for name, (_, total) in pairs.items()
                       if name.startswith("accelerator_type:") and total > 0})
    if variants:
        attributes["device_variant"] = variants
    groups = group_nodes((node.attributes, node.resources) for node in nodes)
    return ClusterReport(Discovered(attributes, resources, groups), nodes, ray_names)
