"""Placement: which reachable peer and backend takes each queued job. Pure, no I/O.

The whole rule — feasibility, ranking, holds and its fast paths — is one pure unit
because the tick's hot loop calls it once per job: one module reads top to bottom
and keeps the fast paths next to the rules they shortcut.

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
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace
from typing import NamedTuple

from irisfed.shared.bands import DEFAULT_BAND_RANK
from irisfed.shared.constraints import Constraint, matches_all
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.federation.router import PeerVerdict, judge_peer, too_few_nodes
from irisfed.shared.nodes import Gang, NodePool, describe_task, gang_verdict
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
from irisfed.shared.resources import (
    DEFAULT_RESOURCES,
    Resources,
    Shortfall,
    as_resources,
    describe_shortfalls,
    offer_units,
    shortfalls,
    to_units,
)

PACK = "pack"
SPREAD = "spread"
POLICIES = (PACK, SPREAD)
# Long enough that ordinary churn (jobs waiting a tick or two for a slot) never holds
# a backend back; short enough that a big job starts within minutes of a backend
# draining instead of never.
RESERVE_AFTER_S = 300.0


# QueuedJob and Placement are made 100k at a time in one tick run: named tuples are
# as immutable as frozen dataclasses and several times cheaper to build.
class QueuedJob(NamedTuple):
    """A queued job as the tick claimed it.

    ``resources``: a Resources (or a mapping, validated here); default one cpu.
    ``preferences``: soft constraints ranking peers. ``waited_s``: how long it has
    waited since submit (anti-starvation).
    """

    job_id: str
    epoch: int
    constraints: tuple[Constraint, ...] = ()
    pinned_peer_id: str | None = None
    avoid_peers: frozenset[str] = frozenset()
    resources: Resources = DEFAULT_RESOURCES
    preferences: tuple[Constraint, ...] = ()
    waited_s: float = 0.0
    band: int = DEFAULT_BAND_RANK  # shared.bands: what it may preempt
    replicas: int = 1  # tasks (a gang: more), each asking ``resources`` (shared.nodes)
    group_by: str = ""  # the node attribute a gang's nodes share ("": none)


class Placement(NamedTuple):
    job_id: str
    epoch: int  # the epoch the job was claimed under (the CAS expects it)
    peer_id: str
    backend: str
    tasks: int = 1  # the job's tasks (slots taken)
    nodes: tuple = ()  # the node classes taken on a backend advertising nodes (to give back)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A job left queued, with the rule that held it back and each peer's verdict.

    ``holding`` is the (peer, backend) held for this job (anti-starvation), if any.
    """

    job_id: str
    rule: str
    verdicts: tuple[PeerVerdict, ...] = ()
    holding: tuple[str, str] | None = None
    code: str | None = None  # why it waits when no peer is to blame (``quota``: shared.users)

    @property
    def reason(self) -> str:
        details = "; ".join(v.describe() for v in self.verdicts)
        return f"{self.rule}: {details}" if details else self.rule


@dataclass(slots=True)
class Hold:
    """A backend held for a job that waited too long: what later jobs must leave free."""

    job_id: str
    units: dict[str, int] = field(default_factory=dict)  # the held job's request, in units (all tasks)
    slots: int = 1
    gang: Gang | None = None  # a held gang on a backend with nodes: the nodes later jobs must leave it


def free_slots(
    peers: Iterable[FederationPeer], live: Mapping[tuple[str, str | None], int]
) -> dict[tuple[str, str], int]:
    """Free slots per (peer, backend): advertised total minus live jobs there. Negative
    when a backend holds more than it advertises (LOCAL jobs are assigned by its totals
    and queue at the agent; an agent may restart with fewer slots): that debt is room a
    placement or a preemption must make up before a job fits."""
    return {
        (peer.peer_id, backend.name): backend.total - live.get((peer.peer_id, backend.name), 0)
        for peer in peers
        for backend in peer.backends
    }


def add_usage(
    used: dict[tuple[str, str], dict[str, float]], key: tuple[str, str], resources: Resources, sign: int = 1
) -> None:
    """Add (``sign=-1``: take back) one job's resources to ``used`` at ``key`` = (peer, backend).

    For a caller keeping ``used`` across a run's batches, as it keeps ``live``.
    """
    into = used.setdefault(key, {})
    for name, amount in resources.as_dict().items():
        into[name] = into.get(name, 0) + sign * amount


class _Room:
    """One reachable backend during a run: what it has free, kept up to date."""

    __slots__ = ("backend", "free", "improves", "inv", "key", "left", "legacy", "name", "nodes", "peer_id",
                 "slot_total", "slots", "total", "version")

    def __init__(self, peer_id: str, backend: Backend, slots: int,
                 used: Mapping[str, float] | None, sign: float = 1.0) -> None:
        self.peer_id = peer_id
        self.name = backend.name
        self.key = (peer_id, backend.name)
        self.backend = backend
        self.slots = slots
        self.slot_total = backend.total
        self.version = 0
        offered = offer_units(backend.resources) if backend.resources else {}
        self.legacy = not offered
        self.total = {name: total for name, (total, _free) in offered.items()}
        if used is None:
            self.free = {name: free for name, (_total, free) in offered.items()}
        else:
            # Not clamped at 0: a backend over its totals (see free_slots) owes that room first.
            self.free = {name: total - to_units(name, used.get(name, 0)) for name, total in self.total.items()}
        # 1/total per resource with any: the fit's normalisation.
        self.inv = tuple((name, 1.0 / total) for name, total in self.total.items() if total > 0)
        self.left = 0.0
        self._update_left()
        # Does a placement here improve its rank (pack on a room with resources)?
        self.improves = not self.legacy and sign > 0
        # Its hosts (shared.nodes): every task must fit on one; None: single tasks only.
        self.nodes = NodePool(backend.nodes) if backend.nodes else None

    def __lt__(self, other: _Room) -> bool:
        # Heap entries differ before reaching the room; this only keeps a tie from raising.
        return self.key < other.key

    def _update_left(self) -> None:
        free = self.free
        left = 0.0
        for name, inv in self.inv:
            left += free[name] * inv
        self.left = left

    def ask(self, units: tuple[tuple[str, int], ...]) -> float:
        """The job's request as a sum of fractions of this backend's totals."""
        inv = dict(self.inv)
        return sum(amount * inv.get(name, 0.0) for name, amount in units)

    def can_ever_hold(self, units: tuple[tuple[str, int], ...]) -> bool:
        total = self.total
        if not (self.legacy or all(total.get(name, 0) >= amount for name, amount in units)):
            return False
        return self.nodes is None or self.nodes.can_ever_hold(Gang(1, units))

    def fits(self, units: tuple[tuple[str, int], ...]) -> bool:
        """Room for a single task now: a slot and, where resources are advertised, the
        request free. Its nodes are judged by their totals only (``can_ever_hold``): a
        node's free amount counts the engine's other work, and a single task placed on a
        busy cluster waits in the engine's own queue, as it always has (docs/scheduling.md)."""
        if self.slots <= 0:
            return False
        if not self.legacy:
            free = self.free
            for name, amount in units:
                if free.get(name, 0) < amount:
                    return False
        return True

    # A gang: ``gang.replicas`` tasks of ``gang.units``; ``total`` is all of them.

    def can_ever_hold_gang(self, gang: Gang, total: tuple[tuple[str, int], ...]) -> bool:
        if self.nodes is None or self.slot_total < gang.replicas:
            return False
        totals = self.total
        if not (self.legacy or all(totals.get(name, 0) >= amount for name, amount in total)):
            return False
        return self.nodes.can_ever_hold(gang)

    def gang_choice(self, gang: Gang, total: tuple[tuple[str, int], ...]) -> list | None:
        """The nodes ``gang``'s tasks would take here now (None: no room now)."""
        if self.nodes is None or self.slots < gang.replicas:
            return None
        if not self.legacy:
            free = self.free
            for name, amount in total:
                if free.get(name, 0) < amount:
                    return None
        return self.nodes.choose(gang)

    def blocked(self, units: tuple[tuple[str, int], ...], hold: Hold, job_id: str, tasks: int = 1) -> bool:
        """Would placing job ``job_id`` (``tasks`` tasks of ``units``) here eat into what
        ``hold`` keeps free? A held gang keeps, besides, every node that could take one of
        its tasks: later work lands only on nodes it cannot use."""
        if hold.job_id == job_id:
            return False  # a job's own hold never stands in its way
        if self.slots - tasks < hold.slots:
            return True
        held, free = hold.units, self.free
        for name, amount in units:
            need = held.get(name)
            if need and free.get(name, 0) - amount * tasks < need:
                return True
        if hold.gang is not None and self.nodes is not None:
            if tasks > 1:
                return True  # one gang's hold is not shared with another gang
            choice = self.nodes.choose(Gang(1, units), avoid=hold.gang.units)
            return choice is None
        return False

    def take(self, units: tuple[tuple[str, int], ...], tasks: int = 1, nodes: Sequence | None = None) -> tuple:
        """Take the room of ``tasks`` tasks of ``units``: on the chosen ``nodes`` (None:
        the best ones for a single task). The node classes taken (to give back)."""
        self.slots -= tasks
        if not self.legacy:
            free = self.free
            for name, amount in units:
                # A job placed here fits, so it asks only what the room has; a victim taken
                # back (``release``) may hold a resource the backend no longer advertises,
                # which ``give`` skipped too.
                if name in free:
                    free[name] -= amount * tasks
            self._update_left()
        taken: tuple = ()
        if self.nodes is not None:
            if nodes is None:
                nodes = self.nodes.choose(Gang(tasks, units)) or self.nodes.choose_by_totals(units)
            if nodes:
                self.nodes.take(nodes, units)
                taken = tuple(nodes)
        self.version += 1
        return taken

    def give(self, units: tuple[tuple[str, int], ...], tasks: int = 1, nodes: Sequence | None = None) -> None:
        """Undo a ``take`` (a placement given back, a victim preempted): on the ``nodes``
        it took, or, not known (a running job's), the nodes likeliest to hold it."""
        self.slots += tasks
        if not self.legacy:
            free = self.free
            for name, amount in units:
                if name in free:
                    free[name] += amount * tasks
            self._update_left()
        if self.nodes is not None:
            if nodes:
                self.nodes.give(nodes, units)
            else:
                self.nodes.release_somewhere(units, tasks)
        self.version += 1

    def shortfall(self, units: tuple[tuple[str, int], ...], tasks: int = 1) -> float:
        """How far from fitting, as fractions of the totals (0: it fits now); ``units`` all
        of the job's, ``tasks`` its slots."""
        short = max(0, tasks - self.slots) / max(1, self.slot_total)
        if not self.legacy:
            free, total = self.free, self.total
            for name, amount in units:
                lack = amount - free.get(name, 0)
                if lack > 0:
                    short += lack / total[name]
        return short


class _Kind:
    """The backends one kind of job (constraints, resources, preferences) could use.

    The heap holds them best first; entries carry the room's version. A placement
    only ever makes a room's rank *worse* (fewer free slots; under spread, less left),
    except under pack on a room that advertises resources, where it gets better
    (less left). Worse ranks are fixed lazily: a stale entry reaching the top is
    re-pushed with its current rank. Better ranks cannot wait (the room would sink
    below where it belongs), so such rooms are logged in the run's ``changed`` and
    each kind pushes their fresh entries when it next looks (the changes after
    ``seen``), dropping the stale ones as they surface. Rooms without room for this
    kind any more are dropped for the rest of the run: free amounts only shrink during
    a run, holds only grow. (A release breaks that: the run then rebuilds its kinds.)
    """

    __slots__ = ("ask", "heap", "holdable", "members", "prefs", "seen", "sign", "units")

    def __init__(self, rooms: list[_Room], units: tuple[tuple[str, int], ...],
                 preferences: tuple[Constraint, ...], sign: float, seen: int) -> None:
        self.units = units
        self.sign = sign
        self.seen = seen
        # Rooms it could ever fit on (by totals); the others never enter the heap.
        self.holdable = [room for room in rooms if room.can_ever_hold(units)]
        self.members = set(self.holdable)
        self.prefs = {room: -sum(1 for p in preferences if p.holds_for(room.backend.attributes))
                      for room in self.holdable} if preferences else None
        self.ask = {room: room.ask(units) for room in self.holdable if not room.legacy}
        self.heap = [self.entry(room) for room in self.holdable if room.fits(units)]
        heapify(self.heap)

    def entry(self, room: _Room) -> tuple:
        fit = self.sign * (room.left - self.ask[room]) if not room.legacy else 0.0
        prefs = self.prefs[room] if self.prefs is not None else 0
        return (prefs, room.legacy, fit, -room.slots, room.peer_id, room.name, room.version, room)

    def rank(self, room: _Room) -> tuple:
        return self.entry(room)[:6]

    def replay(self, changed: Mapping[_Room, int], seq: int) -> None:
        """Push fresh entries for the improving rooms changed since change ``seen``."""
        members, units, heap, seen = self.members, self.units, self.heap, self.seen
        for room, at in reversed(changed.items()):  # newest first: stop at the first already seen
            if at <= seen:
                break
            if room in members:
                # Often the room this kind would take next: then its stale entry is the
                # top, and replacing it spares a push now and a pop later.
                stale_top = heap and heap[0][7] is room
                if room.fits(units):
                    (heapreplace if stale_top else heappush)(heap, self.entry(room))
                elif stale_top:
                    heappop(heap)
        self.seen = seq

    def best(self, holds: Mapping[tuple[str, str], Hold], job_id: str) -> _Room | None:
        heap, units = self.heap, self.units
        while heap:
            top = heap[0]
            room = top[7]
            if top[6] != room.version:
                # Changed since pushed. An entry is pushed only while its room fits, and
                # fitting changes only with the version: current entries need no check.
                if room.improves or room.slots <= 0 or not (room.legacy or room.fits(units)):
                    heappop(heap)  # (an improving room's fresh entry was replayed)
                else:
                    heapreplace(heap, self.entry(room))
                continue
            if holds:
                hold = holds.get(room.key)
                if hold is not None and room.blocked(units, hold, job_id):
                    heappop(heap)
                    continue
            return room
        return None


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


def waiting_rule(rule: str, holding: tuple[str, str] | None, reserve_after_s: float,
                 cannot_preempt: str | None) -> str:
    """Why a job waits: the rule that left it, the room held for it, why it cannot preempt."""
    if holding is not None:
        rule = f"{rule}; backend {holding[1]} of {holding[0]} is held for it (waiting {reserve_after_s:g}s or more)"
    if cannot_preempt is not None:
        rule = f"{rule}; cannot preempt: {cannot_preempt}"
    return rule


class PlacementRun:
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

    # ------------------------------------------------------------ gangs

    def _gang_rooms(self, job: QueuedJob, gang: Gang, total: tuple[tuple[str, int], ...]) -> list[_Room]:
        """The backends ``job``'s gang could ever run on: its pin's, or those matching its
        constraints; by totals, slots and nodes."""
        if job.pinned_peer_id:
            rooms = self.rooms_of_peer.get(job.pinned_peer_id, ())
        else:
            rooms = [room for m in self._matching(job.constraints) if (room := self.rooms.get(m)) is not None]
        return [room for room in rooms if room.can_ever_hold_gang(gang, total)]

    def _place_gang(self, job: QueuedJob, units: tuple[tuple[str, int], ...], placements: list[Placement],
                    waiting: list[Waiting]) -> None:
        """Place all of ``job``'s tasks on one backend — distinct nodes with room for one
        task each (sharing a ``group_by`` value) — or none (docs/scheduling.md, "Gangs")."""
        gang = Gang(job.replicas, units, job.group_by)
        total = tuple((name, amount * job.replicas) for name, amount in units)
        key = (job.constraints, units, job.replicas, job.group_by, job.pinned_peer_id, job.avoid_peers)
        rooms = self._gang_rooms(job, gang, total)
        preferred = [room for room in rooms if room.peer_id not in job.avoid_peers]
        groups = (preferred, rooms) if job.avoid_peers and len(preferred) < len(rooms) else (rooms,)
        holds = self.holds
        best = None
        if key not in self._gang_full:
            for group in groups:
                for room in group:
                    hold = holds.get(room.key) if holds else None
                    if hold is not None and room.blocked(total, hold, job.job_id, job.replicas):
                        continue
                    nodes = room.gang_choice(gang, total)
                    if nodes is None:
                        continue
                    rank = _rank(room, total, job.preferences, self.sign)
                    if best is None or rank < best[0]:
                        best = (rank, room, nodes)
                if best is not None:
                    break
            if best is None and not holds:
                self._gang_full.add(key)  # rooms only shrink in a run: the next like gang waits too
        if best is not None:
            _, room, nodes = best
            self._placed_on(room, room.take(units, job.replicas, nodes))
            placements.append(Placement(job.job_id, job.epoch, room.peer_id, room.name, job.replicas, tuple(nodes)))
            return
        cannot_preempt = None
        if job.band <= 0:
            cannot_preempt = LOWEST_BAND
        elif self.pool is not None:
            preemption = self._preempt_gang(job, gang, total, groups)
            if isinstance(preemption, str):
                cannot_preempt = preemption
            else:
                room, victims, nodes = preemption
                for victim in victims:
                    room.give(victim.units, victim.tasks)
                taken = room.take(units, job.replicas, nodes)
                self.pool.remove(victims)
                self.preempted[job.job_id] = victims
                self._grown()
                placements.append(Placement(job.job_id, job.epoch, room.peer_id, room.name, job.replicas, taken))
                return
        holding = None
        if self.reserve_after_s is not None and job.waited_s >= self.reserve_after_s:
            holding = self.holder.get(job.job_id) or _reserve_gang(job, gang, total, rooms, holds)
            if holding is not None:
                self.holder[job.job_id] = holding
        explained_key = ("gang", key, len(holds))
        why = self._explained.get(explained_key)
        if why is None:
            why = self._explained[explained_key] = _explain(job, units, self.peers, self.rooms, self.now, holds)
        waiting.append(Waiting(job.job_id, waiting_rule(why.rule, holding, self.reserve_after_s, cannot_preempt),
                               why.verdicts, holding))

    def _placed_on(self, room: _Room, _nodes: tuple) -> None:
        """A gang took room here: single-task kinds re-rank an improving room (pack)."""
        if room.improves:
            seq = self._seq = self._seq + 1
            self._changed.pop(room, None)
            self._changed[room] = seq

    def _preempt_gang(self, job: QueuedJob, gang: Gang, total: tuple[tuple[str, int], ...],
                      groups: tuple[list[_Room], ...]) -> tuple[_Room, tuple[Candidate, ...], list] | str:
        """Where ``job``'s whole gang could preempt its way in — the fewest victims after
        which every task has a node — and whom; or why it cannot."""
        why = NO_LOWER_BAND
        holds = self.holds
        for group in groups:
            best = None
            for room in group:
                found = self.pool.on(room.key, job.band)
                if not found:
                    continue
                hold = holds.get(room.key) if holds else None
                if hold is not None and hold.job_id != job.job_id:
                    why = ONLY_HELD if why == NO_LOWER_BAND else why
                    continue
                chosen = _gang_victims(room, gang, total, found)
                if chosen is None:
                    why = STILL_NO_ROOM
                    continue
                victims, nodes = chosen
                rank = (victims_rank(victims), _rank(room, total, job.preferences, self.sign))
                if best is None or rank < best[0]:
                    best = (rank, room, victims, nodes)
            if best is not None:
                return best[1], best[2], best[3]
        return why

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


def _rank(room: _Room, units: tuple[tuple[str, int], ...], preferences: tuple[Constraint, ...],
          sign: float) -> tuple:
    """The rank of ``room`` for a job (smaller is better): what _Kind.entry computes, uncached."""
    prefs = -sum(1 for p in preferences if p.holds_for(room.backend.attributes))
    fit = sign * (room.left - room.ask(units)) if not room.legacy else 0.0
    return (prefs, room.legacy, fit, -room.slots, room.peer_id, room.name)


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


def _reserve(job: QueuedJob, units: tuple[tuple[str, int], ...], kind: _Kind | None,
             rooms_of_peer: Mapping[str, list[_Room]], holds: dict[tuple[str, str], Hold],
             no_hold: set[tuple]) -> tuple[str, str] | None:
    """Hold the backend where ``job`` would fit soonest; None when none is left to hold."""
    key = (job.constraints, job.resources, job.pinned_peer_id, job.avoid_peers)
    if key in no_hold:
        return None
    if job.pinned_peer_id:
        candidates = [room for room in rooms_of_peer.get(job.pinned_peer_id, ()) if room.can_ever_hold(units)]
    else:
        candidates = [room for room in kind.holdable if room.peer_id not in job.avoid_peers] or kind.holdable
    best = None
    for room in candidates:
        if room.slot_total <= 0 or room.key in holds:
            continue  # one hold per backend: the job that has waited longest keeps it
        rank = (room.shortfall(units), room.peer_id, room.name)
        if best is None or rank < best[0]:
            best = (rank, room)
    if best is None:
        no_hold.add(key)  # holds only grow during a run: it stays so
        return None
    room = best[1]
    holds[room.key] = Hold(job.job_id, {} if room.legacy else dict(units))
    return room.key


def _explain(job: QueuedJob, units: tuple[tuple[str, int], ...], peers: Sequence[FederationPeer],
             rooms: Mapping[tuple[str, str], _Room], now: float, holds: Mapping[tuple[str, str], Hold]) -> Waiting:
    """Why ``job`` could not be placed: the rule, and a verdict for every peer."""
    pin = job.pinned_peer_id
    verdicts = []
    for peer in peers:
        if pin and peer.peer_id != pin:
            verdicts.append(PeerVerdict(peer.peer_id, "not_pinned_peer", f"not the pinned peer {pin}"))
            continue
        if peer.peer_id in job.avoid_peers:
            verdicts.append(PeerVerdict(peer.peer_id, "avoided", "lost this job before; avoided"))
            continue
        verdict = judge_peer(peer, () if pin else job.constraints, now)
        if verdict.code == "match":
            verdict = (_gang_room_verdict if job.replicas > 1 else _room_verdict)(peer, job, units, rooms, holds)
        verdicts.append(verdict)
    codes = {v.code for v in verdicts}
    short_dims = sorted({s.resource for v in verdicts if v.code == "no_free_capacity" for s in v.shortfalls})
    room_for = f"free {', '.join(short_dims)}" if short_dims else "a free slot"
    if job.replicas > 1:
        room_for = f"{job.replicas} free nodes"
    if pin:
        if pin not in {p.peer_id for p in peers}:
            rule = f"pinned to {pin}, which is not in the configuration"
        elif codes - {"not_pinned_peer"} <= {"insufficient_resources", "insufficient_nodes"} and codes - {
                "not_pinned_peer"}:
            rule = f"pinned to {pin}, whose backends can never hold it as advertised; waiting for more"
        elif "discovering" in codes:
            rule = f"pinned to {pin}, whose engine has not said what it has yet; waiting"
        else:
            rule = f"pinned to {pin}; waiting for it to be reachable with {room_for}"
    elif "no_free_capacity" in codes:
        rule = f"matching peers are full; waiting for {room_for}"
    elif "held" in codes:
        rule = "matching peers are held for jobs that have waited longer; waiting"
    elif "discovering" in codes:
        rule = "a reachable peer that might hold it has not heard from its engine yet; waiting"
    elif "insufficient_resources" in codes or "insufficient_nodes" in codes:
        rule = "no reachable matching backend can ever hold it as advertised; waiting for one"
    else:
        rule = "no reachable peer matches; waiting for one"
    return Waiting(job.job_id, rule, tuple(verdicts))


def _room_verdict(peer: FederationPeer, job: QueuedJob, units: tuple[tuple[str, int], ...],
                  rooms: Mapping[tuple[str, str], _Room], holds: Mapping[tuple[str, str], Hold]) -> PeerVerdict:
    """A reachable peer whose attributes match: is it too small, full, or held?"""
    small: list[list[Shortfall]] = []
    few_nodes: list[str] = []
    full: list[tuple[str, list[Shortfall]]] = []
    held: list[tuple[str, str]] = []
    for backend in peer.backends:
        if not job.pinned_peer_id and not matches_all(job.constraints, backend.attributes):
            continue
        room = rooms.get((peer.peer_id, backend.name))
        if room is None:
            continue
        if not room.can_ever_hold(units):
            short = shortfalls(units, room.total, backend.name) if not room.legacy else []
            if short:
                small.append(short)
            else:  # enough in all, on no one node
                few_nodes.append(gang_verdict(Gang(1, units), room.nodes, backend.name))
        elif not room.fits(units):
            full.append((backend.name, [] if room.legacy else shortfalls(units, room.free, backend.name)))
        elif (hold := holds.get(room.key)) is not None and room.blocked(units, hold, job.job_id):
            held.append((backend.name, hold.job_id))
        else:
            return PeerVerdict(peer.peer_id, "match", f"backend {backend.name} has room")
    if full:
        if all(not short for _, short in full):
            return PeerVerdict(peer.peer_id, "no_free_capacity", "matches but has no free slot")
        parts = [f"{describe_shortfalls(short, 'free')} (backend {name})" if short else f"no free slot (backend {name})"
                 for name, short in full]
        return PeerVerdict(peer.peer_id, "no_free_capacity", "matches but is short now: " + "; ".join(parts),
                           tuple(s for _, short in full for s in short))
    if held:
        detail = "; ".join(f"backend {name} held for {job_id}, waiting longer" for name, job_id in held)
        return PeerVerdict(peer.peer_id, "held", detail)
    if small:
        detail = "; ".join(f"{describe_shortfalls(short, 'at most')} (backend {short[0].backend})"
                           for short in small)
        return PeerVerdict(peer.peer_id, "insufficient_resources", detail, tuple(s for short in small for s in short))
    if few_nodes:
        return PeerVerdict(peer.peer_id, "insufficient_nodes", "; ".join(few_nodes))
    return PeerVerdict(peer.peer_id, "no_free_capacity", "matches but has no free slot")


def _gang_room_verdict(peer: FederationPeer, job: QueuedJob, units: tuple[tuple[str, int], ...],
                       rooms: Mapping[tuple[str, str], _Room], holds: Mapping[tuple[str, str], Hold]) -> PeerVerdict:
    """A reachable peer whose attributes match a gang: can it never hold it, is it short
    of free nodes (or slots, or resources) now, or held?"""
    gang = Gang(job.replicas, units, job.group_by)
    total = tuple((name, amount * job.replicas) for name, amount in units)
    never: list[str] = []
    short_now: list[str] = []
    held: list[tuple[str, str]] = []
    for backend in peer.backends:
        if not job.pinned_peer_id and not matches_all(job.constraints, backend.attributes):
            continue
        room = rooms.get((peer.peer_id, backend.name))
        if room is None:
            continue
        if not room.can_ever_hold_gang(gang, total):
            never.append(too_few_nodes(backend, gang) or describe_shortfalls(
                shortfalls(total, room.total, backend.name), "at most") + f" (backend {backend.name})")
        elif room.gang_choice(gang, total) is None:
            free_nodes = room.nodes.most_nodes(gang, by_totals=False)
            shared = f" sharing one {gang.group_by}" if gang.group_by else ""
            short_now.append(f"needs {gang.replicas} free nodes with {describe_task(units)}{shared}, "
                             f"{free_nodes} free now, {max(0, room.slots)} free slots (backend {backend.name})")
        elif (hold := holds.get(room.key)) is not None and room.blocked(total, hold, job.job_id, job.replicas):
            held.append((backend.name, hold.job_id))
        else:
            return PeerVerdict(peer.peer_id, "match", f"backend {backend.name} has room")
    if short_now:
        return PeerVerdict(peer.peer_id, "no_free_capacity", "matches but is short now: " + "; ".join(short_now))
    if held:
        detail = "; ".join(f"backend {name} held for {job_id}, waiting longer" for name, job_id in held)
        return PeerVerdict(peer.peer_id, "held", detail)
    return PeerVerdict(peer.peer_id, "insufficient_nodes", "; ".join(never) or "advertises no backend for it")


def _gang_victims(room: _Room, gang: Gang, total: tuple[tuple[str, int], ...],
                  found: Sequence[Candidate]) -> tuple[tuple[Candidate, ...], list] | None:
    """The fewest of ``found`` (in victim order) after whose going ``gang`` fits on
    ``room`` — in slots and every resource (``choose_victims``), then a node for every
    task, the victims' nodes estimated (``NodePool.release_somewhere``) — and the nodes
    its tasks would take; None: even all of them would not do."""
    victims = choose_victims(total, room.free, room.slots, room.legacy, found, tasks=gang.replicas)
    if victims is None:
        return None
    chosen = list(victims)
    rest = [c for c in found if c not in victims]
    while True:
        pool = room.nodes.copy()
        for victim in chosen:
            pool.release_somewhere(victim.units, victim.tasks)
        nodes = pool.choose(gang)
        if nodes is not None:
            return tuple(chosen), nodes
        if not rest:
            return None
        chosen.append(rest.pop(0))


def _reserve_gang(job: QueuedJob, gang: Gang, total: tuple[tuple[str, int], ...], rooms: Sequence[_Room],
                  holds: dict[tuple[str, str], Hold]) -> tuple[str, str] | None:
    """Hold the backend where ``job``'s gang would fit soonest (``_reserve`` for a gang):
    later jobs must leave it its slots, resources and the nodes that could take a task."""
    preferred = [room for room in rooms if room.peer_id not in job.avoid_peers] or list(rooms)
    best = None
    for room in preferred:
        if room.key in holds:
            continue
        free_nodes = room.nodes.most_nodes(gang, by_totals=False)
        rank = (room.shortfall(total, gang.replicas) + max(0, gang.replicas - free_nodes) / gang.replicas,
                room.peer_id, room.name)
        if best is None or rank < best[0]:
            best = (rank, room)
    if best is None:
        return None
    room = best[1]
    holds[room.key] = Hold(job.job_id, {} if room.legacy else dict(total), gang.replicas, gang)
    return room.key


def explain_waiting(
    job: QueuedJob, peers: Sequence[FederationPeer], slots: Mapping[tuple[str, str], int], now: float,
    used: Mapping[tuple[str, str | None], Mapping[str, float]] | None = None,
) -> Waiting:
    """Why ``job`` could not be placed: the rule, and a verdict for every peer.

    ``slots``: free slots per (peer, backend); ``used`` as for :func:`assign_queued`.
    """
    rooms = {}
    for peer in peers:
        if peer.is_reachable(now):
            for backend in peer.backends:
                if backend.discovering:
                    continue
                key = (peer.peer_id, backend.name)
                rooms[key] = _Room(peer.peer_id, backend, slots.get(key, 0),
                                   None if used is None else used.get(key, {}))
    return _explain(job, as_resources(job.resources).units, peers, rooms, now, {})

