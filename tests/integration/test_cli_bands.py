"""Bands and preemption in the command line against a real Postgres: ``irisfed jobs``
(a BAND column, ``band`` by name in JSON), ``irisfed job`` (band, preemptions, who
preempted it, when and on which peer; the preempting job's victims), ``irisfed explain``
(the ``cannot preempt`` clause of a waiting job's rule) and ``irisfed.client``'s reads
(:class:`Job` ``band`` and ``preemptions``). Jobs are written with the statements the
router and the tick use (``job_preempt_batch``, ``job_assign_batch`` with its history
detail); the commands run in process (``irisfed.cli.main``)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from irisfed.cli import main
from irisfed.jobs import job_view
from irisfed.reads import JobReads
from irisfed.services.common import db as dbmod
from irisfed.services.common.store import Store
from irisfed.shared.explain import explanation
from irisfed.shared.records import Explanation
from tests.infra.cli_runs import bare_environment, cli_on
from tests.infra.factories import assign_jobs, insert_jobs, preempt, start_jobs, user_job

USERS = [{"id": "alice", "max_band": "production"}, {"id": "bob", "max_band": "batch"}]
CANNOT = ("no_free_capacity: gpu-west is full; cannot preempt: gpu-west runs only jobs of band interactive or "
          "above")


async def populate(database_url: str) -> None:
    pool = await dbmod.connect(database_url, max_size=2)
    store = Store(pool)
    try:
        batch = [user_job("bob", "batch-1", band="batch"), user_job("bob", "batch-2", band="batch"),
                 user_job("bob", "last-1", band="batch", max_preemptions=0)]
        await insert_jobs(store, batch)
        await assign_jobs(store, batch, "gpu-west")
        await start_jobs(store, batch, "gpu-west")
        urgent = user_job("alice", "urgent-1", band="production")
        again = user_job("alice", "urgent-2", band="production")
        await insert_jobs(store, [urgent, again])
        await preempt(store, batch[:2], urgent)  # two back to the queue
        await preempt(store, batch[2:], again)  # at its limit: it fails
        waiting = msgspec.structs.replace(
            user_job("bob", "batch-9", band="batch"),
            explanation=Explanation(msgspec.json.encode(explanation("tick", CANNOT))))
        await insert_jobs(store, [waiting, user_job("default", "plain-1")])
    finally:
        await pool.close()


@pytest.fixture
def cli(database_url, tmp_path, monkeypatch, capsys):
    """``cli(*args)`` → (exit code, stdout, stderr) of ``irisfed *args`` against a populated database."""
    asyncio.run(populate(database_url))
    return cli_on(database_url, USERS, tmp_path, monkeypatch, capsys)


def test_jobs_shows_each_jobs_band(cli):
    code, out, err = cli("jobs")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["JOB", "USER", "STATE", "BAND"]
    bands = {line.split()[0]: (line.split()[2], line.split()[3]) for line in lines[1:]}
    assert bands == {
        "bob:batch-1": ("queued", "batch"), "bob:batch-2": ("queued", "batch"), "bob:last-1": ("failed", "batch"),
        "alice:urgent-1": ("assigned", "production"), "alice:urgent-2": ("assigned", "production"),
        "bob:batch-9": ("queued", "batch"), "plain-1": ("queued", "interactive")}

    code, out, _ = cli("jobs", "--json")
    jobs = {j["job_id"]: j for j in json.loads(out)}
    assert (jobs["bob:batch-1"]["band"], jobs["bob:batch-1"]["preemptions"]) == ("batch", 1)
    assert (jobs["alice:urgent-1"]["band"], jobs["alice:urgent-1"]["preemptions"]) == ("production", 0)
    code, out, _ = cli("jobs", "--user", "bob", "--state", "queued", "-o", "tsv")
    rows = [line.split("\t") for line in out.splitlines()]
    assert rows[0][3] == "band" and sorted((r[0], r[3]) for r in rows[1:]) == [
        ("bob:batch-1", "batch"), ("bob:batch-2", "batch"), ("bob:batch-9", "batch")]


def test_a_preempted_job_shows_its_band_preemptions_and_who_preempted_it(cli):
    code, out, err = cli("job", "bob:batch-1")
    assert code == 0, err
    assert "  band        batch   preemptions 1 (at most 100)\n" in out
    assert "  reason      preempted by alice:urgent-1\n" in out
    stopped = [line for line in out.splitlines() if line.startswith("  preempted   ")]
    assert len(stopped) == 1
    assert stopped[0].endswith(" by alice:urgent-1 on gpu-west  (running → queued)")
    history = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert history[-1][2:] == ["running", "queued", "-", "2", "tick", "preempted", "by", "alice:urgent-1"]

    code, out, _ = cli("job", "bob:batch-1", "--json")
    doc = json.loads(out)
    assert (doc["job"]["band"], doc["job"]["preemptions"], doc["job"]["state"]) == ("batch", 1, "queued")
    assert doc["changelog"][-1]["detail"] == "preempted by alice:urgent-1"


def test_a_job_preempted_past_its_limit_failed(cli):
    code, out, err = cli("job", "bob:last-1")
    assert code == 0, err
    assert "bob:last-1  failed" in out
    assert "  band        batch   preemptions 1 (at most 0)\n" in out
    assert "by alice:urgent-2 on gpu-west  (running → failed)" in out
    assert "more than its max_preemptions 0" in out


def test_the_preempting_job_names_its_victims(cli):
    code, out, err = cli("job", "alice:urgent-1")
    assert code == 0, err
    assert "  band        production   preemptions 0 (at most 100)\n" in out
    assert "on gpu-west by preempting bob:batch-1, bob:batch-2\n" in out
    assert "  preempted   " not in out
    code, out, _ = cli("explain", "alice:urgent-1")
    assert "  placed      on gpu-west at epoch 1 (tick)  preempting bob:batch-1, bob:batch-2\n" in out


def test_explain_shows_why_a_waiting_job_cannot_preempt(cli):
    code, out, err = cli("explain", "bob:batch-9")
    assert code == 0, err
    assert f"  rule        {CANNOT}\n" in out
    code, out, _ = cli("explain", "bob:batch-9", "--json")
    assert json.loads(out)["explanation"]["rule"].endswith("cannot preempt: gpu-west runs only jobs of band "
                                                           "interactive or above")
    code, out, _ = cli("explain", "bob:batch-1")  # preempted once since
    assert "  preempted   1 time, last by alice:urgent-1 on gpu-west at " in out


async def test_the_clients_reads_give_band_by_name_and_preemptions(database_url):
    await populate(database_url)
    reads = await JobReads.connect(database_url)
    try:
        victim = job_view(await reads.job_get("bob:batch-1"))
        assert (victim.job_id, victim.user, victim.band, victim.preemptions) == ("batch-1", "bob", "batch", 1)
        urgent = job_view(await reads.job_get("alice:urgent-1"))
        assert (urgent.band, urgent.preemptions, urgent.state) == ("production", 0, "assigned")
        assert job_view(await reads.job_get("plain-1")).band == "interactive"
    finally:
        await reads.close()


# ---------------------------------------------------------------- irisfed submit --dry-run, on a real router

GPU_CONFIG = {"users": [{"id": "bob", "max_band": "production"}], "heartbeat_ttl_s": 600}


@pytest.fixture
def dry_cli(database_url, servers, tmp_path, monkeypatch, capsys):
    """(``cli(*args)`` → (exit code, stdout, stderr) of ``irisfed submit *args`` on a router
    whose federation is two one-slot GPU peers, each running a batch job; those jobs' ids)."""
    from tests.infra.factories import advertise, running_job
    from tests.infra.routers import RouterThread

    router = RouterThread(database_url, servers.nats_url, **GPU_CONFIG)
    store = Store(router.pool)
    for peer in ("gpu-west", "tpu-east"):
        router.run(advertise(store, peer, slots=1, ttl_s=600, device_type="gpu"))
    router.run(router.router.refresh_view())
    victims = {peer: router.run(running_job(store, peer, band="batch")) for peer in ("gpu-west", "tpu-east")}
    bare_environment(monkeypatch, tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        before = router.rows()
        code = main(["submit", "--nats-url", servers.nats_url, "--prefix", router.prefix, *args])
        captured = capsys.readouterr()
        if "--dry-run" in args:
            assert router.rows() == before, "a dry run wrote to Postgres"
        return code, captured.out, captured.err

    try:
        yield run, victims
    finally:
        router.close()


def test_a_dry_run_from_the_cli_says_where_and_whom_it_would_preempt(dry_cli):
    cli, victims = dry_cli
    code, out, err = cli("--user", "bob", "--id", "j1", "--band", "production", "--constraint", "device_type=gpu",
                         "--dry-run", "--", "true")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "dry run: nothing was submitted"
    assert lines[1] == "j1: queue → queued  (band production)"
    # Which of the two full peers is the tick's business (tests/integration/test_dry_run.py);
    # the CLI says the peer and the batch job running there.
    peer = [line for line in lines if line.startswith("  would run       on ")][0].split()[3].rstrip(",")
    assert peer in victims
    assert f"  would run       on {peer}, backend main" in lines
    assert f"  would preempt   {victims[peer]}" in lines
    code, out, _ = cli("--user", "bob", "--id", "j1", "--band", "production", "--constraint", "device_type=gpu",
                       "--dry-run", "--json", "--", "true")
    doc = json.loads(out)
    assert (code, doc["dry_run"], doc["placement"]["preempts"]) == (0, True, [victims[doc["placement"]["peer_id"]]])


def test_a_dry_run_from_the_cli_that_would_wait_says_why(dry_cli):
    cli, _ = dry_cli
    code, out, err = cli("--band", "batch", "--constraint", "device_type=gpu", "--dry-run", "--", "true")
    assert code == 0, err
    wait = [line for line in out.splitlines() if line.startswith("  would wait      ")]
    assert len(wait) == 1 and "; cannot preempt: " in wait[0]
    assert "would run" not in out and out.startswith("dry run: nothing was submitted\n")


def test_a_dry_run_from_the_cli_is_refused_or_rejected_as_a_submit_would_be(dry_cli):
    cli, _ = dry_cli
    code, out, err = cli("--band", "production", "--dry-run", "--", "true")  # default's max_band: interactive
    assert (code, out) == (1, "") and err.startswith("irisfed: forbidden: ")
    code, out, _ = cli("--constraint", "device_type=tpu", "--dry-run", "--", "true")
    assert code == 3 and ": reject → rejected" in out and "dry run: nothing was submitted" in out
