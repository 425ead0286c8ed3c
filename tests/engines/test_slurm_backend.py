"""The Slurm backend against a real Slurm (services/peer_agent/backends/slurm.py).

Each test has a peer id of its own, so runs of earlier tests (and of other peers on a
shared cluster) are never its runs. Each run takes one CPU. The node has one CPU more
than the machine (2 here), which the time-limited run (``slurm_time_limited_run``,
submitted when the first test asks for Slurm, read by the last test) holds for its
first minute or so: the tests find the machine's CPUs free either way. Timeouts bound
a hang; nothing here is timed.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import (
    KILLED_EXIT_CODE,
    LaunchError,
    LiveRun,
    RunLost,
    RunOutcomeUnknown,
    RunSpec,
)
from irisfed.services.peer_agent.backends.slurm import SlurmBackend, SlurmError
from irisfed.services.peer_agent.backends.slurm_nodes import parse_gres
from irisfed.services.peer_agent.backends.slurm_text import (
    EXIT_STATUS_FILE,
    STARTED_MARKER,
    job_name,
)
from irisfed.shared.messages import JOB_ID_PATTERN
from irisfed.tooling.engines.slurm import SlurmCluster
from tests.engines.fixtures import TimeLimitedRun
from tests.infra.probes import returns
from tests.infra.slurm_runs import (
    JOB_TIMEOUT_S,
    POLL_S,
    eventually,
    in_environment,
    run_ended,
    slurm_backends,
    slurm_job,
)

# Waits until a file `go` appears in its run folder (its working directory), then exits 7.
WAIT_FOR_GO = ["sh", "-c", "while [ ! -e go ]; do sleep 0.2; done; exit 7"]


@pytest.fixture
def slurm_env(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
              slurm_time_limited_run: TimeLimitedRun) -> SlurmCluster:
    """The cluster, in the environment; its time-limited run started (its minute runs
    while the tests do: ``test_a_run_past_its_time_limit_...``, last here, reads it)."""
    return in_environment(slurm_cluster, monkeypatch)


@pytest.fixture
def peer_id() -> str:
    return f"peer-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def make_backend(slurm_env: SlurmCluster, tmp_path: Path,
                       peer_id: str) -> AsyncIterator[Callable[..., SlurmBackend]]:
    """New SlurmBackend objects (an agent run each) on one work folder; all closed at the end."""
    async with slurm_backends(tmp_path / "work", peer_id) as make:
        yield make


@pytest.fixture
def backend(make_backend: Callable[..., SlurmBackend]) -> SlurmBackend:
    return make_backend()


def _spec(command: list[str], job_id: str = "", epoch: int = 1, **kwargs) -> RunSpec:
    return RunSpec(job_id or f"job-{uuid.uuid4().hex[:8]}", epoch, command, **kwargs)


def _assert_stopped(job: dict[str, str], within_grace: bool | None = True) -> None:
    """A job the backend stopped (``kill``): SIGTERM alone, so a job that ended by it
    within its grace is FAILED by SIGTERM (its batch shell ends by the signal, as
    Slurm's ``0:15`` says); one that outlived its grace was cancelled. None: either."""
    stopped = (job["JobState"], job["ExitCode"])
    allowed = {True: [("FAILED", "0:15")], False: [("CANCELLED", "0:9"), ("CANCELLED", "0:15")],
               None: [("FAILED", "0:15"), ("CANCELLED", "0:9"), ("CANCELLED", "0:15")]}[within_grace]
    assert stopped in allowed, job


async def _running(cluster: SlurmCluster, slurm_id: str) -> None:
    await eventually(lambda: asyncio.to_thread(lambda: slurm_job(cluster, slurm_id)["JobState"] == "RUNNING"),
                     f"Slurm job {slurm_id} to run")


async def test_exit_code_and_output_files(backend: SlurmBackend) -> None:
    spec = _spec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    handle = await backend.launch(spec)

    assert await run_ended(handle) == 3
    run_dir = Path(handle.log_dir)
    assert handle.log_dir == backend.log_dir(spec.job_id, spec.epoch)
    assert run_dir == (backend.work_root / spec.job_id / "epoch-1").resolve()
    assert (run_dir / "stdout").read_text() == "out\n"
    assert (run_dir / "stderr").read_text() == "err\n"
    assert (run_dir / "job.sh").exists()


async def test_gpu_job_gets_its_gres_and_is_killed(backend: SlurmBackend, slurm_env: SlurmCluster) -> None:
    handle = await backend.launch(_spec(["sh", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES"; exec sleep 30'],
                                        resources={"cpu": 1, "gpu": 2}))
    job = slurm_job(slurm_env, handle.slurm_id)
    # Slurm 22.05 writes "gres:gpu:2", 23.02 and later "gres/gpu:2".
    assert re.fullmatch(r"gres[:/]gpu:2", job["TresPerNode"]), job
    tres = set(job["TRES"].split(","))
    assert "cpu=1" in tres and tres & {"mem=1024M", "mem=1G"}, job
    assert job["Comment"] == backend.comment
    assert job["Requeue"] == "0", job  # a node failure ends it (irisfed retries), never reruns it in place
    stdout = Path(handle.log_dir) / "stdout"
    await eventually(lambda: asyncio.to_thread(lambda: stdout.exists() and stdout.read_text()),
                     "the job to start")
    assert re.fullmatch(r"gpus=\d+,\d+\n", stdout.read_text())

    await handle.kill(grace_s=1)

    assert await run_ended(handle) == KILLED_EXIT_CODE
    _assert_stopped(slurm_job(slurm_env, handle.slurm_id), within_grace=None)


async def test_environment_arrives_literally_without_agent_secrets(
    backend: SlurmBackend, slurm_env: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IRISFED_DATABASE_URL", "postgres://agent:secret@db/irisfed")
    monkeypatch.setenv("IRISFED_NATS_URL", "nats://agent:secret@nats:4222")
    pwned = tmp_path / "pwned"
    env = {
        "SUBST": f"$(touch {pwned})", "TICKS": f"`touch {pwned}`", "QUOTES": "it's \"q\" \\ $HOME",
        "LINES": "a\n#SBATCH --gres=gpu:4\nb", "CRLF": "x\r\ny", "odd-name": f"v; touch {pwned}",
        "IRISFED_JOB_ID": "forged",
    }
    printer = "import json, os; print(json.dumps(dict(os.environ)))"
    spec = _spec(["python3", "-c", printer], env=env, epoch=4)
    handle = await backend.launch(spec)

    assert await run_ended(handle) == 0
    seen = json.loads((Path(handle.log_dir) / "stdout").read_text())
    assert {name: seen.get(name) for name in env if name != "IRISFED_JOB_ID"} == {
        name: value for name, value in env.items() if name != "IRISFED_JOB_ID"}
    assert (seen["IRISFED_JOB_ID"], seen["IRISFED_EPOCH"]) == (spec.job_id, "4")
    assert "IRISFED_DATABASE_URL" not in seen and "IRISFED_NATS_URL" not in seen
    assert not any("secret" in value for value in seen.values())
    assert not pwned.exists()
    assert slurm_job(slurm_env, handle.slurm_id).get("TresPerNode", "") in ("", "(null)")  # no #SBATCH read


async def test_launch_twice_is_one_slurm_job(backend: SlurmBackend, slurm_env: SlurmCluster,
                                             make_backend: Callable[..., SlurmBackend]) -> None:
    spec = _spec(["sleep", "30"])
    first = await backend.launch(spec)
    second = await backend.launch(spec)
    restarted = await make_backend().launch(spec)  # by a restarted agent

    assert first.slurm_id == second.slurm_id == restarted.slurm_id
    named = slurm_env.run("squeue", "-h", "-t", "all", "-n", job_name(spec.job_id, spec.epoch), "-o", "%i")
    assert named.split() == [first.slurm_id]
    await first.kill(grace_s=1)
    assert await run_ended(second) == KILLED_EXIT_CODE


async def test_restarted_agent_lists_adopts_and_follows_to_the_exit_code(
    make_backend: Callable[..., SlurmBackend], slurm_env: SlurmCluster,
) -> None:
    spec = _spec(WAIT_FOR_GO)
    first = make_backend()
    launched = await first.launch(spec)
    await first.close()  # the agent stops; the run goes on

    restarted = make_backend()
    assert await restarted.list_runs() == [LiveRun(spec.job_id, spec.epoch, launched.slurm_id)]
    assert await make_backend(peer=f"other-{uuid.uuid4().hex[:6]}").list_runs() == []
    adopted = await restarted.adopt(LiveRun(spec.job_id, spec.epoch, ""))  # as the agent's reconcile asks
    assert adopted is not None and adopted.slurm_id == launched.slurm_id
    assert adopted.log_dir == launched.log_dir

    (Path(launched.log_dir) / "go").touch()

    assert await run_ended(adopted) == 7
    # Ended while no agent watched: still adopted (Slurm remembers it), with its exit code.
    later = await make_backend().adopt(LiveRun(spec.job_id, spec.epoch, ""))
    assert later is not None and await run_ended(later) == 7
    assert await restarted.list_runs() == []


async def test_other_peers_neither_adopt_nor_kill(
    make_backend: Callable[..., SlurmBackend], slurm_env: SlurmCluster,
) -> None:
    spec = _spec(WAIT_FOR_GO)
    handle = await make_backend().launch(spec)
    other = make_backend(peer=f"other-{uuid.uuid4().hex[:6]}")

    assert await other.adopt(LiveRun(spec.job_id, spec.epoch, "")) is None
    assert await other.kill_leftover(spec.job_id, spec.epoch) is False
    assert await other.kill_run(LiveRun(spec.job_id, spec.epoch, handle.slurm_id)) is False
    (Path(handle.log_dir) / "go").touch()
    assert await run_ended(handle) == 7


async def test_kill_leftover_and_kill_run(make_backend: Callable[..., SlurmBackend],
                                          slurm_env: SlurmCluster) -> None:
    first = make_backend()
    leftover = await first.launch(_spec(["sleep", "30"]))
    listed = await first.launch(_spec(["sleep", "30"]))
    restarted = make_backend()

    assert await restarted.kill_leftover(*_run_of(leftover)) is True
    runs = {run.handle: run for run in await restarted.list_runs()}
    assert set(runs) == {listed.slurm_id}
    assert await restarted.kill_run(runs[listed.slurm_id]) is True

    assert await run_ended(leftover) == KILLED_EXIT_CODE
    assert await run_ended(listed) == KILLED_EXIT_CODE
    assert await restarted.kill_leftover(*_run_of(leftover)) is False
    assert await restarted.kill_run(runs[listed.slurm_id]) is False
    assert slurm_job(slurm_env, leftover.slurm_id)["JobState"] == "CANCELLED"


def _run_of(handle) -> tuple[str, int]:
    """(job id, epoch) of a handle, from its run folder ``<job>/epoch-<n>``."""
    run_dir = Path(handle.log_dir)
    return run_dir.parent.name, int(run_dir.name.removeprefix("epoch-"))


async def test_discover_matches_the_nodes_and_free_drops_while_a_gpu_job_runs(
    backend: SlurmBackend, slurm_env: SlurmCluster,
) -> None:
    node = slurm_env.node()
    gpus, gpu_types = parse_gres(node.get("Gres", ""))
    if not gpus.get("gpu"):
        pytest.skip("the Slurm node has no GPU GRES")
    found = await backend.discover()

    assert found.resources["cpu"][0] == int(node["CPUTot"])
    assert found.resources["memory_mb"][0] == int(node["RealMemory"])
    assert found.resources["gpu"][0] == gpus["gpu"]
    assert found.attributes == {"device_type": ["gpu"], "device_variant": gpu_types["gpu"]}

    handle = await backend.launch(_spec(["sleep", "30"], resources={"cpu": 1, "gpu": 2}))
    await _running(slurm_env, handle.slurm_id)
    busy = await backend.discover()
    assert busy.resources["gpu"][1] <= gpus["gpu"] - 2
    assert busy.resources["cpu"][1] <= int(node["CPUTot"]) - 1
    assert busy.resources["memory_mb"][1] <= int(node["RealMemory"]) - 1024
    assert busy.resources["gpu"][0] == gpus["gpu"]
    await handle.kill(grace_s=1)
    assert await run_ended(handle) == KILLED_EXIT_CODE


async def test_a_job_no_node_can_hold_is_refused_before_sbatch(backend: SlurmBackend) -> None:
    with pytest.raises(LaunchError, match=r"gpu: asked 8, the largest node has \d+"):
        await backend.launch(_spec(["true"], resources={"cpu": 1, "gpu": 8}))
    with pytest.raises(LaunchError, match=r"tpu: asked 1, the largest node has 0"):
        await backend.launch(_spec(["true"], resources={"cpu": 1, "tpu": 1}))
    assert backend.engine_calls["sbatch"] == 0


async def test_sbatch_refusal_and_unknown_partition_are_launch_errors(
    backend: SlurmBackend, make_backend: Callable[..., SlurmBackend],
) -> None:
    # Slurm refuses batch scripts over its max_script_size (4 MB by default).
    with pytest.raises(LaunchError, match="sbatch exited 1: .*Batch job submission failed"):
        await backend.launch(_spec(["true"], env={"BIG": "x" * 5_000_000}))
    with pytest.raises(LaunchError, match="holds '='"):
        await backend.launch(_spec(["a=b"], env={"odd-name": "1"}))
    nowhere = make_backend(partition="no-such-partition")
    with pytest.raises(LaunchError, match="no-such-partition"):
        await nowhere.launch(_spec(["true"]))
    with pytest.raises(SlurmError, match="no-such-partition"):
        await nowhere.discover()


async def test_runs_in_flight_are_polled_with_one_call_per_interval(
    backend: SlurmBackend, slurm_env: SlurmCluster,
) -> None:
    handles = [await backend.launch(_spec(["sleep", "30"])) for _ in range(3)]  # 2 or 3 run, as CPUs allow
    await _running(slurm_env, handles[0].slurm_id)
    calls, polls = dict(backend.engine_calls), backend.polls

    await eventually(lambda: returns(backend.polls >= polls + 5), "five polls")

    assert backend.polls - polls >= 5
    grown = {name: count - calls.get(name, 0) for name, count in backend.engine_calls.items()}
    # A call is counted when it starts, a poll when it is answered: one poll may be in
    # flight at either snapshot. One call per run would be three per poll.
    squeue = grown.pop("squeue")
    assert abs(squeue - (backend.polls - polls)) <= 1, (squeue, backend.polls - polls)
    assert grown == {name: 0 for name in calls if name != "squeue"}
    for handle in handles:
        await handle.kill(grace_s=1)
    assert [await run_ended(handle) for handle in handles] == [KILLED_EXIT_CODE] * 3


async def test_a_job_slurm_does_not_know_is_lost(backend: SlurmBackend) -> None:
    handle = backend.follow("999999999", "ghost", 1)  # no run folder: it never started
    with pytest.raises(RunLost, match="Slurm no longer knows job 999999999, and it never started"):
        await run_ended(handle)


# ---------------------------------------------------------------- what a run leaves in its folder


async def test_a_run_records_its_start_and_exit_status_in_its_folder(backend: SlurmBackend) -> None:
    ok = await backend.launch(_spec(["sh", "-c", "exit 0"]))
    failed = await backend.launch(_spec(["sh", "-c", "exit 3"]))

    assert (await run_ended(ok), await run_ended(failed)) == (0, 3)
    for handle, code in ((ok, 0), (failed, 3)):
        run_dir = Path(handle.log_dir)
        assert (run_dir / STARTED_MARKER).read_text() == f"{handle.slurm_id}\n"
        assert (run_dir / EXIT_STATUS_FILE).read_text() == f"{code}\n"


async def test_a_killed_run_ends_killed_its_command_got_sigterm_and_minus_15_is_recorded(
    backend: SlurmBackend, slurm_env: SlurmCluster,
) -> None:
    command = ["sh", "-c", "trap 'echo got-term > term; exit 0' TERM; touch ready; while :; do sleep 0.1; done"]
    handle = await backend.launch(_spec(command))
    run_dir = Path(handle.log_dir)
    await eventually(lambda: asyncio.to_thread((run_dir / "ready").exists), "the command to start")

    await handle.kill(grace_s=1)

    assert await run_ended(handle) == KILLED_EXIT_CODE  # though its command exited 0 on SIGTERM
    _assert_stopped(slurm_job(slurm_env, handle.slurm_id), within_grace=None)
    assert (run_dir / "term").read_text() == "got-term\n"  # signals reach the command, not only the shell
    assert (run_dir / EXIT_STATUS_FILE).read_text() == "-15\n"


async def _real_run_folder(backend: SlurmBackend, code: int) -> Path:
    """The folder a real run exiting ``code`` left: what Slurm's forgetting leaves."""
    handle = await backend.launch(_spec(["sh", "-c", f"exit {code}"]))
    assert await run_ended(handle) == code
    return Path(handle.log_dir)


def _forgotten(backend: SlurmBackend, real: Path, keep: tuple[str, ...]) -> tuple[str, int]:
    """A (job, epoch) Slurm never heard of whose run folder is a copy of ``real``,
    kept to the markers named in ``keep``: a run Slurm has forgotten."""
    job_id, epoch = f"gone-{uuid.uuid4().hex[:8]}", 2
    target = backend.run_dir(job_id, epoch)
    shutil.copytree(real, target)
    for marker in {STARTED_MARKER, EXIT_STATUS_FILE} - set(keep):
        (target / marker).unlink()
    return job_id, epoch


@pytest.mark.parametrize("code", [0, 4])
async def test_a_forgotten_run_with_an_exit_status_is_adopted_with_it(
    make_backend: Callable[..., SlurmBackend], code: int,
) -> None:
    first = make_backend()
    job_id, epoch = _forgotten(first, await _real_run_folder(first, code), (STARTED_MARKER, EXIT_STATUS_FILE))
    restarted = make_backend()

    adopted = await restarted.adopt(LiveRun(job_id, epoch, ""))

    assert adopted is not None
    assert adopted.log_dir == restarted.log_dir(job_id, epoch)
    assert await run_ended(adopted) == code
    await adopted.kill(grace_s=1)  # ended: nothing to cancel
    assert restarted.engine_calls["scancel"] == 0


async def test_a_forgotten_run_that_started_without_an_exit_status_has_an_unknown_outcome(
    make_backend: Callable[..., SlurmBackend],
) -> None:
    first = make_backend()
    real = await _real_run_folder(first, 0)
    job_id, epoch = _forgotten(first, real, (STARTED_MARKER,))

    adopted = await make_backend().adopt(LiveRun(job_id, epoch, ""))

    assert adopted is not None
    slurm_id = (real / STARTED_MARKER).read_text().strip()
    run_dir = first.run_dir(job_id, epoch).resolve()
    with pytest.raises(RunOutcomeUnknown) as caught:
        await run_ended(adopted)
    assert str(caught.value) == (f"Slurm forgot job {slurm_id} after it started; its outcome is unknown "
                                 f"(no exit status in {run_dir})")


async def test_a_run_slurm_does_not_know_that_never_started_is_not_adopted(
    make_backend: Callable[..., SlurmBackend],
) -> None:
    first = make_backend()
    job_id, epoch = _forgotten(first, await _real_run_folder(first, 0), ())  # job.sh, no markers
    restarted = make_backend()

    assert await restarted.adopt(LiveRun(job_id, epoch, "")) is None
    assert await restarted.adopt(LiveRun(f"never-{uuid.uuid4().hex[:8]}", 1, "")) is None  # no folder at all


async def test_a_followed_run_slurm_stops_listing_settles_from_its_folder(backend: SlurmBackend) -> None:
    """The poll path: Slurm forgot a followed job (an id it never had, here)."""
    real = await _real_run_folder(backend, 6)
    ended = _forgotten(backend, real, (STARTED_MARKER, EXIT_STATUS_FILE))
    started_only = _forgotten(backend, real, (STARTED_MARKER,))

    assert await run_ended(backend.follow("999999997", *ended)) == 6
    with pytest.raises(RunOutcomeUnknown, match=r"Slurm forgot job 999999997 after it started; its outcome "
                                                r"is unknown \(no exit status in .*/epoch-2\)"):
        await run_ended(backend.follow("999999997", *started_only))


async def test_a_hung_or_missing_command_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one stand-in here: a real Slurm cannot be made to hang on demand, so ``squeue``
    is a script that never answers (no cluster needed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hang = bin_dir / "squeue"
    hang.write_text("#!/bin/sh\nexec /bin/sleep 600\n")
    hang.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    backend = SlurmBackend(tmp_path / "work", "p", poll_interval_s=POLL_S, command_timeout_s=0.5)

    with pytest.raises(SlurmError, match=r"squeue did not answer within 0.5 s"):
        await backend.list_runs()
    hang.unlink()
    with pytest.raises(LaunchError, match="cannot run squeue"):
        await backend.launch(_spec(["true"]))


async def test_a_failed_sbatch_that_created_its_job_is_followed_but_a_refused_one_is_not(
    backend: SlurmBackend, slurm_env: SlurmCluster, peer_id: str,
) -> None:
    """sbatch may fail after slurmctld took the job (its answer lost): that job is the run.
    A submission Slurm refused is also listed (FAILED, Reason=BadConstraints): no run."""
    taken, refused = _spec(["true"]), _spec(["true"])
    comment = f"--comment=irisfed:{peer_id}"
    quiet = ["-D", "/tmp", "-o", "/dev/null", "-c", "1", "--mem=64"]
    slurm_env.run("sbatch", "-J", job_name(taken.job_id, 1), comment, *quiet, "--wrap", "true")
    slurm_env.run("sbatch", "-J", job_name(refused.job_id, 1), comment, *quiet, "--gres=gpu:h100:99",
                  "--wrap", "true", check=False)
    lost = SlurmError("sbatch exited 1: Socket timed out on send/recv operation")

    made = await backend._submitted_anyway(job_name(taken.job_id, 1), lost)
    assert made is not None and made.job_id == taken.job_id
    assert await run_ended(backend.follow(made.slurm_id, taken.job_id, 1)) == 0
    assert await backend._submitted_anyway(job_name(refused.job_id, 1), lost) is None
    assert await backend._submitted_anyway(job_name("never-submitted", 1), lost) is None


async def test_a_job_another_user_names_as_our_run_is_never_taken_for_it(
    backend: SlurmBackend, slurm_env: SlurmCluster, peer_id: str,
) -> None:
    """Another user of the cluster submits ``irisfed-<job>-e<epoch>`` with our comment
    before we launch it: the backend lists only its own user's jobs (``squeue --me``),
    so it never lists, adopts, kills or follows that job, and launches its own."""
    import os
    import subprocess

    spec = _spec(["sh", "-c", "exit 5"])
    for folder in slurm_env.conf_path.parents:  # the user `nobody` must reach the config and munge
        if folder == Path("/tmp") or folder == Path("/"):
            break
        os.chmod(folder, os.stat(folder).st_mode | 0o001)
    forged = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sbatch", "--parsable",
         "-J", job_name(spec.job_id, 1), f"--comment=irisfed:{peer_id}", "-D", "/tmp", "-o", "/dev/null",
         "-c", "1", "--mem=64", "--wrap", "sleep 20"],
        env=slurm_env.client_env(), capture_output=True, text=True, timeout=60, check=False)
    if forged.returncode != 0:
        pytest.skip(f"cannot submit as another user here: {forged.stderr.strip()}")
    forged_id = forged.stdout.strip().split(";")[0]
    try:
        assert await backend.list_runs() == []
        assert await backend.adopt(LiveRun(spec.job_id, 1, "")) is None
        assert await backend.kill_leftover(spec.job_id, 1) is False
        handle = await backend.launch(spec)
        assert handle.slurm_id != forged_id
        assert await run_ended(handle) == 5
        assert slurm_job(slurm_env, forged_id)["JobState"] in ("PENDING", "RUNNING", "COMPLETED")  # untouched
    finally:
        slurm_env.run("scancel", forged_id, check=False)


async def test_slurm_a_longest_job_id_is_one_run_found_again_by_name(make_backend) -> None:
    """Slurm keeps a job's whole name (``irisfed-<128 characters>-e1``): a truncated one
    would never be found again, and a second launch would submit the job twice."""
    job = "j" + uuid.uuid4().hex + "." * 20 + "-" * 20 + "e" * 55
    assert len(job) == 128 and re.fullmatch(JOB_ID_PATTERN, job)
    backend = make_backend()
    spec = RunSpec(job, 1, ["sh", "-c", "while [ ! -e go ]; do sleep 0.2; done; exit 3"])
    first = await backend.launch(spec)
    again = await make_backend().launch(spec)  # a restarted agent's launch of the same (job, epoch)
    assert first.slurm_id == again.slurm_id
    assert [run.job_id for run in await backend.list_runs()] == [job]
    (Path(first.log_dir) / "go").touch()
    assert await run_ended(first) == 3


async def test_slurm_commands_that_trap_term_fork_or_exit_143_end_as_they_said(make_backend) -> None:
    backend = make_backend()
    specs = {
        # A child left behind: the run ends when the command does, with its status.
        "forks": (["sh", "-c", "(sleep 30 &) ; exit 4"], 4),
        # A command that traps TERM but is never sent one.
        "traps": (["sh", "-c", "trap 'exit 9' TERM; exit 5"], 5),
    }
    handles = {name: await backend.launch(RunSpec(f"{name}-{uuid.uuid4().hex[:8]}", 1, command))
               for name, (command, _) in specs.items()}
    for name, (_, code) in specs.items():
        assert await run_ended(handles[name]) == code, name
        folder = Path(handles[name].log_dir)
        assert (folder / EXIT_STATUS_FILE).read_text() == f"{code}\n"
        assert (folder / STARTED_MARKER).read_text().strip() == handles[name].slurm_id


# ---------------------------------------------------------------- the run contract (docs/design.md §3.7)

# A checkpoint that takes longer than our cluster's KillWait (5 s): a plain scancel would
# SIGKILL it half way; the run's grace (10 s) leaves it time to finish.
CHECKPOINT_S = 6
# Stopped by SIGTERM, it checkpoints (a line in ``ckpt``, in its run folder) and exits 0.
CHECKPOINTS = ["sh", "-c", f'trap "sleep {CHECKPOINT_S}; echo checkpoint >> ckpt; exit 0" TERM; '
                           "touch ready; sleep 300 & wait"]
IGNORES_TERM = ["sh", "-c", 'trap "" TERM; touch ready; sleep 300 & wait']


async def test_a_stopped_run_gets_sigterm_and_its_grace_and_slurm_a_time_limit_past_the_agents(
    backend: SlurmBackend, slurm_env: SlurmCluster,
) -> None:
    checkpoints = await backend.launch(_spec(CHECKPOINTS, grace_s=10, time_limit_s=90))
    ignores = await backend.launch(_spec(IGNORES_TERM, grace_s=2))
    for handle in (checkpoints, ignores):
        ready = Path(handle.log_dir) / "ready"
        await eventually(lambda ready=ready: asyncio.to_thread(ready.exists), "the command to trap SIGTERM")
    # The agent stops it at 90 s; Slurm's backstop, in whole minutes: ceil((90 + 10) / 60) + 1.
    assert slurm_job(slurm_env, checkpoints.slurm_id)["TimeLimit"] == "00:03:00"
    assert slurm_job(slurm_env, ignores.slurm_id)["TimeLimit"] != "00:03:00"  # no limit of its own: the partition's

    await asyncio.gather(checkpoints.kill(grace_s=10), ignores.kill(grace_s=2))

    # SIGTERM first, and time to finish its checkpoint: then it ended, killed.
    assert await run_ended(checkpoints) == KILLED_EXIT_CODE
    run_dir = Path(checkpoints.log_dir)
    assert (run_dir / "ckpt").read_text() == "checkpoint\n"
    assert (run_dir / EXIT_STATUS_FILE).read_text() == "-15\n"
    _assert_stopped(slurm_job(slurm_env, checkpoints.slurm_id), within_grace=True)
    # SIGTERM ignored: cancelled once its grace passed, and killed all the same.
    assert await run_ended(ignores) == KILLED_EXIT_CODE
    _assert_stopped(slurm_job(slurm_env, ignores.slurm_id), within_grace=False)


async def test_a_run_stopped_before_any_poll_saw_it_run_still_gets_its_grace(
    slurm_env: SlurmCluster, tmp_path: Path, peer_id: str,
) -> None:
    """A cancel right after the run started, before the backend's poll noticed: its start
    marker says it runs, so it gets SIGTERM and its grace, not a cancel at once."""
    backend = SlurmBackend(tmp_path / "unpolled", peer_id, poll_interval_s=3600)  # polls only when asked
    try:
        handle = await backend.launch(_spec(CHECKPOINTS, grace_s=10))
        await eventually(lambda: asyncio.to_thread((Path(handle.log_dir) / "ready").exists),
                         "the command to trap SIGTERM")
        assert backend.polls == 0
        stopping = asyncio.ensure_future(handle.kill(grace_s=10))
        while not stopping.done():  # the end is seen by a poll: ask for them
            await asyncio.wait({stopping}, timeout=POLL_S)
            await backend.poll()
        await stopping
        assert await run_ended(handle) == KILLED_EXIT_CODE
        assert (Path(handle.log_dir) / "ckpt").read_text() == "checkpoint\n"
        _assert_stopped(slurm_job(slurm_env, handle.slurm_id), within_grace=True)
    finally:
        await backend.close()


async def test_a_run_stopped_before_slurm_runs_it_is_cancelled_at_once(backend: SlurmBackend,
                                                                       slurm_env: SlurmCluster) -> None:
    """Slurm signals only running jobs: a pending one is cancelled without waiting its grace."""
    gpus = parse_gres(slurm_env.gres)[0].get("gpu", 0)
    if not gpus:
        pytest.skip("needs a node with GPUs, to hold them all")
    holder = await backend.launch(_spec(["sleep", "300"], resources={"cpu": 1, "gpu": gpus}))
    await _running(slurm_env, holder.slurm_id)
    handle = await backend.launch(_spec(["true"], resources={"cpu": 1, "gpu": 1}, grace_s=600))
    assert slurm_job(slurm_env, handle.slurm_id)["JobState"] == "PENDING"  # every GPU is the holder's

    await asyncio.wait_for(handle.kill(grace_s=600), JOB_TIMEOUT_S)  # not the grace: a bound on a hang

    assert await run_ended(handle) == KILLED_EXIT_CODE
    assert slurm_job(slurm_env, handle.slurm_id)["JobState"] == "CANCELLED"
    await holder.kill(grace_s=1)
    assert await run_ended(holder) == KILLED_EXIT_CODE


# ---------------------------------------------------------------- last: the run with a time limit


async def test_a_run_past_its_time_limit_still_ends_timeout_with_sigterm(
    slurm_env: SlurmCluster, slurm_time_limited_run: TimeLimitedRun,
) -> None:
    """irisfed sets no time limit; a site's partition may. The script, submitted with
    one (``-t 1``, checked by Slurm about every 30 s) before the tests above ran, ends
    TIMEOUT by SIGTERM: -15."""
    run = slurm_time_limited_run
    backend = SlurmBackend(run.work_root, run.peer_id, poll_interval_s=POLL_S)
    try:
        assert await run_ended(backend.follow(run.slurm_id, run.job_id, 1)) == -15
    finally:
        await backend.close()
    assert slurm_job(slurm_env, run.slurm_id)["JobState"] == "TIMEOUT"
    assert (backend.run_dir(run.job_id, 1) / EXIT_STATUS_FILE).read_text() == "-15\n"


WORKSPACE_SCRIPT = ("import os, pathlib; out = pathlib.Path(os.environ['IRISFED_OUTPUT_DIR']); "
                    "out.joinpath('seen.txt').write_text(pathlib.Path('data.txt').read_text() + ' ' + os.getcwd())")


async def test_a_job_runs_in_a_fresh_copy_of_its_workspace_and_leaves_its_outputs(backend: SlurmBackend,
                                                                                  tmp_path: Path) -> None:
    workspace = tmp_path / "cache" / "tree"  # the agent's unpacked cache: never written by the run
    workspace.mkdir(parents=True)
    (workspace / "data.txt").write_text("from the workspace")
    spec = _spec(["python3", "-c", WORKSPACE_SCRIPT], workspace=workspace)
    handle = await backend.launch(spec)
    assert await run_ended(handle) == 0, (Path(handle.log_dir) / "stderr").read_text()
    [(task, outputs)] = backend.output_dirs(spec.job_id, spec.epoch, 1)
    text = (outputs / "seen.txt").read_text()
    assert task == 0 and text == f"from the workspace {Path(handle.log_dir) / 'workspace'}"
    assert sorted(p.name for p in workspace.iterdir()) == ["data.txt"]
