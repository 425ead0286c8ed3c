"""Every run on an engine backend sees ``IRISFED_RESOURCES`` (docs/design.md §3.7), and
the engine is asked for its devices so that it binds them: Slurm's batch script exports
the variable (its ``--gres`` comes from ``resource_args``), Ray's submission carries it
in the runtime env with ``entrypoint_num_gpus`` (a gang: in each task's environment,
``GPU`` in each task's bundle). Pure: scripts written and submissions built, no engine."""

from __future__ import annotations

import base64
import json
import time
from types import SimpleNamespace

from irisfed.services.peer_agent.backends import Discovered, RunSpec
from irisfed.services.peer_agent.backends import ray_gang as driver
from irisfed.services.peer_agent.backends.ray import RayBackend
from irisfed.services.peer_agent.backends.ray_capacity import ClusterReport
from irisfed.services.peer_agent.backends.ray_text import ENV_VARIABLE
from irisfed.services.peer_agent.backends.slurm import SlurmBackend
from irisfed.services.peer_agent.backends.slurm_script import (
    TASK_SCRIPT,
    GangFile,
    resource_args,
    slurm_request,
)

ASKED = {"cpu": 1, "gpu": 2}
EXPORTED = """export IRISFED_RESOURCES='{"cpu":1,"gpu":2}'"""


def test_a_slurm_run_exports_what_it_asked_and_asks_slurm_for_the_gpus(tmp_path):
    backend = SlurmBackend(tmp_path, "hpc")
    spec = RunSpec("j", 1, ["true"], env={"IRISFED_RESOURCES": "forged"}, resources=ASKED)
    script = backend._write_script(spec).read_text()
    assert EXPORTED in script and "forged" not in script
    assert "--gres=gpu:2" in resource_args(slurm_request(ASKED, 1024))
    gang = RunSpec("g", 1, ["true"], resources=ASKED, replicas=2)
    backend._write_script(gang, GangFile(2, 30.0, time.time() + 30))
    assert EXPORTED in (tmp_path / "g" / "epoch-1" / TASK_SCRIPT).read_text()  # each task's wrapper


def test_a_ray_run_carries_what_it_asked_and_asks_ray_for_the_gpus(tmp_path):
    backend = SimpleNamespace(run_dir=lambda job_id, epoch: tmp_path / job_id / f"epoch-{epoch}", python="python3")
    report = ClusterReport(Discovered())
    single = RayBackend._submission(backend, RunSpec("j", 1, ["true"], resources=ASKED), report)
    assert single["entrypoint_num_gpus"] == 2 and single["entrypoint_num_cpus"] == 1
    env_script = base64.b64decode(single["runtime_env"]["env_vars"][ENV_VARIABLE]).decode()
    assert EXPORTED in env_script

    gang = RayBackend._submission(backend, RunSpec("g", 1, ["true"], resources=ASKED, replicas=2), report)
    run = json.loads(base64.b64decode(gang["runtime_env"]["env_vars"][driver.SPEC_VARIABLE]))
    assert run["env"]["IRISFED_RESOURCES"] == '{"cpu":1,"gpu":2}'
    assert run["bundle"]["GPU"] == 2  # each task's num_gpus: Ray sets its CUDA_VISIBLE_DEVICES
