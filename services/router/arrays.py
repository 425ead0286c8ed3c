"""A submit naming ``array: N`` (docs/design.md §3.8): N jobs ``<job_id>_<i>`` in one
transaction of its own, off the router's group-commit batches (arrays are few, and
each writes many rows).

In that transaction: the array's row is written first (its id taken: answered as a
resubmission, ``duplicate`` or ``conflict``, by the whole request's spec hash); its
dependencies, if any, are locked and settled as for one job (services/router/
dependencies.py), an array named in ``after`` standing for each of its elements;
then the elements are written, each queued (the tick places them: a LOCAL route too),
each told its index and the size in its environment. With ``array_parallel: K`` the
elements from the K-th on are *held*: Postgres releases one each time an element that
held a slot ends (trigger irisfed_array_release, migration 0020). An element id taken
already by another job refuses the whole submit (``conflict``), writing nothing.
"""

from __future__ import annotations

import msgspec

from irisfed.services.common.store import Store
from irisfed.services.router.dependencies import lock_dependencies
from irisfed.services.router.plan import (
    Routed,
    plan_new_job,
    submit_reply,
    waiting_for_dependencies,
)
from irisfed.shared.dependencies import Settled
from irisfed.shared.errors import Conflict
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import ARRAY_ENV, SubmitRequest
from irisfed.shared.records import Move, NewJob
from irisfed.shared.users import stored_job_id


def element_id(base: str, index: int) -> str:
    """The id of an array's element ``index``: ``sweep_3``."""
    return f"{base}_{index}"


def array_words(base: str, size: int, parallel: int | None) -> str:
    """What an array's reply says: ``array of 6 jobs sweep_0 … sweep_5, at most 2 live at once``."""
    last = f" … {element_id(base, size - 1)}" if size > 1 else ""
    limit = f", at most {parallel} live at once" if parallel is not None and parallel < size else ""
    return f"array of {size} job{'s' if size > 1 else ''} {element_id(base, 0)}{last}{limit}"


def repeated_reply(first: str) -> bytes:
    """An array's first reply (as stored in ``job_arrays``) as a resubmission gets it."""
    return first.replace('"duplicate":false', '"duplicate":true', 1).encode()


def held_words(base: str, parallel: int) -> str:
    """The reason of a held element: ``waiting for a slot of array sweep (2 live at once)``."""
    return f"waiting for a slot of array {base} ({parallel} live at once)"


def element_request(request: SubmitRequest, index: int) -> SubmitRequest:
    """What element ``index`` of ``request``'s array runs: the same job, told its index."""
    env = {**request.env, ARRAY_ENV[0]: str(index), ARRAY_ENV[1]: str(request.array)}
    return msgspec.structs.replace(request, env=env, array=None, array_parallel=None)


async def insert_array(store: Store, request: SubmitRequest, routed: Routed, base: str,
                       user: str) -> tuple[list[NewJob], bytes]:
    """Write ``request``'s array, its elements routed as ``routed``: the rows written (none:
    ``base`` named this array already, answered as a resubmission) and the reply."""
    size, parallel = request.array or 1, request.array_parallel
    stored_base = stored_job_id(user, base)
    spec_hash = request.spec_hash()
    words = array_words(base, size, parallel)
    async with store.transaction() as tx:
        settled = Settled(0, "", ())
        if request.after:
            settled = await lock_dependencies(tx, request, user)
        rejected = routed.state == JobState.REJECTED
        state = routed.state if rejected else (JobState.UNSCHEDULABLE if settled.broken else JobState.QUEUED)
        reason = routed.plan.reason if rejected else (settled.broken or (
            f"{words}; {settled.reason()}" if settled.pending else words))
        reply = submit_reply(base, routed.plan.disposition.value, state.value,
                             "" if not rejected else routed.peer_id, reason, routed.verdicts)
        if not await tx.job_array_insert(stored_base, user, size, parallel, spec_hash, reply):
            existing = await tx.job_array_get(stored_base)
            if existing is None or existing.spec_hash != spec_hash:
                raise Conflict(f"job_id {base!r} already names an array with a different spec")
            return [], repeated_reply(existing.reply)
        if await tx.job_get_submitted([stored_base]):
            raise Conflict(f"job_id {base!r} already names a job; an array needs an id of its own")
        jobs = []
        for index in range(size):
            job, _ = plan_new_job(element_request(request, index), routed, element_id(base, index), user)
            if not rejected:
                job, _ = waiting_for_dependencies(job, settled)
            jobs.append(job)
        created = await tx.job_insert_batch(jobs)
        if len(created) < size:
            taken = next(index for index, job in enumerate(jobs) if job.job_id not in created)
            raise Conflict(f"job_id {element_id(base, taken)!r} already names a job or an array; "
                           f"array {base!r} would need that id")
        live = not rejected and not settled.broken
        pending = settled.pending if live else 0
        await tx.job_array_mark(stored_base, [
            (job.job_id, index, live and parallel is not None and index >= parallel, pending)
            for index, job in enumerate(jobs)], held_words(base, parallel or size))
        if request.after and not rejected:
            await tx.job_dependencies_insert_edges(
                [(job.job_id, stored, when) for job in jobs for _, stored, when in settled.edges])
        if not rejected and settled.broken:
            for job in jobs:
                await tx.job_move(Move(job.job_id, JobState.QUEUED, JobState.UNSCHEDULABLE, job.epoch,
                                       actor="dependency", owner_peer_id=None, reason=settled.broken))
            jobs = [msgspec.structs.replace(job, state=JobState.UNSCHEDULABLE.value) for job in jobs]
    return jobs, reply

