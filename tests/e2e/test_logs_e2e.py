"""Logs come home (docs/design.md §3.6; invariant 15), end to end: router, tick and
agents as processes; users on their own NATS credentials and no database URL."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from datetime import datetime

import pytest

from irisfed.client import Client
from irisfed.errors import NotFoundError
from irisfed.services.common.bus import connect_client
from tests.infra.configs import make_peer
from tests.infra.probes import returns
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

PEERS = [make_peer("home", "cpu", 4), make_peer("gpu-west", "gpu", 4)]
GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]


def configure(federation) -> None:
    federation.configure(PEERS, users=[{"id": "alice"}, {"id": "bob"}])


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


async def test_a_user_reads_its_own_jobs_with_only_its_nats_credentials(federation, servers, tmp_path):
    """`jobs`, `job`, `explain`, `users`, `outputs` and `watch` from an empty folder with
    alice's NATS URL only: her jobs by her ids; bob sees none of them; each reads as if
    the other's did not exist."""
    configure(federation)
    await federation.start_federation("home")
    async with user_client(federation, servers, "alice") as alice:
        await alice.submit(["sh", "-c", "echo hi"], job_id="train-3", env={"TOKEN": "alice-secret"})
        done = await alice.wait("train-3", timeout=60)  # through the router: no database URL
        assert done.state == "succeeded"
        assert (await alice.get("train-3")).state == "succeeded"
    async with user_client(federation, servers, "bob") as bob:
        await bob.submit(["true"], job_id="bobs")
        with pytest.raises(NotFoundError):
            await bob.get("train-3")

    def as_alice(*args: str) -> subprocess.CompletedProcess:
        return cli_as(federation, servers, "alice", *args, cwd=tmp_path)

    jobs = json.loads(as_alice("jobs", "--json").stdout)
    assert [(j["job_id"], j["user_id"], j["state"]) for j in jobs] == [("train-3", "alice", "succeeded")]
    detail = json.loads(as_alice("job", "train-3", "--json").stdout)
    assert detail["job"]["job_id"] == "train-3" and detail["job"]["spec"]["env"] == {"TOKEN": "alice-secret"}
    assert [c["to_state"] for c in detail["changelog"]] == ["assigned", "running", "succeeded"]  # a local job
    explained = json.loads(as_alice("explain", "train-3", "--json").stdout)
    assert (explained["job_id"], explained["state"]) == ("train-3", "succeeded")
    users = json.loads(as_alice("users", "--json").stdout)
    assert [u["user_id"] for u in users if u["queued"] or u["running"] or u["usage"]] in ([], ["alice"])
    assert "bob" not in {u["user_id"] for u in users if u["queued"] or u["running"]}
    watched = as_alice("watch", "train-3")
    assert watched.returncode == 0 and b"train-3: succeeded" in watched.stdout, watched.stderr
    # Each change once, at the time it happened (not when watch read it).
    assert [line.split()[0] for line in watched.stdout.decode().splitlines()] == [
        datetime.fromisoformat(c["at"]).astimezone().strftime("%H:%M:%S") for c in detail["changelog"]]
    nothing = as_alice("outputs", "train-3")
    assert nothing.returncode == 1 and b"has no outputs" in nothing.stderr

    for args in (("job", "bobs"), ("job", "bob:bobs"), ("explain", "bobs"), ("watch", "bobs")):
        refused = as_alice(*args)
        assert refused.returncode != 0 and f"no job {args[1]!r}".encode() in refused.stderr, (args, refused.stderr)
    assert json.loads(cli_as(federation, servers, "bob", "jobs", "--json", cwd=tmp_path).stdout)[0]["job_id"] == "bobs"

    # Inside the state folder (the database URL at hand) alice's own id still names her job.
    scoped = subprocess.run([sys.executable, "-m", "irisfed.cli", "job", "train-3", "--json"],
                            env={**federation.env, "IRISFED_NATS_URL": servers.nats_url_for("user-alice")},
                            cwd=federation.tmp, capture_output=True, text=True, timeout=60, check=False)
    assert json.loads(scoped.stdout)["job"]["job_id"] == "alice:train-3", scoped.stderr


async def test_a_users_credentials_reach_no_log_stream_and_no_one_elses_events(federation, servers):
    """Server-enforced: what a user reads of logs comes through the router's check."""
    if servers.nats_auth is None:
        pytest.skip("needs the NATS users the tests generate")
    refusals: list[str] = []

    async def on_error(exc: Exception) -> None:
        refusals.append(str(exc))
    nc = await connect_client(servers.nats_url_for("user-alice"), error_cb=on_error)
    try:
        subjects = [">", f"{federation.prefix}.>", "$JS.>", "$O.>", f"{federation.prefix}.logs.>",
                    f"{federation.prefix}.events.*"]
        for subject in subjects:
            await nc.subscribe(subject)
        # (Its JetStream rights name no log stream: test_security's table; this test server's
        # "*" prefix lets users read any bucket, so it cannot show that part.)
        await nc.publish(f"{federation.prefix}.read.logs.bob", b'{"job_id": "x"}')  # speaking for bob
        await nc.flush()
        await wait_for(lambda: returns(len(refusals) >= len(subjects) + 1), "the server to refuse each")
    finally:
        await nc.close()
    assert all("permissions violation" in r.lower() for r in refusals), refusals
    for subject in subjects:
        assert any(f'subscription to "{subject}"'.lower() in r.lower() for r in refusals), (subject, refusals)
    assert any(f'publish to "{federation.prefix}.read.logs.bob"' in r for r in refusals), refusals


async def test_a_user_hears_its_own_jobs_events_by_its_ids_and_no_one_elses(federation, servers):
    """Events on ``P.uevents.<user>.>``: the user's own credentials may subscribe there
    (and the server refuses another user's); each state change arrives with the id the
    user submitted, not the stored ``alice:...``."""
    if servers.nats_auth is None:
        pytest.skip("needs the NATS users the tests generate")
    configure(federation)
    await federation.start_federation("home", "gpu-west")
    refusals: list[str] = []
    heard: list[dict] = []

    async def on_error(exc: Exception) -> None:
        refusals.append(str(exc))

    async def on_event(msg) -> None:
        heard.append({"subject": msg.subject, **json.loads(msg.data)})
    nc = await connect_client(servers.nats_url_for("user-alice"), error_cb=on_error)
    try:
        await nc.subscribe(f"{federation.prefix}.uevents.alice.>", cb=on_event)
        await nc.subscribe(f"{federation.prefix}.uevents.bob.>")
        await nc.flush()
        async with user_client(federation, servers, "alice") as alice:
            await alice.submit(["true"], job_id="heard-1", constraints=GPU)
        async with user_client(federation, servers, "bob") as bob:
            await bob.submit(["true"], job_id="bobs-own")
            assert (await bob.wait("bobs-own", timeout=60)).state == "succeeded"
        await wait_for(lambda: returns(any(e["state"] == "succeeded" for e in heard)), "alice's job to end")
        await wait_for(lambda: returns(refusals), "the server to refuse bob's subject")
    finally:
        await nc.close()
    assert [e["state"] for e in heard] == ["queued", "assigned", "running", "succeeded"], heard
    assert {(e["subject"], e["job_id"]) for e in heard} == {(f"{federation.prefix}.uevents.alice.heard-1", "heard-1")}
    assert any(f'subscription to "{federation.prefix}.uevents.bob.>"' in r for r in refusals), refusals
