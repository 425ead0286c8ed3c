"""After the faults: wait for every acknowledged job to end, then check the invariants
(docs/design.md §6), the double-run rule and the services' logs.

Users (invariants 9 and 10): every job belongs to the user whose subject sent it and
is one that user sent (so one job_id from two users is two jobs), a cancel from a
user whose job it was not left the job alone, a stored cancel names the job's own
user or an operator; and replaying the changelog in ``seq`` order, no user's live
jobs ever held more than its quota (tooling/invariants.py).

Preemption (invariant 11, ``preemption_violations``): every ``preempted by J`` row
preempts a strictly lower band, never production, and is followed in its
transaction by J's placement on the victim's own peer naming exactly the victims
preempted for it; none of them could have been spared; the victim's epoch moved by
one, no write of its old run follows, and it is queued again (or failed past its
``max_preemptions``, killed when a cancel was stored), never lost; ``jobs.preemptions``
counts its preemptions.

Dependencies (invariant 16, ``dependency_violations``): replaying the changelog in
``seq`` order, no dependent went live before each of its dependencies' terminal rows,
and each of those ends met its condition; a dependency that ended breaking its
condition ended its (still waiting) dependent ``unschedulable``, and nothing ended
``unschedulable`` for a dependency that had not; no job is left queued with every
dependency ended, and a queued job's ``deps_pending`` counts exactly those not ended.

Arrays (§3.8, ``array_violations``): every array has exactly its ``size`` elements
``<id>_0`` .. ``<id>_<size-1>``; replaying the changelog in ``seq`` order, never more of
its elements live (assigned or running first seen, terminal row not yet) than its
``array_parallel``; and none of them is left queued and held while a slot is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.shared.users import quota_units
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import SENT_BY_LABEL
from irisfed.tooling.chaos.world import CONVERGE_TIMEOUT_S, DOWN_SLACK_S, HEARTBEAT_TTL_S
from irisfed.tooling.invariants import (
    advertised_resources,
    array_replay_violations,
    banded_jobs,
    changelog_violations,
    dependency_replay_violations,
    gang_replay_violations,
    identity_violations,
    job_holdings,
    job_identities,
    noded_peers,
    peak_live_usage,
    preemption_history,
    preemption_violations,
    preemptor_of,
    quota_violations,
)

# Agent → [[killed, restarted or None], ...] (time.time()), as ChaosFederation.down.
Outages = Mapping[str, list[list[float | None]]]
# User → resource → the most its live jobs may hold (as configured; ``slots``: jobs).
Quotas = Mapping[str, Mapping[str, int | float]]


@dataclass
class Ledger:
    """What a schedule's users sent, for the identity checks (invariant 9)."""

    sent: set[tuple[str, str]] = field(default_factory=set)  # (user, job_id) of every submit sent
    owner_of: dict[str, tuple[str, str]] = field(default_factory=dict)  # acknowledged: stored id → (user, job_id)
    foreign_cancels: list[tuple[str, str]] = field(default_factory=list)  # (asker, stored id of another's job)
    own_cancels: set[str] = field(default_factory=set)  # stored ids their own user asked to cancel
    forged: int = 0  # bodies naming a user, sent to be refused

    def shared_ids(self) -> int:
        """Job ids that two or more users sent (each user's its own job)."""
        users: dict[str, int] = {}
        for _, job_id in self.sent:
            users[job_id] = users.get(job_id, 0) + 1
        return sum(1 for n in users.values() if n > 1)


async def converge_and_check(database_url: str, result: ScheduleResult, acked: Mapping[str, dict],
                             never_started: set[str], outages: Outages,
                             restart_exited: Callable[[], None], ledger: Ledger | None = None,
                             quotas: Quotas | None = None) -> None:
    """Wait (up to CONVERGE_TIMEOUT_S) for every acknowledged job to end, restarting any
    service that exits meanwhile; then record in ``result`` every invariant broken.
    ``acked`` and ``never_started`` hold stored job ids (``alice:x``)."""
    pool = await dbmod.with_retry(lambda: dbmod.connect(database_url, max_size=2), attempts=50)
    store = Store(pool)
    try:
        began = time.monotonic()
        deadline = began + CONVERGE_TIMEOUT_S
        while True:
            rows = {r.job_id: r for r in await store.job_list_states()}
            open_jobs = [j for j in acked if j not in rows or rows[j].state not in TERMINAL_STATES]
            if not open_jobs or time.monotonic() > deadline:
                result.converge_s = time.monotonic() - began
                break
            restart_exited()
            await asyncio.sleep(0.05)  # each poll is one small query; a coarser one only idles
        violations = result.violations
        for job_id, reply in acked.items():
            row = rows.get(job_id)
            if row is None:
                violations.append(f"{job_id}: acknowledged ({reply['disposition']}) but not in Postgres")
            elif row.state not in TERMINAL_STATES:
                job = await store.job_get(job_id)
                violations.append(f"{job_id}: still {row.state} after convergence ({job.reason})")
        for job_id in never_started:
            job = await store.job_get(job_id)
            if job.started_at is not None:
                violations.append(f"{job_id}: cancel said never_started but it started")
        violations.extend(await changelog_violations(store))
        violations.extend(await placed_on_dead_agents(pool, outages))
        history = await preemption_history(pool)
        violations.extend(preemption_violations(history, await banded_jobs(pool), await advertised_resources(pool),
                                                await noded_peers(pool)))
        result.preempted = Counter(str(r.to_state) for r in history if preemptor_of(r) is not None)
        gangs, result.gang_runs = await gang_replay_violations(pool)
        violations.extend(gangs)
        result.gangs_requeued = await pool.fetchval(
            "SELECT count(*) FROM (SELECT job_id FROM job_tasks GROUP BY job_id HAVING count(DISTINCT epoch) > 1) g")
        dependencies, counts = await dependency_replay_violations(pool)
        violations.extend(dependencies)
        result.dependency_edges, result.dependents_started = counts.edges, counts.started
        result.dependents_unschedulable = counts.unschedulable
        arrays, array_counts = await array_replay_violations(pool)
        violations.extend(arrays)
        result.array_elements, result.array_peaks = array_counts.elements, list(array_counts.peaks)
        if ledger is not None:
            identities = await job_identities(pool, SENT_BY_LABEL)
            violations.extend(identity_violations(identities, ledger.sent, ledger.foreign_cancels,
                                                  ledger.own_cancels))
            result.shared_ids = ledger.shared_ids()
            result.foreign_cancels = len(ledger.foreign_cancels)
        if quotas:
            changelog, holdings = await store.changelog_list_all(), await job_holdings(pool)
            violations.extend(quota_violations(changelog, holdings, quotas))
            result.quotas_reached = quotas_reached(peak_live_usage(changelog, holdings), quotas)
    finally:
        await pool.close()


async def placed_on_dead_agents(pool: asyncpg.Pool, outages: Outages) -> list[str]:
    """Unpinned jobs the tick placed on a peer whose agent was dead for over a TTL.

    A heartbeat sent just before the kill keeps the peer reachable for its TTL
    (plus DOWN_SLACK_S for heartbeats the tick writes to Postgres a moment after
    hearing them); after that, only a forged or replayed heartbeat could make
    the peer look alive until its agent is started again.
    """
    rows = await pool.fetch(
        "SELECT c.job_id, c.peer_id, extract(epoch FROM c.at)::float8 AS at "
        "FROM federation_changelog c JOIN jobs j USING (job_id) "
        "WHERE c.to_state = 'assigned' AND c.actor = 'tick' AND j.pinned_peer_id IS NULL")
    problems = []
    for row in rows:
        for killed, restarted in outages.get(row["peer_id"], []):
            if killed + HEARTBEAT_TTL_S + DOWN_SLACK_S < row["at"] < (restarted or float("inf")):
                problems.append(f"{row['job_id']}: placed on {row['peer_id']} "
                                f"{row['at'] - killed:.1f}s after its agent was killed "
                                f"(TTL {HEARTBEAT_TTL_S:g}s) and before it was started again")
    return problems


def quotas_reached(peaks: Mapping[str, Mapping[str, int]], quotas: Quotas) -> list[str]:
    """``user:resource`` of each quota some moment's live jobs filled (the workload hit it)."""
    return [f"{user}:{name}" for user, quota in sorted(quotas.items()) for name, amount in sorted(quota.items())
            if peaks.get(user, {}).get(name, 0) >= quota_units(name, amount)]


def check_runs(watcher: RunWatcher, result: ScheduleResult, workspaces: dict[str, str] | None = None) -> None:
    """Stop watching processes; kill (by pid) any job process a killed agent left; judge
    overlaps, and (``workspaces``: stored job id → its workspace token) invariant 14."""
    watcher.stop()
    for pid in watcher.live_pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # JOB_SCRIPT's shell leads its own session
    problems, fenced = watcher.violations()
    result.violations.extend(problems)
    result.fenced_overlaps = fenced
    result.runs = len(watcher.runs)
    if workspaces is not None:
        problems, result.workspace_runs = watcher.workspace_violations(workspaces)
        result.violations.extend(problems)


def nats_log_size(log_path: Path) -> int:
    """Where the NATS server's log ends now (0: none yet): a schedule reads on from here."""
    try:
        return log_path.stat().st_size
    except OSError:
        return 0


def check_nats_permissions(log_path: Path, offset: int, result: ScheduleResult) -> None:
    """Every publish or subscribe the NATS server refused since ``offset``: no client here
    is meant to be refused (the rogue lies only on subjects its credentials allow), so a
    service whose role lacks a subject it uses (a notice never delivered) is a finding."""
    if nats_log_size(log_path) < offset:  # started afresh: read it all
        offset = 0
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return
    refused = [line for line in text.splitlines() if "Violation" in line]
    for line in refused[:5]:
        result.violations.append(f"nats refused a client: {line[line.find(' - ') + 3:][:300]}")
    if len(refused) > 5:
        result.violations.append(f"nats refused {len(refused) - 5} more (see {log_path})")


def check_logs(folder: Path, result: ScheduleResult) -> None:
    """A background task that died is a bug by the services' own rule: report each."""
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"event":"task_died"' in line.replace(" ", ""):
                result.violations.append(f"{log.stem}: a task died: {line[:300]}")
