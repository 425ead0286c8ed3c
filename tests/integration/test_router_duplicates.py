"""Invariant 2 on a real router, Postgres and nats-server: a duplicate gets the first
reply again, byte for byte but ``duplicate``, though no row stores that reply (it is
rebuilt from the lean job row): after the job moved on, after a cancel, while racing
the first submit, and from a second router process racing the first. A job's
explanation, stored once per decision, reads back as the router built it."""

from __future__ import annotations

import asyncio
import json

from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from irisfed.shared.federation.router import PeerRouter, RoutingRequest
from tests.infra.factories import advertise
from tests.infra.routers import RouterThread


def _raw(router, body: dict) -> bytes:
    async def ask() -> bytes:
        reply = await router.client.request(f"{router.prefix}.submit", json.dumps(body).encode(), timeout=10)
        return reply.data
    return router.run(ask())


def _as_duplicate(first: bytes) -> bytes:
    assert first.count(b'"duplicate":false') == 1, first
    return first.replace(b'"duplicate":false', b'"duplicate":true')


def _race(router: RouterThread, bodies: list[dict], routers: list[RouterThread] | None = None) -> list[bytes]:
    """Every body sent at once (round robin over ``routers``' subjects); the raw replies, in order."""
    routers = routers or [router]

    async def ask() -> list[bytes]:
        replies = await asyncio.gather(*(
            router.client.request(f"{routers[i % len(routers)].prefix}.submit", json.dumps(body).encode(),
                                  timeout=15)
            for i, body in enumerate(bodies)))
        return [reply.data for reply in replies]
    return router.run(ask())


def test_duplicates_get_the_first_reply_in_every_disposition_and_after_moves(router):
    store = Store(router.pool)
    router.run(advertise(store, "home", slots=4, device_type="cpu"))
    router.run(router.router.refresh_view())
    bodies = {
        "local": {"job_id": "dup-local", "command": ["true"], "constraints": [
            {"key": "device_type", "op": "eq", "value": "cpu"}]},
        "pinned": {"job_id": "dup-pinned", "command": ["true"], "cluster_pin": "gpu-west"},
        "rejected": {"job_id": "dup-rejected", "command": ["true"], "constraints": [
            {"key": "device_type", "op": "eq", "value": "quantum"}]},
    }
    first = {kind: _raw(router, body) for kind, body in bodies.items()}
    replies = {kind: json.loads(raw) for kind, raw in first.items()}
    assert [replies[k]["disposition"] for k in bodies] == ["local", "queue", "reject"]
    assert replies["local"]["peer_id"] == "home" and replies["pinned"]["peer_id"] == "gpu-west"
    assert replies["rejected"]["verdicts"] and {v["peer_id"] for v in replies["rejected"]["verdicts"]} == {
        "home", "gpu-west", "tpu-east"}
    rows_before = router.rows()

    # The jobs move on: the local one runs and ends, the pinned one is assigned (its
    # reason and owner change); what their first replies said does not.
    async def move_on() -> None:
        async with store.transaction() as tx:
            await tx.job_assign_batch([("dup-pinned", 0, "gpu-west", "main")])
        await store.job_start_batch("home", [("dup-local", 1, None, "started")])
        await store.job_finish_batch("home", [("dup-local", 1, 0, False)])
    router.run(move_on())
    assert router.run(store.job_get("dup-pinned")).reason == "assigned to gpu-west"
    assert router.run(store.job_get("dup-local")).state == "succeeded"

    for kind, body in bodies.items():
        assert _raw(router, body) == _as_duplicate(first[kind]), kind
    assert router.rows() == rows_before + 3  # the moves' changelog rows; the duplicates wrote nothing


def test_a_different_spec_under_the_same_id_is_still_a_conflict(router):
    assert "error" not in json.loads(_raw(router, {"job_id": "c", "command": ["true"], "cluster_pin": "gpu-west"}))
    reply = json.loads(_raw(router, {"job_id": "c", "command": ["false"], "cluster_pin": "gpu-west"}))
    assert reply["error"]["code"] == "conflict"


def test_one_explanation_row_per_distinct_decision_read_back_whole(router):
    store = Store(router.pool)
    for i in range(5):
        _raw(router, {"job_id": f"same-{i}", "command": ["true"], "cluster_pin": "gpu-west"})
    _raw(router, {"job_id": "other", "command": ["true"], "cluster_pin": "tpu-east"})
    keys = router.run(router.pool.fetch("SELECT DISTINCT explanation_key FROM jobs"))
    assert len(keys) == 2
    assert router.run(router.pool.fetchval("SELECT count(*) FROM job_explanations")) == 2
    plan = PeerRouter(router.router.view.peers(since_healthy=True), router.router.clock.monotonic).classify(
        RoutingRequest([], False, "gpu-west"))
    expected = explanation("router", plan.reason, plan.verdicts)
    for i in range(5):
        assert router.run(store.job_get(f"same-{i}")).explanation == expected


def test_racing_duplicates_get_one_first_reply_and_its_exact_copies_and_other_specs_conflict(router):
    store = Store(router.pool)
    router.run(advertise(store, "home", slots=4, device_type="cpu"))
    router.run(router.router.refresh_view())
    same = {"job_id": "race-1", "command": ["echo", "x"], "env": {"A": "'$(x)\n"}, "labels": {"k": "v"}}
    other = {**same, "command": ["echo", "y"]}
    bodies = [same] * 12 + [other] * 4
    replies = _race(router, bodies)
    decoded = [json.loads(raw) for raw in replies]
    # Either spec may have won the race; exactly one submit created the job.
    created = [i for i, reply in enumerate(decoded) if reply.get("duplicate") is False]
    assert len(created) == 1, decoded
    winner = bodies[created[0]]
    for body, raw, reply in zip(bodies, replies, decoded, strict=True):
        if body is winner or body == winner:
            assert raw in (replies[created[0]], _as_duplicate(replies[created[0]])), (raw, replies[created[0]])
        else:
            assert reply["error"]["code"] == "conflict", reply
    assert router.run(router.pool.fetchval("SELECT count(*) FROM jobs WHERE job_id = 'race-1'")) == 1
    assert router.run(router.pool.fetchval(
        "SELECT count(*) FROM federation_changelog WHERE job_id = 'race-1'")) == 1


def test_a_duplicate_after_a_cancel_and_of_a_rejected_job_is_still_the_first_reply(router):
    store = Store(router.pool)
    router.run(advertise(store, "home", slots=4, device_type="cpu"))
    router.run(router.router.refresh_view())
    queued = {"job_id": "cancel-dup", "command": ["true"], "cluster_pin": "gpu-west"}
    rejected = {"job_id": "reject-dup", "command": ["true"],
                "constraints": [{"key": "device_type", "op": "eq", "value": "quantum"}]}
    first_queued, first_rejected = _race(router, [queued, rejected])
    assert json.loads(first_rejected)["disposition"] == "reject"
    cancel = router.request("cancel", json.dumps({"job_id": "cancel-dup"}).encode())
    assert "error" not in cancel, cancel
    assert router.run(store.job_get("cancel-dup")).state == "killed"
    # Cancelling a rejected job changes nothing either.
    router.request("cancel", json.dumps({"job_id": "reject-dup"}).encode())
    again = _race(router, [queued, rejected, queued, rejected])
    assert again == [_as_duplicate(first_queued), _as_duplicate(first_rejected)] * 2


def test_two_routers_racing_one_job_id_create_it_once_and_answer_alike(router, database_url, servers):
    second = RouterThread(database_url, servers.nats_url)
    try:
        store = Store(router.pool)
        router.run(advertise(store, "home", slots=4, device_type="cpu"))
        router.run(router.router.refresh_view())
        second.run(second.router.refresh_view())
        body = {"job_id": "two-routers", "command": ["true"], "cluster_pin": "tpu-east"}
        replies = _race(router, [body] * 10, routers=[router, second])
        created = [raw for raw in replies if b'"duplicate":false' in raw]
        assert len(created) == 1, replies
        assert all(raw in (created[0], _as_duplicate(created[0])) for raw in replies), replies
        assert router.run(router.pool.fetchval(
            "SELECT count(*) FROM federation_changelog WHERE job_id = 'two-routers'")) == 1
    finally:
        second.close()
