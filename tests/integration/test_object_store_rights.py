"""Who may touch which bytes (docs/design.md §3.5), enforced by a real nats-server with
one NATS user per role: a user puts and reads only its own workspaces and reads only
its own outputs; the router reads workspaces and sends them on to agents' inboxes; an
agent reads no workspace bucket and writes outputs only at its own peer; the dashboard
only reads outputs (an operator's download); the tick has no object store at all.
Each user's buckets, and each at each peer, are streams of their own, so another
user's digest or job, and another peer's outputs, are out of reach."""

from __future__ import annotations

import pytest

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import ObjectStore, ObjectStoreError, ensure_buckets
from irisfed.tooling.servers import start_secured_nats
from tests.infra.secured_nats import until

PREFIX = "acme"
ARCHIVE = b"workspace bytes of alice" * 100
PEERS = ["gpu", "cpu"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    server, auth = start_secured_nats(tmp_path_factory.mktemp("nats-rights"), PREFIX, PEERS,
                                      user_ids=["alice", "bob"])
    try:
        yield server, auth
    finally:
        server.stop()


@pytest.fixture
async def as_role(secured):
    server, auth = secured
    opened = []

    async def connect(role: str):
        nc = await connect_client(auth.url(server.url, role))
        opened.append(nc)
        return nc
    admin = await connect("admin")
    await ensure_buckets(admin, PREFIX, users=["alice", "bob"], peers=PEERS)
    yield connect
    for nc in opened:
        await nc.close()


def store(nc, user: str, peer: str | None = None) -> ObjectStore:
    return ObjectStore(nc, PREFIX, user=user, peer=peer, timeout_s=2.0)


async def refused(call) -> None:
    with pytest.raises(ObjectStoreError):
        await call


async def test_a_user_puts_and_reads_only_its_own_workspaces(as_role):
    alice, bob = await as_role("user-alice"), await as_role("user-bob")
    digest, size, _ = await store(alice, "alice").put_workspace(ARCHIVE)
    assert await store(alice, "alice").get_workspace(digest) == ARCHIVE
    await refused(store(bob, "alice").get_workspace(digest))  # bob's credentials, alice's bucket
    await refused(store(bob, "alice").has_workspace(digest))
    await refused(store(bob, "alice").put_workspace(b"planted by bob"))
    assert await store(bob, "bob").has_workspace(digest) is None  # not in bob's own bucket


async def test_outputs_are_written_by_an_agent_at_its_peer_and_read_only_by_their_user(as_role):
    agent, alice, bob = await as_role("agent-gpu"), await as_role("user-alice"), await as_role("user-bob")
    await store(agent, "alice", "gpu").put_output("alice:train-1", 1, 0, "model.pt", b"weights")
    assert await store(alice, "alice", "gpu").get_output("alice:train-1", 1, 0, "model.pt") == b"weights"
    await refused(store(bob, "alice", "gpu").get_output("alice:train-1", 1, 0, "model.pt"))
    await refused(store(alice, "alice", "gpu").put_output("alice:train-1", 1, 0, "model.pt", b"forged"))
    # Another peer's outputs (where readers look for the runs that peer owned) are out of reach.
    await refused(store(agent, "alice", "cpu").put_output("alice:train-1", 1, 0, "model.pt", b"forged"))
    cpu = await as_role("agent-cpu")
    await refused(store(cpu, "alice", "gpu").put_output("alice:train-1", 1, 0, "model.pt", b"forged"))
    await refused(store(cpu, "alice", "gpu").get_output("alice:train-1", 1, 0, "model.pt"))
    assert await store(alice, "alice", "gpu").get_output("alice:train-1", 1, 0, "model.pt") == b"weights"


async def test_an_agent_reads_no_workspace_and_only_the_router_reaches_its_inbox(as_role):
    """An agent gets a job's workspace from the router, on its own inbox: it may read no
    workspace bucket, and nobody but the router (and its own requests' answers) may
    put messages on that inbox, so no one can slip it other bytes."""
    import asyncio

    alice, router = await as_role("user-alice"), await as_role("router")
    gpu, cpu = await as_role("agent-gpu"), await as_role("agent-cpu")
    digest, size, _ = await store(alice, "alice").put_workspace(ARCHIVE)
    await refused(store(gpu, "alice").get_workspace(digest))
    await refused(store(gpu, "alice").has_workspace(digest))
    await refused(store(gpu, "alice").put_workspace(b"planted by an agent"))
    assert await store(router, "alice").get_workspace(digest) == ARCHIVE
    inbox = gpu.new_inbox()
    heard: asyncio.Queue = asyncio.Queue()

    async def hear(msg) -> None:
        heard.put_nowait(msg.data)
    await gpu.subscribe(inbox, cb=hear)
    await gpu.flush()
    for nc, data in ((alice, b"forged by alice"), (cpu, b"forged by another agent"), (router, b"the router's")):
        await nc.publish(inbox, data)
        await nc.flush()
    assert await asyncio.wait_for(heard.get(), 5) == b"the router's"  # published last, heard first
    assert heard.empty()


async def test_services_have_only_what_their_part_needs(as_role):
    alice, router, tick = await as_role("user-alice"), await as_role("router"), await as_role("tick")
    digest, size, _ = await store(alice, "alice").put_workspace(ARCHIVE)
    assert await store(router, "alice").has_workspace(digest) == size
    await refused(store(router, "alice").put_workspace(b"planted by the router"))
    await refused(store(router, "alice", "gpu").put_output("alice:x", 1, 0, "n", b"x"))
    await refused(store(router, "alice", "gpu").get_output("alice:x", 1, 0, "n"))
    await refused(store(tick, "alice").has_workspace(digest))
    operator = await as_role("operator")
    assert await store(operator, "bob").put_workspace(b"an operator's") is not None
    assert await store(operator, "bob", "cpu").put_output("bob:x", 1, 0, "n", b"x") == 1


async def test_the_dashboard_reads_outputs_and_nothing_else(as_role):
    agent, alice, web = await as_role("agent-gpu"), await as_role("user-alice"), await as_role("web")
    await store(agent, "alice", "gpu").put_output("alice:eval-1", 1, 0, "scores.json", b"{}")
    assert await store(web, "alice", "gpu").get_output("alice:eval-1", 1, 0, "scores.json") == b"{}"
    await refused(store(web, "alice", "gpu").put_output("alice:eval-1", 1, 0, "scores.json", b"forged"))
    digest, _, _ = await store(alice, "alice").put_workspace(ARCHIVE)
    await refused(store(web, "alice").get_workspace(digest))


async def test_no_role_but_admin_may_make_a_consumer_that_delivers_elsewhere(as_role):
    """A JetStream consumer delivers to any subject its creator names, and the server does
    not check the creator may publish there: a user allowed to make one on its own bucket
    could have a message it stored there delivered on another user's submit subject. So
    reads are direct gets and no role (admin aside) may make a consumer at all."""
    import json

    import nats.errors

    admin = await as_role("admin")
    stream = "OBJ_acme-workspaces-alice"
    forged = json.dumps({"command": ["sh", "-c", "echo pwned"], "job_id": "x"}).encode()
    for role in ("user-alice", "producer", "agent-gpu", "agent-cpu", "router", "web", "operator"):
        nc = await as_role(role)
        if role == "user-alice":
            await nc.publish("$O.acme-workspaces-alice.C.planted", forged)  # its own bucket: allowed
            await nc.flush()
        config = {"stream_name": stream, "config": {
            "deliver_subject": "acme.submit.bob", "filter_subject": "$O.acme-workspaces-alice.C.planted",
            "ack_policy": "none", "deliver_policy": "all"}}
        for subject in (f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.evil",
                        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.evil"):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request(subject, json.dumps(config).encode(), timeout=0.5)
    assert await admin.jetstream().consumers_info(stream) == []  # none was made


async def test_a_direct_get_answers_on_any_subject_so_every_handler_drops_its_answer(as_role):
    """A direct get is answered on whatever reply subject its asker names, unchecked by
    the server: a user may store a message in its own bucket and have it answered onto
    another user's submit subject (or a peer's heartbeat, or a cancel). Such an answer
    carries the stream's name, which is how every handler knows it for no client's
    publish and drops it (``from_jetstream``)."""
    import json

    from irisfed.services.common.bus import from_jetstream

    admin, alice = await as_role("admin"), await as_role("user-alice")
    heard = []

    async def hear(msg) -> None:
        heard.append(msg)
    for subject in ("acme.submit.bob", "acme.heartbeat.gpu", "acme.cancel.bob"):
        await admin.subscribe(subject, cb=hear)
    await admin.flush()
    forged = json.dumps({"command": ["sh", "-c", "echo pwned"], "job_id": "x"}).encode()
    await alice.jetstream().publish("$O.acme-workspaces-alice.C.planted", forged)  # its own bucket: allowed
    for reply in ("acme.submit.bob", "acme.heartbeat.gpu", "acme.cancel.bob"):
        await alice.publish("$JS.API.DIRECT.GET.OBJ_acme-workspaces-alice",
                            json.dumps({"last_by_subj": "$O.acme-workspaces-alice.C.planted"}).encode(), reply=reply)
    await alice.flush()
    await until(lambda: len(heard) == 3, what=lambda: [msg.subject for msg in heard])
    assert sorted(msg.subject for msg in heard) == ["acme.cancel.bob", "acme.heartbeat.gpu", "acme.submit.bob"]
    assert [(msg.data, from_jetstream(msg)) for msg in heard] == [(forged, True)] * 3, [msg.headers for msg in heard]
