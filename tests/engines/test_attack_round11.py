"""Attack pass, round 11: the engines' run-folder markers and the Ray entrypoint
against a real Slurm cluster and Ray head (tests/engines/fixtures.py)."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import pytest

from irisfed.services.peer_agent.backends import LaunchError, RunSpec
from irisfed.services.peer_agent.backends.ray import RayBackend
from irisfed.services.peer_agent.backends.slurm_text import EXIT_STATUS_FILE, STARTED_MARKER
from irisfed.shared.messages import JOB_ID_PATTERN
from irisfed.tooling.engines.ray import RayHead
from tests.engines.test_slurm_backend import _ended, make_backend, peer_id, slurm_env  # noqa: F401 - fixtures

POLL_S = 0.5


def job_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


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
    """Twelve values of 4096 quotes (~49 KB, a submit may be 64 KB): quoted for the
    shell and encoded it was ~330 KB, which Ray hands its job supervisor's worker as
    one argument: that exec failed (E2BIG), Ray retried it for minutes and failed the
    job as lost (JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE), so it was retried elsewhere."""
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


# ---------------------------------------------------------------- Slurm



async def test_slurm_a_longest_job_id_is_one_run_found_again_by_name(make_backend) -> None:  # noqa: F811
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
    assert await _ended(first) == 3


async def test_slurm_commands_that_trap_term_fork_or_exit_143_end_as_they_said(make_backend) -> None:  # noqa: F811
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
        assert await _ended(handles[name]) == code, name
        folder = Path(handles[name].log_dir)
        assert (folder / EXIT_STATUS_FILE).read_text() == f"{code}\n"
        assert (folder / STARTED_MARKER).read_text().strip() == handles[name].slurm_id
