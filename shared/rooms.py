"""What placement measures: the jobs, the placements, and each backend's room during a run. Pure.

Owns ``QueuedJob`` (a job as the tick claimed it) and ``Placement`` (where one went);
``free_slots`` and ``add_usage``, the caller's bookkeeping of what live jobs take;
``_Room``, one reachable backend during a run — its free slots, resources and nodes
(shared.nodes), kept up to date as placements take and give back room, and whether a
job would eat into what a ``Hold`` keeps free (the hold's terms live here, with the room
they constrain; choosing what to hold is shared/holds.py); ``_Kind``, the backends one
kind of job could use, best first in a heap; and ``_rank``, a room's rank for a job.
The rules that use them: shared/placement.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace
from typing import NamedTuple

from irisfed.shared.bands import DEFAULT_BAND_RANK
from irisfed.shared.constraints import Constraint
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.nodes import Gang, NodePool, fits_on
from irisfed.shared.resources import DEFAULT_RESOURCES, Resources, offer_units, to_units


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
        return self.legacy or fits_on(self.free, units)

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
        if self.nodes is None or self.slots < gang.replicas or not (self.legacy or fits_on(self.free, total)):
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


def _rank(room: _Room, units: tuple[tuple[str, int], ...], preferences: tuple[Constraint, ...],
          sign: float) -> tuple:
    """The rank of ``room`` for a job (smaller is better): what _Kind.entry computes, uncached."""
    prefs = -sum(1 for p in preferences if p.holds_for(room.backend.attributes))
    fit = sign * (room.left - room.ask(units)) if not room.legacy else 0.0
    return (prefs, room.legacy, fit, -room.slots, room.peer_id, room.name)
