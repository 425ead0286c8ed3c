"""One seeded chaos schedule: its own database and subject prefix, producers and
faults in turns, then convergence and the checks.

The producers are the federation's users (world.SUBMITTERS): ``default`` on v1's
subjects with the ``producer`` NATS user, every configured user on its own subjects
with its own NATS user. A new job sometimes reuses a job_id another user already
sent (two users, two jobs); quota users sometimes send a burst bigger than their
quota; some cancels come from a user whose job it is not (the answer must be
``not_found``, the job untouched); and now and then a body names a user (it must be
refused: identity comes from the subject alone). The :class:`Ledger` keeps what was
sent, for the identity checks.

Bands (§3.3): every job draws its band (workload.draw_band). A ``squeeze`` step fills
the peers of one kind of work with batch jobs, then sends that kind of work of a
higher band (interactive, or production from a user allowed it): it finds no room
and preempts. Now and then a user sends a band above its ``max_band``: it must be
answered ``forbidden`` and write nothing.

Pipelines (§3.8): one step of every schedule, and some submit steps, also send one
user's chain of jobs waiting for each other (workload.pipeline_edges), each sent once
what it waits for is acknowledged (a job whose dependency never was is not sent);
invariant 16 is checked from the changelog at the end (checks, ``dependency_violations``).

Arrays (§3.8): one step of every schedule, and some submit steps, also send one user's
array (workload.array_body): now and then after a job sent just before it, now and then
followed by a job ``after`` its base id, and now and then cancelled by its base id a
moment later. Each element is acknowledged with the array (its stored id waited for and
checked like any job's); at the end no array had more than its limit live at once and
none was left with an element stranded (checks, ``array_violations``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.nats_auth import user_role
from irisfed.services.common.objects import ensure_buckets
from irisfed.services.common.store import Store
from irisfed.shared.bands import BATCH, INTERACTIVE, PRODUCTION, band_rank
from irisfed.shared.errors import ErrorCode
from irisfed.shared.lifecycle import CancelOutcome
from irisfed.shared.resources import as_resources
from irisfed.shared.users import DEFAULT_USER, over_whole_quota, stored_job_id
from irisfed.tooling.chaos.checks import (
    Ledger,
    check_logs,
    check_nats_permissions,
    check_runs,
    converge_and_check,
    nats_log_size,
)
from irisfed.tooling.chaos.faults import Faults, actions_for, quiet
from irisfed.tooling.chaos.logs_check import check_shipped_logs
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import (
    ARRAY_KINDS,
    ARRAY_MIN_S,
    ARRAY_PARALLEL,
    ARRAY_SIZES,
    EARLIER_P,
    PIPELINE_FAILS_P,
    PIPELINE_HEAD_FAILS_P,
    PIPELINE_LENGTHS,
    WHENS,
    WORKSPACE_P,
    WORKSPACE_TOKEN,
    array_body,
    array_exit_codes,
    draw_band,
    job_body,
    pipeline_edges,
)
from irisfed.tooling.chaos.world import (
    MAX_BAND,
    PEERS,
    QUOTAS,
    REQUEST_TIMEOUT_S,
    SERVICES,
    SLOTS_PER_PEER,
    SUBMITTERS,
    ChaosFederation,
    Servers,
    chaos_config,
    config_text,
)
from irisfed.tooling.federation import login_role_urls
from irisfed.transfer import store_workspace

SHARED_ID_P = 0.25  # a new job takes a job_id another user already sent
BURST_P = 0.35  # a submit step is one quota user's burst of 3-4 jobs
FOREIGN_CANCEL_P = 0.3  # a cancel step's cancel comes from a user whose job it is not
FOREIGN_AFTER_SUBMIT_P = 0.3  # after a submit step, a user cancels another user's job too
FORGED_USER_P = 0.15  # after a submit step, a body that names a user is sent too
FORBIDDEN_BAND_P = 0.1  # after a submit step, a user sends a band above its max_band
# A squeeze: (kind of work, pin, how many peers take it). Its batch jobs fill those
# peers' slots and last at least SQUEEZE_MIN_S; SQUEEZE_WAIT_S later (the tick has
# placed them) 1-2 jobs of a higher band of the same kind arrive and find no room.
SQUEEZES = (("gpu", None, ("gpu-a", "gpu-b")), ("tpu", None, ("tpu",)), ("only:gpu-a", None, ("gpu-a",)),
            ("pinned", "gpu-b", ("gpu-b",)))
SQUEEZE_MIN_S = 0.6
SQUEEZE_WAIT_S = 0.3
# Who squeezes: fills come from users with no quota the fill would wait on, and so
# does most urgent work (a job held back by its own quota preempts nothing, §3.3).
SQUEEZE_FILLERS = (DEFAULT_USER,)
SQUEEZE_URGENT = (DEFAULT_USER, DEFAULT_USER, "alice", "bob")
# The gang a squeeze's urgent work may be, by what the squeeze filled.
GANG_SQUEEZES = {"tpu": "gang:tpu", "gpu-b": "gang:gpu-b"}
GANG_URGENT_P = 0.4
PIPELINE_P = 0.3  # a submit step also sends one user's pipeline (and one step of every schedule does)

# A pipeline as drawn: (user, body without ``after``, what it waits for: (index in the
# chain, when), and (job_id, when) of earlier jobs of that user), in sending order.
Pipeline = list[tuple[str, dict, list[tuple[int, str]], list[tuple[str, str]]]]
ARRAY_P = 0.25  # a submit step also sends one user's array (and one step of every schedule does)
ARRAY_AFTER_P = 0.3  # the array waits for a job sent just before it
ARRAY_DEPENDENT_P = 0.4  # a job is sent after the array's base id
ARRAY_CANCEL_P = 0.3  # the array is cancelled by its base id, this long after its submit:
ARRAY_CANCEL_AFTER_S = (0.5, 3.0)


@dataclass(frozen=True)
class DrawnArray:
    """An array as drawn: whose, its body (workload.array_body), the job it waits for
    (its body and ``when``; None: none), the job sent ``after`` its base id (likewise)
    and how long after its submit it is cancelled by its base id (None: never)."""

    user: str
    body: dict
    head: tuple[dict, str] | None
    dependent: tuple[dict, str] | None
    cancel_after_s: float | None

    def element_ids(self) -> list[str]:
        return [f"{self.body['job_id']}_{i}" for i in range(self.body["array"])]


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
        self.acked: dict[str, dict] = {}  # stored job id → first successful reply
        # Invariant 14: each user's workspace (its submit field and token), and each acked
        # job's token ("-": none), which its runs' start lines must show.
        self.workspaces: dict[str, tuple[dict, str]] = {}
        self.tokens: dict[str, str] = {}
        self.never_started: set[str] = set()  # stored job ids
        self.ledger = Ledger()
        self.users = chaos_config().user_table
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
        self.fed = ChaosFederation(self.folder, self._db_urls(database_url), self.servers.nats_url,
                                   self.servers.auth)
        phase("database")
        nats_logs = self.servers.nats_logs  # the same files across NATS restarts
        nats_from = [nats_log_size(log) for log in nats_logs]
        self.clients: dict = {}
        self.prefix = prefix
        self.faults = Faults(self.rng, self.result, self.fed, self.servers, self.watcher, prefix, self.submit)
        # From the first process started on, whatever stops the schedule (a violation, an
        # error, SIGTERM or SIGINT to the run) stops everything it started.
        try:
            self.watcher.start()
            for name in SERVICES:
                self.fed.start(name)
            # As producers would: each its own NATS user, so its own inbox prefix (_INBOX_producer,
            # _INBOX_user-alice ...): the default user as v1's producer, the others as user-<id>.
            for user in SUBMITTERS:
                role = "producer" if user == DEFAULT_USER else user_role(user)
                self.clients[user] = await connect_client(self.servers.auth.url(self.servers.nats_url, role),
                                                          max_reconnect_attempts=-1,
                                                          reconnect_time_wait=0.2, error_cb=quiet)
            await self._store_workspaces(prefix)
            await self._wait_ready(database_url)
            await self.faults.listen_to_heartbeats()
            phase("ready")
            # One step of every schedule squeezes, whatever the draw: preemption is exercised
            # in every schedule (others may squeeze too, drawn like any action).
            squeeze_at = self.rng.randrange(self.steps) if self.steps else -1
            # On an HA world, one step of every schedule fails a server over (alternating
            # the primary and a NATS node between schedules), whatever the draw.
            ha_at, ha_fault = -1, None
            if self.servers.ha and self.steps > 1:
                ha_at = (squeeze_at + 1 + self.rng.randrange(self.steps - 1)) % self.steps
                ha_fault = "failover_postgres" if self.index % 2 == 0 else "kill_nats_node"
            # One step of every schedule also sends a pipeline (invariant 16), whatever the draw.
            pipeline_at = self.rng.randrange(self.steps) if self.steps else -1
            # And one sends an array (at most K of its jobs live at once), whatever the draw.
            array_at = self.rng.randrange(self.steps) if self.steps else -1
            for index in range(self.steps):
                forced = "squeeze" if index == squeeze_at else ha_fault if index == ha_at else None
                if index == pipeline_at:
                    await self._send_pipeline(self._draw_pipeline())
                if index == array_at:
                    await self._send_array(self._draw_array())
                action = await self.step(forced)
                phase(f"step:{action}")
                self._restart_exited()
                self.faults.mend_due()
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
                phase("gap")
            await self.faults.mend_all()
            await converge_and_check(database_url, self.result, self.acked, self.never_started, self.fed.down,
                                     self._restart_exited, self.ledger, QUOTAS)
            await check_shipped_logs(database_url, self._request, self.ledger.sent, self.rng, self.result)
            phase("converge+checks")
        finally:
            await self.faults.close()
            for client in self.clients.values():
                await client.close()
            self.result.violations.extend(self.fed.reap())
            self.fed.close()
            phase("stop")
            check_runs(self.watcher, self.result, self.tokens)
            check_logs(self.folder, self.result)
            for log, offset in zip(nats_logs, nats_from, strict=True):
                check_nats_permissions(log, offset, self.result)
        return self.result

    async def step(self, action: str | None = None) -> str:
        """Producers submit, cancel or squeeze, or one fault is injected (drawn by weight,
        unless ``action`` says which); which."""
        rng = self.rng
        actions = actions_for(self.servers.ha)
        action = action or rng.choices(list(actions), weights=list(actions.values()))[0]
        if action == "submit" or not self.acked and action == "cancel":
            # Producers in parallel (each retrying on its own); drawn in order, so seeded.
            if rng.random() < BURST_P:  # one quota user asks for more than its quota at once
                user = rng.choice(sorted(QUOTAS))
                jobs = [self._new_job(user=user) for _ in range(rng.randint(3, 4))]
            else:
                jobs = [self._new_job() for _ in range(rng.randint(1, 4))]
            # Drawn before anything is sent, so the draw does not depend on timing.
            pipelines = [self._draw_pipeline()] if rng.random() < PIPELINE_P else []
            arrays = [self._draw_array()] if rng.random() < ARRAY_P else []
            await asyncio.gather(*(self._send(user, body) for user, body in jobs),
                                 *(self._send_pipeline(pipeline) for pipeline in pipelines),
                                 *(self._send_array(array) for array in arrays))
            if rng.random() < FORGED_USER_P:
                await self._send_forged_user()
            if self.acked and rng.random() < FOREIGN_AFTER_SUBMIT_P:
                await self._cancel_one(foreign=True)
            if rng.random() < FORBIDDEN_BAND_P:
                await self._send_forbidden_band()
        elif action == "cancel":
            await self._cancel_one(foreign=rng.random() < FOREIGN_CANCEL_P)
        elif action == "squeeze":
            await self._squeeze()
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
                    # Every user's cancel subject answers (not_found): the router serves them all.
                    replies = [await self._request("cancel", {"job_id": "ready-probe"}, user) for user in SUBMITTERS]
                    if all(reply is not None for reply in replies):
                        return
                await asyncio.sleep(0.1)
        finally:
            await pool.close()
        raise RuntimeError("the federation did not come up")

    # ------------------------------------------------------------ the producers

    async def _request(self, verb: str, body: dict, user: str = DEFAULT_USER) -> dict | None:
        """A request as ``user``: on its own subject (v1's for ``default``), with its own NATS user."""
        subject = f"{self.prefix}.{verb}" if user == DEFAULT_USER else f"{self.prefix}.{verb}.{user}"
        try:
            reply = await self.clients[user].request(subject, json.dumps(body).encode(), timeout=REQUEST_TIMEOUT_S)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError):
            return None
        return json.loads(reply.data)

    async def _store_workspaces(self, prefix: str) -> None:
        """The object store's buckets (as `irisfed up` makes them: one replica per NATS node)
        and a small workspace per user, stored with that user's own credentials; its
        WORKSPACE_TOKEN file names it."""
        admin = await connect_client(self.servers.auth.url(self.servers.nats_url, "admin"))
        try:
            await ensure_buckets(admin, prefix, replicas=3 if self.servers.ha else 1,
                                 users=[u for u in SUBMITTERS if u != DEFAULT_USER], peers=list(PEERS), wait_s=30.0)
        finally:
            await admin.close()
        for user in SUBMITTERS:
            token = f"{user}-{self.index}-{self.rng.randrange(1 << 30):x}"
            folder = self.folder / f"workspace-{user}"
            folder.mkdir(exist_ok=True)
            (folder / WORKSPACE_TOKEN).write_text(token + "\n")
            workspace, _ = await store_workspace(self.clients[user], prefix, folder, user=user)
            self.workspaces[user] = ({"digest": workspace.digest, "size": workspace.size}, token)

    async def submit(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0) -> None:
        await self._send(*self._new_job(kind, pin, min_s))

    def _new_job(self, kind: str | None = None, pin: str | None = None, min_s: float = 0.0,
                 user: str | None = None, band: str | None = None, fails: bool | None = None) -> tuple[str, dict]:
        """A new job of ``user`` (drawn when None) and that user, of ``band`` (drawn when
        None), exiting 1 when ``fails`` (None: drawn); recorded as sent at once."""
        rng = self.rng
        user = user or rng.choice(SUBMITTERS)
        band = band or draw_band(rng, user)
        self.result.jobs += 1
        job_id = f"s{self.index}-j{self.result.jobs}-{rng.randrange(1 << 20):x}"
        if rng.random() < SHARED_ID_P:  # an id another user sent: the same id, another job
            # (never an array's element id ``<base>_<i>``: an array of this user's named
            # ``<base>`` later would find its element's id taken)
            mine = {i for u, i in self.ledger.sent if u == user}
            theirs = sorted({i for u, i in self.ledger.sent if u != user and "_" not in i} - mine)
            if theirs:
                job_id = rng.choice(theirs)
        self.ledger.sent.add((user, job_id))
        body = job_body(rng, job_id, self.run_log, kind, pin, min_s, user, band, fails)
        if self.workspaces and rng.random() < WORKSPACE_P:
            body["workspace"] = self.workspaces[user][0]
        return user, body

    def _draw_pipeline(self) -> Pipeline:
        """One user's chain of jobs waiting for each other (workload.pipeline_edges): its
        first fails half the time, and now and then waits for an earlier acknowledged job
        of that user too (likely ended: the submit settles it at once)."""
        rng = self.rng
        user = rng.choice(SUBMITTERS)
        edges = pipeline_edges(rng, rng.choice(PIPELINE_LENGTHS))
        earlier = sorted(job_id for stored, (owner, job_id) in self.ledger.owner_of.items()
                         if owner == user and stored in self.acked)
        pipeline: Pipeline = []
        for i, needs in enumerate(edges):
            fails = rng.random() < (PIPELINE_HEAD_FAILS_P if i == 0 else PIPELINE_FAILS_P)
            _, body = self._new_job(user=user, fails=fails)
            also = [(rng.choice(earlier), rng.choice(WHENS))] if i == 0 and earlier and rng.random() < EARLIER_P \
                else []
            pipeline.append((user, body, needs, also))
        return pipeline

    async def _send_pipeline(self, pipeline: Pipeline) -> None:
        """Send a pipeline in order, each job once what it waits for was acknowledged (one
        whose dependency never was is not sent: its submit would name no job)."""
        acked: list[bool] = []
        for user, body, needs, also in pipeline:
            if not all(acked[i] for i, _ in needs):
                acked.append(False)
                continue
            after = [{"job_id": pipeline[i][1]["job_id"], "when": when} for i, when in needs]
            after += [{"job_id": job_id, "when": when} for job_id, when in also]
            acked.append(await self._send(user, {**body, "after": after}))
        self.result.pipelines += 1

    def _draw_array(self) -> DrawnArray:
        """One user's array (workload.array_body) of a kind of work that runs, each element
        failing now and then; now and then after a job of that user sent just before it
        (failing half the time), with a job after its base id, and cancelled a moment
        after its submit. Its elements' ids are recorded as sent at once."""
        rng = self.rng
        user = rng.choice(SUBMITTERS)
        size, parallel = rng.choice(ARRAY_SIZES), rng.choice(ARRAY_PARALLEL)
        codes = array_exit_codes(rng, size)
        head = None
        if rng.random() < ARRAY_AFTER_P:
            head = (self._new_job(user=user, fails=rng.random() < PIPELINE_HEAD_FAILS_P)[1], rng.choice(WHENS))
        _, body = self._new_job(rng.choice(ARRAY_KINDS), min_s=ARRAY_MIN_S, user=user, fails="1" in codes)
        dependent = (self._new_job(user=user)[1], rng.choice(WHENS)) if rng.random() < ARRAY_DEPENDENT_P else None
        cancel_after_s = rng.uniform(*ARRAY_CANCEL_AFTER_S) if rng.random() < ARRAY_CANCEL_P else None
        drawn = DrawnArray(user, array_body(body, codes, parallel), head, dependent, cancel_after_s)
        self.ledger.sent.update((user, element) for element in drawn.element_ids())
        return drawn

    async def _send_array(self, drawn: DrawnArray) -> None:
        """Send the job the array waits for (if any; the array is not sent unless that was
        acknowledged), the array, the job after its base id, and its cancel."""
        user, body = drawn.user, drawn.body
        if drawn.head is not None:
            head, when = drawn.head
            if not await self._send(user, head):
                return
            body = {**body, "after": [{"job_id": head["job_id"], "when": when}]}
        if not await self._send(user, body):
            return
        self.result.arrays += 1
        base = body["job_id"]
        if drawn.dependent is not None:
            dependent, when = drawn.dependent
            if await self._send(user, {**dependent, "after": [{"job_id": base, "when": when}]}):
                self.result.array_dependents += 1
        if drawn.cancel_after_s is not None:
            await asyncio.sleep(drawn.cancel_after_s)
            await self._cancel_array(user, base, drawn.element_ids())

    async def _cancel_array(self, user: str, base: str, elements: list[str]) -> None:
        """``user`` cancels its array ``base`` by that id: every element (§3.8)."""
        self.result.array_cancels += 1
        self.ledger.own_cancels.update(stored_job_id(user, element) for element in elements)
        reply = await self._request("cancel", {"job_id": base}, user)
        code = (reply or {}).get("error", {}).get("code")
        if reply is not None and code is not None and code != ErrorCode.UNAVAILABLE:
            self.result.violations.append(f"{stored_job_id(user, base)}: {user} cancelled its array {base!r} "
                                          f"and was answered {reply}")
        elif reply is not None and code is None and reply.get("job_id") != base:
            self.result.violations.append(f"{stored_job_id(user, base)}: {user} cancelled its array {base!r}, "
                                          f"the reply names {reply.get('job_id')!r}")

    async def _squeeze(self) -> None:
        """Fill the peers of one kind of work with batch jobs; once they are placed, send
        1-2 jobs of a higher band of that kind: finding no room, they preempt."""
        rng = self.rng
        # Where the agents run (one killed a moment ago takes nothing: no room to fight for).
        up = [s for s in SQUEEZES if all(self.fed.running(peer) for peer in s[2])]
        kind, pin, peers = rng.choice(up or SQUEEZES)
        fill = [self._new_job(kind, pin, SQUEEZE_MIN_S, rng.choice(SQUEEZE_FILLERS), BATCH)
                for _ in range(len(peers) * SLOTS_PER_PEER)]
        await asyncio.gather(*(self._send(user, body) for user, body in fill))
        await asyncio.sleep(SQUEEZE_WAIT_S)
        urgent = []
        for _ in range(rng.randint(1, 2)):
            user = rng.choice(SQUEEZE_URGENT)
            band = PRODUCTION if band_rank(MAX_BAND[user]) >= band_rank(PRODUCTION) and rng.random() < 0.6 \
                else INTERACTIVE
            # Where nodes are, a gang preempts too (whole gangs, only where it then fits).
            gang = GANG_SQUEEZES.get(kind if pin is None else pin)
            urgent.append(self._new_job(gang if gang and rng.random() < GANG_URGENT_P else kind, pin, 0.0, user,
                                        band))
        await asyncio.gather(*(self._send(user, body) for user, body in urgent))

    async def _send_forbidden_band(self) -> None:
        """A band above the user's ``max_band``: answered ``forbidden``, nothing written
        (its job_id is sent by no one, so a job made of it fails the identity checks)."""
        users = [u for u in SUBMITTERS if band_rank(MAX_BAND[u]) < band_rank(PRODUCTION)]
        if not users:
            return
        user = self.rng.choice(users)
        self.result.forbidden_bands += 1
        job_id = f"s{self.index}-forbidden-{self.result.forbidden_bands}"
        body = job_body(self.rng, job_id, self.run_log, user=user, band=PRODUCTION)
        reply = await self._request("submit", body, user)
        code = (reply or {}).get("error", {}).get("code")
        if reply is not None and code not in (ErrorCode.FORBIDDEN, ErrorCode.UNAVAILABLE):
            self.result.violations.append(f"{stored_job_id(user, job_id)}: {user} (max_band {MAX_BAND[user]}) "
                                          f"asked band production and was answered {reply} (expected forbidden)")

    async def _send(self, user: str, body: dict) -> bool:
        """Submit ``body`` as ``user`` (up to three tries on no answer or ``unavailable``);
        whether it was acknowledged."""
        job_id = body["job_id"]
        stored = stored_job_id(user, job_id)
        over = over_whole_quota(self.users.get(user), as_resources(body.get("resources") or None).units,
                                body.get("replicas", 1))
        for _ in range(3):  # producers retry with the same job_id: idempotent
            reply = await self._request("submit", body, user)
            if reply is None or reply.get("error", {}).get("code") == ErrorCode.UNAVAILABLE:
                await asyncio.sleep(0.2)
                continue
            if "error" in reply:
                self.result.violations.append(f"{stored}: unexpected error {reply['error']}")
                break
            # An array's reply acknowledges each of its jobs (§3.8): each is waited for.
            jobs = [f"{job_id}_{i}" for i in range(body["array"])] if "array" in body else [job_id]
            for one in jobs:
                self.acked.setdefault(stored_job_id(user, one), reply)
                self.tokens.setdefault(stored_job_id(user, one),
                                       self.workspaces[user][1] if "workspace" in body else "-")
                self.ledger.owner_of[stored_job_id(user, one)] = (user, one)
            if reply.get("job_id") != job_id:
                self.result.violations.append(f"{stored}: {user} sent job_id {job_id!r}, the reply names "
                                              f"{reply.get('job_id')!r}")
            if over is not None and (reply.get("disposition") != "reject" or "quota" not in reply.get("reason", "")):
                self.result.violations.append(f"{stored}: asks more than {user}'s whole quota ({over}) but was "
                                              f"answered {reply.get('disposition')}: {reply.get('reason')!r}")
            return True
        return False

    async def _send_forged_user(self) -> None:
        """A body naming another user: decoded strictly, it must be refused and write nothing
        (invariant 9: nothing in a body speaks for a user; the job_id is sent by no one)."""
        user = self.rng.choice(SUBMITTERS)
        claimed = self.rng.choice([u for u in SUBMITTERS if u != user])
        self.ledger.forged += 1
        body = job_body(self.rng, f"s{self.index}-forged-{self.ledger.forged}", self.run_log, user=user)
        body["user_id"] = claimed
        reply = await self._request("submit", body, user)
        code = (reply or {}).get("error", {}).get("code")
        if reply is not None and code not in (ErrorCode.INVALID_REQUEST, ErrorCode.UNAVAILABLE):
            self.result.violations.append(f"{body['job_id']}: {user}'s submit naming user {claimed} in its body "
                                          f"was answered {reply} (expected invalid_request)")

    async def _cancel_one(self, foreign: bool) -> None:
        """Cancel an acknowledged job (drawn): as its own user, or (``foreign``) as a user
        whose job it is not, if one never sent that job_id (on its subject the id names no
        job of its own); no such user: its own user cancels it."""
        rng = self.rng
        stored = rng.choice(sorted(self.acked))
        owner, job_id = self.ledger.owner_of[stored]
        others = [u for u in SUBMITTERS if u != owner and (u, job_id) not in self.ledger.sent]
        if foreign and others:
            await self._cancel_foreign(rng.choice(others), stored, job_id)
        else:
            await self._cancel(owner, job_id)

    async def _cancel(self, user: str, job_id: str) -> None:
        """``user`` cancels its own job ``job_id``."""
        stored = stored_job_id(user, job_id)
        self.ledger.own_cancels.add(stored)
        reply = await self._request("cancel", {"job_id": job_id}, user)
        if reply and reply.get("outcome") == CancelOutcome.NEVER_STARTED:
            self.never_started.add(stored)
        if reply and "error" not in reply and reply.get("job_id") != job_id:
            self.result.violations.append(f"{stored}: {user} cancelled {job_id!r}, the reply names "
                                          f"{reply.get('job_id')!r}")

    async def _cancel_foreign(self, asker: str, stored: str, job_id: str) -> None:
        """``asker`` cancels ``job_id``, which names no job of its own but another user's
        (``stored``): the answer is ``not_found`` and the job is left alone (checked at the end)."""
        self.ledger.foreign_cancels.append((asker, stored))
        reply = await self._request("cancel", {"job_id": job_id}, asker)
        code = (reply or {}).get("error", {}).get("code")
        if reply is not None and code not in (ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE):
            self.result.violations.append(f"{stored}: {asker}, whose job it is not, cancelled {job_id!r} and was "
                                          f"answered {reply} (expected not_found)")
