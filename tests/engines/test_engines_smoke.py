"""The engines the backends will run on answer the way their docstrings say
(``tooling/engines/slurm.py``, ``tooling/engines/ray.py``)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from irisfed.tooling.engines.procs import wait_until
from irisfed.tooling.engines.ray import RayHead
from irisfed.tooling.engines.slurm import TERMINAL_STATES, SlurmCluster

# Bounds on a hang of a slow shared machine, not expectations: a trivial job takes
# ~3 s on either engine, Ray's very first one up to ~20 s.
JOB_TIMEOUT_S = 180.0


def _gpu_request(node_gres: str) -> str:
    """One GPU of the node's first GPU type: ``gpu:h100:1`` (or ``gpu:1`` untyped)."""
    match = re.search(r"gpu:(?:([^:,(]+):)?\d+", node_gres)
    if match is None:
        pytest.skip(f"the Slurm node has no GPU GRES (Gres={node_gres or 'none'})")
    return f"gpu:{match.group(1)}:1" if match.group(1) else "gpu:1"


def _sbatch(cluster: SlurmCluster, folder: Path, *args: str) -> str:
    out = cluster.run("sbatch", "--parsable", "-D", str(folder), *args)
    return out.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def _ended(cluster: SlurmCluster, job_id: str) -> dict[str, str] | None:
    job = cluster.job(job_id)
    return job if job is not None and job["JobState"] in TERMINAL_STATES else None


def test_slurm_gpu_job_runs_to_completion_with_its_tres(
    slurm_cluster: SlurmCluster, tmp_path: Path,
) -> None:
    gpu = _gpu_request(slurm_cluster.gres)
    out = tmp_path / "job.out"
    job_id = _sbatch(
        slurm_cluster, tmp_path, "-J", "irisfed-smoke", "-o", str(out), f"--gres={gpu}",
        "-c", "1", "--mem", "100", "--wrap", "echo gpus=$CUDA_VISIBLE_DEVICES",
    )

    submitted = slurm_cluster.job(job_id)
    # Slurm 22.05 writes "gres:gpu:h100:1", 23.02 and later "gres/gpu:h100:1".
    assert re.fullmatch(r"gres[:/]" + re.escape(gpu), submitted["TresPerNode"]), submitted
    assert {"cpu=1", "mem=100M"} <= set(submitted["TRES"].split(",")), submitted

    final = wait_until(lambda: _ended(slurm_cluster, job_id), f"Slurm job {job_id} to end",
                       JOB_TIMEOUT_S)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), final
    assert re.fullmatch(r"gpus=\d+", out.read_text().strip())


def test_slurm_cancel_ends_a_running_job_as_cancelled(
    slurm_cluster: SlurmCluster, tmp_path: Path,
) -> None:
    job_id = _sbatch(slurm_cluster, tmp_path, "-o", "/dev/null", "-c", "1", "--mem", "100",
                     "--wrap", "sleep 600")
    wait_until(lambda: slurm_cluster.job(job_id)["JobState"] == "RUNNING",
               f"Slurm job {job_id} to run", JOB_TIMEOUT_S)
    queued = slurm_cluster.run("squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", job_id)
    assert queued.split() == [f"{job_id}|RUNNING"]

    slurm_cluster.run("scancel", job_id)

    final = wait_until(lambda: _ended(slurm_cluster, job_id), f"Slurm job {job_id} to end",
                       JOB_TIMEOUT_S)
    # scancel's SIGTERM reaches the batch shell and its `sleep` together: the shell either
    # dies by the signal ("0:15") or sees its child killed and exits 128 + 15 ("143:0").
    assert final["JobState"] == "CANCELLED" and final["ExitCode"] in ("0:15", "143:0"), final


def _custom_resource(head: RayHead) -> str:
    if not head.resources:
        pytest.skip("the Ray cluster has no custom resource")
    return sorted(head.resources)[0]


def test_ray_job_with_a_custom_resource_runs_and_its_logs_come_back(ray_head: RayHead) -> None:
    from ray.job_submission import JobStatus

    resource = _custom_resource(ray_head)
    client = ray_head.job_client()
    submission_id = f"irisfed-smoke-{uuid.uuid4().hex[:8]}"
    client.submit_job(
        entrypoint="echo smoke-$IRISFED_SMOKE", submission_id=submission_id,
        entrypoint_num_cpus=1, entrypoint_resources={resource: 1},
        runtime_env={"env_vars": {"IRISFED_SMOKE": "ok"}}, metadata={"irisfed": "smoke"},
    )

    wait_until(lambda: client.get_job_status(submission_id).is_terminal(),
               f"Ray job {submission_id} to end", JOB_TIMEOUT_S)
    info = client.get_job_info(submission_id)
    assert (info.status, info.driver_exit_code) == (JobStatus.SUCCEEDED, 0), info.message
    assert info.metadata == {"irisfed": "smoke"}
    assert "smoke-ok" in client.get_job_logs(submission_id)
    assert submission_id in {job.submission_id for job in client.list_jobs()}


def test_ray_job_holds_its_resource_while_running_and_stop_ends_it(ray_head: RayHead) -> None:
    from ray.job_submission import JobStatus

    resource = _custom_resource(ray_head)
    client = ray_head.job_client()
    submission_id = f"irisfed-hold-{uuid.uuid4().hex[:8]}"
    client.submit_job(entrypoint="echo holding; sleep 600", submission_id=submission_id,
                      entrypoint_resources={resource: 1})

    wait_until(lambda: client.get_job_status(submission_id) == JobStatus.RUNNING,
               f"Ray job {submission_id} to run", JOB_TIMEOUT_S)
    # The usage report is refreshed every few seconds: it may lag the job's start.
    _, total = wait_until(
        lambda: (u := ray_head.usage()[resource])[0] >= 1 and u,
        f"{resource} to show as used", JOB_TIMEOUT_S,
    )
    assert total == ray_head.resources[resource]

    assert client.stop_job(submission_id)
    wait_until(lambda: client.get_job_status(submission_id).is_terminal(),
               f"Ray job {submission_id} to end", JOB_TIMEOUT_S)
    info = client.get_job_info(submission_id)
    assert (info.status, info.driver_exit_code) == (JobStatus.STOPPED, None), info.message
    assert "holding" in client.get_job_logs(submission_id)


async def test_chromium_renders_a_page_and_reports_console_errors(chromium):
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.connect_over_cdp(chromium.endpoint)
        context = await browser.new_context()
        page = await context.new_page()
        errors = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        await page.set_content("<p id=x>hello</p><script>console.error('boom')</script>")
        assert await page.text_content("#x") == "hello"
        await page.wait_for_function("true")
        assert errors == ["boom"]
        await context.close()
