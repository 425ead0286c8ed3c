"""A federation on the Patroni cluster of tests/e2e/conftest.py's ``patroni`` fixture
(started once per test module that asks for it): the cluster made healthy again
between tests, a fresh migrated database on it, the simulated services started, and a
read of the test's own retried through a failover.

Used by tests/e2e/test_failover_e2e.py, test_failover_hanging_primary_e2e.py,
test_failover_replayed_submits_e2e.py and test_ha_urls_standby_first_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from irisfed.services.common import db as dbmod
from irisfed.services.common.logstore import ensure_log_streams
from irisfed.services.common.store import Store
from irisfed.shared.errors import Unavailable
from irisfed.tooling.federation import Peer
from irisfed.tooling.ha import PatroniCluster, PatroniNode
from tests.e2e.conftest import Federation
from tests.infra.configs import make_peer
from tests.infra.waiting import wait_for

SIMULATED_PEERS = [make_peer("home", "cpu", 64, backend="simulated"),
                   make_peer("gpu-west", "gpu", 64, backend="simulated")]


def healthy(cluster: PatroniCluster) -> None:
    """Every node up, a leader and a synchronous standby (earlier tests killed some)."""
    for node in cluster.nodes:
        if not node.process.running():
            cluster.restart(node)
    cluster.wait_leader()
    cluster.wait_sync_standby()


def other_node(cluster: PatroniCluster, node: PatroniNode) -> PatroniNode:
    return next(n for n in cluster.nodes if n is not node)


@contextlib.asynccontextmanager
async def fresh_federation(patroni: PatroniCluster, tmp_path, servers, subject_prefix, nats_client, prefix: str,
                           peers: list[Peer] = SIMULATED_PEERS):
    """A federation (not started) on a new, migrated database of the healthy Patroni
    cluster, every service given the multi-host URL; the test's own pool on it."""
    await asyncio.to_thread(healthy, patroni)
    url = await patroni.create_database(f"{prefix}_{uuid.uuid4().hex[:10]}")
    await asyncio.to_thread(dbmod.migrate, url)
    pool = await dbmod.connect(url, max_size=4)
    fed = Federation(tmp_path, url, servers.nats_plain_url or servers.nats_url, subject_prefix, nats_client,
                     Store(pool), auth=servers.nats_auth)
    fed.configure(peers, heartbeat_interval_s=0.5, ttl_s=20.0, grace_s=5.0)
    await ensure_log_streams(nats_client, subject_prefix, [peer.id for peer in peers])  # as `irisfed up` does
    try:
        yield fed
    finally:
        fed.close()
        await pool.close()


async def start_simulated(fed: Federation, *router_args: str) -> None:
    """Router (with ``router_args``), tick and the two simulated agents of ``SIMULATED_PEERS``."""
    fed.start("router", *router_args)
    fed.start("tick")
    for peer in ("home", "gpu-west"):
        fed.start(peer, "--sim-duration", "0.05")
    await fed.wait_router()
    for peer in ("home", "gpu-west"):
        await fed.wait_agent(peer)


async def retrying(read):
    """A read of the test's own through a failover (its pool's old connections break once)."""
    async def attempt():
        try:
            return (await read(),)
        except Unavailable:
            return None
    return (await wait_for(attempt, "a read through the failover", timeout=60))[0]
