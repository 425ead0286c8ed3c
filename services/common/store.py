"""The Postgres adapter, and the one door to it: domain actions over named queries.

Each method is named like the SQL block it runs (``job_move`` runs ``-- job_move --``
in ``shared/sql/*.sql``, loaded by ``irisfed.shared.queries``). Services call these actions and never see SQL or the driver:
- results are frozen typed rows (``irisfed.shared.records``), never driver records;
- failures are ``Unavailable`` (Postgres away, hung, or the connection lost: retry)
  or ``PermanentStoreError`` (refused for good), never driver errors;
- a ``Store`` runs on a pool; ``transaction()``, ``connection()``, ``hold()`` and
  ``begin()`` give a ``Store`` bound to one connection, for work that must share it.
This module never decides policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
import msgspec

from irisfed.services.common.store_pipelines import PipelineQueries
from irisfed.shared.errors import Unavailable
from irisfed.shared.lifecycle import JobState, check_transition
from irisfed.shared.messages import Heartbeat
from irisfed.shared.postgres import translated_errors
from irisfed.shared.queries import QUERIES
from irisfed.shared.records import (
    AcceptedJob,
    AssignedJob,
    ChangelogBounds,
    ChangelogEntry,
    ChangelogPoint,
    ChangelogRow,
    ChangelogSince,
    ChangelogTip,
    ChartCount,
    ClaimedJob,
    ExpiredJob,
    Explanation,
    FinishedJob,
    JobListRow,
    JobPageQuery,
    JobRow,
    JobStateRow,
    JobSummary,
    JobToCancel,
    LostPeerJob,
    Move,
    NewJob,
    OldestQueued,
    OutputRow,
    OwnedJob,
    PeerHeartbeatRow,
    PreemptedJob,
    PreemptibleJob,
    QueueClass,
    ReleasedJob,
    Row,
    SubmittedJob,
    SyncState,
    TaskRow,
)
from irisfed.shared.resources import SLOTS, to_units

_encoder = msgspec.json.Encoder()
_R = TypeVar("_R", bound=Row)
_checked: set[str] = set()  # queries whose columns were checked against their row type
# A keyset cursor before every queued job: -band is at least -2, -priority at least
# -1,000,000 (the wire's bound), and every submit time is after -infinity.
_BEFORE_EVERY_JOB = (-(2**15), -(2**31), datetime.min.replace(tzinfo=UTC), "")


def _json(value: object) -> str:
    return _encoder.encode(value).decode()


def _explanation_key(value: object) -> str:
    # A job's JSON names its explanation by key; the document goes once per batch.
    if isinstance(value, Explanation):
        return value.key
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_jobs_encoder = msgspec.json.Encoder(enc_hook=_explanation_key)


def _explanations_json(explanations: Mapping[str, Explanation]) -> str:
    return _json([{"key": key, "explanation": msgspec.Raw(e.doc),
                   "verdicts": None if e.verdicts is None else msgspec.Raw(e.verdicts)}
                  for key, e in explanations.items()])


def _rows(name: str, kind: type[_R], records: Sequence[asyncpg.Record]) -> list[_R]:
    """``records`` of query ``name`` as ``kind`` rows (columns checked once per query)."""
    if records and name not in _checked:
        columns = tuple(records[0].keys())
        if columns != kind.__struct_fields__:
            raise TypeError(f"query {name} returns {columns}, but {kind.__name__} has {kind.__struct_fields__}")
        _checked.add(name)
    return [kind.from_record(r) for r in records]


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


class Transaction:
    """An open transaction on a held connection: ``commit()`` or ``rollback()`` it once.

    For work that keeps a transaction open across awaits of its own (the tick holds a
    claim while it places the batch and the previous batch commits); otherwise use
    ``Store.transaction()``.
    """

    def __init__(self, transaction: Any) -> None:
        self._transaction = transaction
        self.finished = False  # committed or rolled back

    async def commit(self) -> None:
        """Commit; a failure raises (and leaves ``finished`` false: roll back, or drop the connection)."""
        with translated_errors():
            await self._transaction.commit()
        self.finished = True

    async def rollback(self) -> None:
        with translated_errors():
            await self._transaction.rollback()
        self.finished = True

    async def rollback_quietly(self) -> None:
        """Roll back on the way out of an error; a failure here must not hide that error."""
        self.finished = True
        with contextlib.suppress(Exception):
            await self._transaction.rollback()



LiveUsage = tuple[dict[tuple[str, str | None], int], dict[tuple[str, str | None], dict[str, float]], dict[str, int]]


def _live_usage(rows: Iterable[tuple[str, str | None, str | None, float, int | None]]) -> LiveUsage:
    """Live-usage rows (owner peer, backend, resource or None for the slots row, amount,
    lowest band of the slots row) as slots in use, resources in use, lowest band per peer."""
    live: dict[tuple[str, str | None], int] = {}
    used: dict[tuple[str, str | None], dict[str, float]] = {}
    lowest: dict[str, int] = {}
    for peer, backend, resource, amount, band in rows:
        key = (peer, backend)
        if resource is None:
            live[key] = int(amount)
            lowest[peer] = band if peer not in lowest else min(band, lowest[peer])
        else:
            used.setdefault(key, {})[resource] = amount
    return live, used, lowest

class Store(PipelineQueries):
    """Domain actions on the tables, over a pool (or one connection).

    ``db`` is the pool from ``irisfed.services.common.db.connect`` (or one of its
    connections; None for a service built without a database, in unit tests).
    """

    def __init__(self, db: Any) -> None:
        self.db = db

    def _pool(self) -> Any:
        """The pool this store's connections come from (None: not a pool's)."""
        return self.db if isinstance(self.db, asyncpg.Pool) else None

    @contextlib.asynccontextmanager
    async def _translated(self) -> AsyncIterator[None]:
        """``translated_errors``, and one thing more: a statement refused because the server
        is a standby (read-only: a failover moved the primary, or a URL without
        ``target_session_attrs=read-write`` reached a replica) is ``Unavailable`` and
        retired every pooled connection, so the next ones find the primary."""
        try:
            with translated_errors():
                yield
        except Unavailable as exc:
            if isinstance(exc.__cause__, asyncpg.exceptions.ReadOnlySQLTransactionError):
                pool = self._pool()
                if pool is not None:
                    await pool.expire_connections()
            raise

    # ------------------------------------------------------------ connections and transactions

    @property
    def max_connections(self) -> int:
        """How many connections this store may use at once (1 when bound to one)."""
        return self.db.get_max_size() if isinstance(self.db, asyncpg.Pool) else 1

    async def hold(self, wait_s: float | None = None) -> HeldStore:
        """A store on one pooled connection (waiting ``wait_s`` at most for one: the pool's
        default when None), held until ``release()`` or ``discard()``."""
        async with self._translated():
            conn = await self.db.acquire(timeout=wait_s)
        return HeldStore(conn, self.db)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Store]:
        """A store on one connection for the duration of the block (this one, if bound)."""
        if not isinstance(self.db, asyncpg.Pool):
            yield self
            return
        held = await self.hold()
        try:
            yield held
        finally:
            await held.release()

    async def begin(self) -> Transaction:
        """Open a transaction on this store's connection (a bound store: ``connection()``/``hold()``)."""
        transaction = self.db.transaction()
        async with self._translated():
            await transaction.start()
        return Transaction(transaction)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Store]:
        """``async with store.transaction() as tx:`` — ``tx``'s actions commit together, or none does."""
        async with self.connection() as bound:
            transaction = await bound.begin()
            try:
                yield bound
            except BaseException:
                await transaction.rollback_quietly()
                raise
            await transaction.commit()

    # ------------------------------------------------------------ running named queries

    async def _fetch(self, name: str, *args: Any, limit_s: float | None = None) -> list[asyncpg.Record]:
        """Run query ``name``; ``limit_s``: its client-side timeout (None: the pool's)."""
        async with self._translated():
            return await self.db.fetch(QUERIES[name], *args, timeout=limit_s)

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        async with self._translated():
            return await self.db.fetchrow(QUERIES[name], *args)

    async def _fetchval(self, name: str, *args: Any, limit_s: float | None = None) -> Any:
        async with self._translated():
            return await self.db.fetchval(QUERIES[name], *args, timeout=limit_s)

    async def _execute(self, name: str, *args: Any) -> None:
        async with self._translated():
            await self.db.execute(QUERIES[name], *args)

    async def _one(self, name: str, kind: type[_R], *args: Any) -> _R | None:
        record = await self._fetchrow(name, *args)
        return None if record is None else _rows(name, kind, [record])[0]

    async def _all(self, name: str, kind: type[_R], *args: Any, limit_s: float | None = None) -> list[_R]:
        return _rows(name, kind, await self._fetch(name, *args, limit_s=limit_s))

    # ------------------------------------------------------------ jobs: router

    async def job_insert_batch(self, jobs: Sequence[NewJob], statement_timeout_s: float | None = None) -> set[str]:
        """Insert ``jobs`` (skipping existing ids) and their explanations not stored yet;
        return the ids actually created."""
        explanations = {j.explanation.key: j.explanation for j in jobs if j.explanation is not None}
        rows = await self._fetch("job_insert_batch", _jobs_encoder.encode(jobs).decode(),
                                 _explanations_json(explanations), limit_s=statement_timeout_s)
        return {r["job_id"] for r in rows}

    async def job_get_submitted(self, job_ids: Sequence[str],
                                statement_timeout_s: float | None = None) -> dict[str, SubmittedJob]:
        rows = await self._all("job_get_submitted", SubmittedJob, list(job_ids), limit_s=statement_timeout_s)
        return {r.job_id: r for r in rows}

    async def job_get_for_update(self, job_id: str) -> JobToCancel | None:
        """Lock ``job_id`` for the rest of this store's transaction."""
        return await self._one("job_get_for_update", JobToCancel, job_id)

    async def job_request_cancel(self, job_id: str, requested_by: str | None = None) -> None:
        await self._execute("job_request_cancel", job_id, requested_by)

    async def job_quota_lock(self, users: Sequence[str], wait_s: float) -> None:
        """Hold the quota lock of ``users`` until this store's transaction ends (sorted
        here: every writer takes them in one order), waiting ``wait_s`` at most for them
        (then ``Unavailable``: another writer holds one, maybe hung)."""
        if users:
            await self._fetchval("transaction_lock_timeout", f"{max(1, round(wait_s * 1000))}ms")
            await self._fetchval("job_quota_lock", sorted(set(users)), limit_s=wait_s + 1.0)

    async def job_live_usage_by_user(self, users: Sequence[str] | None = None,
                                     statement_timeout_s: float | None = None) -> dict[str, dict[str, int]]:
        """What the live jobs of ``users`` (None: every user) hold, in units (shared.users),
        ``slots``: how many."""
        records = (await self._fetch("job_live_usage_all_users", limit_s=statement_timeout_s) if users is None
                   else await self._fetch("job_live_usage_by_user", list(users), limit_s=statement_timeout_s))
        held: dict[str, dict[str, int]] = {}
        for r in records:
            name = r["resource"]
            usage = held.setdefault(r["user_id"], {})
            if name is None:
                usage[SLOTS] = int(r["amount"])
            else:
                usage[name] = to_units(name, r["amount"])
        return held

    async def job_count_by_user(self) -> dict[str, dict[str, int]]:
        """Queued, assigned and running jobs per user and state."""
        counts: dict[str, dict[str, int]] = {}
        for r in await self._fetch("job_count_by_user"):
            counts.setdefault(r["user_id"], {})[r["state"]] = r["jobs"]
        return counts

    # ------------------------------------------------------------ jobs: reading

    async def job_get(self, job_id: str) -> JobRow | None:
        return await self._one("job_get", JobRow, job_id)

    async def job_list(self, state: str | None = None, limit: int = 100,
                       user_id: str | None = None) -> list[JobSummary]:
        if user_id is not None:
            return await self._all("job_list_by_user", JobSummary, user_id, state, limit)
        if state is None:
            return await self._all("job_list", JobSummary, limit)
        return await self._all("job_list_by_state", JobSummary, state, limit)

    async def job_count_by_state(self) -> dict[str, int]:
        return {r["state"]: r["jobs"] for r in await self._fetch("job_count_by_state")}

    async def job_list_states(self) -> list[JobStateRow]:
        return await self._all("job_list_states", JobStateRow)

    # ------------------------------------------------------------ jobs: any service's CAS

    async def job_move(self, move: Move) -> int | None:
        """Apply ``move`` if the job is still in (from_state, epoch); return its changelog seq."""
        check_transition(move.from_state, move.to_state)
        return await self._fetchval(
            "job_move", move.job_id, move.from_state.value, move.epoch, move.to_state.value,
            move.resulting_epoch, move.owner_peer_id,
            move.reason, move.exit_code, move.actor, move.log_dir, move.avoid_peer,
        )

    # ------------------------------------------------------------ jobs: peer agents

    async def job_start_batch(
        self, peer_id: str, starts: Sequence[tuple[str, int, str | None, str]]
    ) -> dict[str, AcceptedJob]:
        """Accept (job_id, epoch, log_dir, reason) for ``peer_id``; return what moved (spec, backend)."""
        job_ids, epochs, log_dirs, reasons = (list(c) for c in zip(*starts, strict=True))
        rows = await self._all("job_start_batch", AcceptedJob, peer_id, job_ids, epochs, log_dirs, reasons)
        return {r.job_id: r for r in rows}

    async def job_finish_batch(
        self, peer_id: str, endings: Sequence[tuple[str, int, int, bool]]
    ) -> dict[str, FinishedJob]:
        """Report (job_id, epoch, exit_code, cancelled) for ``peer_id``; return what moved."""
        job_ids, epochs, codes, cancelled = (list(c) for c in zip(*endings, strict=True))
        rows = await self._all("job_finish_batch", FinishedJob, peer_id, job_ids, epochs, codes, cancelled)
        return {r.job_id: r for r in rows}

    async def job_end_run(
        self, peer_id: str, job_id: str, epoch: int, to_state: JobState, reason: str,
        exit_code: int | None = None, no_fault: bool = False,
    ) -> int | None:
        """``peer_id`` ends its running job other than by its exit: queued (handed back,
        a new epoch, no owner; ``no_fault``: spending no retry), failed or killed. Returns
        the changelog seq; None: CAS lost."""
        check_transition(JobState.RUNNING, to_state)
        return await self._fetchval("job_end_run", peer_id, job_id, epoch, to_state.value, reason, exit_code,
                                    no_fault)

    async def job_runs_stopped(self, peer_id: str, only: Sequence[str] | None = None,
                               keep: Sequence[str] = ()) -> list[str]:
        """``peer_id`` has no run left of its preempted jobs (``only`` those; None: any)
        but those in ``keep``: they may be placed again. The ids released."""
        rows = await self._fetch("job_runs_stopped", peer_id, None if only is None else list(only), list(keep))
        return [r["job_id"] for r in rows]

    async def job_tasks_report(self, peer_id: str,
                               rows: Sequence[tuple[str, int, int, str | None, str, int | None, str | None]]) -> int:
        """Record gang tasks: (job, epoch, index, node, state, exit code, log) each, only
        of jobs ``peer_id`` owns at that epoch. How many were written."""
        if not rows:
            return 0
        columns = [list(c) for c in zip(*rows, strict=True)]
        return await self._fetchval("job_tasks_report", peer_id, *columns)

    async def job_tasks_list(self, job_id: str) -> list[TaskRow]:
        """A job's tasks, newest run first, in index order."""
        return await self._all("job_tasks_list", TaskRow, job_id)

    # ------------------------------------------------------------ dependencies (§3.8)

    async def job_outputs_record(self, peer_id: str,
                                 rows: Sequence[tuple[str, int, int, str, int, bool, str]]) -> int:
        """Record runs' output files: (job, epoch, task, name, size, stored, note) each,
        only of jobs ``peer_id`` owns at that epoch. How many were written."""
        if not rows:
            return 0
        columns = [list(c) for c in zip(*rows, strict=True)]
        return await self._fetchval("job_outputs_record", peer_id, *columns)

    async def job_outputs_list(self, job_id: str, epoch: int | None = None,
                               task: int | None = None) -> list[OutputRow]:
        """A job's output files of ``epoch`` (None: the newest with any), ``task`` (None: all)."""
        return await self._all("job_outputs_list", OutputRow, job_id, epoch, task)

    async def job_hand_back(self, peer_id: str, job_id: str, epoch: int, to_state: JobState, reason: str) -> int | None:
        """``peer_id`` hands back its assigned gang whose tasks did not all start: queued (a
        new epoch, no owner), failed or killed. The changelog seq; None: the CAS lost."""
        check_transition(JobState.ASSIGNED, to_state)
        return await self._fetchval("job_hand_back", peer_id, job_id, epoch, to_state.value, reason)

    async def job_list_assigned_specs(self, peer_id: str, jobs: Sequence[tuple[str, int]]) -> dict[str, AcceptedJob]:
        """What to run of ``peer_id``'s assigned gangs (job, epoch) — still ours at that epoch."""
        if not jobs:
            return {}
        ids, epochs = (list(c) for c in zip(*jobs, strict=True))
        rows = await self._all("job_list_assigned_specs", AcceptedJob, peer_id, ids, epochs)
        return {r.job_id: r for r in rows}

    async def job_list_live_for_owner(self, peer_id: str) -> list[OwnedJob]:
        return await self._all("job_list_live_for_owner", OwnedJob, peer_id)

    # ------------------------------------------------------------ jobs: the tick

    async def job_list_queued_users(self) -> dict[str, int]:
        """Users with queued jobs → the band (rank) of each one's highest queued job."""
        return (await self.job_pass_reads())[1]

    async def job_claim_queued(self, limit: int, after: tuple[int, int, datetime, str] | None = None,
                               user_id: str = "default") -> list[ClaimedJob]:
        """Lock the next ``limit`` queued jobs of ``user_id`` after its cursor ``after``."""
        return await self.job_claim_queued_by_user({user_id: after}, limit)

    async def job_claim_queued_by_user(self, cursors: Mapping[str, tuple[int, int, datetime, str] | None],
                                       limit: int) -> list[ClaimedJob]:
        """Lock the next ``limit`` queued jobs of each user in ``cursors`` after that user's
        cursor (-band, -priority, submitted_at, job_id; None: from its start), in a
        transaction; each user's in its own order."""
        users = list(cursors)
        if len(users) == 1:
            return await self._all("job_claim_queued_of_user", ClaimedJob, users[0],
                                   *(cursors[users[0]] or _BEFORE_EVERY_JOB), limit)
        bands, priorities, times, ids = [], [], [], []
        for user in users:
            neg_band, neg_priority, submitted_at, job_id = cursors[user] or _BEFORE_EVERY_JOB
            bands.append(neg_band)
            priorities.append(neg_priority)
            times.append(submitted_at)
            ids.append(job_id)
        return await self._all("job_claim_queued_by_user", ClaimedJob, users, bands, priorities, times, ids, limit)

    async def job_count_live(self) -> dict[tuple[str, str | None], int]:
        """Slots in use: live jobs per (owner peer, backend)."""
        rows = await self._fetch("job_count_live")
        return {(r["owner_peer_id"], r["backend"]): r["live"] for r in rows}

    async def job_live_usage(self) -> tuple[dict[tuple[str, str | None], int],
                                            dict[tuple[str, str | None], dict[str, float]]]:
        """Slots and resources in use, in one read: live jobs per (owner peer, backend),
        and what they asked per (owner peer, backend) and resource."""
        live, used, _ = await self.job_live_usage_with_bands()
        return live, used

    async def job_live_usage_with_bands(self) -> tuple[dict[tuple[str, str | None], int],
                                                       dict[tuple[str, str | None], dict[str, float]],
                                                       dict[str, int]]:
        """``job_live_usage``, and the lowest band live on each owner peer."""
        return (await self.job_pass_reads())[0]

    async def job_pass_reads(self) -> tuple[LiveUsage, dict[str, int]]:
        """A tick pass's first reads in one statement: ``job_live_usage_with_bands``
        and ``job_list_queued_users``."""
        rows = await self._fetch("job_pass_reads")
        usage = _live_usage((r["key"], r["backend"], r["resource"], r["amount"], r["band"])
                            for r in rows if r["kind"] == "live")
        return usage, {r["key"]: r["band"] for r in rows if r["kind"] == "queued"}

    async def job_assign_batch(self, assignments: Sequence[tuple[str, int, str, str]],
                               details: Mapping[str, str] | None = None) -> list[AssignedJob]:
        """Commit (job_id, epoch, peer_id, backend) placements; return what actually moved.
        ``details``: history details of some (default: ``placed``)."""
        if not assignments:
            return []
        job_ids, epochs, peers, backends = (list(c) for c in zip(*assignments, strict=True))
        notes = [details.get(job_id) for job_id in job_ids] if details else [None] * len(job_ids)
        return await self._all("job_assign_batch", AssignedJob, job_ids, epochs, peers, backends, notes)

    async def job_explain_batch(self, explained: Sequence[tuple[str, dict, str]]) -> None:
        """Store (job_id, explanation, reason) for jobs left queued."""
        if not explained:
            return
        job_ids, docs, reasons = zip(*explained, strict=True)
        by_json: dict[bytes, Explanation] = {}  # a batch's waiting jobs share few explanations
        keys = []
        for doc in docs:
            encoded = _encoder.encode(doc)
            known = by_json.get(encoded)
            if known is None:
                known = by_json[encoded] = Explanation(encoded)
            keys.append(known.key)
        await self._execute("job_explain_batch", list(job_ids), keys, list(reasons),
                            [e.key for e in by_json.values()], [e.doc.decode() for e in by_json.values()])

    async def job_expire_deadlines(self, limit: int = 1000) -> list[ExpiredJob]:
        return await self._all("job_expire_deadlines", ExpiredJob, limit)

    async def job_count_queued_by_class(self, classes: int) -> list[QueueClass]:
        return await self._all("job_count_queued_by_class", QueueClass, classes)

    async def job_list_preemptible(self, below_band: int, peers: Sequence[str]) -> list[PreemptibleJob]:
        """Live jobs of bands below ``below_band`` (never production) on ``peers``."""
        return await self._all("job_list_preemptible", PreemptibleJob, below_band, list(peers))

    async def job_lock_victims(self, victims: Sequence[tuple[str, str, int, str]]) -> set[str]:
        """Lock (job_id, state, epoch, owner) victims still so; the ids locked (SKIP LOCKED)."""
        if not victims:
            return set()
        ids, states, epochs, owners = (list(c) for c in zip(*victims, strict=True))
        return {r["job_id"] for r in await self._fetch("job_lock_victims", ids, states, epochs, owners)}

    async def job_preempt_batch(self, victims: Sequence[tuple[str, str, int, str, str]]) -> list[PreemptedJob]:
        """Preempt locked (job_id, state, epoch, owner, preemptor) victims; what moved."""
        if not victims:
            return []
        ids, states, epochs, owners, by = (list(c) for c in zip(*victims, strict=True))
        return await self._all("job_preempt_batch", PreemptedJob, ids, states, epochs, owners, by)

    async def job_release_stopping_on_lost(self, lost: Sequence[str], configured: Sequence[str] | None
                                           ) -> list[ReleasedJob]:
        """Preempted jobs waiting on a ``lost`` peer (or one not ``configured``; None: do not
        judge those yet) to stop their old run: free to be placed again."""
        return await self._all("job_release_stopping_on_lost", ReleasedJob, list(lost),
                               None if configured is None else list(configured))

    async def job_claim_on_lost_peers(self, lost: Sequence[str], limit: int = 1000) -> list[LostPeerJob]:
        """Up to ``limit`` unpinned live jobs owned by the ``lost`` peers, locked (SKIP LOCKED)."""
        return await self._all("job_claim_on_lost_peers", LostPeerJob, list(lost), limit)

    # ------------------------------------------------------------ changelog

    async def changelog_list_for_job(self, job_id: str) -> list[ChangelogEntry]:
        return await self._all("changelog_list_for_job", ChangelogEntry, job_id)

    async def changelog_list_all(self) -> list[ChangelogRow]:
        return await self._all("changelog_list_all", ChangelogRow)

    async def changelog_get_last_for_job(self, job_id: str) -> ChangelogTip | None:
        return await self._one("changelog_get_last_for_job", ChangelogTip, job_id)

    # ------------------------------------------------------------ sync state

    async def sync_state_upsert(self, job_id: str, peer_id: str, changelog_seq: int, epoch: int,
                                note: str = "") -> None:
        await self._execute("sync_state_upsert", job_id, peer_id, changelog_seq, epoch, note)

    async def sync_state_get(self, job_id: str) -> list[SyncState]:
        return await self._all("sync_state_get", SyncState, job_id)

    # ------------------------------------------------------------ peer heartbeats

    async def peer_heartbeat_upsert(
        self, peer_id: str, run_id: str, seq: int, backends: list, ttl_s: float, sent_at: datetime
    ) -> None:
        await self._execute("peer_heartbeat_upsert", peer_id, run_id, seq, backends, ttl_s, sent_at)

    async def peer_heartbeat_upsert_batch(self, heard: Sequence[tuple[Heartbeat, float]]) -> None:
        """Write many (heartbeat, seconds since it was heard) in one statement."""
        if not heard:
            return
        heartbeats = [h for h, _ in heard]
        await self._execute(
            "peer_heartbeat_upsert_batch",
            [h.peer_id for h in heartbeats], [h.run_id for h in heartbeats], [h.seq for h in heartbeats],
            [_json(h.backends) for h in heartbeats], [h.ttl_s for h in heartbeats],
            [h.sent_at for h in heartbeats], [age for _, age in heard],
        )

    async def peer_heartbeat_list(self) -> list[PeerHeartbeatRow]:
        return await self._all("peer_heartbeat_list", PeerHeartbeatRow)

    async def peer_heartbeat_list_news(self, held: Sequence[tuple[str, str, int]]) -> list[PeerHeartbeatRow]:
        """The advertisements newer than ``held`` ((peer_id, run_id, seq) a view has)."""
        return await self._all("peer_heartbeat_list_news", PeerHeartbeatRow,
                               [h[0] for h in held], [h[1] for h in held], [h[2] for h in held])

    # ------------------------------------------------------------ the dashboard (irisfed web: reads only)

    # A trigram index finds nothing shorter (fewer than 3 characters: a scan of newest first).
    _TRIGRAM = 3

    async def job_list_page(self, query: JobPageQuery) -> list[JobListRow]:
        """One page of jobs, newest first, after ``query.after``.

        Runs the form of ``job_list_page`` that leads with the filter an index serves
        best: labels, then a text of 3 characters or more, then user, then owner, then state, else
        newest first (the other filters are conditions of the same query).
        """
        name = ("job_list_page_by_label" if query.labels
                else "job_list_page_by_text" if query.text and len(query.text) >= self._TRIGRAM
                else "job_list_page_by_user" if query.user_id
                else "job_list_page_by_owner" if query.owner_peer_id
                else "job_list_page_by_state" if query.state
                else "job_list_page")
        after_at, after_id = query.after if query.after else (None, None)
        return await self._all(name, JobListRow, query.state, query.owner_peer_id, query.labels or None,
                               query.text or None, after_at, after_id, query.limit, query.user_id)

    async def job_count_live_by_state(self) -> dict[str, int]:
        """Queued, assigned and running jobs (states with none are absent)."""
        return {r["state"]: r["jobs"] for r in await self._fetch("job_count_live_by_state")}

    async def job_get_oldest_queued(self) -> OldestQueued | None:
        return await self._one("job_get_oldest_queued", OldestQueued)

    async def job_count_submitted_by_minute(self, since: datetime) -> dict[datetime, int]:
        """Jobs submitted per minute (its start, Postgres's time zone) since ``since``."""
        return {r["minute"]: r["jobs"] for r in await self._fetch("job_count_submitted_by_minute", since)}

    async def changelog_list_since(self, seq: int, limit: int) -> list[ChangelogSince]:
        return await self._all("changelog_list_since", ChangelogSince, seq, limit)

    async def changelog_get_bounds(self) -> ChangelogBounds:
        bounds = await self._one("changelog_get_bounds", ChangelogBounds)
        assert bounds is not None  # an aggregate: always one row
        return bounds

    async def changelog_get_first_from_seq(self, seq: int) -> ChangelogPoint | None:
        return await self._one("changelog_get_first_from_seq", ChangelogPoint, seq)

    async def changelog_count_by_minute(self, from_seq: int, since: datetime) -> list[ChartCount]:
        return await self._all("changelog_count_by_minute", ChartCount, from_seq, since)

    # ------------------------------------------------------------ login roles

    async def login_roles_apply(self, roles: Mapping[str, str], passwords: Mapping[str, str],
                                peers: Mapping[str, str]) -> None:
        """Create or update each login role (→ its group role) with its password, and map
        peer login roles to their peers (``peers``: role → peer id); all or nothing."""
        async with self.transaction() as tx:
            for role, group in roles.items():
                verb = "ALTER" if await tx._fetchval("login_role_exists", role) else "CREATE"
                # Utility statements take no parameters; the password is a generated token.
                with translated_errors():
                    await tx.db.execute(f"{verb} ROLE {_quote(role)} LOGIN PASSWORD '{passwords[role]}'")
                    await tx.db.execute(f"GRANT {group} TO {_quote(role)}")
            for role, peer_id in peers.items():
                await tx._execute("peer_role_upsert", role, peer_id)


class HeldStore(Store):
    """A store on one pooled connection, held across many statements (a router writer's):
    given back with ``release()``, or thrown away with ``discard()`` when it may be hung."""

    def __init__(self, conn: Any, pool: Any) -> None:
        super().__init__(conn)
        self._held_from = pool

    def _pool(self) -> Any:
        return self._held_from

    def usable(self) -> bool:
        """Whether the connection can take the next statement (the driver may have closed
        it behind its holder's back, after a statement timeout whose cancel failed)."""
        try:
            return not self.db.is_closed()
        except asyncpg.InterfaceError:
            return False

    async def release(self) -> None:
        """Give the connection back to the pool (a dead one is simply discarded)."""
        try:
            await self._held_from.release(self.db)
        except Exception:  # noqa: BLE001 - a dead connection is simply discarded
            with contextlib.suppress(asyncpg.InterfaceError):
                self.db.terminate()

    async def discard(self) -> None:
        """Throw the connection away whatever state it is in (hung, mid-statement, broken)."""
        # Already given back (closed after a failed cancel): nothing to terminate.
        with contextlib.suppress(asyncpg.InterfaceError):
            self.db.terminate()
        await self.release()
