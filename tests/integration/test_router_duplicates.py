"""Invariant 2 on a real router and Postgres: a duplicate gets the first reply again,
byte for byte but ``duplicate``, though no row stores that reply; and a job's
explanation, stored once per decision, reads back as the router built it."""

import json

from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from irisfed.shared.federation.router import PeerRouter, RoutingRequest
from tests.infra.factories import advertise
from tests.integration.test_hostile_input import router  # noqa: F401 - fixture


def _raw(router, body: dict) -> bytes:  # noqa: F811
    async def ask() -> bytes:
        reply = await router.client.request(f"{router.prefix}.submit", json.dumps(body).encode(), timeout=10)
        return reply.data
    return router.run(ask())


def _as_duplicate(first: bytes) -> bytes:
    assert first.count(b'"duplicate":false') == 1, first
    return first.replace(b'"duplicate":false', b'"duplicate":true')


def test_duplicates_get_the_first_reply_in_every_disposition_and_after_moves(router):  # noqa: F811
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


def test_a_different_spec_under_the_same_id_is_still_a_conflict(router):  # noqa: F811
    assert "error" not in json.loads(_raw(router, {"job_id": "c", "command": ["true"], "cluster_pin": "gpu-west"}))
    reply = json.loads(_raw(router, {"job_id": "c", "command": ["false"], "cluster_pin": "gpu-west"}))
    assert reply["error"]["code"] == "conflict"


def test_one_explanation_row_per_distinct_decision_read_back_whole(router):  # noqa: F811
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
