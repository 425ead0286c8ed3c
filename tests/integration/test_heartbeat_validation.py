"""The tick's checks on heartbeat fields, on real Postgres.

A peer's heartbeat whose ``seq`` does not fit a bigint, or whose ``sent_at`` overflows
when turned to UTC, decodes fine (the wire's ints are unbounded, its offsets free) but
cannot be stored. Were it accepted, the tick's once-per-interval batch write of
heartbeats would fail as a whole on it, for every peer's heartbeat in the batch and
again at every retry (the batch is kept); with ``seq = 2**63`` the poison would never
leave (the peer's next heartbeats of the same run are "older") and ``peer_heartbeat``
would freeze for the whole federation. Such heartbeats are dropped on receipt as
malformed. Absurd values Postgres can store are the peer's own claim about itself:
stored, and placement neither crashes nor trusts them.
"""

from __future__ import annotations

import json

import pytest

from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick
from irisfed.tooling.invariants import assert_changelog_replays
from tests.infra.factories import Msg, insert_jobs, make_config, make_job


def _beat(peer: str, seq: str, sent_at: str = '"2026-01-01T00:00:00Z"', run: str = "r1") -> bytes:
    """A heartbeat body as raw JSON, so values no struct of ours would build can be sent."""
    return (f'{{"peer_id":"{peer}","seq":{seq},"sent_at":{sent_at},"ttl_s":1.5,"backends":[{{"name":"main",'
            f'"attributes":{{}},"capacity":{{"total":4,"free":4}}}}],"run_id":"{run}"}}').encode()


@pytest.mark.parametrize("seq,sent_at", [
    (str(2**63), '"2026-01-01T00:00:00Z"'),
    (str(-(2**63) - 1), '"2026-01-01T00:00:00Z"'),
    (str(10**30), '"2026-01-01T00:00:00Z"'),
    ("1", '"9999-12-31T23:59:59-14:00"'),
    ("1", '"0001-01-01T00:00:00+14:00"'),
])
async def test_a_heartbeat_postgres_cannot_store_does_not_stop_the_tick_storing_every_peers(pool, seq, sent_at):
    config = make_config(tick_interval_s=3600)
    tick = Tick(config, pool, None)
    store = Store(pool)
    await tick.on_heartbeat(Msg(config.subjects.heartbeat("tpu-east"), _beat("tpu-east", "1")))
    await tick.on_heartbeat(Msg(config.subjects.heartbeat("gpu-west"), _beat("gpu-west", seq, sent_at)))
    await tick.persist_heartbeats()  # one unstorable row would fail the whole batch (PermanentStoreError)
    assert {r.peer_id: r.seq for r in await store.peer_heartbeat_list()} == {"tpu-east": 1}
    assert "gpu-west" not in tick.view.reachable_ids()  # dropped, not heard
    # The peer's next honest heartbeat of the same run is heard and stored.
    await tick.on_heartbeat(Msg(config.subjects.heartbeat("gpu-west"), _beat("gpu-west", "2")))
    await tick.persist_heartbeats()
    assert {r.peer_id: r.seq for r in await store.peer_heartbeat_list()} == {"tpu-east": 1, "gpu-west": 2}


async def test_absurd_but_storable_heartbeat_fields_are_stored_and_place_nothing_wrong(pool):
    """Far-future sent_at, negative seq, negative TTL, 1e308 and negative resources, a
    2**70 slot total: stored (the peer's own claim about itself; TTL capped), and
    placement neither crashes nor trusts the advertised ``free``: the tick counts free
    as the (capped) total less what is live there, and a negative total offers nothing."""
    config = make_config(tick_interval_s=3600)
    tick = Tick(config, pool, None)
    store = Store(pool)
    body = json.dumps({"peer_id": "gpu-west", "seq": -5, "sent_at": "9999-01-01T00:00:00Z", "ttl_s": -1,
                       "backends": [{"name": "main", "attributes": {}, "capacity": {"total": 2**70, "free": 2**70},
                                     "resources": {"cpu": {"total": 1e308, "free": -1e308},
                                                   "gpu": {"total": -3, "free": 1e308}}}],
                       "run_id": "r1"}).encode()
    await tick.on_heartbeat(Msg(config.subjects.heartbeat("gpu-west"), body))
    await tick.persist_heartbeats()
    [row] = await store.peer_heartbeat_list()
    assert (row.peer_id, row.seq, row.ttl_s) == ("gpu-west", -5, config.heartbeat_ttl_s)  # TTL capped
    jobs = [make_job() for _ in range(3)] + [make_job(resources={"gpu": 1})]
    await insert_jobs(store, jobs)
    result = await tick.run_once()
    # cpu: the huge total holds the three (its advertised free of -1e308 is not what
    # counts); gpu: a total of -3 offers nothing, so that job waits, explained.
    assert sorted(result.assigned) == sorted((j.job_id, "gpu-west", 1) for j in jobs[:3])
    assert (await store.job_get(jobs[3].job_id)).state == "queued"
    assert result.waiting == 1
    await assert_changelog_replays(store)
