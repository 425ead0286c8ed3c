"""A user's quota lock held by a writer that stopped answering (a tick frozen mid-commit,
its connection idle in its transaction): the router still answers every submit within
about twice its submit timeout (RouterSettings.submit_timeout_s), and other users'
submits are not held hostage by that one user's lock."""

from __future__ import annotations

import asyncio
import json
import time

import asyncpg

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.services.router.service import Router, RouterSettings
from tests.infra.factories import advertise, make_config

USERS = [{"id": "alice", "quota": {"slots": 100}}, {"id": "bob"}]
SUBMIT_TIMEOUT_S = 1.0


async def _hold_quota_lock(database_url: str, user: str) -> asyncpg.Connection:
    """What a tick frozen between ``job_quota_lock`` and its commit leaves behind."""
    conn = await asyncpg.connect(database_url)
    await conn.execute("BEGIN")
    await conn.fetchval("SELECT pg_advisory_xact_lock(hashtextextended('irisfed.quota.' || $1::text, 0))", user)
    return conn


async def _timed(nc, subject: str, body: dict, timeout: float = 30) -> tuple[float, dict]:
    started = time.monotonic()
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return time.monotonic() - started, json.loads(reply.data)


async def test_a_held_quota_lock_does_not_stall_submits_past_the_submit_timeout(database_url, servers,
                                                                                subject_prefix):
    pool = await dbmod.connect(database_url, max_size=10)
    service_nc = await connect_client(servers.nats_url)
    client = await connect_client(servers.nats_url)
    store = Store(pool)
    await advertise(store, "home", slots=50, device_type="cpu")
    router = Router(make_config(subject_prefix=subject_prefix, users=USERS), pool, service_nc,
                    RouterSettings(writers=2, submit_timeout_s=SUBMIT_TIMEOUT_S))
    await router.start()
    holder = await _hold_quota_lock(database_url, "alice")
    try:
        # Alice's LOCAL submits need her quota lock; one batch per writer.
        alices = []
        for i in range(2):
            alices.append(asyncio.ensure_future(_timed(client, f"{subject_prefix}.submit.alice",
                                                       {"job_id": f"a{i}", "command": ["true"]})))
            await asyncio.sleep(0.3)
        # Bob has no quota: his submit needs no lock at all.
        bob_s, bob = await _timed(client, f"{subject_prefix}.submit.bob", {"job_id": "b0", "command": ["true"]})
        alice = await asyncio.gather(*alices)
    finally:
        await holder.close()
        await router.close()
        await client.close()
        await service_nc.close()
        await pool.close()
    # Alice's batches give up on the lock within their budget and say so (a retry with
    # the same job_id is safe); they do not hold their writers for the pool's timeout, so
    # bob's submit, which needs no lock, finds a writer and is assigned.
    seen = {"alice": [(round(t, 1), r) for t, r in alice], "bob": (round(bob_s, 1), bob)}
    assert all(r["error"]["code"] == "unavailable" and "retry with the same job_id" in r["error"]["message"]
               for _, r in alice), seen
    assert bob.get("state") == "assigned", seen
