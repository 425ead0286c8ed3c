"""Quotas and users under the services' restricted login roles (`irisfed db-roles`):
the router's LOCAL assignments under quota locks, the tick's commit-time quota check
and the dashboard's per-user reads all work as those roles."""

from __future__ import annotations

import json

from irisfed.services.common import db as dbmod
from irisfed.services.common.bus import connect_client
from irisfed.services.common.store import Store
from irisfed.services.router.service import Router
from irisfed.services.tick.service import Tick
from tests.infra.db_roles import ROLES, as_role
from tests.infra.factories import advertise, make_config

USERS = [{"id": "alice", "quota": {"slots": 2}}, {"id": "bob"}]


async def test_quota_paths_work_as_the_services_login_roles(database_url, roles, servers, subject_prefix):
    admin = await dbmod.connect(database_url)
    router_pool = await dbmod.connect(as_role(database_url, ROLES["router"]))
    tick_pool = await dbmod.connect(as_role(database_url, ROLES["tick"]))
    web_pool = await dbmod.connect(as_role(database_url, ROLES["web"]))
    service_nc = await connect_client(servers.nats_url)
    client = await connect_client(servers.nats_url)
    config = make_config(subject_prefix=subject_prefix, users=USERS)
    router = Router(config, router_pool, service_nc)
    try:
        await advertise(Store(admin), "home", slots=10, device_type="cpu")
        await advertise(Store(admin), "gpu-west", slots=10, device_type="cpu")
        await router.start()
        replies = []
        for i in range(3):  # LOCAL: two assigned under alice's lock, the third waits for quota
            raw = await client.request(f"{subject_prefix}.submit.alice",
                                       json.dumps({"job_id": f"l{i}", "command": ["true"]}).encode(), timeout=10)
            replies.append(json.loads(raw.data))
        assert [r.get("state") for r in replies] == ["assigned", "assigned", "queued"], replies
        raw = await client.request(f"{subject_prefix}.submit.alice",
                                   json.dumps({"job_id": "q", "command": ["true"],
                                               "cluster_pin": "gpu-west"}).encode(), timeout=10)
        assert json.loads(raw.data).get("state") == "queued", raw.data
        # The tick, as its role: alice is at her quota, so nothing of hers is placed.
        tick = Tick(config, tick_pool, None)
        await tick.refresh_view()
        result = await tick.run_once()
        assert result.assigned == []
        waiting = await Store(admin).job_get("alice:l2")
        assert waiting.explanation["wait"] == "quota", waiting.explanation
        # The dashboard's reads, as its role.
        web = Store(web_pool)
        assert (await web.job_live_usage_by_user())["alice"]["slots"] == 2
        assert (await web.job_count_by_user())["alice"] == {"assigned": 2, "queued": 2}
    finally:
        await router.close()
        for closing in (client, service_nc):
            await closing.close()
        for pool in (admin, router_pool, tick_pool, web_pool):
            await pool.close()
