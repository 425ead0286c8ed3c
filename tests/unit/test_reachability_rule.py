"""The reachability rule (``irisfed.shared.reachability``): when a peer is reachable,
when lost, and that the router's peers and the peer view judge by it."""

from __future__ import annotations

import math

import pytest

from irisfed.shared.config import FederationConfig, parse_config
from irisfed.shared.federation.peer import FederationPeer
from irisfed.shared.reachability import (
    DEFAULT_ASSIGN_GRACE_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TTL_S,
    capped_ttl,
    is_lost,
    is_reachable,
    next_expiry,
)


@pytest.mark.parametrize(("age", "reachable"), [(0.0, True), (5.999, True), (6.0, False), (60.0, False)])
def test_a_peer_is_reachable_while_its_heartbeat_is_younger_than_its_ttl(age, reachable):
    assert is_reachable(100.0 - age, 6.0, now=100.0) is reachable
    assert FederationPeer("p", last_heartbeat_at=100.0 - age, ttl_s=6.0).is_reachable(100.0) is reachable


def test_a_peer_never_heard_is_unreachable():
    assert not is_reachable(None, 6.0, now=0.0)
    assert not FederationPeer("p").is_reachable(0.0)


@pytest.mark.parametrize(("advertised", "judged"), [(3.0, 3.0), (6.0, 6.0), (600.0, 6.0), (0.0, 6.0),
                                                    (-1.0, 6.0), (math.nan, 6.0), (math.inf, 6.0)])
def test_a_peer_cannot_advertise_itself_alive_for_longer_than_the_federation_allows(advertised, judged):
    assert capped_ttl(advertised, 6.0) == judged


def test_lost_is_unreachable_for_a_grace_longer():
    heard = 100.0
    assert not is_lost(heard, 6.0, 10.0, now=115.9, healthy_since=0.0)
    assert is_lost(heard, 6.0, 10.0, now=116.0, healthy_since=0.0)


def test_silence_is_not_counted_from_before_the_observer_was_healthy():
    # Heard long ago, but the observer itself was down until 200: a full TTL + grace from 200.
    assert not is_lost(100.0, 6.0, 10.0, now=215.0, healthy_since=200.0)
    assert is_lost(100.0, 6.0, 10.0, now=216.0, healthy_since=200.0)
    # Never heard: counted from the observer's health too.
    assert not is_lost(None, 6.0, 10.0, now=215.0, healthy_since=200.0)
    assert is_lost(None, 6.0, 10.0, now=216.0, healthy_since=200.0)


def test_the_next_expiry_is_the_soonest_among_reachable_peers():
    assert next_expiry([(100.0, 6.0), (101.0, 2.0), (90.0, 6.0)], now=102.0) == 103.0
    assert next_expiry([(90.0, 6.0)], now=102.0) == math.inf


def test_defaults_are_defined_once_and_used_by_the_configuration():
    config = parse_config({"peers": [{"id": "home"}]})
    assert (config.heartbeat_interval_s, config.heartbeat_ttl_s, config.assign_grace_s) == (
        DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TTL_S, DEFAULT_ASSIGN_GRACE_S)
    assert FederationConfig(peers=()).heartbeat_ttl_s == DEFAULT_HEARTBEAT_TTL_S
    assert FederationPeer("p").ttl_s == DEFAULT_HEARTBEAT_TTL_S
