"""Pure decisions of the router: the job row and reply for a submit, and whether its
user may ask for its band.

What a cancel does is the rule of ``irisfed.shared.cancel``; the router applies it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from irisfed.shared.bands import BANDS, DEFAULT_BAND
from irisfed.shared.constraints import Constraint, matches_all
from irisfed.shared.dependencies import DEPENDENCY, Settled
from irisfed.shared.errors import Forbidden
from irisfed.shared.explain import explanation
from irisfed.shared.federation.peer import Backend
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan, backend_can_hold
from irisfed.shared.fencing import initial_epoch
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import PeerVerdictMsg, SubmitReply, SubmitRequest, encoder
from irisfed.shared.records import Explanation, NewJob, SubmittedJob
from irisfed.shared.resources import DEFAULT_RESOURCES, Resources
from irisfed.shared.users import (
    DEFAULT_MAX_BAND,
    DEFAULT_USER,
    QUOTA,
    UserConfig,
    stored_job_id,
    user_job_id,
)


def local_backend_for(constraints: Sequence[Constraint], local: Sequence[Backend],
                      resources: Resources = DEFAULT_RESOURCES, replicas: int = 1,
                      group_by: str = "") -> Backend | None:
    """The local cluster's first backend that satisfies every constraint and could hold
    ``replicas`` tasks of ``resources`` by its advertised totals and nodes
    (docs/scheduling.md, rule 2), if any."""
    for backend in local:
        if matches_all(constraints, backend.attributes) and backend_can_hold(backend, resources, replicas,
                                                                             group_by):
            return backend
    return None


@dataclass(frozen=True, slots=True)
class Routed:
    """Everything about a new job that follows from where it goes, not from the job.

    Built once per routing decision and shared by every submit routed the same way,
    so the per-submit work is only what differs per job (id, spec, reply).
    """

    plan: SubmitPlan
    state: JobState
    peer_id: str  # named in the reply: the local cluster, the pinned peer, or ""
    owner_peer_id: str | None
    backend: str | None
    epoch: int
    verdicts: tuple[PeerVerdictMsg, ...]  # in the reply of rejected jobs
    explanation: Explanation  # stored once, however many jobs share it
    reply_tail: bytes  # the reply after its job_id (see first_reply)


def route(plan: SubmitPlan, local_cluster: str, local_backend: Backend | None) -> Routed:
    """What a routing decision means for the job row and the reply."""
    disposition = plan.disposition
    owner = backend = None
    if disposition is SubmitDisposition.LOCAL:
        state, owner = JobState.ASSIGNED, local_cluster
        backend = local_backend.name if local_backend else None
        peer_id = local_cluster
    elif disposition is SubmitDisposition.QUEUE:
        state, peer_id = JobState.QUEUED, plan.pinned_peer_id
    else:
        state, peer_id = JobState.REJECTED, ""
    epoch = initial_epoch(state)
    rejected = disposition is SubmitDisposition.REJECT
    verdicts = tuple(PeerVerdictMsg(v.peer_id, v.code, v.detail) for v in plan.verdicts) if rejected else ()
    # A rejected job's reply lists every peer's verdict and a duplicate must repeat it,
    # so those are stored with the explanation (which lists only the first few).
    stored = Explanation(encoder.encode(explanation("router", plan.reason, plan.verdicts)),
                         encoder.encode(verdicts) if rejected else None)
    # Every field of the reply but the first, job_id, follows from the decision.
    blank = submit_reply("", disposition.value, state.value, peer_id, plan.reason, verdicts)
    assert blank.startswith(_REPLY_HEAD + b'""')
    return Routed(plan=plan, state=state, peer_id=peer_id, owner_peer_id=owner, backend=backend, epoch=epoch,
                  verdicts=verdicts, explanation=stored, reply_tail=blank[len(_REPLY_HEAD) + 2:])


_REPLY_HEAD = b'{"job_id":'
_DEFAULT_RESOURCES_JSON = encoder.encode(DEFAULT_RESOURCES.as_dict()).decode()


def first_reply(routed: Routed, job_id: str) -> bytes:
    """``submit_reply`` for a new job routed as ``routed``: the same bytes, spliced
    around the job_id instead of encoded whole (this runs for every submit)."""
    return _REPLY_HEAD + encoder.encode(job_id) + routed.reply_tail


def submit_reply(job_id: str, disposition: str, state: str, peer_id: str, reason: str,
                 verdicts: Sequence[PeerVerdictMsg], duplicate: bool = False) -> bytes:
    """A submit's success reply (JSON): the first one, and the same again for duplicates."""
    return encoder.encode(SubmitReply(job_id=job_id, disposition=disposition, state=state, peer_id=peer_id,
                                      duplicate=duplicate, reason=reason, verdicts=list(verdicts)))


def original_reply(row: SubmittedJob) -> bytes:
    """The reply a job's first submit got, marked ``duplicate`` (invariant 2), rebuilt
    from what never changes: the row's disposition and pin, its first changelog row
    (the state, owner and reason it was created with) and a rejected job's verdicts."""
    if row.disposition == SubmitDisposition.LOCAL.value:
        peer_id = row.first_peer_id or ""  # the local cluster it was created on
    else:
        peer_id = row.pinned_peer_id or ""
    verdicts = [PeerVerdictMsg(v["peer_id"], v["code"], v.get("detail", "")) for v in row.verdicts or ()]
    return submit_reply(user_job_id(row.job_id), row.disposition, row.first_state, peer_id, row.first_reason,
                        verdicts, duplicate=True)


def quota_rejected(reason: str) -> Routed:
    """What a submit asking more than its user's whole quota gets: rejected, naming it."""
    return route(SubmitPlan(SubmitDisposition.REJECT, reason=reason), "", None)


def waiting_for_quota(job: NewJob, reason: str) -> tuple[NewJob, bytes]:
    """A LOCAL job whose user's quota is full at submit: queued instead of assigned,
    with the quota as its reason (the tick places it once the user has room), and the
    reply that says so (the same one a duplicate of it gets)."""
    state = JobState.QUEUED
    stored = Explanation(encoder.encode(explanation("router", reason, code=QUOTA)))
    queued = msgspec.structs.replace(job, state=state.value, owner_peer_id=None, backend=None,
                                     epoch=initial_epoch(state), reason=reason, explanation=stored)
    return queued, submit_reply(user_job_id(job.job_id), job.disposition, state.value, "", reason, ())


def waiting_for_dependencies(job: NewJob, settled: Settled) -> tuple[NewJob, bytes]:
    """A job naming dependencies (docs/design.md §3.8), not rejected: the row to insert,
    queued whatever its route (the tick places it once they are met; a LOCAL route too,
    which was decided for now, not for then), waiting with code ``dependency`` while some
    have not ended; and its reply. When one ended as it may not (``settled.broken``), the
    reply says ``unschedulable``: the caller ends the row so in the same transaction
    (a job is created queued, and ends from there)."""
    reason = settled.broken or (settled.reason() if settled.pending else job.reason)
    stored = (Explanation(encoder.encode(explanation("router", reason, code=DEPENDENCY))) if settled.pending
              else job.explanation if job.state == JobState.QUEUED else None)
    waiting = msgspec.structs.replace(job, state=JobState.QUEUED.value, owner_peer_id=None, backend=None,
                                      epoch=initial_epoch(JobState.QUEUED), reason=reason, explanation=stored)
    state = JobState.UNSCHEDULABLE if settled.broken else JobState.QUEUED
    return waiting, submit_reply(user_job_id(job.job_id), job.disposition, state.value, job.pinned_peer_id or "",
                                 reason, ())


# Band name → its rank (shared.bands): a dict lookup on every submit.
BAND_RANKS = {name: rank for rank, name in enumerate(BANDS)}


def max_band_ranks(users: Iterable[UserConfig]) -> dict[str, int]:
    """Each configured user's ``max_band`` as a rank, for ``band_allowed``."""
    return {user.id: BAND_RANKS[user.max_band] for user in users}


def band_allowed(user: str, band: str, max_ranks: Mapping[str, int]) -> int:
    """The rank of ``band`` (a decoded request's, so a valid name) when ``user`` may ask
    for it; ``Forbidden`` naming both bands otherwise (docs/design.md §3.3). A user not
    in ``max_ranks`` (``default`` unconfigured) has the default ``max_band``."""
    rank = BAND_RANKS[band]
    most = max_ranks.get(user, _DEFAULT_MAX_RANK)
    if rank > most:
        default = " (the default band when none is given)" if band == DEFAULT_BAND else ""
        raise Forbidden(f"user {user} may submit at most band {BANDS[most]}; this job asks {band}{default}")
    return rank


_DEFAULT_MAX_RANK = BAND_RANKS[DEFAULT_MAX_BAND]


def plan_new_job(request: SubmitRequest, routed: Routed, job_id: str,
                 user: str = DEFAULT_USER) -> tuple[NewJob, bytes]:
    """The row to insert and the reply (JSON) to send once it is committed. ``job_id`` is
    the id ``user`` sent (or one made for it): the reply names it; the row is keyed by
    its stored form (shared.users). The row keeps the job's band as its rank."""
    plan = routed.plan
    reply = first_reply(routed, job_id)
    spec = request.canonical_spec()
    job = NewJob(
        job_id=stored_job_id(user, job_id),
        spec_json=spec.decode(),
        spec_hash=hashlib.sha256(spec).hexdigest(),
        state=routed.state.value,
        disposition=plan.disposition.value,
        pinned_peer_id=plan.pinned_peer_id or None,
        owner_peer_id=routed.owner_peer_id,
        backend=routed.backend,
        epoch=routed.epoch,
        max_retries=request.max_retries,
        priority=request.priority,
        deadline_s=request.deadline_s,
        reason=plan.reason,
        explanation=routed.explanation,
        resources_json=(encoder.encode(request.resource_request().as_dict()).decode() if request.resources
                        else _DEFAULT_RESOURCES_JSON),
        user_id=user,
        band=BAND_RANKS[request.band],
        replicas=request.replicas,
    )
    return job, reply
