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
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from irisfed.tooling.engines.slurm import parse_scontrol_line
from irisfed.tooling.federation import Peer, render_config
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

SPARE = "gpu-east"  # somewhere else to run, started only when a test needs it


@dataclass
class Engine:
    """An engine peer under test, and how to look at the engine behind irisfed's back."""

    kind: str
    peer_id: str
    agent_args: list[str]
    env: dict[str, str]
    accelerator: str  # the resource it has that the plain peers lack: gpu (Slurm), tpu (Ray)
    runs_of: Callable[[str], list[tuple[str, str, int]]]  # job id → [(engine id, state, epoch)]
    free: Callable[[], dict[str, float]]  # resource → free amount, as the engine itself says
    totals: Callable[[], dict[str, float]]
    asked: Callable[[str], str]  # engine id → what the engine says the running run holds
    killed_state: str


def _slurm_engine(cluster) -> Engine:
    def runs_of(job_id: str) -> list[tuple[str, str, int]]:
        prefix = f"irisfed-{job_id}-e"
        runs = []
        for line in cluster.run("squeue", "-h", "-t", "all", "-o", "%i|%T|%j").splitlines():
            slurm_id, state, name = line.split("|", 2)
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                runs.append((slurm_id, state, int(name[len(prefix):])))
        return runs

    def node() -> dict[str, str]:
        return parse_scontrol_line(cluster.run("scontrol", "show", "node", "-o", "-d", cluster.node_name))

    def gpus_used() -> int:
        used = node().get("GresUsed", "")  # gpu:h100:2(IDX:0-1)
        return sum(int(part.split("(")[0].rsplit(":", 1)[1]) for part in used.split(",") if part.startswith("gpu"))

    def totals() -> dict[str, float]:
        n = node()
        return {"cpu": float(n["CPUTot"]), "gpu": float(cluster.gres.rsplit(":", 1)[1])}

    def free() -> dict[str, float]:
        n = node()
        return {"cpu": float(int(n["CPUTot"]) - int(n["CPUAlloc"])), "gpu": totals()["gpu"] - gpus_used()}

    def asked(slurm_id: str) -> str:
        job = cluster.job(slurm_id) or {}
        return f"{job.get('TresPerNode', '')} {job.get('TRES', '')}"

    return Engine("slurm", "gpu-west", ["--backend", "slurm", "--slurm-partition", cluster.partition,
                                   "--poll-interval", "0.25"],
                  cluster.env, "gpu", runs_of, free, totals, asked, "CANCELLED")


def _ray_engine(head) -> Engine:
    client = head.job_client()

    def runs_of(job_id: str) -> list[tuple[str, str, int]]:
        prefix = f"irisfed-{job_id}-e"
        return [(job.submission_id, str(job.status.value if hasattr(job.status, "value") else job.status),
                 int(job.submission_id[len(prefix):]))
                for job in client.list_jobs()
                if (job.submission_id or "").startswith(prefix) and job.submission_id[len(prefix):].isdigit()]

    def usage() -> dict[str, tuple[float, float]]:
        return head.usage()

    def totals() -> dict[str, float]:
        u = usage()
        return {"cpu": u["CPU"][1], "tpu": u["TPU"][1]}

    def free() -> dict[str, float]:
        u = usage()
        return {"cpu": u["CPU"][1] - u["CPU"][0], "tpu": u["TPU"][1] - u["TPU"][0]}

    def asked(submission_id: str) -> str:
        # Ray's job details do not keep the entrypoint's resources: its usage shows them held.
        return f"TPU held: {usage()['TPU'][0]:g}"

    return Engine("ray", "tpu-east", ["--backend", "ray", "--ray-address", head.address, "--poll-interval", "0.25"],
                  {}, "tpu", runs_of, free, totals, asked, "STOPPED")


@pytest.fixture(params=["slurm", "ray"])
def engine(request) -> Engine:
    if request.param == "slurm":
        return _slurm_engine(request.getfixturevalue("slurm_cluster"))
    return _ray_engine(request.getfixturevalue("ray_head"))


def _configure(federation, engine: Engine) -> None:
    """home (subprocess, CPU only), the engine peer, and gpu-east, the spare (subprocess,
    with the engine's accelerator) which only starts when a test needs somewhere else to
    run. (Peer ids are those the session's NATS users were made for.)"""
    federation.config_path.write_text(render_config(
        [Peer("home", {"device_type": "cpu"}, slots=2), Peer(engine.peer_id, slots=8, backend=engine.kind),
         Peer(SPARE, {"device_type": engine.accelerator}, slots=2)],
        local_cluster="home", subject_prefix=federation.prefix, heartbeat_interval_s=0.25,
        heartbeat_ttl_s=1.5, tick_interval_s=0.25, assign_grace_s=1.0))


async def _start(federation, engine: Engine, agent_env: dict[str, str] | None = None,
                 wait_discovered: bool = True) -> None:
    _configure(federation, engine)
    federation.start("router")
    federation.start("tick")
    federation.start("home", "--resource", "cpu=2", "--resource", "memory_mb=4096")
    federation.start(engine.peer_id, *engine.agent_args, env={**engine.env, **(agent_env or {})})
    await federation.wait_router()
    await federation.wait_agent("home")
    await federation.wait_agent(engine.peer_id)
    if not wait_discovered:
        return
    # Heard is not yet discovered: an agent whose first ask of its engine outlasts two
    # heartbeat intervals advertises the backend as discovering until it answers; the
    # scenarios below judge the engine's real shape (a too-big job must be rejected).
    async def discovered():
        return engine.accelerator in await _advertised(federation, engine.peer_id)
    await wait_for(discovered, f"{engine.peer_id} to advertise what its engine has", timeout=60, interval=0.25)


async def _until(probe: Callable[[], object], what: str, timeout: float = 120.0):
    """Wait for a probe that asks the engine (a blocking call: run in a thread, twice a second)."""
    async def asked():
        return await asyncio.to_thread(probe)
    return await wait_for(asked, what, timeout=timeout, interval=0.5)


def _job_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"  # the engines outlive a test: ids never repeat


async def _advertised(federation, peer_id: str) -> dict[str, dict[str, float]]:
    listing = await asyncio.to_thread(federation.cli, "peers", "--json")
    peers = {p["peer_id"]: p for p in json.loads(listing.stdout)}
    return peers[peer_id]["backends"][0]["resources"] if peer_id in peers else {}


async def test_an_accelerator_job_runs_on_the_engine_with_what_it_asked(federation, engine, tmp_path):
    await _start(federation, engine)
    job_id = _job_id("accel")
    release = tmp_path / "release"  # the job holds its resources until the test has looked (at most 2 min)
    reply = await federation.submit({
        "job_id": job_id, "command": ["sh", "-c", 'echo ran $IRISFED_JOB_ID; for i in $(seq 600); do '
                                      '[ -e "$0" ] && break; sleep 0.2; done', str(release)],
        "resources": {"cpu": 1, engine.accelerator: 2}})
    assert reply["disposition"] == "queue", reply  # home has no accelerator
    running = await federation.wait_state(job_id, "running", timeout=120)
    assert running.owner_peer_id == engine.peer_id

    (engine_id, _, epoch), = await _until(lambda: engine.runs_of(job_id) or None, "the engine's run")
    assert epoch == 1
    def holds_what_it_asked():
        asked = engine.asked(engine_id)
        return ("gpu:2" in asked) if engine.kind == "slurm" else (asked == "TPU held: 2")
    await _until(holds_what_it_asked, "the engine to show the run holding what it asked for")

    totals = engine.totals()

    async def advertised_matches_engine():
        advertised = await _advertised(federation, engine.peer_id)
        free = await asyncio.to_thread(engine.free)
        ok = all(advertised.get(name, {}).get("total") == total for name, total in totals.items()) and all(
            advertised.get(name, {}).get("free") == amount for name, amount in free.items())
        return (advertised, free) if ok and free[engine.accelerator] <= totals[engine.accelerator] - 2 else None
    await wait_for(advertised_matches_engine, "irisfed peers to show the engine's own free amounts while it runs",
                   timeout=60, interval=0.5)
    release.touch()

    done = await federation.wait_state(job_id, "succeeded", "failed", timeout=120)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    logs = federation.cli("logs", job_id)
    assert f"ran {job_id}" in logs.stdout, (logs.stdout, logs.stderr)

    too_big = await federation.submit({"job_id": _job_id("too-big"), "command": ["true"],
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
    engine = _slurm_engine(slurm_cluster)
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
    await _start(federation, engine, {"PATH": f"{wrapped}{os.pathsep}{os.environ['PATH']}"}, wait_discovered=False)

    listing = await asyncio.to_thread(federation.cli, "peers", "--json")
    (advertised,) = [p for p in json.loads(listing.stdout) if p["peer_id"] == engine.peer_id]
    assert advertised["backends"][0]["discovering"] is True, advertised
    job_id = _job_id("asking")
    reply = await federation.submit({"job_id": job_id, "command": ["true"], "resources": {"cpu": 1, "gpu": 2}})
    assert reply["disposition"] == "queue", reply
    assert f"once their engines answer: {engine.peer_id}" in reply["reason"], reply
    job = await federation.job(job_id)
    assert job.state == "queued" and job.owner_peer_id is None  # nothing placed on an unknown shape

    gate.unlink()  # the controller answers: the peer advertises its GPUs and the job runs there
    done = await federation.wait_state(job_id, "succeeded", "failed", timeout=120)
    assert (done.state, done.owner_peer_id) == ("succeeded", engine.peer_id), done


async def test_a_cancel_reaches_the_engine(federation, engine):
    await _start(federation, engine)
    job_id = _job_id("cancel")
    await federation.submit({"job_id": job_id, "command": ["sleep", "300"], "cluster_pin": engine.peer_id})
    await federation.wait_state(job_id, "running", timeout=120)
    await _until(lambda: [r for r in engine.runs_of(job_id) if r[1] == "RUNNING"] or None,
                   "the engine to run it", timeout=120)
    reply = await federation.cancel(job_id)
    assert reply["outcome"] == "kill_sent", reply
    killed = await federation.wait_state(job_id, "killed", timeout=120)
    assert killed.owner_peer_id == engine.peer_id
    (_, state, _), = await _until(
        lambda: [r for r in engine.runs_of(job_id) if r[1] == engine.killed_state] or None,
        f"the engine to show the run {engine.killed_state}", timeout=60)
    assert state == engine.killed_state


async def test_a_restarted_agent_adopts_its_runs_and_never_launches_them_again(federation, engine):
    await _start(federation, engine)
    live, ended = _job_id("adopt-live"), _job_id("adopt-ended")
    for job_id, seconds in ((live, 20), (ended, 1)):
        await federation.submit({"job_id": job_id, "command": ["sh", "-c", f"echo before; sleep {seconds}; echo slept"],
                                 "cluster_pin": engine.peer_id})
    for job_id in (live, ended):
        await federation.wait_state(job_id, "running", timeout=120)
    await _until(lambda: [r for r in engine.runs_of(live) if r[1] == "RUNNING"] or None,
                   "the long run to start in the engine", timeout=120)
    # Its output comes home while it runs (Slurm: the output files; Ray: the Jobs API's tail).
    await _until(lambda: "before\n" in federation.cli("logs", live).stdout or None,
                 "the long run's first line to be shipped", timeout=60)

    federation.kill(engine.peer_id)  # SIGKILL: the runs go on in the engine, unwatched
    ended_states = {"COMPLETED", "SUCCEEDED"}
    await _until(lambda: [r for r in engine.runs_of(ended) if r[1] in ended_states] or None,
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
    await _start(federation, engine)
    job_id = _job_id("lost")
    await federation.submit({"job_id": job_id, "command": ["sleep", "300"],
                             "resources": {"cpu": 1, engine.accelerator: 1}})
    first = await federation.wait_state(job_id, "running", timeout=120)
    assert (first.owner_peer_id, first.epoch) == (engine.peer_id, 1)
    await _until(lambda: [r for r in engine.runs_of(job_id) if r[1] == "RUNNING"] or None,
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
    await _until(lambda: [r for r in engine.runs_of(job_id) if r[1] == engine.killed_state] or None,
                   "the returning agent to cancel its stale copy", timeout=120)
    assert len(engine.runs_of(job_id)) == 1  # and never launched it again

    async def noted():
        rows = await federation.store.sync_state_get(job_id)
        return [r for r in rows if r["peer_id"] == engine.peer_id and "stale copy killed" in (r["note"] or "")] or None
    await wait_for(noted, "the stale copy to be recorded in the engine peer's sync state")
    await federation.cancel(job_id)
    await federation.wait_state(job_id, "killed", timeout=60)
