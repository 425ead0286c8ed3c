"""The router: decode → classify → commit (grouped) → reply → notify.

Submits are decoded strictly and classified at once in the NATS callback; valid
ones join a queue that a few writer tasks drain in batches, each batch one
``job_insert_batch`` statement in one transaction (group commit). Replies go out
only after that commit, so an acknowledged job is always in Postgres. After the
commit the router publishes what others wait for: ``assign.<local>`` for LOCAL
jobs, ``tick.wake`` for queued work, and ``events.<job_id>`` for watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common import metrics
from services.common.bus import publish
from services.common.db import CONNECTION_ERRORS
from services.common.faults import crash_point
from services.common.log import EventLogger
from services.common.peer_view import PeerView
from services.common.runtime import TaskOwner, forever
from services.common.store import Store
from services.router.plan import Routed, cancel_action, local_backend_for, plan_new_job, route
from shared.config import FederationConfig
from shared.errors import Conflict, IrisfedError, NotFound
from shared.federation.router import PeerRouter, RoutingRequest
from shared.lifecycle import JobState
from shared.messages import (
    CANCEL_OUTCOMES,
    AssignmentNotice,
    CancelNotice,
    CancelReply,
    CancelRequest,
    JobEvent,
    SubmitRequest,
    TickWake,
    decode_request,
    encoder,
    error_reply,
)
from shared.records import Move, NewJob
from shared.subjects import SUBMIT_QUEUE_GROUP

log = EventLogger("router")

# How long a routing decision may be reused for identical (constraints, pin).
# A routing decision is reused until the peer view changes or a peer it relied on
# may have gone stale, and never longer than this.
PLAN_CACHE_MAX_S = 1.0
PLAN_CACHE_ENTRIES = 10_000


@dataclass(frozen=True)
class RouterSettings:
    """Tuning knobs with defaults that suit one router on a small machine."""

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


def _usable(conn: asyncpg.Connection | None) -> bool:
    """Whether a writer's connection can take the next batch.

    asyncpg may close a pooled connection behind its holder's back (after a
    statement timeout whose cancel request failed), which gives it back to the pool:
    every call on it then raises InterfaceError.
    """
    if conn is None:
        return False
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (perf_counter), for a statement's timeout."""
    return None if deadline is None else max(0.001, deadline - time.perf_counter())


@dataclass
class _Pending:
    job: NewJob
    reply: bytes  # the SubmitReply JSON, sent once the job is committed
    msg: Msg
    received: float  # perf_counter at receipt, for the ack latency histogram
    answered: bool = False


class Router:
    """Answers ``<prefix>.submit`` and ``<prefix>.cancel`` (queue group: run many)."""

    def __init__(
        self,
        config: FederationConfig,
        pool: asyncpg.Pool,
        nc: Client,
        settings: RouterSettings = RouterSettings(),
        clock: Callable[[], float] = time.monotonic,  # ages only: immune to wall-clock jumps
        new_job_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.config = config
        self.subjects = config.subjects
        self.pool = pool
        self.store = Store(pool)
        self.nc = nc
        self.settings = settings
        self.clock = clock
        self.new_job_id = new_job_id
        self.view = PeerView(config, clock)
        metrics.watch_peer_view(self.view)
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=settings.max_queue)
        metrics.ROUTER_QUEUE.set_function(self.queue.qsize)
        self.writer_busy = 0  # writers holding a batch (waiting on Postgres or answering)
        self._cancels: set[asyncio.Task] = set()  # cancels outliving their timed-out request
        self._plans: dict[tuple, tuple] = {}
        self.tasks = TaskOwner()
        self.batches_committed = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.refresh_view()
        await self.nc.subscribe(self.subjects.heartbeat(), cb=self.on_heartbeat)
        await self.nc.subscribe(self.subjects.submit, queue=SUBMIT_QUEUE_GROUP, cb=self.on_submit)
        await self.nc.subscribe(self.subjects.cancel, queue=SUBMIT_QUEUE_GROUP, cb=self.on_cancel)
        await self.nc.flush()
        for i in range(self.settings.writers):
            self.tasks.spawn(self._writer(), name=f"router-writer-{i}")
        refresh = self.settings.view_refresh_s or self.config.heartbeat_interval_s
        self.tasks.spawn(forever("view_refresh", self.refresh_view, refresh), name="router-view")
        log.info("router_started", prefix=self.subjects.prefix, peers=",".join(self.config.peer_ids))

    async def close(self) -> None:
        await self.tasks.close()
        for task in list(self._cancels):
            task.cancel()
        await asyncio.gather(*self._cancels, return_exceptions=True)

    async def on_reconnect(self) -> None:
        self.view.mark_healthy()

    # ------------------------------------------------------------ peer view

    async def refresh_view(self) -> None:
        """Merge what Postgres knows of heartbeats (covers missed NATS messages)."""
        self.view.apply_rows(await self.store.peer_heartbeat_list())

    async def on_heartbeat(self, msg: Msg) -> None:
        # The subject names the sender (NATS auth); a body naming another peer, or an
        # unconfigured one, is dropped and counted; the TTL is capped.
        self.view.receive(msg.subject, msg.data, log)

    # ------------------------------------------------------------ submit

    async def on_submit(self, msg: Msg) -> None:
        received = time.perf_counter()
        try:
            request = decode_request(SubmitRequest, msg.data)
            job, reply = plan_new_job(request, self._route(request), request.job_id or self.new_job_id())
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
            metrics.SUBMIT_ERRORS.labels("unavailable").inc()
            await self._respond(msg, error_reply(
                "unavailable", f"router overloaded: {self.queue.qsize()} submits waiting for the "
                               "database; retry with the same job_id"))

    def _route(self, request: SubmitRequest) -> Routed:
        """Local feasibility and the routing plan, cached per (constraints, pin).

        Submits mostly repeat a few constraint sets. A cached decision is dropped on
        any change of the peer view (a peer appearing, returning, changing shape, or
        this router regaining its view) and at the moment the first peer that was
        reachable would go stale, so it is never wrong, only reused; PLAN_CACHE_MAX_S
        bounds it besides.
        """
        constraints = request.constraint_list()
        key = (tuple(constraints), request.cluster_pin)
        now = self.clock()
        cached = self._plans.get(key)
        if cached is not None and cached[0] == self.view.version and now < cached[1]:
            return cached[2]
        local_backend = local_backend_for(constraints, self.view.local_backends())
        # A peer we have not heard from since we (re)started gets one TTL's benefit
        # of the doubt: at worst its job waits queued instead of being rejected.
        plan = PeerRouter(self.view.peers(since_healthy=True), self.clock).classify(
            RoutingRequest(constraints, local_backend is not None, request.cluster_pin)
        )
        routed = route(plan, self.config.local_cluster, local_backend)
        if len(self._plans) > PLAN_CACHE_ENTRIES:
            self._plans.clear()
        valid_until = min(now + PLAN_CACHE_MAX_S, self.view.next_expiry(now, since_healthy=True))
        self._plans[key] = (self.view.version, valid_until, routed)
        return routed

    async def _writer(self) -> None:
        # Each writer keeps its own connection: no pool round trip or reset per batch.
        conn = None
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
                    deadline = time.perf_counter() + self.settings.submit_timeout_s
                    if not _usable(conn):
                        conn = await self._drop(conn)
                        conn = await self.pool.acquire(timeout=self.settings.submit_timeout_s)
                    await self._commit(conn, batch, deadline)
                except asyncio.CancelledError:
                    await self._fail_all(batch, "unavailable", "router shutting down; retry with the same job_id")
                    raise
                except CONNECTION_ERRORS as exc:
                    metrics.DB_UNAVAILABLE.inc()
                    log.warning("submit_batch_unavailable", jobs=len(batch), error=self._db_error(exc))
                    # A connection lost (or silent) during the commit leaves the outcome
                    # unknown; a retry under the same job_id is safe either way. Answer
                    # first: a hung connection is then thrown away, never reused.
                    await self._fail_all(batch, "unavailable",
                                         f"{self._db_error(exc)}; retry with the same job_id")
                    conn = await self._discard(conn)
                except Exception as exc:  # noqa: BLE001 - answer every waiting producer
                    log.error("submit_batch_failed", exc_info=True, jobs=len(batch))
                    await self._fail_all(batch, "internal", f"internal error: {exc}")
                    conn = await self._discard(conn)
                finally:
                    self.writer_busy -= 1
        finally:
            await self._drop(conn)

    def _db_error(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return "the database did not answer in time"
        return f"database unavailable: {exc}"

    async def _expire(self, batch: list[_Pending]) -> list[_Pending]:
        """Answer `unavailable` to submits that waited too long for a writer; the rest go on."""
        oldest_allowed = time.perf_counter() - self.settings.submit_timeout_s
        if batch[0].received >= oldest_allowed:  # the queue is FIFO: the first is the oldest
            return batch
        expired = [item for item in batch if item.received < oldest_allowed]
        metrics.SUBMIT_SHED.labels("expired").inc(len(expired))
        log.warning("submits_expired_in_queue", jobs=len(expired))
        await self._fail_all(expired, "unavailable", (
            f"waited over {self.settings.submit_timeout_s:g}s for the database; this submit was not "
            "written; retry with the same job_id"))
        return [item for item in batch if item.received >= oldest_allowed]

    async def _discard(self, conn: asyncpg.Connection | None) -> None:
        """Throw a connection away whatever state it is in (hung, mid-statement, broken)."""
        if conn is not None:
            # Already given back (asyncpg closes a connection whose cancel failed): nothing to do.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        return await self._drop(conn)

    async def _drop(self, conn: asyncpg.Connection | None) -> None:
        if conn is not None:
            try:
                await self.pool.release(conn)
            except Exception:  # noqa: BLE001 - a dead connection is simply discarded
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
        return None

    async def _commit(self, conn: asyncpg.Connection, batch: list[_Pending], deadline: float | None = None) -> None:
        # The first submit of a job_id in a batch is the one inserted; later ones in
        # the same batch are answered like resubmissions.
        first: dict[str, _Pending] = {}
        for item in batch:
            first.setdefault(item.job.job_id, item)
        # One statement, so one implicit transaction: no BEGIN/COMMIT round trips.
        created = await self.store.job_insert_batch(conn, [i.job for i in first.values()],
                                                    statement_timeout_s=_left(deadline))
        crash_point("router_after_commit")
        self.batches_committed += 1
        metrics.SUBMIT_BATCH.observe(len(batch))
        # Committed jobs are answered first, so nothing that fails later can tell
        # their producers otherwise.
        repeats = []
        for item in batch:
            if item.job.job_id in created and first[item.job.job_id] is item:
                metrics.SUBMITS.labels(item.job.disposition).inc()
                await self._answer(item, item.reply)
            else:
                repeats.append(item)
        await self._announce([first[job_id].job for job_id in created])
        if not repeats:
            return
        # Rows that already existed are committed (ON CONFLICT waited for them) and
        # their spec and first reply never change, so reading them afterwards is exact.
        existing = await self.store.job_get_submitted(conn, [i.job.job_id for i in repeats],
                                                      statement_timeout_s=_left(deadline))
        for item in repeats:
            row = existing[item.job.job_id]
            if row["spec_hash"] != item.job.spec_hash:
                exc = Conflict(f"job_id {item.job.job_id!r} already names a job with a different spec")
                metrics.SUBMIT_ERRORS.labels(exc.code).inc()
                await self._answer(item, error_reply(exc.code, exc.message))
            else:
                metrics.SUBMIT_DUPLICATES.inc()
                await self._answer(item, encoder.encode({**row["submit_reply"], "duplicate": True}))

    async def _answer(self, item: _Pending, body: bytes) -> None:
        item.answered = True
        await self._respond(item.msg, body)
        metrics.SUBMIT_ACK.observe(time.perf_counter() - item.received)

    async def _announce(self, jobs: list[NewJob]) -> None:
        """After commit: wake agents and the tick, and tell watchers."""
        now = datetime.now(UTC)
        queued = False
        for job in jobs:
            if job.state == JobState.ASSIGNED.value:
                await publish(self.nc, self.subjects.assign(job.owner_peer_id),
                              AssignmentNotice(job.job_id, job.owner_peer_id, job.epoch, job.backend or "",
                                               job.priority))
            queued = queued or job.state == JobState.QUEUED.value
            await publish(self.nc, self.subjects.events(job.job_id),
                          JobEvent(job.job_id, job.state, job.owner_peer_id or "", job.epoch, now,
                                   reason=job.reason))
        if queued:
            await publish(self.nc, self.subjects.tick_wake, TickWake("submit"))

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

    # ------------------------------------------------------------ cancel

    async def on_cancel(self, msg: Msg) -> None:
        try:
            request = decode_request(CancelRequest, msg.data)
            reply = await self._bounded(self.cancel(request.job_id))
        except IrisfedError as exc:
            await self._respond(msg, error_reply(exc.code, exc.message))
            return
        except CONNECTION_ERRORS as exc:
            metrics.DB_UNAVAILABLE.inc()
            await self._respond(msg, error_reply("unavailable", f"{self._db_error(exc)}; retry"))
            return
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            log.error("cancel_failed", exc_info=True)
            await self._respond(msg, error_reply("internal", f"internal error: {exc}"))
            return
        await self._respond(msg, encoder.encode(reply))

    async def _bounded(self, work):
        """``work``'s result, or TimeoutError after twice the submit timeout.

        A cancel may need a row lock and several statements; when Postgres hangs its
        requester is answered `unavailable` in time while the cancel finishes (or
        fails) in the background. A cancel is idempotent, so the retry is safe.
        """
        task = asyncio.ensure_future(work)
        self._cancels.add(task)

        def done(finished: asyncio.Task) -> None:
            self._cancels.discard(finished)
            if not finished.cancelled():
                finished.exception()  # retrieved: it was answered (or logged) already

        task.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(task), 2 * self.settings.submit_timeout_s)

    async def cancel(self, job_id: str) -> CancelReply:
        """Cancel ``job_id`` durably; the reply's outcome says what happened."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await self.store.job_get_for_update(conn, job_id)
            if row is None:
                raise NotFound(f"no job {job_id!r}")
            state = JobState(row["state"])
            owner, epoch = row["owner_peer_id"], row["epoch"]
            action = cancel_action(state, row["cancel_requested"])
            if action == "nothing":
                return CancelReply(job_id, state.value, "already_finished")
            await self.store.job_request_cancel(conn, job_id)
            if action == "kill_now":
                # A job requeued after a lost peer did run before: it is not restarted.
                outcome = "never_started" if row["attempts"] == 0 else "not_restarted"
                await self.store.job_move(Move(
                    job_id, state, JobState.KILLED, epoch, actor="router", owner_peer_id=owner,
                    reason=CANCEL_OUTCOMES[outcome],
                ), conn)
                new_state = JobState.KILLED
            else:
                reachable = owner in self.view.reachable_ids()
                outcome = "kill_sent" if reachable else "pending_owner_offline"
                if action == "repeat":
                    outcome = "already_requested" if reachable else outcome
                new_state = state
        # Committed: now tell the owner (it also finds the flag on its next reconcile).
        if owner:
            await publish(self.nc, self.subjects.cancel_notice(owner), CancelNotice(job_id, owner, epoch))
        if new_state is JobState.KILLED:
            await publish(self.nc, self.subjects.events(job_id),
                          JobEvent(job_id, new_state.value, owner or "", epoch, datetime.now(UTC),
                                   reason=CANCEL_OUTCOMES[outcome]))
        metrics.CANCELS.labels(outcome).inc()
        log.info("job_cancel", job_id=job_id, peer_id=owner, epoch=epoch, outcome=outcome)
        return CancelReply(job_id, new_state.value, outcome)
