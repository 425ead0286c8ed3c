"""Pure decisions of the router: the job row and reply for a submit, and what a cancel does."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from irisfed.shared.constraints import Constraint, matches_all
from irisfed.shared.explain import explanation
from irisfed.shared.federation.peer import Backend
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan, backend_can_hold
from irisfed.shared.lifecycle import CancelOutcome, JobState
from irisfed.shared.messages import PeerVerdictMsg, SubmitReply, SubmitRequest, encoder
from irisfed.shared.records import Explanation, NewJob, SubmittedJob
from irisfed.shared.resources import DEFAULT_RESOURCES, Resources

# LOCAL jobs are created already assigned to the local agent, under this first epoch.
FIRST_EPOCH = 1


def local_backend_for(constraints: Sequence[Constraint], local: Sequence[Backend],
                      resources: Resources = DEFAULT_RESOURCES) -> Backend | None:
    """The local cluster's first backend that satisfies every constraint and could hold
    ``resources`` by its advertised totals (docs/scheduling.md, rule 2), if any."""
    for backend in local:
        if matches_all(constraints, backend.attributes) and backend_can_hold(backend, resources):
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
    epoch = 0
    if disposition is SubmitDisposition.LOCAL:
        state, owner, epoch = JobState.ASSIGNED, local_cluster, FIRST_EPOCH
        backend = local_backend.name if local_backend else None
        peer_id = local_cluster
    elif disposition is SubmitDisposition.QUEUE:
        state, peer_id = JobState.QUEUED, plan.pinned_peer_id
    else:
        state, peer_id = JobState.REJECTED, ""
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
    return submit_reply(row.job_id, row.disposition, row.first_state, peer_id, row.first_reason, verdicts,
                        duplicate=True)


def plan_new_job(request: SubmitRequest, routed: Routed, job_id: str) -> tuple[NewJob, bytes]:
    """The row to insert and the reply (JSON) to send once it is committed."""
    plan = routed.plan
    reply = first_reply(routed, job_id)
    spec = request.canonical_spec()
    job = NewJob(
        job_id=job_id,
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
    )
    return job, reply


class CancelAction(StrEnum):
    """What a cancel does to a job in the database."""

    KILL_NOW = "kill_now"  # not started: killed in the database (fences the owner's start)
    ASK_OWNER = "ask_owner"  # running: the request is stored and the owner told
    REPEAT = "repeat"  # running, cancel already requested: stored and told again
    NOTHING = "nothing"  # already finished


def cancel_action(state: JobState, cancel_requested: bool) -> CancelAction:
    """What a cancel does to a job in ``state``."""
    if state.is_terminal:
        return CancelAction.NOTHING
    if state in (JobState.QUEUED, JobState.ASSIGNED):
        # Not started: killing it in the database fences the owner's start (its CAS
        # assigned → running can no longer succeed).
        return CancelAction.KILL_NOW
    return CancelAction.REPEAT if cancel_requested else CancelAction.ASK_OWNER


@dataclass(frozen=True, slots=True)
class CancelDecision:
    """A cancel's action, the outcome its requester is told, and the job's state after it."""

    action: CancelAction
    outcome: CancelOutcome
    new_state: JobState


def cancel_decision(state: JobState, cancel_requested: bool, attempts: int,
                    owner_reachable: bool) -> CancelDecision:
    """Decide a cancel of a job in ``state`` (started ``attempts`` times; its owner reachable or not)."""
    action = cancel_action(state, cancel_requested)
    if action is CancelAction.NOTHING:
        return CancelDecision(action, CancelOutcome.ALREADY_FINISHED, state)
    if action is CancelAction.KILL_NOW:
        # A job requeued after a lost peer did run before: it is not restarted.
        outcome = CancelOutcome.NEVER_STARTED if attempts == 0 else CancelOutcome.NOT_RESTARTED
        return CancelDecision(action, outcome, JobState.KILLED)
    if not owner_reachable:
        return CancelDecision(action, CancelOutcome.PENDING_OWNER_OFFLINE, state)
    outcome = CancelOutcome.ALREADY_REQUESTED if action is CancelAction.REPEAT else CancelOutcome.KILL_SENT
    return CancelDecision(action, outcome, state)
