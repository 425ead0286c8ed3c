"""Reachability: when a peer counts as reachable, and when as lost. The one rule.

A peer is *reachable* while its newest heartbeat is younger than its TTL: the TTL
it advertises, capped at the federation's ``heartbeat_ttl_s`` (a peer cannot make
itself look alive for longer than the operator allows). Time is our receipt time,
never the peer's clock. A peer is *lost* once it has been silent for its TTL plus a
grace (``assign_grace_s``): only then may the tick move its live work elsewhere, so a
heartbeat late by a little never costs a running job.

Silence is counted from the newest heartbeat, but never from before the moment the
observing service became healthy (its own outage is not the peers' silence); a peer
never heard counts from that moment, with the federation's TTL.

Postgres decides the same thing where it answers reads (``peer_heartbeat``'s
``expires_at > now()``, written as received + TTL); tests/integration pins the two
together. Who applies it: the router and the tick through their peer view
(``irisfed.services.common.peer_view``), the routing rules through
``FederationPeer.is_reachable``.
"""

from __future__ import annotations

import math

# The federation's defaults (DESIGN §8): an agent says it is alive every 2 s; three
# missed heartbeats make it unreachable; its assigned or running work moves once it
# has been unreachable for another 10 s.
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_HEARTBEAT_TTL_S = 6.0
DEFAULT_ASSIGN_GRACE_S = 10.0


def capped_ttl(advertised_s: float, cap_s: float) -> float:
    """The TTL a heartbeat is judged by: its own, never more than ``cap_s`` (NaN,
    zero and negative values get the cap too)."""
    return advertised_s if 0 < advertised_s <= cap_s else cap_s


def expires_at(heard_at: float, ttl_s: float) -> float:
    """When a peer heard at ``heard_at`` stops being reachable, if it says nothing more."""
    return heard_at + ttl_s


def is_reachable(heard_at: float | None, ttl_s: float, now: float) -> bool:
    """Whether a peer last heard at ``heard_at`` (None: never) is reachable at ``now``."""
    return heard_at is not None and now < expires_at(heard_at, ttl_s)


def silent_since(heard_at: float | None, healthy_since: float) -> float:
    """Where a peer's silence is counted from: its newest heartbeat, never before the
    observer became healthy (``healthy_since``), and from then for a peer never heard."""
    return healthy_since if heard_at is None else max(heard_at, healthy_since)


def is_lost(heard_at: float | None, ttl_s: float, grace_s: float, now: float, healthy_since: float) -> bool:
    """Whether a peer has been silent for its TTL plus ``grace_s``: its live work may move."""
    return now >= expires_at(silent_since(heard_at, healthy_since), ttl_s) + grace_s


def next_expiry(heard: list[tuple[float, float]], now: float) -> float:
    """The soonest moment one of the peers ``(heard_at, ttl_s)`` reachable at ``now``
    stops being so (``inf``: none is reachable)."""
    return min((expires_at(at, ttl) for at, ttl in heard if is_reachable(at, ttl, now)), default=math.inf)
