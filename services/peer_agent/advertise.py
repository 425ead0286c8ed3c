"""What a peer agent advertises for each of its backends in its heartbeat (pure).

Each backend's attributes, slots and resources, and its node groups. An engine's own
report (``Backend.discover``) is the truth for its resources (free counts every user's
jobs) unless ``--resource`` configured them; ``--attr`` adds to or overrides
discovered attributes. An engine not heard from yet is advertised as ``discovering``
(not "has nothing": a router would reject what only this engine could run). Backends
without an engine (``LOCAL_KINDS``) have configured nodes (``LocalNodes``), whose sum
they advertise when no resources are configured. The agent (service.py) counts what
is free and sends the heartbeat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from irisfed.services.peer_agent.backends import Backend, Discovered, LocalNodes
from irisfed.services.peer_agent.settings import BackendSpec
from irisfed.shared.messages import BackendAd, Capacity, NodeGroup, ResourceAmount

# Backends without an engine: their nodes are configured (LocalNodes).
LOCAL_KINDS = ("subprocess", "simulated")


def with_node_totals(spec: BackendSpec, nodes: LocalNodes | None) -> BackendSpec:
    """A backend whose nodes are configured but not its resources advertises their sum."""
    if nodes is None or spec.resources or not spec.nodes:
        return spec
    return dataclasses.replace(spec, resources=nodes.totals())


def node_group(group: dict) -> NodeGroup:
    """A node group (shared.nodes.group_nodes) as the heartbeat carries it."""
    return NodeGroup(group["count"], group["attributes"],
                     {name: ResourceAmount(v["total"], v["free"]) for name, v in group["resources"].items()})


def backend_ads(specs: Sequence[BackendSpec], discovered: Mapping[str, Discovered],
                backends: Mapping[str, Backend], local_nodes: Mapping[str, LocalNodes],
                free: Mapping[str, int], free_res: Mapping[str, Mapping[str, float]]) -> list[BackendAd]:
    """Each backend's advertisement: ``free`` slots and ``free_res`` resources as the agent
    counts them (configured resources), ``discovered`` what each engine last reported."""
    ads = []
    for spec in specs:
        found = discovered.get(spec.name)
        # Not "has nothing": a router would reject what only this engine could run.
        discovering = found is None and backends[spec.name].discovers
        attributes = {**found.attributes, **spec.attributes} if found else spec.attributes
        if spec.resources or found is None:
            resources = {name: ResourceAmount(total, free_res[spec.name][name])
                         for name, total in spec.resources.items()}
        else:
            resources = {name: ResourceAmount(total, free_amount)
                         for name, (total, free_amount) in found.resources.items()}
        local = local_nodes.get(spec.name)
        groups = found.nodes if found else (local.groups() if local is not None else [])
        ads.append(BackendAd(spec.name, attributes, Capacity(spec.slots, free[spec.name]), resources,
                             discovering, [node_group(g) for g in groups]))
    return ads
