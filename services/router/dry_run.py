"""Pure decisions of a dry run (``dry_run: true``): the job as the tick would see it, and
the answer. No I/O; the router's service reads what these need.

A dry run answers what the submit would do now (docs/design.md §3.3) and writes
nothing. Its routing fields are the real submit's reply itself (built by plan.py, then
decoded), so they cannot drift from it; what it adds is where the job would go now:

- LOCAL: the local cluster and the backend the router picked — or, for a user whose
  quota is full now, the queued state and the quota reason its real submit would get.
- QUEUE: one placement run of the tick's rules (shared/placement.py with its default
  policy, ``pack``, and ``RESERVE_AFTER_S``; fair share and quotas by
  shared/fair_share.py; preemption by shared/preemption.py) over the router's current
  view of the peers and the live jobs in Postgres, with this job alone in the queue.
  It does not simulate the queued jobs ahead of it: the tick places those first (by
  band, fair share, priority and age), so under a backlog the job may wait, or go
  elsewhere, where the dry run found room. Nor does it know the holds the tick keeps
  for jobs waiting long (anti-starvation).
- REJECT and duplicates: nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from irisfed.services.router.plan import BAND_RANKS, Routed
from irisfed.shared.federation.router import SubmitDisposition
from irisfed.shared.holds import Waiting
from irisfed.shared.messages import (
    DryRunPlacement,
    DryRunReply,
    PeerVerdictMsg,
    SubmitReply,
    SubmitRequest,
)
from irisfed.shared.preemption import Candidate
from irisfed.shared.rooms import Placement, QueuedJob

_replies = msgspec.json.Decoder(SubmitReply)

# The key of a dry-run job sent without a job_id while it is placed (never stored).
UNNAMED = "(dry run)"


def queued_job(request: SubmitRequest, routed: Routed, job_id: str) -> QueuedJob:
    """The job as the tick would claim it right after the submit: ``job_id`` its stored
    id, no wait behind it, no peer to avoid."""
    return QueuedJob(
        job_id=job_id,
        epoch=routed.epoch,
        constraints=tuple(request.constraint_list()),
        pinned_peer_id=routed.plan.pinned_peer_id or None,
        resources=request.resource_request(),
        preferences=tuple(request.preference_list()),
        waited_s=0.0,
        band=BAND_RANKS[request.band],
        replicas=request.replicas,
        group_by=request.group_by(),
    )


def would_place(job_id: str, placements: Sequence[Placement], waiting: Sequence[Waiting],
                preempted: Mapping[str, Sequence[Candidate]]) -> DryRunPlacement | Waiting:
    """Where a placement run put ``job_id`` (with whom it preempts there, by stored id), or
    why it left it waiting."""
    for placement in placements:
        if placement.job_id == job_id:
            return DryRunPlacement(placement.peer_id, placement.backend,
                                   [victim.job_id for victim in preempted.get(job_id, ())])
    for left in waiting:
        if left.job_id == job_id:
            return left
    raise ValueError(f"the placement run neither placed nor left waiting {job_id!r}")


def local_placement(routed: Routed) -> DryRunPlacement | None:
    """Where a LOCAL job goes: the local cluster's backend the router picked."""
    if routed.plan.disposition is not SubmitDisposition.LOCAL or routed.owner_peer_id is None:
        return None
    return DryRunPlacement(routed.owner_peer_id, routed.backend or "")


def dry_run_reply(real_reply: bytes, band: str, outcome: DryRunPlacement | Waiting | None = None) -> DryRunReply:
    """The dry run's answer: the real submit's reply (``real_reply``, the JSON it would
    send), the band, and where the job would go now (``outcome``: a placement, why it
    would wait, or None for a rejected job or a duplicate)."""
    real = _replies.decode(real_reply)
    placement = outcome if isinstance(outcome, DryRunPlacement) else None
    waiting = outcome if isinstance(outcome, Waiting) else None
    return DryRunReply(
        job_id=real.job_id, disposition=real.disposition, state=real.state, peer_id=real.peer_id,
        reason=real.reason, verdicts=real.verdicts, duplicate=real.duplicate, band=band,
        placement=placement,
        waiting=waiting.rule if waiting is not None else "",
        waiting_code=(waiting.code or "") if waiting is not None else "",
        waiting_verdicts=[PeerVerdictMsg(v.peer_id, v.code, v.detail) for v in waiting.verdicts]
        if waiting is not None else [],
    )
