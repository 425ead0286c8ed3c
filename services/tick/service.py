"""The scheduler tick: runs on an interval and whenever woken.

The tick's run — deadlines, lost peers, and placement pipelined two batches deep
with in-run capacity accounting — is one loop; every decision in it is pure and
lives in plan.py and shared/placement.py.

Each run: (1) queued jobs past ``deadline_s`` become ``unschedulable``;
(2) live jobs of peers unreachable for longer than the grace period are
recovered (requeued, or failed when out of retries; pinned jobs never move);
(3) queued jobs are claimed band first, then by fair share and priority, in
batches, with ``FOR UPDATE SKIP LOCKED``, placed by one pure ``PlacementRun`` per
run (shared/placement.py) on reachable matching peers with room — a job of a
higher band that fits nowhere preempting the fewest lower-band jobs on one backend
(shared/preemption.py) — committed with a compare-and-set that bumps the epoch
(the victims' too, with their history rows, in the same transaction), and only
then announced: the victims' owners on ``cancel.<peer>``, the placements on
``assign.<peer>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from irisfed.services.common import metrics
from irisfed.services.common.bus import from_jetstream, publish, publish_event
from irisfed.services.common.faults import crash_point
from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView
from irisfed.services.common.runtime import Service, forever, when_woken
from irisfed.services.common.store import Store, Transaction
from irisfed.services.common.store_pipelines import ReleaseListener
from irisfed.services.tick.plan import (
    Recovery,
    queued_job_from_row,
    recovery_move,
    stored_cancel_move,
)
from irisfed.shared.bands import UNPREEMPTIBLE_RANK
from irisfed.shared.clock import Clock
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import ConfigError
from irisfed.shared.explain import explanation
from irisfed.shared.fair_share import FairShareRun, claim_share, within_quota
from irisfed.shared.holds import Waiting
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import AssignmentNotice, CancelNotice, Heartbeat, JobEvent
from irisfed.shared.placement import PACK, POLICIES, RESERVE_AFTER_S, PlacementRun
from irisfed.shared.preemption import Candidate, VictimPool, candidate_from_row
from irisfed.shared.records import AssignedJob, ClaimedJob, Move, PreemptedJob
from irisfed.shared.resources import Resources
from irisfed.shared.rooms import Placement
from irisfed.shared.settings import require_count
from irisfed.shared.subjects import TICK_QUEUE_GROUP
from irisfed.shared.users import QUOTA

log = EventLogger("tick")


# The queue-depth gauge is refreshed apart from the tick: it scans the whole queue.
QUEUE_DEPTH_INTERVAL_S = 5.0
QUEUE_DEPTH_CLASSES = 20  # label sets exported at most; the rest are summed as "other"
# A commit waits this long at most for its users' quota locks (a router or another
# tick holds them for one short transaction); past it the batch is rolled back (its
# rows go back to the queue) and the next pass tries again.
QUOTA_LOCK_WAIT_S = 2.0
# A preempting job left queued because a victim changed between the decision and the
# commit (it ended, was cancelled or is being written by its agent): the next pass decides again.
VICTIM_CHANGED = "a job it would preempt changed meanwhile; deciding again"


@dataclass(frozen=True)
class TickSettings:
    """Tuning knobs of a tick. The defaults live here; values are checked when built."""

    batch_size: int = 1000  # queued jobs claimed per transaction
    recover_batch_size: int = 1000  # live jobs of lost peers recovered per transaction
    policy: str = PACK  # pack (best fit) or spread (docs/scheduling.md)
    reserve_after_s: float | None = RESERVE_AFTER_S  # wait before a job holds a backend; None: never

    def __post_init__(self) -> None:
        require_count("tick", "batch_size", self.batch_size, flag="--batch-size")
        require_count("tick", "recover_batch_size", self.recover_batch_size)
        if self.policy not in POLICIES:
            raise ConfigError(f"tick: policy must be one of {', '.join(POLICIES)}, got {self.policy!r} "
                              "(--policy)")
        if self.reserve_after_s is not None and (
                isinstance(self.reserve_after_s, bool) or not isinstance(self.reserve_after_s, int | float)
                or not math.isfinite(self.reserve_after_s) or self.reserve_after_s < 0):
            raise ConfigError(f"tick: reserve_after_s must be a non-negative number of seconds or None, "
                              f"got {self.reserve_after_s!r} (--reserve-after)")


@dataclass
class TickResult:
    """What one run did."""

    assigned: list[tuple[str, str, int]] = field(default_factory=list)  # job, peer, epoch
    expired: int = 0
    recovered: int = 0
    waiting: int = 0
    claimed: int = 0  # queued rows this pass read and locked
    preempted: list[PreemptedJob] = field(default_factory=list)  # victims moved, with whom they made room for


# user → keyset (-band, -priority, submitted_at, job_id) of its last job claimed (None: none yet)
Cursor = dict[str, tuple[int, int, datetime, str] | None]


@dataclass
class _Batch:
    """Claimed jobs, placed, holding their row locks in an open transaction."""

    store: Store  # bound to the connection that holds the claim
    claim: Transaction
    rows: list[ClaimedJob]
    placements: list[Placement]
    waiting: list[Waiting]
    cursor: Cursor  # the users with more queued, each after its last job claimed here
    resources: dict[str, Resources] = field(default_factory=dict)  # each claimed job's request
    cancelled: list[Move] = field(default_factory=list)  # queued with a cancel stored: to kill, not place
    victims: dict[str, tuple[Candidate, ...]] = field(default_factory=dict)  # preempting job → whom it stops
    preempted: list[PreemptedJob] = field(default_factory=list)  # victims the commit moved

    def user_of(self) -> dict[str, str]:
        return {r.job_id: r.user_id for r in self.rows}


async def _done(value):
    """An awaitable of a value already at hand (a slot of ``_gathered`` with nothing to read)."""
    return value


async def _gathered(*reads):
    """``asyncio.gather`` of ``reads`` (the first: a claim or None), each awaited to its
    end; on any error the claim, if it was made, is rolled back and the first error
    raised."""
    results = await asyncio.gather(*reads, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        claim = results[0]
        if claim is not None and not isinstance(claim, BaseException):
            await claim[0].rollback_quietly()
        raise failed
    return results


@dataclass(frozen=True)
class QueueShape:
    """Who has queued work and the highest band queued: what a pass's first reads need.
    ``shared``: the users' usage matters (several users, or one with a quota)."""

    users: tuple[str, ...] = ()
    top_band: int = 0
    shared: bool = False
    preempts: bool = False  # a job live on a reachable peer is of a band the top band may preempt

    @classmethod
    def of(cls, top_band_of: dict[str, int], quota_users) -> QueueShape:
        users = tuple(sorted(top_band_of))
        return cls(users, max(top_band_of.values(), default=0),
                   len(users) > 1 or bool(set(users) & set(quota_users)))


class Tick(Service):
    """Places queued work; many may run at once (claims never overlap)."""

    def __init__(
        self,
        config: FederationConfig,
        pool: Any,
        nc: Client | None,
        settings: TickSettings = TickSettings(),
        clock: Clock | Callable[[], float] | None = None,  # default: the system's (a bare callable: monotonic)
    ) -> None:
        super().__init__(config, pool, nc, settings, clock)
        self.view = PeerView.exported(config, self.clock.monotonic)
        self.users = config.user_table
        self.quota_users = self.users.with_quota()
        self.wake = asyncio.Event()
        # Newest heartbeat per peer since the last write, with when we heard it (monotonic):
        # it is persisted as old as it is, so one held back through a Postgres outage is
        # never stored as fresh (a dead peer would look alive to a restarting service).
        self.heard: dict[str, tuple[Heartbeat, float]] = {}
        self.runs = 0  # full passes
        self.passes = 0  # placement passes (full or not): what wake-ups cost
        self.last_full_pass = float("-inf")  # the clock's monotonic reading when the last full pass started
        self.queue_shape = QueueShape()  # the queue as the last pass listed it: the next pass's first guess
        # The lowest band live on a reachable peer at this run's start (UNPREEMPTIBLE_RANK:
        # none below production): a queue may preempt only a band below its own.
        self.lowest_live_band = UNPREEMPTIBLE_RANK
        self.released: ReleaseListener | None = None  # listening for jobs an end released

    async def start(self) -> None:
        await self.refresh_view()
        if self.nc is not None:
            await self.nc.subscribe(self.subjects.heartbeat(), cb=self.on_heartbeat)
            await self.nc.subscribe(self.subjects.tick_wake, queue=TICK_QUEUE_GROUP, cb=self.on_wake)
            await self.nc.subscribe(self.subjects.tick_ping, cb=self.on_ping)
            await self.nc.flush()
        self.tasks.spawn(forever("view_refresh", self.refresh_view, self.config.heartbeat_interval_s),
                         name="tick-view")
        self.tasks.spawn(forever("heartbeat_persist", self.persist_heartbeats, self.config.heartbeat_interval_s),
                         name="tick-heartbeats")
        # After Postgres comes back, peers get a full TTL before being judged lost.
        self.tasks.spawn(when_woken("tick", self.run_woken, self.wake, self.config.tick_interval_s,
                                    on_db_back=self.view.mark_healthy), name="tick-loop")
        self.tasks.spawn(forever("queue_depth", self.export_queue_depth, QUEUE_DEPTH_INTERVAL_S),
                         name="tick-queue-depth")
        self.tasks.spawn(forever("released_listener", self.listen_released, self.config.tick_interval_s),
                         name="tick-released")
        log.info("tick_started", prefix=self.subjects.prefix)

    async def close(self) -> None:
        await self.tasks.close()
        if self.released is not None:
            await self.released.close()

    async def listen_released(self) -> None:
        """Keep a connection listening for jobs released by an end (a dependency met, an
        array's slot freed: Postgres notifies at commit), each waking a pass now; checked
        every interval, so one lost with Postgres is listened again once it is back. A
        pool of one connection keeps it for passes: those released wait for the interval."""
        if self.released is not None and self.released.alive():
            return
        if self.store.db.get_max_size() < 2:
            return
        if self.released is not None:
            await self.released.close()
            self.released = None
        self.released = await self.store.job_released_listen(self.wake.set)

    async def export_queue_depth(self) -> None:
        """Refresh irisfed_queue_depth (one grouped scan of the queued partial index)."""
        rows = await self.store.job_count_queued_by_class(QUEUE_DEPTH_CLASSES)
        metrics.QUEUE_DEPTH.clear()
        for row in rows:
            metrics.QUEUE_DEPTH.labels(row.pinned_peer, row.constraints).set(row.jobs)

    async def refresh_view(self) -> None:
        if self.view.apply_rows(await self.store.peer_heartbeat_list_news(self.view.held())):
            self.wake.set()  # a peer back (or roomier) through Postgres, e.g. NATS-partitioned

    async def on_heartbeat(self, msg: Msg) -> None:
        if from_jetstream(msg):  # not a peer's own publish
            return
        # Checked against its subject and the configuration; its TTL capped.
        heartbeat, change = self.view.receive(msg.subject, msg.data, log)
        if heartbeat is not None:
            self.heard[heartbeat.peer_id] = (heartbeat, self.clock.monotonic())  # capped TTL
        # Only a peer appearing or coming back, a new shape or freed slots may make
        # queued work placeable; a heartbeat that merely says "still here" costs no pass.
        if change.placeable:
            metrics.TICK_WAKEUPS_FROM_HEARTBEATS.inc()
            self.wake.set()

    async def persist_heartbeats(self) -> None:
        """Write what we heard on NATS to ``peer_heartbeat``: one statement per interval."""
        heard, self.heard = self.heard, {}
        now = self.clock.monotonic()
        try:
            await self.store.peer_heartbeat_upsert_batch(
                [(heartbeat, max(0.0, now - heard_at)) for heartbeat, heard_at in heard.values()])
        except BaseException:
            self.heard = {**heard, **self.heard}  # retry them next time
            raise

    async def on_wake(self, msg: Msg) -> None:
        if not from_jetstream(msg):
            self.wake.set()

    async def on_reconnect(self) -> None:
        self.view.mark_healthy()
        self.wake.set()

    async def on_ping(self, msg: Msg) -> None:
        if msg.reply and not from_jetstream(msg):
            await msg.respond(str(self.runs).encode())

    async def run_woken(self) -> TickResult:
        """What the loop runs: a full pass once per interval, placement alone in between.

        Wake-ups come with every submit and freed slot; they only make queued work
        placeable. Deadlines and lost peers are matters of time, so they keep the
        interval and a burst of submits does not repeat them per wake-up.
        """
        return await self.run_once(full=self.clock.monotonic() - self.last_full_pass >= self.config.tick_interval_s)

    async def run_once(self, full: bool = True) -> TickResult:
        """One pass: deadlines and lost peers (when ``full``), then placement."""
        # Counted before the first await: once the loop has cleared a wake-up, the
        # pass it causes is already counted (tests wait on exactly that).
        self.passes += 1
        metrics.TICK_PASSES.labels("full" if full else "place").inc()
        result = TickResult()
        elapsed = metrics.timer()
        if full:
            self.last_full_pass = self.clock.monotonic()  # scheduling: immune to wall-clock jumps
            expired = await self.store.job_expire_deadlines()
            result.expired = len(expired)
            metrics.UNSCHEDULABLE.inc(len(expired))
            now_dt = self.clock.now()
            for row in expired:
                log.info("job_unschedulable", job_id=row.job_id, epoch=row.epoch)
                await self._event(row.job_id, JobState.UNSCHEDULABLE, "", row.epoch, now_dt, "deadline passed")
            result.recovered = await self.recover_lost_peers()
            self.runs += 1
        await self._place(result)
        metrics.ASSIGNMENTS.inc(len(result.assigned))
        metrics.TICK_SECONDS.observe(elapsed())
        return result

    async def recover_lost_peers(self) -> int:
        """Requeue or fail unpinned live jobs of lost peers, batch by batch until none is left,
        and let preempted jobs whose old run was on a lost peer be placed again.

        A peer is lost once it has been silent for its TTL plus ``assign_grace_s``,
        counted from its newest heartbeat (never from before the tick last came back,
        so a control-plane outage never looks like every peer died at once), not from
        when its jobs last changed. Owners missing from the configuration can never be
        heard: they are lost like a peer never heard since then.
        """
        grace_s = self.config.assign_grace_s
        lost = self.view.lost_ids(grace_s)
        if self.view.unheard_lost(grace_s):
            configured = set(self.config.peer_ids)
            lost += sorted({owner for owner, _ in await self.store.job_count_live()
                            if owner and owner not in configured})
        released = await self.store.job_release_stopping_on_lost(
            lost, self.config.peer_ids if self.view.unheard_lost(grace_s) else None)
        for job in released:
            log.warning("preempted_run_presumed_stopped", job_id=job.job_id, peer_id=job.peer_id, epoch=job.epoch)
        if not lost:
            if released:
                self.wake.set()
            return 0
        total, limit = 0, self.settings.recover_batch_size
        while True:
            fetched, recovered = await self._recover_batch(lost, limit)
            total += len(recovered)
            now_dt = self.clock.now()
            for job_id, decision, owner, epoch in recovered:
                metrics.FAILOVERS.labels(decision.to_state.value).inc()
                log.warning("job_recovered_from_lost_peer", job_id=job_id, peer_id=owner, epoch=epoch,
                            state=decision.to_state.value)
                await self._event(job_id, decision.to_state, owner, epoch, now_dt, decision.reason)
            # Fewer rows than asked: none left (or locked by another tick, which recovers
            # them). No progress at all: stop rather than spin.
            if fetched < limit or not recovered:
                break
        if total or released:
            self.wake.set()
        return total

    async def _recover_batch(self, lost: list[str], limit: int
                             ) -> tuple[int, list[tuple[str, Recovery, str, int]]]:
        """One transaction: lock up to ``limit`` unpinned live jobs of ``lost`` peers and move them."""
        recovered = []
        async with self.store.transaction() as tx:
            rows = await tx.job_claim_on_lost_peers(lost, limit)
            for row in rows:
                if row.pinned_peer_id:
                    continue  # the query leaves them out; pinned jobs never move
                move, decision = recovery_move(row)
                if await tx.job_move(move) is not None:
                    recovered.append((row.job_id, decision, row.owner_peer_id, move.new_epoch))
        return len(rows), recovered

    async def _place(self, result: TickResult) -> None:
        """Claim, place and assign the queue in batches, two batches in flight.

        While batch k's assignments commit on one connection, batch k+1 is claimed
        and placed on the other, so Postgres and Python work at the same time. Batch
        k+1 is placed as if all of batch k's assignments succeed; any that lose their
        compare-and-set give their slot back when batch k commits.
        """
        peers = self.view.peers()
        now = self.clock.monotonic()
        if not any(p.is_reachable(now) for p in peers):
            return
        # The second batch in flight needs a second connection; a pool of one cannot.
        pipelined = self.store.max_connections > 1
        batch = following = None
        async with contextlib.AsyncExitStack() as connections:
            try:
                first = await connections.enter_async_context(self.store.connection())
                claimed, run = await self._open_run(first, peers, now, concurrent=pipelined)
                if claimed is None:
                    return  # nothing queued
                batch = await self._placed(first, *claimed, run)
                spare = None  # the second connection, taken only when a second batch is needed
                while batch is not None:
                    following = None
                    more = bool(batch.cursor) and run.placement.has_room()
                    if more and pipelined:
                        spare = spare or await connections.enter_async_context(self.store.connection())
                        committed, claimed = await asyncio.gather(
                            self._commit_batch(batch), self._claim_batch(spare, batch.cursor, run),
                            return_exceptions=True)
                        if not isinstance(claimed, BaseException):
                            following = claimed
                        if isinstance(committed, BaseException):
                            raise committed
                        await self._announce_batch(batch, committed, run, result)
                        if isinstance(claimed, BaseException):
                            raise claimed
                        spare, batch = batch.store, following
                    else:
                        committed = await self._commit_batch(batch)
                        await self._announce_batch(batch, committed, run, result)
                        batch = await self._claim_batch(batch.store, batch.cursor, run) if more else None
            finally:
                # Whatever stopped us (an error, shutdown), no claim stays open.
                for left in (batch, following):
                    if left is not None and not left.claim.finished:
                        await left.claim.rollback_quietly()

    async def _open_run(self, bound: Store, peers, now: float, concurrent: bool
                        ) -> tuple[tuple[Transaction, list[ClaimedJob], Cursor] | None, FairShareRun | None]:
        """The first claim and the run's placement state (None, None: nothing queued;
        an idle federation's passes then cost no placement state over every peer).

        Slots and resources in use are counted once per run; the run's placement state
        takes each placement's share as it goes (and gets back those whose CAS lost),
        so each batch costs its own rows, not a scan of every live job. Kinds, holds
        and explanations live for the run, not a batch.

        With connections to spare, everything a pass reads before placing goes to
        Postgres at once, so a wake-up (every submit burst) waits for one round trip:
        the claim, the users with queued work and the counts (one statement,
        ``job_pass_reads``), and — where they apply —
        what users hold (more than one user, or a quota) and what may be preempted (a
        queue above ``batch``). The claim and those two reads need the users and their
        top band, which the same round trip lists: they go out for the users and band
        the last pass listed (``QueueShape``), and are read again, in a second round
        trip, only when the listing says the queue's shape changed. The counts are a
        snapshot either way; taken beside the claim they are no staler than before it.
        """
        if not concurrent:  # a pool of one: everything on the held connection, in turn
            (live, used, lowest), top_band_of = await bound.job_pass_reads()
            if not top_band_of:
                return None, None
            shape = QueueShape.of(top_band_of, self.quota_users)
            reachable = [p.peer_id for p in peers if p.is_reachable(now)]
            self.lowest_live_band = min((lowest[p] for p in reachable if p in lowest), default=UNPREEMPTIBLE_RANK)
            held = await bound.job_live_usage_by_user() if shape.shared else {}
            claimed = await self._claim(bound, dict.fromkeys(shape.users))
            victims = None
        else:
            claimed, (live, used), held, victims, shape = await self._open_concurrently(bound, peers, now)
            if shape is None:
                return None, None
        run = PlacementRun(peers, live, now, used=used, policy=self.settings.policy,
                           reserve_after_s=self.settings.reserve_after_s)
        if victims is not None:
            run.pool = VictimPool(map(candidate_from_row, victims[1]), victims[0])
        return claimed, FairShareRun(run, self.users, held)

    async def _open_concurrently(self, bound: Store, peers, now: float):
        """``_open_run``'s reads on several connections: one round trip when the queue's
        shape is the last pass's, a second for what that guess got wrong. Returns the
        claim (None: nothing claimable), the counts, what users hold, the victims (band,
        rows) or None, and the shape (None: nothing queued). Victims are read only where
        a live job's band is below the queue's top band (the counts say so)."""
        reachable = sorted(p.peer_id for p in peers if p.is_reachable(now))
        guess = self.queue_shape
        claimed, ((live, used, lowest), listed), held, victims = await _gathered(
            self._claim(bound, dict.fromkeys(guess.users)) if guess.users else _done(None),
            self.store.job_pass_reads(),
            self.store.job_live_usage_by_user() if guess.shared else _done({}),
            self._victims(guess.top_band, reachable) if guess.preempts else _done(None))
        self.lowest_live_band = min((lowest[p] for p in reachable if p in lowest), default=UNPREEMPTIBLE_RANK)
        shape = QueueShape.of(listed, self.quota_users)
        shape = replace(shape, preempts=self.lowest_live_band < min(shape.top_band, UNPREEMPTIBLE_RANK))
        if not listed:
            # Nothing queued: the guess keeps the last queue's users. The passes that drain
            # a queue (every freed slot wakes one) must not make the next submit's pass pay
            # a second round trip for a guess of "nobody"; but what users hold and what
            # may be preempted are not read again on idle passes (they may be many rows).
            if claimed is not None:
                await claimed[0].rollback()
            self.queue_shape = replace(guess, shared=False, preempts=False)
            return None, (live, used), {}, None, None
        self.queue_shape = shape
        reclaim = shape.users != guess.users  # users queued (or gone) since: claim them all
        if reclaim and claimed is not None:
            await claimed[0].rollback()
        more_held = shape.shared and not guess.shared
        more_victims = shape.preempts and not (guess.preempts and guess.top_band == shape.top_band)
        if not shape.preempts:  # nothing live below the queue's band: no victims, none read
            victims = (shape.top_band, []) if shape.top_band > 0 else None
        if reclaim or more_held or more_victims:
            claimed, held, victims = await _gathered(
                self._claim(bound, dict.fromkeys(shape.users)) if reclaim else _done(claimed),
                self.store.job_live_usage_by_user() if more_held else _done(held),
                self._victims(shape.top_band, reachable) if more_victims else _done(victims))
        return claimed, (live, used), held, victims, shape

    async def _victims(self, band: int, reachable: list[str]) -> tuple[int, list] | None:
        """What a queue whose top band is ``band`` may preempt on ``reachable`` peers
        (None: nothing, the band being the lowest or no peer reachable)."""
        if band <= 0 or not reachable:
            return None
        return band, await self.store.job_list_preemptible(band, reachable)

    async def _claim(self, bound: Store, cursor: Cursor) -> tuple[Transaction, list[ClaimedJob], Cursor] | None:
        """Open a transaction on ``bound``'s connection and claim the next batch: each
        user of ``cursor`` its share of the batch size, after its own cursor (None, the
        transaction rolled back: the queue is drained). Also the cursor after it: the
        users whose share came back full (they may have more queued)."""
        per_user = claim_share(self.settings.batch_size, len(cursor))
        claim = await bound.begin()
        try:
            rows = await bound.job_claim_queued_by_user(cursor, per_user)
        except BaseException:
            await claim.rollback_quietly()
            raise
        if not rows:
            await claim.rollback()
            return None
        count: dict[str, int] = {}
        last: dict[str, ClaimedJob] = {}
        for row in rows:
            count[row.user_id] = count.get(row.user_id, 0) + 1
            last[row.user_id] = row
        after: Cursor = {user: (-row.band, -row.priority, row.submitted_at, row.job_id)
                         for user, row in last.items() if count[user] == per_user}
        return claim, rows, after

    async def _placed(self, bound: Store, claim: Transaction, rows: list[ClaimedJob], cursor: Cursor,
                      run: FairShareRun) -> _Batch:
        """Place claimed ``rows`` in ``run`` (the claim stays open until the batch commits)."""
        try:
            kills = {r.job_id: move for r in rows if (move := stored_cancel_move(r)) is not None}
            cancelled = list(kills.values())
            by_user: dict[str, list] = {}
            user_of = {r.job_id: r.user_id for r in rows}
            resources: dict[str, Resources] = {}
            for r in rows:
                if r.job_id not in kills:
                    job = queued_job_from_row(r)
                    by_user.setdefault(r.user_id, []).append(job)
                    resources[job.job_id] = job.resources
            top_band = max((r.band for r in rows if r.job_id not in kills), default=0)
            if top_band > 0 and self.lowest_live_band < min(top_band, UNPREEMPTIBLE_RANK):
                await self._load_victims(bound, run, top_band)
            elif top_band > 0 and (run.placement.pool is None or run.placement.pool.band < top_band):
                run.placement.pool = VictimPool((), top_band)  # nothing live below it: nothing to read
            placements, waiting = run.place(by_user)
            preempted = run.placement.preempted
            victims = {p.job_id: preempted[p.job_id] for p in placements if p.job_id in preempted}
            # A user whose every job here waited on its quota is not claimed further
            # this pass: its next jobs would wait too, and a backlog far past a quota
            # must not make every pass read all of it.
            at_quota = {user for user, jobs in by_user.items() if jobs} - {
                user_of[w.job_id] for w in waiting if w.code != QUOTA} - {
                user_of[p.job_id] for p in placements} if waiting else set()
            cursor = {user: after for user, after in cursor.items() if user not in at_quota}
        except BaseException:
            await claim.rollback_quietly()
            raise
        return _Batch(bound, claim, rows, placements, waiting, cursor, resources, cancelled, victims)

    async def _load_victims(self, bound: Store, run: FairShareRun, band: int) -> None:
        """Give the run the live jobs a job of ``band`` may preempt (once per pass; again
        when a later batch brings a higher band), less those already chosen as victims."""
        placement = run.placement
        if placement.pool is not None and placement.pool.band >= band:
            return
        peers = sorted(placement.rooms_of_peer)
        rows = await bound.job_list_preemptible(band, peers) if peers else []
        chosen = {v.job_id for victims in placement.preempted.values() for v in victims}
        placement.pool = VictimPool((c for c in map(candidate_from_row, rows) if c.job_id not in chosen), band)

    async def _claim_batch(self, bound: Store, cursor: Cursor, run: FairShareRun) -> _Batch | None:
        """Claim the next batch after ``cursor`` on ``bound``'s connection and place it
        (None: queue drained)."""
        claimed = await self._claim(bound, cursor)
        return None if claimed is None else await self._placed(bound, *claimed, run)

    async def _commit_batch(self, batch: _Batch) -> list[AssignedJob]:
        """Assign (CAS on epoch, changelog in the same statement), explain the rest, kill
        the cancelled (rare: one statement each), commit.

        Preempting placements lock their victims first (still as seen, or the job stays
        queued: ``VICTIM_CHANGED``). Placements of users with quotas are checked once
        more under those users' quota locks against what their live jobs hold now (less
        the locked victims'), committed by anyone (other ticks, routers' LOCAL jobs): a
        quota is a hard cap, not a snapshot's guess. Those that no longer fit stay queued
        (their room goes back to the run with the lost CASes). Then the victims are
        preempted and the placements assigned, in this one transaction: the preempting
        job's assignment is the hold on the room its victims free.
        """
        try:
            # The claim holds their rows: these CASes cannot lose.
            batch.cancelled = [m for m in batch.cancelled if await batch.store.job_move(m) is not None]
            placements = batch.placements
            victims = batch.victims
            if victims:
                locked = await batch.store.job_lock_victims(
                    [(v.job_id, v.state, v.epoch, v.peer_id) for vs in victims.values() for v in vs])
                changed = {job_id for job_id, vs in victims.items() if any(v.job_id not in locked for v in vs)}
                if changed:
                    placements = [p for p in placements if p.job_id not in changed]
                    batch.waiting.extend(Waiting(job_id, VICTIM_CHANGED) for job_id in sorted(changed))
            user_of = batch.user_of()
            capped = sorted({user_of[p.job_id] for p in placements} & self.quota_users)
            if capped:
                await batch.store.job_quota_lock(capped, wait_s=QUOTA_LOCK_WAIT_S)
                held = await batch.store.job_live_usage_by_user(capped)
                placements, over = within_quota(
                    [(p, user_of[p.job_id], batch.resources[p.job_id]) for p in placements], self.users, held,
                    {job_id: [(v.user_id, v.units, v.tasks) for v in vs] for job_id, vs in victims.items()})
                batch.waiting.extend(over)
            preempting = [p for p in placements if p.job_id in victims]
            if preempting:
                batch.preempted = await batch.store.job_preempt_batch(
                    [(v.job_id, v.state, v.epoch, v.peer_id, p.job_id) for p in preempting for v in victims[p.job_id]])
            moved = await batch.store.job_assign_batch(
                [(p.job_id, p.epoch, p.peer_id, p.backend) for p in placements],
                {p.job_id: "placed; preempted " + ", ".join(v.job_id for v in victims[p.job_id])
                 for p in preempting})
            await batch.store.job_explain_batch([
                (w.job_id, explanation("tick", w.rule, w.verdicts, w.code), w.rule) for w in batch.waiting])
        except BaseException:
            await batch.claim.rollback_quietly()
            raise
        # A failed commit raises its own error (never a rollback's): the caller's
        # cleanup and the pool deal with the connection.
        await batch.claim.commit()
        return moved

    async def _announce_batch(self, batch: _Batch, moved: list[AssignedJob], run: FairShareRun,
                              result: TickResult) -> None:
        """After commit: give back slots and resources of lost CASes (and of placements
        over quota), then tell agents and watchers."""
        crash_point("tick_after_commit")
        result.waiting += len(batch.waiting)
        result.claimed += len(batch.rows)
        placed = {p.job_id: p for p in batch.placements}
        lost = placed.keys() - {row.job_id for row in moved}
        if lost:
            user_of = batch.user_of()
            for job_id in lost:
                run.release(user_of[job_id], placed[job_id], batch.resources[job_id])
        priority_of = {r.job_id: r.priority for r in batch.rows}
        now_dt = self.clock.now()
        for victim in batch.preempted:
            # Its owner fences the run now, as it would a stale epoch's (its reconcile would too).
            metrics.PREEMPTIONS.labels(victim.state.value).inc()
            log.info("job_preempted", job_id=victim.job_id, peer_id=victim.run_owner, epoch=victim.epoch,
                     state=victim.state.value, by=victim.preemptor)
            result.preempted.append(victim)
            if self.nc is not None:
                await publish(self.nc, self.subjects.cancel_notice(victim.run_owner),
                              CancelNotice(victim.job_id, victim.run_owner, victim.epoch))
            await self._event(victim.job_id, victim.state, "" if victim.state is JobState.QUEUED else victim.run_owner,
                              victim.epoch, now_dt, victim.reason)
        if batch.preempted:
            self.wake.set()  # the victims are queued again: place them elsewhere if there is room
        for move in batch.cancelled:
            log.info("job_killed_stored_cancel", job_id=move.job_id, epoch=move.epoch)
            await self._event(move.job_id, JobState.KILLED, "", move.epoch, now_dt, move.reason)
        for row in moved:
            job_id, peer_id, epoch = row.job_id, row.owner_peer_id, row.epoch
            result.assigned.append((job_id, peer_id, epoch))
            await self._notify_assigned(job_id, peer_id, epoch, placed[job_id].backend, priority_of[job_id], now_dt,
                                        placed[job_id].tasks)

    async def _notify_assigned(self, job_id: str, peer_id: str, epoch: int, backend: str, priority: int,
                               at: datetime, tasks: int = 1) -> None:
        if self.nc is None:
            return
        await publish(self.nc, self.subjects.assign(peer_id),
                      AssignmentNotice(job_id, peer_id, epoch, backend, priority, tasks))
        await self._event(job_id, JobState.ASSIGNED, peer_id, epoch, at, "")

    async def _event(self, job_id: str, state: JobState, peer_id: str, epoch: int, at: datetime,
                     reason: str) -> None:
        if self.nc is not None:
            await publish_event(self.nc, self.subjects,
                                JobEvent(job_id, state.value, peer_id or "", epoch, at, reason=reason))
