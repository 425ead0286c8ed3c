"""An engine peer's agent SIGKILLed at every step of a run; engines that hang or lose
an answer; the engine scenario on least-privilege database roles.

Stand-ins for ``sbatch``, ``squeue`` and ``scancel`` on the agent's ``PATH`` call the
real command and SIGKILL the agent (their parent) at the chosen moment, once (a
``mkdir`` marker): right after ``sbatch`` created the job, while ``scancel`` is in
flight, once ``squeue`` shows the run ended but before the agent could report it.
The crash between accept and launch is ``IRISFED_CRASH_AT=agent_after_accept`` (Slurm
and Ray); a PENDING run is one waiting behind a job that holds the whole node. Each
time the agent is started again as it would be in production, and the job must end
once, as its run did, with one engine job for its (job, epoch) and nothing launched
twice. Hangs: a stand-in ``squeue``/``sbatch`` that never answers while a marker
exists, and a stalled TCP proxy in front of the Ray dashboard, each for longer than
the backend's call timeout (``--engine-timeout``, 30 s by default; 5 s here).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from irisfed.shared.lifecycle import TERMINAL_STATES
from tests.infra.engine_peers import (
    SPARE,
    configure_with_engine,
    engine_for,
    ray_engine,
    slurm_engine,
    unique_job_id,
    until,
)
from tests.infra.waiting import wait_for

pytestmark = pytest.mark.e2e

# The hang tests' engine call timeout, and how long the engine stays hung: well past
# the timeout (calls give up and are asked again), so what the default
# 30 s would show, a short one shows in a fraction of the time.
ENGINE_TIMEOUT_S = 5.0
HUNG_FOR_S = 2.5 * ENGINE_TIMEOUT_S


@pytest.fixture
def slurm(slurm_cluster):
    return slurm_cluster, slurm_engine(slurm_cluster)


@pytest.fixture(params=["slurm", "ray"])
def any_engine(request):
    return engine_for(request)


def stand_in(folder: Path, name: str, body: str) -> None:
    """``folder/name``: a shell script standing in for the real ``/usr/bin/<name>``."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def env_with(engine, folder: Path | None, **extra: str) -> dict[str, str]:
    path = f"{folder}:{os.environ['PATH']}" if folder else os.environ["PATH"]
    return {**engine.env, "PATH": path, **extra}


async def start(federation, engine, env: dict[str, str]) -> None:
    configure_with_engine(federation, engine)
    federation.start("router")
    federation.start("tick")
    federation.start(engine.peer_id, *engine.agent_args, env=env)
    await federation.wait_router()
    await federation.wait_agent(engine.peer_id)


async def died(federation, name: str) -> None:
    async def gone():
        return not federation.supervisor.running(name)
    await wait_for(gone, f"{name}'s agent to die", timeout=60)


async def ended_once(federation, engine, job_id: str, timeout: float = 120.0):
    """The job's terminal row, once it is terminal; checks it was reported once and that
    Slurm has exactly one job for the epoch it ended under."""
    done = await federation.wait_state(job_id, *TERMINAL_STATES, timeout=timeout)
    await asyncio.sleep(1.0)  # a second report (or a second launch) would show by now
    history = await federation.store.changelog_list_for_job(job_id)
    assert [row.to_state for row in history].count(done.state) == 1, history
    assert [row.to_state for row in history if row.to_state in TERMINAL_STATES] == [done.state], history
    runs = await asyncio.to_thread(engine.runs_of, job_id)
    assert [epoch for _, _, epoch in runs].count(done.epoch) == 1, runs
    return done, runs, history


async def restarted_it_succeeds_once(federation, engine, job_id: str) -> None:
    """The agent died with ``job_id`` running: started again, the job succeeds once, under
    its first epoch and attempt, from one engine run."""
    await died(federation, engine.peer_id)
    assert (await federation.job(job_id)).state == "running"
    federation.start(engine.peer_id, *engine.agent_args, env=env_with(engine, None))
    done, runs, _ = await ended_once(federation, engine, job_id)
    assert (done.state, done.epoch, done.attempts, done.exit_code) == ("succeeded", 1, 1, 0), done
    assert len(runs) == 1, runs


async def test_killed_right_after_sbatch_returned_the_run_is_adopted(federation, slurm, tmp_path):
    _, engine = slurm
    job_id = unique_job_id("after-sbatch")
    stand_in(tmp_path / "bin", "sbatch", f"""out=$(/usr/bin/sbatch "$@"); rc=$?
if [ $rc -eq 0 ] && mkdir {tmp_path}/fired 2>/dev/null; then kill -9 $PPID; fi
printf '%s\\n' "$out"; exit $rc
""")
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    await federation.submit({"job_id": job_id, "command": ["sh", "-c", "sleep 3; echo ran"],
                             "cluster_pin": engine.peer_id})
    await restarted_it_succeeds_once(federation, engine, job_id)
    assert "run_adopted" in federation.log(engine.peer_id)


async def test_killed_between_accept_and_launch_the_job_is_handed_back_and_runs_once(federation, any_engine):
    engine = any_engine
    job_id = unique_job_id("after-accept")
    await start(federation, engine, env_with(engine, None, IRISFED_CRASH_AT="agent_after_accept"))
    await federation.submit({"job_id": job_id, "command": ["sh", "-c", "echo ran"], "cluster_pin": engine.peer_id})
    await died(federation, engine.peer_id)
    federation.start(engine.peer_id, *engine.agent_args, env=env_with(engine, None))
    done, runs, history = await ended_once(federation, engine, job_id)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    assert [epoch for _, _, epoch in runs] == [done.epoch] and done.epoch > 1, runs  # never launched under epoch 1
    assert "run_adopted" not in federation.log(engine.peer_id)  # nothing of epoch 1 to adopt
    assert any("restarted while running it" in (row.detail or "") for row in history), history


async def test_killed_while_its_slurm_job_is_pending_the_run_is_adopted(federation, slurm):
    cluster, engine = slurm
    job_id = unique_job_id("pending")
    await start(federation, engine, env_with(engine, None))
    blocker = cluster.run("sbatch", "--parsable", "-J", "outside-work", "-c", str(cluster.cpus), "--mem=64",
                          "-D", "/tmp", "-o", "/dev/null", "--wrap", "sleep 600").strip()
    try:
        await until(lambda: (cluster.job(blocker) or {}).get("JobState") == "RUNNING" or None,
                    "the outside job to hold the node")
        await federation.submit({"job_id": job_id, "command": ["sh", "-c", "echo ran"],
                                 "cluster_pin": engine.peer_id})
        await until(lambda: engine.runs_in(job_id, "PENDING"),
                    "the run to wait in Slurm's queue")
        federation.kill(engine.peer_id)
        federation.start(engine.peer_id, *engine.agent_args, env=env_with(engine, None))

        async def adopted():
            return "run_adopted" in federation.log(engine.peer_id)
        await wait_for(adopted, "the restarted agent to adopt the pending run", timeout=60)
        assert [r[1] for r in engine.runs_of(job_id)] == ["PENDING"]
    finally:
        cluster.run("scancel", blocker, check=False)
    done, runs, _ = await ended_once(federation, engine, job_id)
    assert (done.state, done.epoch, done.attempts) == ("succeeded", 1, 1), done
    assert len(runs) == 1, runs


@pytest.mark.parametrize("scancel_reached_slurm", [False, True])
async def test_killed_while_scancel_is_in_flight_the_cancel_still_happens(federation, slurm, tmp_path,
                                                                          scancel_reached_slurm):
    _, engine = slurm
    job_id = unique_job_id("scancel")
    then = "exec /usr/bin/scancel \"$@\"" if scancel_reached_slurm else "exit 1"
    stand_in(tmp_path / "bin", "scancel", f"""if mkdir {tmp_path}/fired 2>/dev/null; then kill -9 $PPID; {then}; fi
exec /usr/bin/scancel "$@"
""")
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    await federation.submit({"job_id": job_id, "command": ["sleep", "300"], "cluster_pin": engine.peer_id})
    await until(lambda: engine.runs_in(job_id, "RUNNING"), "the run to start")
    assert (await federation.cancel(job_id))["outcome"] == "kill_sent"
    await died(federation, engine.peer_id)
    federation.start(engine.peer_id, *engine.agent_args, env=env_with(engine, None))
    done, runs, _ = await ended_once(federation, engine, job_id)
    assert (done.state, done.epoch) == ("killed", 1), done
    assert len(runs) == 1 and runs[0][1] in engine.killed_states, runs  # SIGTERM (FAILED by it) or scancel


async def test_killed_after_the_run_ended_but_before_the_report_it_is_reported_once(federation, slurm, tmp_path):
    _, engine = slurm
    job_id = unique_job_id("unreported")
    stand_in(tmp_path / "bin", "squeue", f"""out=$(/usr/bin/squeue "$@"); rc=$?
case "$out" in *"|COMPLETED|"*"irisfed-{job_id}-e"*)
    if mkdir {tmp_path}/fired 2>/dev/null; then kill -9 $PPID; exit 1; fi;;
esac
printf '%s\\n' "$out"; exit $rc
""")
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    await federation.submit({"job_id": job_id, "command": ["sh", "-c", "echo ran"], "cluster_pin": engine.peer_id})
    await restarted_it_succeeds_once(federation, engine, job_id)


async def test_an_sbatch_whose_answer_is_lost_is_followed_not_run_again(federation, slurm, tmp_path):
    # sbatch can fail ("Socket timed out on send/recv operation") after slurmctld took
    # the job. Were the launch failed, the job would be handed back and run again under a
    # new epoch while the first copy ran too (its command twice).
    _, engine = slurm
    job_id = unique_job_id("lost-answer")
    ran = tmp_path / "ran.log"
    stand_in(tmp_path / "bin", "sbatch", f"""out=$(/usr/bin/sbatch "$@"); rc=$?
if [ $rc -eq 0 ] && mkdir {tmp_path}/fired 2>/dev/null; then
    sleep 5  # the job starts (and ends) meanwhile
    echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2
    exit 1
fi
printf '%s\\n' "$out"; exit $rc
""")
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    await federation.submit({"job_id": job_id, "command": ["sh", "-c", f"echo ran $IRISFED_EPOCH >> {ran}"],
                             "cluster_pin": engine.peer_id})
    done, runs, _ = await ended_once(federation, engine, job_id)
    assert (done.state, done.epoch, done.attempts) == ("succeeded", 1, 1), done
    assert ran.read_text() == "ran 1\n"
    assert len(runs) == 1, runs


async def hang_while_jobs_run(federation, engine, before: str, during: str, hang) -> None:
    """``before`` runs, then the engine hangs (``hang()``) and ``during`` is submitted;
    for HUNG_FOR_S, well past the engine timeout, the peer must stay reachable."""
    await federation.submit({"job_id": before, "command": ["sh", "-c", "sleep 8; echo ran"],
                             "cluster_pin": engine.peer_id})
    await until(lambda: engine.runs_in(before, "RUNNING"), "the run to start")
    hang()
    await federation.submit({"job_id": during, "command": ["sh", "-c", "echo ran"], "cluster_pin": engine.peer_id,
                             "max_retries": 20})  # each launch that times out is one
    loop = asyncio.get_running_loop()
    hung_until = loop.time() + HUNG_FOR_S
    while loop.time() < hung_until:
        peers = {p.peer_id: p for p in await federation.store.peer_heartbeat_list()}
        assert peers[engine.peer_id].reachable, f"the agent stopped heartbeating while {engine.kind} hung"
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("hung", ["squeue", "sbatch"])
async def test_a_hung_slurm_never_stops_heartbeats_nor_launches_twice(federation, slurm, tmp_path, hung):
    """``squeue`` (or ``sbatch``) stops answering for longer than the agent's command
    timeout (``--engine-timeout``), then comes back: the peer stays reachable throughout, the run it followed is
    reported once, and a job assigned meanwhile runs once."""
    _, engine = slurm
    hang = tmp_path / "hang"
    stand_in(tmp_path / "bin", hung, f"""[ -e {hang} ] && exec sleep 3600
exec /usr/bin/{hung} "$@"
""")
    engine.agent_args = [*engine.agent_args, "--engine-timeout", str(ENGINE_TIMEOUT_S)]
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    before, during = unique_job_id("before-hang"), unique_job_id("during-hang")
    await hang_while_jobs_run(federation, engine, before, during, hang.touch)
    assert federation.supervisor.running(engine.peer_id)
    hang.unlink()
    for job_id in (before, during):
        done, runs, _ = await ended_once(federation, engine, job_id, timeout=180)
        assert (done.state, done.exit_code) == ("succeeded", 0), done
        assert len(runs) == 1, runs  # launched once (a launch that failed never reached sbatch)
    assert (await federation.job(before)).epoch == 1


async def test_a_ray_dashboard_that_hangs_never_stops_heartbeats_nor_launches_twice(federation, ray_head):
    """The Ray peer's dashboard accepts connections and moves no byte for longer than the
    backend's call timeout (a proxy in front of it, stalled), then answers again."""
    from irisfed.tooling.proxy import TcpProxy

    engine = ray_engine(ray_head)
    host, port = ray_head.address.removeprefix("http://").rsplit(":", 1)
    proxy = TcpProxy(host, int(port))
    federation.supervisor.proxies.append(proxy)  # closed with the federation
    engine.agent_args = ["--backend", "ray", "--ray-address", f"http://127.0.0.1:{proxy.port}",
                         "--poll-interval", "0.25", "--engine-timeout", str(ENGINE_TIMEOUT_S)]
    await start(federation, engine, env_with(engine, None))
    before, during = unique_job_id("before-stall"), unique_job_id("during-stall")
    await hang_while_jobs_run(federation, engine, before, during, proxy.stall)
    proxy.restore()
    for job_id in (before, during):
        done, runs, _ = await ended_once(federation, engine, job_id, timeout=180)
        assert (done.state, done.exit_code) == ("succeeded", 0), done
        assert len(runs) == 1, runs  # a submit that timed out never became a second run
    assert (await federation.job(before)).epoch == 1


async def test_an_engine_peer_and_the_dashboard_on_their_own_database_roles(federation, any_engine):
    """Router, tick and agents as their own login roles (``irisfed db-roles``), the
    dashboard as ``irisfed_svc_web``: an engine run adopted after a crash, a cancel, and
    a stale copy of a lost peer all work, and every page answers while nothing written
    comes from the dashboard."""
    import httpx

    from irisfed.tooling.servers import free_port

    engine = any_engine
    configure_with_engine(federation, engine)
    await federation.use_db_roles()
    port = free_port()
    federation.start("router")
    federation.start("tick")
    federation.start("home", "--resource", "cpu=2", "--resource", "memory_mb=4096")
    federation.start(engine.peer_id, *engine.agent_args, env=engine.env)
    federation.start("web", "--port", str(port))
    await federation.wait_router()
    await federation.wait_agent(engine.peer_id)

    adopted, cancelled, stale = (unique_job_id(f"roles-{what}") for what in ("adopt", "cancel", "stale"))
    await federation.submit({"job_id": adopted, "command": ["sh", "-c", "sleep 6; echo slept"],
                             "cluster_pin": engine.peer_id})
    await federation.submit({"job_id": cancelled, "command": ["sleep", "300"], "cluster_pin": engine.peer_id})
    await federation.submit({"job_id": stale, "command": ["sleep", "300"],
                             "resources": {"cpu": 1, engine.accelerator: 1}})
    for job_id in (adopted, cancelled, stale):
        await until(lambda job_id=job_id: engine.runs_in(job_id, "RUNNING"),
                    f"{job_id} to run in the engine")

    federation.kill(engine.peer_id)
    assert (await federation.cancel(cancelled))["outcome"] in ("kill_sent", "pending_owner_offline")
    federation.start(SPARE, "--resource", "cpu=2", "--resource", f"{engine.accelerator}=4")

    async def moved():
        job = await federation.job(stale)
        return job if job.owner_peer_id == SPARE and job.state == "running" else None
    await wait_for(moved, "the lost peer's job to run on the spare", timeout=120)
    federation.start(engine.peer_id, *engine.agent_args, env=engine.env)

    done = await federation.wait_state(adopted, *TERMINAL_STATES, timeout=120)
    assert (done.state, done.epoch, done.attempts) == ("succeeded", 1, 1), done
    assert len(engine.runs_of(adopted)) == 1
    done = await federation.wait_state(cancelled, *TERMINAL_STATES, timeout=120)
    assert done.state == "killed", done
    await until(lambda: engine.runs_in(stale, *engine.killed_states),
                "the returning agent to cancel its stale copy", timeout=120)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        async def up():
            try:
                return (await client.get("/healthz")).status_code == 200
            except httpx.HTTPError:
                return None
        await wait_for(up, "the dashboard to answer")
        for path in ("/", "/jobs", "/charts", "/api/charts", *(f"/jobs/{j}" for j in (adopted, cancelled, stale)),
                     f"/jobs?peer={engine.peer_id}&state=succeeded"):
            response = await client.get(path)
            assert response.status_code == 200, (path, response.text[:300])
    await federation.cancel(stale)
    await federation.wait_state(stale, "killed", timeout=60)

    privileges = await federation.store.db.fetch("""
        SELECT c.relname, p.privilege FROM pg_class c
        CROSS JOIN unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) AS p(privilege)
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p')
          AND has_table_privilege('irisfed_svc_web', c.oid, p.privilege)""")
    assert privileges == [], privileges
    functions = await federation.store.db.fetch("""
        SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace AND prosecdef
          AND proname <> 'irisfed_current_peer' AND has_function_privilege('irisfed_svc_web', oid, 'EXECUTE')""")
    assert functions == [], functions
    writers = await federation.store.db.fetch(
        "SELECT DISTINCT actor FROM federation_changelog WHERE job_id = ANY($1::text[])", [adopted, cancelled, stale])
    assert {r["actor"] for r in writers} <= {"router", "tick", engine.peer_id, SPARE}, writers
    for name in ("router", "tick", engine.peer_id, SPARE, "web"):
        text = federation.log(name)
        assert "permission denied" not in text and "row-level security" not in text, name
        assert "report_set_aside" not in text and "page_failed" not in text, name


async def test_killed_after_slurm_refused_the_submission_the_job_is_retried_not_failed(federation, slurm, tmp_path):
    # Slurm keeps a refused submission as a FAILED job (Reason BadConstraints). An agent
    # killed before it handed the job back finds that job by name at its restart; were
    # it "adopted", the job would fail for good (exit -1) instead of being retried as
    # the infrastructure failure it is.
    _, engine = slurm
    job_id = unique_job_id("refused")
    stand_in(tmp_path / "bin", "sbatch", f"""if mkdir {tmp_path}/fired 2>/dev/null; then
    /usr/bin/sbatch --gres=gpu:h100:99 "$@"; kill -9 $PPID; exit 1
fi
exec /usr/bin/sbatch "$@"
""")
    await start(federation, engine, env_with(engine, tmp_path / "bin"))
    await federation.submit({"job_id": job_id, "command": ["sh", "-c", "echo ran"], "cluster_pin": engine.peer_id})
    await died(federation, engine.peer_id)
    assert [r[1] for r in engine.runs_of(job_id)] == ["FAILED"]  # the refused submission, kept by Slurm
    federation.start(engine.peer_id, *engine.agent_args, env=env_with(engine, None))
    done, runs, _ = await ended_once(federation, engine, job_id)
    assert (done.state, done.exit_code) == ("succeeded", 0), done
    assert done.epoch > 1 and "run_adopted" not in federation.log(engine.peer_id), runs
