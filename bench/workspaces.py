"""The ``workspaces`` section: what code travelling with a job costs (docs/design.md
§3.5), each figure a ratio to a baseline measured in this run.

- *pack + store*: ``store_workspace`` of a tree of files (64 MiB; quick 16) against a
  bare object store put of the same number of bytes; runs alternate, medians.
- *first fetch + unpack*: a peer's ``WorkspaceCache.acquire`` with an empty cache (the
  workspace sent by the store on the word of the router's relay, in a process of its
  own, as an agent gets it) against a bare get of the same object.
- *cache hit*: submit → running, one job at a time, of jobs naming a workspace every
  agent already holds, against the same jobs without one (alternating batches).
- *shared workspace*: 1,000 small jobs (quick 200) naming one workspace: how many
  objects the store holds afterwards and how many times each agent fetched it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time

import msgspec

from irisfed.bench.deployment import bench_env, prefix_of
from irisfed.bench.load import median
from irisfed.bench.relay import JOB_PREFIX
from irisfed.bench.report import Bench, Figure
from irisfed.bench.sections import DISPATCH_PEERS, DispatchProbe, dispatch_deployment
from irisfed.services.common.bus import connect_client
from irisfed.services.common.objects import ObjectStore, bucket, ensure_buckets
from irisfed.services.peer_agent.workspaces import WorkspaceCache, fetch_through_router
from irisfed.shared.subjects import Subjects
from irisfed.transfer import store_workspace

MIB = 1024 * 1024
ROUNDS = 3
TRANSFER_ROUNDS = 5  # pack/put and fetch/get pairs: each a few tenths of a second
PEER = "bench-peer"


def _make_tree(root, total: int) -> None:
    """``total`` bytes in 1 MiB files across a few folders, and small files beside."""
    for i in range(total // MIB):
        folder = root / f"part-{i % 8}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"shard-{i}.bin").write_bytes(os.urandom(MIB))
    for i in range(200):
        (root / f"src-{i}.py").write_text(f"print({i})\n")


def _body(label: str, workspace: dict | None):
    def body(i: int) -> bytes:
        raw = {"command": ["true"], "job_id": f"{label}-{i}",
               "constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}
        if workspace is not None:
            raw["workspace"] = workspace
        return msgspec.json.encode(raw)
    return body


async def _transfer_figures(bench: Bench, nats_url: str) -> None:
    nc = await connect_client(nats_url)
    prefix = prefix_of("workspaces-transfer")
    tree = bench.folder / "workspace-tree"
    router = None
    try:
        await ensure_buckets(nc, prefix, peers=[PEER])
        at_peer = ObjectStore(nc, prefix, peer=PEER)  # outputs: the bare put and get
        size = bench.profile.n(16, 64) * MIB
        subjects = Subjects(prefix)
        # The router's side, as a process of its own beside the agent (bench/relay.py).
        router = await asyncio.create_subprocess_exec(sys.executable, "-m", "irisfed.bench.relay", nats_url, prefix,
                                                      PEER, stdout=asyncio.subprocess.PIPE, env=bench_env())
        if (await asyncio.wait_for(router.stdout.readline(), 60)).strip() != b"ready":
            raise RuntimeError("the bench's relay process did not start")

        async def fetch(digest: str, user: str, job, sink) -> str:
            """An agent's first fetch: sent on the router's (relay's) word, unpacked as it comes."""
            return await fetch_through_router(nc, subjects.fetch(PEER), job, digest, 2 * size, sink)
        await asyncio.to_thread(_make_tree, tree, size)
        packs, puts, fetches, gets = [], [], [], []
        for r in range(TRANSFER_ROUNDS):
            # A different tree each round (one file changes), so every pack is stored anew.
            (tree / "round.txt").write_text(str(r))
            started = time.perf_counter()
            workspace, sent = await store_workspace(nc, prefix, tree, max_mb=size // MIB + 16)
            packs.append(time.perf_counter() - started)
            assert sent
            blob = os.urandom(workspace.size)
            started = time.perf_counter()
            await at_peer.put_output("bare", r, 0, "blob", blob)  # the same bytes, as one object
            puts.append(time.perf_counter() - started)
            cache_root = bench.folder / f"workspace-cache-{r}"
            cache = await WorkspaceCache(cache_root, fetch, max_bytes=4 * size,
                                         max_files=100_000, max_unpacked_bytes=2 * size).open()
            job = (JOB_PREFIX + workspace.digest.removeprefix("sha256:"), 1)
            for fetching in (True, False) if r % 2 == 0 else (False, True):  # which goes first alternates
                started = time.perf_counter()
                if fetching:
                    await cache.acquire(workspace.digest, job=job)
                else:
                    await at_peer.get_output("bare", r, 0, "blob")
                (fetches if fetching else gets).append(time.perf_counter() - started)
            await asyncio.to_thread(shutil.rmtree, cache_root, True)
        mib = workspace.size / MIB
        pack, put, fetched, get = (median(x) for x in (packs, puts, fetches, gets))
        bench.add(Figure("workspaces", f"--workspace of {mib:,.0f} MiB: pack + store", mib / pack, "MiB/s",
                         "a bare object store put of the same bytes", put / pack, target="≥ 0.5×",
                         met=put / pack >= 0.5, runs=f"median of {TRANSFER_ROUNDS}",
                         note=f"pack + store {pack:.2f} s, bare put {put:.2f} s"))
        bench.add(Figure("workspaces", f"a peer's first fetch + unpack of {mib:,.0f} MiB", mib / fetched, "MiB/s",
                         "a bare get of the same object", get / fetched, target="≥ 0.5×", met=get / fetched >= 0.5,
                         runs=f"median of {TRANSFER_ROUNDS}, alternating",
                         note=f"sent by the store on a relay process's word (bench/relay.py, the router's code), "
                              f"unpacked as it comes, verified: {fetched:.2f} s; bare get {get:.2f} s"))
    finally:
        await asyncio.to_thread(shutil.rmtree, tree, True)
        await nc.close()
        if router is not None:
            router.kill()
            await router.wait()


async def _dispatch_figures(bench: Bench, admin_url: str, nats_url: str) -> None:
    dep = await dispatch_deployment(bench, admin_url, nats_url, "workspaces")
    nc = await connect_client(nats_url)
    try:
        await ensure_buckets(nc, dep.prefix, peers=[peer for peer, _, _ in DISPATCH_PEERS])
        small = bench.folder / "workspace-small"
        small.mkdir(exist_ok=True)
        (small / "train.py").write_text("print('hello')\n")
        workspace, _ = await store_workspace(nc, dep.prefix, small)
        field = {"digest": workspace.digest, "size": workspace.size}
        probe = DispatchProbe(dep, nc, rate=200)
        await probe.open(len(DISPATCH_PEERS))
        # Every gpu agent fetches it once before anything is timed.
        await probe.one_at_a_time(len(DISPATCH_PEERS) * 4, "wsw", body=_body("wsw", field))
        with_ws, without = [], []
        n = bench.profile.n(20, 100)
        for r in range(ROUNDS):
            plain, _ = await probe.one_at_a_time(n, f"p{r}", body=_body(f"p{r}", None))
            cached, _ = await probe.one_at_a_time(n, f"w{r}", body=_body(f"w{r}", field))
            without.append(plain.pct(0.5))
            with_ws.append(cached.pct(0.5))
        hit, base = median(with_ws), median(without)
        bench.add(Figure("workspaces", "cache hit: submit → running p50, one job at a time", hit * 1e3, "ms",
                         "the same job without a workspace", hit / base, target="≤ 1.3×", met=hit / base <= 1.3,
                         runs=f"median of {ROUNDS} batches of {n}",
                         note=f"without a workspace {base * 1e3:.1f} ms; the router's lookup is remembered, "
                              f"the agent's cache holds the tree"))
        jobs = bench.profile.n(200, 1000)
        label = "ws-shared"
        replies = await asyncio.gather(*(nc.request(f"{dep.prefix}.submit", _body(label, field)(i), timeout=30)
                                         for i in range(jobs)))
        accepted = sum(1 for r in replies if b'"error"' not in r.data)
        for _ in range(600):
            ended = await dep.pool.fetchval(
                "SELECT count(*) FROM jobs WHERE job_id LIKE $1 AND state IN ('running', 'succeeded')", f"{label}-%")
            if ended >= accepted:
                break
            await asyncio.sleep(0.1)
        objects = [o for o in await (await nc.jetstream().object_store(bucket(dep.prefix, "workspaces"))).list()
                   if not o.deleted]
        cache = bench.folder / "work" / ".workspaces"
        fetched = {peer: sum(1 for user in (cache / peer).iterdir() for _ in user.iterdir())
                   if (cache / peer).is_dir() else 0
                   for peer, attrs, _ in DISPATCH_PEERS if attrs["device_type"] == "gpu"}
        bench.add(Figure("workspaces", f"{jobs:,} jobs naming one workspace: objects stored", len(objects),
                         "objects", target="1", met=len(objects) == 1 and all(n <= 1 for n in fetched.values()),
                         note=f"{accepted:,} accepted, {ended:,} ran; trees each gpu agent unpacked: "
                              f"{', '.join(f'{p} {n}' for p, n in fetched.items())} (one per digest)"))
    finally:
        await nc.close()
        await dep.close()


async def workspaces_section(bench: Bench, admin_url: str, nats_url: str) -> None:
    await _transfer_figures(bench, nats_url)
    await _dispatch_figures(bench, admin_url, nats_url)
