"""Heartbeat trust: the subject names the peer, the configuration bounds who and how long.

NATS auth lets agent X publish only on ``<prefix>.heartbeat.X``, so the subject is
the trustworthy part of a heartbeat; its body is what the agent says about itself.
"""

import time
from datetime import UTC, datetime
from types import SimpleNamespace

from prometheus_client.registry import REGISTRY

from irisfed.services.common.peer_view import PeerView
from irisfed.services.router.service import Router
from irisfed.services.tick.service import Tick
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, encoder
from irisfed.shared.records import PeerHeartbeatRow
from tests.infra.factories import make_config


def heartbeat(peer_id: str, seq: int = 1, ttl_s: float = 1.0, device: str = "gpu", free: int = 4,
              total: int = 4, run_id: str = "r1") -> Heartbeat:
    return Heartbeat(peer_id, seq, datetime.now(UTC), ttl_s,
                     [BackendAd("main", {"device_type": [device]}, Capacity(total, free))], run_id=run_id)


def msg(subject_peer: str, body: Heartbeat) -> SimpleNamespace:
    return SimpleNamespace(subject=f"irisfed.heartbeat.{subject_peer}", data=encoder.encode(body), reply="")


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("irisfed_heartbeats_dropped_total", {"reason": reason}) or 0.0


def row(peer_id: str, seq: int, ttl_s: float, age_s: float, received_epoch: float) -> PeerHeartbeatRow:
    at = datetime.fromtimestamp(received_epoch, UTC)
    return PeerHeartbeatRow(peer_id=peer_id, run_id="r1", seq=seq, ttl_s=ttl_s, age_s=age_s,
                            received_epoch=received_epoch, sent_at=at, received_at=at, expires_at=at,
                            reachable=True,
                            backends=[{"name": "main", "attributes": {"device_type": ["gpu"]},
                                       "capacity": {"total": 4, "free": 4}}])


async def test_router_drops_a_heartbeat_naming_another_peer_than_its_subject():
    now = [1000.0]
    router = Router(make_config(), pool=None, nc=None, clock=lambda: now[0])
    before = dropped("subject_mismatch")
    # gpu-west's agent, on its own subject, claims to be tpu-east.
    await router.on_heartbeat(msg("gpu-west", heartbeat("tpu-east", ttl_s=3600)))
    assert "tpu-east" not in router.view.reachable_ids()
    assert "gpu-west" not in router.view.reachable_ids()  # nor is the liar heard as itself
    assert dropped("subject_mismatch") - before == 1
    await router.on_heartbeat(msg("gpu-west", heartbeat("gpu-west")))
    assert router.view.reachable_ids() == ["gpu-west"]


async def test_tick_drops_forged_and_unconfigured_heartbeats_and_persists_neither():
    now = [1000.0]
    tick = Tick(make_config(), pool=None, nc=None, clock=lambda: now[0])
    mismatch, unknown = dropped("subject_mismatch"), dropped("unknown_peer")
    await tick.on_heartbeat(msg("gpu-west", heartbeat("tpu-east")))
    await tick.on_heartbeat(msg("evil", heartbeat("evil")))
    await tick.on_heartbeat(msg("evil", heartbeat("gpu-west")))  # unconfigured subject, configured body
    assert tick.view.reachable_ids() == []
    assert tick.heard == {} and not tick.wake.is_set()
    assert dropped("subject_mismatch") - mismatch == 2
    assert dropped("unknown_peer") - unknown == 1


async def test_malformed_heartbeats_are_counted():
    tick = Tick(make_config(), pool=None, nc=None, clock=lambda: 1000.0)
    before = dropped("malformed")
    await tick.on_heartbeat(SimpleNamespace(subject="irisfed.heartbeat.gpu-west", data=b"{nope", reply=""))
    assert dropped("malformed") - before == 1


async def test_ttl_is_capped_at_the_configured_heartbeat_ttl_and_persisted_capped():
    now = [1000.0]
    tick = Tick(make_config(), pool=None, nc=None, clock=lambda: now[0])  # heartbeat_ttl_s = 1.5
    await tick.on_heartbeat(msg("gpu-west", heartbeat("gpu-west", ttl_s=3600)))
    assert tick.view.reachable_ids() == ["gpu-west"]
    assert tick.heard["gpu-west"][0].ttl_s == 1.5  # what the tick writes to peer_heartbeat
    now[0] = 1001.6
    assert tick.view.reachable_ids() == []


def test_ttl_of_rows_is_capped_too():
    now = [1000.0]
    view = PeerView(make_config(), clock=lambda: now[0])
    view.apply_rows([row("gpu-west", 1, ttl_s=3600, age_s=0.0, received_epoch=1000.0)])
    assert view.reachable_ids() == ["gpu-west"]
    now[0] = 1001.6
    assert view.reachable_ids() == []
    assert view.peers()[1].ttl_s == 1.5


def test_row_ages_come_from_the_database_not_from_its_wall_clock():
    # The database host's wall clock says 1970; only the age (db now() - received_at)
    # counts, placed on this service's own clock.
    now = [1000.0]
    view = PeerView(make_config(), clock=lambda: now[0])
    view.apply_rows([row("gpu-west", 1, ttl_s=1.5, age_s=0.5, received_epoch=5.0)])
    now[0] = 1000.9
    assert view.reachable_ids() == ["gpu-west"]
    now[0] = 1001.1  # heard 1.6 s ago
    assert view.reachable_ids() == []


def test_in_memory_ages_use_the_monotonic_clock_by_default():
    assert Tick(make_config(), pool=None, nc=None).view.clock is time.monotonic
    assert Router(make_config(), pool=None, nc=None).view.clock is time.monotonic


async def test_only_heartbeats_that_could_place_work_wake_the_tick():
    now = [1000.0]
    tick = Tick(make_config(), pool=None, nc=None, clock=lambda: now[0])

    async def hear(hb: Heartbeat) -> bool:
        tick.wake.clear()
        await tick.on_heartbeat(msg(hb.peer_id, hb))
        return tick.wake.is_set()

    assert await hear(heartbeat("gpu-west", 1, free=2))  # appeared
    version = tick.view.version
    now[0] += 0.25
    assert not await hear(heartbeat("gpu-west", 2, free=2))  # nothing changed
    assert tick.view.version == version
    assert "gpu-west" in tick.heard and tick.heard["gpu-west"][0].seq == 2  # still persisted
    assert await hear(heartbeat("gpu-west", 3, free=3))  # a slot freed
    assert not await hear(heartbeat("gpu-west", 4, free=1))  # fuller: nothing more to place
    assert tick.view.version > version  # the router's plan cache still sees every change
    assert await hear(heartbeat("gpu-west", 5, free=1, device="tpu"))  # new shape
    assert not await hear(heartbeat("gpu-west", 6, free=1, device="tpu", run_id="r2"))  # restart, same shape
    now[0] += 10  # silent past its TTL ...
    assert await hear(heartbeat("gpu-west", 7, free=1, device="tpu", run_id="r2"))  # ... and back
