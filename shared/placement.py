"""Placement: which reachable peer and backend takes each queued job. Pure, no I/O.

Rules, applied to jobs in the order given (the tick passes priority order):
- A pinned job goes only to its pinned peer, and only while that peer is
  reachable and one of its backends has a free slot (capability checks are
  skipped for pins; a matching backend is preferred when there is one).
- An unpinned job goes to a reachable peer with a backend that satisfies every
  constraint and has a free slot; among those, the backend with the most free
  slots wins (ties: peer id, then backend name), which spreads load. Peers in the
  job's ``avoid_peers`` (they lost it before) are used only when no other
  reachable peer matches.
- Free slots are the backend's advertised total minus the jobs already live on
  it, and each placement made here takes one, so a tick never over-commits.
Jobs left waiting carry the rule that held them and a verdict per peer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.constraints import Constraint, matches_all
from shared.federation.peer import FederationPeer
from shared.federation.router import PeerVerdict, judge_peer


# QueuedJob and Placement are made 100k at a time in one tick run: named tuples are
# as immutable as frozen dataclasses and several times cheaper to build.
class QueuedJob(NamedTuple):
    """A queued job as the tick claimed it."""

    job_id: str
    epoch: int
    constraints: tuple[Constraint, ...] = ()
    pinned_peer_id: str | None = None
    avoid_peers: frozenset[str] = frozenset()


class Placement(NamedTuple):
    job_id: str
    epoch: int  # the epoch the job was claimed under (the CAS expects it)
    peer_id: str
    backend: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A job left queued, with the rule that held it back and each peer's verdict."""

    job_id: str
    rule: str
    verdicts: tuple[PeerVerdict, ...] = ()

    @property
    def reason(self) -> str:
        details = "; ".join(v.describe() for v in self.verdicts)
        return f"{self.rule}: {details}" if details else self.rule


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
    matched: dict[tuple[Constraint, ...], list[tuple[str, str]]] | None = None,
) -> tuple[list[Placement], list[Waiting]]:
    """Place ``jobs`` in order on ``peers``; return placements and jobs left waiting.

    ``matched`` remembers which (peer, backend) pairs each constraint set matches;
    a caller placing several batches against the same peers passes one dict to all.
    """
    if matched is None:
        matched = {}
    by_id = {peer.peer_id: peer for peer in peers}
    reachable = [peer for peer in peers if peer.is_reachable(now)]
    slots = free_slots(reachable, live)
    # Jobs mostly share a few constraint sets: match each set against the peers once,
    # and keep its candidates in a heap so each placement costs log(peers).
    matching_by_constraints: dict[tuple[Constraint, ...], _Candidates] = {}
    # Slots only shrink during a run, so a job kind that had to wait once would wait
    # again for the same reasons: explain it once.
    explained: dict[tuple, Waiting] = {}
    placements: list[Placement] = []
    waiting: list[Waiting] = []
    for job in jobs:
        if job.pinned_peer_id:
            choice = _place_pinned(job, by_id.get(job.pinned_peer_id), slots, now)
        else:
            candidates = matching_by_constraints.get(job.constraints)
            if candidates is None:
                matching = matched.get(job.constraints)
                if matching is None:
                    matching = matched[job.constraints] = [
                        (peer.peer_id, backend.name)
                        for peer in reachable
                        for backend in peer.backends
                        if matches_all(job.constraints, backend.attributes)
                    ]
                candidates = matching_by_constraints[job.constraints] = _Candidates(matching, slots)
            if job.avoid_peers:
                choice = _place_unpinned(job, candidates.matching, slots)
            else:
                choice = candidates.best(slots)
        if choice is None:
            key = (job.constraints, job.pinned_peer_id, job.avoid_peers)
            why = explained.get(key)
            if why is None:
                why = explained[key] = explain_waiting(job, peers, slots, now)
            waiting.append(Waiting(job.job_id, why.rule, why.verdicts))
            continue
        slots[choice] -= 1
        placements.append(Placement(job.job_id, job.epoch, choice[0], choice[1]))
    return placements, waiting


class _Candidates:
    """The backends matching one constraint set, best first (most free slots, then ids).

    Free slots only shrink during a run, so an entry whose count went stale is
    simply re-pushed with its current count when it surfaces (lazy heap).
    """

    def __init__(self, matching: list[tuple[str, str]], slots: Mapping[tuple[str, str], int]) -> None:
        self.matching = matching
        self.heap = [(-slots[m], m[0], m[1]) for m in matching if slots[m] > 0]
        heapq.heapify(self.heap)

    def best(self, slots: Mapping[tuple[str, str], int]) -> tuple[str, str] | None:
        heap = self.heap
        while heap:
            neg_free, peer_id, backend = heap[0]
            free = slots[(peer_id, backend)]
            if free <= 0:
                heapq.heappop(heap)
            elif -neg_free != free:
                heapq.heapreplace(heap, (-free, peer_id, backend))
            else:
                return peer_id, backend
        return None


def _place_pinned(
    job: QueuedJob, peer: FederationPeer | None, slots: dict[tuple[str, str], int], now: float
) -> tuple[str, str] | None:
    if peer is None or not peer.is_reachable(now):
        return None
    open_backends = [b for b in peer.backends if slots.get((peer.peer_id, b.name), 0) > 0]
    if not open_backends:
        return None
    matching = [b for b in open_backends if matches_all(job.constraints, b.attributes)]
    best = max(matching or open_backends, key=lambda b: (slots[(peer.peer_id, b.name)], b.name))
    return peer.peer_id, best.name


def _place_unpinned(
    job: QueuedJob, matching: Sequence[tuple[str, str]], slots: dict[tuple[str, str], int]
) -> tuple[str, str] | None:
    # Peers that lost this job before are a last resort: used only when no other
    # reachable peer matches at all, so a job whose only capable peer blinked is
    # not stranded forever.
    preferred = [m for m in matching if m[0] not in job.avoid_peers]
    best: tuple[int, str, str] | None = None
    for peer_id, backend_name in preferred or matching:
        free = slots[(peer_id, backend_name)]
        if free <= 0:
            continue
        # Most free slots first; ties go to the smaller peer id, then backend name.
        candidate = (-free, peer_id, backend_name)
        if best is None or candidate < best:
            best = candidate
    return None if best is None else (best[1], best[2])


def explain_waiting(
    job: QueuedJob, peers: Sequence[FederationPeer], slots: Mapping[tuple[str, str], int], now: float
) -> Waiting:
    """Why ``job`` could not be placed: the rule, and a verdict for every peer."""
    verdicts = []
    for peer in peers:
        if job.pinned_peer_id and peer.peer_id != job.pinned_peer_id:
            verdicts.append(PeerVerdict(peer.peer_id, "not_pinned_peer", f"not the pinned peer {job.pinned_peer_id}"))
            continue
        if peer.peer_id in job.avoid_peers:
            verdicts.append(PeerVerdict(peer.peer_id, "avoided", "lost this job before; avoided"))
            continue
        verdict = judge_peer(peer, () if job.pinned_peer_id else job.constraints, now)
        if verdict.code == "match":
            free = sum(slots.get((peer.peer_id, b.name), 0) for b in peer.backends
                       if job.pinned_peer_id or matches_all(job.constraints, b.attributes))
            if free <= 0:
                verdict = PeerVerdict(peer.peer_id, "no_free_capacity", "matches but has no free slot")
        verdicts.append(verdict)
    if job.pinned_peer_id:
        if job.pinned_peer_id not in {p.peer_id for p in peers}:
            rule = f"pinned to {job.pinned_peer_id}, which is not in the configuration"
        else:
            rule = f"pinned to {job.pinned_peer_id}; waiting for it to be reachable with a free slot"
    elif any(v.code == "no_free_capacity" for v in verdicts):
        rule = "matching peers are full; waiting for a free slot"
    else:
        rule = "no reachable peer matches; waiting for one"
    return Waiting(job.job_id, rule, tuple(verdicts))
