"""Engine peers of a federation of service processes (tests/e2e/conftest.py's
``federation``): a peer in front of the session's real Slurm cluster (``gpu-west``) or
Ray head (``tpu-east``), and how to look at the engine behind irisfed's back.

Used by tests/e2e/test_engines_e2e.py, test_engine_crashes_e2e.py and
tests/engines/test_preemption_engines.py, test_ray_gangs.py. The engines themselves are
the session's (tests/engines/fixtures.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from irisfed.tooling.engines.slurm import parse_scontrol_line
from tests.infra.configs import make_peer
from tests.infra.groups import groups_of
from tests.infra.waiting import wait_for

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
    # How the engine shows a run its agent stopped. Slurm: FAILED when SIGTERM ended it within
    # its grace (its batch shell ends by the signal, ExitCode 0:15), CANCELLED when scancel
    # ended it (past its grace, or a leftover); Ray: STOPPED (docs/engines.md).
    killed_states: tuple[str, ...]

    def runs_in(self, job_id: str, *states: str) -> list[tuple[str, str, int]] | None:
        """The job's engine runs in one of ``states`` (a probe for ``until``: None when none)."""
        return [run for run in self.runs_of(job_id) if run[1] in states] or None


def slurm_engine(cluster) -> Engine:
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
                  cluster.env, "gpu", runs_of, free, totals, asked, ("FAILED", "CANCELLED"))


def ray_engine(head) -> Engine:
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
                  {}, "tpu", runs_of, free, totals, asked, ("STOPPED",))


def engine_for(request) -> Engine:
    """The engine peer of a fixture parametrised ``params=["slurm", "ray"]``. The test must
    be in its engine's xdist group (tests/conftest.py ``engine_group``): a worker outside
    it would start a second cluster of that engine, which then idles beside the first
    for the rest of the run."""
    groups = groups_of(request.node)
    assert groups == [request.param], f"{request.node.nodeid} is in xdist groups {groups}, not {request.param!r}"
    if request.param == "slurm":
        return slurm_engine(request.getfixturevalue("slurm_cluster"))
    return ray_engine(request.getfixturevalue("ray_head"))


def configure_with_engine(federation, engine: Engine) -> None:
    """home (subprocess, CPU only), the engine peer, and gpu-east, the spare (subprocess,
    with the engine's accelerator) which only starts when a test needs somewhere else to
    run. (Peer ids are those the session's NATS users were made for.)"""
    federation.configure([make_peer("home", "cpu"), make_peer(engine.peer_id, slots=8, backend=engine.kind),
                          make_peer(SPARE, engine.accelerator)])


async def start_with_engine(federation, engine: Engine, agent_env: dict[str, str] | None = None,
                            wait_discovered: bool = True) -> None:
    """Router, tick, home and the engine peer's agent, configured by ``configure_with_engine``."""
    configure_with_engine(federation, engine)
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
    # scenarios judge the engine's real shape (a too-big job must be rejected).
    async def discovered():
        return engine.accelerator in await advertised(federation, engine.peer_id)
    await wait_for(discovered, f"{engine.peer_id} to advertise what its engine has", timeout=60, interval=0.25)


async def until(probe: Callable[[], object], what: str, timeout: float = 120.0):
    """Wait for a probe that asks the engine (a blocking call: run in a thread, twice a second)."""
    async def asked():
        return await asyncio.to_thread(probe)
    return await wait_for(asked, what, timeout=timeout, interval=0.5)


def unique_job_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"  # the engines outlive a test: ids never repeat


async def advertised(federation, peer_id: str) -> dict[str, dict[str, float]]:
    """What ``irisfed peers --json`` says ``peer_id``'s first backend has ({} when unlisted)."""
    listing = await asyncio.to_thread(federation.cli, "peers", "--json")
    peers = {p["peer_id"]: p for p in json.loads(listing.stdout)}
    return peers[peer_id]["backends"][0]["resources"] if peer_id in peers else {}
