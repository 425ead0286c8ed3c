"""After the faults: wait for every acknowledged job to end, then check the invariants
(docs/design.md §6), the double-run rule and the services' logs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.world import CONVERGE_TIMEOUT_S, DOWN_SLACK_S, HEARTBEAT_TTL_S
from irisfed.tooling.invariants import changelog_violations

# Agent → [[killed, restarted or None], ...] (time.time()), as ChaosFederation.down.
Outages = Mapping[str, list[list[float | None]]]


async def converge_and_check(database_url: str, result: ScheduleResult, acked: Mapping[str, dict],
                             never_started: set[str], outages: Outages,
                             restart_exited: Callable[[], None]) -> None:
    """Wait (up to CONVERGE_TIMEOUT_S) for every acknowledged job to end, restarting any
    service that exits meanwhile; then record in ``result`` every invariant broken."""
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


def check_runs(watcher: RunWatcher, result: ScheduleResult) -> None:
    """Stop watching processes; kill (by pid) any job process a killed agent left; judge overlaps."""
    watcher.stop()
    for pid in watcher.live_pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # JOB_SCRIPT's shell leads its own session
    problems, fenced = watcher.violations()
    result.violations.extend(problems)
    result.fenced_overlaps = fenced
    result.runs = len(watcher.runs)


def check_logs(folder: Path, result: ScheduleResult) -> None:
    """A background task that died is a bug by the services' own rule: report each."""
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"event":"task_died"' in line.replace(" ", ""):
                result.violations.append(f"{log.stem}: a task died: {line[:300]}")
