"""Dry runs being answered (``dry_run: true``): what the router reads for one, and its reply.

A dry run is decoded, checked and routed exactly like a submit (service.py), then
leaves that path here: a task of its own (its reads must not hold up the submits
behind it on the subscription, nor occupy a writer) reads what placing it needs from
Postgres — read-only, one dry run at a time, on a pooled connection — and answers a
``DryRunReply``. It writes nothing, publishes nothing and takes no lock. What it
judges, and what not, is dry_run.py's (pure). Past DRY_RUNS_WAITING_AT_MOST dry runs
not finished, the next is answered `unavailable` at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg

from irisfed.services.common import metrics
from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.store import Store
from irisfed.services.router.arrays import array_words, element_id, repeated_reply
from irisfed.services.router.dependencies import check_edges, taken_id
from irisfed.services.router.dry_run import (
    UNNAMED,
    dry_run_reply,
    local_placement,
    queued_job,
    would_place,
)
from irisfed.services.router.plan import (
    Routed,
    first_reply,
    original_reply,
    plan_new_job,
    submit_reply,
    waiting_for_dependencies,
    waiting_for_quota,
)
from irisfed.shared.clock import Clock
from irisfed.shared.dependencies import DEPENDENCY, settle
from irisfed.shared.errors import (
    Conflict,
    ErrorCode,
    InvalidRequest,
    IrisfedError,
    PermanentStoreError,
    Unavailable,
)
from irisfed.shared.fair_share import FairShareRun
from irisfed.shared.federation.router import SubmitDisposition
from irisfed.shared.holds import Waiting
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import DryRunReply, SubmitRequest, encoder, error_reply
from irisfed.shared.placement import PACK, RESERVE_AFTER_S, PlacementRun
from irisfed.shared.preemption import VictimPool, candidate_from_row
from irisfed.shared.users import QUOTA, UserTable, quota_wait, stored_job_id, user_job_id

log = EventLogger("router")

# Dry runs read Postgres one at a time (one of the spare connections at most, so cancels
# and the peer view keep theirs); beyond this many waiting, `unavailable` at once.
DRY_RUNS_WAITING_AT_MOST = 100


async def _dependencies(db: Store, request: SubmitRequest, user: str) -> list[tuple[str, str, str, str]]:
    """Each dependency of ``request`` as (shown id, stored id, when, its state now), read
    without a lock; ``invalid_request`` naming one that is not ``user``'s or does not exist."""
    found, arrays = [], []
    for dependency in request.after:
        stored = stored_job_id(user, dependency.job_id)
        row = await db.job_get(stored)
        if row is not None:
            found.append((dependency.job_id, stored, dependency.when, row.state))
        else:
            arrays.append((dependency, stored))
    named = {stored for _, stored, _, _ in found}
    for dependency, stored in arrays:  # an array: each of its jobs not named itself (lock_dependencies' rule)
        elements = (await db.job_array_elements([stored])).get(stored)
        if elements is None:
            raise InvalidRequest(f"after: no job {dependency.job_id!r} of yours to wait for")
        found += [(user_job_id(e), e, dependency.when, state) for e, state in elements if e not in named]
        named.update(e for e, _ in elements)
    check_edges(request.array or 1, len(found))
    return found


async def _elements_free(db: Store, request: SubmitRequest, stored: str, user: str) -> None:
    """Conflict, as the submit would answer, when an array's id or one of its jobs' ids
    names a job already."""
    if await db.job_get_submitted([stored]):
        raise Conflict(f"job_id {user_job_id(stored)!r} already names a job; an array needs an id of its own")
    base = user_job_id(stored)
    ids = [stored_job_id(user, element_id(base, index)) for index in range(request.array or 0)]
    taken = await db.job_get_submitted(ids) if stored != UNNAMED else {}
    if taken:
        first = next(job_id for job_id in ids if job_id in taken)
        raise Conflict(f"job_id {user_job_id(first)!r} already names a job or an array; "
                       f"array {base!r} would need that id")


class DryRuns:
    """The router's dry runs: each answered from a task of its own, read one at a time.

    ``bounded`` is the router's (its answer in time, the work finishing in the
    background); ``respond`` answers a request.
    """

    def __init__(self, store: Store, view: PeerView, clock: Clock, users: UserTable, quota_users: set[str],
                 bounded: Callable[[Awaitable[Any]], Awaitable[Any]],
                 respond: Callable[[Msg, bytes], Awaitable[None]]) -> None:
        self.store = store
        self.view = view
        self.clock = clock
        self.users = users
        self.quota_users = quota_users
        self._bounded = bounded
        self._respond = respond
        self._tasks: set[asyncio.Task] = set()  # dry runs being answered
        self._open = 0  # dry runs not finished (some may outlive their timed-out request)
        self._turn = asyncio.Semaphore(1)

    def running(self) -> list[asyncio.Task]:
        """The dry runs being answered (the router cancels them when it closes)."""
        return list(self._tasks)

    def start(self, msg: Msg, request: SubmitRequest, routed: Routed, user: str) -> None:
        """Answer a dry run from a task of its own: its reads must not hold up the
        submits behind it on this subscription, nor occupy a writer."""
        if self._open >= DRY_RUNS_WAITING_AT_MOST:
            metrics.SUBMIT_ERRORS.labels(ErrorCode.UNAVAILABLE).inc()
            task = asyncio.ensure_future(self._respond(msg, error_reply(
                ErrorCode.UNAVAILABLE, f"router busy: {self._open} dry runs waiting; retry")))
        else:
            task = asyncio.ensure_future(self._answer(msg, request, routed, user))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg, request: SubmitRequest, routed: Routed, user: str) -> None:
        self._open += 1

        async def counted() -> DryRunReply:
            try:
                return await self.dry_run(request, routed, user)
            finally:
                self._open -= 1

        try:
            body = encoder.encode(await self._bounded(counted()))
        except (Unavailable, TimeoutError) as exc:
            metrics.DB_UNAVAILABLE.inc()
            why = exc.message if isinstance(exc, Unavailable) else "the database did not answer in time"
            body = error_reply(ErrorCode.UNAVAILABLE, f"{why}; retry")
        except IrisfedError as exc:
            if isinstance(exc, PermanentStoreError):
                log.error("dry_run_failed", exc_info=True)
                body = error_reply(ErrorCode.INTERNAL, f"internal error: {exc}")
            else:
                body = error_reply(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            log.error("dry_run_failed", exc_info=True)
            body = error_reply(ErrorCode.INTERNAL, f"internal error: {exc}")
        await self._respond(msg, body)

    async def dry_run(self, request: SubmitRequest, routed: Routed, user: str) -> DryRunReply:
        """What submitting ``request`` (decoded, its band allowed, routed as ``routed``) as
        ``user`` would do now; writes nothing (dry_run.py says what it judges, and what not).

        Reads only, one dry run at a time, on a pooled connection (never a writer's):
        the job if its id exists, and for a job that would be assigned or placed, the
        live jobs' usage (of its user too when it has a quota) and the jobs it could
        preempt. No lock is taken: a quota's figures are those committed now.
        A job_id naming this user's job already is answered as its resubmission would
        be: the original answer marked ``duplicate``, or ``conflict`` for another spec.
        """
        job_id = request.job_id or ""
        stored = stored_job_id(user, job_id) if job_id else UNNAMED
        disposition = routed.plan.disposition
        async with self._turn, self.store.connection() as db:
            array = await db.job_array_get(stored) if job_id else None
            if request.array is not None:
                if array is not None:
                    if array.spec_hash != request.spec_hash():
                        raise Conflict(f"job_id {job_id!r} already names an array with a different spec")
                    return dry_run_reply(repeated_reply(array.reply), request.band)
                await _elements_free(db, request, stored, user)
                if disposition is SubmitDisposition.LOCAL:
                    disposition = SubmitDisposition.QUEUE  # an array's jobs are stored queued: the tick places them
            elif array is not None:
                raise Conflict(taken_id(stored, True))
            if job_id and request.array is None:
                existing = (await db.job_get_submitted([stored])).get(stored)
                if existing is not None:
                    if existing.spec_hash != request.spec_hash():
                        raise Conflict(taken_id(stored, False))
                    return dry_run_reply(original_reply(existing), request.band)
            real = first_reply(routed, job_id)
            if disposition is SubmitDisposition.REJECT:
                return dry_run_reply(real, request.band)
            words = array_words(job_id or "<job_id>", request.array, request.array_parallel) if request.array else ""
            if words:  # an array's reply names the array, its jobs stored queued
                real = submit_reply(job_id, routed.plan.disposition.value, JobState.QUEUED.value, "", words, ())
            units = request.resource_request().units
            held = await db.job_live_usage_by_user([user]) if user in self.quota_users else {}
            if request.after:  # as insert_with_dependencies would judge it, from what is committed now
                found = await _dependencies(db, request, user)
                settled = settle([f[:3] for f in found], {stored: state for _, stored, _, state in found})
                if settled.pending or settled.broken:
                    new_job, _ = plan_new_job(request, routed, job_id, user)
                    _, waiting_reply = waiting_for_dependencies(new_job, settled)
                    if words:
                        waiting_reply = submit_reply(
                            job_id, routed.plan.disposition.value,
                            (JobState.UNSCHEDULABLE if settled.broken else JobState.QUEUED).value, "",
                            settled.broken or f"{words}; {settled.reason()}", ())
                    outcome = Waiting(stored, settled.reason(), code=DEPENDENCY) if settled.pending else None
                    return dry_run_reply(waiting_reply, request.band, outcome)
                disposition = SubmitDisposition.QUEUE  # met already: stored queued, the tick places it
            if disposition is SubmitDisposition.LOCAL:
                # As the router's _insert_under_quota would judge it, from what is committed now.
                capped = user in self.quota_users
                why = quota_wait(self.users.get(user), held.get(user, {}), units, request.replicas) if capped else None
                if why is None:
                    return dry_run_reply(real, request.band, local_placement(routed))
                new_job, _ = plan_new_job(request, routed, job_id, user)
                _, waiting_reply = waiting_for_quota(new_job, why)
                return dry_run_reply(waiting_reply, request.band, Waiting(stored, why, code=QUOTA))
            # QUEUE: one placement run of the tick's, this job alone in its queue.
            peers, now = self.view.peers(), self.clock.monotonic()
            live, used = await db.job_live_usage()
            run = PlacementRun(peers, live, now, used=used, policy=PACK, reserve_after_s=RESERVE_AFTER_S)
            job = queued_job(request, routed, stored)
            if job.band > 0 and run.rooms_of_peer:
                rows = await db.job_list_preemptible(job.band, sorted(run.rooms_of_peer))
                run.pool = VictimPool(map(candidate_from_row, rows), job.band)
        placements, waiting = FairShareRun(run, self.users, held).place({user: [job]})
        return dry_run_reply(real, request.band, would_place(stored, placements, waiting, run.preempted))
