"""The router's requests besides submits: cancels and users' reads, each answered whatever happens.

- Cancels (``P.cancel[.<user>]``: a user's, by the id it sent; ``P.operator.cancel``: an
  operator's, by the stored id): decided by shared/cancel.py, stored durably in one
  transaction, then the owner is told (``cancel.<peer>``) and watchers too when the
  job ends at once.
- Reads (docs/design.md §3.6): a user's own job's output (``P.read.logs[.<user>]``), an
  operator's of any job (``P.operator.read.logs``), a user's own jobs as the store has
  them (``P.read.store[.<user>]``); reads.py reads them. Each from a task of its own (one
  stream or Postgres slow to answer holds up no other read), at most READS_AT_ONCE at
  once, past that `unavailable`.

Every one is answered in time (the router's ``bounded``: `unavailable` after twice the
submit timeout while the work finishes in the background) and answered whatever fails.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from irisfed.services.common import metrics
from irisfed.services.common.bus import publish, publish_event
from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.store import Store
from irisfed.services.router.reads import Reads
from irisfed.shared.arrays import array_state
from irisfed.shared.cancel import CancelAction, cancel_decision
from irisfed.shared.clock import Clock
from irisfed.shared.errors import (
    ErrorCode,
    IrisfedError,
    NotFound,
    PermanentStoreError,
    Unavailable,
)
from irisfed.shared.lifecycle import CancelOutcome, JobState
from irisfed.shared.messages import (
    CancelNotice,
    CancelReply,
    CancelRequest,
    JobEvent,
    LogsReply,
    LogsRequest,
    OperatorCancelRequest,
    StoreReadRequest,
    decode_request,
    encoder,
    error_reply,
)
from irisfed.shared.records import Move
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import DEFAULT_USER, stored_job_id

log = EventLogger("router")
# An array's cancel reply tells the outcome first in this order that one of its jobs had.
_ARRAY_CANCEL_ORDER = [CancelOutcome.KILL_SENT, CancelOutcome.PENDING_OWNER_OFFLINE, CancelOutcome.NOT_RESTARTED,
                       CancelOutcome.NEVER_STARTED, CancelOutcome.ALREADY_REQUESTED, CancelOutcome.ALREADY_FINISHED]

# Users' reads (logs, their jobs) answered at once, each from a task of its own.
READS_AT_ONCE = 64


class Requests:
    """Answers cancels and reads for the router that owns it.

    From the router: ``user_of(subject, base)`` (the user a request speaks for, or
    Forbidden), ``forged_reply(msg)`` (a reply subject the router must not answer),
    ``bounded(work)`` (the answer in time) and ``respond(msg, body)``.
    """

    def __init__(self, nc: Client, subjects: Subjects, store: Store, view: PeerView, clock: Clock,
                 peer_ids: frozenset[str], reads: Reads, *,
                 user_of: Callable[[str, str], str], forged_reply: Callable[[Msg], bool],
                 bounded: Callable[[Awaitable[Any]], Awaitable[Any]],
                 respond: Callable[[Msg, bytes], Awaitable[None]]) -> None:
        self.nc = nc
        self.subjects = subjects
        self.store = store
        self.view = view
        self.clock = clock
        self.peer_ids = peer_ids
        self.reads = reads
        self._user = user_of
        self._forged_reply = forged_reply
        self._bounded = bounded
        self._respond = respond
        self._reads: set[asyncio.Task] = set()  # reads being answered

    def running(self) -> list[asyncio.Task]:
        """The reads being answered (the router cancels them when it closes)."""
        return list(self._reads)

    # ------------------------------------------------------------ reads (docs/design.md §3.6)

    async def _start_read(self, msg: Msg, answer: Callable[[Msg], Awaitable[None]]) -> None:
        """Answer a read from a task of its own (one stream or Postgres slow to answer
        holds up no other read); at most READS_AT_ONCE at once, past that `unavailable`.
        A read no one waits for (no reply subject) is not made."""
        if not msg.reply:
            return
        if len(self._reads) >= READS_AT_ONCE:
            await self._respond(msg, error_reply(ErrorCode.UNAVAILABLE,
                                                 f"{READS_AT_ONCE} reads in progress on this router; retry"))
            return
        task = asyncio.ensure_future(answer(msg))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def on_read_logs(self, msg: Msg) -> None:
        await self._start_read(msg, self._read_logs)

    async def on_read_store(self, msg: Msg) -> None:
        await self._start_read(msg, self._read_store)

    async def _read_logs(self, msg: Msg) -> None:
        """A user reads its own job's output (``P.read.logs[.<user>]``, by the id it sent);
        an operator any job's (``P.operator.read.logs``, by its stored id)."""
        async def work() -> LogsReply:
            operator = msg.subject == self.subjects.operator_read("logs")
            user = None if operator else self._user(msg.subject, self.subjects.read_for("logs", DEFAULT_USER))
            request = decode_request(LogsRequest, msg.data)
            if operator:
                return await self._bounded(self.reads.logs(request.job_id, request.job_id, request))
            return await self._bounded(self.reads.user_logs(user, request))
        await self._answer_request(msg, work)

    async def _read_store(self, msg: Msg) -> None:
        """A user reads its own jobs as the store has them (``P.read.store[.<user>]``)."""
        async def work() -> Any:
            user = self._user(msg.subject, self.subjects.read_for("store", DEFAULT_USER))
            return await self._bounded(self.reads.store_read(user, decode_request(StoreReadRequest, msg.data)))
        await self._answer_request(msg, work)

    # ------------------------------------------------------------ cancel

    async def on_cancel(self, msg: Msg) -> None:
        """A user's cancel (``P.cancel``: ``default``; ``P.cancel.<user>``), by the id it sent."""
        if msg.subject.rpartition(".")[2] in self.peer_ids and msg.subject != self.subjects.cancel:
            return  # a cancel notice to that peer (P.cancel.<peer>), not a request

        async def work() -> CancelReply:
            user = self._user(msg.subject, self.subjects.cancel)
            request = decode_request(CancelRequest, msg.data)
            return await self._bounded(self.cancel(stored_job_id(user, request.job_id), f"user {user}",
                                                   shown_as=request.job_id))
        await self._answer_request(msg, work)

    async def on_operator_cancel(self, msg: Msg) -> None:
        """An operator's cancel: any job, named by its stored id (``alice:train-1``)."""
        async def work() -> CancelReply:
            request = decode_request(OperatorCancelRequest, msg.data)
            by = f"operator ({request.by})" if request.by else "operator"
            return await self._bounded(self.cancel(request.job_id, by))
        await self._answer_request(msg, work)

    async def _answer_request(self, msg: Msg, work: Callable[[], Any]) -> None:
        """Run a request's ``work`` (a cancel, a read) and answer it, whatever happens."""
        if self._forged_reply(msg):
            return
        try:
            reply = await work()
        except (Unavailable, TimeoutError) as exc:
            metrics.DB_UNAVAILABLE.inc()
            why = exc.message if isinstance(exc, Unavailable) else "the database did not answer in time"
            await self._respond(msg, error_reply(ErrorCode.UNAVAILABLE, f"{why}; retry"))
            return
        except IrisfedError as exc:
            if not isinstance(exc, PermanentStoreError):
                await self._respond(msg, error_reply(exc.code, exc.message))
                return
            await self._request_failed(msg, exc)
            return
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            await self._request_failed(msg, exc)
            return
        await self._respond(msg, encoder.encode(reply))

    async def _request_failed(self, msg: Msg, exc: Exception) -> None:
        log.error("request_failed", subject=msg.subject, exc_info=True)
        await self._respond(msg, error_reply(ErrorCode.INTERNAL, f"internal error: {exc}"))

    async def cancel(self, job_id: str, requested_by: str = "user default", shown_as: str | None = None
                     ) -> CancelReply:
        """Cancel the job stored as ``job_id`` durably, as ``requested_by`` asked (``user
        alice``, ``operator (web)``: the history names them); the reply's outcome says
        what happened and names the job as its asker does (``shown_as``)."""
        shown = job_id if shown_as is None else shown_as
        try:
            return await self._cancel_one(job_id, requested_by, shown)
        except NotFound:
            elements = (await self.store.job_array_elements([job_id])).get(job_id)
            if elements is None:
                raise
        return await self._cancel_array(job_id, requested_by, shown)

    async def _cancel_array(self, array_id: str, requested_by: str, shown: str) -> CancelReply:
        """An array's cancel (§3.8): remembered first (from then on no end releases a held
        job), then every queued job at once, held ones included, then each live one as a
        cancel of it does; the reply says what the most telling one did."""
        await self.store.job_array_request_cancel(array_id)
        killed = await self.store.job_array_kill_queued(
            array_id, requested_by, f"{CancelOutcome.NEVER_STARTED.meaning} (cancelled by {requested_by})",
            f"{CancelOutcome.NOT_RESTARTED.meaning} (cancelled by {requested_by})")
        now = self.clock.now()
        for job_id, epoch in killed:
            await publish_event(self.nc, self.subjects, JobEvent(job_id, JobState.KILLED, "", epoch, now,
                                                                  reason=CancelOutcome.NEVER_STARTED.meaning))
        elements = (await self.store.job_array_elements([array_id]))[array_id]
        live = [element for element, state in elements if not JobState(state).is_terminal]
        replies = [await self._cancel_one(element, requested_by, element) for element in live]
        replies += [CancelReply(shown, JobState.KILLED, CancelOutcome.NEVER_STARTED)] if killed else []
        if not replies:  # every one had ended: the array's state as `irisfed jobs` shows it
            counts = Counter(state for _, state in elements)
            return CancelReply(shown, array_state(counts), CancelOutcome.ALREADY_FINISHED)
        telling = min(replies, key=lambda reply: _ARRAY_CANCEL_ORDER.index(reply.outcome))
        log.info("array_cancel", job_id=array_id, killed=len(killed), live=len(live), requested_by=requested_by)
        return CancelReply(shown, telling.state, telling.outcome)

    async def _cancel_one(self, job_id: str, requested_by: str, shown: str) -> CancelReply:
        async with self.store.transaction() as tx:
            row = await tx.job_get_for_update(job_id)
            if row is None:
                # Another user's job is answered exactly like no job at all (§3.2).
                raise NotFound(f"no job {shown!r}")
            owner, epoch = row.owner_peer_id, row.epoch
            decision = cancel_decision(row.state, row.cancel_requested, row.attempts,
                                       owner_reachable=owner in self.view.reachable_ids())
            if decision.action is CancelAction.NOTHING:
                return CancelReply(shown, row.state, decision.outcome)
            await tx.job_request_cancel(job_id, requested_by)
            if decision.action is CancelAction.KILL_NOW:
                await tx.job_move(Move(job_id, row.state, JobState.KILLED, epoch, actor="router",
                                       owner_peer_id=owner,
                                       reason=f"{decision.outcome.meaning} (cancelled by {requested_by})"))
        # Committed: now tell the owner (it also finds the flag on its next reconcile).
        if owner:
            await publish(self.nc, self.subjects.cancel_notice(owner), CancelNotice(job_id, owner, epoch))
        if decision.new_state is JobState.KILLED:
            await publish_event(self.nc, self.subjects,
                                JobEvent(job_id, JobState.KILLED, owner or "", epoch, self.clock.now(),
                                         reason=decision.outcome.meaning))
        metrics.CANCELS.labels(decision.outcome).inc()
        log.info("job_cancel", job_id=job_id, peer_id=owner, epoch=epoch, outcome=decision.outcome,
                 requested_by=requested_by)
        return CancelReply(shown, decision.new_state, decision.outcome)
