"""Factories for rows and messages, with overridable defaults."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import msgspec

from irisfed.services.common.store import Store
from irisfed.services.router.plan import plan_new_job, route
from irisfed.shared.config import FederationConfig, parse_config
from irisfed.shared.federation.router import SubmitDisposition, SubmitPlan
from irisfed.shared.messages import SubmitRequest
from irisfed.shared.records import NewJob

_ids = itertools.count(1)


def make_config(**overrides) -> FederationConfig:
    raw = {
        "local_cluster": "home",
        "heartbeat_interval_s": 0.25,
        "heartbeat_ttl_s": 1.5,
        "tick_interval_s": 0.25,
        "peers": [{"id": "home"}, {"id": "gpu-west"}, {"id": "tpu-east"}],
    }
    raw.update(overrides)
    return parse_config(raw)


def make_job(disposition: str = "queue", pin: str = "", **request_fields) -> NewJob:
    """A job row as the router would build it (default: an unpinned queued job)."""
    body = {"command": ["true"], "job_id": f"job-{next(_ids)}", **request_fields}
    request = msgspec.convert(body, SubmitRequest)
    plan = SubmitPlan(SubmitDisposition(disposition), pinned_peer_id=pin, reason="test")
    job, _ = plan_new_job(request, route(plan, "home", None), body["job_id"])
    return job


def user_job(user: str, job_id: str, **request_fields) -> NewJob:
    """``user``'s queued job ``job_id`` as the router builds it from that user's subject
    (stored as ``<user>:<job_id>``)."""
    request = msgspec.convert({"command": ["true"], "job_id": job_id, **request_fields}, SubmitRequest)
    plan = SubmitPlan(SubmitDisposition("queue"), reason="test")
    job, _ = plan_new_job(request, route(plan, "home", None), job_id, user)
    return job


async def insert_jobs(store: Store, jobs: list[NewJob]) -> None:
    async with store.transaction() as tx:
        await tx.job_insert_batch(jobs)


async def assign_jobs(store: Store, jobs: list[NewJob], peer: str, epoch: int = 0, backend: str = "main") -> list:
    """Place queued ``jobs`` (claimed at ``epoch``) on ``peer``, as the tick's commit does."""
    async with store.transaction() as tx:
        return await tx.job_assign_batch([(j.job_id, epoch, peer, backend) for j in jobs])


async def start_jobs(store: Store, jobs: list[NewJob], peer: str, epoch: int = 1) -> dict:
    """Accept assigned ``jobs`` on ``peer`` (as its agent, through ``store``'s role)."""
    return await store.job_start_batch(peer, [(j.job_id, epoch, None, "started") for j in jobs])


async def running_job(admin: Store, peer: str, agent: Store | None = None, **fields) -> str:
    """A new job assigned to ``peer`` (epoch 1) and accepted by it (through ``agent``'s
    role, else ``admin``'s); its id."""
    job = make_job(**fields)
    await insert_jobs(admin, [job])
    await assign_jobs(admin, [job], peer)
    assert job.job_id in await start_jobs(agent or admin, [job], peer)
    return job.job_id


async def running_jobs(store: Store, count: int, peer: str = "gpu-west") -> list[str]:
    """``count`` new jobs placed on ``peer`` (epoch 1) and accepted there; their ids."""
    jobs = [make_job() for _ in range(count)]
    await insert_jobs(store, jobs)
    await assign_jobs(store, jobs, peer)
    await start_jobs(store, jobs, peer)
    return [j.job_id for j in jobs]


async def advertise(store: Store, peer_id: str, slots: int = 2, run_id: str = "run-1", seq: int = 1,
                    ttl_s: float = 60.0, **attributes: str) -> None:
    backends = [{"name": "main", "attributes": {k: [v] for k, v in attributes.items()},
                 "capacity": {"total": slots, "free": slots}}]
    await store.peer_heartbeat_upsert(peer_id, run_id, seq, backends, ttl_s, datetime.now(UTC))


async def advertise_resources(store: Store, peer_id: str, resources: dict, slots: int = 8,
                              backend: str = "main") -> None:
    """``peer_id`` advertises one backend with ``resources`` ({name: total}, all free)."""
    backends = [{"name": backend, "attributes": {}, "capacity": {"total": slots, "free": slots},
                 "resources": {k: {"total": v, "free": v} for k, v in resources.items()}}]
    await store.peer_heartbeat_upsert(peer_id, "run-1", 1, backends, 60.0, datetime.now(UTC))


class Msg:
    """A NATS message as a service's subscription callback sees it (its subject and data)."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data
