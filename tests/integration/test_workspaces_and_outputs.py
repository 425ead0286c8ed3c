"""Workspaces travel with the job and outputs come home (docs/design.md §3.5), against a
real nats-server with JetStream and the real Postgres, a subprocess agent in process.

No shared disk is assumed: the producer's folder is deleted as soon as the workspace
is stored, and the peer's run folders (and its cache) before the outputs are read."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from irisfed.services.common.objects import ObjectStore, ensure_buckets, workspace_object
from irisfed.services.common.store import Store
from irisfed.services.peer_agent.service import AgentSettings, BackendSpec, PeerAgent
from irisfed.services.router.service import Router
from irisfed.shared.config import NodeSpec
from irisfed.shared.lifecycle import JobState
from irisfed.shared.workspace import digest_of
from irisfed.tooling.invariants import assert_changelog_replays
from irisfed.transfer import store_workspace
from tests.infra.archives import archive, member
from tests.infra.factories import assign_jobs, insert_jobs, make_config, make_job, user_job
from tests.infra.probes import in_state, returns
from tests.infra.waiting import wait_for

TRAIN = """\
import os, pathlib
data = pathlib.Path("data/input.txt").read_text()
out = pathlib.Path(os.environ["IRISFED_OUTPUT_DIR"])
task = os.environ.get("IRISFED_TASK_INDEX", "-")
(out / "result.txt").write_text(f"{data.upper()} task={task}")
(out / "sub").mkdir()
(out / "sub" / "cwd.txt").write_text(os.getcwd())
pathlib.Path("written-by-the-run.txt").write_text("mine")
"""


@pytest.fixture
async def buckets(nats_client, subject_prefix):
    """The user ``default``'s own workspaces (its outputs from gpu-west: ``at_peer``)."""
    await ensure_buckets(nats_client, subject_prefix, users=["alice"], peers=["gpu-west"])
    return ObjectStore(nats_client, subject_prefix)


@pytest.fixture
def at_peer(buckets, nats_client, subject_prefix):
    return ObjectStore(nats_client, subject_prefix, peer="gpu-west")


@pytest.fixture(autouse=True)
async def router(pool, nats_client, subject_prefix):
    """The router, which stages a job's workspace at its peer when the agent asks."""
    router = Router(make_config(subject_prefix=subject_prefix), pool, nats_client)
    await router.start()
    yield router
    await router.close()


@contextlib.asynccontextmanager
async def agent_for(pool, nc, prefix: str, root: Path, *, nodes=(), **config) -> AsyncIterator[PeerAgent]:
    """A started gpu-west agent (subprocess backend, work folder ``root``); closed at the end."""
    spec = BackendSpec("main", "subprocess", {}, 8, {}, nodes=nodes)
    agent = PeerAgent(make_config(subject_prefix=prefix, **config), pool, nc,
                      AgentSettings(peer_id="gpu-west", backends=(spec,), work_root=root,
                                    reconcile_interval_s=0.05, report_linger_s=0.0))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.close()


def producer_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "producer"
    (folder / "data").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "data" / "input.txt").write_text("tokens")
    return folder


async def run_job(store: Store, agent: PeerAgent, job) -> None:
    await insert_jobs(store, [job])
    await assign_jobs(store, [job], "gpu-west")
    await agent.reconcile()
    await wait_for(lambda: _ended(store, job.job_id), f"job {job.job_id} to end")


async def _ended(store: Store, job_id: str) -> bool:
    return (await store.job_get(job_id)).state.is_terminal


async def test_a_job_runs_in_its_workspace_and_its_outputs_outlive_the_peer(pool, nats_client, subject_prefix,
                                                                             buckets, at_peer, tmp_path):
    store = Store(pool)
    folder = producer_folder(tmp_path)
    workspace, sent = await store_workspace(nats_client, subject_prefix, folder)
    assert sent
    shutil.rmtree(folder)  # the producer's copy is gone as soon as the submit could go
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        job = make_job(command=[sys.executable, "train.py"], workspace=msgspec.to_builtins(workspace))
        await run_job(store, agent, job)
    row = await store.job_get(job.job_id)
    assert (row.state, row.exit_code) == (JobState.SUCCEEDED, 0), row.reason
    run_dir = tmp_path / "peer" / "gpu-west" / job.job_id / "epoch-1"
    assert (run_dir / "stdout").exists() and not (run_dir / "workspace").exists()  # its copy is gone once stored
    shutil.rmtree(tmp_path / "peer")  # the peer's run folders and its cache
    outputs = await store.job_outputs_list(job.job_id)
    assert [(o.task_index, o.name, o.stored) for o in outputs] == [(0, "result.txt", True), (0, "sub/cwd.txt", True)]
    assert await at_peer.get_output(job.job_id, 1, 0, "result.txt") == b"TOKENS task=-"
    cwd = (await at_peer.get_output(job.job_id, 1, 0, "sub/cwd.txt")).decode()
    assert cwd.endswith("/workspace") and f"/{job.job_id}/epoch-1/" in cwd  # a copy, not the cache
    await assert_changelog_replays(store)


async def test_one_digest_is_stored_once_and_fetched_once_per_peer(pool, nats_client, subject_prefix, buckets,
                                                                   tmp_path):
    store = Store(pool)
    folder = producer_folder(tmp_path)
    first, sent_first = await store_workspace(nats_client, subject_prefix, folder)
    second, sent_second = await store_workspace(nats_client, subject_prefix, folder)
    assert first == second and (sent_first, sent_second) == (True, False)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        jobs = [make_job(command=[sys.executable, "train.py"], workspace=msgspec.to_builtins(first)) for _ in range(3)]
        for job in jobs:
            await run_job(store, agent, job)
        assert agent.workspaces.fetches == 1
    for job in jobs:
        assert (await store.job_get(job.job_id)).state is JobState.SUCCEEDED
        # Each run had its own copy: what one run wrote into its folder no other saw.
    cache = tmp_path / "peer" / ".workspaces" / "gpu-west" / "default" / first.digest.removeprefix("sha256:")
    assert sorted(p.name for p in cache.iterdir()) == ["data", "train.py"]


async def test_each_task_of_a_gang_runs_in_its_own_copy_and_keeps_its_outputs_apart(
        pool, nats_client, subject_prefix, buckets, at_peer, tmp_path):
    store = Store(pool)
    folder = producer_folder(tmp_path)
    workspace, _ = await store_workspace(nats_client, subject_prefix, folder)
    shutil.rmtree(folder)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer",
                         nodes=(NodeSpec(2, {"cpu": 1}, {}),)) as agent:
        job = make_job(command=[sys.executable, "train.py"], replicas=2, workspace=msgspec.to_builtins(workspace))
        await run_job(store, agent, job)
    assert (await store.job_get(job.job_id)).state is JobState.SUCCEEDED
    shutil.rmtree(tmp_path / "peer")
    outputs = await store.job_outputs_list(job.job_id)
    assert [(o.task_index, o.name) for o in outputs] == [
        (0, "result.txt"), (0, "sub/cwd.txt"), (1, "result.txt"), (1, "sub/cwd.txt")]
    for task in (0, 1):
        assert await at_peer.get_output(job.job_id, 1, task, "result.txt") == f"TOKENS task={task}".encode()
    assert await store.job_outputs_list(job.job_id, task=1) == outputs[2:]


HOSTILE = {
    "absolute path": archive(member("/tmp/irisfed-planted", data=b"x")),
    "'..' in path": archive(member("a", tarfile.DIRTYPE), member("a/../../planted", data=b"x")),
    "symlink leaving the tree": archive(member("out", tarfile.SYMTYPE, link="../.."),
                                        member("out/planted", data=b"x")),
    "hard link": archive(member("a", data=b"x"), member("b", tarfile.LNKTYPE, link="a")),
    "fifo": archive(member("pipe", tarfile.FIFOTYPE)),
    "character device": archive(member("null", tarfile.CHRTYPE)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_a_hostile_workspace_fails_the_job_and_writes_nothing_outside(pool, nats_client, subject_prefix,
                                                                           buckets, tmp_path, case):
    store = Store(pool)
    data = HOSTILE[case]
    digest, size, _ = await buckets.put_workspace(data)
    peer = tmp_path / "peer"
    async with agent_for(pool, nats_client, subject_prefix, peer) as agent:
        before = {p for p in tmp_path.rglob("*")}
        job = make_job(command=["touch", "ran"], workspace={"digest": digest, "size": size}, max_retries=3)
        await run_job(store, agent, job)
    row = await store.job_get(job.job_id)
    assert row.state is JobState.FAILED
    assert row.reason.startswith("workspace refused: ") and case in row.reason
    assert row.attempts == 1  # not retried: the same bytes would be refused again
    after = {p for p in tmp_path.rglob("*")}
    assert not [p for p in after - before if peer not in p.parents]  # nothing written outside the peer
    assert not list(peer.rglob("ran")) and not list(peer.rglob("planted"))
    assert not Path("/tmp/irisfed-planted").exists()  # noqa: S108, ASYNC240 - the hostile member aims there


async def test_bytes_not_their_digest_fail_the_job_naming_it(pool, nats_client, subject_prefix, buckets, tmp_path):
    store = Store(pool)
    good = archive(member("train.py", data=b"print(1)\n"))
    digest = digest_of(good)
    forged = archive(member("train.py", data=b"print(2)\n"))
    bucket = await nats_client.jetstream().object_store(f"{subject_prefix}-workspaces")
    await bucket.put(workspace_object(digest), forged)  # the store's own chunk digest is right
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        job = make_job(command=["true"], workspace={"digest": digest, "size": len(forged)})
        await run_job(store, agent, job)
    row = await store.job_get(job.job_id)
    assert row.state is JobState.FAILED and digest in row.reason and "other bytes" in row.reason


async def test_a_workspace_deleted_while_its_job_waits_fails_it_naming_the_digest(pool, nats_client, subject_prefix,
                                                                                 buckets, tmp_path):
    store = Store(pool)
    digest, size, _ = await buckets.put_workspace(archive(member("train.py", data=b"print(1)\n")))
    job = make_job(command=["true"], workspace={"digest": digest, "size": size})
    await insert_jobs(store, [job])
    assert await buckets.delete_workspace(digest)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        await assign_jobs(store, [job], "gpu-west")
        await agent.reconcile()
        await wait_for(lambda: in_state(store, job.job_id, JobState.FAILED), "the job to fail")
    row = await store.job_get(job.job_id)
    assert row.reason == f"workspace {digest} is no longer in the object store"


async def test_outputs_over_the_cap_are_listed_as_left_out(pool, nats_client, subject_prefix, buckets, at_peer, tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer", max_output_mb=1) as agent:
        script = ('import os; d = os.environ["IRISFED_OUTPUT_DIR"]\n'
                  'for n in ("a.bin", "b.bin", "c.bin"): open(os.path.join(d, n), "wb").write(b"x" * 400_000)\n'
                  'os.symlink("/etc/passwd", os.path.join(d, "link"))\n')
        job = make_job(command=[sys.executable, "-c", script])
        await run_job(store, agent, job)
    assert (await store.job_get(job.job_id)).state is JobState.SUCCEEDED
    outputs = await store.job_outputs_list(job.job_id)
    assert [(o.name, o.stored) for o in outputs] == [("a.bin", True), ("b.bin", True), ("c.bin", False),
                                                     ("link", False)]
    assert outputs[2].note.startswith("over max_output_mb") and outputs[3].note == "not a regular file"
    assert len(await at_peer.get_output(job.job_id, 1, 0, "b.bin")) == 400_000


async def test_a_failed_run_keeps_its_outputs(pool, nats_client, subject_prefix, buckets, at_peer, tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        script = ('import os, sys; open(os.path.join(os.environ["IRISFED_OUTPUT_DIR"], "crash.log"), "w")'
                  '.write("boom"); sys.exit(3)')
        job = make_job(command=[sys.executable, "-c", script], max_retries=0)
        await run_job(store, agent, job)
    assert (await store.job_get(job.job_id)).exit_code == 3
    assert await at_peer.get_output(job.job_id, 1, 0, "crash.log") == b"boom"


async def test_a_users_job_runs_its_own_buckets_workspace_and_stores_outputs_there(pool, nats_client,
                                                                                   subject_prefix, buckets, tmp_path):
    store = Store(pool)
    folder = producer_folder(tmp_path)
    workspace, _ = await store_workspace(nats_client, subject_prefix, folder, user="alice")
    assert await ObjectStore(nats_client, subject_prefix).has_workspace(workspace.digest) is None
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer", users=[{"id": "alice"}]) as agent:
        job = user_job("alice", "train-1", command=[sys.executable, "train.py"], workspace=msgspec.to_builtins(workspace))
        await run_job(store, agent, job)
    assert job.job_id == "alice:train-1" and (await store.job_get(job.job_id)).state is JobState.SUCCEEDED
    alices = ObjectStore(nats_client, subject_prefix, user="alice", peer="gpu-west")
    assert await alices.get_output(job.job_id, 1, 0, "result.txt") == b"TOKENS task=-"
    assert await ObjectStore(nats_client, subject_prefix, peer="gpu-west").list_outputs(job.job_id) == []


async def test_an_output_name_too_long_for_the_store_is_left_out_and_the_agent_stays_connected(
        pool, nats_client, subject_prefix, buckets, at_peer, tmp_path):
    store = Store(pool)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        script = ('import os; d = os.environ["IRISFED_OUTPUT_DIR"]; deep = os.path.join(d, *["é" * 120] * 8)\n'
                  'os.makedirs(os.path.dirname(deep)); open(deep, "w").write("x")\n'
                  'open(os.path.join(d, "fine.txt"), "w").write("ok")\n')
        job = make_job(command=[sys.executable, "-c", script])
        await run_job(store, agent, job)
        assert agent.nc.is_connected
        after = make_job(command=["true"])  # the agent goes on taking work
        await run_job(store, agent, after)
        assert (await store.job_get(after.job_id)).state is JobState.SUCCEEDED
    outputs = await store.job_outputs_list(job.job_id)
    assert [(o.name.startswith("é"), o.stored, o.note) for o in outputs] == [
        (False, True, ""), (True, False, "its name is too long for the object store")]
    assert await at_peer.get_output(job.job_id, 1, 0, "fine.txt") == b"ok"


async def test_a_gang_holds_its_cached_workspace_until_it_ends(pool, nats_client, subject_prefix, buckets,
                                                                tmp_path):
    """A gang's tasks copy the workspace as each starts, after its launch: the cache must
    not evict the tree meanwhile, so the gang holds it to its end."""
    store = Store(pool)
    folder = producer_folder(tmp_path)
    flag = tmp_path / "go"
    (folder / "wait.py").write_text(f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\n")
    workspace, _ = await store_workspace(nats_client, subject_prefix, folder)
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer",
                         nodes=(NodeSpec(2, {"cpu": 1}, {}),)) as agent:
        job = make_job(command=[sys.executable, "wait.py"], replicas=2, workspace=msgspec.to_builtins(workspace))
        key = ("default", workspace.digest)
        await insert_jobs(store, [job])
        await assign_jobs(store, [job], "gpu-west")
        await agent.reconcile()
        await wait_for(lambda: in_state(store, job.job_id, JobState.RUNNING), "the gang to run")
        assert agent.workspaces.entries[key].holders == 1  # all its tasks run, and it still holds it
        flag.write_text("go")
        await wait_for(lambda: _ended(store, job.job_id), "the gang to end")
        await wait_for(lambda: returns(agent.workspaces.entries[key].holders == 0), "the gang to let it go")
    assert (await store.job_get(job.job_id)).state is JobState.SUCCEEDED


async def test_a_run_that_fails_to_launch_leaves_no_workspace_copy(pool, nats_client, subject_prefix, buckets,
                                                                     tmp_path):
    store = Store(pool)
    workspace, _ = await store_workspace(nats_client, subject_prefix, producer_folder(tmp_path))
    async with agent_for(pool, nats_client, subject_prefix, tmp_path / "peer") as agent:
        job = make_job(command=["irisfed-no-such-program"], max_retries=0, workspace=msgspec.to_builtins(workspace))
        await run_job(store, agent, job)
    row = await store.job_get(job.job_id)
    assert row.state is JobState.FAILED, row.reason
    run_dir = tmp_path / "peer" / "gpu-west" / job.job_id / "epoch-1"
    assert run_dir.is_dir() and not (run_dir / "workspace").exists()
