"""Heartbeats advertising absurd node groups, to the tick (real Postgres, in process) and
to the router's rules: nothing crashes, nothing is stored half, nothing is placed on nodes
that were never really offered (docs/scheduling.md, "Gangs": groups are sanitised like
resources).

gpu-west advertises garbage — negative, zero and absurdly large counts, negative and
inverted amounts, 10,000 distinct groups offering nothing, attributes with empty value
lists — plus exactly two real one-cpu nodes on slice ``a``. tpu-east advertises four
real nodes on slice ``z``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import msgspec

from irisfed.services.common.peer_view import backends_from_wire
from irisfed.services.common.store import Store
from irisfed.services.tick.service import Tick
from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition
from irisfed.shared.lifecycle import JobState
from irisfed.shared.resources import Resources
from tests.infra.factories import Msg, insert_jobs, make_config, make_job


def node(count, cpu_total=1, cpu_free=1, **attributes):
    return {"count": count, "attributes": attributes, "resources": {"cpu": {"total": cpu_total, "free": cpu_free}}}


GARBAGE = [
    node(-5, 64, 64, slice=["a"]),
    node(0, 64, 64, slice=["a"]),
    node(2**62, 64, 64, slice=["a"]),  # past any real backend: offers nothing
    node(1_000_001, 64, 64, slice=["a"]),
    node(10**30, 64, 64, slice=["a"]),
    node(3, -1, 5, slice=["a"]),  # a negative total: no cpu
    node(3, 0, 100, slice=["a"]),  # free above total: capped at total (0)
    node(3, 1, -7, slice=["a"]),  # real nodes (by totals), none free now
    node(3, 1, 1, slice=[]),  # real free nodes of no slice: never a group_by candidate
    *(node(1, 0, 0, host=[f"h{i}"], slice=["a"]) for i in range(10_000)),
]
REAL = [node(2, 1, 1, slice=["a"])]


def heartbeat(peer_id: str, nodes: list, seq: int = 1) -> bytes:
    return json.dumps({
        "peer_id": peer_id, "seq": seq, "sent_at": datetime.now(UTC).isoformat(), "ttl_s": 60.0, "run_id": "r1",
        "backends": [{"name": "main", "attributes": {"device_type": ["tpu"]}, "capacity": {"total": 64, "free": 64},
                      "resources": {"cpu": {"total": 64, "free": 64}}, "nodes": nodes}],
    }).encode()


def gang(replicas: int, group_by: str = "", **fields):
    coschedule = {"coschedule": {"group_by": group_by}} if group_by else {}
    return make_job(replicas=replicas, resources={"cpu": 1}, **coschedule, **fields)


async def test_absurd_node_groups_crash_nothing_and_offer_only_real_nodes(pool):
    store = Store(pool)
    config = make_config(heartbeat_ttl_s=60.0)
    tick = Tick(config, pool, None)
    subject = config.subjects.heartbeat
    await tick.on_heartbeat(Msg(subject("gpu-west"), heartbeat("gpu-west", [*GARBAGE, *REAL])))
    await tick.on_heartbeat(Msg(subject("tpu-east"), heartbeat("tpu-east", [node(4, 1, 1, slice=["z"])])))
    assert set(tick.view.reachable_ids()) == {"gpu-west", "tpu-east"}
    await tick.persist_heartbeats()  # one statement for both: the garbage must not fail it
    stored = {r.peer_id: r for r in await store.peer_heartbeat_list()}
    assert set(stored) == {"gpu-west", "tpu-east"}

    # What the router makes of the stored row: only the two real nodes hold a task.
    west = backends_from_wire(stored["gpu-west"].backends)
    peers = [FederationPeer("gpu-west", west, last_heartbeat_at=0.0, ttl_s=1e9)]
    router = PeerRouter(peers, clock=lambda: 1.0)

    def classify(replicas: int, group_by: str = ""):
        return router.classify(RoutingRequest((), False, "", Resources({"cpu": 1}), replicas, group_by))
    # Real by their totals: 2 + 3 on slice a, 3 of no slice.
    assert classify(8).disposition is SubmitDisposition.QUEUE
    assert classify(9).disposition is SubmitDisposition.REJECT, classify(9)
    assert classify(5, "slice").disposition is SubmitDisposition.QUEUE
    assert classify(6, "slice").disposition is SubmitDisposition.REJECT
    assert classify(2, "host").disposition is SubmitDisposition.REJECT  # the host-named nodes offer no cpu

    # The tick places gangs only on nodes free now: three tasks sharing a slice fit on
    # tpu-east alone (slice a has two free), the pinned pair on gpu-west's two free
    # slice-a nodes, a pinned six nowhere (five free nodes at most).
    three, pair, stuck = gang(3, "slice"), gang(2, "slice", cluster_pin="gpu-west"), gang(6, cluster_pin="gpu-west")
    await insert_jobs(store, [three, pair, stuck])
    await tick.refresh_view()
    result = await tick.run_once(full=False)
    placed = {job_id: peer for job_id, peer, _ in result.assigned}
    assert placed == {three.job_id: "tpu-east", pair.job_id: "gpu-west"}, result
    row = await store.job_get(stuck.job_id)
    assert row.state is JobState.QUEUED and row.reason, row


async def test_a_heartbeat_whose_node_groups_have_wrong_types_is_dropped_whole_and_changes_nothing(pool):
    store = Store(pool)
    config = make_config(heartbeat_ttl_s=60.0)
    tick = Tick(config, pool, None)
    subject = config.subjects.heartbeat("gpu-west")
    await tick.on_heartbeat(Msg(subject, heartbeat("gpu-west", REAL)))
    for seq, bad in enumerate((
        [{"count": "2", "resources": {"cpu": {"total": 1, "free": 1}}}],
        [{"count": True, "resources": {}}],
        [{"count": 2.5, "resources": {}}],
        [{"count": 2, "attributes": {"slice": "a"}}],  # a value, not a list
        [{"count": 2, "attributes": {"slice": ["a\u0000b"]}}],
        [{"count": 2, "resources": {"cpu": {"total": "many", "free": 1}}}],
        {"count": 2},
    ), start=2):
        await tick.on_heartbeat(Msg(subject, heartbeat("gpu-west", bad, seq=seq)))
    await tick.persist_heartbeats()
    [row] = await store.peer_heartbeat_list()
    assert (row.peer_id, row.seq) == ("gpu-west", 1), row
    assert msgspec.json.decode(msgspec.json.encode(row.backends))[0]["nodes"] == REAL
