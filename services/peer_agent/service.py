"""The peer agent: one per cluster.

It advertises its backends on ``heartbeat.<self>`` (and in ``peer_heartbeat``)
every interval; listens on ``assign.<self>`` and ``cancel.<self>``; and
reconciles with Postgres at start, on NATS reconnect and periodically, so a
missed message delays work but never loses it. It accepts a job with a
compare-and-set on its epoch (assigned → running), runs it on its backend,
writes the terminal state with the exit code under the same epoch, records
``federation_sync_state`` and publishes ``events.<job_id>``. A write refused
because the epoch moved on means the job was fenced away: the local copy is
killed and nothing is reported for it.

Decisions are ``plan.py``'s (pure), status writes and events ``report.py``'s,
runs are the backends' (``backends/``); what a heartbeat advertises is
``advertise.py``'s (pure), a run's workspace and outputs ``run_files.py``'s, runs'
time limits ``time_limits.py``'s; this module is the loop that ties them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from irisfed.services.common import metrics
from irisfed.services.common.bus import from_jetstream, publish
from irisfed.services.common.faults import crash_point
from irisfed.services.common.log import EventLogger
from irisfed.services.common.logstore import LogStore
from irisfed.services.common.runtime import Service, forever, when_woken
from irisfed.services.peer_agent.advertise import LOCAL_KINDS, backend_ads, with_node_totals
from irisfed.services.peer_agent.backends import (
    Backend,
    CommandNotStarted,
    Discovered,
    LaunchError,
    LiveRun,
    LocalNodes,
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
    make_backend,
)
from irisfed.services.peer_agent.logs import LogShipper
from irisfed.services.peer_agent.plan import (
    Pending,
    backend_for,
    choose_starts,
    free_resources,
    free_slots,
    job_gang,
    job_resources,
    merge_noticed,
    plan_leftovers,
    plan_reconcile,
    run_contract,
)
from irisfed.services.peer_agent.report import ReportKind, Reports, Run
from irisfed.services.peer_agent.run_files import RunFiles
from irisfed.services.peer_agent.settings import AgentSettings, BackendSpec
from irisfed.services.peer_agent.time_limits import TimeLimits
from irisfed.services.peer_agent.workspaces import (
    CACHE_FOLDER,
    WorkspaceCache,
    WorkspaceUnusable,
)
from irisfed.shared.cancel import must_kill_run
from irisfed.shared.clock import Clock
from irisfed.shared.config import FederationConfig
from irisfed.shared.errors import Unavailable
from irisfed.shared.lifecycle import JobState
from irisfed.shared.messages import (
    AssignmentNotice,
    BackendAd,
    CancelNotice,
    Heartbeat,
    JobEvent,
    decode_internal,
)
from irisfed.shared.records import AcceptedJob, OwnedJob
from irisfed.shared.users import split_job_id

__all__ = ["AgentSettings", "BackendSpec", "PeerAgent"]

MIB = 1024 * 1024
LOG_PASS_S = 0.25  # how often live runs' output is shipped: a reader following sees it within a second
LOG_MARKS_FOLDER = ".logs-unshipped"  # under the work root: per peer, the runs whose output is not shipped whole

log = EventLogger("peer-agent")
# The most grace a run gets when its agent stops: below what `irisfed up` and the
# harness wait for a stopping service (tooling.federation.STOP_TIMEOUT_S) before SIGKILL.
SHUTDOWN_GRACE_S = 10.0


class PeerAgent(Service):
    """Runs the jobs the federation assigns to one peer."""

    def __init__(self, config: FederationConfig, pool: Any, nc: Client, settings: AgentSettings,
                 clock: Clock | Callable[[], float] | None = None) -> None:
        super().__init__(config, pool, nc, settings, clock)
        self.peer_id = settings.peer_id
        self.run_id = uuid.uuid4().hex
        self.seq = 0
        self._db_shape: list | None = None  # the advertisement last written to Postgres
        # Subprocess and simulated backends keep their configured nodes here (engines report theirs).
        self.local_nodes = {spec.name: LocalNodes(spec.nodes, spec.resources) for spec in settings.backends
                            if spec.kind in LOCAL_KINDS}
        self.specs = tuple(with_node_totals(spec, self.local_nodes.get(spec.name)) for spec in settings.backends)
        self.backends: dict[str, Backend] = {
            spec.name: make_backend(spec.kind, settings.work_root / self.peer_id, settings.simulated_duration_s,
                                    spec.options, self.peer_id, self.local_nodes.get(spec.name))
            for spec in settings.backends}
        self.backend_names = [spec.name for spec in settings.backends]  # the first is the default
        self.slots = {spec.name: spec.slots for spec in settings.backends}
        self.runs: dict[str, Run] = {}
        # What each engine backend last said it has (backends that discover nothing are absent).
        self.discovered: dict[str, Discovered] = {}
        self.pending: dict[str, Pending] = {}
        # Assignment notices heard since the last start; merged into ``pending`` under
        # the lock, so a reconcile in progress never drops one it could not yet see.
        self.noticed: dict[str, Pending] = {}
        self.start_wanted = asyncio.Event()
        # Reconcile and job transitions take this lock so each sees the other's effects.
        self.lock = asyncio.Lock()
        self.reconcile_wanted = asyncio.Event()
        # Runs' time limits, enforced through the one stop path (a stop, not a cancel).
        self.limits = TimeLimits(self.peer_id, self.runs, self.store, self.clock, settings.kill_grace_s,
                                 lambda run: self._kill(run, cancel=False))
        self.reports = Reports(self.store, self.peer_id, nc, self.subjects, self.clock, self.runs, self.lock)
        self.reconciled = 0
        # Workspaces come from the object store, outputs go there (docs/design.md §3.5).
        self.files = RunFiles(nc, self.subjects, self.peer_id, self.store, max_output_bytes=config.max_output_bytes,
                              max_workspace_bytes=config.max_workspace_bytes,
                              retry_pause_s=settings.reconcile_interval_s)
        self.workspaces = WorkspaceCache(
            settings.work_root / CACHE_FOLDER / self.peer_id,
            self.files.fetch_workspace,
            max_bytes=settings.cache_mb * MIB, max_files=config.max_workspace_files,
            max_unpacked_bytes=config.max_workspace_bytes)
        # Each run's output goes into the peer's log stream while it runs (docs/design.md §3.6).
        self.log_shipper = LogShipper(LogStore(nc, self.subjects.prefix, self.peer_id), self.subjects.prefix,
                                      self.peer_id, config.max_log_bytes, interval_s=LOG_PASS_S,
                                      marks=settings.work_root / LOG_MARKS_FOLDER / self.peer_id)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.workspaces.open()
        await self.log_shipper.resume_unshipped()  # runs an earlier agent did not ship whole
        await self.nc.subscribe(self.subjects.assign(self.peer_id), cb=self.on_assign)
        await self.nc.subscribe(self.subjects.cancel_notice(self.peer_id), cb=self.on_cancel)
        await self.nc.flush()
        await self.discover()
        await self.heartbeat()
        await self.reconcile()
        # Of those, the runs not adopted ended while no agent watched: shipped to their end.
        self.log_shipper.end_unless({(run.job_id, run.epoch) for run in self.runs.values()})
        # Discovery asks the engines in a loop of its own: a slow engine never delays a heartbeat.
        self.tasks.spawn(forever("discover", self.discover, self.settings.heartbeat_interval_s),
                         name="agent-discover")
        self.tasks.spawn(forever("heartbeat", self.heartbeat, self.settings.heartbeat_interval_s),
                         name="agent-heartbeat")
        self.tasks.spawn(when_woken("reconcile", self.reconcile, self.reconcile_wanted,
                                    self.settings.reconcile_interval_s), name="agent-reconcile")
        self.tasks.spawn(self.reports.loop(self.settings.report_linger_s, self.settings.reconcile_interval_s,
                                           self.start_wanted.set), name="agent-report")
        self.tasks.spawn(when_woken("start", self._start_noticed, self.start_wanted,
                                    self.settings.reconcile_interval_s), name="agent-start")
        self.tasks.spawn(self.log_shipper.run(self._follow_runs), name="agent-logs")
        log.info("agent_started", peer_id=self.peer_id, run_id=self.run_id,
                 backends=",".join(f"{s.name}:{s.kind}x{s.slots}" for s in self.settings.backends))

    async def close(self) -> None:
        """Stop. Runs in an engine that outlasts us (Slurm, Ray) go on: our next start
        adopts them. Other runs are stopped (a stop under way goes on: no second SIGTERM),
        each with its grace up to SHUTDOWN_GRACE_S, so that all are gone before whoever
        stops us loses patience; their rows stay `running` and our next start hands them
        back (orphan recovery)."""
        await self.tasks.close()
        for backend in self.backends.values():
            if hasattr(backend, "stopping"):  # a subprocess backend: what we stop now records no outcome
                backend.stopping = True
        await asyncio.gather(*(run.handle.kill(min(run.grace_s, SHUTDOWN_GRACE_S)) for run in list(self.runs.values())
                               if run.handle is not None and run.exit_code is None
                               and not self.backends[run.backend].runs_outlive_agent))
        for name, backend in self.backends.items():
            try:
                await backend.close()
            except Exception as exc:  # noqa: BLE001 - stopping the others matters more
                log.warning("backend_close_failed", peer_id=self.peer_id, backend=name, error=repr(exc))

    async def on_reconnect(self) -> None:
        self.reconcile_wanted.set()

    # ------------------------------------------------------------ heartbeat

    async def discover(self) -> None:
        """Ask every engine backend at once what it has now; on failure keep what it said
        last. At once: one hung engine neither delays another's answer nor, at start, the
        first heartbeat beyond two intervals (asked in turn, N hung engines took 2N)."""
        names = list(self.backends)
        answers = await asyncio.gather(*(self._discover_one(name) for name in names))
        for name, found in zip(names, answers, strict=True):
            if found is not None:
                self.discovered[name] = found

    async def _discover_one(self, name: str) -> Discovered | None:
        try:
            return await asyncio.wait_for(self.backends[name].discover(),
                                          timeout=self.settings.heartbeat_interval_s * 2)
        except Exception as exc:  # noqa: BLE001 - an engine away must not stop the agent
            log.warning("discover_failed", peer_id=self.peer_id, backend=name, error=repr(exc))
            return None

    def advertisement(self) -> list[BackendAd]:
        """Each backend's attributes, slots and resources. An engine's own report is the
        truth for its resources (free counts every user's jobs) unless ``--resource``
        configured them; ``--attr`` adds to or overrides discovered attributes."""
        metrics.RUNNING_JOBS.set(len(self.runs))
        free = free_slots(self.slots, self.runs.values(), self.pending.values())
        free_res = free_resources(self.specs, self.runs.values())
        return backend_ads(self.specs, self.discovered, self.backends, self.local_nodes, free, free_res)

    async def heartbeat(self) -> None:
        """Advertise on NATS; write Postgres only when NATS cannot carry it or it changed.

        Ticks write the heartbeats they hear into ``peer_heartbeat`` in one batch per
        interval, so a healthy federation pays about one commit per interval for all
        peers. An agent writes its own row at start, when its shape changes (not its
        free slots, which the tick derives from Postgres), and whenever it is cut off
        from NATS, which keeps a NATS-partitioned peer reachable through Postgres.
        """
        self.seq += 1
        message = Heartbeat(
            peer_id=self.peer_id, seq=self.seq, sent_at=self.clock.now(),
            ttl_s=self.settings.heartbeat_ttl_s, backends=self.advertisement(), run_id=self.run_id,
        )
        if self.nc.is_connected:
            await publish(self.nc, self.subjects.heartbeat(self.peer_id), message)
        shape = [(b.name, b.attributes, b.capacity.total, {k: v.total for k, v in b.resources.items()},
                  b.discovering) for b in message.backends]
        if self.nc.is_connected and shape == self._db_shape:
            return
        await self.store.peer_heartbeat_upsert(
            self.peer_id, self.run_id, self.seq, msgspec.to_builtins(message.backends),
            message.ttl_s, message.sent_at,
        )
        self._db_shape = shape

    # ------------------------------------------------------------ messages

    async def on_assign(self, msg: Msg) -> None:
        notice = self._notice(AssignmentNotice, msg, "assign_notice_ignored")
        if notice is None:
            return
        log.debug("assign_notice", job_id=notice.job_id, peer_id=self.peer_id, epoch=notice.epoch)
        if notice.peer_id != self.peer_id:
            return
        if not notice.backend:  # from a sender that predates the field: read the job first
            self.reconcile_wanted.set()
            return
        # Accepted straight from the notice; the CAS on (state, epoch, owner) in
        # job_start_batch refuses anything stale, and reconcile covers lost notices.
        self.noticed[notice.job_id] = Pending(notice.job_id, notice.epoch,
                                              backend_for(notice.backend, self.backend_names), notice.priority,
                                              max(1, notice.tasks))
        self.start_wanted.set()

    async def on_cancel(self, msg: Msg) -> None:
        notice = self._notice(CancelNotice, msg, "cancel_notice_ignored")
        if notice is None:
            return
        async with self.lock:
            self.pending.pop(notice.job_id, None)
            run = self.runs.get(notice.job_id)
            # The router stores a cancel before it sends the notice.
            if run is not None and run.epoch == notice.epoch and must_kill_run(True, run.cancel_requested):
                self._kill(run, cancel=True)
            elif run is not None and notice.epoch > run.epoch and run.exit_code is None and not run.fenced:
                # The tick moved the job on past this run (preempted): the run is stale,
                # fenced now as reconcile would fence it.
                self._fence(run, f"its epoch moved on to {notice.epoch}")
        self.reconcile_wanted.set()

    @staticmethod
    def _notice(kind: type, msg: Msg, event: str) -> Any:
        """A notice from another service, or None: for JetStream's copy of it (not the
        tick's or the router's own publish), or (logged as ``event``) when it does not
        decode."""
        if from_jetstream(msg):
            return None
        try:
            return decode_internal(kind, msg.data)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the agent
            log.warning(event, error=str(exc))
            return None

    # ------------------------------------------------------------ reconcile

    async def reconcile(self) -> None:
        """Make local runs match what Postgres says this peer owns, then start work."""
        async with self.lock:
            rows = await self.store.job_list_live_for_owner(self.peer_id)
            every_backend_listed = await self._stop_leftovers({row.job_id: row for row in rows})
            plan = plan_reconcile(self.runs, self.pending, rows, self.backend_names)
            for job_id in plan.fence:
                self._fence(self.runs[job_id], "the job is no longer ours under this epoch")
            for job_id in plan.cancel:
                self._kill(self.runs[job_id], cancel=True)
            for job_id in plan.drop_pending:
                del self.pending[job_id]
            self.pending.update((p.job_id, p) for p in plan.add_pending)
            for row in plan.orphans:
                await self._recover_orphan(row)
            if every_backend_listed:
                await self._release_stopped()
            await self._start_pending()
        self.reconciled += 1

    async def _release_stopped(self) -> None:
        """Preempted jobs whose old run here is gone (no run of ours, none left in any
        backend: the leftovers were just killed) may be placed again. One whose run is
        still being killed is released when that run's end is recorded (``record_fenced``)."""
        for job_id in await self.store.job_runs_stopped(self.peer_id, keep=list(self.runs)):
            log.info("preempted_run_stopped", job_id=job_id, peer_id=self.peer_id)

    async def _stop_leftovers(self, owned: dict[str, OwnedJob]) -> bool:
        """Kill every run our backends still have alive that is not ours to run any more
        (``plan_leftovers``), and record it like a fenced copy. False: a backend could not
        list its runs (what it has is unknown until the next reconcile)."""
        listed = {}
        for name, backend in self.backends.items():
            try:
                listed[name] = await backend.list_runs()
            except Exception as exc:  # noqa: BLE001 - the next reconcile looks again
                log.warning("leftover_scan_failed", peer_id=self.peer_id, backend=name, error=repr(exc))
        for leftover in plan_leftovers(self.runs, owned, listed):
            if not await self.backends[leftover.backend].kill_run(leftover.run):
                continue  # ended (or turned out not ours) meanwhile
            log.warning("leftover_run_killed", job_id=leftover.run.job_id, peer_id=self.peer_id,
                        epoch=leftover.run.epoch, backend=leftover.backend, handle=leftover.run.handle,
                        owned_epoch=leftover.owned_epoch)
            await self.reports.record_fenced(leftover.run.job_id, leftover.run.epoch)
        return len(listed) == len(self.backends)

    async def _recover_orphan(self, row: OwnedJob) -> None:
        """A `running` row with no local run: a previous agent run died (or stopped) under it.

        When its engine still knows the run (live, or ended while no agent watched) the
        run is adopted: followed to its end and reported as if we had launched it —
        never launched again. Otherwise any copy left alive is killed and the job ends
        as ``plan.orphan_move`` says. An engine that cannot answer now leaves the row
        alone until the next reconcile: handing back a job whose run may still be
        alive would run it twice.

        A permanent database error sets the job aside (logged, counted) instead of
        stopping the agent; ``Unavailable`` propagates and the next reconcile retries.
        """
        if self.reports.set_aside.get(row.job_id) == row.epoch:
            return  # its write failed for good before: not retried every interval
        name = backend_for(row.backend, self.backend_names)
        backend = self.backends[name]
        try:
            handle = await backend.adopt(LiveRun(row.job_id, row.epoch, ""))
        except Exception as exc:  # noqa: BLE001 - asked again at the next reconcile
            log.warning("adopt_deferred", job_id=row.job_id, peer_id=self.peer_id, epoch=row.epoch,
                        backend=name, error=repr(exc))
            return
        if handle is not None:
            run = Run(row.job_id, row.epoch, name, handle=handle, tasks=row.replicas)
            self.runs[row.job_id] = run
            await self.limits.adopt_contract(run)
            metrics.RUNS_ADOPTED.inc()
            log.warning("run_adopted", job_id=row.job_id, peer_id=self.peer_id, epoch=row.epoch, backend=name)
            self.tasks.spawn(self._finish(run), name=f"run-{row.job_id}")
            if must_kill_run(row.cancel_requested, run.cancel_requested):
                self._kill(run, cancel=True)
            return
        killed = await backend.kill_leftover(row.job_id, row.epoch)
        await self.reports.recover_orphan(row, leftover_killed=killed)

    # ------------------------------------------------------------ starting

    async def _start_noticed(self) -> None:
        async with self.lock:
            await self._start_pending()

    async def _start_pending(self) -> None:
        """Accept as many pending jobs as there are free slots: one statement for all."""
        noticed, self.noticed = self.noticed, {}
        self.pending = merge_noticed(self.pending, noticed, self.runs)
        chosen = choose_starts(self.pending, self.runs.values(), self.slots)
        if not chosen:
            return
        for pending in chosen:
            del self.pending[pending.job_id]
        # A gang is running only once all its tasks run: launched while still assigned,
        # accepted when they do (_finish). Its spec comes from its row, as an acceptance's would.
        gangs = [p for p in chosen if p.tasks > 1]
        singles = [p for p in chosen if p.tasks == 1]
        # One statement (job, changelog, sync state): atomic without BEGIN/COMMIT round trips.
        accepted = await self.store.job_start_batch(self.peer_id, [
            (p.job_id, p.epoch, self.backends[p.backend].log_dir(p.job_id, p.epoch),
             f"running on {self.peer_id}/{p.backend}") for p in singles]) if singles else {}
        specs = await self.store.job_list_assigned_specs(
            self.peer_id, [(p.job_id, p.epoch) for p in gangs]) if gangs else {}
        crash_point("agent_after_accept")
        now = self.clock.now()
        started = []
        # Committed: every accepted job is launched first, whatever NATS does next.
        for pending in chosen:
            row = (specs if pending.tasks > 1 else accepted).get(pending.job_id)
            if row is None:
                log.info("accept_lost", job_id=pending.job_id, peer_id=self.peer_id, epoch=pending.epoch)
                continue
            run = await self._launch(pending, row, accepted_already=pending.tasks == 1)
            if run.accepted:
                started.append(run)
        # Then the events, best effort (announce logs a failed publish): Postgres
        # already holds the truth, and NATS gone mid-batch must not strand the rest.
        for run in started:
            await self.reports.announce(JobEvent(
                run.job_id, JobState.RUNNING, self.peer_id, run.epoch, now,
                reason=f"running on {self.peer_id}/{run.backend}"))

    async def _launch(self, pending: Pending, accepted: AcceptedJob, accepted_already: bool = True) -> Run:
        """Start a job on the backend its row names (the row decides, not the notice):
        accepted already, or (a gang) to be accepted once all its tasks run. A job with
        a workspace starts in its own task, once the workspace is here (fetching it
        never holds up the other starts)."""
        job_id, epoch, spec = pending.job_id, pending.epoch, accepted.spec
        replicas, group_by = job_gang(spec)
        grace_s, time_limit_s = run_contract(spec, self.settings.kill_grace_s)
        run = Run(job_id, epoch, backend_for(accepted.backend, self.backend_names),
                  resources=job_resources(spec), tasks=replicas, accepted=accepted_already,
                  grace_s=grace_s, time_limit_s=time_limit_s)
        self.runs[job_id] = run
        self.log_shipper.follow(job_id, epoch, replicas, self._log_dir(run), fresh=True)  # nothing shipped yet
        run_spec = RunSpec(job_id, epoch, list(spec["command"]), dict(spec.get("env", {})),
                           dict(spec.get("labels", {})), dict(run.resources), replicas, group_by,
                           self.settings.gang_start_timeout_s, grace_s=grace_s, time_limit_s=time_limit_s)
        workspace = (spec.get("workspace") or {}).get("digest")
        if workspace is None:
            await self._start_run(run, run_spec)
            self.tasks.spawn(self._finish(run), name=f"run-{job_id}")
        else:
            self.tasks.spawn(self._run_in_workspace(run, run_spec, workspace), name=f"run-{job_id}")
        return run

    async def _start_run(self, run: Run, run_spec: RunSpec) -> None:
        try:
            run.handle = await self.backends[run.backend].launch(run_spec)
        except CommandNotStarted as exc:  # the job's own failure: not retried (docs/design.md §3.7)
            run.launch_error, run.refused, run.exit_code = str(exc), True, -1
            log.warning("command_not_started", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                        error=str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure to start is a launch error
            run.launch_error = str(exc) if isinstance(exc, LaunchError) else repr(exc)
            run.exit_code = -1
            log.warning("launch_failed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch, error=str(exc))
        else:
            if run.accepted:
                self.limits.arm(run)
        log.debug("job_started", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch)

    async def _run_in_workspace(self, run: Run, run_spec: RunSpec, digest: str) -> None:
        """Fetch (or find cached) the job's workspace, then start and follow the run in
        fresh copies of it. A workspace unusable for good fails the job (not retried);
        a store that cannot answer now, or a peer disk that cannot take it, is a launch
        error (handed back while retries remain). A run cancelled or fenced meanwhile is
        never started; one cancelled or fenced while it was being started is stopped at
        once. Whatever happens, the run's end is reported (``_finish``). A single run is
        copied by the time it is launched, so the cache may evict the tree then; a gang's
        tasks copy it as each starts, so a gang holds it until its end."""
        user = split_job_id(run.job_id)[0]
        held = False
        try:
            try:
                path = await self.workspaces.acquire(digest, user, (run.job_id, run.epoch))
            except WorkspaceUnusable as exc:
                run.launch_error, run.refused, run.exit_code = str(exc), True, -1
                log.warning("workspace_unusable", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            why=str(exc))
            else:
                try:
                    if run.fenced or run.cancel_requested:
                        run.launch_error, run.exit_code = "stopped before it started", -1
                    else:
                        await self._start_run(run, dataclasses.replace(run_spec, workspace=path))
                        if run.handle is not None and (run.fenced or run.cancel_requested):
                            self._kill(run, cancel=run.cancel_requested)  # asked while it was starting
                finally:
                    held = run_spec.replicas > 1 and run.handle is not None
                    if not held:
                        self.workspaces.release(digest, user)  # copied by now: the cache may evict it
        except Exception as exc:  # noqa: BLE001 - the store away, the peer's disk full: retried elsewhere
            run.launch_error, run.exit_code = f"workspace {digest}: {exc}", -1
            log.warning("workspace_fetch_failed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                        error=repr(exc))
        try:
            await self._finish(run)
        finally:
            if held:
                self.workspaces.release(digest, user)

    async def _accept_gang(self, run: Run) -> None:
        """A gang's tasks all run: now its job is running (CAS on its assigned row, as any
        acceptance), and where its tasks run is recorded. Refused (the job moved on while
        its tasks started: cancelled, preempted, taken back), the run is fenced. Under the
        agent's lock, so a reconcile sees the row and the run's ``accepted`` agree."""
        while True:
            async with self.lock:
                outcome = await self._try_accept(run)
            if outcome is not None:
                break
            await asyncio.sleep(self.settings.reconcile_interval_s)  # Postgres away: ask again
        if outcome:
            try:
                await self.reports.guard(ReportKind.TASKS, run.job_id, run.epoch, self.reports.record_tasks([run]))
            except Unavailable as exc:
                # The gang runs on: where its tasks run is written with its end (report).
                log.warning("tasks_not_recorded", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            error=str(exc))
            await self.reports.announce(JobEvent(
                run.job_id, JobState.RUNNING, self.peer_id, run.epoch, self.clock.now(),
                reason=f"running on {self.peer_id}/{run.backend}: {run.tasks} tasks"))

    async def _try_accept(self, run: Run) -> bool | None:
        """One try of ``_accept_gang`` (the lock held): True accepted, False refused (the run
        fenced), None: Postgres did not answer (whether an earlier try committed, its row
        says next time)."""
        if run.fenced or run.exit_code is not None:
            return False
        try:
            row = await self.store.job_get(run.job_id)
            if row is not None and (row.state, row.epoch, row.owner_peer_id) == (
                    JobState.RUNNING, run.epoch, self.peer_id):
                accepted = True  # an earlier try committed
            elif row is not None and (row.state, row.epoch, row.owner_peer_id) == (
                    JobState.ASSIGNED, run.epoch, self.peer_id):
                accepted = run.job_id in await self.store.job_start_batch(self.peer_id, [(
                    run.job_id, run.epoch, self.backends[run.backend].log_dir(run.job_id, run.epoch),
                    f"running on {self.peer_id}/{run.backend}: {run.tasks} tasks")])
            else:
                accepted = False
        except Unavailable:
            return None
        if accepted:
            run.accepted = True
            self.limits.arm(run)  # a gang's running time starts when all its tasks run
        else:
            self._fence(run, "its tasks started after the job moved on")
        return accepted

    async def _finish(self, run: Run) -> None:
        if run.handle is not None:
            try:
                try:
                    if run.accepted:
                        run.exit_code = await run.handle.wait()
                    else:
                        run.exit_code = await self._accepted_when_started(run)
                finally:
                    if run.limit_timer is not None:
                        run.limit_timer.cancel()
            except CommandNotStarted as exc:  # a gang task's command: the job's own failure, not retried
                run.launch_error, run.refused, run.exit_code = str(exc), True, -1
                log.warning("command_not_started", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            error=str(exc))
            except RunLost as exc:  # the engine's fault, not the job's: handed back like a launch error
                run.launch_error, run.lost, run.exit_code = str(exc), True, -1
                log.warning("run_lost", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch, error=str(exc))
            except RunOutcomeUnknown as exc:  # it may have done its work: failed, never run again
                run.launch_error, run.outcome_unknown, run.exit_code = str(exc), True, -1
                log.warning("run_outcome_unknown", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            error=str(exc))
            except Exception as exc:  # noqa: BLE001 - not followed any more: found again by reconcile
                # The run may still be alive in its engine: forget it here so the next
                # reconcile finds the row without a run and adopts it again.
                log.warning("run_unfollowed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                            error=repr(exc))
                async with self.lock:
                    if self.runs.get(run.job_id) is run:
                        del self.runs[run.job_id]
                self.reconcile_wanted.set()
                return
            if not run.fenced:
                await self.files.store_outputs(run, self.backends[run.backend])  # the workspace copies go after
        # Its output to its end and the end message, before its end is reported (NATS away:
        # shipped later by the pass loop); a run never started ends with nothing shipped.
        await self.log_shipper.finish(run.job_id, run.epoch, run.tasks, self._log_dir(run))
        # Fenced, never launched or failing mid-launch too:
        await self.files.remove_copies(run, self.backends.get(run.backend))
        self.reports.finished.put_nowait(run)

    def _follow_runs(self) -> None:
        """Before each shipping pass: every run started here (adopted ones too) is followed."""
        for run in list(self.runs.values()):
            if run.handle is not None and not self.log_shipper.follows(run.job_id, run.epoch):
                self.log_shipper.follow(run.job_id, run.epoch, run.tasks, self._log_dir(run))

    def _log_dir(self, run: Run) -> str | None:
        backend = self.backends.get(run.backend)
        return backend.log_dir(run.job_id, run.epoch) if backend is not None else None

    async def _accepted_when_started(self, run: Run) -> int:
        """Follow a gang launched before its acceptance to its end (its exit code, or what
        ``wait`` raises), accepting it as soon as all its tasks run — before its end is
        reported: the end of a job never accepted would be refused."""
        ended = asyncio.ensure_future(run.handle.wait())  # wait() runs the gang: called once
        started = asyncio.ensure_future(run.handle.started.wait())
        try:
            await asyncio.wait({started, ended}, return_when=asyncio.FIRST_COMPLETED)
            if run.handle.started.is_set():
                await self._accept_gang(run)
            return await ended
        finally:
            started.cancel()
            if not ended.done():  # cancelled (the agent stops): the run goes on or is killed by close()
                ended.cancel()

    # ------------------------------------------------------------ stopping runs

    # One stop path for every reason (docs/design.md §3.7): SIGTERM, SIGKILL after the job's grace.

    # Once per run: a second SIGTERM would interrupt the job's own handler mid-checkpoint.

    def _kill(self, run: Run, cancel: bool) -> None:
        run.cancel_requested = run.cancel_requested or cancel
        self._stop(run, "kill")

    def _fence(self, run: Run, why: str) -> None:
        if not run.fenced:
            log.warning("fencing_local_copy", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch, why=why)
        run.fenced = True
        self._stop(run, "fence")

    def _stop(self, run: Run, why: str) -> None:
        if run.handle is not None and not run.stopping:
            run.stopping = True
            self.tasks.spawn(self._stopped(run), name=f"{why}-{run.job_id}")

    async def _stopped(self, run: Run) -> None:
        """Stop ``run``; a stop that failed, or left it alive (an engine that did not end it
        within its grace), may be asked again by the next reconcile."""
        try:
            await run.handle.kill(run.grace_s)
        except Exception as exc:  # noqa: BLE001 - the engine away: the next reconcile asks again
            log.warning("stop_failed", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch, error=repr(exc))
        finally:
            if run.exit_code is None:
                run.stopping = False
