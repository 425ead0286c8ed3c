"""The federation's object store (services/common/objects.py) on a real nats-server with
JetStream: buckets, workspaces by digest, outputs by job/epoch/task, and the errors."""

from __future__ import annotations

import asyncio
import os
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor

import nats
import pytest
from nats.js.errors import ServiceUnavailableError
from nats.js.object_store import VALID_BUCKET_RE, VALID_KEY_RE

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import (
    OUTPUTS,
    WORKSPACES,
    DigestMismatch,
    ObjectMissing,
    ObjectStore,
    StoreMissing,
    bucket,
    ensure_buckets,
    output_object,
    parse_output_object,
    workspace_object,
)
from irisfed.shared.workspace import digest_of
from irisfed.tooling.servers import start_nats

MIB = 1024 * 1024


async def _jetstream_on(url: str) -> bool:
    nc = await connect_client(url)
    try:
        await nc.jetstream().account_info()
        return True
    except ServiceUnavailableError:
        return False
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def js_url(servers, tmp_path_factory):
    """The shared test NATS server when JetStream is on there, else one started here."""
    with ThreadPoolExecutor(1) as thread:  # its own loop, leaving pytest-asyncio's alone
        jetstream_on = thread.submit(asyncio.run, _jetstream_on(servers.nats_url)).result()
    if jetstream_on:
        yield servers.nats_url
        return
    warnings.warn("the shared test nats-server has no JetStream: test_object_store starts its own",
                  stacklevel=1)
    server = start_nats(tmp_path_factory.mktemp("nats-js"), jetstream=True)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def nc(js_url):
    client = await connect_client(js_url)
    yield client
    await client.close()


@pytest.fixture
def prefix():
    return f"t{uuid.uuid4().hex[:12]}"


PEER = "gpu-west"


@pytest.fixture
async def store(nc, prefix):
    """The user ``default``'s own workspaces; its outputs at PEER are ``at_peer``'s."""
    await ensure_buckets(nc, prefix, peers=[PEER])
    yield await ObjectStore(nc, prefix).open()
    for name in (bucket(prefix, "workspaces"), bucket(prefix, "outputs", peer=PEER)):
        await nc.jetstream().delete_object_store(name)


@pytest.fixture
async def at_peer(store, nc, prefix):
    return await ObjectStore(nc, prefix, peer=PEER).open()


async def _messages(nc, prefix: str, kind: str) -> int:
    return (await nc.jetstream().stream_info(f"OBJ_{bucket(prefix, kind)}")).state.messages


def test_bucket_names_are_valid_distinct_and_default_to_the_constants():
    assert bucket("irisfed", "workspaces") == WORKSPACES == bucket("irisfed", WORKSPACES)
    assert bucket("irisfed", "outputs") == OUTPUTS == bucket(kind=OUTPUTS)
    names = {bucket(p, k) for p in ("a.b", "a_b", "a_2Eb", "a-b", "a.b.c") for k in ("workspaces", "outputs")}
    assert len(names) == 10
    # A user and a peer both may hold `_` and `-`: "__" between them, `_` escaped in each.
    at = {bucket("p", "outputs", user, peer) for user, peer in (
        ("a_b", "c"), ("a", "b_c"), ("a", "5F_c"), ("a__b", "c"), ("a_", "c"), ("default", "a__b"),
        ("a", "b"), ("a-b", "c"), ("a", "b-c"))}
    assert len(at) == 9
    assert all(VALID_BUCKET_RE.match(name) for name in names | at)
    assert bucket("irisfed", "outputs", "alice", "gpu-west") == "irisfed-outputs-alice__gpu-west"
    assert bucket("irisfed", "outputs", peer="gpu_1") == "irisfed-outputs__gpu_5F1"
    with pytest.raises(ValueError, match="invalid peer id"):
        bucket("irisfed", "outputs", peer="gpu.west")
    assert bucket("irisfed", "logs", peer="gpu-west") == "irisfed-logs__gpu-west"  # a peer's log stream
    with pytest.raises(ValueError):
        bucket("irisfed", "secrets")


def test_object_names_are_valid_keys_and_decode_back():
    digest = "sha256:" + "ab" * 32
    assert workspace_object(digest) == "sha256-" + "ab" * 32
    for job, name in [("job:1.x_y-z", "dir/with space/ünï cødé 日本.bin"), ("a/b=3D", "=2F/x=.txt"),
                      ("j", "-")]:
        encoded = output_object(job, 3, 7, name)
        assert VALID_KEY_RE.match(encoded), encoded
        assert parse_output_object(encoded) == (job, 3, 7, name)
    for bad in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError):
            output_object("j", 0, 0, bad)
    with pytest.raises(ValueError):
        workspace_object("sha256:XYZ")


async def test_ensure_buckets_is_idempotent_and_concurrent_safe(nc, prefix):
    names = [bucket(prefix, "workspaces"), bucket(prefix, "outputs", peer=PEER)]
    try:
        await ensure_buckets(nc, prefix, output_ttl_s=3600, peers=[PEER])
        await ensure_buckets(nc, prefix, output_ttl_s=3600, peers=[PEER])
        await asyncio.gather(*(ensure_buckets(nc, prefix, output_ttl_s=3600, peers=[PEER]) for _ in range(3)))
        js = nc.jetstream()
        workspaces, outputs = [await (await js.object_store(name)).status() for name in names]
        assert outputs.ttl == 3600 and outputs.replicas == 1
        assert not workspaces.ttl
        await ensure_buckets(nc, prefix, output_ttl_s=7200, peers=[PEER])  # a changed retention takes effect
        assert (await (await js.object_store(names[1])).status()).ttl == 7200
        await ObjectStore(nc, prefix, peer=PEER).open()
    finally:
        for name in names:
            await nc.jetstream().delete_object_store(name)


async def test_a_5_mib_workspace_round_trips(store):
    data = os.urandom(5 * MIB)
    digest, size, stored_now = await store.put_workspace(data)
    assert (digest, size, stored_now) == (digest_of(data), 5 * MIB, True)
    assert await store.has_workspace(digest) == 5 * MIB
    assert await store.get_workspace(digest) == data


async def test_the_same_digest_is_stored_once(store, nc, prefix):
    data = os.urandom(MIB + 7)
    first = await store.put_workspace(data)
    objects = await (await nc.jetstream().object_store(bucket(prefix, "workspaces"))).list()
    messages = await _messages(nc, prefix, "workspaces")
    second = await store.put_workspace(data)
    assert first[2] is True and second == (first[0], first[1], False)
    after = await (await nc.jetstream().object_store(bucket(prefix, "workspaces"))).list()
    assert len(after) == len(objects) == 1
    assert await _messages(nc, prefix, "workspaces") == messages  # no chunk sent again


async def test_other_bytes_under_a_digest_raise_digest_mismatch(store, nc, prefix):
    data = os.urandom(300_000)
    digest, _, _ = await store.put_workspace(data)
    raw = await nc.jetstream().object_store(bucket(prefix, "workspaces"))
    await raw.put(workspace_object(digest), data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(DigestMismatch) as raised:
        await store.get_workspace(digest)
    assert digest in str(raised.value)


async def test_a_missing_digest_raises_object_missing(store):
    digest = digest_of(b"never stored")
    assert await store.has_workspace(digest) is None
    with pytest.raises(ObjectMissing) as raised:
        await store.get_workspace(digest)
    assert digest in str(raised.value) and "\n" not in str(raised.value)
    assert await store.delete_workspace(digest) is False
    stored, _, _ = await store.put_workspace(b"stored then deleted")
    assert await store.delete_workspace(stored) is True
    assert await store.has_workspace(stored) is None
    with pytest.raises(ObjectMissing):
        await store.get_workspace(stored)


async def test_outputs_per_epoch_and_task(at_peer):
    store = at_peer
    job = "job:2026.12_06-a"
    files = {
        (0, 0, "result.txt"): b"epoch 0 task 0",
        (0, 1, "dir/sub dir/data.bin"): os.urandom(200_000),
        (1, 0, "result.txt"): b"epoch 1 task 0",
        (1, 0, "ünïcødé/日本 語.json"): '{"ok": "日本"}'.encode(),
        (1, 1, "a=3D/=2F.txt"): b"looks escaped, is not",
    }
    for (epoch, task, name), data in files.items():
        assert await store.put_output(job, epoch, task, name, data) == len(data)
    await store.put_output("job:2026.12_06-b", 0, 0, "result.txt", b"another job")

    every = sorted((e, t, n, len(d)) for (e, t, n), d in files.items())
    assert await store.list_outputs(job) == every
    assert await store.list_outputs(job, epoch=1) == [row for row in every if row[0] == 1]
    assert await store.list_outputs(job, task=0) == [row for row in every if row[1] == 0]
    assert await store.list_outputs(job, epoch=1, task=0) == [
        (1, 0, "result.txt", 14), (1, 0, "ünïcødé/日本 語.json", len(files[1, 0, "ünïcødé/日本 語.json"]))]
    assert await store.list_outputs("job:none") == []
    for (epoch, task, name), data in files.items():
        assert await store.get_output(job, epoch, task, name) == data
    with pytest.raises(ObjectMissing) as raised:
        await store.get_output(job, 2, 0, "result.txt")
    assert job in str(raised.value)


async def test_store_missing_when_the_buckets_were_never_created(nc):
    prefix = f"never{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreMissing) as raised:
        await ObjectStore(nc, prefix).open()
    message = str(raised.value)
    assert bucket(prefix, "workspaces") in message and "JetStream" in message
    assert "irisfed up" in message and "\n" not in message and message.count(". ") == 0
    with pytest.raises(StoreMissing):  # without open(): on first use
        await ObjectStore(nc, prefix).put_workspace(b"x")
    with pytest.raises(StoreMissing):
        await ObjectStore(nc, prefix, peer=PEER).list_outputs("job")
    with pytest.raises(ValueError, match="outputs are kept per peer"):
        await ObjectStore(nc, prefix).list_outputs("job")


async def test_store_missing_when_jetstream_is_off(tmp_path):
    server = start_nats(tmp_path / "nats", jetstream=False)
    try:
        client = await nats.connect(server.url)
        try:
            with pytest.raises(StoreMissing) as raised:
                await ObjectStore(client).open()
            assert WORKSPACES in str(raised.value)
            with pytest.raises(StoreMissing):
                await ensure_buckets(client)
        finally:
            await client.close()
    finally:
        server.stop()


def test_each_user_has_its_own_pair_of_buckets():
    assert bucket("irisfed", "workspaces", "alice") == "irisfed-workspaces-alice"
    assert bucket("irisfed", "outputs", "default") == OUTPUTS
    assert bucket("irisfed", "outputs", "alice", "home") == "irisfed-outputs-alice__home"
    with pytest.raises(ValueError, match="invalid user id"):
        bucket("irisfed", "outputs", "Alice.x")


async def test_irisfed_buckets_creates_every_users_pair_with_the_configured_retention(js_url, nc, prefix, tmp_path,
                                                                                      capsys):
    from irisfed.cli import main

    config = tmp_path / "federation.toml"
    config.write_text(f'subject_prefix = "{prefix}"\noutput_retention_days = 2\n'
                      '[[peers]]\nid = "home"\n[[users]]\nid = "alice"\n')
    args = ["buckets", "--nats-url", js_url, "--config", str(config)]
    assert await asyncio.to_thread(main, args) == 0
    assert "ready for default, alice (1 replica, outputs kept 2 days)" in capsys.readouterr().out
    js = nc.jetstream()
    for user in ("default", "alice"):
        outputs = await js.stream_info(f"OBJ_{bucket(prefix, 'outputs', user, 'home')}")
        assert outputs.config.max_age == 2 * 86400
        await js.stream_info(f"OBJ_{bucket(prefix, 'workspaces', user)}")
    assert await asyncio.to_thread(main, args) == 0  # again: nothing to do, no error
    assert await asyncio.to_thread(main, [*args, "--replicas", "4"]) == 2
    assert "--replicas must be 1, 2 or 3" in capsys.readouterr().err


async def test_a_link_to_another_bucket_is_neither_stored_nor_followed(nc, prefix):
    """A user may write raw metadata into its own bucket: an entry linking to another
    user's workspace must not let the router accept it nor an agent fetch it."""
    import base64
    import json

    await ensure_buckets(nc, prefix, users=["alice", "bob"])
    data = b"alice's code" * 10
    digest, size, _ = await ObjectStore(nc, prefix, user="alice").put_workspace(data)
    name = workspace_object(digest)
    bobs = bucket(prefix, "workspaces", "bob")
    meta = {"name": name, "bucket": bobs, "nuid": "linknuid", "size": size, "chunks": 1, "mtime": "",
            "options": {"link": {"bucket": bucket(prefix, "workspaces", "alice"), "name": name}}}
    await nc.jetstream().publish(f"$O.{bobs}.M.{base64.urlsafe_b64encode(name.encode()).decode()}",
                                 json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    as_bob = ObjectStore(nc, prefix, user="bob")
    assert await as_bob.has_workspace(digest) is None
    with pytest.raises(ObjectMissing, match="is not in the object store"):  # refused like a missing one
        await as_bob.get_workspace(digest)


async def test_a_get_bounded_below_an_objects_size_reads_nothing(store):
    from irisfed.services.common.objects import ObjectTooLarge

    digest, size, _ = await store.put_workspace(b"x" * 10_000)
    with pytest.raises(ObjectTooLarge, match="over the 1,000 allowed"):
        await store.get_workspace(digest, max_bytes=1000)
    assert await store.get_workspace(digest, max_bytes=size) == b"x" * 10_000
