"""Jobs that wait for other jobs (docs/design.md §3.8) through real router, tick and
agent processes: a chain across peers, each condition, a broken chain ending whole,
and the ids a user may name."""

from __future__ import annotations

import pytest

from irisfed.tooling.federation import Peer, render_config

pytestmark = pytest.mark.e2e

GPU = [{"key": "device_type", "op": "eq", "value": "gpu"}]
TPU = [{"key": "device_type", "op": "eq", "value": "tpu"}]
ENDED = ("succeeded", "failed", "killed", "rejected", "unschedulable")


def configure(federation) -> None:
    federation.config_path.write_text(render_config(
        [Peer("home", {"device_type": "cpu"}, slots=2), Peer("gpu-west", {"device_type": "gpu"}, slots=2),
         Peer("tpu-east", {"device_type": "tpu"}, slots=2)],
        users=[{"id": "alice"}, {"id": "bob"}], local_cluster="home", subject_prefix=federation.prefix,
        heartbeat_interval_s=0.25, heartbeat_ttl_s=1.5, tick_interval_s=0.25, assign_grace_s=1.0))


async def _changes(federation, job_id: str) -> list:
    return await federation.store.changelog_list_for_job(job_id)


async def test_a_chain_across_peers_runs_each_step_after_the_last_ended(federation, tmp_path):
    configure(federation)
    await federation.start_federation("home", "gpu-west", "tpu-east")
    await federation.submit({"job_id": "prep", "command": ["sleep", "1"]})
    train = await federation.submit({"job_id": "train", "command": ["sleep", "0.5"], "constraints": GPU,
                                     "after": [{"job_id": "prep"}]})
    assert (train["state"], train["disposition"]) == ("queued", "queue"), train
    assert train["reason"].startswith("waiting for its dependencies: prep ("), train
    evaluate = await federation.submit({"job_id": "eval", "command": ["true"], "constraints": TPU,
                                        "after": [{"job_id": "train", "when": "ok"}]})
    waiting = await federation.job("eval")
    assert (waiting.state, waiting.explanation["wait"]) == ("queued", "dependency")
    assert evaluate["state"] == "queued"
    jobs = {j: await federation.wait_state(j, *ENDED, timeout=120) for j in ("prep", "train", "eval")}
    assert {j: (row.state, row.owner_peer_id) for j, row in jobs.items()} == {
        "prep": ("succeeded", "home"), "train": ("succeeded", "gpu-west"), "eval": ("succeeded", "tpu-east")}
    ended = {j: next(e.at for e in await _changes(federation, j) if e.to_state == "succeeded") for j in jobs}
    started = {j: next(e.at for e in await _changes(federation, j) if e.to_state == "running") for j in jobs}
    assert ended["prep"] <= started["train"] and ended["train"] <= started["eval"], (ended, started)
    shown = federation.cli("job", "eval")
    assert "after       train (succeeded: must succeed)" in shown.stdout, shown.stderr
    assert "dependents  eval (succeeded: must succeed)" in federation.cli("job", "train").stdout


async def test_conditions_and_a_broken_chain_ending_whole(federation):
    configure(federation)
    await federation.start_federation("home")
    await federation.submit({"job_id": "bad", "command": ["sh", "-c", "exit 3"]})
    await federation.submit({"job_id": "next", "command": ["true"], "after": [{"job_id": "bad"}]})
    await federation.submit({"job_id": "after-next", "command": ["true"], "after": [{"job_id": "next"}]})
    await federation.submit({"job_id": "cleanup", "command": ["true"], "after": [{"job_id": "bad", "when": "any"}]})
    await federation.submit({"job_id": "on-failure", "command": ["true"],
                             "after": [{"job_id": "bad", "when": "failed"}]})
    rows = {j: await federation.wait_state(j, *ENDED, timeout=60)
            for j in ("bad", "next", "after-next", "cleanup", "on-failure")}
    assert {j: r.state for j, r in rows.items()} == {
        "bad": "failed", "next": "unschedulable", "after-next": "unschedulable", "cleanup": "succeeded",
        "on-failure": "succeeded"}
    assert rows["next"].reason == "dependency bad ended failed; it had to succeed"
    assert rows["after-next"].reason == "dependency next ended unschedulable; it had to succeed"
    assert [e.to_state for e in await _changes(federation, "next")] == ["queued", "unschedulable"]
    # A dependency already broken at submit: unschedulable at once, nothing placed.
    late = await federation.submit({"job_id": "late", "command": ["true"], "after": [{"job_id": "bad"}]})
    assert (late["state"], late["reason"]) == ("unschedulable", "dependency bad ended failed; it had to succeed")


async def test_a_cancelled_middle_ends_the_rest_of_the_chain(federation):
    configure(federation)
    await federation.start_federation("home")
    await federation.submit({"job_id": "first", "command": ["sleep", "60"]})
    dry = await federation.submit({"job_id": "middle", "command": ["true"], "after": [{"job_id": "first"}],
                                   "dry_run": True})
    assert (dry["state"], dry["waiting_code"], dry["placement"]) == ("queued", "dependency", None), dry
    assert dry["waiting"].startswith("waiting for its dependencies: first (")
    assert await federation.job("middle") is None  # a dry run writes nothing
    await federation.submit({"job_id": "middle", "command": ["true"], "after": [{"job_id": "first"}]})
    await federation.submit({"job_id": "last", "command": ["true"], "after": [{"job_id": "middle"}]})
    assert (await federation.cancel("middle"))["state"] == "killed"
    last = await federation.wait_state("last", *ENDED, timeout=30)
    assert (last.state, last.reason) == ("unschedulable", "dependency middle ended killed; it had to succeed")
    await federation.cancel("first")
    assert (await federation.wait_state("first", *ENDED)).state == "killed"


async def test_only_your_own_existing_jobs_may_be_named(federation, servers):
    if servers.nats_auth is None:
        pytest.skip("needs the NATS users the tests generate")
    from irisfed.client import Client
    from irisfed.errors import InvalidRequestError

    configure(federation)
    await federation.start_federation("home")

    def client(user: str) -> Client:
        return Client.connect(nats_url=servers.nats_url_for(f"user-{user}"), prefix=federation.prefix,
                              database_url="", state_dir=federation.tmp / "nowhere", timeout=5.0)
    async with client("bob") as bob:
        await bob.submit(["true"], job_id="bobs")
    async with client("alice") as alice:
        for named in ("bobs", "nowhere"):  # another user's job reads as one that does not exist
            with pytest.raises(InvalidRequestError, match=f"after: no job '{named}' of yours to wait for"):
                await alice.submit(["true"], job_id=f"waits-{named}", after=[named])
        with pytest.raises(InvalidRequestError, match="after"):  # a stored id is no id a user submits
            await alice.submit(["true"], job_id="waits-stored", after=["bob:bobs"])
        await alice.submit(["true"], job_id="mine")
        reply = await alice.submit(["true"], job_id="waits-mine", after=[("mine", "any")])
        assert reply.state == "queued"
        assert (await alice.wait("waits-mine", timeout=60)).state == "succeeded"
        again = await alice.submit(["true"], job_id="waits-mine", after=[("mine", "any")])
        assert again.duplicate
    assert await federation.job("alice:waits-bobs") is None and await federation.job("alice:waits-nowhere") is None
