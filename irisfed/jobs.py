"""Jobs on the client's side: ids made before the first try, submit requests built and
checked as the router checks them, and Postgres's rows as :class:`Job` and
:class:`~shared.messages.JobEvent`. Pure."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec
from msgspec import Struct

from irisfed.errors import InvalidRequestError
from irisfed.shared.bands import DEFAULT_BAND, band_name
from irisfed.shared.constraints import Constraint
from irisfed.shared.errors import IrisfedError
from irisfed.shared.ids import ALPHABET
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.shared.messages import ConstraintSpec, JobEvent, SubmitRequest, decode_request, encoder
from irisfed.shared.users import user_job_id

__all__ = ["ConstraintLike", "Job", "build_submit", "checked_submit", "constraint_wire", "job_event",
           "job_view", "new_job_id"]

_RANDOM_CHARS = 11  # 55 bits


def _base32(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 32)
        chars.append(ALPHABET[digit])
    return "".join(reversed(chars))


def new_job_id(now_ms: int | None = None, random_bits: int | None = None) -> str:
    """A job id for a submit that names none: 20 characters, sortable by time, unique.

    9 characters of milliseconds since the epoch (as the router's own ids,
    ``irisfed.shared.ids``) then 11 random characters (55 bits, drawn per id): ids made by
    any number of clients at once never meet in practice, where a shared id would
    quietly turn one producer's job into another's duplicate. Made here, before the
    first try, so that every retry of the submit carries the same id.

    >>> new_job_id(now_ms=0, random_bits=0)
    '00000000000000000000'
    """
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    if random_bits is None:
        random_bits = secrets.randbits(5 * _RANDOM_CHARS)
    return _base32(now_ms, 9) + _base32(random_bits, _RANDOM_CHARS)


ConstraintLike = str | Constraint | ConstraintSpec | Mapping[str, Any]


def constraint_wire(item: ConstraintLike) -> dict[str, Any]:
    """A constraint in any accepted form as its wire form ``{"key", "op", "value"}``.

    Accepted: the wire dict itself, a :class:`~shared.messages.ConstraintSpec`, a
    :class:`~shared.constraints.Constraint`, or the command line's shorthand
    (``"device_type=gpu"``, ``"memory_gb>=80"``, ``"zone=in:a,b"``, ``"exists:spot"``).
    """
    if isinstance(item, str):
        from irisfed.shared.shorthands import parse_constraint

        try:
            return parse_constraint(item).to_wire()
        except IrisfedError as exc:
            raise InvalidRequestError(exc.message) from None
    if isinstance(item, Constraint):
        return item.to_wire()
    if isinstance(item, ConstraintSpec):
        return msgspec.to_builtins(item)
    if isinstance(item, Mapping):
        return dict(item)
    raise InvalidRequestError(f"a constraint must be a string, a dict or a Constraint, not {type(item).__name__}")


def build_submit(command: Sequence[str], *, job_id: str | None = None, name: str = "",
                 env: Mapping[str, str] | None = None, constraints: Sequence[ConstraintLike] = (),
                 resources: Mapping[str, float] | None = None, preferences: Sequence[ConstraintLike] = (),
                 cluster_pin: str = "", priority: int = 0, max_retries: int | None = None,
                 deadline_s: float | None = None, labels: Mapping[str, str] | None = None,
                 band: str | None = None, max_preemptions: int | None = None,
                 dry_run: bool = False, replicas: int | None = None, group_by: str = "",
                 time_limit_s: float | None = None, grace_s: float | None = None,
                 max_failure_retries: int | None = None,
                 after: Sequence[str | tuple[str, str] | Mapping[str, str]] = (),
                 array: int | None = None, array_parallel: int | None = None) -> SubmitRequest:
    """The :class:`~shared.messages.SubmitRequest` for these arguments, checked as the router
    checks it (raises :class:`InvalidRequestError`), with a fresh job_id when none is given.
    ``band`` (``batch``, ``interactive``, ``production``) and ``max_preemptions``: None
    leaves the contract's defaults; ``dry_run``: ask what the submit would do, writing nothing;
    ``replicas`` and ``group_by``: a gang of that many tasks, their nodes sharing that attribute;
    ``time_limit_s``, ``grace_s``, ``max_failure_retries``: the run contract (docs/design.md §3.7);
    ``after``: jobs of the submitter's to wait for (§3.8), each an id (it must succeed), an
    ``(id, when)`` pair or a ``{"job_id", "when"}`` dict, ``when`` ``ok``, ``any`` or ``failed``;
    ``array``: that many jobs ``<job_id>_<i>``, at most ``array_parallel`` of them live at once."""
    if isinstance(command, str):
        raise InvalidRequestError("command is a list of strings (the program, then its arguments), "
                                  f"e.g. {command.split()!r}")
    body: dict[str, Any] = {"command": list(command), "job_id": job_id or new_job_id()}
    # Only what differs from the contract's defaults goes on the wire (as a hand-written body would).
    if name:
        body["name"] = name
    if env:
        body["env"] = dict(env)
    if constraints:
        body["constraints"] = [constraint_wire(c) for c in constraints]
    if resources:
        body["resources"] = dict(resources)
    if preferences:
        body["preferences"] = [constraint_wire(c) for c in preferences]
    if cluster_pin:
        body["cluster_pin"] = cluster_pin
    if priority:
        body["priority"] = priority
    if max_retries is not None:
        body["max_retries"] = max_retries
    if deadline_s is not None:
        body["deadline_s"] = deadline_s
    if time_limit_s is not None:
        body["time_limit_s"] = time_limit_s
    if grace_s is not None:
        body["grace_s"] = grace_s
    if max_failure_retries is not None:
        body["max_failure_retries"] = max_failure_retries
    if after:
        body["after"] = [{"job_id": a} if isinstance(a, str) else dict(a) if isinstance(a, Mapping)
                         else {"job_id": a[0], "when": a[1]} for a in after]
    if array is not None:
        body["array"] = array
    if array_parallel is not None:
        body["array_parallel"] = array_parallel
    if labels:
        body["labels"] = dict(labels)
    if band is not None:
        body["band"] = band
    if max_preemptions is not None:
        body["max_preemptions"] = max_preemptions
    if dry_run:
        body["dry_run"] = True
    if replicas is not None:
        body["replicas"] = replicas
    if group_by:
        body["coschedule"] = {"group_by": group_by}
    return checked_submit(body)


def checked_submit(request: SubmitRequest | Mapping[str, Any]) -> SubmitRequest:
    """``request`` decoded strictly, exactly as the router decodes it (and refused when a
    number in it is not finite: JSON has no NaN or infinity, and msgspec would write
    ``null``, which reads as "not given")."""
    fields = request if isinstance(request, Mapping) else msgspec.structs.asdict(request)
    numbers = [(name, fields.get(name)) for name in ("deadline_s", "time_limit_s", "grace_s")]
    numbers += [(f"resources.{name}", value) for name, value in dict(fields.get("resources") or {}).items()]
    for name, value in numbers:
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, not {value}")
    data = encoder.encode(request)
    try:
        return decode_request(SubmitRequest, data)
    except IrisfedError as exc:
        raise InvalidRequestError(exc.message) from None


class Job(Struct, frozen=True):
    """A job as Postgres (the durable truth) has it now: what :meth:`Client.get` returns."""

    job_id: str
    state: str
    disposition: str
    peer_id: str  # the owner now ("" while queued or never placed)
    pinned_peer_id: str
    epoch: int
    attempts: int
    exit_code: int | None
    reason: str
    cancel_requested: bool
    submitted_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    spec: dict[str, Any]
    user: str = "default"  # whose job it is; ``job_id`` is the id that user sent
    band: str = DEFAULT_BAND  # its priority band: ``batch``, ``interactive`` or ``production``
    preemptions: int = 0  # times it was preempted (stopped for a higher band's job, then requeued)
    replicas: int = 1  # its tasks (a gang: more than one)

    @property
    def terminal(self) -> bool:
        """Whether the job has ended (succeeded, failed, killed, rejected, unschedulable)."""
        return self.state in TERMINAL_STATES


class Task(Struct, frozen=True):
    """One task of a gang's run (:meth:`Client.tasks`): its index, the run's epoch, the
    peer and node it ran on, its state (pending, running, succeeded, failed, killed,
    lost), exit code and log folder."""

    index: int
    epoch: int
    peer_id: str
    node: str | None
    state: str
    exit_code: int | None
    log_path: str | None


def task_views(rows) -> list[Task]:
    """The newest run's tasks (``job_tasks_list`` rows), in index order."""
    newest = rows[0].epoch if rows else None
    return [Task(r.task_index, r.epoch, r.peer_id, r.node, r.state, r.exit_code, r.log_path)
            for r in rows if r.epoch == newest]


def job_view(row) -> Job:
    return Job(job_id=user_job_id(row.job_id), user=row.user_id, state=str(row.state), disposition=row.disposition,
               peer_id=row.owner_peer_id or "", pinned_peer_id=row.pinned_peer_id or "", epoch=row.epoch,
               attempts=row.attempts, exit_code=row.exit_code, reason=row.reason,
               cancel_requested=row.cancel_requested, submitted_at=row.submitted_at,
               updated_at=row.updated_at, finished_at=row.finished_at, spec=row.spec,
               band=band_name(row.band), preemptions=row.preemptions, replicas=row.replicas)


def job_event(job_id: str, entry, job) -> JobEvent:
    """A changelog entry as the event services publish for it; the terminal one carries the
    job's exit code and reason."""
    terminal = entry.to_state in TERMINAL_STATES
    reason = (job.reason or entry.detail) if terminal and job is not None else entry.detail
    exit_code = job.exit_code if terminal and job is not None else None
    return JobEvent(job_id=job_id, state=str(entry.to_state), peer_id=entry.peer_id or "", epoch=entry.epoch,
                    at=entry.at, exit_code=exit_code, reason=reason or "")


