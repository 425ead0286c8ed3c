"""Preemption: which running jobs a waiting job of a higher band stops, and where. Pure, no I/O.

The rule (docs/design.md §3.3; docs/scheduling.md, "Preemption"): a queued job J that
fits on no backend now, and that its user's quota lets run, may stop live jobs of
bands strictly lower than its own — never ``production`` — on one backend that can
host J, so that J then fits there in every resource and in a slot. Per backend the
victims are chosen in the order lowest band first, then the most recently started;

- a single victim whenever one is enough (the first in that order that is), else
- the shortest prefix of that order that makes room, then pruned: any victim whose
  room J does not need after all is spared (the most protected first). No victim of
  the set could be spared, so J never preempts more than it needs.

Of the backends where victims exist, the one with the fewest victims wins, then the
lowest bands, then the least work lost (victims started most recently, in sum), then
placement's own ranking
(peer id, backend). Backends J's constraints, pin or ``avoid_peers`` rule out are
never used, nor one held (anti-starvation) for another job: that room is promised.

``VictimPool`` holds the candidates of one tick pass; a victim chosen once is gone
from it, so no job is preempted twice in a pass, and two preemptions never count
the same freed room.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import NamedTuple

from irisfed.shared.bands import BANDS, UNPREEMPTIBLE_RANK
from irisfed.shared.resources import resources_from_json

# Why a waiting job preempted nothing (the end of its explanation).
LOWEST_BAND = f"a {BANDS[0]} job preempts nothing"
NO_LOWER_BAND = "no job of a lower band runs on a backend that could hold it"
STILL_NO_ROOM = "it would not fit even with every job of a lower band there preempted"
ONLY_HELD = "the backends it could preempt on are held for jobs waiting longer"


class Candidate(NamedTuple):
    """A live job a higher band may preempt: where it runs, what it holds, since when."""

    job_id: str
    epoch: int
    state: str  # assigned or running: the CAS expects it
    peer_id: str
    backend: str
    band: int
    since: float  # when it took its room (seconds since the epoch): the newest goes first
    units: tuple[tuple[str, int], ...]  # what each of its tasks asked, in units (shared.resources)
    user_id: str = "default"
    tasks: int = 1  # a gang's tasks: it frees that many slots and that many times ``units``

    def order(self) -> tuple:
        """Victim order: lowest band first, then the most recently started."""
        return (self.band, -self.since, self.job_id)


_band = attrgetter("band")


def candidate_from_row(row) -> Candidate:
    """A ``job_list_preemptible`` row → Candidate."""
    return Candidate(row.job_id, row.epoch, str(getattr(row.state, "value", row.state)), row.owner_peer_id,
                     row.backend or "", row.band, row.since, resources_from_json(row.resources_json).units,
                     row.user_id, getattr(row, "replicas", 1))


class VictimPool:
    """The preemptible jobs of one pass, per (peer, backend), in victim order: those a
    job of ``band`` or lower may preempt (what was read for it)."""

    __slots__ = ("band", "by_room")

    def __init__(self, candidates: Iterable[Candidate], band: int = UNPREEMPTIBLE_RANK) -> None:
        self.band = band
        self.by_room: dict[tuple[str, str], list[Candidate]] = {}
        for c in candidates:
            self.by_room.setdefault((c.peer_id, c.backend), []).append(c)
        for listed in self.by_room.values():
            listed.sort(key=Candidate.order)

    def on(self, key: tuple[str, str], band: int) -> Sequence[Candidate]:
        """What a job of ``band`` may preempt on backend ``key``, in victim order (lowest
        band first, so it is a prefix: found by bisection, not a scan — the tick asks this
        for every waiting job and every backend it could use). Not to be modified."""
        listed = self.by_room.get(key)
        if not listed:
            return ()
        end = bisect_left(listed, min(band, UNPREEMPTIBLE_RANK), key=_band)
        return listed if end == len(listed) else listed[:end]

    def remove(self, victims: Iterable[Candidate]) -> None:
        for v in victims:
            listed = self.by_room.get((v.peer_id, v.backend))
            if listed is not None and v in listed:
                listed.remove(v)

    def restore(self, victims: Iterable[Candidate]) -> None:
        """Put back victims whose preemption was not committed."""
        for v in victims:
            listed = self.by_room.setdefault((v.peer_id, v.backend), [])
            if v not in listed:
                listed.append(v)
                listed.sort(key=Candidate.order)


def _lacks(units: Sequence[tuple[str, int]], free: Mapping[str, int], slots: int,
           legacy: bool, tasks: int = 1) -> dict[str, int]:
    """What a backend lacks for a job of ``tasks`` tasks (``units``: all of them), per
    resource (``""``: slots). ``free`` and ``slots`` are negative on a backend over its
    totals: the victims must pay that too."""
    lack = {"": tasks - slots} if slots < tasks else {}
    if not legacy:
        for name, amount in units:
            short = amount - free.get(name, 0)
            if short > 0:
                lack[name] = short
    return lack


def _covers(victims: Iterable[Candidate], lack: Mapping[str, int]) -> bool:
    freed: dict[str, int] = {"": 0}
    for v in victims:
        freed[""] += v.tasks
        for name, amount in v.units:
            freed[name] = freed.get(name, 0) + amount * v.tasks
    return all(freed.get(name, 0) >= amount for name, amount in lack.items())


def choose_victims(units: Sequence[tuple[str, int]], free: Mapping[str, int], slots: int, legacy: bool,
                   candidates: Sequence[Candidate], tasks: int = 1) -> tuple[Candidate, ...] | None:
    """The victims (in victim order) that make room for a job asking ``units`` (all its
    ``tasks`` tasks together) on a backend with ``free`` units and ``slots`` free slots
    (``legacy``: it advertises no resources, so only slots count), from ``candidates``
    (already in victim order, all preemptible by the job). ``()``: it fits already; None:
    even all would not do. (Nodes are the caller's: shared.gang_placement.)"""
    lack = _lacks(units, free, slots, legacy, tasks)
    if not lack:
        return ()
    for c in candidates:  # one victim, whenever one is enough
        if _covers((c,), lack):
            return (c,)
    chosen: list[Candidate] = []
    for c in candidates:
        chosen.append(c)
        if _covers(chosen, lack):
            break
    else:
        return None
    for c in reversed(chosen[:-1]):  # spare whoever is not needed, the most protected first
        rest = [v for v in chosen if v is not c]
        if _covers(rest, lack):
            chosen = rest
    return tuple(chosen)


def victims_rank(victims: Sequence[Candidate]) -> tuple:
    """How good a set of victims is (smaller is better): fewest, lowest bands, then the
    least work lost (started most recently, summed over the victims)."""
    return (len(victims), sorted(v.band for v in victims), -sum(v.since for v in victims))
