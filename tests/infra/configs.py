"""Federation configurations for tests of service processes: a peer in one call, and a
federation's TOML with the short timings these tests run on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from irisfed.tooling.federation import Peer, render_config


def make_peer(peer_id: str, device_type: str | None = None, slots: int = 2, backend: str | None = None,
              **attributes: str) -> Peer:
    """``[[peers]]`` entry ``peer_id`` with ``slots`` slots, its ``device_type`` (when given)
    and other ``attributes``; ``backend`` unless the default (subprocess)."""
    if device_type is not None:
        attributes = {"device_type": device_type, **attributes}
    return Peer(peer_id, attributes, slots=slots, backend=backend)


def federation_config(peers: Iterable[Peer], prefix: str, *, ttl_s: float = 1.5, grace_s: float = 1.0,
                      local: str = "home", **settings: Any) -> str:
    """The TOML of a federation of ``peers`` on subject prefix ``prefix``, ``local`` its local
    cluster: a heartbeat every 0.25 s trusted for ``ttl_s``, a tick pass every 0.25 s,
    ``grace_s`` for an agent to accept an assignment; ``settings`` add to or override these
    (``users=[...]``: ``[[users]]`` tables)."""
    return render_config(peers, local_cluster=local, subject_prefix=prefix, **{
        "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": ttl_s, "tick_interval_s": 0.25, "assign_grace_s": grace_s,
        **settings})
