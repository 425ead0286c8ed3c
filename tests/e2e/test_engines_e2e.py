"""A federation with a peer in front of a real Slurm cluster, and one in front of a real
Ray head (services as subprocesses, engines from ``irisfed.tooling.engines``).

Each scenario runs once per engine: the job lands on the engine peer with what it
asked for, capacity in ``irisfed peers`` is the engine's own, a cancel reaches the
engine, an agent killed mid-job has its run adopted (never launched twice), and a
peer lost past the grace has its stale engine copy cancelled when it returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil

import pytest

from tests.infra.engine_peers import (
    SPARE,
    Engine,
    advertised,
    engine_for,
    slurm_engine,
    start_with_engine,
    unique_job_id,
    until,
)
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["slurm", "ray"])
def engine(request) -> Engine:
    return engine_for(request)


async def test_an_accelerator_job_runs_on_the_engine_with_what_it_asked(federation, engine, tmp_path):
    await start_with_engine(federation, engine)
    job_id = unique_job_id("accel")
    release = tmp_path / "release"  # the job holds its resources until the test has looked (at most 2 min)
    reply = await federation.submit({
        "job_id": job_id, "command": ["sh", "-c", 'echo ran $IRISFED_JOB_ID; for i in $(seq 600); do '
                                      '[ -e "$0" ] && break; sleep 0.2; done', str(release)],
        "resources": {"cpu": 1, engine.accelerator: 2}})
    assert reply["disposition"] == "queue", reply  # home has no accelerator
    running = await federation.wait_state(job_id, "running", timeout=120)
    assert running.owner_peer_id == engine.peer_id

    (engine_id, _, epoch), = await until(lambda: engine.runs_of(job_id) or None, "the engine's run")
    assert epoch == 1
    def holds_what_it_asked():
        asked = engine.asked(engine_id)
        return ("gpu:2" in asked) if engine.kind == "slurm" else (asked == "TPU held: 2")
    await until(holds_what_it_asked, "the engine to show the run holding what it asked for")

    totals = engine.totals()

    async def advertised_matches_engine():
        shown = await advertised(federation, engine.peer_id)
        free = await asyncio.to_thread(engine.free)
        ok = all(shown.get(name, {}).get("total") == total for name, total in totals.items()) and all(
            shown.get(name, {}).get("free") == amount for name, amount in free.items())
        return (shown, free) if ok and free[engine.accelerator] <= totals[engine.accelerator] - 2 else None
    await wait_for(advertised_matches_engine, "irisfed peers to show the engine's own free amounts while it runs",
                   timeout=60, interval=0.5)
    release.touch()

    done = await federation.wait_state(job_id, "succeeded", "failed", timeout=120)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    logs = federation.cli("logs", job_id)
    assert f"ran {job_id}" in logs.stdout, (logs.stdout, logs.stderr)

    too_big = await federation.submit({"job_id": unique_job_id("too-big"), "command": ["true"],
                                       "resources": {engine.accelerator: 8}})
    assert too_big["disposition"] == "reject", too_big
    verdict = {v["peer_id"]: v for v in too_big["verdicts"]}[engine.peer_id]
    total = int(totals[engine.accelerator])
    assert verdict["code"] == "insufficient_resources"
    assert f"{engine.accelerator}: asked 8, at most {total}" in verdict["detail"], verdict


async def test_a_slurm_peer_not_yet_heard_from_its_engine_queues_what_it_might_hold(federation, slurm_cluster,
                                                                                    tmp_path):
    """The CI failure of 2026-12-01: the agent's first ask of Slurm outlasted two heartbeat
    intervals and the router rejected a GPU job (final) because the peer was heard
    advertising nothing. A gated ``scontrol show node`` stands for a slow controller."""
    engine = slurm_engine(slurm_cluster)
    gate = tmp_path / "slow-controller"
    gate.touch()
    wrapped = tmp_path / "bin"
    wrapped.mkdir()
    scontrol = wrapped / "scontrol"
    scontrol.write_text(f'''#!/bin/sh
if [ "$1 $2" = "show node" ]; then while [ -e {shlex.quote(str(gate))} ]; do sleep 0.05; done; fi
exec {shlex.quote(shutil.which("scontrol"))} "$@"
''')
    scontrol.chmod(0o755)
    await start_with_engine(federation, engine, {"PATH": f"{wrapped}{os.pathsep}{os.environ['PATH']}"},
                            wait_discovered=False)

    listing = await asyncio.to_thread(federation.cli, "peers", "--json")
    (listed,) = [p for p in json.loads(listing.stdout) if p["peer_id"] == engine.peer_id]
    assert listed["backends"][0]["discovering"] is True, listed
    job_id = unique_job_id("asking")
    reply = await federation.submit({"job_id": job_id, "command": ["true"], "resources": {"cpu": 1, "gpu": 2}})
    assert reply["disposition"] == "queue", reply
    assert f"once their engines answer: {engine.peer_id}" in reply["reason"], reply
    job = await federation.job(job_id)
    assert job.state == "queued" and job.owner_peer_id is None  # nothing placed on an unknown shape

    gate.unlink()  # the controller answers: the peer advertises its GPUs and the job runs there
    done = await federation.wait_state(job_id, "succeeded", "failed", timeout=120)
    assert (done.state, done.owner_peer_id) == ("succeeded", engine.peer_id), done


async def test_a_cancel_reaches_the_engine(federation, engine):
    await start_with_engine(federation, engine)
    job_id = unique_job_id("cancel")
    await federation.submit({"job_id": job_id, "command": ["sleep", "300"], "cluster_pin": engine.peer_id})
    await federation.wait_state(job_id, "running", timeout=120)
    await until(lambda: engine.runs_in(job_id, "RUNNING"),
                "the engine to run it", timeout=120)
    reply = await federation.cancel(job_id)
    assert reply["outcome"] == "kill_sent", reply
    killed = await federation.wait_state(job_id, "killed", timeout=120)
    assert killed.owner_peer_id == engine.peer_id
    (_, state, _), = await until(
        lambda: engine.runs_in(job_id, *engine.killed_states),
        f"the engine to show the run {'/'.join(engine.killed_states)}", timeout=60)
    assert state in engine.killed_states


async def test_a_restarted_agent_adopts_its_runs_and_never_launches_them_again(federation, engine):
    await start_with_engine(federation, engine)
    live, ended = unique_job_id("adopt-live"), unique_job_id("adopt-ended")
    for job_id, seconds in ((live, 20), (ended, 1)):
        await federation.submit({"job_id": job_id, "command": ["sh", "-c", f"echo before; sleep {seconds}; echo slept"],
                                 "cluster_pin": engine.peer_id})
    for job_id in (live, ended):
        await federation.wait_state(job_id, "running", timeout=120)
    await until(lambda: engine.runs_in(live, "RUNNING"),
                "the long run to start in the engine", timeout=120)
    # Its output comes home while it runs (Slurm: the output files; Ray: the Jobs API's tail).
    await until(lambda: "before\n" in federation.cli("logs", live).stdout or None,
                "the long run's first line to be shipped", timeout=60)

    federation.kill(engine.peer_id)  # SIGKILL: the runs go on in the engine, unwatched
    ended_states = {"COMPLETED", "SUCCEEDED"}
    await until(lambda: engine.runs_in(ended, *ended_states),
                "the short run to end while no agent watches", timeout=120)
    assert (await federation.job(live)).state == "running"

    federation.start(engine.peer_id, *engine.agent_args, env=engine.env)
    for job_id in (live, ended):
        done = await federation.wait_state(job_id, "succeeded", "failed", "queued", timeout=120)
        assert (done.state, done.epoch, done.owner_peer_id, done.attempts) == (
            "succeeded", 1, engine.peer_id, 1), done
        assert len(engine.runs_of(job_id)) == 1, engine.runs_of(job_id)  # one run, never a second
        if engine.kind == "ray" and job_id == ended:
            continue  # Ray's Jobs API may keep no driver output of a job that ended unwatched
        # Its output shipped whole and once: the restarted agent went on from where the stream stopped.
        shown = federation.cli("logs", job_id)
        assert shown.stdout.count("before\n") == 1 and shown.stdout.count("slept\n") == 1, shown.stdout + shown.stderr
        assert shown.stdout.index("before") < shown.stdout.index("slept")
    assert "run_adopted" in federation.log(engine.peer_id)


async def test_a_lost_engine_peer_has_its_stale_copy_cancelled_when_it_returns(federation, engine):
    await start_with_engine(federation, engine)
    job_id = unique_job_id("lost")
    await federation.submit({"job_id": job_id, "command": ["sleep", "300"],
                             "resources": {"cpu": 1, engine.accelerator: 1}})
    first = await federation.wait_state(job_id, "running", timeout=120)
    assert (first.owner_peer_id, first.epoch) == (engine.peer_id, 1)
    await until(lambda: engine.runs_in(job_id, "RUNNING"),
                "the engine to run it", timeout=120)

    federation.kill(engine.peer_id)  # lost past the grace: the job moves on
    federation.start(SPARE, "--resource", "cpu=2", "--resource", f"{engine.accelerator}=4")

    async def moved():
        job = await federation.job(job_id)
        return job if job.state == "running" and job.owner_peer_id == SPARE else None
    second = await wait_for(moved, "the job to run on the spare peer", timeout=120)
    assert second.epoch > first.epoch  # requeued (epoch 2), then assigned (epoch 3)
    assert [r[1] for r in engine.runs_of(job_id)] == ["RUNNING"]  # the stale copy runs on, unwatched

    federation.start(engine.peer_id, *engine.agent_args, env=engine.env)
    await until(lambda: engine.runs_in(job_id, *engine.killed_states),
                "the returning agent to cancel its stale copy", timeout=120)
    assert len(engine.runs_of(job_id)) == 1  # and never launched it again

    async def noted():
        rows = await federation.store.sync_state_get(job_id)
        return [r for r in rows if r["peer_id"] == engine.peer_id and "stale copy killed" in (r["note"] or "")] or None
    await wait_for(noted, "the stale copy to be recorded in the engine peer's sync state")
    await federation.cancel(job_id)
    await federation.wait_state(job_id, "killed", timeout=60)
