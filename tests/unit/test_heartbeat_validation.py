"""A heartbeat Postgres could not store is malformed.

A ``seq`` beyond a bigint, or a ``sent_at`` that overflows once put in UTC, is dropped
on receipt by every view, counted as malformed: stored, it would fail the tick's whole
batch write of heartbeats, and kept as the newest in a router's view it would lock the
peer's later heartbeats of the same run out (none has a larger ``seq``). The extremes
Postgres can store are still heard."""

from __future__ import annotations

import pytest
from prometheus_client.registry import REGISTRY

from irisfed.services.common.log import EventLogger
from irisfed.services.common.peer_view import PeerView
from tests.infra.factories import make_config

log = EventLogger("test")


def _beat(seq: str, sent_at: str = '"2026-01-01T00:00:00Z"', run: str = "r1") -> bytes:
    return (f'{{"peer_id":"gpu-west","seq":{seq},"sent_at":{sent_at},"ttl_s":1.5,"backends":[{{"name":"main",'
            f'"attributes":{{}},"capacity":{{"total":4,"free":4}}}}],"run_id":"{run}"}}').encode()


def _malformed() -> float:
    return REGISTRY.get_sample_value("irisfed_heartbeats_dropped_total", {"reason": "malformed"}) or 0.0


@pytest.mark.parametrize("seq,sent_at", [
    (str(2**63), '"2026-01-01T00:00:00Z"'),
    (str(2**64), '"2026-01-01T00:00:00Z"'),
    (str(-(2**63) - 1), '"2026-01-01T00:00:00Z"'),
    ("1", '"9999-12-31T23:59:59-14:00"'),
    ("1", '"0001-01-01T00:00:00+00:01"'),
])
def test_an_unstorable_heartbeat_is_dropped_and_the_next_honest_one_is_heard(seq, sent_at):
    now = [1000.0]
    view = PeerView(make_config(), clock=lambda: now[0])
    subject = view.config.subjects.heartbeat("gpu-west")
    before = _malformed()
    heartbeat, change = view.receive(subject, _beat(seq, sent_at), log)
    assert heartbeat is None and not change
    assert _malformed() - before == 1
    assert view.reachable_ids() == []
    heartbeat, change = view.receive(subject, _beat("2"), log)  # same run, an ordinary seq
    assert heartbeat is not None and change.recorded
    assert view.reachable_ids() == ["gpu-west"]


@pytest.mark.parametrize("seq,sent_at", [
    (str(2**63 - 1), '"2026-01-01T00:00:00Z"'),
    (str(-(2**63)), '"2026-01-01T00:00:00Z"'),
    ("1", '"9999-12-31T23:59:59Z"'),
    ("1", '"0001-01-01T00:00:00Z"'),
    ("1", '"2026-01-01T00:00:00"'),
])
def test_the_storable_extremes_are_still_heard(seq, sent_at):
    view = PeerView(make_config(), clock=lambda: 1000.0)
    heartbeat, change = view.receive(view.config.subjects.heartbeat("gpu-west"), _beat(seq, sent_at), log)
    assert heartbeat is not None and change.recorded
    assert view.reachable_ids() == ["gpu-west"]
