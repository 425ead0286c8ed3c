"""Users in the command line against a real Postgres: ``irisfed users`` (live usage
against quota, weight, share of what the reachable peers advertise, queued and running
jobs), ``irisfed jobs --user``, and ``irisfed job`` / ``explain`` on a user's stored id
(its user, who asked to cancel it, the waiting code ``quota``). Jobs are inserted as the
router and the tick would write them; the commands run in process (``irisfed.cli.main``)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from irisfed.shared.records import Explanation
from tests.infra.cli_runs import cli_on
from tests.infra.factories import (
    advertise,
    advertise_resources,
    assign_jobs,
    insert_jobs,
    start_jobs,
    user_job,
)

USERS = [{"id": "alice", "weight": 2.0, "quota": {"gpu": 2}},
         {"id": "bob", "max_band": "batch", "quota": {"cpu": 8, "slots": 3}}]
QUOTA_RULE = "quota: this job's 1 gpu would take alice over its quota of 2 gpu"


async def populate(database_url: str) -> None:
    pool = await dbmod.connect(database_url, max_size=2)
    store = Store(pool)
    try:
        gpu = {"resources": {"gpu": 1, "cpu": 1.5}}
        running = [user_job("alice", "train-1", **gpu), user_job("default", "plain-1")]
        assigned = [user_job("alice", "train-2", **gpu)]
        done = [user_job("alice", "old-1", resources={"gpu": 2})]
        waiting = msgspec.structs.replace(
            user_job("alice", "train-3", **gpu),
            explanation=Explanation(msgspec.json.encode(explanation("tick", QUOTA_RULE, code="quota"))))
        queued = [waiting, user_job("carol", "left-1")]  # carol: no longer configured, still has a job
        await insert_jobs(store, running + assigned + done + queued)
        await assign_jobs(store, running + assigned + done, "gpu-west")
        await start_jobs(store, running + done, "gpu-west")
        await store.job_finish_batch("gpu-west", [(done[0].job_id, 1, 0, False)])
        await store.job_request_cancel("alice:train-1", "user alice")
        await advertise_resources(store, "gpu-west", {"gpu": 4, "cpu": 16}, slots=8)
        await advertise(store, "home", slots=2)
        await advertise_resources(store, "mars", {"gpu": 100}, slots=100)  # not configured: not counted
    finally:
        await pool.close()


@pytest.fixture
def cli(database_url, tmp_path, monkeypatch, capsys):
    """``cli(*args, config=True)`` → (exit code, stdout, stderr) of ``irisfed *args`` against a
    populated database; ``--config`` names the users' TOML unless ``config=False``."""
    asyncio.run(populate(database_url))
    return cli_on(database_url, USERS, tmp_path, monkeypatch, capsys)


def test_users_shows_usage_against_quota_weight_share_and_counts(cli):
    code, out, err = cli("users", "--json")
    assert code == 0, err
    users = {u["user_id"]: u for u in json.loads(out)}
    assert list(users) == ["alice", "bob", "carol", "default"]
    alice = users["alice"]
    # Two live jobs (one running, one assigned) of gpu 1 and cpu 1.5 each; the finished and
    # the queued one hold nothing.
    assert alice["usage"] == {"cpu": 3, "gpu": 2, "slots": 2} and alice["quota"] == {"gpu": 2}
    assert (alice["queued"], alice["running"], alice["weight"], alice["configured"]) == (1, 2, 2.0, True)
    # Totals of reachable configured peers: slots 8 + 2, gpu 4, cpu 16 → gpu 2/4 over weight 2.
    assert alice["share"] == pytest.approx(0.25)
    assert users["bob"] == {"user_id": "bob", "configured": True, "usage": {}, "quota": {"cpu": 8, "slots": 3},
                            "weight": 1.0, "share": 0.0, "queued": 0, "running": 0, "max_band": "batch"}
    assert (users["carol"]["configured"], users["carol"]["queued"], users["carol"]["running"]) == (False, 1, 0)
    assert users["default"]["usage"] == {"cpu": 1, "slots": 1}
    assert users["default"]["share"] == pytest.approx(0.1)  # 1 slot of 10 (cpu: 1 of 16)

    code, out, _ = cli("users", "-o", "tsv")
    lines = out.splitlines()
    assert lines[0] == "user\tusage/quota\tweight\tshare\tqueued\trunning\tmax_band"
    assert lines[1] == "alice\tgpu 2/2, cpu 3/-\t2\t25.0%\t1\t2\tinteractive"
    assert lines[2] == "bob\tcpu 0/8, slots 0/3\t1\t0.0%\t0\t0\tbatch"


def test_users_without_a_configuration_lists_users_with_jobs(cli):
    code, out, err = cli("users", "--json", config=False)
    assert code == 0, err
    users = {u["user_id"]: u for u in json.loads(out)}
    assert list(users) == ["alice", "carol", "default"]  # bob has no jobs and nothing names him
    assert (users["alice"]["quota"], users["alice"]["weight"]) == (None, None)
    # Unweighted, and every reachable peer's heartbeat counts (mars too): gpu 2 of 104,
    # cpu 3 of 16, slots 2 of 110.
    assert users["alice"]["share"] == pytest.approx(3 / 16)
    code, out, _ = cli("users", config=False)
    assert out.splitlines()[1].split() == ["alice", "cpu", "3,", "gpu", "2", "-", "18.8%", "1", "2", "-"]


def test_jobs_filters_by_user_and_shows_each_jobs_user(cli):
    code, out, err = cli("jobs", "--user", "alice", "--json")
    assert code == 0, err
    jobs = json.loads(out)
    assert sorted(j["job_id"] for j in jobs) == ["alice:old-1", "alice:train-1", "alice:train-2", "alice:train-3"]
    assert {j["user_id"] for j in jobs} == {"alice"}
    code, out, _ = cli("jobs", "--user", "alice", "--state", "queued", "--json")
    assert [j["job_id"] for j in json.loads(out)] == ["alice:train-3"]
    assert cli("jobs", "--user", "bob", "--json")[1].strip() == "[]"

    code, out, _ = cli("jobs")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["JOB", "USER", "STATE"]
    assert {tuple(line.split()[:2]) for line in lines[1:]} == {
        ("alice:train-1", "alice"), ("alice:train-2", "alice"), ("alice:train-3", "alice"), ("alice:old-1", "alice"),
        ("plain-1", "default"), ("carol:left-1", "carol")}


@pytest.mark.parametrize("bad", ["Alice", "alice:x", "x" * 500])
def test_jobs_for_a_user_id_nobody_can_have_is_one_line_and_exit_2(cli, bad):
    code, out, err = cli("jobs", "--user", bad)
    assert (code, out) == (2, "") and err.count("\n") == 1 and err.startswith("irisfed: --user ")
    assert len(err) < 200


def test_job_shows_its_user_and_who_asked_to_cancel(cli):
    code, out, err = cli("job", "alice:train-1", "--json")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert (job["job_id"], job["user_id"], job["cancel_requested"], job["cancel_requested_by"]) == (
        "alice:train-1", "alice", True, "user alice")
    code, out, _ = cli("job", "alice:train-1")
    assert "  user        alice\n" in out and "  cancel      requested by user alice" in out
    code, out, _ = cli("job", "plain-1")  # a default job: its bare id
    assert code == 0 and "  user        default\n" in out and "cancel" not in out
    code, out, err = cli("job", "bob:train-1")  # bob has no such job
    assert (code, out) == (1, "") and "no job 'bob:train-1'" in err
    code, out, err = cli("job", "Alice:train-1")
    assert (code, out) == (2, "") and err.startswith("irisfed: not a job id: 'Alice:train-1'")


def test_explain_shows_the_waiting_code_quota(cli):
    code, out, err = cli("explain", "alice:train-3")
    assert code == 0, err
    assert "alice:train-3 is queued" in out
    assert f"  rule        {QUOTA_RULE}\n" in out and "  waiting     quota  (" in out
    code, out, _ = cli("explain", "alice:train-3", "--json")
    doc = json.loads(out)
    assert (doc["user_id"], doc["wait"], doc["explanation"]["wait"]) == ("alice", "quota", "quota")
