"""An agent SIGKILLed while it fetches a workspace or stores a run's outputs (real
servers, service processes, NATS users per role): its restart fails or completes the
run cleanly. A half-unpacked tree is never run (whatever ran read the whole
workspace), and the outputs listed are a whole run's, fetched whole."""

import os
import shutil

import pytest

from irisfed.services.common.objects import ObjectStore
from irisfed.transfer import store_workspace
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
FILES = 48  # 1 MiB each: a fetch and unpack that take a moment


async def test_an_agent_killed_mid_fetch_leaves_no_tree_to_run_and_the_job_still_runs_whole(federation):
    await federation.ensure_buckets()
    await federation.start_federation("home", "gpu-west")
    folder = federation.tmp / "big"
    folder.mkdir()
    for i in range(FILES):
        (folder / f"part-{i}.bin").write_bytes(os.urandom(1 << 20))
    (folder / "check.sh").write_text(f'[ "$(ls part-*.bin | wc -l)" = {FILES} ] && echo whole')
    workspace, _ = await store_workspace(federation.nats, federation.prefix, folder)
    shutil.rmtree(folder)
    reply = await federation.submit({"command": ["sh", "check.sh"], "constraints": GPU, "max_retries": 2,
                                     "workspace": {"digest": workspace.digest, "size": workspace.size}})
    job_id = reply["job_id"]
    await federation.wait_state(job_id, "running")  # accepted: its agent fetches now
    federation.kill("gpu-west")
    federation.start("gpu-west")
    job = await federation.wait_state(job_id, "succeeded", "failed", timeout=120)
    assert job.state == "succeeded", job.reason
    stdout = federation.work_dir / "gpu-west" / job_id / f"epoch-{job.epoch}" / "stdout"
    assert stdout.read_text() == "whole\n"  # every run that ran saw the whole tree
    cache = federation.work_dir / ".workspaces" / "gpu-west" / "default"
    assert [p.name for p in cache.iterdir()] == [workspace.digest.removeprefix("sha256:")]  # no partial left


async def test_an_agent_killed_while_storing_outputs_lists_only_a_whole_runs(federation):
    await federation.ensure_buckets()
    await federation.start_federation("home", "gpu-west")
    script = ('d="$IRISFED_OUTPUT_DIR"; for i in $(seq 1 ' + str(FILES) + '); do '
              'head -c 1048576 /dev/urandom > "$d/shard-$i.bin"; done; echo done')
    reply = await federation.submit({"command": ["sh", "-c", script], "constraints": GPU, "max_retries": 2})
    job_id = reply["job_id"]
    job = await federation.wait_state(job_id, "running")
    run_dir = federation.work_dir / "gpu-west" / job_id / f"epoch-{job.epoch}"

    async def command_done():
        return (run_dir / "exit").exists() or "done" in ((run_dir / "stdout").read_text()
                                                          if (run_dir / "stdout").exists() else "")
    await wait_for(command_done, "the command to end (its agent now storing its outputs)", timeout=60)
    federation.kill("gpu-west")
    federation.start("gpu-west")
    job = await federation.wait_state(job_id, "succeeded", "failed", timeout=180)
    assert job.state == "succeeded", job.reason
    listed = await federation.store.job_outputs_list(job_id)
    assert len(listed) == FILES and all(o.stored for o in listed) and {o.epoch for o in listed} == {job.epoch}
    federation.kill("gpu-west")  # the peer gone, and its files with it: the store has them
    shutil.rmtree(federation.work_dir / "gpu-west")
    store = ObjectStore(federation.nats, federation.prefix, peer="gpu-west")
    for output in listed[:3]:
        assert len(await store.get_output(job_id, output.epoch, 0, output.name)) == 1 << 20
