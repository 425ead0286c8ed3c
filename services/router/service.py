"""The router: decode → classify → commit (grouped) → reply → notify.

Submits and their group commit live here; every decision is plan.py's. Cancels and
users' reads are answered by requests.py (cancel decisions are shared/cancel.py's), dry
runs by dry_runs.py: collaborators this service owns, sharing its peer view, store,
replies and answers in time (``_bounded``).

Submits are decoded strictly and classified at once in the NATS callback; valid
ones join a queue that a few writer tasks drain in batches, each batch one
``job_insert_batch`` statement in one transaction (group commit). Replies go out
only after that commit, so an acknowledged job is always in Postgres. After the
commit the router publishes what others wait for: ``assign.<local>`` for LOCAL
jobs, ``tick.wake`` for queued work, and ``events.<job_id>`` for watchers.

A submit with ``dry_run: true`` is decoded, checked and routed exactly the same way,
then leaves that path: a task of its own reads what placing it needs from Postgres
(read-only, one at a time, never through a writer) and answers a ``DryRunReply``
(dry_runs.py; its judgement dry_run.py's). It writes nothing, publishes nothing and takes no lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from irisfed.services.common import metrics
from irisfed.services.common.bus import from_jetstream, publish
from irisfed.services.common.faults import crash_point
from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.runtime import Service, forever
from irisfed.services.common.store import HeldStore, Store
from irisfed.services.router.arrays import insert_array
from irisfed.services.router.dependencies import insert_with_dependencies, taken_id
from irisfed.services.router.dry_runs import DryRuns
from irisfed.services.router.plan import (
    Routed,
    band_allowed,
    local_backend_for,
    max_band_ranks,
    original_reply,
    plan_new_job,
    quota_rejected,
    route,
    waiting_for_quota,
)
from irisfed.services.router.reads import Reads
from irisfed.services.router.requests import Requests
from irisfed.services.router.workspaces import WorkspaceCheck, WorkspaceRelay, fetch_inbox
from irisfed.shared.clock import Clock
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import (
    ConfigError,
    Conflict,
    ErrorCode,
    Forbidden,
    IrisfedError,
    Unavailable,
)
from irisfed.shared.federation.router import PeerRouter, RoutingRequest
from irisfed.shared.ids import JobIds
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import (
    AssignmentNotice,
    CancelReply,
    JobEvent,
    SubmitRequest,
    TickWake,
    decode_request,
    encoder,
    error_reply,
)
from irisfed.shared.records import NewJob
from irisfed.shared.resources import resources_from_json
from irisfed.shared.seen import scrub
from irisfed.shared.settings import require_count, require_seconds
from irisfed.shared.subjects import SUBMIT_QUEUE_GROUP, job_token
from irisfed.shared.users import (
    DEFAULT_USER,
    add_units,
    over_whole_quota,
    quota_wait,
    split_job_id,
)

log = EventLogger("router")

# How long a routing decision may be reused for identical (constraints, pin).
# A routing decision is reused until the peer view changes or a peer it relied on
# may have gone stale, and never longer than this.
PLAN_CACHE_MAX_S = 1.0
PLAN_CACHE_ENTRIES = 10_000
# Pool connections the router needs besides its writers': cancels, the peer view.
ROUTER_SPARE_CONNECTIONS = 2


_EVENT_HEAD = b'{"job_id":'  # JobEvent's first field: an event is this, the id, then the rest


@dataclass(frozen=True)
class RouterSettings:
    """Tuning knobs with defaults that suit one router on a small machine.

    The defaults live here (and nowhere else); values are checked when built
    (``ConfigError`` naming the setting and its flag).
    """

    writers: int = 4  # concurrent group-commit transactions
    max_batch: int = 1000  # jobs per transaction at most
    view_refresh_s: float | None = None  # default: the heartbeat interval
    # Backpressure: submits waiting for a writer at most; beyond, `unavailable` at once
    # (~2 KB each, so the default bounds the queue near 20 MB; 5× a full
    # 2000-in-flight load).
    max_queue: int = 10_000
    # How long a submit may wait for Postgres at each step: for a writer (then it is
    # answered `unavailable` without being written) and for its commit (then
    # `unavailable`: it may or may not have been written; the retry with the same
    # job_id is safe either way). A producer is answered within about twice this, and
    # a cancel within twice this too. Pick a producer request timeout above it.
    submit_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        require_count("router", "writers", self.writers, flag="--writers")
        require_count("router", "max_batch", self.max_batch)
        require_count("router", "max_queue", self.max_queue, flag="--max-queue")
        require_seconds("router", "submit_timeout_s", self.submit_timeout_s, flag="--submit-timeout")
        if self.view_refresh_s is not None:
            require_seconds("router", "view_refresh_s", self.view_refresh_s)

    def require_pool(self, db_pool: int) -> None:
        """Each writer keeps one pool connection for good; cancels and the peer view
        need connections besides them, or they wait out ``--db-timeout`` and fail."""
        least = self.writers + ROUTER_SPARE_CONNECTIONS
        if db_pool < least:
            raise ConfigError(
                f"router --writers {self.writers} needs --db-pool of at least {least} (each writer keeps "
                f"one connection; cancels and the peer view need {ROUTER_SPARE_CONNECTIONS} more), got {db_pool}")


@dataclass(slots=True)
class _Pending:
    job: NewJob
    reply: bytes  # the SubmitReply JSON, sent once the job is committed
    msg: Msg
    received: float  # the clock's monotonic reading at receipt (expiry, the ack latency histogram)
    answered: bool = False


# Submits naming a workspace, waiting on the object store at once, past which the next
# is answered `unavailable` (a hung store must not hold a router's memory).
WORKSPACE_SUBMITS_WAITING_AT_MOST = 1000
# An agent's workspace fetches answered at once (each has the store send one window of a
# workspace); past that it is told `unavailable` and retries.
FETCHES_PER_PEER = 16


class Router(Service):
    """Answers ``<prefix>.submit`` and ``<prefix>.cancel`` (queue group: run many)."""

    def __init__(
        self,
        config: FederationConfig,
        pool: Any,
        nc: Client,
        settings: RouterSettings = RouterSettings(),
        clock: Clock | Callable[[], float] | None = None,  # default: the system's (a bare callable: monotonic)
        new_job_id: Callable[[], str] | None = None,  # default: shared.ids.JobIds (short, time-sortable)
    ) -> None:
        super().__init__(config, pool, nc, settings, clock)
        self.new_job_id = new_job_id or JobIds()
        self.view = PeerView.exported(config, self.clock.monotonic)
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=settings.max_queue)
        metrics.ROUTER_QUEUE.set_function(self.queue.qsize)
        self.writer_busy = 0  # writers holding a batch (waiting on Postgres or answering)
        self._cancels: set[asyncio.Task] = set()  # cancels outliving their timed-out request
        self._plans: dict[tuple, tuple] = {}
        self.batches_committed = 0
        self.users = config.user_table
        self.quota_users = self.users.with_quota()
        self.max_bands = max_band_ranks(self.users.users.values())  # user → its max_band's rank
        self.peer_ids = frozenset(config.peer_ids)
        self._own_subjects = f"{self.subjects.prefix}."
        self.workspaces = WorkspaceCheck(nc, self.subjects.prefix, config.max_workspace_bytes)
        self._workspace_submits: set[asyncio.Task] = set()  # submits waiting on the object store
        self.relay = WorkspaceRelay(nc, self.subjects.prefix, self.store, config.max_workspace_bytes)
        self._fetches: dict[str, set[asyncio.Task]] = {}  # per peer: its agent's fetches being answered
        self.dry_runs = DryRuns(self.store, self.view, self.clock, self.users, self.quota_users,
                                bounded=self._bounded, respond=self._respond)
        self.requests = Requests(nc, self.subjects, self.store, self.view, self.clock, self.peer_ids,
                                 Reads(nc, self.subjects.prefix, self.store), user_of=self._user,
                                 forged_reply=self._forged_reply, bounded=self._bounded, respond=self._respond)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.refresh_view()
        await self.nc.subscribe(self.subjects.heartbeat(), cb=self.on_heartbeat)
        # v1's subjects are the user `default`'s; `<base>.<user>` every other user's
        # (docs/design.md §3.2: NATS lets only that user's credentials publish there).
        for subject in (self.subjects.submit, self.subjects.submit_for("*")):
            await self.nc.subscribe(subject, queue=SUBMIT_QUEUE_GROUP, cb=self.on_submit)
        for subject in (self.subjects.cancel, self.subjects.cancel_for("*")):
            await self.nc.subscribe(subject, queue=SUBMIT_QUEUE_GROUP, cb=self.requests.on_cancel)
        await self.nc.subscribe(self.subjects.operator_cancel, queue=SUBMIT_QUEUE_GROUP, cb=self.requests.on_operator_cancel)
        await self.nc.subscribe(self.subjects.fetch(), queue=SUBMIT_QUEUE_GROUP, cb=self.on_fetch)
        for subject in (self.subjects.read_for("logs", DEFAULT_USER), self.subjects.read_for("logs", "*"),
                        self.subjects.operator_read("logs")):
            await self.nc.subscribe(subject, queue=SUBMIT_QUEUE_GROUP, cb=self.requests.on_read_logs)
        for subject in (self.subjects.read_for("store", DEFAULT_USER), self.subjects.read_for("store", "*")):
            await self.nc.subscribe(subject, queue=SUBMIT_QUEUE_GROUP, cb=self.requests.on_read_store)
        await self.nc.flush()
        for i in range(self.settings.writers):
            self.tasks.spawn(self._writer(), name=f"router-writer-{i}")
        refresh = self.settings.view_refresh_s or self.config.heartbeat_interval_s
        self.tasks.spawn(forever("view_refresh", self.refresh_view, refresh), name="router-view")
        log.info("router_started", prefix=self.subjects.prefix, peers=",".join(self.config.peer_ids))

    async def close(self) -> None:
        await self.tasks.close()
        fetches = [task for tasks in self._fetches.values() for task in tasks]
        others = (list(self._cancels) + self.dry_runs.running() + list(self._workspace_submits) + fetches
                  + self.requests.running())
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def on_reconnect(self) -> None:
        self.view.mark_healthy()

    # ------------------------------------------------------------ peer view

    async def refresh_view(self) -> None:
        """Merge what Postgres knows of heartbeats (covers missed NATS messages)."""
        self.view.apply_rows(await self.store.peer_heartbeat_list_news(self.view.held()))

    async def on_heartbeat(self, msg: Msg) -> None:
        # The subject names the sender (NATS auth); a body naming another peer, or an
        # unconfigured one, is dropped and counted; the TTL is capped.
        if not from_jetstream(msg):
            self.view.receive(msg.subject, msg.data, log)

    # ------------------------------------------------------------ submit

    def _user(self, subject: str, base: str) -> str:
        """The user a request on ``subject`` speaks for; Forbidden for one not configured."""
        user = self.subjects.user_of(subject, base)
        if user is None or not self.users.knows(user):
            raise Forbidden(f"no user {subject.rpartition('.')[2]!r} is configured in this federation")
        return user

    def _forged_reply(self, msg: Msg) -> bool:
        """A request whose reply subject is one of the federation's own (``P.cancel.<peer>``,
        ``P.assign.<peer>``, another user's ``P.submit.<user>``) or a system one (``$O.``
        object store chunks, ``$JS.`` API): the router may publish there, so answering
        would let a requester speak (or write) through it; or a message JetStream sent
        out of a stream, whatever its reply (``from_jetstream``). Dropped unanswered."""
        if from_jetstream(msg) or msg.reply and msg.reply.startswith((self._own_subjects, "$")):
            metrics.SUBMIT_ERRORS.labels(ErrorCode.FORBIDDEN).inc()
            log.warning("request_reply_subject_refused", subject=msg.subject, reply=msg.reply[:200])
            return True
        return False

    async def on_submit(self, msg: Msg) -> None:
        received = self.clock.monotonic()
        if self._forged_reply(msg):
            return
        try:
            user = self._user(msg.subject, self.subjects.submit)
            request = decode_request(SubmitRequest, msg.data)
            band_allowed(user, request.band, self.max_bands)  # Forbidden above the user's max_band
        except IrisfedError as exc:
            metrics.SUBMIT_ERRORS.labels(exc.code).inc()
            await self._respond(msg, error_reply(exc.code, exc.message))
            return
        if request.workspace is None and not request.after and request.array is None:
            await self._submit(msg, request, user, received)
            return
        # Its workspace is looked up in the object store first, or it waits for the locks of
        # its dependencies: in a task of its own, so a slow or hung store (or a lock held)
        # holds up only such submits (a bounded few).
        if len(self._workspace_submits) >= WORKSPACE_SUBMITS_WAITING_AT_MOST:
            metrics.SUBMIT_ERRORS.labels(ErrorCode.UNAVAILABLE).inc()
            await self._respond(msg, error_reply(ErrorCode.UNAVAILABLE, (
                f"router busy: {len(self._workspace_submits)} submits waiting on the object store or on "
                "their dependencies; retry")))
            return
        task = asyncio.ensure_future(self._submit(msg, request, user, received))
        self._workspace_submits.add(task)
        task.add_done_callback(self._workspace_submits.discard)

    async def _submit(self, msg: Msg, request: SubmitRequest, user: str, received: float) -> None:
        """The rest of a decoded submit: its workspace checked, then judged and queued for
        the writers (or answered as a dry run)."""
        try:
            if request.workspace is not None:
                await self.workspaces.check(request.workspace, user)
            routed = None
            if user in self.quota_users:
                why = over_whole_quota(self.users.get(user), request.resource_request().units, request.replicas)
                if why is not None:
                    routed = quota_rejected(why)
            routed = routed or self._route(request)
            if request.dry_run:
                self.dry_runs.start(msg, request, routed, user)
                return
            if request.array is not None:  # a transaction of its own, writing every job (§3.8)
                written, reply = await self._bounded(insert_array(
                    self.store, request, routed, request.job_id or self.new_job_id(), user))
                await self._respond(msg, reply)
                if written:
                    await self._announce(written)
                return
            job, reply = plan_new_job(request, routed, request.job_id or self.new_job_id(), user)
            if request.after:  # a transaction of its own, locking what it waits for (§3.8)
                written, reply = await self._bounded(insert_with_dependencies(self.store, request, job, reply, user))
                await self._answer(_Pending(job, reply, msg, received), reply)
                if written is not None:
                    await self._announce([written])
                return
        except TimeoutError:
            metrics.SUBMIT_ERRORS.labels(ErrorCode.UNAVAILABLE).inc()
            await self._respond(msg, error_reply(ErrorCode.UNAVAILABLE, "the database did not answer in time; "
                                                 "retry with the same job_id"))
            return
        except IrisfedError as exc:
            metrics.SUBMIT_ERRORS.labels(exc.code).inc()
            await self._respond(msg, error_reply(exc.code, exc.message))
            return
        try:
            self.queue.put_nowait(_Pending(job, reply, msg, received))
        except asyncio.QueueFull:
            # Postgres is slower than submits arrive (or hangs): say so now rather than
            # hold memory and the producer for a commit that may come after it gave up.
            metrics.SUBMIT_SHED.labels("queue_full").inc()
            metrics.SUBMIT_ERRORS.labels(ErrorCode.UNAVAILABLE).inc()
            await self._respond(msg, error_reply(
                ErrorCode.UNAVAILABLE, f"router overloaded: {self.queue.qsize()} submits waiting for the "
                               "database; retry with the same job_id"))

    def _route(self, request: SubmitRequest) -> Routed:
        """Local feasibility and the routing plan, cached per (constraints, pin, resources, tasks).

        Submits mostly repeat a few constraint sets. A cached decision is dropped on
        any change of the peer view (a peer appearing, returning, changing shape, or
        this router regaining its view) and at the moment the first peer that was
        reachable would go stale, so it is never wrong, only reused; PLAN_CACHE_MAX_S
        bounds it besides.
        """
        res = request.resource_request()
        # Keyed by the constraints' wire form (encoded in C): building Constraint objects
        # for every submit only to find the cached decision was a tenth of the router.
        key = (encoder.encode(request.constraints), request.cluster_pin, res, request.replicas, request.group_by())
        now = self.clock.monotonic()
        cached = self._plans.get(key)
        if cached is not None and cached[0] == self.view.version and now < cached[1]:
            return cached[2]
        constraints = request.constraint_list()
        local_backend = local_backend_for(constraints, self.view.local_backends(), res, request.replicas,
                                          request.group_by())
        # A peer we have not heard from since we (re)started gets one TTL's benefit
        # of the doubt: at worst its job waits queued instead of being rejected.
        plan = PeerRouter(self.view.peers(since_healthy=True), self.clock.monotonic).classify(
            RoutingRequest(constraints, local_backend is not None, request.cluster_pin, res, request.replicas,
                           request.group_by())
        )
        routed = route(plan, self.config.local_cluster, local_backend)
        if len(self._plans) > PLAN_CACHE_ENTRIES:
            self._plans.clear()
        valid_until = min(now + PLAN_CACHE_MAX_S, self.view.next_expiry(now, since_healthy=True))
        self._plans[key] = (self.view.version, valid_until, routed)
        return routed

    async def _writer(self) -> None:
        # Each writer keeps its own connection: no pool round trip or reset per batch.
        held: HeldStore | None = None
        try:
            while True:
                batch = [await self.queue.get()]
                while len(batch) < self.settings.max_batch and not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                self.writer_busy += 1
                try:
                    batch = await self._expire(batch)
                    if not batch:
                        continue
                    # One budget for the whole commit step (connection, insert, repeats).
                    deadline = self.clock.monotonic() + self.settings.submit_timeout_s
                    if held is None or not held.usable():
                        held = await self._release(held)
                        held = await self.store.hold(wait_s=self.settings.submit_timeout_s)
                    await self._commit(held, batch, deadline)
                except asyncio.CancelledError:
                    await self._fail_all(batch, ErrorCode.UNAVAILABLE,
                                         "router shutting down; retry with the same job_id")
                    raise
                except Unavailable as exc:
                    metrics.DB_UNAVAILABLE.inc()
                    log.warning("submit_batch_unavailable", jobs=len(batch), error=exc.message)
                    # A connection lost (or silent) during the commit leaves the outcome
                    # unknown; a retry under the same job_id is safe either way. Answer
                    # first: a hung connection is then thrown away, never reused.
                    await self._fail_all(batch, ErrorCode.UNAVAILABLE, f"{exc.message}; retry with the same job_id")
                    held = await self._discard(held)
                except Exception as exc:  # noqa: BLE001 - answer every waiting producer
                    log.error("submit_batch_failed", exc_info=True, jobs=len(batch))
                    await self._fail_all(batch, ErrorCode.INTERNAL, f"internal error: {exc}")
                    held = await self._discard(held)
                finally:
                    self.writer_busy -= 1
        finally:
            await self._release(held)

    def _left(self, deadline: float) -> float:
        """Seconds left until ``deadline`` (the clock's monotonic reading), for a statement's timeout."""
        return max(0.001, deadline - self.clock.monotonic())

    async def _expire(self, batch: list[_Pending]) -> list[_Pending]:
        """Answer `unavailable` to submits that waited too long for a writer; the rest go on."""
        oldest_allowed = self.clock.monotonic() - self.settings.submit_timeout_s
        if batch[0].received >= oldest_allowed:  # the queue is FIFO: the first is the oldest
            return batch
        expired = [item for item in batch if item.received < oldest_allowed]
        metrics.SUBMIT_SHED.labels("expired").inc(len(expired))
        log.warning("submits_expired_in_queue", jobs=len(expired))
        await self._fail_all(expired, ErrorCode.UNAVAILABLE, (
            f"waited over {self.settings.submit_timeout_s:g}s for the database; this submit was not "
            "written; retry with the same job_id"))
        return [item for item in batch if item.received >= oldest_allowed]

    @staticmethod
    async def _discard(held: HeldStore | None) -> None:
        """Throw a writer's connection away whatever state it is in (hung, mid-statement, broken)."""
        if held is not None:
            await held.discard()

    @staticmethod
    async def _release(held: HeldStore | None) -> None:
        if held is not None:
            await held.release()

    async def _commit(self, held: Store, batch: list[_Pending], deadline: float) -> None:
        # The first submit of a job_id in a batch is the one inserted; later ones in
        # the same batch are answered like resubmissions.
        first: dict[str, _Pending] = {}
        for item in batch:
            first.setdefault(item.job.job_id, item)
        capped = [i for i in first.values()
                  if i.job.state == JobState.ASSIGNED.value and i.job.user_id in self.quota_users]
        if capped:
            created = await self._insert_under_quota(held, first, capped, deadline)
        else:
            # One statement, so one implicit transaction: no BEGIN/COMMIT round trips.
            created = await held.job_insert_batch([i.job for i in first.values()],
                                                  statement_timeout_s=self._left(deadline))
        crash_point("router_after_commit")
        self.batches_committed += 1
        metrics.SUBMIT_BATCH.observe(len(batch))
        # Committed jobs are answered first, so nothing that fails later can tell
        # their producers otherwise.
        repeats = []
        dispositions: dict[str, int] = {}
        publish_raw, ack, now = self.nc.publish, metrics.SUBMIT_ACK.observe, self.clock.monotonic
        for item in batch:
            if item.job.job_id in created and first[item.job.job_id] is item:
                item.answered = True
                if item.msg.reply:
                    await publish_raw(item.msg.reply, item.reply)
                ack(now() - item.received)
                dispositions[item.job.disposition] = dispositions.get(item.job.disposition, 0) + 1
            else:
                repeats.append(item)
        for disposition, count in dispositions.items():
            metrics.SUBMITS.labels(disposition).inc(count)
        await self._announce([first[job_id].job for job_id in created])
        if not repeats:
            return
        # Rows that already existed are committed (ON CONFLICT waited for them) and
        # their spec and what their first reply said never change, so reading them
        # afterwards is exact.
        existing = await held.job_get_submitted([i.job.job_id for i in repeats],
                                                statement_timeout_s=self._left(deadline))
        for item in repeats:
            row = existing.get(item.job.job_id)
            if row is None or row.spec_hash != item.job.spec_hash:
                exc = Conflict(taken_id(item.job.job_id, row is None))
                metrics.SUBMIT_ERRORS.labels(exc.code).inc()
                await self._answer(item, error_reply(exc.code, exc.message))
            else:
                metrics.SUBMIT_DUPLICATES.inc()
                await self._answer(item, original_reply(row))

    async def _insert_under_quota(self, held: Store, first: dict[str, _Pending], capped: list[_Pending],
                                  deadline: float) -> set[str]:
        """Insert a batch holding LOCAL jobs of users with quotas: under those users'
        quota locks, each such job is assigned only while its user's live jobs leave
        room for it, and waits queued (code ``quota``) otherwise. The same locks
        serialise ticks, so the quota is a hard cap whatever runs at once."""
        users = sorted({i.job.user_id for i in capped})
        async with held.transaction() as tx:
            # Within the batch's budget: a writer holding a lock (a hung tick) costs this
            # batch an `unavailable` in time, never the router its answers.
            await tx.job_quota_lock(users, wait_s=self._left(deadline))
            usage = await tx.job_live_usage_by_user(users, statement_timeout_s=self._left(deadline))
            for item in capped:
                units = resources_from_json(item.job.resources_json).units
                user_usage = usage.setdefault(item.job.user_id, {})
                why = quota_wait(self.users.get(item.job.user_id), user_usage, units, item.job.replicas)
                if why is None:
                    add_units(user_usage, units, tasks=item.job.replicas)
                else:
                    item.job, item.reply = waiting_for_quota(item.job, why)
            return await tx.job_insert_batch([i.job for i in first.values()],
                                             statement_timeout_s=self._left(deadline))

    async def _answer(self, item: _Pending, body: bytes) -> None:
        item.answered = True
        await self._respond(item.msg, body)
        metrics.SUBMIT_ACK.observe(self.clock.monotonic() - item.received)

    async def _announce(self, jobs: list[NewJob]) -> None:
        """After commit: wake the tick and agents, and tell watchers."""
        if any(job.state == JobState.QUEUED.value for job in jobs):
            # First: the tick's work starts now, the watchers' events can follow it.
            await publish(self.nc, self.subjects.tick_wake, TickWake("submit"))
        now = self.clock.now()
        events = self.subjects.events("")
        tails: dict[tuple, bytes] = {}  # jobs routed alike share every event field but job_id
        publish_raw = self.nc.publish
        for job in jobs:
            if job.state == JobState.ASSIGNED.value:
                await publish(self.nc, self.subjects.assign(job.owner_peer_id),
                              AssignmentNotice(job.job_id, job.owner_peer_id, job.epoch, job.backend or "",
                                               job.priority, job.replicas))
            shape = (job.state, job.owner_peer_id, job.epoch, job.reason)
            tail = tails.get(shape)
            if tail is None:
                blank = encoder.encode(JobEvent("", job.state, job.owner_peer_id or "", job.epoch, now,
                                                reason=job.reason))
                tail = tails[shape] = blank[len(_EVENT_HEAD) + 2:]
            await publish_raw(events + job_token(job.job_id), _EVENT_HEAD + encoder.encode(job.job_id) + tail)
            # Its user's copy (bus.user_event), built the same way: the id it sent, the same tail
            # unless the reason names a job the user may not see.
            user, bare = split_job_id(job.job_id)
            seen = scrub(job.reason, user)
            own = tail if seen == job.reason else encoder.encode(JobEvent(
                "", job.state, job.owner_peer_id or "", job.epoch, now, reason=seen))[len(_EVENT_HEAD) + 2:]
            await publish_raw(self.subjects.user_events(user, bare), _EVENT_HEAD + encoder.encode(bare) + own)

    async def _fail_all(self, batch: list[_Pending], code: str, message: str) -> None:
        """Answer every submit of ``batch`` not answered yet."""
        unanswered = [item for item in batch if not item.answered]
        metrics.SUBMIT_ERRORS.labels(code).inc(len(unanswered))
        for item in unanswered:
            item.answered = True
            await self._respond(item.msg, error_reply(code, message))

    @staticmethod
    async def _respond(msg: Msg, body: bytes) -> None:
        if msg.reply:
            await msg.respond(body)

    # ------------------------------------------------------------ workspaces sent to peers

    async def on_fetch(self, msg: Msg) -> None:
        """An agent asks for a window of its job's workspace (``P.fetch.<peer>``: only that
        peer's agent may publish there; the store sends the bytes to the reply subject,
        which must be one plain inbox). Answered from a task of its own, so a slow
        Postgres or store holds up nothing else; at most FETCHES_PER_PEER at once per
        peer, past that `unavailable`."""
        peer_id = self.subjects.fetch_peer(msg.subject)
        if self._forged_reply(msg) or peer_id not in self.peer_ids or not fetch_inbox(msg.reply or "", peer_id):
            return  # the chunks go only to an inbox (with NATS users: the asking agent's own)
        tasks = self._fetches.setdefault(peer_id, set())
        if len(tasks) >= FETCHES_PER_PEER:
            await self.relay.end(msg.reply, error_reply(
                ErrorCode.UNAVAILABLE, f"fetch: {FETCHES_PER_PEER} fetches of {peer_id} in progress; retry"))
            return
        task = asyncio.ensure_future(self._answer_fetch(msg, peer_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _answer_fetch(self, msg: Msg, peer_id: str) -> None:
        await self.relay.answer(peer_id, msg.data, msg.reply)

    # ------------------------------------------------------------ answers in time (submits, dry runs,
    # cancels, reads)

    async def _bounded(self, work):
        """``work``'s result, or TimeoutError after twice the submit timeout.

        A cancel may need a row lock and several statements (a dry run, its turn and a
        few reads); when Postgres hangs its requester is answered `unavailable` in time
        while the work finishes (or fails) in the background. Both are idempotent, so
        the retry is safe.
        """
        task = asyncio.ensure_future(work)
        self._cancels.add(task)

        def done(finished: asyncio.Task) -> None:
            self._cancels.discard(finished)
            if not finished.cancelled():
                finished.exception()  # retrieved: it was answered (or logged) already

        task.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(task), 2 * self.settings.submit_timeout_s)

    async def cancel(self, job_id: str, requested_by: str = "user default", shown_as: str | None = None
                     ) -> CancelReply:
        """Cancel the job stored as ``job_id`` durably (requests.py: ``Requests.cancel``)."""
        return await self.requests.cancel(job_id, requested_by, shown_as)
