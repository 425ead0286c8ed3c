"""One seeded chaos schedule: its own database and subject prefix, producers and
faults in turns, then convergence and the checks."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import nats

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.shared.errors import ErrorCode
from irisfed.shared.lifecycle import CancelOutcome
from irisfed.tooling.chaos.checks import check_logs, check_runs, converge_and_check
from irisfed.tooling.chaos.faults import ACTIONS, Faults, quiet
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import job_body
from irisfed.tooling.chaos.world import (
    PEERS,
    REQUEST_TIMEOUT_S,
    SERVICES,
    ChaosFederation,
    Servers,
    config_text,
)
from irisfed.tooling.federation import login_role_urls


class Schedule:
    """One seeded schedule: faults, then convergence, then the invariant checks."""

    def __init__(self, servers: Servers, folder: Path, index: int, seed: int, steps: int,
                 template: str, say: Callable[[str], None], passwords: dict[str, str] | None = None) -> None:
        self.servers = servers
        self.passwords = passwords or {}  # login role → password: restricted-roles mode
        self.folder = folder
        self.index = index
        self.rng = random.Random(seed * 100_003 + index)
        self.steps = steps
        self.template = template
        self.say = say
        self.result = ScheduleResult(index, log_dir=str(folder))
        self.acked: dict[str, dict] = {}  # job_id → first successful reply
        self.never_started: set[str] = set()
        self.run_log = folder / "runs.log"
        self.watcher = RunWatcher(self.run_log, folder / "work")

    async def run(self) -> ScheduleResult:
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            self.result.phases.append((name, now - mark))
            mark = now

        prefix = f"c{self.index}x{self.rng.randrange(1 << 30):x}"
        dbname = f"chaos_{self.index}_{os.getpid()}"
        await self.servers.admin(f'DROP DATABASE IF EXISTS "{dbname}"')
        await self.servers.admin(f'CREATE DATABASE "{dbname}" TEMPLATE "{self.template}"')
        database_url = self.servers.database_url(dbname)
        (self.folder / "federation.toml").write_text(config_text(prefix))
        self.fed = ChaosFederation(self.folder, self._db_urls(database_url), self.servers.nats.url,
                                   self.servers.auth)
        phase("database")
        self.watcher.start()
        for name in SERVICES:
            self.fed.start(name)
        # As a producer would: its own user, so its own inbox prefix (_INBOX_producer).
        self.nc = await connect_client(self.servers.auth.url(self.servers.nats.url, "producer"),
                                       max_reconnect_attempts=-1,
                                       reconnect_time_wait=0.2, error_cb=quiet)
        self.prefix = prefix
        self.faults = Faults(self.rng, self.result, self.fed, self.servers, self.watcher, prefix, self.submit)
        try:
            await self._wait_ready(database_url)
            await self.faults.listen_to_heartbeats()
            phase("ready")
            for _ in range(self.steps):
                action = await self.step()
                phase(f"step:{action}")
                self._restart_exited()
                self.faults.mend_due()
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
                phase("gap")
            await self.faults.mend_all()
            await converge_and_check(database_url, self.result, self.acked, self.never_started, self.fed.down,
                                     self._restart_exited)
            phase("converge+checks")
        finally:
            await self.faults.close()
            await self.nc.close()
            self.result.violations.extend(self.fed.reap())
            self.fed.close()
            phase("stop")
            check_runs(self.watcher, self.result)
            check_logs(self.folder, self.result)
        return self.result

    async def step(self) -> str:
        """Producers submit or cancel, or one fault is injected (drawn by weight); which."""
        rng = self.rng
        action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        if action == "submit" or not self.acked and action == "cancel":
            # Producers in parallel (each retrying on its own); drawn in order, so seeded.
            bodies = [self._new_job() for _ in range(rng.randint(1, 4))]
            await asyncio.gather(*(self._send(body) for body in bodies))
        elif action == "cancel":
            await self._cancel(rng.choice(sorted(self.acked)))
        else:
            await self.faults.inject(action)
        return action

    def _restart_exited(self) -> None:
        # Like a supervisor (restart: unless-stopped), start again what exited by
        # itself, and report it: services are meant to ride out every fault here.
        for exited in self.fed.reap():
            self.result.violations.append(exited)
            self.fed.start(exited.split()[0])

    def _db_urls(self, database_url: str) -> dict[str, str]:
        """The Postgres URL of each service: the owner's, or its own login role's."""
        if not self.passwords:
            return {name: database_url for name in SERVICES}
        return login_role_urls(database_url, PEERS, self.passwords)

    async def _wait_ready(self, database_url: str) -> None:
        deadline = time.monotonic() + 60
        pool = await dbmod.connect(database_url, max_size=1)
        try:
            while time.monotonic() < deadline:
                rows = await Store(pool).peer_heartbeat_list()
                if len([r for r in rows if r.reachable]) == len(PEERS):
                    if await self._request("cancel", {"job_id": "ready-probe"}) is not None:
                        return
                await asyncio.sleep(0.1)
        finally:
            await pool.close()
        raise RuntimeError("the federation did not come up")

    # ------------------------------------------------------------ the producer

    async def _request(self, verb: str, body: dict) -> dict | None:
        try:
            reply = await self.nc.request(f"{self.prefix}.{verb}", json.dumps(body).encode(),
                                          timeout=REQUEST_TIMEOUT_S)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError):
            return None
        return json.loads(reply.data)

    async def submit(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0) -> None:
        await self._send(self._new_job(kind, pin, min_s))

    def _new_job(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0) -> dict:
        self.result.jobs += 1
        job_id = f"s{self.index}-j{self.result.jobs}-{self.rng.randrange(1 << 20):x}"
        return job_body(self.rng, job_id, self.run_log, kind, pin, min_s)

    async def _send(self, body: dict) -> None:
        job_id = body["job_id"]
        for _ in range(3):  # producers retry with the same job_id: idempotent
            reply = await self._request("submit", body)
            if reply is None or reply.get("error", {}).get("code") == ErrorCode.UNAVAILABLE:
                await asyncio.sleep(0.2)
                continue
            if "error" in reply:
                self.result.violations.append(f"{job_id}: unexpected error {reply['error']}")
            else:
                self.acked.setdefault(job_id, reply)
            break

    async def _cancel(self, job_id: str) -> None:
        reply = await self._request("cancel", {"job_id": job_id})
        if reply and reply.get("outcome") == CancelOutcome.NEVER_STARTED:
            self.never_started.add(job_id)
