"""Fair share and quotas in placement: the order users' queued jobs are placed in. Pure, no I/O.

The rule (docs/scheduling.md, "Fair share"): bands come first (shared/bands.py): a
user's next job of a higher band goes before any of a lower one. Within a band, the user whose live
usage is the smallest *weighted dominant share* goes first — the largest fraction of
any federation total (advertised by reachable backends, slots included) that its
assigned and running jobs hold, divided by its weight — recomputed after every
placement; within a user, its own priority, then submit time. Users with equal shares
go by whose next job has waited longest. A job that would take its user over any
amount of its quota is not placed: it waits with the code ``quota``.

``FairShareRun`` wraps one ``PlacementRun`` (which owns room, holds and ranking) and
decides only the order and the quota, so a single user's queue is placed exactly as
before fair share existed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from heapq import heappop, heappush

from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.holds import Waiting
from irisfed.shared.placement import PlacementRun
from irisfed.shared.resources import SLOTS, as_resources, offered_units
from irisfed.shared.rooms import Placement, QueuedJob
from irisfed.shared.users import QUOTA, Usage, UserTable, add_units, dominant_share, quota_wait


def federation_totals(peers: Iterable[FederationPeer], now: float | None = None) -> Usage:
    """What the backends of the peers reachable at ``now`` (every one given, when None)
    advertise in all, in units, slots included: what dominant shares divide by. The
    tick, ``irisfed users`` and the dashboard all count with this."""
    totals: Usage = {}
    for peer in peers:
        if now is not None and not peer.is_reachable(now):
            continue
        for backend in peer.backends:
            totals[SLOTS] = totals.get(SLOTS, 0) + offered_units(SLOTS, backend.total)
            for name, amount in backend.resources.items():
                totals[name] = totals.get(name, 0) + offered_units(name, getattr(amount, "total", 0))
    return totals


# With many users a batch claims at least this many jobs of each (up to
# CLAIM_BATCHES_AT_MOST batches' worth in all): a batch's fixed costs (a range probe per
# user, the quota check at commit) then spread over more jobs, and each batch shows
# fair share more of every user's queue.
CLAIM_PER_USER_AT_LEAST = 10
CLAIM_BATCHES_AT_MOST = 10


def claim_share(batch_size: int, users: int) -> int:
    """How many queued jobs of each of ``users`` one claim takes: an equal part of the
    batch, at least CLAIM_PER_USER_AT_LEAST (never more than a batch) while the claim
    stays within CLAIM_BATCHES_AT_MOST batches, and at least one."""
    widest = min(CLAIM_PER_USER_AT_LEAST, batch_size, CLAIM_BATCHES_AT_MOST * batch_size // users)
    return max(1, batch_size // users, widest)


class FairShareRun:
    """Places claimed jobs of many users in fair-share order, under their quotas.

    ``held``: what each user's live jobs hold (units; ``slots``: how many), read when
    the run starts; it grows with every placement made here (and shrinks with
    ``release``), so later batches of the same run see earlier ones.
    """

    __slots__ = ("held", "placement", "totals", "users")

    def __init__(self, placement: PlacementRun, users: UserTable, held: Mapping[str, Mapping[str, int]]) -> None:
        self.placement = placement
        self.users = users
        self.held: dict[str, Usage] = {user: dict(usage) for user, usage in held.items()}
        self.totals = federation_totals(placement.reachable)

    def share(self, user: str) -> float:
        return dominant_share(self.held.get(user, {}), self.totals, self.users.get(user).weight)

    def place(self, jobs_by_user: Mapping[str, Sequence[QueuedJob]]) -> tuple[list[Placement], list[Waiting]]:
        """Place each user's jobs (in that user's order) interleaved by fair share."""
        quota_users = self.users.with_quota()
        queues = [(user, jobs) for user, jobs in jobs_by_user.items() if jobs]
        if len(queues) == 1 and queues[0][0] not in quota_users:
            # One user without a quota: its order is the whole order.
            user, jobs = queues[0]
            placements, waiting = self.placement.place(jobs)
            if placements:
                self._take(user, {p.job_id for p in placements}, jobs)
                self._free_victims(placements)
            return placements, waiting
        placements: list[Placement] = []
        waiting: list[Waiting] = []
        heap: list[tuple[int, float, float, int, str]] = []
        position = dict.fromkeys(jobs_by_user, 0)
        for n, (user, jobs) in enumerate(queues):
            heappush(heap, (-jobs[0].band, self.share(user), -jobs[0].waited_s, n, user))
        place = self.placement.place
        while heap:
            _, _, _, n, user = heappop(heap)
            jobs = queues[n][1]
            i = position[user]
            job = jobs[i]
            position[user] = i + 1
            resources = as_resources(job.resources)
            held = self.held.setdefault(user, {})
            why = (quota_wait(self.users.get(user), held, resources.units, job.replicas)
                   if user in quota_users else None)
            if why is not None:
                waiting.append(Waiting(job.job_id, why, code=QUOTA))
            else:
                placed, left = place((job,))
                if placed:
                    placements.extend(placed)
                    add_units(held, resources.units, tasks=job.replicas)
                    self._free_victims(placed)
                else:
                    waiting.extend(left)
            if i + 1 < len(jobs):
                heappush(heap, (-jobs[i + 1].band, self.share(user), -jobs[i + 1].waited_s, n, user))
        return placements, waiting

    def _take(self, user: str, placed: set[str], jobs: Iterable[QueuedJob]) -> None:
        held = self.held.setdefault(user, {})
        for job in jobs:
            if job.job_id in placed:
                add_units(held, as_resources(job.resources).units, tasks=job.replicas)

    def _free_victims(self, placements: Iterable[Placement]) -> None:
        """Placements that preempted: their victims' users hold less from now on."""
        preempted = self.placement.preempted
        if not preempted:
            return
        for placement in placements:
            for victim in preempted.get(placement.job_id, ()):
                add_units(self.held.setdefault(victim.user_id, {}), victim.units, sign=-1, tasks=victim.tasks)

    def release(self, user: str, placement: Placement, resources) -> None:
        """Give back a placement whose commit failed: its room and its user's share (and
        its victims', whose preemption did not happen either)."""
        for victim in self.placement.preempted.get(placement.job_id, ()):
            add_units(self.held.setdefault(victim.user_id, {}), victim.units, tasks=victim.tasks)
        self.placement.release(placement, resources)
        add_units(self.held.setdefault(user, {}), as_resources(resources).units, sign=-1, tasks=placement.tasks)


def within_quota(placements: Sequence[tuple[Placement, str, object]], users: UserTable,
                 held: Mapping[str, Mapping[str, int]],
                 freed: Mapping[str, Sequence[tuple[str, tuple[tuple[str, int], ...], int]]] | None = None,
                 ) -> tuple[list[Placement], list[Waiting]]:
    """The placements (each with its user and resources, in placement order) that fit
    their users' quotas over ``held`` (what each user's live jobs hold now, read under
    that user's quota lock), and the rest as waiting with the code ``quota``.

    ``freed``: a preempting placement's victims (job → (user, units, tasks) each). They stop
    only if that placement is kept: then what they held is taken off their users'
    usage (its own user's counts for its own check, as they go in the same
    transaction); a placement that waits frees nothing for the ones after it.

    The commit-time check that makes a quota a hard cap whatever number of routers and
    ticks run: ``held`` is read after every other writer's commit for these users.
    """
    quota_users = users.with_quota()
    running: dict[str, Usage] = {}
    kept: list[Placement] = []
    waiting: list[Waiting] = []
    freed = freed or {}

    def usage_of(user: str) -> Usage:
        return running.setdefault(user, dict(held.get(user, {})))

    for placement, user, resources in placements:
        victims = freed.get(placement.job_id, ())
        if user in quota_users:
            units = as_resources(resources).units
            after = dict(usage_of(user))
            for owner, victim_units, tasks in victims:
                if owner == user:
                    add_units(after, victim_units, sign=-1, tasks=tasks)
            why = quota_wait(users.get(user), after, units, placement.tasks)
            if why is not None:
                waiting.append(Waiting(placement.job_id, why, code=QUOTA))
                continue
            add_units(usage_of(user), units, tasks=placement.tasks)
        for owner, victim_units, tasks in victims:
            if owner in quota_users:
                add_units(usage_of(owner), victim_units, sign=-1, tasks=tasks)
        kept.append(placement)
    return kept, waiting
