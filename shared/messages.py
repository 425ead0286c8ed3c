"""Wire contract v1: every message irisfed sends or receives over NATS.

What producers and users send (``SubmitRequest``, ``CancelRequest``) is decoded
strictly: unknown fields, unknown ops, wrong types, missing required fields and
bodies over ``MAX_BODY_BYTES`` raise :class:`shared.errors.InvalidRequest`.
Messages between irisfed's own services (heartbeats, notices, events) tolerate
unknown fields so services can be upgraded one at a time.

Evolution rule: new fields get defaults; a field's type never changes.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from functools import lru_cache
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta, Struct

from irisfed.shared.bands import BANDS, DEFAULT_BAND, DEFAULT_MAX_PREEMPTIONS, MAX_PREEMPTIONS_LIMIT
from irisfed.shared.constraints import Constraint, ConstraintError, ConstraintOp
from irisfed.shared.errors import InvalidRequest
from irisfed.shared.lifecycle import CancelOutcome
from irisfed.shared.plain import plain
from irisfed.shared.resources import MAX_RESOURCES, Resources, as_resources
from irisfed.shared.users import STORED_JOB_ID_PATTERN

WIRE_VERSION = 1
# Generous for any real job spec, small enough that a hostile producer cannot
# make a router buffer megabytes per request.
MAX_BODY_BYTES = 64 * 1024

# (?!\n): in Python a bare $ also matches before a final newline; "abc\n" is no id.
# The lookahead means the same in ECMA regexes, so the exported JSON Schema agrees.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(?!\n)$"
MAX_JOB_ID = 128  # characters, as JOB_ID_PATTERN allows
# The most jobs one array may have, and what each of its runs is told (docs/design.md §3.8).
MAX_ARRAY = 10_000
ARRAY_ENV = ("IRISFED_ARRAY_INDEX", "IRISFED_ARRAY_SIZE")
JobId = Annotated[str, Meta(pattern=JOB_ID_PATTERN, description="client idempotency key")]
Text = Annotated[str, Meta(max_length=4096)]
Name = Annotated[str, Meta(max_length=256)]
MapKey = Annotated[str, Meta(min_length=1, max_length=256)]
Scalar = str | int | float
Band = Literal["batch", "interactive", "production"]  # shared.bands.BANDS (checked below)
# The most tasks one job may have (docs/design.md §3.4).
MAX_REPLICAS = 4096
# How long a run may take to stop after SIGTERM, at most, and by default (§3.7).
MAX_GRACE_S = 600
DEFAULT_GRACE_S = 30.0
AttributeKey = Annotated[str, Meta(min_length=1, max_length=128)]


assert get_args(Band) == BANDS

# ---------------------------------------------------------------- producer → router


@lru_cache(maxsize=8192, typed=True)
def _constraint(key: str, op: ConstraintOp, value: Scalar | tuple[Scalar, ...] | None) -> Constraint:
    # Submits repeat a few constraint sets endlessly: validate and build each once.
    # (A failure is not cached; it raises again, as it should.)
    return Constraint(key=key, op=op, value=value)


class ConstraintSpec(Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """A constraint on the wire: ``{"key", "op", "value"}``; no value for exists/not_exists."""

    key: Annotated[str, Meta(min_length=1, max_length=128)]
    op: ConstraintOp
    value: Scalar | list[Scalar] | None = None

    def __post_init__(self) -> None:
        # msgspec turns this ValueError into a ValidationError naming the field path.
        self.to_constraint()

    def to_constraint(self) -> Constraint:
        value = tuple(self.value) if isinstance(self.value, list) else self.value
        return _constraint(self.key, self.op, value)


class Coschedule(Struct, forbid_unknown_fields=True, frozen=True):
    """How a gang's tasks are placed together: ``group_by`` names a node attribute all
    its nodes must share one value of (a TPU slice, a rack)."""

    group_by: AttributeKey


# A workspace's content digest (docs/design.md §3.5): shared.workspace.DIGEST_RE.
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}(?!\n)$"


class Dependency(Struct, forbid_unknown_fields=True, frozen=True):
    """A job this one waits for (docs/design.md §3.8): ``job_id`` (the submitter's own, as it
    submitted it) ending ``succeeded`` (``when`` ``ok``, the default), in any way
    (``any``), or other than ``succeeded`` (``failed``)."""

    job_id: JobId
    when: Literal["ok", "any", "failed"] = "ok"


MAX_DEPENDENCIES = 64


class Workspace(Struct, forbid_unknown_fields=True, frozen=True):
    """The packed workspace a job runs in, stored in the object store under ``digest``."""

    digest: Annotated[str, Meta(pattern=DIGEST_PATTERN, description="sha256:<64 lowercase hex> of the archive")]
    size: Annotated[int, Meta(ge=0, le=1 << 40, description="the archive's length in bytes")]


class SubmitRequest(Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """Submit a job (``<prefix>.submit``, request/reply)."""

    command: Annotated[list[Text], Meta(min_length=1, max_length=256)]
    job_id: JobId | None = None
    name: Name = ""
    env: Annotated[dict[MapKey, Text], Meta(max_length=128)] = {}
    constraints: Annotated[list[ConstraintSpec], Meta(max_length=64)] = []
    cluster_pin: Annotated[str, Meta(max_length=64)] = ""
    priority: Annotated[int, Meta(ge=-1_000_000, le=1_000_000)] = 0
    max_retries: Annotated[int, Meta(ge=0, le=100)] = 2
    deadline_s: Annotated[float, Meta(gt=0, le=31_536_000)] | None = None
    labels: Annotated[dict[MapKey, Name], Meta(max_length=64)] = {}
    # Added to v1 (docs/design.md §3.1). Resource name → amount; validated in __post_init__
    # (shared.resources: names, units, limits). Absent = {"cpu": 1}.
    resources: Annotated[dict[Annotated[str, Meta(max_length=64)], int | float],
                         Meta(max_length=MAX_RESOURCES)] = {}
    # Soft constraints: they rank the peers that can take the job, never reject it.
    preferences: Annotated[list[ConstraintSpec], Meta(max_length=64)] = []
    # Added with bands (docs/design.md §3.3); their defaults are omitted from the spec,
    # so a job submitted without them keeps its hash.
    band: Band = DEFAULT_BAND
    max_preemptions: Annotated[int, Meta(ge=0, le=MAX_PREEMPTIONS_LIMIT)] = DEFAULT_MAX_PREEMPTIONS
    # Answer what the submit would do now, and write nothing. Not part of the job.
    dry_run: bool = False
    # Added with gangs (docs/design.md §3.4): that many tasks of the command, each asking
    # ``resources``, placed all or nothing on distinct nodes of one backend.
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 1
    coschedule: Coschedule | None = None
    # Added with workspaces (docs/design.md §3.5): the folder each run starts in.
    workspace: Workspace | None = None
    # Added with the run contract (docs/design.md §3.7); omitted at their defaults, so
    # a job submitted without them keeps its hash. ``grace_s`` None: the agent's default.
    time_limit_s: Annotated[float, Meta(gt=0, le=31_536_000)] | None = None
    grace_s: Annotated[float, Meta(ge=0, le=MAX_GRACE_S)] | None = None
    max_failure_retries: Annotated[int, Meta(ge=0, le=100)] = 0
    # Added with pipelines (docs/design.md §3.8): the jobs this one waits for.
    after: Annotated[list[Dependency], Meta(max_length=MAX_DEPENDENCIES)] = []
    # An array: ``array`` jobs ``<job_id>_<i>``, at most ``array_parallel`` of them live at once.
    array: Annotated[int, Meta(ge=1, le=MAX_ARRAY)] | None = None
    array_parallel: Annotated[int, Meta(ge=1, le=MAX_ARRAY)] | None = None

    def __post_init__(self) -> None:
        if not self.command[0].strip():
            raise ValueError("command[0] (the program) must not be empty")
        if self.resources:
            as_resources(self.resources)  # raises ResourceError (a ValueError) naming the problem
        named = [dependency.job_id for dependency in self.after]
        if len(set(named)) != len(named):
            raise ValueError("after names a job more than once")
        if self.job_id is not None and self.job_id in named:
            raise ValueError(f"after names the job itself ({self.job_id})")
        if self.array is None:
            if self.array_parallel is not None:
                raise ValueError("array_parallel limits an array: give array too")
            return
        taken = sorted(set(self.env) & set(ARRAY_ENV))
        if taken:
            raise ValueError(f"env: {taken[0]} is set for each job of an array; leave it out")
        longest = MAX_JOB_ID - len(f"_{self.array - 1}")
        if self.job_id is not None and len(self.job_id) > longest:
            raise ValueError(f"job_id: an array's jobs are <job_id>_<i>, so with array {self.array} "
                             f"it may have at most {longest} characters")

    def constraint_list(self) -> list[Constraint]:
        return [spec.to_constraint() for spec in self.constraints]

    def preference_list(self) -> list[Constraint]:
        return [spec.to_constraint() for spec in self.preferences]

    def resource_request(self) -> Resources:
        """The job's resources (each task's, for a gang), validated and normalised (``cpu``
        defaults to 1)."""
        return as_resources(self.resources or None)

    def group_by(self) -> str:
        return self.coschedule.group_by if self.coschedule is not None else ""

    def canonical_spec(self) -> bytes:
        """Everything but ``job_id`` as canonical JSON (sorted keys): what a job *is*.

        Resources are normalised first, so ``{}``, ``{"cpu": 1}`` and ``{"cpu": 1.0}``
        are the same job (and the same as a v1 submit without them).
        """
        request = self.resource_request()
        resources = {} if request.is_default() else request.as_dict()
        return _canonical.encode(msgspec.structs.replace(self, job_id=None, resources=resources, dry_run=False))

    def spec_hash(self) -> str:
        """A stable hash of everything but ``job_id``: same hash, same job."""
        return hashlib.sha256(self.canonical_spec()).hexdigest()


class CancelRequest(Struct, forbid_unknown_fields=True, frozen=True):
    """Request cancellation of a job (``<prefix>.cancel``, ``<prefix>.cancel.<user>``,
    request/reply): ``job_id`` is the id the user submitted under."""

    job_id: JobId


# An operator names a job by its stored id (``alice:train-1``; shared.users).
StoredJobId = Annotated[str, Meta(pattern=STORED_JOB_ID_PATTERN, description="a job's id as stored and "
                                                                            "shown to operators")]


class OperatorCancelRequest(Struct, forbid_unknown_fields=True, frozen=True):
    """An operator cancels any job (``<prefix>.operator.cancel``, request/reply; only the
    operator and web NATS users may publish there). ``by`` names which operator asked,
    for the job's history (e.g. ``web``); it grants nothing."""

    job_id: StoredJobId
    by: Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_-]{0,31}(?!\n)$")] | None = None


class LogsRequest(Struct, forbid_unknown_fields=True, frozen=True):
    """Read a job's shipped output (docs/design.md §3.6; ``<prefix>.read.logs`` for the
    user ``default``, ``<prefix>.read.logs.<user>``, request/reply): the next bytes of
    ``stream`` of task ``task`` of run ``epoch`` (default: its newest), from stream
    sequence ``seq`` (0: the start, or ``since_s`` seconds ago) with the reader at file
    offset ``offset`` (what the last answer said). Operators ask on
    ``<prefix>.operator.read.logs`` with the stored id."""

    job_id: StoredJobId
    stream: Literal["stdout", "stderr"] = "stdout"
    task: Annotated[int, Meta(ge=0, le=MAX_REPLICAS)] = 0
    epoch: Annotated[int, Meta(ge=1)] | None = None
    seq: Annotated[int, Meta(ge=0)] = 0
    offset: Annotated[int, Meta(ge=0)] = 0
    since_s: Annotated[float, Meta(gt=0, le=366 * 86400)] | None = None


STORE_READS = ("job_get", "changelog_list_for_job", "job_tasks_list", "job_outputs_list", "job_list",
               "job_live_usage_by_user", "job_count_by_user", "peer_heartbeat_list", "job_dependencies_of",
               "job_dependents_of", "job_array_counts")


class StoreReadRequest(Struct, forbid_unknown_fields=True, frozen=True):
    """A user's read of its own jobs without a database URL (docs/design.md §3.6;
    ``<prefix>.read.store`` for ``default``, ``<prefix>.read.store.<user>``,
    request/reply): the store read ``method`` with ``args`` (a job id first, where it
    takes one: the user's own id), answered as the store answers it for that user only
    (its jobs, with the ids it submitted under; its own line of usage). The answer is
    the read's rows as JSON arrays (``irisfed.shared.records``), or an ErrorReply."""

    method: Literal[STORE_READS]  # type: ignore[valid-type]
    args: Annotated[list[str | int | None], Meta(max_length=3)] = []


class LogsReply(Struct, frozen=True):
    """The answer to a LogsRequest: ``data`` (the output's next bytes, any gap marked
    with a line saying how much was dropped; base64 in JSON), then where to ask next
    (``seq``, ``offset``). ``done``: nothing more will come for this run (its output
    was shipped to its end, or it ended long enough ago); ``state`` and ``exit_code``
    are the job's now."""

    job_id: str
    epoch: int
    task: int
    stream: str
    data: bytes
    seq: int
    offset: int
    done: bool
    state: str
    exit_code: int | None = None
    peer_id: str | None = None


# ---------------------------------------------------------------- router → producer


class PeerVerdictMsg(Struct, frozen=True):
    """Why one peer can or cannot take a job (see shared.federation.router.PeerVerdict)."""

    peer_id: str
    code: str
    detail: str = ""


class SubmitReply(Struct, frozen=True):
    """Successful answer to a submit; sent only after the job is committed."""

    job_id: str
    disposition: str
    state: str
    peer_id: str
    duplicate: bool
    reason: str
    verdicts: list[PeerVerdictMsg] = []


class DryRunPlacement(Struct, frozen=True):
    """Where a dry-run job would be placed now, and whom it would preempt there."""

    peer_id: str
    backend: str
    preempts: list[str] = []  # stored ids of the live jobs it would stop (§3.3), in victim order


class DryRunReply(Struct, frozen=True):
    """Answer to a submit with ``dry_run: true``: what the submit would do now. Nothing
    was written (no job, no history, no event, no lock).

    ``job_id``, ``disposition``, ``state``, ``peer_id``, ``reason``, ``verdicts`` and
    ``duplicate`` are exactly what the real submit's reply would say now (a job_id that
    already names this user's job: the original answer with ``duplicate`` true; a
    different spec: the ``conflict`` error instead of this reply). ``band``: the band
    the job asks. ``placement``: where it would go now — a LOCAL job: the local cluster
    and backend; a queued one: where the tick would place it (the peer, the backend and
    the jobs it would preempt there), judged against the live jobs in Postgres but not
    against other queued jobs. None while it would wait; then ``waiting`` says why (the
    tick's rule, with its ``; cannot preempt: ...`` clause), ``waiting_code`` is
    ``quota`` when its user's quota holds it back, and ``waiting_verdicts`` judge each
    peer. A rejected job or a duplicate has neither.
    """

    job_id: str
    disposition: str
    state: str
    peer_id: str
    reason: str
    verdicts: list[PeerVerdictMsg] = []
    duplicate: bool = False
    band: str = DEFAULT_BAND
    placement: DryRunPlacement | None = None
    waiting: str = ""
    waiting_code: str = ""
    waiting_verdicts: list[PeerVerdictMsg] = []
    dry_run: bool = True


class ErrorBody(Struct, frozen=True):
    code: str
    message: str


class ErrorReply(Struct, frozen=True):
    """Failure answer to any request: ``{"error": {"code", "message"}}``."""

    error: ErrorBody


class CancelReply(Struct, frozen=True):
    """Answer to a cancel. ``outcome`` is one of CANCEL_OUTCOMES."""

    job_id: str
    state: str
    outcome: str


# outcome → its meaning (the outcomes are shared.lifecycle.CancelOutcome; wire values).
CANCEL_OUTCOMES = {outcome.value: outcome.meaning for outcome in CancelOutcome}


# ---------------------------------------------------------------- service ↔ service


class Capacity(Struct, frozen=True):
    total: int
    free: int


class ResourceAmount(Struct, frozen=True):
    """One advertised resource of a backend (units: shared.resources)."""

    total: float
    free: float


class NodeGroup(Struct, frozen=True):
    """``count`` identical nodes of a backend (shared.nodes): their attributes and, per
    node, each resource's total and free amount."""

    count: int
    attributes: dict[str, list[str]] = {}
    resources: dict[str, ResourceAmount] = {}


class BackendAd(Struct, frozen=True):
    """One backend in a heartbeat.

    ``capacity`` counts slots (one per job). ``resources`` (added to v1) advertises
    every resource the backend has, ``{name: {total, free}}``; a backend without it is
    placed by slots only (docs/scheduling.md). ``nodes`` (added with gangs): its hosts,
    identical ones counted together (shared.nodes); every task must then fit on one
    node, and only a backend advertising nodes runs gangs. ``discovering`` (added to v1): the
    backend's engine has not yet said what it has, so its resources and any attribute
    not configured on the agent (``--attr``, which overrides the engine) are unknown:
    routers queue a job it might hold rather than reject it, and ticks place nothing on
    it until it is advertised with its shape (docs/engines.md).
    """

    name: str
    attributes: dict[str, list[str]]
    capacity: Capacity
    resources: dict[str, ResourceAmount] = {}
    discovering: bool = False
    nodes: list[NodeGroup] = []


class Heartbeat(Struct, frozen=True):
    """A peer agent's capability advertisement (``<prefix>.heartbeat.<peer_id>``).

    ``seq`` increases strictly within one agent run (``run_id``).
    """

    peer_id: str
    seq: int
    sent_at: datetime
    ttl_s: float
    backends: list[BackendAd]
    run_id: str = ""


class AssignmentNotice(Struct, frozen=True):
    """``<prefix>.assign.<peer_id>``: job_id was assigned to that peer under ``epoch``.

    ``backend`` and ``priority`` let the agent accept from the notice alone, without
    reading its queue from Postgres first; an empty backend means "look it up".
    """

    job_id: str
    peer_id: str
    epoch: int
    backend: str = ""
    priority: int = 0
    tasks: int = 1  # a gang's tasks: the slots it takes


class CancelNotice(Struct, frozen=True):
    """``<prefix>.cancel.<peer_id>``: kill job_id, which that peer owns under ``epoch``."""

    job_id: str
    peer_id: str
    epoch: int


class JobEvent(Struct, frozen=True):
    """``<prefix>.events.<job_id>``: a committed state change, for live watchers."""

    job_id: str
    state: str
    peer_id: str
    epoch: int
    at: datetime
    exit_code: int | None = None
    reason: str = ""


class FetchRequest(Struct, frozen=True):
    """``<prefix>.fetch.<peer_id>`` (only that peer's agent may publish it; its reply
    subject an inbox of that agent's): send me the workspace of job_id, which is
    assigned to that peer under ``epoch``, from stream sequence ``from_seq`` on (0: from
    its start). The router checks, then has the object store send a window of the
    workspace's chunks straight to the reply subject (a batched direct get: each chunk
    a message with header ``Nats-Sequence``, the window ended by a status 204 message
    whose ``Nats-Last-Sequence`` is where to go on from and ``Nats-Num-Pending`` how many
    chunks remain, or by a status 404: none left), and sends one ``FETCH_PART: end``
    message of its own: a FetchEnd, or an ErrorReply (then no window comes). The two
    may arrive in either order. The bytes are the reader's to verify against the digest
    the end names; it asks again with ``from_seq`` for the next window."""

    job_id: str
    epoch: int
    from_seq: int = 0


class FetchEnd(Struct, frozen=True):
    """The router's answer to a FetchRequest: a window of workspace ``digest``'s chunks
    is on its way; the workspace is ``size`` bytes, and ``sha256`` is the object
    store's own record of its chunks' SHA-256 (``SHA-256=<base64url>``; "" when none):
    bytes that match it but not the digest are what the store holds, not a transfer's
    garbling."""

    job_id: str
    digest: str
    size: int
    sha256: str = ""


FETCH_PART = "Irisfed-Part"  # header of every message answering a FetchRequest: "chunk" or "end"


class TickWake(Struct, frozen=True):
    """``<prefix>.tick.wake``: queued work was committed; a tick should run now."""

    reason: str = ""


# ---------------------------------------------------------------- codecs

encoder = msgspec.json.Encoder()
_canonical = msgspec.json.Encoder(order="sorted")

_T = TypeVar("_T")
_strict_decoders: dict[type, msgspec.json.Decoder] = {
    SubmitRequest: msgspec.json.Decoder(SubmitRequest),
    CancelRequest: msgspec.json.Decoder(CancelRequest),
    OperatorCancelRequest: msgspec.json.Decoder(OperatorCancelRequest),
    LogsRequest: msgspec.json.Decoder(LogsRequest),
    StoreReadRequest: msgspec.json.Decoder(StoreReadRequest),
}
_internal_decoders: dict[type, msgspec.json.Decoder] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (Heartbeat, AssignmentNotice, CancelNotice, JobEvent, TickWake, FetchRequest, FetchEnd,
                 SubmitReply, DryRunReply, CancelReply, ErrorReply, LogsReply)
}


def decode_request(kind: type[_T], data: bytes) -> _T:
    """Strictly decode a producer's request; any problem raises InvalidRequest."""
    if len(data) > MAX_BODY_BYTES:
        raise InvalidRequest(f"body is {len(data)} bytes; the limit is {MAX_BODY_BYTES}")
    if not data:
        raise InvalidRequest("empty body: expected a JSON object")
    try:
        request = _strict_decoders[kind].decode(data)
    except (msgspec.DecodeError, ConstraintError) as exc:
        raise InvalidRequest(plain(str(exc))) from None
    # Postgres text cannot hold NUL; refused here, it can never fail a whole batch.
    # (JSON can only carry it escaped, so the byte scan is exact unless it hits.)
    if b"\\u0000" in data and _holds_nul(msgspec.to_builtins(request)):
        raise InvalidRequest("strings must not contain NUL (\\u0000)")
    return request


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(v) for v in value)
    return False


def decode_internal(kind: type[_T], data: bytes) -> _T:
    """Decode a message from another irisfed service (unknown fields tolerated).

    Strings holding NUL are refused here too: a peer's advertised attributes end up
    in stored heartbeats and explanations, and Postgres cannot store NUL.
    """
    message = _internal_decoders[kind].decode(data)
    if b"\\u0000" in data and _holds_nul(msgspec.to_builtins(message)):
        raise msgspec.ValidationError("strings must not contain NUL (\\u0000)")
    return message


def decode_reply(data: bytes) -> SubmitReply | DryRunReply | CancelReply | LogsReply | ErrorReply:
    """Decode a router reply, for clients: an error, a submit reply (or dry-run answer),
    a cancel reply or a read's answer."""
    raw = msgspec.json.decode(data)
    if isinstance(raw, dict) and "error" in raw:
        return msgspec.convert(raw, ErrorReply)
    if isinstance(raw, dict) and "offset" in raw and "done" in raw:
        return msgspec.json.decode(data, type=LogsReply)
    if isinstance(raw, dict) and "outcome" in raw:
        return msgspec.convert(raw, CancelReply)
    if isinstance(raw, dict) and raw.get("dry_run") is True:
        return msgspec.convert(raw, DryRunReply)
    return msgspec.convert(raw, SubmitReply)


def error_reply(code: str, message: str) -> bytes:
    return encoder.encode(ErrorReply(ErrorBody(code=code, message=message)))


WIRE_MESSAGES: tuple[type, ...] = (
    SubmitRequest,
    SubmitReply,
    DryRunReply,
    ErrorReply,
    CancelRequest,
    OperatorCancelRequest,
    CancelReply,
    Heartbeat,
    AssignmentNotice,
    CancelNotice,
    JobEvent,
    TickWake,
    FetchRequest,
    FetchEnd,
    LogsRequest,
    LogsReply,
    StoreReadRequest,
)


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every wire message, keyed by message name."""
    schemas, components = msgspec.json.schema_components(WIRE_MESSAGES)
    result = {}
    for kind, schema in zip(WIRE_MESSAGES, schemas, strict=True):
        result[kind.__name__] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": kind.__name__,
            **schema,
            "$defs": components,
        }
    return result
