"""``irisfed peer-agent`` (``python -m irisfed.services.peer_agent``): its own flags, and how
they become ``AgentSettings``.

A peer's advertisement comes from its flags, else from its ``[[peers]]`` entry in
the federation's file; its intervals from its flags, else from the file; every
other default lives in ``AgentSettings`` (a flag left out keeps it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from irisfed.services.common.startup import given
from irisfed.services.peer_agent.settings import AgentSettings, BackendSpec
from irisfed.shared.config import (
    BACKEND_KINDS,
    FederationConfig,
    NodeSpec,
    parse_attributes,
    parse_node_specs,
    parse_resource_totals,
)
from irisfed.shared.errors import ConfigError
from irisfed.shared.resources import ResourceError, parse_amount_flags

COMMAND = "peer-agent"
HELP = "run the agent of one peer cluster"


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-id", required=True)
    p.add_argument("--attr", action="append", metavar="KEY=VALUE", help="advertised attribute (repeatable)")
    p.add_argument("--slots", type=int, help="jobs this peer runs at once")
    p.add_argument("--resource", action="append", metavar="NAME=AMOUNT",
                   help="advertised resource total, e.g. cpu=8, memory_mb=32768, gpu=2 (repeatable)")
    p.add_argument("--backend", choices=BACKEND_KINDS)
    p.add_argument("--work-dir", type=Path, help="per-job working directories")
    p.add_argument("--cache-mb", type=int,
                   help="unpacked workspaces kept on this peer, in MiB (default 4096; least recently used evicted)")
    p.add_argument("--heartbeat-interval", type=float)
    p.add_argument("--heartbeat-ttl", type=float)
    p.add_argument("--reconcile-interval", type=float)
    p.add_argument("--sim-duration", type=float, help="simulated backend: default job length (s)")
    p.add_argument("--slurm-partition", help="slurm backend: the partition to submit to (default: the cluster's)")
    p.add_argument("--ray-address", help="ray backend: the Ray dashboard, http://HOST:8265")
    p.add_argument("--poll-interval", type=float,
                   help="slurm/ray backends: seconds between status polls (one engine call for all runs)")
    p.add_argument("--engine-timeout", type=float,
                   help="slurm/ray backends: seconds an engine call may take before it counts as hung (default 30)")
    p.add_argument("--node", action="append", metavar="COUNT[:NAME=AMOUNT,...][:KEY=VALUE,...]",
                   help="subprocess/simulated backends: COUNT identical nodes with these resources each and "
                        "these attributes, e.g. 4:cpu=2,gpu=1:slice=v5e-a (repeatable; default: the host alone)")
    p.add_argument("--gang-start-timeout", type=float,
                   help="seconds a gang's tasks may take to all start before it is requeued whole (default 300)")


def parse_attr_flags(items: list[str] | None) -> dict[str, list[str]]:
    """Repeatable ``--attr key=value`` flags; a key given twice advertises both values."""
    merged: dict[str, list[str]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"--attr {item!r} must look like KEY=VALUE")
        merged.setdefault(key.strip(), []).append(value.strip())
    return {k: list(v) for k, v in parse_attributes(merged, "--attr").items()}


def parse_resource_flags(items: list[str] | None) -> dict[str, float]:
    """Repeatable ``--resource name=amount`` flags → totals (checked like the configuration's)."""
    try:
        raw = parse_amount_flags(items or [], "--resource")
    except ResourceError as exc:
        raise ConfigError(str(exc)) from None
    return parse_resource_totals(raw, "--resource")


def parse_node_flags(items: list[str] | None) -> tuple[NodeSpec, ...]:
    """Repeatable ``--node COUNT[:NAME=AMOUNT,...][:KEY=VALUE,...]`` flags → NodeSpecs,
    checked like the configuration's ``nodes``."""
    entries = []
    for item in items or []:
        count, _, rest = item.partition(":")
        resources, _, attributes = rest.partition(":")
        try:
            entry: dict = {"count": int(count)}
        except ValueError:
            raise ConfigError(f"--node {item!r}: must start with a whole number of nodes "
                              "(COUNT[:NAME=AMOUNT,...][:KEY=VALUE,...])") from None
        try:
            entry["resources"] = parse_amount_flags([r for r in resources.split(",") if r], "--node")
        except ResourceError as exc:
            raise ConfigError(str(exc)) from None
        attrs: dict[str, list[str]] = {}
        for pair in (a for a in attributes.split(",") if a):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ConfigError(f"--node {item!r}: attribute {pair!r} must look like KEY=VALUE")
            attrs.setdefault(key.strip(), []).append(value.strip())
        entry["attributes"] = attrs
        entries.append(entry)
    return parse_node_specs(entries, "--node")


def settings(args: argparse.Namespace, config: FederationConfig) -> AgentSettings:
    peer = config.peer(args.peer_id)  # a clear error when the peer is not configured
    attributes = parse_attr_flags(args.attr) if args.attr else {k: list(v) for k, v in peer.attributes.items()}
    slots = args.slots if args.slots is not None else peer.slots
    kind = args.backend or peer.backend
    resources = parse_resource_flags(args.resource) if args.resource else dict(peer.resources)
    options = {}
    if kind == "slurm":
        options["partition"] = args.slurm_partition or peer.slurm_partition
    if kind == "ray":
        options["address"] = args.ray_address or peer.ray_address
    if args.poll_interval is not None:
        if not 0 < args.poll_interval < float("inf"):  # inf: no run would ever be seen to end
            raise ConfigError(f"--poll-interval must be a positive number of seconds, got {args.poll_interval}")
        options["poll_interval_s"] = str(args.poll_interval)
    if args.engine_timeout is not None:
        if not 0 < args.engine_timeout < float("inf"):
            raise ConfigError(f"--engine-timeout must be a positive number of seconds, got {args.engine_timeout}")
        options["call_timeout_s"] = str(args.engine_timeout)
    nodes = parse_node_flags(args.node) if args.node else peer.nodes
    return AgentSettings(
        peer_id=args.peer_id,
        backends=(BackendSpec(name=kind, kind=kind, attributes=attributes, slots=slots, resources=resources,
                              options=options, nodes=nodes),),
        gang_start_timeout_s=args.gang_start_timeout or peer.gang_start_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval or config.heartbeat_interval_s,
        heartbeat_ttl_s=args.heartbeat_ttl or config.heartbeat_ttl_s,
        reconcile_interval_s=args.reconcile_interval or config.heartbeat_interval_s,
        **given(args, work_root="work_dir", simulated_duration_s="sim_duration", cache_mb="cache_mb"),
    )


def build(config, pool, nc, settings):
    from irisfed.services.peer_agent.service import PeerAgent

    return PeerAgent(config, pool, nc, settings)
