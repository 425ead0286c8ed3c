"""Federation peers as the router sees them: configured identity plus newest advertisement."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from irisfed.shared.errors import ConfigError
from irisfed.shared.nodes import NodeClass, parse_node_groups
from irisfed.shared.reachability import DEFAULT_HEARTBEAT_TTL_S, is_reachable
from irisfed.shared.resources import Amount, ResourceError, parse_offer

# Peer ids become NATS subject tokens (``irisfed.assign.<peer_id>``): no dots,
# no wildcards, no whitespace.
PEER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
_PEER_ID_RE = re.compile(PEER_ID_PATTERN)

def validate_peer_id(peer_id: object) -> str:
    """Return ``peer_id`` when it is a valid peer id; raise ConfigError otherwise."""
    if not isinstance(peer_id, str) or not _PEER_ID_RE.match(peer_id):
        raise ConfigError(
            f"invalid peer id {peer_id!r}: use letters, digits, '_' or '-' (max 64), "
            "starting with a letter or digit"
        )
    return peer_id


@dataclass(frozen=True, slots=True)
class Backend:
    """One place a peer can run jobs, with the attributes and capacity it advertises.

    ``total``/``free`` count slots (one per job). ``resources`` maps a resource name to
    its advertised amounts (anything with ``total`` and ``free``: an Amount, the wire's
    ResourceAmount); empty for an agent that advertises none, which is then placed by
    slots only (see shared.resources and docs/scheduling.md). ``discovering``: its
    engine has not said what it has yet, so its shape is unknown (it might hold
    anything, and nothing may be placed on it).
    """

    name: str
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    total: int = 0
    free: int = 0
    resources: Mapping[str, Amount] = field(default_factory=dict)
    discovering: bool = False
    nodes: tuple[NodeClass, ...] = ()  # its hosts (shared.nodes); none: single-task jobs only


@dataclass(frozen=True, slots=True)
class FederationPeer:
    """A configured peer cluster and its newest heartbeat (if any).

    ``last_heartbeat_at`` is when the newest heartbeat was *received* (epoch
    seconds, our clock), so reachability never depends on the peer's clock.
    """

    peer_id: str
    backends: tuple[Backend, ...] = ()
    last_heartbeat_at: float | None = None
    ttl_s: float = DEFAULT_HEARTBEAT_TTL_S

    def is_reachable(self, now: float) -> bool:
        """True while the newest heartbeat is younger than its TTL (``irisfed.shared.reachability``)."""
        return is_reachable(self.last_heartbeat_at, self.ttl_s, now)

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the newest heartbeat, or None when none was ever received."""
        if self.last_heartbeat_at is None:
            return None
        return max(0.0, now - self.last_heartbeat_at)


def _build_backend(entry: Mapping[str, Any], peer_id: str) -> Backend:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"peer {peer_id}: each backend must be a table")
    name = entry.get("name", "default")
    attributes = _attributes(entry.get("attributes", {}), peer_id)
    capacity = entry.get("capacity", {})
    total = int(capacity.get("total", entry.get("slots", 0)))
    free = int(capacity.get("free", total))
    try:
        resources = parse_offer(entry.get("resources", {}), f"peer {peer_id} backend {name}")
    except ResourceError as exc:
        raise ConfigError(str(exc)) from None
    return Backend(name=str(name), attributes=attributes, total=total, free=free, resources=resources,
                   discovering=entry.get("discovering") is True, nodes=parse_node_groups(entry.get("nodes")))


def _attributes(raw: object, peer_id: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"peer {peer_id}: attributes must map a key to a value or list")
    result: dict[str, tuple[str, ...]] = {}
    for key, values in raw.items():
        items = values if isinstance(values, list | tuple) else [values]
        result[str(key)] = tuple(str(v) for v in items)
    return result


def build_peers(config: Iterable[Mapping[str, Any]] | Mapping[str, Any]) -> list[FederationPeer]:
    """Build the federation's peers from config entries (or a config with ``peers``).

    Each entry needs ``id``; it may carry ``backends`` (``[{name, attributes,
    capacity: {total, free}, resources: {name: total | {total, free}}, nodes: [...]}]``), or
    ``attributes`` as a one-backend shorthand,
    plus ``last_heartbeat_at`` (epoch seconds) and ``ttl_s``.
    """
    entries = config.get("peers", []) if isinstance(config, Mapping) else config
    peers: list[FederationPeer] = []
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, Mapping):
            raise ConfigError("each peer must be a table with an 'id'")
        peer_id = validate_peer_id(entry.get("id"))
        if peer_id in seen:
            raise ConfigError(f"peer {peer_id!r} is configured twice")
        seen.add(peer_id)
        if "backends" in entry:
            backends = tuple(_build_backend(b, peer_id) for b in entry["backends"])
        elif "attributes" in entry:
            backends = (_build_backend(entry, peer_id),)
        else:
            backends = ()
        ttl_s = float(entry.get("ttl_s", DEFAULT_HEARTBEAT_TTL_S))
        if ttl_s <= 0:
            raise ConfigError(f"peer {peer_id}: ttl_s must be positive")
        heard = entry.get("last_heartbeat_at")
        peers.append(
            FederationPeer(
                peer_id=peer_id,
                backends=backends,
                last_heartbeat_at=None if heard is None else float(heard),
                ttl_s=ttl_s,
            )
        )
    return peers
