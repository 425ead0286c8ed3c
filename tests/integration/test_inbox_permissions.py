"""Replies are private: every NATS user has its own inbox prefix (``_INBOX_<user>``)
and may subscribe only there, so no producer can read another client's replies."""

from __future__ import annotations

import asyncio
import json

from tests.infra.secured_nats import SECURED_PEERS, connect_as, connected, until


async def test_a_producer_cannot_read_another_clients_replies(secured_nats):
    auth, server = secured_nats
    errors: list[str] = []
    responder = await connect_as(auth, server, "router", errors)
    spy = await connect_as(auth, server, "producer", errors)
    asker = await connect_as(auth, server, "operator", errors, inbox_prefix="_INBOX_operator")
    overheard = []

    async def respond(msg):
        await msg.respond(b"private answer")

    async def on_overheard(msg):
        overheard.append(msg.data)

    try:
        await responder.subscribe("irisfed.cancel", cb=respond)
        await responder.flush()
        for subject in ("_INBOX.>", "_INBOX_operator.>", ">"):
            await spy.subscribe(subject, cb=on_overheard)
        await spy.flush()
        reply = await asker.request("irisfed.cancel", b"{}", timeout=5)
        assert reply.data == b"private answer"
        await until(lambda: sum("subscription" in e for e in errors) >= 3, what=lambda: errors)
        await asyncio.sleep(0.2)
        assert overheard == []  # the spy heard nothing of the operator's reply
        assert any('subscription to "_inbox.>"' in e.lower() for e in errors)
        assert any('subscription to "_inbox_operator.>"' in e.lower() for e in errors)
    finally:
        for client in (responder, spy, asker):
            await client.close()


async def test_each_requesting_user_may_subscribe_only_to_its_own_inbox(secured_nats):
    auth, server = secured_nats
    for role in ("producer", "operator"):
        assert auth.permissions[role].subscribe[-1] == f"_INBOX_{role}.>"
    for role, perms in auth.permissions.items():
        if role != "admin":
            assert not any(s.startswith("_INBOX.") or s in (">", "_INBOX.>") for s in perms.subscribe), role
    async with connected(secured_nats, "producer") as (errors, producer):
        await producer.subscribe("_INBOX_producer.abc")
        await producer.flush()
        await asyncio.sleep(0.2)
        assert errors == []
        await producer.subscribe("_INBOX_agent-home.>")
        await until(lambda: errors, what=lambda: errors)
        assert "subscription" in errors[0]


async def test_our_clients_use_their_users_prefix_end_to_end(secured_nats, database_url):
    """A real router answers a producer's and the operator's requests under these permissions."""
    from irisfed.services.common import db
    from irisfed.services.common.bus import connect_client, connect_nats
    from irisfed.services.router.service import Router
    from tests.infra.factories import make_config

    auth, server = secured_nats
    pool = await db.connect(database_url)
    service_nc = await connect_nats(auth.url(server.url, "router"), "irisfed-router")
    router = Router(make_config(subject_prefix="irisfed", peers=[{"id": p} for p in SECURED_PEERS]), pool, service_nc)
    await router.start()
    producer = await connect_client(auth.url(server.url, "producer"))
    operator = await connect_client(auth.url(server.url, "operator"))
    try:
        reply = json.loads((await producer.request("irisfed.submit", json.dumps(
            {"command": ["true"], "job_id": "inbox-1"}).encode(), timeout=10)).data)
        assert reply["job_id"] == "inbox-1" and "error" not in reply, reply
        reply = json.loads((await operator.request("irisfed.cancel", b'{"job_id": "inbox-1"}', timeout=10)).data)
        assert reply["job_id"] == "inbox-1" and "outcome" in reply, reply
    finally:
        await router.close()
        for client in (producer, operator, service_nc):
            await client.close()
        await pool.close()


def test_the_inbox_prefix_follows_the_url_user(monkeypatch):
    from irisfed.shared.nats_urls import INBOX_PREFIX_ENV, inbox_prefix_for_url

    monkeypatch.delenv(INBOX_PREFIX_ENV, raising=False)
    assert inbox_prefix_for_url("nats://producer:pw@h:4222") == "_INBOX_producer"
    assert inbox_prefix_for_url("nats://agent-gpu-west:pw@a:1,nats://agent-gpu-west:pw@b:1") == "_INBOX_agent-gpu-west"
    assert inbox_prefix_for_url("nats://h:4222") == "_INBOX"  # no auth: the NATS default
    assert inbox_prefix_for_url("nats://s3cr3t-token@h:4222") == "_INBOX"  # a token never becomes a subject
    assert inbox_prefix_for_url("nats://a.b:pw@h:4222") == "_INBOX"  # not a plain subject token
    monkeypatch.setenv(INBOX_PREFIX_ENV, "_INBOX_team7")
    assert inbox_prefix_for_url("nats://producer:pw@h:4222") == "_INBOX_team7"
