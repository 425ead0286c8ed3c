"""A submit naming dependencies (docs/design.md §3.8): one transaction of its own, off
the router's group-commit batches (such submits are few, and each must lock what it
waits for).

In that transaction: the named jobs are locked (``FOR SHARE``) and must all be the
submitter's own and exist (else ``invalid_request`` naming the first that is not); a
name that is an array's stands for each of its elements, locked alike. Their states
decide the new job's (``shared.dependencies``: waiting ``queued`` while some have not
ended, ``unschedulable`` at once if one ended as it may not); the job, its edges and
its count of pending ones are written. A dependency ending meanwhile waits for the
lock and then finds the edges (Postgres settles them: migration 0019), or ended before
and was read as ended: the new job is never stranded. An id already taken answers
like any resubmission (``duplicate`` or ``conflict``).
"""

from __future__ import annotations

import msgspec

from irisfed.services.common.store import Store
from irisfed.services.router.plan import original_reply, waiting_for_dependencies
from irisfed.shared.dependencies import Settled, settle
from irisfed.shared.errors import Conflict, InvalidRequest
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import SubmitRequest
from irisfed.shared.records import Move, NewJob
from irisfed.shared.users import stored_job_id, user_job_id

# The most edges one submit may write (an array of N jobs after an array of M: N × M).
MAX_EDGES = 100_000


def check_edges(jobs: int, each: int) -> None:
    """Refuse a submit whose ``jobs`` jobs (an array's) waiting for ``each`` jobs each would
    write more than MAX_EDGES dependencies."""
    if jobs * each > MAX_EDGES:
        raise InvalidRequest(f"after: {jobs:,} job{'s' if jobs != 1 else ''} waiting for {each:,} each make "
                             f"{jobs * each:,} dependencies; at most {MAX_EDGES:,} in one submit (an array "
                             "named stands for each of its jobs)")


async def lock_dependencies(tx: Store, request: SubmitRequest, user: str) -> Settled:
    """Lock ``request.after`` (in ``tx``'s transaction) and settle it: arrays named
    stand for each of their elements; a name that is neither a job nor an array of
    ``user`` is refused."""
    named = [(d.job_id, stored_job_id(user, d.job_id), d.when) for d in request.after]
    states = await tx.job_dependencies_lock([stored for _, stored, _ in named])
    after = [edge for edge in named if edge[1] in states]
    arrays = [edge for edge in named if edge[1] not in states]
    if arrays:
        elements = await tx.job_array_elements([stored for _, stored, _ in arrays], lock=True)
        for shown, stored, when in arrays:
            if stored not in elements:
                raise InvalidRequest(f"after: no job {shown!r} of yours to wait for")
            for element, state in elements[stored]:
                if element not in states:  # named itself too: one edge
                    after.append((user_job_id(element), element, when))
                    states[element] = state
    check_edges(request.array or 1, len(after))
    return settle(after, states)


async def insert_with_dependencies(store: Store, request: SubmitRequest, job: NewJob, reply: bytes,
                                   user: str) -> tuple[NewJob | None, bytes]:
    """Write ``job`` (planned as ``reply`` says) waiting for ``request.after``: the row
    written (None: its id named a job already, answered as a resubmission) and the reply."""
    async with store.transaction() as tx:
        settled = await lock_dependencies(tx, request, user)
        if job.state != JobState.REJECTED:  # a job no peer can run is rejected whatever it waits for
            job, reply = waiting_for_dependencies(job, settled)
        created = await tx.job_insert_batch([job])
        if job.job_id in created:
            if job.state != JobState.REJECTED:  # its edges are shown with it (job, the page)
                pending = 0 if settled.broken else settled.pending
                await tx.job_dependencies_insert(job.job_id, [(stored, when) for _, stored, when in settled.edges],
                                                 pending)
            if job.state != JobState.REJECTED and settled.broken:
                await tx.job_move(Move(job.job_id, JobState.QUEUED, JobState.UNSCHEDULABLE, job.epoch,
                                       actor="dependency", owner_peer_id=None, reason=settled.broken))
                job = msgspec.structs.replace(job, state=JobState.UNSCHEDULABLE.value)  # as announced
            return job, reply
    existing = (await store.job_get_submitted([job.job_id])).get(job.job_id)
    if existing is None or existing.spec_hash != job.spec_hash:
        raise Conflict(taken_id(job.job_id, existing is None))
    return None, original_reply(existing)


def taken_id(stored_id: str, by_array: bool) -> str:
    """Why a job cannot have ``stored_id``: an array's id (no job row: the insert skipped
    it), or another job's with a different spec."""
    if by_array:
        return f"job_id {user_job_id(stored_id)!r} already names an array; a job needs an id of its own"
    return f"job_id {user_job_id(stored_id)!r} already names a job with a different spec"
