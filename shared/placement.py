"""Placement: which reachable peer and backend takes each queued job. Pure, no I/O.

The entry points — ``PlacementRun`` (a run placing the queue batch by batch) and
``assign_queued`` (one batch) — and single-task placement: each kind of job's best
backend, pins, avoided peers, and preemption for a single task. The rest of the rule
lives in one module a concern, each importing only those before it:

- shared/rooms.py: the jobs and placements (``QueuedJob``, ``Placement``), what each
  backend has free during a run (``free_slots``, ``add_usage``, its rooms), a hold's
  terms (``Hold``), and the backends each kind of job could use, best first;
- shared/holds.py: anti-starvation holds (which backend a starving job holds) and why
  jobs wait (``Waiting``, ``explain_waiting``);
- shared/gang_placement.py: gangs, all tasks or none on distinct nodes of one backend.

Rules, applied to jobs in the order given (the tick passes priority order, oldest
first within a priority):

- Room. A backend has room for a job when it has a free slot (every job takes one)
  and, when it advertises resources, at least the job's request free in every
  resource (one it does not list counts as none). A backend that advertises no
  resources (an older agent) is judged by slots only. Free slots are the advertised
  total minus the jobs live there (``live``); free resources are the advertised
  totals minus what live jobs use (``used``; without it, the advertised free). Each
  placement made here takes its share, so a run never over-commits; a run placing
  the queue batch by batch (``PlacementRun``) keeps the shares, and what it learnt
  about the queue, from one batch to the next.
- A pinned job goes only to its pinned peer, and only while that peer is reachable
  and one of its backends has room (capability checks are skipped for pins; a
  backend matching the constraints is preferred when there is one).
- An unpinned job goes to a reachable peer with a backend that satisfies every
  constraint and has room. Peers in the job's ``avoid_peers`` (they lost it before)
  are used only when no other reachable peer could ever hold it.
- Among the backends with room, the best is, in this order: the one satisfying the
  most of the job's preferences; one that advertises resources over one that does
  not; the best *fit* for the policy; the most free slots; then peer id and backend
  name. Fit: the sum, over the resources the backend advertises, of the fraction of
  each left free after placing the job. ``pack`` (the default) takes the least left
  (best fit: big holes stay whole for big jobs), ``spread`` the most. Where fits tie
  (backends advertising no resources) the most free slots wins, which spreads
  slot-only work as before resources existed.
- Preemption (shared/preemption.py). Given a ``VictimPool`` (``pool``), a job of a
  band above ``batch`` that finds no room stops the fewest live jobs of strictly
  lower bands on one backend where it then fits, and is placed there; the victims
  and the placement are in ``preempted`` for the caller to commit together.
- Anti-starvation. A job that has waited ``reserve_after_s`` or longer and finds no
  room *holds* the backend where it would fit soonest: of the backends it could ever
  fit on (by their totals) and not already held, the one with the smallest
  shortfall (the sum of what it lacks as fractions of each total, a missing slot
  counting 1/slots). For the rest of the run (a PlacementRun keeps it across its
  batches; ``reservations`` carries it across calls) no later job may be placed
  there unless it leaves at least the held job's request free, in a slot and in
  every resource the held job asks for. The backend drains of whatever the held
  job lacks, and the held job, first in order, takes it as soon as it fits.

Jobs left waiting carry the rule that held them and a verdict per peer, naming the
resources a backend lacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from heapq import heappop, heapreplace

from irisfed.shared.constraints import Constraint, matches_all
from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.gang_placement import GangPlacementMixin
from irisfed.shared.holds import Waiting, _explain, _reserve, waiting_rule
from irisfed.shared.nodes import Gang
from irisfed.shared.preemption import (
    LOWEST_BAND,
    NO_LOWER_BAND,
    ONLY_HELD,
    STILL_NO_ROOM,
    Candidate,
    VictimPool,
    choose_victims,
    victims_rank,
)
from irisfed.shared.resources import Resources, as_resources
from irisfed.shared.rooms import Hold, Placement, QueuedJob, _Kind, _rank, _Room, free_slots

PACK = "pack"
SPREAD = "spread"
POLICIES = (PACK, SPREAD)
# Long enough that ordinary churn (jobs waiting a tick or two for a slot) never holds
# a backend back; short enough that a big job starts within minutes of a backend
# draining instead of never.
RESERVE_AFTER_S = 300.0

def assign_queued(
    jobs: Sequence[QueuedJob],
    peers: Sequence[FederationPeer],
    live: Mapping[tuple[str, str | None], int],
    now: float,
    matched: dict[tuple[Constraint, ...], list[tuple[str, str]]] | None = None,
    *,
    used: Mapping[tuple[str, str | None], Mapping[str, float]] | None = None,
    policy: str = PACK,
    reserve_after_s: float | None = RESERVE_AFTER_S,
    reservations: dict[tuple[str, str], Hold] | None = None,
) -> tuple[list[Placement], list[Waiting]]:
    """Place ``jobs`` in order on ``peers``; return placements and jobs left waiting.

    ``live``: jobs live per (peer, backend) (slots in use). ``used``: resources live
    jobs use per (peer, backend), in each resource's own unit; None takes each
    backend's advertised free amounts instead. ``policy``: ``pack`` or ``spread``.
    ``reserve_after_s``: wait after which a job holds a backend (None: never).

    One :class:`PlacementRun` placing one batch. A caller placing several batches in
    one run should keep a PlacementRun for the run instead (it keeps what it learnt
    between batches); calling this per batch works too, passing the same ``matched``
    (which backends each constraint set matches) and ``reservations`` (backends held
    for starving jobs) to all and adding each batch's placements to ``live`` and ``used``.
    """
    run = PlacementRun(peers, live, now, used=used, policy=policy, reserve_after_s=reserve_after_s,
                       reservations=reservations, matched=matched)
    return run.place(jobs)


class PlacementRun(GangPlacementMixin):
    """One placement run over a fixed view of the peers: ``place`` the queue batch by batch.

    Rooms (what each reachable backend has free) are built once, from ``live`` and
    ``used`` (read here, never written), and every placement takes its share of its
    room, so each batch sees what the earlier ones took without the caller counting.
    What the run learns — each kind of job's candidates in a heap, why a kind had to
    wait, which kinds found nothing to hold, the holds themselves (``reservations``,
    kept in the dict passed, if any) — lives as long as the run, not a batch: placing
    a queue in several batches gives exactly what placing it in one call gives.

    ``release`` gives back a placement the caller could not commit (its compare-and-set
    lost). Rooms then grow, which the cached heaps and explanations assume they never
    do, so those are dropped and rebuilt as the next jobs need them; releases are rare.
    """

    __slots__ = ("_by_id", "_changed", "_explained", "_gang_full", "_kinds", "_no_hold", "_no_victims",
                 "_victims_on", "_seq", "holder", "holds",
                 "matched", "now", "peers", "pool", "preempted", "reachable", "reserve_after_s", "rooms",
                 "rooms_of_peer", "sign")

    def __init__(
        self,
        peers: Sequence[FederationPeer],
        live: Mapping[tuple[str, str | None], int],
        now: float,
        *,
        used: Mapping[tuple[str, str | None], Mapping[str, float]] | None = None,
        policy: str = PACK,
        reserve_after_s: float | None = RESERVE_AFTER_S,
        reservations: dict[tuple[str, str], Hold] | None = None,
        matched: dict[tuple[Constraint, ...], list[tuple[str, str]]] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown placement policy {policy!r} (known: {', '.join(POLICIES)})")
        self.sign = sign = 1.0 if policy == PACK else -1.0
        self.peers = peers
        self.now = now
        self.reserve_after_s = reserve_after_s
        self.matched = matched if matched is not None else {}
        self.holds = holds = reservations if reservations is not None else {}
        self.holder = {hold.job_id: key for key, hold in holds.items()}  # job → the backend held for it
        self.reachable = reachable = [peer for peer in peers if peer.is_reachable(now)]
        slots = free_slots(reachable, live)
        self.rooms: dict[tuple[str, str], _Room] = {}
        self.rooms_of_peer: dict[str, list[_Room]] = {}
        for peer in reachable:
            for backend in peer.backends:
                if backend.discovering:
                    continue  # its shape is unknown: nothing is placed on it yet
                key = (peer.peer_id, backend.name)
                room = self.rooms[key] = _Room(peer.peer_id, backend, slots[key],
                                               None if used is None else used.get(key, {}), sign)
                self.rooms_of_peer.setdefault(peer.peer_id, []).append(room)
        # Jobs mostly share a few kinds: match each against the peers once, and keep its
        # candidates in a heap so each placement costs log(backends).
        self._kinds: dict[tuple, _Kind] = {}
        # The same, by the identity of (constraints, resources, preferences): claimed rows
        # share these objects (their decoders cache them), and ids hash cheaper than values.
        # Each entry keeps its objects alive, so their ids stay theirs.
        self._by_id: dict[tuple[int, int, int], tuple[_Kind, tuple]] = {}
        # Improving rooms that changed (see _Kind), oldest first, each with the number of
        # the newest such change; kinds replay those after the one they saw last.
        self._changed: dict[_Room, int] = {}
        self._seq = 0
        # Room only shrinks during a run, so a kind of job that had to wait once would wait
        # again for the same reasons: explain it once (again when holds change).
        self._explained: dict[tuple, Waiting] = {}
        self._no_hold: set[tuple] = set()  # kinds that found every backend they could hold taken
        self._gang_full: set[tuple] = set()  # kinds of gang that found no room this run (rooms only shrink)
        # Preemption: what lower-band jobs run where (None: not loaded; preempt nothing),
        # each preemption made (the placed job → its victims), and the kinds of job (with
        # their band) found to have nothing to preempt: the pool and rooms only shrink
        # in a run and holds only grow, so they stay so.
        self.pool: VictimPool | None = None
        self.preempted: dict[str, tuple[Candidate, ...]] = {}
        self._no_victims: dict[tuple, str] = {}
        # (backend, units, band, preferences) → (the room's version, victims, rank): a
        # backend's answer holds until its room changes (every placement, preemption or
        # release there bumps its version), so a queue of like jobs asks each backend
        # once, not once per job.
        self._victims_on: dict[tuple, tuple[int, tuple[Candidate, ...] | None, tuple | None]] = {}

    def has_room(self) -> bool:
        """Does any reachable backend still have a free slot?"""
        return any(room.slots > 0 for room in self.rooms.values())

    def release(self, placement: Placement, resources: Resources | Mapping[str, object] | None = None) -> None:
        """Give back the slot and ``resources`` (the job's request; None: the default) of
        ``placement``, made by this run, whose commit failed: later batches may use them."""
        room = self.rooms.get((placement.peer_id, placement.backend))
        if room is None:
            return
        room.give(as_resources(resources).units, placement.tasks, placement.nodes or None)
        victims = self.preempted.pop(placement.job_id, ())
        for victim in victims:
            room.take(victim.units, victim.tasks)  # the victims keep their room: the preemption did not happen
        if victims and self.pool is not None:
            self.pool.restore(victims)
        self._grown()

    def _grown(self) -> None:
        # Rooms only shrank until now; the heaps, explanations and the rooms dropped from
        # heaps relied on it. Holds and what no kind could hold depend on totals: kept.
        self._gang_full.clear()
        self._kinds.clear()
        self._by_id.clear()
        self._changed.clear()
        self._explained.clear()
        self._no_victims.clear()

    def place(self, jobs: Iterable[QueuedJob]) -> tuple[list[Placement], list[Waiting]]:
        """Place ``jobs`` in order after everything placed before; return placements and jobs left waiting."""
        rooms, rooms_of_peer, holds, holder, sign = self.rooms, self.rooms_of_peer, self.holds, self.holder, self.sign
        kinds, by_id, changed, explained = self._kinds, self._by_id, self._changed, self._explained
        reserve_after_s = self.reserve_after_s
        placements: list[Placement] = []
        waiting: list[Waiting] = []
        last = (None, None, None)
        kind: _Kind | None = None
        for job in jobs:
            resources = job.resources
            if resources.__class__ is not Resources:
                resources = as_resources(resources)
            units = resources.units
            if job.replicas > 1:
                self._place_gang(job, units, placements, waiting)
                kind = None
                last = (None, None, None)
                continue
            pinned = job.pinned_peer_id
            if pinned:
                choice = _place_pinned(job, units, rooms_of_peer.get(pinned), holds, sign)
            else:
                # Consecutive jobs are mostly of one kind: identity checks skip the lookup.
                constraints, preferences = job.constraints, job.preferences
                if last[0] is not constraints or last[1] is not resources or last[2] is not preferences:
                    last = (constraints, resources, preferences)
                    found = by_id.get((id(constraints), id(resources), id(preferences)))
                    if found is None:
                        kind = kinds.get(last)
                        if kind is None:
                            kind = kinds[last] = self._kind(constraints, units, preferences)
                        by_id[(id(constraints), id(resources), id(preferences))] = (kind, last)
                    else:
                        kind = found[0]
                if kind.seen != self._seq:
                    kind.replay(changed, self._seq)
                if job.avoid_peers:
                    choice = _place_avoiding(job, kind, holds)
                else:
                    choice = kind.best(holds, job.job_id)
            cannot_preempt = None
            if choice is None and job.band <= 0:
                cannot_preempt = LOWEST_BAND
            elif choice is None and self.pool is not None:
                preemption = self._preempt(job, units, kind)
                if isinstance(preemption, str):
                    cannot_preempt = preemption
                else:
                    room, victims = preemption
                    for victim in victims:
                        room.give(victim.units, victim.tasks)
                    nodes = room.take(units)
                    self.pool.remove(victims)
                    self.preempted[job.job_id] = victims
                    self._grown()
                    kind = None
                    last = (None, None, None)
                    placements.append(Placement(job.job_id, job.epoch, room.peer_id, room.name, 1, nodes))
                    continue
            if choice is None:
                holding = None
                if reserve_after_s is not None and job.waited_s >= reserve_after_s:
                    holding = holder.get(job.job_id) or _reserve(job, units, kind, rooms_of_peer, holds,
                                                                 self._no_hold)
                    if holding is not None:
                        holder[job.job_id] = holding
                if pinned or job.avoid_peers:
                    key = (job.constraints, resources, pinned, job.avoid_peers, len(holds))
                else:
                    key = (kind, len(holds))  # (kinds are per run, hashed by identity: cheap)
                why = explained.get(key)
                if why is None:
                    why = explained[key] = _explain(job, units, self.peers, rooms, self.now, holds)
                waiting.append(Waiting(job.job_id, waiting_rule(why.rule, holding, reserve_after_s, cannot_preempt),
                                       why.verdicts, holding))
                continue
            nodes = choice.take(units, 1, _nodes_leaving_hold(choice, units, holds, job.job_id))
            improves = choice.improves
            if improves:
                seq = self._seq = self._seq + 1
                changed.pop(choice, None)  # (re-added last: the dict stays in order of change)
                changed[choice] = seq
            if not pinned and not job.avoid_peers and kind.seen >= self._seq - improves:
                # The usual case: this kind chose its heap's top; re-rank it in place.
                if choice.slots > 0 and (choice.legacy or choice.fits(units)):
                    heapreplace(kind.heap, kind.entry(choice))
                else:
                    heappop(kind.heap)
                kind.seen = self._seq
            placements.append(Placement(job.job_id, job.epoch, choice.peer_id, choice.name, 1, nodes))
        return placements, waiting

    def _matching(self, constraints: tuple[Constraint, ...]) -> list[tuple[str, str]]:
        matching = self.matched.get(constraints)
        if matching is None:
            matching = self.matched[constraints] = [
                (peer.peer_id, backend.name)
                for peer in self.reachable
                for backend in peer.backends
                if matches_all(constraints, backend.attributes)
            ]
        return matching

    def _kind(self, constraints: tuple[Constraint, ...], units: tuple[tuple[str, int], ...],
              preferences: tuple[Constraint, ...]) -> _Kind:
        rooms = self.rooms
        return _Kind([rooms[m] for m in self._matching(constraints) if m in rooms], units, preferences, self.sign,
                     self._seq)

    def _preempt(self, job: QueuedJob, units: tuple[tuple[str, int], ...],
                 kind: _Kind | None) -> tuple[_Room, tuple[Candidate, ...]] | str:
        """Where ``job`` could preempt its way in, and whom (shared/preemption.py), or
        why it cannot."""
        key = (job.constraints, units, job.pinned_peer_id, job.avoid_peers, job.band)
        known = self._no_victims.get(key)
        if known is not None:
            return known
        if job.pinned_peer_id:
            rooms = [room for room in self.rooms_of_peer.get(job.pinned_peer_id, ()) if room.can_ever_hold(units)]
        else:
            rooms = kind.holdable if kind is not None else [
                room for m in self._matching(job.constraints) if (room := self.rooms.get(m)) is not None
                and room.can_ever_hold(units)]
        preferred = [room for room in rooms if room.peer_id not in job.avoid_peers]
        groups = (preferred, rooms) if job.avoid_peers and len(preferred) < len(rooms) else (rooms,)
        why = NO_LOWER_BAND
        holds = self.holds
        memo = self._victims_on
        band, preferences = job.band, job.preferences
        for group in groups:
            best = None
            for room in group:
                known = memo.get((room.key, units, band, preferences))
                if known is not None and known[0] == room.version:
                    victims, rank = known[1], known[2]
                    if victims is None and rank is None:
                        continue  # nothing of a lower band there
                else:
                    found = self.pool.on(room.key, band)
                    if not found:
                        victims = rank = None
                    else:
                        victims = choose_victims(units, room.free, room.slots, room.legacy, found)
                        rank = (victims_rank(victims), _rank(room, units, preferences, self.sign)) if victims else ()
                    memo[(room.key, units, band, preferences)] = (room.version, victims, rank)
                    if victims is None and rank is None:
                        continue
                hold = holds.get(room.key) if holds else None
                if hold is not None and hold.job_id != job.job_id:
                    why = ONLY_HELD if why == NO_LOWER_BAND else why
                    continue
                if not victims:  # None: not enough there; (): it fits (it would have been placed)
                    why = STILL_NO_ROOM
                    continue
                if best is None or rank < best[0]:
                    best = (rank, room, victims)
            if best is not None:
                return best[1], best[2]
        self._no_victims[key] = why
        return why


def _nodes_leaving_hold(room: _Room, units: tuple[tuple[str, int], ...], holds: Mapping[tuple[str, str], Hold],
                        job_id: str) -> list | None:
    """On a backend held for a gang (not this job's), the node a single task may take:
    one the gang cannot use (``Hold``); None: no such constraint (the best node)."""
    if not holds or room.nodes is None:
        return None
    hold = holds.get(room.key)
    if hold is None or hold.gang is None or hold.job_id == job_id:
        return None
    return room.nodes.choose(Gang(1, units), avoid=hold.gang.units)


def _usable(room: _Room, units: tuple[tuple[str, int], ...], holds: Mapping[tuple[str, str], Hold],
            job_id: str) -> bool:
    if not room.fits(units):
        return False
    hold = holds.get(room.key) if holds else None
    return hold is None or not room.blocked(units, hold, job_id)


def _place_pinned(job: QueuedJob, units: tuple[tuple[str, int], ...], rooms: list[_Room] | None,
                  holds: Mapping[tuple[str, str], Hold], sign: float) -> _Room | None:
    if not rooms:  # unknown, unreachable, or advertising no backends
        return None
    usable = [room for room in rooms if _usable(room, units, holds, job.job_id)]
    if not usable:
        return None

    def rank(room: _Room) -> tuple:
        return (not matches_all(job.constraints, room.backend.attributes),
                *_rank(room, units, job.preferences, sign))

    return min(usable, key=rank)


def _place_avoiding(job: QueuedJob, kind: _Kind, holds: Mapping[tuple[str, str], Hold]) -> _Room | None:
    # Peers that lost this job before are a last resort: used only when no other
    # reachable peer could hold it at all, so a job whose only capable peer blinked is
    # not stranded forever.
    preferred = [room for room in kind.holdable if room.peer_id not in job.avoid_peers]
    best: tuple | None = None
    choice = None
    for room in preferred or kind.holdable:
        if not _usable(room, kind.units, holds, job.job_id):
            continue
        rank = kind.rank(room)
        if best is None or rank < best:
            best, choice = rank, room
    return choice

