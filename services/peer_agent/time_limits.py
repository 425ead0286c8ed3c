"""Runs' time limits on a peer (docs/design.md §3.7): armed, and enforced through the agent's stop.

A job's run contract (``time_limit_s``, ``grace_s``: plan.py's ``run_contract``) travels
with its spec. A run's limit is armed when its running time starts: at acceptance (a
gang's once all its tasks run); an adopted run (an earlier agent launched it) gets its
job's grace and limit back from its row, its limit counted from its recorded start.
Once the limit is up the run is stopped through the agent's one stop path (SIGTERM,
SIGKILL after the grace), marked as stopped for its time limit — unless it ended, was
fenced or cancelled, or is no longer the agent's run first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from irisfed.services.common.log import EventLogger
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.plan import run_contract, time_limit_reason
from irisfed.services.peer_agent.report import Run
from irisfed.shared.clock import Clock
from irisfed.shared.errors import Unavailable

log = EventLogger("peer-agent")


class TimeLimits:
    """The time limits of one agent's runs (``runs``: the agent's own, by job id); ``stop``
    is the agent's stop of a run (not a cancel)."""

    def __init__(self, peer_id: str, runs: Mapping[str, Run], store: Store, clock: Clock,
                 default_grace_s: float, stop: Callable[[Run], None]) -> None:
        self.peer_id = peer_id
        self.runs = runs
        self.store = store
        self.clock = clock
        self.default_grace_s = default_grace_s  # an adopted run's whose row says none
        self._stop = stop

    def arm(self, run: Run, ran_s: float = 0.0) -> None:
        """Stop ``run`` once it has run its job's time limit (``ran_s`` of it already: an
        adopted run's), unless it ended or was stopped for another reason first."""
        if run.time_limit_s is None or run.limit_timer is not None:
            return
        run.limit_timer = asyncio.get_running_loop().call_later(
            max(0.0, run.time_limit_s - ran_s), self._time_up, run)

    def _time_up(self, run: Run) -> None:
        if run.exit_code is not None or run.fenced or run.cancel_requested or self.runs.get(run.job_id) is not run:
            return
        run.stopped_for = time_limit_reason(run.time_limit_s)
        log.info("time_limit_reached", job_id=run.job_id, peer_id=self.peer_id, epoch=run.epoch,
                 time_limit_s=run.time_limit_s, grace_s=run.grace_s)
        self._stop(run)

    async def adopt_contract(self, run: Run) -> None:
        """An adopted run keeps its job's grace and time limit (counted from its start)."""
        try:
            job = await self.store.job_get(run.job_id)
        except Unavailable:
            return  # its grace falls back to the agent's; no limit enforced by us this time
        if job is None:
            return
        run.grace_s, run.time_limit_s = run_contract(job.spec, self.default_grace_s)
        ran = (self.clock.now() - job.started_at).total_seconds() if job.started_at is not None else 0.0
        self.arm(run, ran_s=max(0.0, ran))
