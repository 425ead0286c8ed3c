"""Factories for rows and messages, with overridable defaults."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import msgspec

from irisfed.services.common.store import Store
from irisfed.services.router.plan import plan_new_job, route
from irisfed.services.tick.service import Tick
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
    # Zero-padded: jobs stored in one transaction share a submit time and tie on the id's
    # text order, which is then their creation order ("job-10" < "job-9" would not be).
    body = {"command": ["true"], "job_id": f"job-{next(_ids):06d}", **request_fields}
    request = msgspec.convert(body, SubmitRequest)
    plan = SubmitPlan(SubmitDisposition(disposition), pinned_peer_id=pin, reason="test")
    job, _ = plan_new_job(request, route(plan, "home", None), body["job_id"])
    return job


def banded_job(band: str = "interactive", cpu: float = 1, user: str = "default", **request_fields) -> NewJob:
    """A queued job of ``band`` asking ``cpu`` CPUs; ``user``'s (stored as
    ``<user>:<job_id>``) unless the default user."""
    job = make_job(resources={"cpu": cpu}, band=band, **request_fields)
    if user != "default":
        job = msgspec.structs.replace(job, user_id=user, job_id=f"{user}:{job.job_id}")
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


async def start_in_order(store: Store, jobs: list[NewJob], peer: str = "gpu-west") -> None:
    """Insert, assign and start ``jobs`` on ``peer``, one at a time (their start order is theirs)."""
    await insert_jobs(store, jobs)
    for j in jobs:
        await assign_jobs(store, [j], peer)
        assert j.job_id in await start_jobs(store, [j], peer)


async def tick_for(pool, **config) -> Tick:
    """A tick on ``pool`` (no NATS) with ``make_config(**config)``, heartbeats trusted for
    two minutes, its view of the peers read."""
    tick = Tick(make_config(heartbeat_ttl_s=120.0, **config), pool, None)
    await tick.refresh_view()
    return tick


async def preempt(store: Store, victims: list[NewJob], preemptor: NewJob, peer: str = "gpu-west") -> None:
    """What the tick's commit does: lock the running ``victims`` (epoch 1), preempt them for
    ``preemptor`` and place it on ``peer`` with the history detail naming them."""
    async with store.transaction() as tx:
        locked = await tx.job_lock_victims([(v.job_id, "running", 1, peer) for v in victims])
        assert locked == {v.job_id for v in victims}
        moved = await tx.job_preempt_batch([(v.job_id, "running", 1, peer, preemptor.job_id) for v in victims])
        assert len(moved) == len(victims)
        detail = "placed; preempted " + ", ".join(v.job_id for v in victims)
        assert await tx.job_assign_batch([(preemptor.job_id, 0, peer, "main")], {preemptor.job_id: detail})


async def running_job(admin: Store, peer: str, agent: Store | None = None, **fields) -> str:
    """A new job assigned to ``peer`` (epoch 1) and accepted by it (through ``agent``'s
    role, else ``admin``'s); its id."""
    job = make_job(**fields)
    await insert_jobs(admin, [job])
    await assign_jobs(admin, [job], peer)
    assert job.job_id in await start_jobs(agent or admin, [job], peer)
    return job.job_id


async def start_all(store: Store, jobs: list[NewJob], peer: str = "gpu-west") -> None:
    """Insert ``jobs`` and take them to running on ``peer`` (epoch 1; batched, with their changelog)."""
    await insert_jobs(store, jobs)
    await assign_jobs(store, jobs, peer)
    await start_jobs(store, jobs, peer)


async def running_jobs(store: Store, count: int, peer: str = "gpu-west") -> list[str]:
    """``count`` new jobs placed on ``peer`` (epoch 1) and accepted there; their ids."""
    jobs = [make_job() for _ in range(count)]
    await start_all(store, jobs, peer)
    return [j.job_id for j in jobs]


async def advertise(store: Store, peer_id: str, slots: int = 2, run_id: str = "run-1", seq: int = 1,
                    ttl_s: float = 60.0, **attributes: str) -> None:
    backends = [{"name": "main", "attributes": {k: [v] for k, v in attributes.items()},
                 "capacity": {"total": slots, "free": slots}}]
    await store.peer_heartbeat_upsert(peer_id, run_id, seq, backends, ttl_s, datetime.now(UTC))


async def advertise_resources(store: Store, peer_id: str, resources: dict, slots: int = 8,
                              backend: str = "main", seq: int = 1) -> None:
    """``peer_id`` advertises one backend with ``resources`` ({name: total}, all free)."""
    backends = [{"name": backend, "attributes": {}, "capacity": {"total": slots, "free": slots},
                 "resources": {k: {"total": v, "free": v} for k, v in resources.items()}}]
    await store.peer_heartbeat_upsert(peer_id, "run-1", seq, backends, 60.0, datetime.now(UTC))


async def advertise_cpus(store: Store, peer_id: str = "gpu-west", cpus: int = 4, slots: int = 8,
                         seq: int = 1) -> None:
    """``peer_id`` advertises ``cpus`` free CPUs and ``slots`` free slots."""
    await advertise_resources(store, peer_id, {"cpu": cpus}, slots, seq=seq)


class Msg:
    """A NATS message as a service's subscription callback sees it (its subject and data)."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data
