"""Rows: what services hand to the store, and the frozen typed rows it returns.

The services' store (``irisfed.services.common.store``) and the producers' reads
(``irisfed.reads``) return these values, never a driver's records. Each row type lists exactly the
columns of the named query that returns it, in order (the store checks the order
once per query). Job states are ``JobState`` values.

Rows also answer ``row["field"]`` and ``dict(row)``: callers written against the
driver's records (the CLI, chaos and bench tooling) keep working while they move
to attributes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

from irisfed.shared.lifecycle import JobState

# ---------------------------------------------------------------- rows handed to the store


class Explanation:
    """One distinct explanation of where jobs are (``job_explanations``), keyed by its content.

    Built once per routing or placement decision and shared by every job it
    explains: the store writes it once (if new) in the same statement as its jobs,
    whose rows hold only the key. In a job's JSON it is its key (the store's encoder).
    """

    __slots__ = ("doc", "key", "verdicts")

    def __init__(self, doc: bytes, verdicts: bytes | None = None) -> None:
        self.doc = doc  # shared.explain's stored form, as JSON
        self.verdicts = verdicts  # a rejected submit's reply verdicts (every peer), as JSON
        digest = hashlib.sha256(doc)
        if verdicts is not None:
            digest.update(b"\n")
            digest.update(verdicts)
        self.key = digest.hexdigest()


class NewJob(msgspec.Struct, frozen=True):
    """One row for ``job_insert_batch``, built by the router (a Struct: one per submit,
    built and encoded in C)."""

    job_id: str
    spec_json: str  # the canonical JSON of the request without job_id
    spec_hash: str
    state: str
    disposition: str
    pinned_peer_id: str | None
    owner_peer_id: str | None
    backend: str | None
    epoch: int
    max_retries: int
    priority: int
    deadline_s: float | None
    reason: str
    explanation: Explanation | None  # stored once per decision; the row holds its key
    resources_json: str = '{"cpu":1}'  # the normalised request (shared.resources), as JSON text
    user_id: str = "default"  # whose job it is (shared.users); job_id is already scoped by it
    band: int = 1  # its band's rank (shared.bands)
    replicas: int = 1  # its tasks (a gang: more than one)


@dataclass(frozen=True, slots=True)
class Move:
    """A compare-and-set state change of one job (see ``job_move``)."""

    job_id: str
    from_state: JobState
    to_state: JobState
    epoch: int
    actor: str
    owner_peer_id: str | None
    new_epoch: int | None = None  # default: unchanged
    reason: str = ""
    exit_code: int | None = None
    log_dir: str | None = None
    avoid_peer: str | None = None
    no_fault: bool = False  # handed back through no fault of the job: spends no retry (§3.7)

    @property
    def resulting_epoch(self) -> int:
        """The epoch the job is under once the move committed."""
        return self.epoch if self.new_epoch is None else self.new_epoch


@dataclass(frozen=True, slots=True)
class JobPageQuery:
    """One page of the dashboard's job list (``job_list_page``): newest first, filtered.

    Every filter is optional (None: any). ``text`` is matched anywhere in the job id or
    name, its LIKE metacharacters already escaped by the caller; ``after`` is the keyset
    cursor, the (submitted_at, job_id) of the last job of the previous page.
    """

    state: str | None = None
    owner_peer_id: str | None = None
    labels: dict[str, str] | None = None  # the job's labels must contain all of these
    text: str | None = None
    after: tuple[datetime, str] | None = None
    limit: int = 50
    user_id: str | None = None


# ---------------------------------------------------------------- rows the store returns


class Row(msgspec.Struct, frozen=True, array_like=True):
    """Base of every row the store returns: frozen, typed, built from a query's columns."""

    @classmethod
    def from_record(cls, values: Sequence[Any]):
        """Build from a result row's values (in column order), checking and converting types."""
        return msgspec.convert(tuple(values), cls)

    # Mapping access, for callers that still read rows by key.
    def __getitem__(self, key: str) -> Any:
        if key not in self.__struct_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return self.__struct_fields__

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.__struct_fields__ else default

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((name, getattr(self, name)) for name in self.__struct_fields__)


class JobRow(Row, frozen=True, array_like=True):
    """A whole ``jobs`` row (``job_get``)."""

    job_id: str
    spec: dict[str, Any]
    spec_hash: str
    state: JobState
    disposition: str
    pinned_peer_id: str | None
    owner_peer_id: str | None
    backend: str | None
    epoch: int
    attempts: int
    max_retries: int
    priority: int
    avoid_peers: list[str]
    submitted_at: datetime
    updated_at: datetime
    assigned_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    deadline_at: datetime | None
    exit_code: int | None
    log_dir: str | None
    reason: str
    explanation: dict[str, Any] | None  # job_explanations' document (joined)
    cancel_requested: bool
    cancel_requested_at: datetime | None
    user_id: str = "default"
    cancel_requested_by: str | None = None  # `user alice`, `operator (web)`
    band: int = 1  # its band's rank (shared.bands)
    preemptions: int = 0  # times preempted (never counted as retries)
    stopping_on: str | None = None  # preempted: the peer whose old run has not been seen to stop
    replicas: int = 1  # its tasks (resources is each one's)
    failures: int = 0  # runs that exited non-zero and ran again (max_failure_retries)
    restarts: int = 0  # runs handed back by their agent's restart, through no fault of the job

    @property
    def spared(self) -> int:
        """Runs that spent no retry of ``max_retries`` besides preemptions (shared.retry)."""
        return self.failures + self.restarts


class JobSummary(Row, frozen=True, array_like=True):
    """A job in the unified view (``job_list``)."""

    job_id: str
    state: JobState
    disposition: str
    pinned_peer_id: str | None
    owner_peer_id: str | None
    epoch: int
    attempts: int
    priority: int
    submitted_at: datetime
    updated_at: datetime
    exit_code: int | None
    reason: str
    command: list[str] | None
    user_id: str = "default"
    band: int = 1  # its band's rank (shared.bands)
    preemptions: int = 0  # times preempted
    resources: dict[str, Any] | None = None  # what each task asked (normalised)
    replicas: int = 1
    started_at: datetime | None = None
    finished_at: datetime | None = None
    array_id: str | None = None  # the array it is an element of (docs/design.md §3.8)


class SubmittedJob(Row, frozen=True, array_like=True):
    """What answers a resubmission (``job_get_submitted``): the job's spec hash and what its
    first reply said, from the row and its first changelog row (which never change)."""

    job_id: str
    spec_hash: str
    disposition: str
    pinned_peer_id: str | None
    first_state: str  # the state it was created in
    first_peer_id: str | None  # its owner then (LOCAL: the local cluster)
    first_reason: str
    verdicts: list[dict[str, Any]] | None  # a rejected job's, every peer


class JobToCancel(Row, frozen=True, array_like=True):
    """A job locked while a cancel decides what to do (``job_get_for_update``)."""

    job_id: str
    state: JobState
    owner_peer_id: str | None
    epoch: int
    cancel_requested: bool
    attempts: int


class AcceptedJob(Row, frozen=True, array_like=True):
    """A job an agent accepted (``job_start_batch``): what to run, and where."""

    job_id: str
    spec: dict[str, Any]
    backend: str | None


class FinishedJob(Row, frozen=True, array_like=True):
    """A reported ending that moved its job (``job_finish_batch``)."""

    job_id: str
    state: JobState
    reason: str


class ClaimedJob(Row, frozen=True, array_like=True):
    """A queued job the tick claimed (``job_claim_queued_by_user``)."""

    job_id: str
    epoch: int
    pinned_peer_id: str | None
    avoid_peers: list[str] | None
    priority: int
    submitted_at: datetime
    constraints_json: str | None
    resources_json: str | None = None  # jobs.resources (normalised at submit)
    preferences_json: str | None = None  # spec->'preferences'
    waited_s: float = 0.0  # since submit, by Postgres's clock
    cancel_requested: bool = False  # handed back with a cancel stored: killed, never placed
    user_id: str = "default"
    band: int = 1  # its band's rank (shared.bands)
    replicas: int = 1  # its tasks
    group_by: str = ""  # the node attribute its tasks' nodes share ("": none)

    @classmethod
    def from_record(cls, values: Sequence[Any]) -> ClaimedJob:
        # Thousands per tick batch and no field to convert: built as they come.
        return cls(*values)


class AssignedJob(Row, frozen=True, array_like=True):
    """A placement that committed (``job_assign_batch``): the job, its owner, its new epoch."""

    job_id: str
    owner_peer_id: str
    epoch: int

    @classmethod
    def from_record(cls, values: Sequence[Any]) -> AssignedJob:
        return cls(*values)  # thousands per tick batch: as they come


class ExpiredJob(Row, frozen=True, array_like=True):
    """A queued job that passed its deadline (``job_expire_deadlines``)."""

    job_id: str
    epoch: int


class OwnedJob(Row, frozen=True, array_like=True):
    """A live job a peer owns (``job_list_live_for_owner``): what its agent should be doing."""

    job_id: str
    state: JobState
    epoch: int
    backend: str | None
    cancel_requested: bool
    priority: int
    replicas: int = 1  # its tasks: the slots it takes


class LostPeerJob(Row, frozen=True, array_like=True):
    """A live job of a lost peer, locked for recovery (``job_claim_on_lost_peers``)."""

    job_id: str
    state: JobState
    epoch: int
    owner_peer_id: str
    attempts: int
    max_retries: int
    pinned_peer_id: str | None
    cancel_requested: bool = False  # a cancel stored while the owner was away: applied, never requeued
    preemptions: int = 0  # times preempted: those runs are not retries (shared.retry)
    spared: int = 0  # failure retries and restarts: not retries either


class PreemptibleJob(Row, frozen=True, array_like=True):
    """A live job of a lower band that a waiting job may preempt (``job_list_preemptible``)."""

    job_id: str
    epoch: int
    state: JobState
    owner_peer_id: str
    backend: str | None
    band: int
    resources_json: str | None
    user_id: str
    since: float  # when it took its room (started, else assigned), seconds since the epoch
    replicas: int = 1  # its tasks (resources_json is each one's)


class PreemptedJob(Row, frozen=True, array_like=True):
    """A victim moved by ``job_preempt_batch``: its new state and epoch, the peer whose
    run it fences, and the job it made room for."""

    job_id: str
    state: JobState
    epoch: int
    run_owner: str
    reason: str
    preemptor: str


class ReleasedJob(Row, frozen=True, array_like=True):
    """A preempted job the tick let be placed again because the peer of its old run is
    lost (``job_release_stopping_on_lost``): no agent is left to say the run stopped."""

    job_id: str
    epoch: int
    peer_id: str


class TaskRow(Row, frozen=True, array_like=True):
    """One task of a gang's run (``job_tasks_list``)."""

    job_id: str
    epoch: int
    task_index: int
    peer_id: str
    node: str | None
    state: str  # pending, running, succeeded, failed, killed, lost
    exit_code: int | None
    log_path: str | None
    updated_at: datetime


class DependencyRow(Row, frozen=True, array_like=True):
    """An edge of a job (``job_dependencies_of``: a job it waits for; ``job_dependents_of``:
    a job that waits for it), the condition and that other job's state now."""

    job_id: str
    condition: str  # ok, any, failed
    state: JobState


class ArrayRow(Row, frozen=True, array_like=True):
    """One array (``job_array_get``): its elements are jobs ``<array_id>_<i>``."""

    array_id: str
    user_id: str
    size: int
    parallel: int | None  # at most this many elements live at once (None: no limit)
    spec_hash: str
    reply: str  # the submit's first reply (JSON), repeated to a duplicate
    submitted_at: datetime


class OutputRow(Row, frozen=True, array_like=True):
    """One file a run left in its output directory (``job_outputs_list``): stored in
    the object store, or left out (``note`` says why)."""

    job_id: str
    epoch: int
    task_index: int
    name: str
    size: int
    stored: bool
    note: str
    peer_id: str
    stored_at: datetime


class JobStateRow(Row, frozen=True, array_like=True):
    """A job's current state and epoch (``job_list_states``), for invariant checks."""

    job_id: str
    state: JobState
    epoch: int
    owner_peer_id: str | None
    pinned_peer_id: str | None
    exit_code: int | None


class QueueClass(Row, frozen=True, array_like=True):
    """Queued jobs of one (pin, constraint set) class (``job_count_queued_by_class``)."""

    pinned_peer: str
    constraints: str
    jobs: int


class ChangelogEntry(Row, frozen=True, array_like=True):
    """One hand-off or state change of a job (``changelog_list_for_job``)."""

    seq: int
    from_state: JobState | None
    to_state: JobState
    peer_id: str | None
    epoch: int
    at: datetime
    actor: str
    detail: str


class ChangelogTip(Row, frozen=True, array_like=True):
    """A job's newest changelog row (``changelog_get_last_for_job``)."""

    seq: int
    to_state: JobState
    epoch: int
    peer_id: str | None


class ChangelogRow(Row, frozen=True, array_like=True):
    """A changelog row of any job (``changelog_list_all``), in replay order."""

    seq: int
    job_id: str
    from_state: JobState | None
    to_state: JobState
    peer_id: str | None
    epoch: int
    actor: str
    detail: str


class SyncState(Row, frozen=True, array_like=True):
    """How far a peer synchronized a job (``sync_state_get``)."""

    job_id: str
    peer_id: str
    synced_at: datetime
    changelog_seq: int
    epoch: int
    note: str


class PeerHeartbeatRow(Row, frozen=True, array_like=True):
    """A peer's newest advertisement (``peer_heartbeat_list``), aged by Postgres's clock."""

    peer_id: str
    run_id: str
    seq: int
    backends: list[dict[str, Any]]
    ttl_s: float
    sent_at: datetime
    received_at: datetime
    expires_at: datetime
    received_epoch: float
    age_s: float
    reachable: bool

    @classmethod
    def from_record(cls, values: Sequence[Any]) -> PeerHeartbeatRow:
        return cls(*values)  # every peer, every heartbeat interval, in every router and tick


# ---------------------------------------------------------------- the dashboard's reads (irisfed web)


class JobListRow(Row, frozen=True, array_like=True):
    """A job in the dashboard's list (``job_list_page`` and its variants).

    ``command`` and ``labels`` are the stored spec's, loosely typed: the dashboard shows
    whatever is there rather than fail a whole page on one odd row.
    """

    job_id: str
    name: str
    state: JobState
    owner_peer_id: str | None
    pinned_peer_id: str | None
    epoch: int
    attempts: int
    priority: int
    submitted_at: datetime
    updated_at: datetime
    exit_code: int | None
    reason: str
    command: Any
    labels: Any
    user_id: str = "default"
    band: int = 1  # its band's rank (shared.bands)
    preemptions: int = 0  # times preempted


class OldestQueued(Row, frozen=True, array_like=True):
    """The job waiting longest in the queue (``job_get_oldest_queued``), aged by Postgres's clock."""

    job_id: str
    submitted_at: datetime
    age_s: float


class ChangelogSince(Row, frozen=True, array_like=True):
    """A changelog position and its job (``changelog_list_since``)."""

    seq: int
    job_id: str


class ChangelogBounds(Row, frozen=True, array_like=True):
    """The changelog's first and last positions (None: empty) and Postgres's now (``changelog_get_bounds``)."""

    first_seq: int | None
    last_seq: int | None
    now: datetime


class ChangelogPoint(Row, frozen=True, array_like=True):
    """A changelog position and its time (``changelog_get_first_from_seq``)."""

    seq: int
    at: datetime


class ChartCount(Row, frozen=True, array_like=True):
    """One count for the dashboard's charts (``changelog_count_by_minute``).

    ``kind`` "move": ``n`` changes from ``from_state`` to ``to_state`` on ``peer_id`` in
    the minute starting at ``minute``; "now": ``n`` jobs in ``to_state`` owned by
    ``peer_id`` at ``minute`` (Postgres's now). States are text, as stored.
    """

    kind: str
    minute: datetime
    from_state: str | None
    to_state: str
    peer_id: str | None
    n: int
