"""Several users on one federation (docs/design.md §3.2; invariants 9 and 10), end to end:
router, ticks and agents as processes, users on their own NATS credentials."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from irisfed.services.common.bus import connect_client
from irisfed.shared.config import DATABASE_URL_ENV, NATS_URL_ENV
from irisfed.shared.lifecycle import TERMINAL_STATES
from irisfed.tooling.federation import Peer
from tests.infra.configs import federation_config, make_peer
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

SLEEP = {"command": ["sleep", "300"]}


def users_config(prefix: str, users, peers=None) -> str:
    peers = peers or [make_peer("home", "cpu", 4), make_peer("gpu-west", "gpu", 4)]
    return federation_config(peers, prefix, users=users)


class UserConnection:
    """A user's own NATS connection (its credentials, its inbox) and the errors the server sent it."""

    def __init__(self, nc, prefix: str, user: str) -> None:
        self.nc, self.prefix, self.user = nc, prefix, user
        self.errors: list[str] = []

    @classmethod
    async def open(cls, servers, prefix: str, user: str) -> UserConnection:
        errors: list[str] = []

        async def error_cb(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await connect_client(servers.nats_url_for(f"user-{user}"), error_cb=error_cb)
        made = cls(nc, prefix, user)
        made.errors = errors
        return made

    async def request(self, verb: str, body: dict, subject_user: str | None = None, timeout: float = 2.0):
        subject = f"{self.prefix}.{verb}.{subject_user or self.user}"
        try:
            reply = await self.nc.request(subject, json.dumps(body).encode(), timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return None
        return json.loads(reply.data)

    async def submit(self, body: dict) -> dict:
        return await wait_for(lambda: self.request("submit", body), f"{self.user}'s submit reply")

    async def cancel(self, job_id: str) -> dict:
        return await wait_for(lambda: self.request("cancel", {"job_id": job_id}), f"{self.user}'s cancel reply")

    async def close(self) -> None:
        await self.nc.close()


@pytest.fixture
async def as_user(servers, subject_prefix):
    if servers.nats_auth is None:
        pytest.skip("the NATS server came from IRISFED_TEST_NATS_URL: these tests need the users the tests "
                    "generate (run without it)")
    opened: list[UserConnection] = []

    async def connect(user: str) -> UserConnection:
        connection = await UserConnection.open(servers, subject_prefix, user)
        opened.append(connection)
        return connection

    yield connect
    for connection in opened:
        await connection.close()


def start_another(federation, name: str, service: str) -> None:
    """A second router or tick: another process of the same service."""
    env = {**federation.base_env, NATS_URL_ENV: federation.nats_url_for(service),
           DATABASE_URL_ENV: federation.database_url}
    federation.supervisor.start(name, federation.argv(service), env, cwd=federation.cwd)


async def test_two_users_same_job_id_are_two_jobs_and_cancels_stay_with_their_owner(federation, as_user):
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}, {"id": "bob"}]))
    await federation.start_federation("home")
    alice, bob = await as_user("alice"), await as_user("bob")

    first = await alice.submit({**SLEEP, "job_id": "train-1"})
    second = await bob.submit({"command": ["sleep", "301"], "job_id": "train-1"})
    assert (first["job_id"], first["duplicate"]) == ("train-1", False)
    assert (second["job_id"], second["duplicate"]) == ("train-1", False)  # not a conflict: another user's id
    jobs = {job_id: await federation.job(job_id) for job_id in ("alice:train-1", "bob:train-1")}
    assert {j.user_id for j in jobs.values()} == {"alice", "bob"}
    assert await federation.job("train-1") is None  # the default user has no such job
    assert (await alice.submit({**SLEEP, "job_id": "train-1"}))["duplicate"] is True  # alice's own repeat

    await federation.wait_state("alice:train-1", "running")
    refused = await bob.request("cancel", {"job_id": "only-alice"})
    assert refused is None or refused["error"]["code"] == "not_found"
    only = await alice.submit({**SLEEP, "job_id": "only-alice"})
    await federation.wait_state("alice:only-alice", "running")
    refused = await bob.cancel(only["job_id"])
    assert refused == {"error": {"code": "not_found", "message": "no job 'only-alice'"}}

    # Bob's cancel of his own train-1 kills his, never alice's.
    assert (await bob.cancel("train-1"))["job_id"] == "train-1"
    killed = await federation.wait_state("bob:train-1", "killed")
    assert "bob" in killed.reason and killed.cancel_requested_by == "user bob"
    for job_id in ("alice:train-1", "alice:only-alice"):
        job = await federation.job(job_id)
        assert job.state == "running" and not job.cancel_requested

    # An operator may cancel any job, by its stored id; the history names the operator.
    reply = await wait_for(lambda: federation.request("operator.cancel", {"job_id": "alice:only-alice",
                                                                          "by": "cli"}), "operator cancel")
    assert reply["job_id"] == "alice:only-alice" and reply["outcome"] == "kill_sent"
    ended = await federation.wait_state("alice:only-alice", "killed")
    assert ended.cancel_requested_by == "operator (cli)" and "operator (cli)" in ended.reason


async def test_a_users_credentials_speak_only_for_that_user(federation, as_user):
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}, {"id": "bob"}]))
    await federation.start_federation("home")
    alice = await as_user("alice")
    await alice.submit({**SLEEP, "job_id": "mine"})

    # Publishing on bob's subjects: the server refuses it; nothing reaches the router.
    assert await alice.request("submit", {**SLEEP, "job_id": "as-bob"}, subject_user="bob", timeout=1.0) is None
    assert await alice.request("cancel", {"job_id": "x"}, subject_user="bob", timeout=1.0) is None
    for verb in ("submit", "operator.cancel"):
        await alice.nc.publish(f"{federation.prefix}.{verb}", b'{"command": ["true"]}')
    # Reading bob's replies (his inbox) or other users' traffic: refused too.
    await alice.nc.subscribe("_INBOX_user-bob.>")
    await alice.nc.subscribe(f"{federation.prefix}.submit.bob")
    await alice.nc.flush()

    async def refused():
        text = " ".join(alice.errors).lower()
        wanted = [f"publish to \"{federation.prefix}.submit.bob\"", f"publish to \"{federation.prefix}.cancel.bob\"",
                  f"publish to \"{federation.prefix}.submit\"", f"publish to \"{federation.prefix}.operator.cancel\"",
                  "subscription to \"_inbox_user-bob.>\"", f"subscription to \"{federation.prefix}.submit.bob\""]
        return all(w.lower() in text for w in wanted) or None

    await wait_for(refused, "the server to refuse each of alice's attempts")
    assert await federation.job("bob:as-bob") is None
    assert [j.job_id for j in await federation.store.job_list(None, 50)] == ["alice:mine"]


async def test_hostile_requests_are_refused_and_write_nothing(federation):
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}]))
    await federation.start_federation("home")
    # A body cannot name its user: unknown field.
    reply = await federation.submit({**SLEEP, "user": "alice"})
    assert reply["error"]["code"] == "invalid_request" and "user" in reply["error"]["message"]
    # A subject naming an unconfigured user (the admin NATS user may publish anywhere).
    for verb, body in (("submit.mallory", SLEEP), ("cancel.mallory", {"job_id": "x"})):
        reply = await wait_for(lambda v=verb, b=body: federation.request(v, b), f"{verb} reply")
        assert reply["error"] == {"code": "forbidden",
                                  "message": "no user 'mallory' is configured in this federation"}
    # An operator cancel of an id no job can have.
    reply = await wait_for(lambda: federation.request("operator.cancel", {"job_id": "Alice:x"}), "reply")
    assert reply["error"]["code"] == "invalid_request"
    assert await federation.store.job_list(None, 50) == []


async def test_a_removed_users_jobs_stay_readable_and_cancellable_by_operators(federation, as_user):
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}, {"id": "bob"}]))
    await federation.start_federation("home")
    alice = await as_user("alice")
    await alice.submit({**SLEEP, "job_id": "left-behind"})
    await federation.wait_state("alice:left-behind", "running")

    federation.stop("router")
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "bob"}]))
    federation.start("router")
    await federation.wait_router()

    reply = await alice.request("submit", {**SLEEP, "job_id": "after"}, timeout=2.0)
    assert reply is not None and reply["error"]["code"] == "forbidden"
    shown = federation.cli("job", "alice:left-behind", "--json")
    assert shown.returncode == 0, shown.stderr
    shown = json.loads(shown.stdout)["job"]
    assert (shown["job_id"], shown["user_id"]) == ("alice:left-behind", "alice")
    cancelled = federation.cli("cancel", "--operator", "alice:left-behind")
    assert cancelled.returncode == 0, cancelled.stderr
    job = await federation.wait_state("alice:left-behind", "killed")
    assert job.cancel_requested_by == "operator (cli)"


async def test_a_quota_holds_with_two_routers_and_two_ticks(federation, as_user):
    peers = [Peer("home", {"device_type": "cpu"}, slots=8, resources={"cpu": 16, "gpu": 4}),
             Peer("gpu-west", {"device_type": "gpu"}, slots=8, resources={"cpu": 16, "gpu": 4})]
    federation.config_path.write_text(users_config(
        federation.prefix, [{"id": "alice", "quota": {"gpu": 2}}, {"id": "bob"}], peers))
    await federation.start_federation("home", "gpu-west")
    start_another(federation, "router-2", "router")
    start_another(federation, "tick-2", "tick")
    alice = await as_user("alice")

    too_big = await alice.submit({"command": ["true"], "resources": {"gpu": 3}})
    assert too_big["disposition"] == "reject"
    assert too_big["reason"] == "quota: the job asks 3 gpu; user alice's quota allows 2 in all"

    # Half LOCAL (the router assigns them, under the quota lock), half queued for the ticks.
    bodies = [{"command": ["sleep", "0.4"], "job_id": f"g{i}", "resources": {"gpu": 1, "cpu": 1},
               **({"constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]} if i % 2 else {})}
              for i in range(20)]
    replies = await asyncio.gather(*(alice.submit(body) for body in bodies))
    assert all("error" not in r for r in replies)
    ids = [f"alice:g{i}" for i in range(20)]

    async def all_ended():
        jobs = [await federation.job(job_id) for job_id in ids]
        return all(j.state in TERMINAL_STATES for j in jobs) or None

    await wait_for(all_ended, "alice's 20 jobs to end", timeout=180)
    assert {(await federation.job(job_id)).state for job_id in ids} == {"succeeded"}
    # From the changelog: how many GPUs alice's live jobs held after every change.
    live: set[str] = set()
    most = 0
    for row in sorted(await federation.store.changelog_list_all(), key=lambda r: r.seq):
        if row.job_id not in ids:
            continue
        if row.to_state in ("assigned", "running"):
            live.add(row.job_id)
        else:
            live.discard(row.job_id)
        most = max(most, len(live))
    assert most == 2  # reached, never passed
    waited = [r for r in await federation.store.changelog_list_all()
              if r.job_id in ids and r.to_state == "queued" and (r.detail or "").startswith("quota:")]
    assert waited  # LOCAL submits the quota turned into queued ones


async def _fair_round(federation, alice, bob, tag: str) -> list[str]:
    """Alice queues 200 short jobs, then bob 20; the order they started in (by user)."""
    gpu = {"constraints": [{"key": "device_type", "op": "eq", "value": "gpu"}]}
    await asyncio.gather(*(alice.submit({"command": ["sleep", "0.1"], "job_id": f"{tag}-a{i}", **gpu})
                           for i in range(200)))
    await asyncio.gather(*(bob.submit({"command": ["sleep", "0.1"], "job_id": f"{tag}-b{i}", **gpu})
                           for i in range(20)))
    bobs = [f"bob:{tag}-b{i}" for i in range(20)]

    async def bob_done():
        states = [(await federation.job(j)).state for j in bobs]
        return all(state in TERMINAL_STATES for state in states) or None

    await wait_for(bob_done, f"bob's jobs ({tag}) to end", timeout=240)
    history = sorted(await federation.store.changelog_list_all(), key=lambda r: r.seq)
    started = [row.job_id.split(":")[0] for row in history
               if row.to_state == "running" and row.job_id.split(":")[-1].startswith(f"{tag}-")]
    return started


async def test_fair_share_interleaves_users_and_respects_weights(federation, as_user):
    peers = [Peer("home", {"device_type": "cpu"}, slots=2), Peer("gpu-west", {"device_type": "gpu"}, slots=4)]
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}, {"id": "bob"}], peers))
    await federation.start_federation("home", "gpu-west")
    alice, bob = await as_user("alice"), await as_user("bob")

    even = await _fair_round(federation, alice, bob, "even")
    assert even.count("bob") == 20
    alice_before_bobs_last = even[:len(even) - even[::-1].index("bob")].count("alice")
    assert alice_before_bobs_last < 100  # every bob job started before alice's 100th

    # Drain alice's backlog, then weight bob 3 and run it again.
    for row in await federation.store.job_list("queued", 1000, user_id="alice"):
        await alice.cancel(row.job_id.split(":", 1)[1])
    federation.stop("tick")
    federation.stop("router")
    federation.config_path.write_text(users_config(
        federation.prefix, [{"id": "alice"}, {"id": "bob", "weight": 3}], peers))
    federation.start("router")
    federation.start("tick")
    await federation.wait_router()
    weighted = await _fair_round(federation, alice, bob, "weighted")
    weighted_before = weighted[:len(weighted) - weighted[::-1].index("bob")].count("alice")
    assert weighted_before < alice_before_bobs_last, (weighted_before, alice_before_bobs_last)


async def test_the_client_acts_as_the_user_its_credentials_name(federation, as_user, servers):
    from irisfed.client import Client, NotFoundError

    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}]))
    await federation.start_federation("home")
    await as_user("alice")  # (skips without the tests' own NATS users)
    async with Client.connect(servers.nats_url_for("user-alice"), federation.database_url,
                              prefix=federation.prefix) as client:
        assert client.user == "alice"  # from the URL's user-alice
        reply = await client.submit(["sleep", "300"], job_id="c1")
        assert (reply.job_id, reply.duplicate) == ("c1", False)
        job = await client.get("c1")
        assert (job.job_id, job.user, job.state) in {("c1", "alice", "assigned"), ("c1", "alice", "running")}
        assert (await client.cancel("c1")).job_id == "c1"
        assert (await client.wait("c1", timeout=60)).state == "killed"
    async with Client.connect(servers.nats_url_for("producer"), federation.database_url,
                              prefix=federation.prefix) as default:
        assert default.user == "default"
        with pytest.raises(NotFoundError):
            await default.get("c1")  # the default user's c1 does not exist
        with pytest.raises(NotFoundError):
            await default.cancel("c1")
    killed = await federation.job("alice:c1")
    assert killed.state == "killed" and killed.cancel_requested_by == "user alice"


async def test_the_command_line_submits_and_cancels_as_a_user(federation, as_user, servers):
    federation.config_path.write_text(users_config(federation.prefix, [{"id": "alice"}, {"id": "bob"}]))
    await federation.start_federation("home")
    await as_user("alice")  # (skips without the tests' own NATS users)
    alice_url = servers.nats_url_for("user-alice")
    made = federation.cli("submit", "--user", "alice", "--nats-url", alice_url, "--id", "cli-1", "--",
                          "sleep", "300")
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("cli-1: local → assigned on home")
    assert (await federation.job("alice:cli-1")).user_id == "alice"
    # The URL's user-alice is the user when --user is not given.
    cancelled = federation.cli("cancel", "--nats-url", alice_url, "cli-1")
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith("cli-1: ")
    await federation.wait_state("alice:cli-1", "killed")
    # Another user's name with alice's credentials: said at once, nothing sent.
    refused = federation.cli("submit", "--user", "bob", "--nats-url", alice_url, "--", "true")
    assert refused.returncode == 2 and "--user bob: the NATS URL is 'alice''s" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "s3cret" not in refused.stderr
    bad = federation.cli("submit", "--user", "Bob;rm", "--", "true")
    assert bad.returncode == 2 and "invalid" in bad.stderr
    assert [j.job_id for j in await federation.store.job_list(None, 50)] == ["alice:cli-1"]
