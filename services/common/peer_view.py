"""The routing view of the federation's peers, fed by heartbeats (NATS and Postgres).

Trust: NATS auth lets agent X publish only on ``<prefix>.heartbeat.X``, so the
subject names the peer. A heartbeat whose body names another peer, or a peer not
in the configuration, is dropped (and counted); a peer's ``ttl_s`` never exceeds
the configured ``heartbeat_ttl_s``.

Time: ages are kept on this service's own monotonic clock. Heartbeats heard on NATS
are stamped with it on receipt; ``peer_heartbeat`` rows carry their age as Postgres
computes it (``now() - received_at``), so neither host's wall clock, nor a jump of
it, decides whether a peer is reachable or lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC
from enum import StrEnum

import msgspec

from irisfed.services.common import metrics
from irisfed.services.common.log import EventLogger
from irisfed.shared.config import FederationConfig
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.messages import BackendAd, Heartbeat, decode_internal
from irisfed.shared.nodes import NodePool, parse_node_groups
from irisfed.shared.reachability import capped_ttl, is_lost, is_reachable, next_expiry, silent_since
from irisfed.shared.records import PeerHeartbeatRow
from irisfed.shared.resources import Amount


class HeartbeatDrop(StrEnum):
    """Why a heartbeat was dropped (the label of irisfed_heartbeats_dropped_total): append only."""

    MALFORMED = "malformed"
    SUBJECT_MISMATCH = "subject_mismatch"  # the body names another peer than its subject
    UNKNOWN_PEER = "unknown_peer"  # not in the configuration


@dataclass(frozen=True, slots=True)
class _Advert:
    run_id: str
    seq: int
    backends: tuple[Backend, ...]
    ttl_s: float
    received_at: float


@dataclass(frozen=True, slots=True)
class Change:
    """What one advertisement did to the view (true when it was recorded)."""

    recorded: bool = False  # newer than what the view had: now the peer's advertisement
    # It may let queued work be placed: the peer appeared or came back, changed shape
    # (backends, attributes, totals), or advertises more free slots or resources than before.
    placeable: bool = False

    def __bool__(self) -> bool:
        return self.recorded


UNCHANGED = Change()

# What a ``peer_heartbeat`` row can hold (its ``seq`` is a bigint).
_BIGINT = range(-(2**63), 2**63)


def _unstorable(heartbeat: Heartbeat) -> str:
    """Why Postgres could not store ``heartbeat`` ("" when it can). The wire's ints are
    unbounded and its times may carry any offset; one such heartbeat in the tick's
    batch write failed the whole statement, for every peer's heartbeat in it, again
    at every retry."""
    if heartbeat.seq not in _BIGINT:
        return "seq out of range"
    try:
        heartbeat.sent_at.astimezone(UTC)
    except (OverflowError, ValueError):
        return "sent_at out of range"
    return ""


def _shape(backends: tuple[Backend, ...]) -> tuple:
    return tuple((b.name, tuple(sorted(b.attributes.items())), b.total,
                  tuple(sorted((name, amount.total) for name, amount in b.resources.items())), b.discovering,
                  _node_shapes(b))
                 for b in backends)


def _node_shapes(backend: Backend) -> tuple:
    """How many nodes of each shape (attributes, totals) a backend has."""
    shapes: dict[tuple, int] = {}
    for c in backend.nodes:
        shapes[(c.attributes, c.total)] = shapes.get((c.attributes, c.total), 0) + c.count
    return tuple(sorted(shapes.items()))


def _more_room(old: tuple[Backend, ...], new: tuple[Backend, ...]) -> bool:
    """Could ``new`` place something ``old`` could not? (A new shape, a slot, a resource or
    a node's room freed.)"""
    if _shape(old) != _shape(new):
        return True
    return any(n.free > o.free
               or any(amount.free > o.resources[name].free for name, amount in n.resources.items())
               or _nodes_freed(o, n)
               for o, n in zip(old, new, strict=True))


def _nodes_freed(old: Backend, new: Backend) -> bool:
    """Has any resource more free over all nodes? (Room moving between nodes is not counted.)"""
    if not new.nodes:
        return False
    before = NodePool(old.nodes).free_units()
    return any(amount > before.get(name, 0) for name, amount in NodePool(new.nodes).free_units().items())


def _amount(value: object) -> Amount:
    """A stored ``{total, free}`` → Amount (anything else offers nothing; placement sanitises)."""
    if isinstance(value, Mapping):
        return Amount(value.get("total", 0), value.get("free", 0))
    return Amount(0, 0)


def backends_from_wire(backends: Iterable[Mapping]) -> tuple[Backend, ...]:
    """Heartbeat backends (decoded JSON) → Backend values."""
    return tuple(
        Backend(
            name=b["name"],
            attributes={k: tuple(v) for k, v in b["attributes"].items()},
            total=b["capacity"]["total"],
            free=b["capacity"]["free"],
            resources={name: _amount(value) for name, value in (b.get("resources") or {}).items()},
            discovering=b.get("discovering") is True,
            nodes=parse_node_groups(b.get("nodes")),
        )
        for b in backends
    )


class PeerView:
    """Newest advertisement per configured peer; unconfigured peers are ignored.

    ``clock`` is this service's own clock for ages (monotonic unless a test injects one).
    """

    def __init__(self, config: FederationConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        # Computed once: every heartbeat is checked against them.
        self._peer_ids = config.peer_ids
        self._known = frozenset(self._peer_ids)
        self._heartbeat_prefix = config.subjects.heartbeat("")
        self._adverts: dict[str, _Advert] = {}
        # Bumped whenever an advertisement could change a routing decision (a peer
        # appears, returns, or changes shape); caches of decisions key on it.
        self.version = 0
        # When this service last (re)gained its view of the world: start, NATS
        # reconnect, Postgres back after an outage.
        self.healthy_since = clock()

    @classmethod
    def exported(cls, config: FederationConfig, clock: Callable[[], float]) -> PeerView:
        """A view whose peers' reachability and heartbeat ages are exported as metrics."""
        view = cls(config, clock)
        metrics.watch_peer_view(view)
        return view

    def mark_healthy(self) -> None:
        """The control plane just came back: judge peers' TTLs from now on."""
        self.healthy_since = self.clock()
        self.version += 1  # peers may count as reachable again: decisions must be redone

    def next_expiry(self, now: float, since_healthy: bool = False) -> float:
        """The soonest moment a peer reachable at ``now`` stops being so (inf: none is).

        Between version changes, reachability only changes by expiring, so a routing
        decision taken now stays right until then.
        """
        return next_expiry([(self._heard_at(advert, since_healthy), advert.ttl_s)
                            for advert in self._adverts.values()], now)

    def _heard_at(self, advert: _Advert, since_healthy: bool) -> float:
        """When ``advert`` was heard, never before ``healthy_since`` when ``since_healthy``."""
        return silent_since(advert.received_at, self.healthy_since) if since_healthy else advert.received_at

    def cap_ttl(self, ttl_s: float) -> float:
        """A peer's TTL, never more than the configured ``heartbeat_ttl_s`` (nor absurd)."""
        return capped_ttl(ttl_s, self.config.heartbeat_ttl_s)

    def _is_newer(self, peer_id: str, run_id: str, seq: int, received_at: float) -> bool:
        """Would an advertisement (``run_id``, ``seq``, heard at ``received_at``) replace
        what the view holds for a configured ``peer_id``? Asked before its backends are
        built: a router or tick hears 1,000 peers' heartbeats a second and re-reads them
        all from Postgres as often, and most are not news."""
        if peer_id not in self._known:
            return False
        current = self._adverts.get(peer_id)
        return (current is None
                or run_id != current.run_id and received_at >= current.received_at
                or run_id == current.run_id and seq > current.seq)

    def _accept(self, peer_id: str, advert: _Advert) -> Change:
        if not self._is_newer(peer_id, advert.run_id, advert.seq, advert.received_at):
            return UNCHANGED
        current = self._adverts.get(peer_id)
        back = (current is None  # it had expired: back
                or not is_reachable(current.received_at, current.ttl_s, advert.received_at)
                or not is_reachable(current.received_at, current.ttl_s, self.clock()))
        # The version (the router's plan cache keys on it) moves on any change of the
        # advertisement, free slots included; waking placement needs more room.
        changed = back or current.backends != advert.backends
        if changed:
            self.version += 1
        self._adverts[peer_id] = advert
        return Change(True, back or changed and _more_room(current.backends, advert.backends))

    def apply_heartbeat(self, heartbeat: Heartbeat, received_at: float | None = None) -> Change:
        """Record a heartbeat received now (our clock); unchanged when old or unconfigured.

        The caller has checked that ``heartbeat.peer_id`` is who sent it (``receive``
        does, from the subject); its TTL is capped here.
        """
        received_at = self.clock() if received_at is None else received_at
        if not self._is_newer(heartbeat.peer_id, heartbeat.run_id, heartbeat.seq, received_at):
            return UNCHANGED
        backends = tuple(
            Backend(b.name, {k: tuple(v) for k, v in b.attributes.items()},
                    b.capacity.total, b.capacity.free,
                    {name: Amount(v.total, v.free) for name, v in b.resources.items()}, b.discovering,
                    parse_node_groups(b.nodes))
            for b in heartbeat.backends
        )
        advert = _Advert(heartbeat.run_id, heartbeat.seq, backends, self.cap_ttl(heartbeat.ttl_s), received_at)
        return self._accept(heartbeat.peer_id, advert)

    def receive(self, subject: str, data: bytes, log: EventLogger) -> tuple[Heartbeat | None, Change]:
        """A heartbeat message from NATS, checked against its subject and the configuration.

        Returns the heartbeat (TTL capped: what may be persisted) when it was newer than
        what the view had, and what it changed. Dropped messages are counted
        (``irisfed_heartbeats_dropped_total{reason}``) and logged on ``log``.
        """
        sender = subject[len(self._heartbeat_prefix):] if subject.startswith(self._heartbeat_prefix) else ""
        try:
            heartbeat = decode_internal(Heartbeat, data)
        except Exception as exc:  # noqa: BLE001 - one bad heartbeat must not stop the view
            return self._drop(HeartbeatDrop.MALFORMED, log, subject, error=str(exc)[:200])
        if why := _unstorable(heartbeat):
            return self._drop(HeartbeatDrop.MALFORMED, log, subject, error=why)
        if heartbeat.peer_id != sender:
            return self._drop(HeartbeatDrop.SUBJECT_MISMATCH, log, subject, claimed_peer_id=heartbeat.peer_id[:80])
        if sender not in self._known:
            return self._drop(HeartbeatDrop.UNKNOWN_PEER, log, subject, claimed_peer_id=heartbeat.peer_id[:80])
        ttl_s = self.cap_ttl(heartbeat.ttl_s)
        if ttl_s != heartbeat.ttl_s:
            heartbeat = msgspec.structs.replace(heartbeat, ttl_s=ttl_s)
        change = self.apply_heartbeat(heartbeat)
        return (heartbeat if change.recorded else None), change

    @staticmethod
    def _drop(reason: HeartbeatDrop, log: EventLogger, subject: str, **fields) -> tuple[None, Change]:
        metrics.HEARTBEATS_DROPPED.labels(reason).inc()
        log.warning("heartbeat_dropped", reason=reason, subject=subject[:200], **fields)
        return None, UNCHANGED

    def held(self) -> list[tuple[str, str, int]]:
        """(peer_id, run_id, seq) of every advertisement held: what a re-read of
        ``peer_heartbeat`` may leave out (``peer_heartbeat_list_news``)."""
        return [(peer_id, advert.run_id, advert.seq) for peer_id, advert in self._adverts.items()]

    def apply_rows(self, rows: Iterable[PeerHeartbeatRow]) -> bool:
        """Merge ``peer_heartbeat`` rows (what other services' peers told Postgres).

        Each row's ``age_s`` (Postgres ``now() - received_at``) places it on our clock.
        True when some row may let queued work be placed.
        """
        now = self.clock()
        placeable = False
        for row in rows:
            received_at = now - max(0.0, row.age_s)
            if not self._is_newer(row.peer_id, row.run_id, row.seq, received_at):
                continue  # what we hold (most often heard on NATS already)
            try:
                # Checked against the wire's types first, as a heartbeat from NATS is.
                msgspec.convert(row.backends, list[BackendAd])
                backends = backends_from_wire(row.backends)
            except (msgspec.ValidationError, KeyError, TypeError, ValueError, AttributeError):
                # A peer may write its own row directly: a malformed one is skipped, so
                # it cannot stop this service from hearing every other peer.
                metrics.HEARTBEATS_DROPPED.labels(HeartbeatDrop.MALFORMED).inc()
                continue
            advert = _Advert(row.run_id, row.seq, backends, self.cap_ttl(row.ttl_s), received_at)
            placeable = self._accept(row.peer_id, advert).placeable or placeable
        return placeable

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
            result.append(FederationPeer(peer_id, advert.backends, self._heard_at(advert, since_healthy),
                                         advert.ttl_s))
        return result

    def local_backends(self) -> tuple[Backend, ...]:
        """The local cluster's advertised shape (newest heartbeat, stale or not)."""
        advert = self._adverts.get(self.config.local_cluster)
        return advert.backends if advert else ()

    def reachable_ids(self, since_healthy: bool = False) -> list[str]:
        now = self.clock()
        return [p.peer_id for p in self.peers(since_healthy) if p.is_reachable(now)]

    def lost_ids(self, grace_s: float) -> list[str]:
        """Configured peers silent for their TTL plus ``grace_s``: their live work may move.

        Silence is counted from the newest heartbeat, but never from before
        ``healthy_since`` (an outage of this service is not the peers' silence); a
        peer never heard counts from ``healthy_since`` with the configured TTL.
        """
        now = self.clock()
        lost = []
        for peer_id in self._peer_ids:
            advert = self._adverts.get(peer_id)
            heard, ttl_s = (None, self.config.heartbeat_ttl_s) if advert is None else (advert.received_at, advert.ttl_s)
            if is_lost(heard, ttl_s, grace_s, now, self.healthy_since):
                lost.append(peer_id)
        return lost

    def unheard_lost(self, grace_s: float) -> bool:
        """Would a peer never heard since ``healthy_since`` count as lost now?

        Owners that are not (or no longer) in the configuration can never be heard:
        their live work is judged like a never-heard peer's.
        """
        return is_lost(None, self.config.heartbeat_ttl_s, grace_s, self.clock(), self.healthy_since)
