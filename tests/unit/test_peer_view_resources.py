"""The peer view keeps backends' resources and wakes placement when they free up."""

from datetime import UTC, datetime

from irisfed.services.common.peer_view import PeerView, backends_from_wire
from irisfed.shared.messages import BackendAd, Capacity, Heartbeat, ResourceAmount
from irisfed.shared.resources import Amount
from tests.infra.factories import make_config


def _heartbeat(seq: int, gpu_total: float, gpu_free: float) -> Heartbeat:
    return Heartbeat("gpu-west", seq, datetime.now(UTC), 60.0, [BackendAd(
        "main", {}, Capacity(4, 2), {"gpu": ResourceAmount(gpu_total, gpu_free)})], run_id="r1")


def test_heartbeat_and_stored_backends_carry_resources():
    view = PeerView(make_config(), clock=lambda: 100.0)
    view.apply_heartbeat(_heartbeat(1, 4, 1))
    (peer,) = [p for p in view.peers() if p.peer_id == "gpu-west"]
    assert peer.backends[0].resources == {"gpu": Amount(4, 1)}
    stored = [{"name": "main", "attributes": {}, "capacity": {"total": 4, "free": 2},
               "resources": {"gpu": {"total": 4, "free": 1}}},
              {"name": "old", "attributes": {}, "capacity": {"total": 1, "free": 1}}]
    new, old = backends_from_wire(stored)
    assert new.resources == {"gpu": Amount(4, 1)} and old.resources == {}


def test_freed_resources_and_new_totals_are_placeable():
    view = PeerView(make_config(), clock=lambda: 100.0)
    assert view.apply_heartbeat(_heartbeat(1, 4, 1)).placeable  # appeared
    assert not view.apply_heartbeat(_heartbeat(2, 4, 1)).placeable  # nothing new
    assert not view.apply_heartbeat(_heartbeat(3, 4, 0)).placeable  # less room
    assert view.apply_heartbeat(_heartbeat(4, 4, 3)).placeable  # GPUs freed
    version = view.version
    assert view.apply_heartbeat(_heartbeat(5, 8, 3)).placeable  # a new shape
    assert view.version > version
