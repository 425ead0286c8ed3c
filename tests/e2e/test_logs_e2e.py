"""Logs come home (docs/design.md §3.6; invariant 15), end to end: router, tick and
agents as processes; users on their own NATS credentials and no database URL."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from irisfed.client import Client
from irisfed.errors import NotFoundError
from irisfed.services.common.bus import connect_client
from irisfed.tooling.federation import Peer, render_config

pytestmark = pytest.mark.e2e

PEERS = [Peer("home", {"device_type": "cpu"}, slots=4), Peer("gpu-west", {"device_type": "gpu"}, slots=4)]
GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]


def configure(federation) -> None:
    federation.config_path.write_text(render_config(
        PEERS, users=[{"id": "alice"}, {"id": "bob"}], local_cluster="home", subject_prefix=federation.prefix,
        heartbeat_interval_s=0.25, heartbeat_ttl_s=1.5, tick_interval_s=0.25, assign_grace_s=1.0))


def user_client(federation, servers, user: str):
    if servers.nats_auth is None:
        pytest.skip("the NATS server came from IRISFED_TEST_NATS_URL: these tests need the users the tests "
                    "generate (run without it)")
    return Client.connect(nats_url=servers.nats_url_for(f"user-{user}"), prefix=federation.prefix,
                          database_url="", state_dir=federation.tmp / "nowhere", timeout=5.0)


def cli_as(federation, servers, user: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """The CLI from an empty folder with only ``user``'s NATS URL: no database, no config."""
    env = {"PATH": "/usr/bin:/bin", "IRISFED_NATS_URL": servers.nats_url_for(f"user-{user}"), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-m", "irisfed.cli", *args, "--prefix", federation.prefix], env=env,
                          cwd=cwd, capture_output=True, timeout=60, check=False)


async def test_a_user_follows_a_job_on_another_peer_and_reads_it_after_the_peer_is_gone(
        federation, servers, tmp_path):
    configure(federation)
    await federation.start_federation("home", "gpu-west")
    gate = tmp_path / "gate"
    script = (f"echo first; while [ ! -e {gate} ]; do sleep 0.05; done; "
              "for i in 1 2 3; do echo line $i; sleep 0.2; done; printf 'tail'; echo oops >&2")
    async with user_client(federation, servers, "alice") as alice:
        await alice.submit(["sh", "-c", script], job_id="printer", constraints=GPU)
        seen: list[str] = []
        async with asyncio.timeout(120):
            async for line in alice.logs("printer", follow=True):
                seen.append(line)
                if line == "first\n":
                    gate.touch()  # the job goes on only once its first line came home
        assert seen == ["first\n", "line 1\n", "line 2\n", "line 3\n", "tail"]
        job = await federation.wait_state("alice:printer", "succeeded")
        assert job.owner_peer_id == "gpu-west"

        # The peer's run folders deleted and its agent stopped: the output stays readable.
        federation.stop("gpu-west")
        shutil.rmtree(federation.tmp / "work" / "gpu-west")
        assert [line async for line in alice.logs("printer")] == seen
        assert [line async for line in alice.logs("printer", stderr=True)] == ["oops\n"]

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    shown = cli_as(federation, servers, "alice", "logs", "printer", cwd=empty)
    assert (shown.returncode, shown.stdout) == (0, b"first\nline 1\nline 2\nline 3\ntail"), shown.stderr

    # Bob: alice's job is answered exactly as a job that does not exist, whichever way he names it.
    async with user_client(federation, servers, "bob") as bob:
        for job_id in ("printer", "never-submitted"):
            with pytest.raises(NotFoundError) as refused:
                [line async for line in bob.logs(job_id)]
            assert str(refused.value) == f"not_found: no job {job_id!r}"
    bob_nc = await connect_client(servers.nats_url_for("user-bob"))
    try:
        for job_id in ("alice:printer", "printer"):
            reply = await bob_nc.request(f"{federation.prefix}.read.logs.bob", json.dumps({"job_id": job_id}).encode(),
                                         timeout=5)
            assert json.loads(reply.data) == {"error": {"code": "not_found", "message": f"no job {job_id!r}"}}
    finally:
        await bob_nc.close()
    refused = cli_as(federation, servers, "bob", "logs", "printer", cwd=empty)
    assert refused.returncode != 0 and b"no job 'printer'" in refused.stderr and refused.stdout == b""


async def test_follow_exits_with_the_jobs_status_and_terminal_escapes_are_shown_inert(federation, servers, tmp_path):
    configure(federation)
    await federation.start_federation("home")
    async with user_client(federation, servers, "alice") as alice:
        await alice.submit(["sh", "-c", r"printf 'bad \033[31mred\033]0;title\007 \377\n'; exit 7"], job_id="hostile")
        await federation.wait_state("alice:hostile", "failed")
    followed = cli_as(federation, servers, "alice", "logs", "hostile", "--follow", cwd=tmp_path)
    assert followed.returncode == 7, followed.stderr
    assert followed.stdout == b"bad \x1b[31mred\x1b]0;title\x07 \xff\n"  # piped: the bytes as written
    script = ("import sys; from irisfed.cli.logs import write_output; "
              "write_output(sys.stdin.buffer.read(), tty=True)")
    shown = subprocess.run([sys.executable, "-c", script], input=followed.stdout, capture_output=True, check=True)
    assert b"\x1b" not in shown.stdout and b"\x07" not in shown.stdout and b"\\x1b[31mred" in shown.stdout
