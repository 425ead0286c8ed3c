"""What a Ray cluster has, as the ``ray`` backend advertises it. Pure, no I/O.

``GET /api/cluster_status`` (each resource's total and used amount, cluster-wide and
per node in ``usageByNode``) and ``GET /api/v0/nodes`` (which nodes are alive, their
labels) → ``Discovered``: the resources under irisfed's names, ``device_type`` and
``device_variant``, and the alive nodes grouped with their labels as attributes
(``cluster_report``). The ``ClusterReport`` also keeps each alive node (what a
request or a gang is checked against before submitting: ``ray_text.too_big``,
``ray_gang_text.gang_problem``) and Ray's name of each extended resource
(``ray_names``: what a submission asks for). See tooling/engines/ray.py for the
measured behaviour of the API.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from irisfed.services.peer_agent.backends.contract import (
    Discovered,
)
from irisfed.shared.nodes import group_nodes
from irisfed.shared.resources import CPU, GPU, MEMORY_MB, RESOURCE_NAME_PATTERN, SLOTS

MIB = 1024 * 1024
TPU = "tpu"

_NAME_RE = re.compile(RESOURCE_NAME_PATTERN)
# Ray's own resources besides CPU, GPU and memory: never advertised.
_NOT_ADVERTISED = frozenset({"objectStoreMemory", "object_store_memory"})
# Our names Ray's custom resources may not take (they are Ray's built-in ones, or reserved).
_RESERVED = frozenset({CPU, GPU, MEMORY_MB, SLOTS, "memory"})


# ------------------------------------------------------------------ capacity


# Node labels that name one node alone: advertised, they would make every node a group
# of its own (and a heartbeat of 1,000 nodes 1,000 entries).
PER_NODE_LABELS = frozenset({"ray.io/node-id", "ray.io/tpu-worker-id"})


@dataclass(frozen=True)
class RayNode:
    """One alive node of a Ray cluster: its labels as attributes (``{key: [value]}``) and
    each resource's (total, free) under our names."""

    node_id: str
    attributes: dict[str, list[str]] = field(default_factory=dict)
    resources: dict[str, tuple[float, float]] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        return {name: total for name, (total, _free) in self.resources.items()}


@dataclass(frozen=True)
class ClusterReport:
    """What a Ray cluster has: ``discovered`` (summed over nodes, and its node groups),
    each alive node (``nodes``), and Ray's name of each extended resource
    (``ray_names``: ``{"tpu": "TPU"}``)."""

    discovered: Discovered
    nodes: list[RayNode] = field(default_factory=list)
    ray_names: dict[str, str] = field(default_factory=dict)


def _our_name(ray_resource: str) -> str | None:
    """Our name of a Ray resource, None for one that is never advertised: Ray's
    bookkeeping (``node:<ip>``, ``accelerator_type:<type>``, object store memory,
    placement group ``<name>_group_<id>`` resources) and names that are not valid
    irisfed resource names once lower-cased."""
    if ray_resource == "CPU":
        return CPU
    if ray_resource == "GPU":
        return GPU
    if ray_resource == "memory":
        return MEMORY_MB
    if (ray_resource in _NOT_ADVERTISED or ray_resource.startswith(("node:", "accelerator_type:"))
            or "_group_" in ray_resource):
        return None
    name = ray_resource.lower()
    if name in _RESERVED or not _NAME_RE.match(name):
        return None
    return name


def _pairs(usage: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """``{ray name: (used, total)}``, dropping entries that are not two numbers."""
    pairs = {}
    for name, value in usage.items():
        try:
            used, total = (float(v) for v in value)
        except (TypeError, ValueError):
            continue
        pairs[name] = (used, total)
    return pairs


def _named(pairs: Mapping[str, tuple[float, float]],
           ray_names: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``{our name: (total, free)}``; memory in whole MiB. The first Ray name (sorted)
    of a lower-cased name wins (``TPU`` over ``tpu``)."""
    named: dict[str, tuple[float, float]] = {}
    for ray_resource in sorted(pairs):
        name = _our_name(ray_resource)
        if name is None or (name in named):
            continue
        used, total = pairs[ray_resource]
        free = max(0.0, total - used)
        if name == MEMORY_MB:
            total, free = float(int(total // MIB)), float(int(free // MIB))
        named[name] = (total, free)
        if name not in (CPU, GPU, MEMORY_MB):
            ray_names.setdefault(name, ray_resource)
    return named


def node_attributes(labels: Any) -> dict[str, list[str]]:
    """A node's labels as attributes, but those naming one node alone (``PER_NODE_LABELS``)."""
    if not isinstance(labels, Mapping):
        return {}
    return {str(key): [str(value)] for key, value in sorted(labels.items())
            if key not in PER_NODE_LABELS and isinstance(value, str)}


def _alive_nodes(listed: Iterable[Any], by_node: Mapping[str, Any], ray_names: dict[str, str]) -> list[RayNode]:
    """The nodes the state API says are ALIVE: labels from it, (total, free) from the
    resource report's ``usageByNode``. A node not in that report yet (it refreshes every
    few seconds) offers nothing free until it is."""
    nodes = []
    for entry in listed:
        if not isinstance(entry, Mapping) or entry.get("state") != "ALIVE" or not entry.get("node_id"):
            continue
        node_id = str(entry["node_id"])
        usage = by_node.get(node_id)
        if isinstance(usage, Mapping):
            resources = _named(_pairs(usage), ray_names)
        else:
            totals = entry.get("resources_total") if isinstance(entry.get("resources_total"), Mapping) else {}
            resources = {name: (total, 0.0) for name, (total, _free) in _named(
                _pairs({name: (0.0, amount) for name, amount in totals.items()}), ray_names).items()}
        nodes.append(RayNode(node_id, node_attributes(entry.get("labels")), resources))
    return nodes


def _summed(nodes: Iterable[RayNode]) -> dict[str, tuple[float, float]]:
    """Every node's (total, free) added up, per resource."""
    summed: dict[str, tuple[float, float]] = {}
    for node in nodes:
        for name, (total, free) in node.resources.items():
            had_total, had_free = summed.get(name, (0.0, 0.0))
            summed[name] = (had_total + total, had_free + free)
    return summed


def node_list(payload: Mapping[str, Any]) -> list[Any]:
    """The nodes of a ``GET /api/v0/nodes`` answer; raises ValueError for any other answer."""
    try:
        listed = payload["data"]["result"]["result"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the Ray node list holds no nodes ({exc!r} missing)") from None
    if not isinstance(listed, list):
        raise ValueError("the Ray node list holds no nodes")
    return listed


def cluster_report(payload: Mapping[str, Any], nodes_payload: Mapping[str, Any] | None = None) -> ClusterReport:
    """A ``GET /api/cluster_status`` answer (and the ``GET /api/v0/nodes`` one) → what the
    cluster has.

    Resources: cpu, gpu, memory_mb (whole MiB) and every custom resource whose
    lower-cased name is a valid irisfed resource name (``TPU`` → ``tpu``), each as
    (total, free = total − used). Attributes: ``device_type`` ``gpu`` and/or ``tpu``
    when the cluster has any, else ``cpu``; ``device_variant`` the lower-cased
    ``accelerator_type:<type>`` names (``a100``). Nodes: each alive node, its labels as
    attributes (``node_attributes``) and its resources, grouped into
    ``discovered.nodes`` (shared.nodes.group_nodes), and the resources are their sum;
    without ``nodes_payload``, every node of the resource report, without attributes,
    and the resources its cluster-wide sum. Raises ``ValueError`` when the
    answer holds no resource report (the head's first one comes some seconds after it
    starts) or the node list is not one.
    """
    try:
        metrics = payload["data"]["clusterStatus"]["loadMetricsReport"]
        usage = metrics["usage"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the Ray cluster status holds no resource report ({exc!r} missing)") from None
    pairs = _pairs(usage or {})
    if "CPU" not in pairs:
        raise ValueError("the Ray cluster status holds no resource report yet")
    ray_names: dict[str, str] = {}
    resources = _named(pairs, ray_names)
    by_node = metrics.get("usageByNode") or {}
    if nodes_payload is None:
        nodes = [RayNode(str(node_id), {}, _named(_pairs(node_usage), ray_names))
                 for node_id, node_usage in by_node.items() if isinstance(node_usage, Mapping)]
    else:
        nodes = _alive_nodes(node_list(nodes_payload), by_node, ray_names)
        # The summed report keeps a dead node's resources for a while (seen: 10 s and more
        # after its raylet was killed): the alive nodes' sum is the cluster now.
        resources = _summed(nodes)
    device_type = [kind for kind in (GPU, TPU) if resources.get(kind, (0, 0))[0] > 0] or [CPU]
    attributes = {"device_type": device_type}
    variants = sorted({name.removeprefix("accelerator_type:").lower() for name, (_, total) in pairs.items()
                       if name.startswith("accelerator_type:") and total > 0})
    if variants:
        attributes["device_variant"] = variants
    groups = group_nodes((node.attributes, node.resources) for node in nodes)
    return ClusterReport(Discovered(attributes, resources, groups), nodes, ray_names)
