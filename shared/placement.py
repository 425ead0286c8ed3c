"""Placement: which reachable peer and backend takes each queued job. Pure, no I/O.

Rules, applied to jobs in the order given (the tick passes priority order):
- A pinned job goes only to its pinned peer, and only while that peer is
  reachable and one of its backends has a free slot (capability checks are
  skipped for pins; a matching backend is preferred when there is one).
- An unpinned job goes to a reachable peer, not in its ``avoid_peers``, with a
  backend that satisfies every constraint and has a free slot; among those, the
  backend with the most free slots wins (ties: peer id, then backend name), which
  spreads load.
- Free slots are the backend's advertised total minus the jobs already live on
  it, and each placement made here takes one, so a tick never over-commits.
Jobs left waiting carry a reason for the operator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.constraints import Constraint, matches_all
from shared.federation.peer import FederationPeer
from shared.federation.router import judge_peer


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A queued job as the tick claimed it."""

    job_id: str
    epoch: int
    constraints: tuple[Constraint, ...] = ()
    pinned_peer_id: str | None = None
    avoid_peers: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: str
    epoch: int  # the epoch the job was claimed under (the CAS expects it)
    peer_id: str
    backend: str


@dataclass(frozen=True, slots=True)
class Waiting:
    job_id: str
    reason: str


def free_slots(
    peers: Iterable[FederationPeer], live: Mapping[tuple[str, str | None], int]
) -> dict[tuple[str, str], int]:
    """Free slots per (peer, backend): advertised total minus live jobs there."""
    return {
        (peer.peer_id, backend.name): max(0, backend.total - live.get((peer.peer_id, backend.name), 0))
        for peer in peers
        for backend in peer.backends
    }


def assign_queued(
    jobs: Sequence[QueuedJob],
    peers: Sequence[FederationPeer],
    live: Mapping[tuple[str, str | None], int],
    now: float,
) -> tuple[list[Placement], list[Waiting]]:
    """Place ``jobs`` in order on ``peers``; return placements and jobs left waiting."""
    by_id = {peer.peer_id: peer for peer in peers}
    reachable = [peer for peer in peers if peer.is_reachable(now)]
    slots = free_slots(reachable, live)
    # Jobs mostly share a few constraint sets: match each set against the peers once.
    matching_by_constraints: dict[tuple[Constraint, ...], list[tuple[str, str]]] = {}
    placements: list[Placement] = []
    waiting: list[Waiting] = []
    for job in jobs:
        if job.pinned_peer_id:
            choice, reason = _place_pinned(job, by_id.get(job.pinned_peer_id), slots, now)
        else:
            matching = matching_by_constraints.get(job.constraints)
            if matching is None:
                matching = [
                    (peer.peer_id, backend.name)
                    for peer in reachable
                    for backend in peer.backends
                    if matches_all(job.constraints, backend.attributes)
                ]
                matching_by_constraints[job.constraints] = matching
            choice, reason = _place_unpinned(job, matching, peers, slots, now)
        if choice is None:
            waiting.append(Waiting(job.job_id, reason))
            continue
        slots[choice] -= 1
        placements.append(Placement(job.job_id, job.epoch, choice[0], choice[1]))
    return placements, waiting


def _place_pinned(
    job: QueuedJob, peer: FederationPeer | None, slots: dict[tuple[str, str], int], now: float
) -> tuple[tuple[str, str] | None, str]:
    pin = job.pinned_peer_id
    if peer is None:
        return None, f"pinned to {pin}, which is not in the configuration"
    if not peer.is_reachable(now):
        return None, f"pinned to {pin}, which is unreachable; waiting for it to return"
    if not peer.backends:
        return None, f"pinned to {pin}, which advertises no backends"
    open_backends = [b for b in peer.backends if slots.get((pin, b.name), 0) > 0]
    if not open_backends:
        return None, f"pinned to {pin}, which has no free slot"
    matching = [b for b in open_backends if matches_all(job.constraints, b.attributes)]
    best = max(matching or open_backends, key=lambda b: (slots[(pin, b.name)], b.name))
    return (pin, best.name), ""


def _place_unpinned(
    job: QueuedJob,
    matching: Sequence[tuple[str, str]],
    peers: Sequence[FederationPeer],
    slots: dict[tuple[str, str], int],
    now: float,
) -> tuple[tuple[str, str] | None, str]:
    best: tuple[int, str, str] | None = None
    full: list[str] = []
    for peer_id, backend_name in matching:
        if peer_id in job.avoid_peers:
            continue
        free = slots[(peer_id, backend_name)]
        if free <= 0:
            full.append(peer_id)
            continue
        # Most free slots first; ties go to the smaller peer id, then backend name.
        candidate = (-free, peer_id, backend_name)
        if best is None or candidate < best:
            best = candidate
    if best is not None:
        return (best[1], best[2]), ""
    if full:
        return None, "matching peers have no free slot: " + ", ".join(sorted(set(full)))
    reasons = []
    for peer in peers:
        if peer.peer_id in job.avoid_peers:
            reasons.append(f"{peer.peer_id}: avoided (lost this job before)")
        else:
            reasons.append(judge_peer(peer, job.constraints, now).describe())
    return None, "no peer can take it now: " + "; ".join(reasons)
