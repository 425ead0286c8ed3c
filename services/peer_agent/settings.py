"""A peer agent's settings: its backends and its intervals, checked when built.

The defaults live here and nowhere else (the command line reads them from here);
a value that cannot work raises ``ConfigError`` naming the setting and its flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from irisfed.shared.config import (
    BACKEND_KINDS,
    DEFAULT_GANG_START_TIMEOUT_S,
    NodeSpec,
    parse_resource_totals,
)
from irisfed.shared.errors import ConfigError
from irisfed.shared.messages import DEFAULT_GRACE_S
from irisfed.shared.reachability import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TTL_S
from irisfed.shared.settings import require_count, require_seconds


@dataclass(frozen=True)
class BackendSpec:
    """One backend this agent offers: its kind, advertised attributes, slots and resources."""

    name: str
    kind: str = "subprocess"
    attributes: dict[str, list[str]] = field(default_factory=dict)
    slots: int = 4
    # Resource name → total advertised (docs/scheduling.md); empty: placed by slots only.
    resources: dict[str, float] = field(default_factory=dict)
    # Engine settings for make_backend: slurm {"partition"}, ray {"address"}; both "poll_interval_s".
    options: dict[str, str] = field(default_factory=dict)
    # Subprocess and simulated: the nodes it has (shared.nodes); empty: the host alone, one
    # node with ``resources``. Engines report their own.
    nodes: tuple[NodeSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("agent backend: name must not be empty")
        if self.kind not in BACKEND_KINDS:
            raise ConfigError(f"agent backend {self.name}: kind (--backend) must be one of "
                              f"{', '.join(BACKEND_KINDS)}, got {self.kind!r}")
        require_count(f"agent backend {self.name}", "slots", self.slots, least=0, flag="--slots")
        parse_resource_totals(self.resources, f"agent backend {self.name} (--resource)")
        if self.nodes and self.kind in ("slurm", "ray"):
            raise ConfigError(f"agent backend {self.name}: {self.kind} reports its own nodes; --node is for "
                              "subprocess and simulated backends")
        if self.kind == "ray" and not self.options.get("address", "").startswith(("http://", "https://")):
            raise ConfigError(f"agent backend {self.name}: ray needs --ray-address http://HOST:PORT "
                              f"(the Ray dashboard), got {self.options.get('address', '')!r}")


@dataclass(frozen=True)
class AgentSettings:
    """How one peer agent runs (``irisfed peer-agent``)."""

    peer_id: str
    backends: tuple[BackendSpec, ...]
    work_root: Path = Path(".irisfed/work")
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    reconcile_interval_s: float = 2.0
    # SIGTERM to SIGKILL for a job that names no grace_s of its own (docs/design.md §3.7).
    kill_grace_s: float = DEFAULT_GRACE_S
    simulated_duration_s: float = 0.0
    report_linger_s: float = 0.01  # gather finished runs this long before writing them
    # A gang whose tasks have not all started by then is requeued whole (docs/design.md §3.4).
    gang_start_timeout_s: float = DEFAULT_GANG_START_TIMEOUT_S
    # The unpacked workspaces kept on this peer (least recently used evicted past it).
    cache_mb: int = 4096

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ConfigError("agent setting peer_id (--peer-id) must not be empty")
        if not self.backends:
            raise ConfigError("agent setting backends: an agent needs at least one backend")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ConfigError(f"agent setting backends: names must differ, got {', '.join(names)}")
        require_seconds("agent", "heartbeat_interval_s", self.heartbeat_interval_s, flag="--heartbeat-interval")
        require_seconds("agent", "heartbeat_ttl_s", self.heartbeat_ttl_s, flag="--heartbeat-ttl")
        require_seconds("agent", "reconcile_interval_s", self.reconcile_interval_s, flag="--reconcile-interval")
        require_seconds("agent", "kill_grace_s", self.kill_grace_s, positive=False)
        require_seconds("agent", "simulated_duration_s", self.simulated_duration_s, positive=False,
                        flag="--sim-duration")
        require_count("agent", "cache_mb", self.cache_mb, least=0, flag="--cache-mb")
        require_seconds("agent", "report_linger_s", self.report_linger_s, positive=False)
        require_seconds("agent", "gang_start_timeout_s", self.gang_start_timeout_s, flag="--gang-start-timeout")
