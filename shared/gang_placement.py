"""Gang placement: all of a gang's tasks on distinct nodes of one backend, or none. Pure.

Owns the gang half of a placement run (docs/scheduling.md, "Gangs"): the backends a
gang could ever run on, the one it takes now (every task a node with room for it,
sharing a ``group_by`` value), the fewest lower-band jobs whose preemption lets the
whole gang in (``_gang_victims``), and, when none of that works, its hold and why it
waits (shared/holds.py). ``GangPlacementMixin`` is mixed into ``PlacementRun``
(shared/placement.py), whose state (rooms, holds, the victim pool, what it learnt) its
methods read and update; fitting tasks on nodes is shared/nodes.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from irisfed.shared.holds import Waiting, _explain, _reserve_gang, waiting_rule
from irisfed.shared.nodes import Gang
from irisfed.shared.preemption import (
    LOWEST_BAND,
    NO_LOWER_BAND,
    ONLY_HELD,
    STILL_NO_ROOM,
    Candidate,
    choose_victims,
    victims_rank,
)
from irisfed.shared.rooms import Placement, QueuedJob, _rank, _Room


class GangPlacementMixin:
    """The gang half of ``PlacementRun``: its methods use the run's state."""

    __slots__ = ()

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
