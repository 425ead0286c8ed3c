"""What a chaos step may break, when each break ends, and mending everything at the end.

Every draw comes from the schedule's seeded ``rng``, in a fixed order, so a seed
replays the same faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from irisfed.services.common.bus import connect_client
from irisfed.tooling.chaos.result import ScheduleResult
from irisfed.tooling.chaos.watcher import RunWatcher
from irisfed.tooling.chaos.workload import ONLY_ON
from irisfed.tooling.chaos.world import (
    DOWN_SLACK_S,
    HEARTBEAT_TTL_S,
    PEERS,
    SAMPLE_PERIOD_S,
    SERVICES,
    SLOTS_PER_PEER,
    SUBPROCESS_PEERS,
    ChaosFederation,
    Servers,
)
from irisfed.tooling.proxy import TcpProxy

# action → weight; "submit", "cancel" and "squeeze" are the producers' (see Schedule.step).
ACTIONS = {
    "submit": 5, "cancel": 2, "squeeze": 2, "kill_agent": 1, "kill_agent_with_runs": 2, "partition": 2,
    "stall_postgres": 2, "rogue_heartbeats": 1, "kill_router": 1, "kill_tick": 1,
    "restart_nats": 1, "restart_postgres": 2,
}
POSTGRES_RESTARTS = {"fast": "restart_postgres", "immediate": "crash_postgres_immediate",
                     "kill": "crash_postgres_sigkill"}
# On an HA world (``irisfed chaos --ha``) the servers' faults are a primary that dies
# (Patroni promotes the synchronous standby) and NATS nodes that die (two of three at
# most at once), in place of one server's restarts.
HA_ACTIONS = {**{k: v for k, v in ACTIONS.items() if k not in ("restart_nats", "restart_postgres")},
              "failover_postgres": 2, "kill_nats_node": 2}


def actions_for(ha: bool) -> dict[str, int]:
    return HA_ACTIONS if ha else ACTIONS

# Submits a job of a kind (see workload.job_body): the schedule's producer.
Submit = Callable[..., Awaitable[None]]


async def quiet(exc: Exception) -> None:  # NATS restarts are the point here
    pass


class Faults:
    """The faults of one schedule: injected by :meth:`inject`, each ended when its time
    comes (:meth:`mend_due`) and all of them at the end (:meth:`mend_all`)."""

    def __init__(self, rng: random.Random, result: ScheduleResult, fed: ChaosFederation, servers: Servers,
                 watcher: RunWatcher, prefix: str, submit: Submit) -> None:
        self.rng = rng
        self.result = result
        self.fed = fed
        self.servers = servers
        self.watcher = watcher
        self.prefix = prefix
        self.submit = submit
        self.pending_restarts: list[tuple[float, str]] = []
        self.nats_restarts: list[tuple[float, int]] = []  # (when, NATS cluster node)
        self.partitions: list[tuple[float, TcpProxy]] = []
        self.stalls: list[tuple[float, TcpProxy, bool]] = []  # until, proxy, drop on restore
        self.rogues: list[asyncio.Task] = []
        self.heard: dict[str, list[bytes]] = {}  # peer → [its first heartbeat, its latest]
        self.spy = None

    async def inject(self, action: str) -> None:
        """One fault of kind ``action`` (a key of ACTIONS other than the producers' submit, cancel and squeeze)."""
        rng = self.rng
        if action == "kill_agent":
            peer = rng.choice(sorted(PEERS))
            self.result.fault(action)
            self.fed.kill(peer)
            self.pending_restarts.append((time.monotonic() + rng.uniform(0.2, 2.5), peer))
        elif action == "kill_agent_with_runs":
            self.result.fault(action)
            await self._kill_agent_with_runs()
        elif action == "partition":
            peer = rng.choice(sorted(PEERS))
            nats_proxy, db_proxy = self.fed.nats_proxies[peer], self.fed.db_proxies[peer]
            which = rng.choice([[nats_proxy], [db_proxy], [nats_proxy, db_proxy]])
            until = time.monotonic() + rng.uniform(0.3, 3.0)
            self.result.fault(action)
            for proxy in which:
                proxy.cut()
                self.partitions.append((until, proxy))
        elif action == "stall_postgres":
            # Postgres hangs for one service (or everyone): connections stay open, no byte
            # moves, nothing is reset; then it resumes, or the connections are reset.
            target = rng.choice(["all", "router", "tick", *sorted(PEERS)])
            until = time.monotonic() + rng.uniform(0.5, 4.0)
            drop = rng.random() < 0.5
            self.result.fault("stall_postgres_all" if target == "all" else "stall_postgres")
            for name in SERVICES if target == "all" else (target,):
                self.fed.db_proxies[name].stall()
                self.stalls.append((until, self.fed.db_proxies[name], drop))
        elif action == "rogue_heartbeats":
            target = rng.choice(sorted(ONLY_ON))
            rogue = rng.choice(sorted(set(PEERS) - {target}))
            # Down for longer than a TTL, so a forgery that worked shows as a placement.
            until = time.monotonic() + rng.uniform(2.4, 3.2)
            self.result.fault(action)
            self.fed.kill(target)
            self.pending_restarts.append((until, target))
            self.rogues.append(asyncio.create_task(self._forge(rogue, target, until)))
            # Once the real heartbeats have expired, offer work only the dead peer could
            # take: if a lie is believed, the tick places it there.
            await asyncio.sleep(HEARTBEAT_TTL_S + DOWN_SLACK_S + 0.1)
            for _ in range(2):
                await self.submit(kind=f"only:{target}")
        elif action in ("kill_router", "kill_tick"):
            name = action.split("_")[1]
            self.result.fault(action)
            self.fed.kill(name)
            self.fed.start(name)
        elif action == "restart_nats":
            self.result.fault(action)
            await asyncio.to_thread(self.servers.restart_nats)
        elif action == "restart_postgres":
            how = rng.choice(sorted(POSTGRES_RESTARTS))
            self.result.fault(POSTGRES_RESTARTS[how])
            await asyncio.to_thread(self.servers.restart_postgres, how)
        elif action == "failover_postgres":
            self.result.fault(action)
            await asyncio.to_thread(self.servers.failover_postgres)
        elif action == "kill_nats_node":
            cluster = self.servers.nats_cluster
            alive = [i for i, server in enumerate(cluster.servers) if server.running()]
            if len(alive) >= 2:  # one is always left: with none, NATS is simply down (restart_nats)
                index = rng.choice(alive)
                self.result.fault(action)
                self.servers.kill_nats_node(index)
                self.nats_restarts.append((time.monotonic() + rng.uniform(0.5, 4.0), index))

    async def _kill_agent_with_runs(self) -> None:
        """SIGKILL a subprocess peer's agent while real runs of it go on (own sessions)."""
        rng = self.rng
        peer = rng.choice(SUBPROCESS_PEERS)
        await self.submit(kind="pinned", pin=peer, min_s=0.5)
        await self.submit(kind="gpu", min_s=0.5)
        for _ in range(int(1.5 / SAMPLE_PERIOD_S)):  # its agent may be down or cut off: no run starts
            # A run started; or its agent is down (killed or exited), so none can start
            # before mend_due restarts it: waiting on would only idle the schedule.
            if self.watcher.live_on(peer) or not self.fed.running(peer):
                break
            await asyncio.sleep(SAMPLE_PERIOD_S)
        self.fed.kill(peer)
        self.pending_restarts.append((time.monotonic() + rng.uniform(0.2, 2.5), peer))

    async def listen_to_heartbeats(self) -> None:
        """Record real heartbeats off the wire, for the rogue to replay later."""
        async def heard(msg) -> None:
            peer = msg.subject.rsplit(".", 1)[1]
            seen = self.heard.setdefault(peer, [msg.data, msg.data])
            seen[1] = msg.data

        self.spy = await connect_client(self.servers.auth.url(self.servers.nats_url, "admin"),
                                        max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet)
        await self.spy.subscribe(f"{self.prefix}.heartbeat.*", cb=heard)
        await self.spy.flush()

    async def _forge(self, rogue: str, target: str, until: float) -> None:
        """A rogue agent user lies about ``target`` while ``target``'s agent is down.

        With ``rogue``'s own credentials, on its own subject: fresh heartbeats naming
        ``target`` with a huge TTL, and ``target``'s first heartbeat replayed. With
        ``target``'s credentials (stolen), on ``target``'s subject: that old
        heartbeat replayed verbatim (old run, seq and sent_at).
        """
        auth, url = self.servers.auth, self.servers.nats_url
        clients = []
        try:
            for user in (f"agent-{rogue}", f"agent-{target}"):
                clients.append(await connect_client(auth.url(url, user), max_reconnect_attempts=-1,
                                                    reconnect_time_wait=0.2, error_cb=quiet))
            liar, thief = clients
            old = self.heard.get(target, [None])[0]
            body = json.loads(old) if old else {"backends": [{
                "name": "simulated", "attributes": {k: [v] for k, v in PEERS[target].items()},
                "capacity": {"total": SLOTS_PER_PEER, "free": SLOTS_PER_PEER}}]}
            run_id, seq = uuid.uuid4().hex, 1 << 40
            while time.monotonic() < until:
                seq += 1
                forged = {**body, "peer_id": target, "seq": seq, "run_id": run_id, "ttl_s": 1e6,
                          "sent_at": datetime.now(UTC).isoformat()}
                await liar.publish(f"{self.prefix}.heartbeat.{rogue}", json.dumps(forged).encode())
                if old is not None:
                    await liar.publish(f"{self.prefix}.heartbeat.{rogue}", old)
                    await thief.publish(f"{self.prefix}.heartbeat.{target}", old)
                await asyncio.sleep(0.1)
        finally:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()

    async def stop_rogues(self) -> None:
        for task in self.rogues:
            task.cancel()
        await asyncio.gather(*self.rogues, return_exceptions=True)
        self.rogues.clear()

    def mend_due(self) -> None:
        """End the partitions, stalls and agent outages whose time has come."""
        now = time.monotonic()
        for until, proxy in [p for p in self.partitions if p[0] <= now]:
            proxy.restore()
            self.partitions.remove((until, proxy))
        for stall in [s for s in self.stalls if s[0] <= now]:
            stall[1].restore(drop=stall[2])
            self.stalls.remove(stall)
        for when, peer in [r for r in self.pending_restarts if r[0] <= now]:
            self.fed.start(peer)
            self.pending_restarts.remove((when, peer))
        for when, index in [r for r in self.nats_restarts if r[0] <= now]:
            self.servers.restart_nats_node(index)
            self.nats_restarts.remove((when, index))

    async def mend_all(self) -> None:
        """Every fault ended, every service running (one that exited by itself is a finding)."""
        await self.stop_rogues()
        self.result.violations.extend(self.fed.reap())
        for _, proxy in self.partitions:
            proxy.restore()
        self.partitions.clear()
        for _, proxy, drop in self.stalls:
            proxy.restore(drop=drop)
        self.stalls.clear()
        for _, peer in self.pending_restarts:
            self.fed.start(peer)
        self.pending_restarts.clear()
        self.nats_restarts.clear()
        if self.servers.ha:  # every node back: a failed-over primary rejoins as a standby
            await asyncio.to_thread(self.servers.healthy)
        for name in SERVICES:
            if not self.fed.running(name):
                self.fed.start(name)

    async def close(self) -> None:
        await self.stop_rogues()
        if self.spy is not None:
            await self.spy.close()
