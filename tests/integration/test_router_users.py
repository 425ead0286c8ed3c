"""The router with several users, on real Postgres and nats-server: the subject names
the user, ids are scoped by it, and LOCAL jobs of users with quotas are assigned only
under their quota locks, whichever router takes them."""

from __future__ import annotations

import asyncio
import json

from irisfed.services.common.store import Store
from tests.infra.factories import advertise
from tests.infra.routers import RouterThread

USERS = [{"id": "alice", "quota": {"slots": 3}}, {"id": "bob"}]


def _home(router: RouterThread, slots: int = 50) -> Store:
    store = Store(router.pool)
    router.run(advertise(store, "home", slots=slots, device_type="cpu"))
    router.run(router.router.refresh_view())
    return store


def test_local_jobs_past_the_quota_wait_queued_and_repeat_their_first_reply(database_url, servers):
    router = RouterThread(database_url, servers.nats_url, users=USERS)
    try:
        store = _home(router)
        first = [router.reply_to("submit.alice", {"job_id": f"q{i}", "command": ["true"]}) for i in range(5)]
        replies = [json.loads(raw) for raw in first]
        assert [(r["job_id"], r["disposition"], r["state"]) for r in replies] == [
            ("q0", "local", "assigned"), ("q1", "local", "assigned"), ("q2", "local", "assigned"),
            ("q3", "local", "queued"), ("q4", "local", "queued")]
        assert replies[3]["reason"] == "quota: this job's 1 slots would take alice over its quota of 3 slots"
        job = router.run(store.job_get("alice:q3"))
        assert (job.state, job.owner_peer_id, job.user_id) == ("queued", None, "alice")
        assert job.explanation["wait"] == "quota" and job.explanation["rule"] == replies[3]["reason"]
        # A resubmission gets the first reply again, byte for byte but `duplicate`.
        for raw, i in ((first[0], 0), (first[3], 3)):
            again = router.reply_to("submit.alice", {"job_id": f"q{i}", "command": ["true"]})
            assert again == raw.replace(b'"duplicate":false', b'"duplicate":true')
        # Bob has no quota; the default user neither.
        assert json.loads(router.reply_to("submit.bob", {"command": ["true"]}))["state"] == "assigned"
        assert json.loads(router.reply_to("submit", {"command": ["true"]}))["state"] == "assigned"
    finally:
        router.close()


def test_two_routers_racing_never_assign_past_a_quota(database_url, servers):
    one = RouterThread(database_url, servers.nats_url, users=USERS)
    two = RouterThread(database_url, servers.nats_url, prefix=one.prefix, users=USERS)
    try:
        store = _home(one)
        two.run(two.router.refresh_view())

        async def burst() -> list[dict]:
            replies = await asyncio.gather(*(
                one.client.request(f"{one.prefix}.submit.alice",
                                   json.dumps({"job_id": f"r{i}", "command": ["true"]}).encode(), timeout=15)
                for i in range(40)))
            return [json.loads(r.data) for r in replies]

        replies = one.run(burst())
        assert all("error" not in r for r in replies), replies
        states = [r["state"] for r in replies]
        assert states.count("assigned") == 3 and states.count("queued") == 37
        rows = one.run(store.job_list(None, 100, user_id="alice"))
        assert sum(1 for r in rows if r.state == "assigned") == 3
        assert one.router.batches_committed and two.router.batches_committed  # both took part
    finally:
        two.close()
        one.close()


def test_subjects_decide_the_user_and_peers_notices_are_not_requests(database_url, servers):
    router = RouterThread(database_url, servers.nats_url, users=USERS)
    try:
        store = _home(router)
        for subject in ("submit", "submit.alice", "submit.bob"):
            assert json.loads(router.reply_to(subject, {"job_id": "same", "command": ["true"]}))["job_id"] == "same"
        rows = router.run(store.job_list(None, 10))
        assert sorted((r.job_id, r.user_id) for r in rows) == [
            ("alice:same", "alice"), ("bob:same", "bob"), ("same", "default")]
        refused = json.loads(router.reply_to("cancel.alice", {"job_id": "nope"}))
        assert refused["error"] == {"code": "not_found", "message": "no job 'nope'"}
        forbidden = json.loads(router.reply_to("submit.carol", {"command": ["true"]}))
        assert forbidden["error"]["code"] == "forbidden"
        # A request on a peer's cancel-notice subject (P.cancel.home) gets no answer and changes nothing.
        try:
            router.reply_to("cancel.home", {"job_id": "same"}, timeout=1)
        except Exception as exc:  # noqa: BLE001 - no responder, or no reply in time
            assert "timeout" in type(exc).__name__.lower() or "responders" in type(exc).__name__.lower()
        else:
            raise AssertionError("the router answered a peer's cancel-notice subject")
        assert not router.run(store.job_get("same")).cancel_requested
        # The operator subject takes stored ids, and names the operator.
        reply = json.loads(router.reply_to("operator.cancel", {"job_id": "bob:same", "by": "web"}))
        assert reply["job_id"] == "bob:same"
        assert router.run(store.job_get("bob:same")).cancel_requested_by == "operator (web)"
        for bad in ({"job_id": "same", "by": "Web Ops"}, {"job_id": "bob:same", "user": "bob"},
                    {"job_id": "bob::same"}):
            assert json.loads(router.reply_to("operator.cancel", bad))["error"]["code"] == "invalid_request"
    finally:
        router.close()


def test_a_reply_subject_inside_the_federation_is_never_answered(database_url, servers):
    """A requester may name any reply subject; the router may publish on peers' cancel
    notices, assignments and users' subjects, so a request whose reply would land there
    is dropped unanswered (and writes nothing)."""
    router = RouterThread(database_url, servers.nats_url, users=USERS)
    try:
        store = _home(router)

        async def forge() -> list[bytes]:
            heard: list[bytes] = []

            async def spy(msg) -> None:
                heard.append(msg.data)

            await router.client.subscribe(f"{router.prefix}.>", cb=spy)
            for subject, body, reply in (
                    ("submit.alice", {"job_id": "f1", "command": ["true"]}, f"{router.prefix}.cancel.home"),
                    ("submit", {"job_id": "f2", "command": ["true"]}, f"{router.prefix}.assign.home"),
                    ("cancel.bob", {"job_id": "x"}, f"{router.prefix}.submit.alice"),
                    ("operator.cancel", {"job_id": "x"}, f"{router.prefix}.events.x")):
                await router.client.publish(f"{router.prefix}.{subject}", json.dumps(body).encode(), reply=reply)
            await router.client.flush()
            await asyncio.sleep(1.0)  # a reply, were one sent, would have come by now
            return heard

        heard = router.run(forge())
        assert all(b'"disposition"' not in data and b'"error"' not in data and b'"outcome"' not in data
                   for data in heard), heard
        assert router.run(store.job_list(None, 10)) == []
        # The same requests with an inbox of their own are answered.
        assert json.loads(router.reply_to("submit.alice", {"job_id": "f1", "command": ["true"]}))["job_id"] == "f1"
    finally:
        router.close()


def test_a_submit_the_store_answered_onto_another_users_subject_makes_no_job(database_url, servers):
    """A user may store any bytes in its own bucket and have a direct get answered onto
    ``P.submit.<another user>``: the router drops what JetStream sent out of a stream,
    so no job is made in that user's name (tests/integration/test_object_store_rights.py
    shows the server delivers it)."""
    from irisfed.services.common.objects import bucket, ensure_buckets

    router = RouterThread(database_url, servers.nats_url, users=USERS)
    try:
        store = _home(router)
        chunks = f"$O.{bucket(router.prefix, 'workspaces', 'alice')}"

        async def forge() -> None:
            await ensure_buckets(router.client, router.prefix, users=["alice", "bob"])
            await router.client.jetstream().publish(  # stored before it is asked for
                f"{chunks}.C.planted", json.dumps({"job_id": "forged", "command": ["true"]}).encode())
            await router.client.publish(f"$JS.API.DIRECT.GET.OBJ_{bucket(router.prefix, 'workspaces', 'alice')}",
                                        json.dumps({"last_by_subj": f"{chunks}.C.planted"}).encode(),
                                        reply=f"{router.prefix}.submit.bob")
            await router.client.flush()
        router.run(forge())
        # Bob's own submit after it: answered, so the router has read what came before.
        assert json.loads(router.reply_to("submit.bob", {"job_id": "own", "command": ["true"]}))["job_id"] == "own"
        assert router.run(store.job_get("bob:forged")) is None
        assert router.run(store.job_get("bob:own")) is not None
    finally:
        router.close()
