"""The ray backend against a real Ray head (``ray_head``: 2 CPUs, no GPU, ``{"TPU": 4}``).

Ray is slow here (a trivial job takes 3-5 s from submit to its end): each test runs
few jobs, at the same time. Jobs that must stay alive wait for a file the test
creates (the head runs on this machine). Every wait is a bound on a hang of a busy
machine, never an assertion on time.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import (
    KILLED_EXIT_CODE,
    LaunchError,
    LiveRun,
    RunLost,
    RunSpec,
)
from irisfed.services.peer_agent.backends.ray import RayBackend
from irisfed.tooling.engines.ray import RayHead
from tests.infra.waiting import wait_for

TIMEOUT_S = 180.0  # Ray's very first job on a fresh head took up to ~20 s
POLL_S = 0.5


@pytest.fixture
async def backends(ray_head: RayHead, tmp_path: Path):
    """``make(peer_id)``: a RayBackend on the test head (closed at the end)."""
    made: list[RayBackend] = []

    def make(peer_id: str = "peer-a") -> RayBackend:
        backend = RayBackend(ray_head.address, tmp_path / "work", peer_id, poll_interval_s=POLL_S)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


def job_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def until_file(path: Path, then: str = "exit 0") -> list[str]:
    """A command that waits for ``path`` to exist, then runs ``then``."""
    return ["sh", "-c", f'echo started; while [ ! -e "$1" ]; do sleep 0.2; done; {then}', "sh", str(path)]


async def ray_status(ray_head: RayHead, submission_id: str) -> str:
    info = await asyncio.to_thread(ray_head.job_client().get_job_info, submission_id)
    return str(info.status.value)


async def ray_jobs_named(ray_head: RayHead, submission_id: str) -> int:
    jobs = await asyncio.to_thread(ray_head.job_client().list_jobs)
    return sum(job.submission_id == submission_id for job in jobs)


async def wait_status(ray_head: RayHead, submission_id: str, *statuses: str) -> str:
    async def probe() -> str | None:
        status = await ray_status(ray_head, submission_id)
        return status if status in statuses else None

    return await wait_for(probe, f"Ray job {submission_id} to be {'/'.join(statuses)}", TIMEOUT_S, POLL_S)


async def test_exit_code_env_and_logs_and_a_second_launch_is_the_same_run(
        ray_head: RayHead, backends, tmp_path: Path) -> None:
    backend = backends()
    pwned = tmp_path / "pwned"
    hostile = f"$(touch {pwned}) `touch {pwned}` 'q' \"dq\" $HOME ${{HOME}} ${{NOT_SET}} \\$"
    script = 'printf "env=%s\\n" "$HOSTILE"; printf "arg=%s\\n" "$1"; echo to-stderr >&2; exit 7'
    spec = RunSpec(job_id("exit7"), 1, ["sh", "-c", script, "sh", hostile],
                   env={"HOSTILE": hostile}, resources={"cpu": 1})

    handle = await backend.launch(spec)
    again = await backend.launch(spec)  # the engine already has (job, epoch): that run

    assert await handle.wait() == 7
    assert await again.wait() == 7
    assert await ray_jobs_named(ray_head, "irisfed-" + spec.job_id + "-e1") == 1
    run_dir = tmp_path / "work" / spec.job_id / "epoch-1"
    assert handle.log_dir == backend.log_dir(spec.job_id, 1) == str(run_dir.resolve())
    stdout = (Path(handle.log_dir) / "stdout").read_text()
    assert f"env={hostile}\n" in stdout and f"arg={hostile}\n" in stdout and "to-stderr\n" in stdout
    assert (Path(handle.log_dir) / "stderr").read_text() == ""  # Ray interleaves both in stdout
    assert not pwned.exists()

    # A restarted agent adopts by name a run that ended while no agent watched.
    later = backends()
    adopted = await later.adopt(LiveRun(spec.job_id, 1, ""))
    assert adopted is not None and await adopted.wait() == 7
    assert spec.job_id not in {run.job_id for run in await later.list_runs()}  # ended: not alive
    assert await later.adopt(LiveRun(spec.job_id, 2, "")) is None  # no such run
    assert await backends("peer-b").adopt(LiveRun(spec.job_id, 1, "")) is None  # not peer-b's


async def test_runs_in_flight_share_one_list_jobs_per_poll(backends) -> None:
    backend = backends()
    specs = [RunSpec(job_id(f"many{code}"), 1, ["sh", "-c", f"exit {code}"], resources={"cpu": 0.5})
             for code in (0, 3, 4)]
    handles = await asyncio.gather(*(backend.launch(spec) for spec in specs))
    before_polls, before = backend.polls, dict(backend.engine_calls)

    assert await asyncio.gather(*(handle.wait() for handle in handles)) == [0, 3, 4]

    calls = {name: count - before.get(name, 0) for name, count in backend.engine_calls.items()}
    polls = backend.polls - before_polls
    assert polls >= 1
    # Each poll is one list_jobs for all three runs; nothing asks about a run on its own
    # but its log's tail (one websocket while it runs) and its logs once it ended.
    assert calls["list_jobs"] == polls
    assert calls.get("get_job_info", 0) == calls.get("get_job_status", 0) == 0
    assert calls["get_job_logs"] == 3


async def test_a_request_the_cluster_can_never_hold_is_refused_before_submitting(
        ray_head: RayHead, backends) -> None:
    backend = backends()
    spec = RunSpec(job_id("oversize"), 1, ["true"], resources={"cpu": 1, "tpu": 8})
    with pytest.raises(LaunchError, match=r"tpu=8 .* tpu=4"):
        await backend.launch(spec)
    with pytest.raises(LaunchError, match=r"gpu=1 .* gpu=0"):
        await backend.launch(RunSpec(spec.job_id, 2, ["true"], resources={"cpu": 1, "gpu": 1}))
    assert backend.engine_calls["submit_job"] == 0
    assert await ray_jobs_named(ray_head, f"irisfed-{spec.job_id}-e1") == 0


async def test_a_tpu_job_shows_in_discover_and_a_pending_job_killed_is_stopped_once_it_starts(
        ray_head: RayHead, backends, tmp_path: Path) -> None:
    backend = backends()
    idle = await backend.discover()
    total_tpu = idle.resources["tpu"][0]
    assert total_tpu == ray_head.resources["TPU"] and "tpu" in idle.attributes["device_type"]
    release = tmp_path / "release"
    holder = await backend.launch(RunSpec(job_id("tpu"), 1, until_file(release),
                                          resources={"cpu": 1, "tpu": 1}))
    await wait_status(ray_head, holder.submission_id, "RUNNING")

    async def tpu_in_use():
        free = (await backend.discover()).resources["tpu"][1]
        return free <= total_tpu - 1 or None  # the usage report lags the job's start

    await wait_for(tpu_in_use, "the TPU job to show as used", TIMEOUT_S, POLL_S)

    # More TPUs than are free: Ray keeps it PENDING, and ignores stop_job meanwhile.
    pending = await backend.launch(RunSpec(job_id("pending"), 1, ["sleep", "600"],
                                           resources={"cpu": 1, "tpu": total_tpu}))
    assert await ray_status(ray_head, pending.submission_id) == "PENDING"
    await pending.kill(grace_s=0)
    assert await ray_status(ray_head, pending.submission_id) == "PENDING"

    release.touch()
    assert await holder.wait() == 0
    assert await pending.wait() == KILLED_EXIT_CODE  # stopped again by the poller once it started
    assert backend.engine_calls["stop_job"] >= 2  # the kill, then again at each poll until it ended
    assert await ray_status(ray_head, pending.submission_id) in ("STOPPED", "FAILED")

    async def tpu_free_again():
        return (await backend.discover()).resources["tpu"] == (total_tpu, total_tpu)

    await wait_for(tpu_free_again, "every TPU to be free again", TIMEOUT_S, POLL_S)


async def test_kill_of_a_running_job_stops_it(ray_head: RayHead, backends, tmp_path: Path) -> None:
    backend = backends()
    handle = await backend.launch(RunSpec(job_id("kill"), 3, until_file(tmp_path / "never")))
    await wait_status(ray_head, handle.submission_id, "RUNNING")

    await handle.kill(grace_s=1.0)

    assert await handle.wait() == KILLED_EXIT_CODE
    assert await ray_status(ray_head, handle.submission_id) == "STOPPED"
    assert "started" in (Path(handle.log_dir) / "stdout").read_text()
    assert await backend.kill_leftover(handle.job_id, 3) is False  # ended: nothing left to kill


async def test_a_restarted_agent_lists_adopts_and_kills_its_runs_and_no_other_peer_does(
        ray_head: RayHead, backends, tmp_path: Path) -> None:
    first, restarted, other = backends(), backends(), backends("peer-b")
    done = tmp_path / "done"
    followed = RunSpec(job_id("adopt"), 5, until_file(done, "exit 3"), resources={"cpu": 0.5})
    left = RunSpec(job_id("leftover"), 2, until_file(tmp_path / "never"), resources={"cpu": 0.5})
    await asyncio.gather(first.launch(followed), first.launch(left))
    await first.close()  # the agent stops; its runs go on in Ray
    assert first.runs_outlive_agent

    listed = {(run.job_id, run.epoch): run for run in await restarted.list_runs()}
    assert set(listed) >= {(followed.job_id, 5), (left.job_id, 2)}
    assert listed[(followed.job_id, 5)].handle == f"irisfed-{followed.job_id}-e5"
    assert not {run.job_id for run in await other.list_runs()} & {followed.job_id, left.job_id}
    assert await other.adopt(listed[(followed.job_id, 5)]) is None
    assert await other.kill_run(listed[(left.job_id, 2)]) is False
    assert await other.kill_leftover(left.job_id, 2) is False

    adopted = await restarted.adopt(listed[(followed.job_id, 5)])
    assert adopted is not None
    assert await restarted.kill_leftover(left.job_id, 2) is True

    done.touch()
    assert await adopted.wait() == 3
    assert await wait_status(ray_head, f"irisfed-{left.job_id}-e2", "STOPPED", "FAILED") == "STOPPED"
    assert await restarted.kill_run(listed[(left.job_id, 2)]) is False  # gone now
    assert {run.job_id for run in await restarted.list_runs()}.isdisjoint({followed.job_id, left.job_id})


async def test_a_run_the_head_does_not_list_is_lost(backends) -> None:
    backend = backends()
    # As after a head restart: a followed run the head no longer knows.
    ghost = backend.track("irisfed-ghost-e1", "ghost", 1)
    with pytest.raises(RunLost, match="no longer knows job irisfed-ghost-e1"):
        await ghost.wait()
    assert "run lost" in (Path(ghost.log_dir) / "stderr").read_text()
    assert await backend.adopt(LiveRun("ghost", 1, "")) is None
    assert await backend.kill_leftover("ghost", 1) is False


async def test_a_head_that_does_not_answer(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = RayBackend(f"http://127.0.0.1:{port}", tmp_path, "peer-a", poll_interval_s=POLL_S,
                         call_timeout_s=10)
    with pytest.raises(LaunchError, match="cannot learn what the Ray cluster at"):
        await backend.launch(RunSpec("j", 1, ["true"]))
    with pytest.raises(Exception):  # noqa: B017 - whatever the client raises; the agent logs it and retries
        await backend.list_runs()
    with pytest.raises(OSError):
        await backend.discover()
    await backend.close()


async def test_a_forged_submission_under_our_name_is_never_taken_for_our_run(
        ray_head: RayHead, backends, tmp_path: Path) -> None:
    """Anyone who reaches the dashboard may submit ``irisfed-<job>-e<epoch>`` with metadata
    naming our peer (job ids and epochs are easy to guess). Taken for the run, such a job
    made before ours would be reported by launch (idempotent) as the job's outcome, whose
    command never ran, and a restarted agent would adopt one made while it was down. Only
    what this peer submitted (the nonce in its run folder) is ours."""
    from irisfed.services.peer_agent.backends import ray_text

    client = ray_head.job_client()
    backend, restarted = backends(), backends()
    forged_first, forged_while_down = job_id("forged"), job_id("forged-down")
    for forged, epoch in ((forged_first, 1), (forged_while_down, 2)):
        await asyncio.to_thread(client.submit_job, entrypoint="echo forged", metadata=ray_text.metadata(
            "peer-a", forged, epoch), submission_id=ray_text.submission_id(forged, epoch), entrypoint_num_cpus=0.1)

    with pytest.raises(LaunchError, match="not this peer's run"):
        await backend.launch(RunSpec(forged_first, 1, ["sh", "-c", "exit 3"], resources={"cpu": 0.5}))
    # The agent accepted (job, 2) and died before it submitted anything: nothing to adopt.
    assert await restarted.adopt(LiveRun(forged_while_down, 2, "")) is None

    # What this peer did submit stays its own: a second launch and a restarted agent find it.
    ours = RunSpec(job_id("ours"), 1, ["sh", "-c", "exit 4"], resources={"cpu": 0.5})
    handle = await backend.launch(ours)
    assert (await backend.launch(ours)).submission_id == handle.submission_id
    adopted = await restarted.adopt(LiveRun(ours.job_id, 1, ""))
    assert adopted is not None and await adopted.wait() == 4


async def test_a_head_that_accepts_and_never_answers_holds_only_the_backends_own_threads(tmp_path: Path) -> None:
    """A dashboard that accepts connections and never answers must not starve the agent:
    its discovery loop gives up after two heartbeat intervals, and were each try one more
    blocking request holding a thread of the event loop's default executor for the 30 s
    call timeout, within seconds every ``to_thread`` of the agent (run folders, logs,
    other backends, host name lookups of a reconnect) would wait ~26 s."""
    import socket
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    backend = RayBackend(f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path, "peer-a", call_timeout_s=30)
    heartbeat_s = 0.1
    loop = asyncio.get_running_loop()
    try:
        until = loop.time() + 3.0
        while loop.time() < until:  # what the agent's discovery loop does
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(backend.discover(), timeout=2 * heartbeat_s)
            await asyncio.sleep(heartbeat_s)
        listing = asyncio.ensure_future(backend.list_runs())  # a call to the head: waits in the backend's threads
        started = loop.time()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), timeout=5) == "free"
        assert loop.time() - started < 1.0
        assert len(accepted) <= 2  # one discovery request in flight, however many heartbeats passed
        listing.cancel()
    finally:
        await backend.close()
        silent.close()
        for conn in accepted:
            conn.close()


async def test_ray_a_submit_whose_answer_is_lost_is_followed_not_handed_back(
        ray_head: RayHead, tmp_path: Path) -> None:
    """The head took the job but its answer never came (a timeout, a reset): the run
    exists and will run; failing the launch would hand the job back and run it twice."""
    backend = RayBackend(ray_head.address, tmp_path / "work", "peer-a", poll_interval_s=POLL_S)
    real = backend.call

    async def answer_lost(name: str, *args, **kwargs):
        result = await real(name, *args, **kwargs)
        if name == "submit_job":
            raise TimeoutError("the head's answer was lost")
        return result

    async def never_taken(name: str, *args, **kwargs):
        if name == "submit_job":
            raise ConnectionResetError("reset before the head read it")
        return await real(name, *args, **kwargs)

    try:
        backend.call = answer_lost
        spec = RunSpec(job_id("lost-answer"), 1, ["sh", "-c", "exit 6"], resources={"cpu": 1})
        handle = await backend.launch(spec)
        assert await handle.wait() == 6
        jobs = await asyncio.to_thread(ray_head.job_client().list_jobs)
        assert sum(job.submission_id == f"irisfed-{spec.job_id}-e1" for job in jobs) == 1

        backend.call = never_taken  # nothing was made: still a launch error
        with pytest.raises(LaunchError, match="did not take"):
            await backend.launch(RunSpec(job_id("never-taken"), 1, ["true"], resources={"cpu": 1}))
    finally:
        await backend.close()


async def test_ray_an_env_too_large_for_ray_is_refused_and_the_largest_that_fits_arrives_verbatim(
        ray_head: RayHead, tmp_path: Path) -> None:
    """Twelve values of 4096 quotes (~49 KB, a submit may be 64 KB) are ~330 KB quoted for
    the shell and encoded, which Ray hands its job supervisor's worker as one argument:
    that exec fails (E2BIG), Ray retries it for minutes and fails the job as lost
    (JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE), and the job would be retried elsewhere. Such an
    environment is a launch error up front; the largest that fits arrives verbatim."""
    backend = RayBackend(ray_head.address, tmp_path / "work", "peer-a", poll_interval_s=POLL_S)
    try:
        quotes = RunSpec(job_id("quotes"), 1, ["true"], env={f"Q{i}": "'" * 4096 for i in range(12)},
                         resources={"cpu": 1})
        with pytest.raises(LaunchError, match="environment is .* at most"):
            await backend.launch(quotes)
        jobs = await asyncio.to_thread(ray_head.job_client().list_jobs)
        assert not any(job.submission_id == f"irisfed-{quotes.job_id}-e1" for job in jobs)

        env = {f"V{i}": "a" * 4096 for i in range(17)} | {"HOSTILE": "'\"$(x)`\n\\"}
        script = 'printf "%s" "$V0" | wc -c; printf "%s" "$V16" | wc -c; [ "$HOSTILE" = "$1" ]'
        spec = RunSpec(job_id("largest"), 1, ["sh", "-c", script, "sh", env["HOSTILE"]], env=env,
                       resources={"cpu": 1})
        handle = await backend.launch(spec)
        assert await handle.wait() == 0
        assert "\n4096\n4096\n" in (Path(handle.log_dir) / "stdout").read_text()  # Ray adds its own lines
    finally:
        await backend.close()


async def test_a_job_runs_in_its_own_copy_of_its_workspace_and_leaves_its_outputs(backends, tmp_path: Path) -> None:
    backend = backends()
    workspace = tmp_path / "cache" / "tree"  # the agent's unpacked cache: never written by the run
    workspace.mkdir(parents=True)
    (workspace / "data.txt").write_text("from the workspace")
    # What the workspace's own .gitignore lists travels too (Ray's upload would drop it).
    (workspace / ".gitignore").write_text("data.txt\n")
    # Exit 5 when an earlier run's scratch file is there: each run starts in a fresh copy.
    script = ("import os, pathlib, sys; out = pathlib.Path(os.environ['IRISFED_OUTPUT_DIR']); "
              "pathlib.Path('scratch').exists() and sys.exit(5); pathlib.Path('scratch').write_text('x'); "
              "out.joinpath('seen.txt').write_text(pathlib.Path('data.txt').read_text())")
    first, second = (RunSpec(job_id(f"ws{i}"), 1, ["python3", "-c", script], resources={"cpu": 0.5},
                             workspace=workspace) for i in (1, 2))
    for spec in (first, second):
        handle = await backend.launch(spec)
        assert await handle.wait() == 0, (Path(handle.log_dir) / "stdout").read_text()
        [(task, outputs)] = backend.output_dirs(spec.job_id, 1, 1)
        assert task == 0 and (outputs / "seen.txt").read_text() == "from the workspace"
    assert sorted(p.name for p in workspace.iterdir()) == [".gitignore", "data.txt"]


# What a job does on SIGTERM, in ``folder`` (the head runs on this machine): checkpoint for
# longer than Ray's own stop timeout (3 s, when the submission sets none), or ignore it.
CHECKPOINT_S = 6


def on_term(folder: Path, trap: str) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return ["sh", "-c", f'cd "$1" && trap "{trap}" TERM; touch ready; sleep 300 & wait', "sh", str(folder)]


async def test_a_stopped_run_gets_sigterm_and_its_grace_before_ray_kills_it(
        ray_head: RayHead, backends, tmp_path: Path) -> None:
    """docs/design.md §3.7 on Ray: the submission sets Ray's stop timeout for the job to
    its grace, so a checkpoint longer than Ray's default finishes; a job ignoring SIGTERM
    is killed once the grace passed. (Nothing here is timed.)"""
    backend = backends()
    saves, deaf = tmp_path / "saves", tmp_path / "deaf"
    checkpoints = await backend.launch(RunSpec(
        job_id("grace"), 1, on_term(saves, f"sleep {CHECKPOINT_S}; echo checkpoint >> ckpt; exit 0"),
        resources={"cpu": 0.5}, grace_s=10))
    ignores = await backend.launch(RunSpec(job_id("deaf"), 1, on_term(deaf, ""), resources={"cpu": 0.5}, grace_s=2))
    for folder in (saves, deaf):
        await wait_for(lambda folder=folder: asyncio.to_thread((folder / "ready").exists),
                       f"{folder.name} to trap SIGTERM", TIMEOUT_S, 0.2)
    info = await asyncio.to_thread(ray_head.job_client().get_job_info, checkpoints.submission_id)
    assert info.runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "10"

    await asyncio.gather(checkpoints.kill(grace_s=10), ignores.kill(grace_s=2))

    assert await asyncio.wait_for(checkpoints.wait(), TIMEOUT_S) == KILLED_EXIT_CODE
    assert (saves / "ckpt").read_text() == "checkpoint\n"  # SIGTERM first, then time to finish
    assert await asyncio.wait_for(ignores.wait(), TIMEOUT_S) == KILLED_EXIT_CODE  # SIGKILLed after its grace
    for handle in (checkpoints, ignores):
        assert await ray_status(ray_head, handle.submission_id) == "STOPPED"
