"""A gang's Ray job, as the ``ray`` backend submits it and reads it back. Pure, no I/O.

A gang is one Ray job whose entrypoint runs a driver (``ray_gang.py``): its source
travels in one variable (``driver_payload``) that a bootstrap entrypoint decodes and
runs (``gang_entrypoint``), its run in another (``gang_env``), with a placement group
bundle per task (``gang_bundle``). Before submitting, ``gang_problem`` says whether the
cluster could ever hold the gang. Its log read back: the ``started`` line, the ``end``
line and each task's output (``gang_started``, ``read_gang_log``), and from them its
exit code (``gang_exit_code``).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from irisfed.services.peer_agent.backends import ray_gang as driver
from irisfed.services.peer_agent.backends.contract import (
    KILLED_EXIT_CODE,
    RunLost,
)
from irisfed.services.peer_agent.backends.ray_capacity import ClusterReport
from irisfed.services.peer_agent.backends.ray_text import (
    ENV_MAX_CHARS,
    MESSAGE_CHARS,
    JobState,
    _check,
    exit_code,
    submit_resources,
)
from irisfed.shared.nodes import most_sharing
from irisfed.shared.resources import CPU, fmt_amount

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
             bundle: Mapping[str, float], group_by: str, start_timeout_s: float, payload: str,
             grace_s: float | None = None) -> dict[str, str]:
    """``runtime_env.env_vars`` of a gang's job: the driver (``payload``) and its run,
    base64 of JSON (no ``$`` for Ray to expand; the job's variables reach each task
    verbatim, with ``IRISFED_JOB_ID``, ``IRISFED_EPOCH`` and ``IRISFED_NUM_TASKS``; the
    driver adds the task's own), with ``grace_s`` when given (between a stopped task's
    SIGTERM and its SIGKILL; the driver's own ``TERM_GRACE_S`` without). Raises
    ValueError for what cannot be passed, or when it all passes ``ENV_MAX_CHARS`` (Ray
    hands the runtime env to every worker it starts as one argument)."""
    _check(command, env)
    task_env = {**env, "IRISFED_JOB_ID": job_id, "IRISFED_EPOCH": str(epoch), "IRISFED_NUM_TASKS": str(replicas)}
    spec = {"command": list(command), "env": task_env, "replicas": replicas, "bundle": dict(bundle),
            "group_by": group_by, "start_timeout_s": start_timeout_s}
    if grace_s is not None:
        spec["grace_s"] = max(0.0, float(grace_s))
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
    most = most_sharing([node.attributes for node in fitting], group_by)
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
