"""The router accepts a submit's workspace only when the object store holds it (docs/
design.md §3.5): a digest never stored, stored with another size, or over
max_workspace_mb is ``invalid_request`` and writes nothing; dry runs are checked the
same; a store that is missing says so. Real nats-server with JetStream, real Postgres."""

from __future__ import annotations

import contextlib
import json

import pytest

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import (
    ObjectStore,
    StoreUnavailable,
    bucket,
    ensure_buckets,
    workspace_object,
)
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.workspaces import (
    WorkspaceCache,
    WorkspaceUnusable,
    fetch_through_router,
)
from irisfed.shared.messages import FETCH_PART
from irisfed.shared.workspace import digest_of
from tests.infra.archives import archive, member
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.routers import RouterThread

DATA = archive(member("train.py", data=b"print(1)\n"))
BIG = archive(*(member(f"part-{i}.bin", data=bytes([i]) * 200_000) for i in range(4)))  # several chunks


@pytest.fixture
def ws_router(database_url, servers):
    running = RouterThread(database_url, servers.nats_url, max_workspace_mb=1)
    running.servers = servers  # each peer's agent asks with its own NATS user (and inbox)
    yield running
    running.close()


@contextlib.asynccontextmanager
async def agent_of(router: RouterThread, peer: str):
    """A NATS client as ``peer``'s agent: its own user and inbox, as a real agent asks."""
    nc = await connect_client(router.servers.nats_url_for(f"agent-{peer}"))
    try:
        yield nc
    finally:
        await nc.close()


def _store(router: RouterThread, data: bytes, buckets: bool = True) -> None:
    async def put():
        if buckets:
            await ensure_buckets(router.client, router.prefix)
        await ObjectStore(router.client, router.prefix).put_workspace(data)
    router.run(put())


def _submit(router: RouterThread, workspace: dict, **fields) -> dict:
    return router.request("submit", json.dumps({"command": ["true"], "workspace": workspace, **fields}).encode())


def test_a_stored_workspace_is_accepted_and_kept_in_the_spec(ws_router):
    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    reply = _submit(ws_router, workspace)
    assert "error" not in reply, reply  # judged like any job (no peer heard here: rejected)
    spec = ws_router.run(ws_router.pool.fetchval("SELECT spec FROM jobs WHERE job_id = $1", reply["job_id"]))
    assert (json.loads(spec) if isinstance(spec, str) else spec)["workspace"] == workspace
    again = _submit(ws_router, workspace)
    assert "error" not in again
    assert ws_router.router.workspaces.lookups == 1  # a digest seen stored is remembered


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_digest_never_stored_is_invalid_and_writes_nothing(ws_router, dry_run):
    _store(ws_router, DATA)
    before = ws_router.rows()
    other = archive(member("other.py", data=b"x"))
    reply = _submit(ws_router, {"digest": digest_of(other), "size": len(other)}, dry_run=dry_run)
    assert reply["error"]["code"] == "invalid_request"
    assert reply["error"]["message"] == (f"workspace: {digest_of(other)} is not in the federation's object "
                                         "store; store it first (irisfed submit --workspace DIR does)")
    assert ws_router.rows() == before


def test_another_size_or_over_the_cap_is_invalid(ws_router):
    _store(ws_router, DATA)
    before = ws_router.rows()
    wrong = _submit(ws_router, {"digest": digest_of(DATA), "size": len(DATA) + 1})
    assert wrong["error"]["code"] == "invalid_request" and "not the" in wrong["error"]["message"]
    big = _submit(ws_router, {"digest": digest_of(DATA), "size": 2 * 1024 * 1024})
    assert big["error"] == {"code": "invalid_request",
                            "message": "workspace: 2.0 MiB is over this federation's max_workspace_mb (1 MiB)"}
    malformed = _submit(ws_router, {"digest": "sha256:XYZ", "size": 1})
    assert malformed["error"]["code"] == "invalid_request" and "workspace.digest" in malformed["error"]["message"]
    assert ws_router.rows() == before


def test_a_missing_object_store_is_unavailable_in_one_line(ws_router):
    before = ws_router.rows()
    reply = _submit(ws_router, {"digest": digest_of(DATA), "size": len(DATA)})
    assert reply["error"]["code"] == "unavailable"
    assert "object store" in reply["error"]["message"] and "\n" not in reply["error"]["message"]
    assert ws_router.rows() == before


def test_a_user_cannot_name_another_users_workspace(database_url, servers):
    router = RouterThread(database_url, servers.nats_url, users=[{"id": "alice"}, {"id": "bob"}])
    try:
        async def put_bobs() -> None:
            await ensure_buckets(router.client, router.prefix, users=["alice", "bob"])
            await ObjectStore(router.client, router.prefix, user="bob").put_workspace(DATA)
        router.run(put_bobs())
        body = json.dumps({"command": ["true"], "workspace": {"digest": digest_of(DATA), "size": len(DATA)}})
        before = router.rows()
        as_alice = router.request("submit.alice", body.encode())
        assert as_alice["error"]["code"] == "invalid_request" and "not in" in as_alice["error"]["message"]
        assert router.rows() == before
        as_bob = router.request("submit.bob", body.encode())
        assert "error" not in as_bob, as_bob
    finally:
        router.close()


def _assigned(router: RouterThread, peer: str, **fields) -> str:
    """A job assigned to ``peer`` under epoch 1; its id."""
    job = make_job(**fields)

    async def place():
        store = Store(router.pool)
        await insert_jobs(store, [job])
        await assign_jobs(store, [job], peer)
    router.run(place())
    return job.job_id


async def _fetch_async(router: RouterThread, peer: str, job_id: str, epoch: int = 1,
                       body: bytes | None = None, reply: str | None = None, from_seq: int = 0) -> tuple[bytes, dict]:
    """What one fetch request brings: the store's chunks joined (one window), and the
    router's end as JSON."""
    async with agent_of(router, peer) as nc:
        return await _ask(nc, router, peer, job_id, epoch, body, reply, from_seq)


async def _ask(nc, router: RouterThread, peer: str, job_id: str, epoch: int, body: bytes | None, reply: str | None,
               from_seq: int) -> tuple[bytes, dict]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(f"{router.prefix}.fetch.{peer}",
                         body or json.dumps({"job_id": job_id, "epoch": epoch, "from_seq": from_seq}).encode(),
                         reply=reply or inbox)
        data, end, closed = b"", None, False
        while end is None or ("error" not in end and not closed):
            msg = await sub.next_msg(timeout=10)
            headers = msg.headers or {}
            if headers.get(FETCH_PART) == "end":
                end = json.loads(msg.data)
            elif "Status" in headers:
                closed = True
            else:
                data += msg.data
        return data, end
    finally:
        await sub.unsubscribe()


def _fetch(router: RouterThread, peer: str, job_id: str, epoch: int = 1, **options) -> tuple[bytes, dict]:
    return router.run(_fetch_async(router, peer, job_id, epoch, **options))


def test_a_workspace_is_sent_only_to_the_peer_its_job_is_assigned_to(ws_router):
    """Agents read no workspace bucket: the router sends a job's workspace to the agent
    of the job's peer, under the job's epoch, and to nobody else."""
    _store(ws_router, BIG)
    workspace = {"digest": digest_of(BIG), "size": len(BIG)}
    job_id = _assigned(ws_router, "gpu-west", workspace=workspace)
    for peer, epoch in (("tpu-east", 1), ("gpu-west", 2), ("gpu-west", 0)):  # another peer, stale epochs
        data, end = _fetch(ws_router, peer, job_id, epoch)
        assert data == b"" and end["error"]["code"] == "forbidden", end
        assert f"not assigned to {peer} under epoch {epoch}" in end["error"]["message"]
    assert _fetch(ws_router, "gpu-west", "job-none")[1]["error"]["message"] == "fetch: no such job"
    plain = _assigned(ws_router, "gpu-west")
    assert _fetch(ws_router, "gpu-west", plain)[1]["error"]["message"] == f"fetch: job {plain} has no workspace"
    data, end = _fetch(ws_router, "gpu-west", job_id)
    assert {k: end[k] for k in ("job_id", "digest", "size")} == {"job_id": job_id, **workspace}
    assert end["sha256"].startswith("SHA-256=")  # the store's own record of the bytes
    assert data == BIG  # in several chunks, in order
    assert ws_router.router.relay.relays == 1


def test_bad_fetch_requests_are_refused_in_one_line(ws_router):
    _store(ws_router, DATA)
    for body, why in ((b"x" * 2000, "the request is over 1024 bytes"), (b"{", "fetch: "),
                      (json.dumps({"job_id": "../../etc", "epoch": 1}).encode(), "job_id is not a job id"),
                      (json.dumps({"job_id": "a\u0000b", "epoch": 1}).encode(), "NUL"),
                      (json.dumps({"job_id": "job-1", "epoch": 1, "from_seq": -1}).encode(),
                       "from_seq must be 0 or more")):
        data, end = _fetch(ws_router, "gpu-west", "-", body=body)
        assert data == b"" and end["error"]["code"] == "invalid_request" and why in end["error"]["message"], end


def test_concurrent_fetches_each_get_the_whole_workspace(ws_router):
    import asyncio

    _store(ws_router, BIG)
    workspace = {"digest": digest_of(BIG), "size": len(BIG)}
    jobs = [_assigned(ws_router, "tpu-east", workspace=workspace) for _ in range(6)]

    async def all_at_once():
        return await asyncio.gather(*(_fetch_async(ws_router, "tpu-east", job_id) for job_id in jobs))
    answers = ws_router.run(all_at_once())
    assert [(data == BIG, end.get("digest")) for data, end in answers] == [(True, workspace["digest"])] * 6


def test_a_workspace_gone_from_the_store_is_not_found_and_a_forged_reply_subject_unanswered(ws_router):
    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    job_id = _assigned(ws_router, "gpu-west", workspace=workspace)

    async def forged() -> list:
        """Requests whose reply subject is not the asking agent's inbox (an object store
        chunk subject, a peer's assignments, another agent's or a user's inbox): the
        store would send the chunks there on the router's word."""
        heard = []

        async def hear(msg) -> None:
            heard.append(msg)
        subs = [await ws_router.client.subscribe(subject, cb=hear)
                for subject in ("$O.>", f"{ws_router.prefix}.assign.>", "elsewhere.>", "_INBOX_agent-tpu-east.>",
                                "_INBOX_user-alice.>")]
        async with agent_of(ws_router, "gpu-west") as agent:  # a hostile agent, with its own rights
            for reply in (f"$O.{ws_router.prefix}-workspaces.C.planted", f"{ws_router.prefix}.assign.gpu-west",
                          "elsewhere.x", "_INBOX_agent-tpu-east.leak", "_INBOX_user-alice.leak"):
                await agent.publish(f"{ws_router.prefix}.fetch.gpu-west",
                                    json.dumps({"job_id": job_id, "epoch": 1}).encode(), reply=reply)
            await agent.flush()
        assert (await _fetch_async(ws_router, "gpu-west", job_id))[0] == DATA  # answered after them
        for sub in subs:
            await sub.unsubscribe()
        return heard
    assert ws_router.run(forged()) == []
    ws_router.run(ObjectStore(ws_router.client, ws_router.prefix).delete_workspace(workspace["digest"]))
    data, end = _fetch(ws_router, "gpu-west", job_id)
    assert data == b"" and end["error"]["code"] == "not_found"
    assert "is not in the object store" in end["error"]["message"]


def test_a_workspace_comes_window_by_window_and_only_its_own_chunks(ws_router):
    """The agent's fetch asks for each next window from where the last one stopped;
    whatever sequence it names, the store sends only the chunks of the job's own
    workspace (another stored before it, and one after, never come)."""
    before, after = archive(member("before.bin", data=b"b" * 300_000)), archive(member("after.bin", data=b"a" * 50))
    _store(ws_router, before)
    _store(ws_router, BIG)
    _store(ws_router, after)
    workspace = {"digest": digest_of(BIG), "size": len(BIG)}
    job_id = _assigned(ws_router, "gpu-west", workspace=workspace)
    data, end = _fetch(ws_router, "gpu-west", job_id, from_seq=1)  # the stream's very first message
    assert data == BIG and end["size"] == len(BIG)

    ws_router.router.relay.window_bytes = 200_000  # two 128 KiB chunks at most: several windows
    relays = ws_router.router.relay.relays
    chunks: list[bytes] = []
    async def fetch():
        async with agent_of(ws_router, "gpu-west") as nc:
            return await fetch_through_router(nc, f"{ws_router.prefix}.fetch.gpu-west", (job_id, 1),
                                              workspace["digest"], 2**20, chunks.append)
    stored = ws_router.run(fetch())
    assert b"".join(chunks) == BIG and stored == end["sha256"]
    chunks_stored = -(-len(BIG) // (128 * 1024))
    assert 1 < ws_router.router.relay.relays - relays <= chunks_stored  # several windows, each a chunk or two


def test_other_bytes_under_a_digest_fail_the_job_for_good_and_garbled_ones_are_retried(ws_router, tmp_path):
    """Bytes that match the store's own record of them but not the digest are what the
    store holds: the agent refuses the workspace (the job fails). Bytes that match
    neither could have been garbled on the way: tried again (a launch error)."""

    digest = _stored_then_overwritten(ws_router)
    job_id = _assigned(ws_router, "gpu-west", workspace={"digest": digest, "size": len(DATA)})

    async def fetch(digest, user, job, sink):
        async with agent_of(ws_router, "gpu-west") as nc:
            return await fetch_through_router(nc, f"{ws_router.prefix}.fetch.gpu-west", job, digest, 2**20, sink)

    async def acquire(root, fetcher):
        cache = await WorkspaceCache(root, fetcher, max_bytes=2**20, max_files=100, max_unpacked_bytes=2**20).open()
        await cache.acquire(digest, job=(job_id, 1))
    with pytest.raises(WorkspaceUnusable, match="holds other bytes"):
        ws_router.run(acquire(tmp_path / "a", fetch))
    assert not any((tmp_path / "a").rglob("train.py"))

    async def garbled(digest, user, job, sink):
        await fetch(digest, user, job, lambda chunk: sink(bytes([chunk[0] ^ 0xFF]) + chunk[1:]))
        return "SHA-256=not-what-came"
    with pytest.raises(StoreUnavailable, match="not the workspace"):
        ws_router.run(acquire(tmp_path / "b", garbled))


def _stored_then_overwritten(router: RouterThread) -> str:
    """DATA's digest, the object under its name then overwritten with other bytes."""
    _store(router, DATA)
    digest = digest_of(DATA)

    async def overwrite():
        raw = await router.client.jetstream().object_store(bucket(router.prefix, "workspaces"))
        await raw.put(workspace_object(digest), DATA[:-1] + bytes([DATA[-1] ^ 1]))
    router.run(overwrite())
    return digest


def test_a_peer_asking_for_window_after_window_is_told_to_wait(ws_router):
    """A window costs the router a small request but the store up to 8 MiB: past its
    budget a peer is told `unavailable` (its agent asks again after a pause), another
    peer is not held up."""
    from irisfed.services.router.workspaces import WindowBudget

    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    west, east = (_assigned(ws_router, peer, workspace=workspace) for peer in ("gpu-west", "tpu-east"))
    ws_router.router.relay.budget = WindowBudget(rate=0.001, burst=2)
    answers = [_fetch(ws_router, "gpu-west", west) for _ in range(3)]
    assert [data == DATA for data, _ in answers] == [True, True, False]
    assert answers[2][1]["error"]["code"] == "unavailable" and "windows a second" in answers[2][1]["error"]["message"]
    assert _fetch(ws_router, "tpu-east", east)[0] == DATA


def test_an_object_whose_metadata_names_a_wildcard_for_its_chunks_is_refused(ws_router):
    """A user writes its own bucket's metadata too: an object naming ``>`` as its chunks
    would have the store send every chunk of that bucket. Refused, the job's for good."""
    import base64

    _store(ws_router, DATA)  # the bucket exists
    digest = digest_of(b"never stored as chunks")
    name = workspace_object(digest)
    stream_bucket = bucket(ws_router.prefix, "workspaces")
    meta = {"name": name, "bucket": stream_bucket, "nuid": ">", "size": 10, "chunks": 1,
            "digest": "SHA-256=" + "A" * 43 + "=", "mtime": "2026-12-08T00:00:00Z"}

    async def plant():
        subject = f"$O.{stream_bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        await ws_router.client.publish(subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
        await ws_router.client.flush()
    ws_router.run(plant())
    job_id = _assigned(ws_router, "gpu-west", workspace={"digest": digest, "size": 10})
    data, end = _fetch(ws_router, "gpu-west", job_id)
    assert data == b"" and end["error"]["code"] == "invalid_request", end
    assert "names no chunks of its own" in end["error"]["message"]
