"""Attack pass, round 11, on a real router, Postgres and nats-server: duplicate
submits answered from the lean job row (no stored reply), racing, after a cancel,
and a second router process racing the first."""

from __future__ import annotations

import asyncio
import json

from irisfed.services.common.store import Store
from tests.infra.factories import advertise
from tests.integration.test_hostile_input import RouterThread, router  # noqa: F401 - fixture


def _as_duplicate(first: bytes) -> bytes:
    assert first.count(b'"duplicate":false') == 1, first
    return first.replace(b'"duplicate":false', b'"duplicate":true')


def _race(router: RouterThread, bodies: list[dict], routers: list[RouterThread] | None = None) -> list[bytes]:  # noqa: F811
    """Every body sent at once (round robin over ``routers``' subjects); the raw replies, in order."""
    routers = routers or [router]

    async def ask() -> list[bytes]:
        replies = await asyncio.gather(*(
            router.client.request(f"{routers[i % len(routers)].prefix}.submit", json.dumps(body).encode(),
                                  timeout=15)
            for i, body in enumerate(bodies)))
        return [reply.data for reply in replies]
    return router.run(ask())


def test_racing_duplicates_get_one_first_reply_and_its_exact_copies_and_other_specs_conflict(router):  # noqa: F811
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


def test_a_duplicate_after_a_cancel_and_of_a_rejected_job_is_still_the_first_reply(router):  # noqa: F811
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


def test_two_routers_racing_one_job_id_create_it_once_and_answer_alike(router, database_url, servers):  # noqa: F811
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
