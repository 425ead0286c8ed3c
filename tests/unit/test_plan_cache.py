"""The router's routing-decision cache: reused, but never a decision it would not take now."""

from datetime import UTC, datetime

import msgspec

from irisfed.services.router.service import Router
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, SubmitRequest
from tests.infra.factories import make_config

GPU_JOB = msgspec.convert({"command": ["train"], "constraints": [
    {"key": "device_type", "op": "eq", "value": "gpu"}]}, SubmitRequest)


def heartbeat(peer_id: str, seq: int, device: str = "gpu", ttl_s: float = 6.0) -> Heartbeat:
    return Heartbeat(peer_id, seq, datetime.now(UTC), ttl_s,
                     [BackendAd("main", {"device_type": [device]}, Capacity(4, 4))], run_id="r1")


def make_router(now: list[float]) -> Router:
    # Heartbeats here advertise ttl_s=6; TTLs are capped at the configured one.
    router = Router(make_config(heartbeat_ttl_s=6.0), pool=None, nc=None, clock=lambda: now[0])
    router.view.apply_heartbeat(heartbeat("home", 1, device="cpu"))
    return router


def test_a_decision_is_reused_until_the_peer_it_relied_on_expires():
    now = [1000.0]
    router = make_router(now)
    router.view.apply_heartbeat(heartbeat("gpu-west", 1))
    first = router._route(GPU_JOB)
    assert first.plan.disposition == "queue"
    now[0] = 1000.9
    assert router._route(GPU_JOB) is first  # reused: nothing changed
    now[0] = 1005.9
    assert router._route(GPU_JOB).plan.disposition == "queue"
    now[0] = 1006.0  # gpu-west's heartbeat is now as old as its TTL
    assert router._route(GPU_JOB).plan.disposition == "reject"


def test_a_change_of_shape_or_a_returning_peer_drops_the_decision():
    now = [1000.0]
    router = make_router(now)
    router.view.apply_heartbeat(heartbeat("gpu-west", 1, device="tpu"))
    assert router._route(GPU_JOB).plan.disposition == "reject"
    router.view.apply_heartbeat(heartbeat("gpu-west", 2, device="gpu"))  # same moment, new shape
    assert router._route(GPU_JOB).plan.disposition == "queue"


def gpu_west_heard_at_990_and_gone_at(now_s: float) -> Router:
    """A router that heard gpu-west at 990 s (TTL 6 s) and, at ``now_s``, holds it gone:
    a GPU job is rejected."""
    now = [980.0]
    router = make_router(now)
    router.view.apply_heartbeat(heartbeat("gpu-west", 1), received_at=990.0)
    now[0] = now_s
    assert router._route(GPU_JOB).plan.disposition == "reject"
    return router


def test_regaining_the_control_plane_redecides():
    router = gpu_west_heard_at_990_and_gone_at(996.5)  # heard 6.5 s ago, TTL 6 s
    router.view.mark_healthy()  # NATS back: peers get a full TTL from now
    assert router._route(GPU_JOB).plan.disposition == "queue"


def test_a_peer_back_through_a_lagging_row_redecides():
    # Postgres rows carry their own (older) receive time: the gap to the previous
    # advertisement can be under the TTL although that one had already expired.
    router = gpu_west_heard_at_990_and_gone_at(997.0)  # expired at 996
    router.view.apply_heartbeat(heartbeat("gpu-west", 2), received_at=995.0)  # reachable until 1001
    assert router._route(GPU_JOB).plan.disposition == "queue"
