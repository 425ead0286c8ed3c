"""Federation configuration: one TOML file, every key defaulted except the peer list.

```toml
local_cluster = "home"
subject_prefix = "irisfed"
heartbeat_interval_s = 2
heartbeat_ttl_s = 6

[[peers]]
id = "home"
attributes = { device_type = "cpu" }   # optional: this peer agent's own advertisement
slots = 4                              # optional, for its agent
backend = "subprocess"                 # optional, for its agent
resources = { cpu = 8, memory_mb = 32768, gpu = 2 }  # optional: what its agent advertises

[[peers]]
id = "hpc"
backend = "slurm"                      # capacity and attributes come from the cluster
slurm_partition = "gpu"                # optional: the cluster's default partition else

[[peers]]
id = "ml"
backend = "ray"
ray_address = "http://127.0.0.1:8265"  # the Ray dashboard (Jobs API)

[[users]]                              # optional: users beside `default` (docs/design.md §3.2)
id = "alice"
max_band = "interactive"
weight = 1.0
quota = { gpu = 16, cpu = 256 }
```
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from irisfed.shared.errors import ConfigError
from irisfed.shared.federation.peer import validate_peer_id
from irisfed.shared.reachability import (
    DEFAULT_ASSIGN_GRACE_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TTL_S,
)
from irisfed.shared.subjects import Subjects
from irisfed.shared.users import UserConfig, UserTable, parse_users

CONFIG_ENV = "IRISFED_CONFIG"
DATABASE_URL_ENV = "IRISFED_DATABASE_URL"
NATS_URL_ENV = "IRISFED_NATS_URL"

_TOP_KEYS = {"local_cluster", "subject_prefix", "heartbeat_interval_s", "heartbeat_ttl_s",
             "peers", "tick_interval_s", "assign_grace_s", "users", "max_workspace_mb",
             "max_workspace_files", "max_output_mb", "output_retention_days", "max_log_mb",
             "log_retention_days"}
_PEER_KEYS = {"id", "attributes", "slots", "backend", "resources", "slurm_partition", "ray_address", "nodes",
              "gang_start_timeout_s"}
_NODE_KEYS = {"count", "resources", "attributes"}
MAX_CONFIGURED_NODES = 100_000
# How long a gang's tasks may take to all start before the gang is requeued whole
# (docs/design.md §3.4): long enough for an engine to find N free nodes when they are
# there, short enough that a gang placed on a stale view does not hold its slots long.
DEFAULT_GANG_START_TIMEOUT_S = 300.0
BACKEND_KINDS = ("subprocess", "simulated", "slurm", "ray")
# Workspaces and outputs (docs/design.md §3.5): what travels with a job and comes back.
DEFAULT_MAX_WORKSPACE_MB = 256
DEFAULT_MAX_WORKSPACE_FILES = 100_000
DEFAULT_MAX_OUTPUT_MB = 1024
DEFAULT_OUTPUT_RETENTION_DAYS = 7
# Logs (docs/design.md §3.6): each run's stdout and stderr, shipped while it runs.
DEFAULT_MAX_LOG_MB = 64
DEFAULT_LOG_RETENTION_DAYS = 7


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """A configured peer; attributes/slots/backend are defaults for its own agent."""

    id: str
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    slots: int = 4
    backend: str = "subprocess"
    # Resource name → total its agent advertises (docs/scheduling.md); empty: slots only.
    resources: Mapping[str, float] = field(default_factory=dict)
    slurm_partition: str = ""  # backend slurm: the partition to submit to ("" = the cluster's default)
    ray_address: str = ""  # backend ray: the dashboard's http://HOST:PORT
    # Subprocess and simulated backends: their nodes (shared.nodes); empty: the host alone.
    nodes: tuple[NodeSpec, ...] = ()
    gang_start_timeout_s: float = DEFAULT_GANG_START_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """``count`` identical nodes a subprocess or simulated backend pretends to have."""

    count: int
    resources: Mapping[str, float] = field(default_factory=dict)
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def parse_node_specs(raw: object, where: str) -> tuple[NodeSpec, ...]:
    """``nodes = [{count = 4, resources = {cpu = 8}, attributes = {slice = "a"}}]`` →
    NodeSpecs, with a clear error for anything else."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: nodes must be a list of {{count, resources, attributes}} tables")
    specs = []
    total = 0
    for i, entry in enumerate(raw):
        at = f"{where}: nodes[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at} must be a table of count, resources and attributes")
        bad = set(entry) - _NODE_KEYS
        if bad:
            raise ConfigError(f"{at}: unknown keys {', '.join(sorted(bad))} (known: count, resources, attributes)")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{at}: count must be a whole number >= 1, got {count!r}")
        total += count
        if total > MAX_CONFIGURED_NODES:
            raise ConfigError(f"{where}: at most {MAX_CONFIGURED_NODES} nodes, got {total}")
        specs.append(NodeSpec(count, parse_resource_totals(entry.get("resources", {}), at),
                              parse_attributes(entry.get("attributes", {}), at)))
    return tuple(specs)

def parse_resource_totals(raw: object, where: str) -> dict[str, float]:
    """Configured resources ``{name: total}`` (validated names and amounts) → totals."""
    from irisfed.shared.resources import ResourceError, parse_offer

    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: resources must be a table of resource name = amount")
    try:
        return {name: amount.total for name, amount in parse_offer(raw, where).items()}
    except ResourceError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class FederationConfig:
    """The whole federation's settings (see the module docstring for the file form)."""

    peers: tuple[PeerConfig, ...]
    local_cluster: str = "home"
    subject_prefix: str = "irisfed"
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    tick_interval_s: float = 1.0
    # How long a job may sit `assigned` on an unreachable peer before the tick requeues it.
    assign_grace_s: float = DEFAULT_ASSIGN_GRACE_S
    users: tuple[UserConfig, ...] = ()  # configured users; `default` acts for v1 producers
    max_workspace_mb: int = DEFAULT_MAX_WORKSPACE_MB  # a packed workspace's largest size
    max_workspace_files: int = DEFAULT_MAX_WORKSPACE_FILES  # its most entries (unpacking refuses more)
    max_output_mb: int = DEFAULT_MAX_OUTPUT_MB  # what one run's outputs may store
    output_retention_days: float = DEFAULT_OUTPUT_RETENTION_DAYS  # how long the store keeps outputs
    max_log_mb: int = DEFAULT_MAX_LOG_MB  # what one run's stdout (and its stderr, each task's) keeps
    log_retention_days: float = DEFAULT_LOG_RETENTION_DAYS  # how long shipped logs are kept

    @property
    def max_workspace_bytes(self) -> int:
        return self.max_workspace_mb * 1024 * 1024

    @property
    def max_output_bytes(self) -> int:
        return self.max_output_mb * 1024 * 1024

    @property
    def max_log_bytes(self) -> int:
        return self.max_log_mb * 1024 * 1024

    @property
    def user_table(self) -> UserTable:
        return UserTable.of(self.users)

    @property
    def user_ids(self) -> tuple[str, ...]:
        return tuple(u.id for u in self.users)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.peers)

    def peer(self, peer_id: str) -> PeerConfig:
        for peer in self.peers:
            if peer.id == peer_id:
                return peer
        raise ConfigError(f"peer {peer_id!r} is not in the configuration (peers: {', '.join(self.peer_ids)})")


def _positive(raw: Mapping[str, Any], key: str, default: float, where: str = "") -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ConfigError(f"{where}{key} must be a positive number, got {value!r}")
    return float(value)


def _whole(raw: Mapping[str, Any], key: str, default: int, most: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ConfigError(f"{key} must be a whole number from 1 to {most:,}, got {value!r}")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or "\x00" in value or len(value) > 1024:
        raise ConfigError(f"{where} must be a string (at most 1024 characters)")
    return value.strip()


def parse_attributes(raw: object, where: str) -> dict[str, tuple[str, ...]]:
    """``{key: value-or-list}`` → ``{key: (str, ...)}``, with a clear error otherwise."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: attributes must be a table of key = value or [values]")
    result = {}
    for key, value in raw.items():
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: attribute {key!r} must be strings or numbers")
        if "\x00" in str(key) or any("\x00" in str(v) for v in values):
            raise ConfigError(f"{where}: attribute {key!r} contains NUL, which Postgres cannot store")
        result[str(key).strip()] = tuple(str(v).strip() for v in values)
    return result


def parse_config(raw: Mapping[str, Any]) -> FederationConfig:
    """Validate a decoded TOML document into a FederationConfig."""
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
    peers_raw = raw.get("peers")
    if not isinstance(peers_raw, list) or not peers_raw:
        raise ConfigError("the configuration needs at least one [[peers]] entry with an id")
    peers = []
    for entry in peers_raw:
        if not isinstance(entry, Mapping):
            raise ConfigError("each [[peers]] entry must be a table")
        bad = set(entry) - _PEER_KEYS
        if bad:
            raise ConfigError(f"unknown keys in [[peers]]: {', '.join(sorted(bad))}")
        peer_id = validate_peer_id(entry.get("id"))
        slots = entry.get("slots", 4)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ConfigError(f"peer {peer_id}: slots must be a whole number >= 0")
        backend = entry.get("backend", "subprocess")
        if backend not in BACKEND_KINDS:
            raise ConfigError(f"peer {peer_id}: backend must be one of {', '.join(BACKEND_KINDS)}")
        peers.append(PeerConfig(
            id=peer_id,
            attributes=parse_attributes(entry.get("attributes", {}), f"peer {peer_id}"),
            slots=slots,
            backend=backend,
            resources=parse_resource_totals(entry.get("resources", {}), f"peer {peer_id}"),
            slurm_partition=_text(entry.get("slurm_partition", ""), f"peer {peer_id}: slurm_partition"),
            ray_address=_text(entry.get("ray_address", ""), f"peer {peer_id}: ray_address"),
            nodes=parse_node_specs(entry.get("nodes", []), f"peer {peer_id}"),
            gang_start_timeout_s=_positive(entry, "gang_start_timeout_s", DEFAULT_GANG_START_TIMEOUT_S,
                                           f"peer {peer_id}: "),
        ))
    ids = [p.id for p in peers]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ConfigError(f"peers configured twice: {', '.join(sorted(duplicates))}")
    local = raw.get("local_cluster", "home")
    if local not in ids:
        raise ConfigError(f"local_cluster {local!r} must be one of the [[peers]] ids ({', '.join(ids)})")
    interval = _positive(raw, "heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S)
    ttl = _positive(raw, "heartbeat_ttl_s", DEFAULT_HEARTBEAT_TTL_S)
    if ttl <= interval:
        raise ConfigError("heartbeat_ttl_s must be larger than heartbeat_interval_s")
    prefix = raw.get("subject_prefix", "irisfed")
    Subjects(prefix)  # validates
    return FederationConfig(
        peers=tuple(peers),
        local_cluster=local,
        subject_prefix=prefix,
        heartbeat_interval_s=interval,
        heartbeat_ttl_s=ttl,
        tick_interval_s=_positive(raw, "tick_interval_s", 1.0),
        assign_grace_s=_positive(raw, "assign_grace_s", DEFAULT_ASSIGN_GRACE_S),
        users=parse_users(raw.get("users"), ids),
        max_workspace_mb=_whole(raw, "max_workspace_mb", DEFAULT_MAX_WORKSPACE_MB, 1024 * 1024),
        max_workspace_files=_whole(raw, "max_workspace_files", DEFAULT_MAX_WORKSPACE_FILES, 10_000_000),
        max_output_mb=_whole(raw, "max_output_mb", DEFAULT_MAX_OUTPUT_MB, 1024 * 1024),
        output_retention_days=_positive(raw, "output_retention_days", DEFAULT_OUTPUT_RETENTION_DAYS),
        max_log_mb=_whole(raw, "max_log_mb", DEFAULT_MAX_LOG_MB, 64 * 1024),
        log_retention_days=_positive(raw, "log_retention_days", DEFAULT_LOG_RETENTION_DAYS),
    )


def load_config(path: str | os.PathLike[str] | None = None) -> FederationConfig:
    """Read the TOML file at ``path`` (or $IRISFED_CONFIG)."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"no configuration: pass --config FILE or set {CONFIG_ENV}")
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not valid TOML: {exc}") from None
    return parse_config(raw)
