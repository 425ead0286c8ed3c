"""The routing view of the federation's peers, fed by heartbeats (NATS and Postgres)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from shared.config import FederationConfig
from shared.federation.peer import Backend, FederationPeer
from shared.messages import Heartbeat


@dataclass(frozen=True, slots=True)
class _Advert:
    run_id: str
    seq: int
    backends: tuple[Backend, ...]
    ttl_s: float
    received_at: float


def backends_from_wire(backends: Iterable[Mapping]) -> tuple[Backend, ...]:
    """Heartbeat backends (decoded JSON) → Backend values."""
    return tuple(
        Backend(
            name=b["name"],
            attributes={k: tuple(v) for k, v in b["attributes"].items()},
            total=b["capacity"]["total"],
            free=b["capacity"]["free"],
        )
        for b in backends
    )


class PeerView:
    """Newest advertisement per configured peer; unconfigured peers are ignored."""

    def __init__(self, config: FederationConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        # Computed once: every heartbeat is checked against them.
        self._peer_ids = config.peer_ids
        self._known = frozenset(self._peer_ids)
        self._adverts: dict[str, _Advert] = {}
        # Bumped whenever an advertisement could change a routing decision (a peer
        # appears, returns, or changes shape); caches of decisions key on it.
        self.version = 0
        # When this service last (re)gained its view of the world: start, NATS
        # reconnect, Postgres back after an outage.
        self.healthy_since = clock()

    def mark_healthy(self) -> None:
        """The control plane just came back: judge peers' TTLs from now on."""
        self.healthy_since = self.clock()
        self.version += 1  # peers may count as reachable again: decisions must be redone

    def next_expiry(self, now: float, since_healthy: bool = False) -> float:
        """The soonest moment a peer reachable at ``now`` stops being so (inf: none is).

        Between version changes, reachability only changes by expiring, so a routing
        decision taken now stays right until then.
        """
        soonest = float("inf")
        for advert in self._adverts.values():
            heard = max(advert.received_at, self.healthy_since) if since_healthy else advert.received_at
            expires = heard + advert.ttl_s
            if now < expires < soonest:
                soonest = expires
        return soonest

    def _accept(self, peer_id: str, advert: _Advert) -> bool:
        if peer_id not in self._known:
            return False
        current = self._adverts.get(peer_id)
        newer = (
            current is None
            or advert.run_id != current.run_id and advert.received_at >= current.received_at
            or advert.run_id == current.run_id and advert.seq > current.seq
        )
        if newer:
            if (current is None or current.backends != advert.backends
                    or advert.received_at - current.received_at >= current.ttl_s
                    or self.clock() - current.received_at >= current.ttl_s):  # it had expired: back
                self.version += 1
            self._adverts[peer_id] = advert
        return newer

    def apply_heartbeat(self, heartbeat: Heartbeat, received_at: float | None = None) -> bool:
        """Record a heartbeat received now (our clock); False when old or unconfigured."""
        backends = tuple(
            Backend(b.name, {k: tuple(v) for k, v in b.attributes.items()},
                    b.capacity.total, b.capacity.free)
            for b in heartbeat.backends
        )
        advert = _Advert(heartbeat.run_id, heartbeat.seq, backends, heartbeat.ttl_s,
                         self.clock() if received_at is None else received_at)
        return self._accept(heartbeat.peer_id, advert)

    def apply_rows(self, rows: Iterable[Mapping]) -> None:
        """Merge ``peer_heartbeat`` rows (what other services' peers told Postgres)."""
        for row in rows:
            advert = _Advert(row["run_id"], row["seq"], backends_from_wire(row["backends"]),
                             row["ttl_s"], row["received_epoch"])
            self._accept(row["peer_id"], advert)

    def peers(self, since_healthy: bool = False) -> list[FederationPeer]:
        """Every configured peer with its newest advertisement, for PeerRouter.

        With ``since_healthy``, a heartbeat counts as received no earlier than
        ``healthy_since``: when this service (or its NATS/Postgres) was the one that
        was down, peers get a full TTL to be heard again before they are judged lost.
        """
        result = []
        for peer_id in self._peer_ids:
            advert = self._adverts.get(peer_id)
            if advert is None:
                result.append(FederationPeer(peer_id, ttl_s=self.config.heartbeat_ttl_s))
                continue
            heard = max(advert.received_at, self.healthy_since) if since_healthy else advert.received_at
            result.append(FederationPeer(peer_id, advert.backends, heard, advert.ttl_s))
        return result

    def local_backends(self) -> tuple[Backend, ...]:
        """The local cluster's advertised shape (newest heartbeat, stale or not)."""
        advert = self._adverts.get(self.config.local_cluster)
        return advert.backends if advert else ()

    def reachable_ids(self, since_healthy: bool = False) -> list[str]:
        now = self.clock()
        return [p.peer_id for p in self.peers(since_healthy) if p.is_reachable(now)]
