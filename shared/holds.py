"""Anti-starvation holds and waiting reasons: what a job that finds no room gets. Pure.

Owns, for a job left waiting: which backend it holds once it has waited long enough
(``_reserve``; ``_reserve_gang`` for a gang) — the one where it would fit soonest, kept
from later jobs by the ``Hold`` (shared/rooms.py) — and why it waits: ``Waiting``, the
rule and a verdict per peer naming what each backend lacks (``_explain`` and its
per-peer verdicts, ``waiting_rule``, ``explain_waiting``). Called by the placement run
(shared/placement.py, shared/gang_placement.py); the rules: shared/placement.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from irisfed.shared.constraints import matches_all
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.federation.router import PeerVerdict, judge_peer, too_few_nodes
from irisfed.shared.nodes import Gang, describe_task, gang_verdict
from irisfed.shared.resources import Shortfall, as_resources, describe_shortfalls, shortfalls
from irisfed.shared.rooms import Hold, QueuedJob, _Kind, _Room


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



def waiting_rule(rule: str, holding: tuple[str, str] | None, reserve_after_s: float,
                 cannot_preempt: str | None) -> str:
    """Why a job waits: the rule that left it, the room held for it, why it cannot preempt."""
    if holding is not None:
        rule = f"{rule}; backend {holding[1]} of {holding[0]} is held for it (waiting {reserve_after_s:g}s or more)"
    if cannot_preempt is not None:
        rule = f"{rule}; cannot preempt: {cannot_preempt}"
    return rule


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


def _matching_rooms(peer: FederationPeer, job: QueuedJob,
                  rooms: Mapping[tuple[str, str], _Room]) -> Iterator[tuple[Backend, _Room]]:
    """The backends of reachable ``peer`` matching ``job`` (a pinned job: all), with their rooms."""
    for backend in peer.backends:
        if not job.pinned_peer_id and not matches_all(job.constraints, backend.attributes):
            continue
        room = rooms.get((peer.peer_id, backend.name))
        if room is not None:
            yield backend, room


def _held_verdict(peer_id: str, held: Sequence[tuple[str, str]]) -> PeerVerdict:
    """The verdict on a peer held for jobs that waited longer: ``held``, (backend, held job) pairs."""
    detail = "; ".join(f"backend {name} held for {job_id}, waiting longer" for name, job_id in held)
    return PeerVerdict(peer_id, "held", detail)


def _room_verdict(peer: FederationPeer, job: QueuedJob, units: tuple[tuple[str, int], ...],
                  rooms: Mapping[tuple[str, str], _Room], holds: Mapping[tuple[str, str], Hold]) -> PeerVerdict:
    """A reachable peer whose attributes match: is it too small, full, or held?"""
    small: list[list[Shortfall]] = []
    few_nodes: list[str] = []
    full: list[tuple[str, list[Shortfall]]] = []
    held: list[tuple[str, str]] = []
    for backend, room in _matching_rooms(peer, job, rooms):
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
        return _held_verdict(peer.peer_id, held)
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
    for backend, room in _matching_rooms(peer, job, rooms):
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
        return _held_verdict(peer.peer_id, held)
    return PeerVerdict(peer.peer_id, "insufficient_nodes", "; ".join(never) or "advertises no backend for it")


def explain_waiting(
    job: QueuedJob, peers: Sequence[FederationPeer], slots: Mapping[tuple[str, str], int], now: float,
    used: Mapping[tuple[str, str | None], Mapping[str, float]] | None = None,
) -> Waiting:
    """Why ``job`` could not be placed: the rule, and a verdict for every peer.

    ``slots``: free slots per (peer, backend); ``used`` as for ``assign_queued`` (shared/placement.py).
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

