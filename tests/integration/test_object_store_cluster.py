"""The object store on a NATS cluster of three (as `irisfed up --ha` and compose.yaml run
it: JetStream clustered, each bucket replicated on every node): a node killed while
workspaces are being stored loses nothing that was acknowledged, and the store keeps
taking new ones."""

from __future__ import annotations

import asyncio
import os

import pytest

from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import ObjectStore, ObjectStoreError, bucket, ensure_buckets
from irisfed.shared.workspace import digest_of
from irisfed.tooling.ha import start_nats_cluster

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
PREFIX = "hastore"
PUTS = 12
KILL_AFTER = 3  # acknowledged puts before the stream's leader is killed


@pytest.fixture
async def cluster(tmp_path):
    nats = await asyncio.to_thread(start_nats_cluster, tmp_path / "nats", 3)
    try:
        yield nats
    finally:
        await asyncio.to_thread(nats.stop)


async def test_a_node_killed_mid_upload_loses_no_acknowledged_workspace(cluster):
    nc = await connect_client(cluster.url)
    try:
        await ensure_buckets(nc, PREFIX, replicas=3, wait_s=60)
        info = await nc.jetstream().stream_info(f"OBJ_{bucket(PREFIX, 'workspaces')}")
        assert info.config.num_replicas == 3
        store = ObjectStore(nc, PREFIX, timeout_s=20)
        acknowledged: dict[str, bytes] = {}
        failed = 0
        enough = asyncio.Event()

        async def upload() -> None:
            nonlocal failed
            for _ in range(PUTS):
                data = os.urandom(2 * MIB)
                try:
                    digest, size, _ = await store.put_workspace(data)
                except ObjectStoreError:
                    failed += 1  # not acknowledged: the producer would see the error and retry
                    continue
                assert digest == digest_of(data) and size == len(data)
                acknowledged[digest] = data
                if len(acknowledged) >= KILL_AFTER:
                    enough.set()

        uploads = asyncio.create_task(upload())
        await enough.wait()
        leader = (await nc.jetstream().stream_info(f"OBJ_{bucket(PREFIX, 'workspaces')}")).cluster.leader
        victim = next(i for i, s in enumerate(cluster.servers) if f"irisfed-n{i}" == leader)
        await asyncio.to_thread(cluster.servers[victim].kill)  # while the uploads go on
        await uploads
        assert len(acknowledged) + failed == PUTS
        assert len(acknowledged) > KILL_AFTER, "the store took nothing once a node was gone"
        for digest, data in acknowledged.items():  # from the two nodes left
            assert await store.get_workspace(digest) == data
        # The killed node comes back and catches up; every object still reads whole.
        await asyncio.to_thread(cluster.restart, victim)
        for digest, data in acknowledged.items():
            assert await store.get_workspace(digest) == data
    finally:
        await nc.close()
