"""The router accepts a submit's workspace only when the object store holds it (docs/
design.md §3.5): a digest never stored, stored with another size, or over
max_workspace_mb is ``invalid_request`` and writes nothing; dry runs are checked the
same; a store that is missing says so. Real nats-server with JetStream, real Postgres."""

from __future__ import annotations

import json

import pytest

from irisfed.services.common.objects import ObjectStore, ensure_buckets
from irisfed.services.common.store import Store
from irisfed.shared.workspace import digest_of
from tests.infra.archives import archive, member
from tests.infra.factories import assign_jobs, insert_jobs, make_job
from tests.infra.routers import RouterThread

DATA = archive(member("train.py", data=b"print(1)\n"))


@pytest.fixture
def ws_router(database_url, servers):
    running = RouterThread(database_url, servers.nats_url, max_workspace_mb=1)
    yield running
    running.close()


def _store(router: RouterThread, data: bytes, buckets: bool = True) -> None:
    async def put():
        if buckets:
            await ensure_buckets(router.client, router.prefix, peers=["home", "gpu-west", "tpu-east"])
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


def _stage(router: RouterThread, peer: str, job_id: str, epoch: int = 1) -> dict:
    return router.request(f"stage.{peer}", json.dumps({"job_id": job_id, "epoch": epoch}).encode())


def test_a_workspace_is_staged_only_for_the_peer_its_job_is_assigned_to(ws_router):
    """Agents read only their own peer's buckets: the router copies a job's workspace
    there for that peer, under the job's epoch, and for nobody else."""
    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    job_id = _assigned(ws_router, "gpu-west", workspace=workspace)
    at = {peer: ObjectStore(ws_router.client, ws_router.prefix, peer=peer) for peer in ("gpu-west", "tpu-east")}
    for peer, epoch in (("tpu-east", 1), ("gpu-west", 2), ("gpu-west", 0)):  # another peer, stale epochs
        reply = _stage(ws_router, peer, job_id, epoch)
        assert reply["error"]["code"] == "forbidden", reply
        assert f"not assigned to {peer} under epoch {epoch}" in reply["error"]["message"]
    assert _stage(ws_router, "gpu-west", "job-none")["error"]["message"] == "stage: no such job"
    plain = _assigned(ws_router, "gpu-west")
    assert _stage(ws_router, "gpu-west", plain)["error"]["message"] == f"stage: job {plain} has no workspace"
    assert ws_router.run(at["gpu-west"].has_workspace(workspace["digest"])) is None  # nothing copied yet
    assert _stage(ws_router, "gpu-west", job_id) == {"job_id": job_id, **workspace}
    assert ws_router.run(at["gpu-west"].get_workspace(workspace["digest"])) == DATA
    assert ws_router.run(at["tpu-east"].has_workspace(workspace["digest"])) is None
    assert _stage(ws_router, "gpu-west", job_id) == {"job_id": job_id, **workspace}
    assert ws_router.router.staging.copies == 1  # staged once per peer and digest


def test_concurrent_stage_requests_share_one_copy(ws_router):
    import asyncio

    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    jobs = [_assigned(ws_router, "tpu-east", workspace=workspace) for _ in range(4)]

    async def all_at_once():
        return await asyncio.gather(*(ws_router._request("stage.tpu-east", json.dumps(
            {"job_id": job_id, "epoch": 1}).encode()) for job_id in jobs))
    replies = ws_router.run(all_at_once())
    assert [r.get("digest") for r in replies] == [workspace["digest"]] * 4, replies
    assert ws_router.router.staging.copies == 1


def test_a_workspace_gone_from_the_store_is_invalid_and_a_forged_reply_subject_unanswered(ws_router):
    _store(ws_router, DATA)
    workspace = {"digest": digest_of(DATA), "size": len(DATA)}
    job_id = _assigned(ws_router, "gpu-west", workspace=workspace)
    ws_router.run(ObjectStore(ws_router.client, ws_router.prefix).delete_workspace(workspace["digest"]))
    reply = _stage(ws_router, "gpu-west", job_id)
    assert reply["error"]["code"] == "not_found"
    assert "is not in the object store" in reply["error"]["message"]

    async def forged() -> list:
        """A request whose reply subject is an object store chunk subject: answering it
        would write into a bucket the router may write to."""
        heard = []

        async def hear(msg) -> None:
            heard.append(msg)
        sub = await ws_router.client.subscribe("$O.>", cb=hear)
        await ws_router.client.publish(f"{ws_router.prefix}.stage.gpu-west",
                                       json.dumps({"job_id": job_id, "epoch": 1}).encode(),
                                       reply=f"$O.{ws_router.prefix}-workspaces__gpu-west.C.planted")
        await ws_router.client.flush()
        await _stage_async(ws_router, "gpu-west", job_id)  # answered after it: the forged one was dropped
        await sub.unsubscribe()
        return heard
    assert ws_router.run(forged()) == []


async def _stage_async(router: RouterThread, peer: str, job_id: str) -> dict:
    return await router._request(f"stage.{peer}", json.dumps({"job_id": job_id, "epoch": 1}).encode())
