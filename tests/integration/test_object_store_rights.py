"""Who may touch which bytes (docs/design.md §3.5), enforced by a real nats-server with
one NATS user per role: a user puts and reads only its own workspaces and reads only
its own outputs; the router only looks workspaces up; agents read workspaces and write
outputs; the tick has no object store at all. Each user's buckets are streams of their
own, so another user's digest or job is out of reach of its credentials."""

from __future__ import annotations

import pytest

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import ObjectStore, ObjectStoreError, ensure_buckets
from irisfed.tooling.servers import start_secured_nats

PREFIX = "acme"
ARCHIVE = b"workspace bytes of alice" * 100


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    server, auth = start_secured_nats(tmp_path_factory.mktemp("nats-rights"), PREFIX, ["gpu"],
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
    await ensure_buckets(admin, PREFIX, users=["alice", "bob"])
    yield connect
    for nc in opened:
        await nc.close()


def store(nc, user: str) -> ObjectStore:
    return ObjectStore(nc, PREFIX, user=user, timeout_s=2.0)


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


async def test_outputs_are_written_by_agents_and_read_only_by_their_user(as_role):
    agent, alice, bob = await as_role("agent-gpu"), await as_role("user-alice"), await as_role("user-bob")
    await store(agent, "alice").put_output("alice:train-1", 1, 0, "model.pt", b"weights")
    assert await store(alice, "alice").get_output("alice:train-1", 1, 0, "model.pt") == b"weights"
    await refused(store(bob, "alice").get_output("alice:train-1", 1, 0, "model.pt"))
    await refused(store(alice, "alice").put_output("alice:train-1", 1, 0, "model.pt", b"forged"))
    assert await store(alice, "alice").get_output("alice:train-1", 1, 0, "model.pt") == b"weights"


async def test_services_have_only_what_their_part_needs(as_role):
    alice, agent = await as_role("user-alice"), await as_role("agent-gpu")
    router, tick = await as_role("router"), await as_role("tick")
    digest, size, _ = await store(alice, "alice").put_workspace(ARCHIVE)
    assert await store(agent, "alice").get_workspace(digest) == ARCHIVE
    await refused(store(agent, "alice").put_workspace(b"planted by an agent"))
    assert await store(router, "alice").has_workspace(digest) == size
    await refused(store(router, "alice").put_workspace(b"planted by the router"))
    await refused(store(router, "alice").put_output("alice:x", 1, 0, "n", b"x"))
    await refused(store(tick, "alice").has_workspace(digest))
    operator = await as_role("operator")
    assert await store(operator, "bob").put_workspace(b"an operator's") is not None
