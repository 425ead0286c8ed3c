"""Gangs at their edges, pure (docs/design.md §3.4): ``replicas`` at and past its bounds,
``coschedule`` strictly decoded, a gang of 4096 tasks routed and placed, a ``group_by``
key no node has, and nodes that are advertised but offer nothing."""

from __future__ import annotations

import json

import pytest

from irisfed.shared.errors import InvalidRequest
from irisfed.shared.federation.peer import Backend, FederationPeer
from irisfed.shared.federation.router import PeerRouter, RoutingRequest, SubmitDisposition
from irisfed.shared.messages import SubmitRequest, decode_request
from irisfed.shared.nodes import Gang, NodePool, parse_node_groups
from irisfed.shared.placement import PlacementRun
from irisfed.shared.resources import Amount, Resources
from irisfed.shared.rooms import QueuedJob

NOW = 1000.0


def submit(**fields) -> SubmitRequest:
    return decode_request(SubmitRequest, json.dumps({"command": ["true"], **fields}).encode())


@pytest.mark.parametrize("replicas", [0, -1, 4097, 2**63, True, 2.0, "2", None, [2]])
def test_replicas_out_of_range_or_not_an_integer_is_invalid(replicas):
    with pytest.raises(InvalidRequest):
        submit(replicas=replicas)


@pytest.mark.parametrize("coschedule", [{}, {"group_by": ""}, {"group_by": "x" * 129}, {"group_by": 1},
                                        {"group_by": "slice", "spread": True}, "slice", ["slice"]])
def test_a_malformed_coschedule_is_invalid(coschedule):
    with pytest.raises(InvalidRequest):
        submit(replicas=2, coschedule=coschedule)


def test_replicas_at_its_bounds_are_valid_and_a_single_task_keeps_its_spec_hash():
    assert submit(replicas=4096).replicas == 4096
    assert submit(replicas=1).canonical_spec() == submit().canonical_spec()


def nodes_backend(count: int, slots: int, cpu_per_node: int = 1, **attributes: str) -> Backend:
    nodes = parse_node_groups([{"count": count, "attributes": {k: [v] for k, v in attributes.items()},
                                "resources": {"cpu": {"total": cpu_per_node, "free": cpu_per_node}}}])
    total = count * cpu_per_node
    return Backend("main", {}, total=slots, free=slots, resources={"cpu": Amount(total, total)}, nodes=nodes)


def peer(backend: Backend, peer_id: str = "big") -> FederationPeer:
    return FederationPeer(peer_id, (backend,), last_heartbeat_at=NOW - 1, ttl_s=60)


def classify(peers, replicas: int, group_by: str = "", pin: str = ""):
    return PeerRouter(peers, clock=lambda: NOW).classify(
        RoutingRequest((), False, pin, Resources({"cpu": 1}), replicas, group_by))


def test_a_gang_of_4096_is_routed_and_placed_whole_or_rejected_by_one_node():
    exact = [peer(nodes_backend(4096, 4096, rack="r1"))]
    assert classify(exact, 4096).disposition is SubmitDisposition.QUEUE
    assert classify(exact, 4096, "rack").disposition is SubmitDisposition.QUEUE
    short = [peer(nodes_backend(4095, 4096))]
    plan = classify(short, 4096)
    assert plan.disposition is SubmitDisposition.REJECT and "at most 4095" in plan.reason, plan
    few_slots = [peer(nodes_backend(4096, 4095))]
    assert classify(few_slots, 4096).disposition is SubmitDisposition.REJECT

    run = PlacementRun(exact, {}, NOW)
    [placed], waiting = run.place([QueuedJob("huge", 0, resources=Resources({"cpu": 1}), replicas=4096)])
    assert waiting == [] and placed.tasks == 4096 and sum(n for _, n in placed.nodes) == 4096
    room = run.rooms[("big", "main")]
    assert room.slots == 0 and room.free["cpu"] == 0
    # Nothing left: not even one more task.
    placed, waiting = run.place([QueuedJob("one", 0, resources=Resources({"cpu": 1}))])
    assert placed == [] and [w.job_id for w in waiting] == ["one"]


def test_group_by_a_key_no_node_has_is_rejected_naming_it_and_a_pinned_one_waits_saying_why():
    peers = [peer(nodes_backend(8, 8, slice="a"))]
    plan = classify(peers, 2, "rack")
    assert plan.disposition is SubmitDisposition.REJECT, plan
    assert "sharing one rack, at most 0" in plan.reason, plan.reason
    assert classify(peers, 2, "slice").disposition is SubmitDisposition.QUEUE

    run = PlacementRun(peers, {}, NOW)
    pinned = QueuedJob("pinned", 0, pinned_peer_id="big", resources=Resources({"cpu": 1}), replicas=2,
                       group_by="rack")
    placed, [waiting] = run.place([pinned])
    assert placed == [] and "rack" in waiting.reason, waiting.reason
    # The pinned gang's wait costs the others nothing.
    placed, waiting = run.place([QueuedJob("ok", 0, resources=Resources({"cpu": 1}), replicas=8, group_by="slice")])
    assert [p.job_id for p in placed] == ["ok"] and waiting == []


def test_a_group_by_value_list_counts_a_node_once_per_gang():
    """A node advertising two values of the key (slice a and b) may serve a gang on
    either, but never twice in one gang."""
    pool = NodePool(parse_node_groups([
        {"count": 2, "attributes": {"slice": ["a", "b"]}, "resources": {"cpu": {"total": 1, "free": 1}}},
        {"count": 1, "attributes": {"slice": ["a"]}, "resources": {"cpu": {"total": 1, "free": 1}}},
    ]))
    units = Resources({"cpu": 1}).units
    assert pool.choose(Gang(3, units, "slice")) is not None  # slice a: the two shared and its own
    assert pool.choose(Gang(4, units, "slice")) is None  # 3 distinct nodes in all
    assert pool.most_nodes(Gang(1, units, "slice"), by_totals=True) == 3


def test_advertised_nodes_offering_nothing_hold_no_gang_and_no_single_task():
    nothing = parse_node_groups([
        {"count": 1000, "resources": {"cpu": {"total": 0, "free": 0}}},
        {"count": -3, "resources": {"cpu": {"total": 64, "free": 64}}},
        {"count": 5_000_000, "resources": {"cpu": {"total": 64, "free": 64}}},
    ])
    backend = Backend("main", {}, total=64, free=64, resources={"cpu": Amount(64, 64)}, nodes=nothing)
    peers = [peer(backend)]
    assert classify(peers, 1).disposition is SubmitDisposition.REJECT
    assert classify(peers, 2).disposition is SubmitDisposition.REJECT
    placed, waiting = PlacementRun(peers, {}, NOW).place(
        [QueuedJob("pinned", 0, pinned_peer_id="big", resources=Resources({"cpu": 1}), replicas=2)])
    assert placed == [] and len(waiting) == 1
