"""Node groups (shared.nodes): what a heartbeat advertises of a backend's hosts, and how
tasks are fitted on them, one per node. Pure, no servers."""

from __future__ import annotations

import msgspec
import pytest

from irisfed.services.peer_agent.advertise import node_group
from irisfed.shared.messages import BackendAd, Capacity, ResourceAmount
from irisfed.shared.nodes import (
    MAX_NODE_GROUPS,
    Gang,
    NodePool,
    gang_verdict,
    group_nodes,
    parse_node_groups,
)
from irisfed.shared.resources import Resources


def units(**amounts):
    return Resources(amounts).units


def groups(*entries):
    """(count, {resource: (total, free)}, {attr: [values]}) → parsed node classes."""
    return parse_node_groups([
        {"count": count, "attributes": attrs or {},
         "resources": {name: {"total": t, "free": f} for name, (t, f) in resources.items()}}
        for count, resources, attrs in entries])


def slices(n_slices: int, per_slice: int, gpu: int = 8, free: int | None = None):
    return groups(*[(per_slice, {"cpu": (8, 8), "gpu": (gpu, gpu if free is None else free)},
                     {"slice": [f"s{i}"]}) for i in range(n_slices)])


def test_identical_nodes_are_one_group_and_a_thousand_in_four_shapes_fit_in_8_kib():
    shapes = [({"device_type": ["gpu"], "device_variant": ["h100"]}, {"cpu": (96, 96), "memory_mb": (786432, 786432),
                                                                       "gpu": (8, 8)}),
              ({"device_type": ["gpu"], "device_variant": ["a100"]}, {"cpu": (64, 64), "memory_mb": (524288, 524288),
                                                                       "gpu": (8, 8)}),
              ({"device_type": ["cpu"]}, {"cpu": (128, 128), "memory_mb": (1048576, 1048576)}),
              ({"device_type": ["tpu"], "slice": ["v5e-16-a"]}, {"cpu": (24, 24), "tpu": (4, 4)})]
    nodes = [shapes[i % 4] for i in range(1000)]
    grouped = group_nodes(nodes)
    assert sorted(g["count"] for g in grouped) == [250] * 4
    ad = BackendAd("slurm", {"device_type": ["gpu"]}, Capacity(4000, 4000),
                   {"gpu": ResourceAmount(4000, 4000)}, nodes=[node_group(g) for g in grouped])
    encoded = msgspec.json.encode(ad)
    assert len(encoded) <= 8 * 1024, len(encoded)
    assert sum(c.count for c in parse_node_groups(msgspec.to_builtins(ad.nodes))) == 1000


def test_past_the_group_limit_nodes_of_one_shape_merge_with_their_least_free():
    # Every node of one shape with a different free cpu: one group each, too many.
    nodes = [({}, {"cpu": (1000, float(i))}) for i in range(MAX_NODE_GROUPS + 10)]
    [merged] = group_nodes(nodes)
    assert merged["count"] == MAX_NODE_GROUPS + 10
    assert merged["resources"]["cpu"] == {"total": 1000, "free": 0}  # never claims room a node lacks


@pytest.mark.parametrize("entry", [
    {"count": 0}, {"count": -1}, {"count": 1.5}, {"count": True}, {"count": "4"}, {"count": 10**9},
    {"count": 2, "resources": "lots"}, "node", None,
])
def test_malformed_node_groups_offer_nothing(entry):
    assert parse_node_groups([entry]) == ()


def test_bad_amounts_in_a_node_group_offer_none_of_that_resource():
    [node] = parse_node_groups([{"count": 2, "resources": {"gpu": {"total": -8, "free": 9}, "cpu": {"total": 4}}}])
    assert dict(node.total) == {"gpu": 0, "cpu": 4000}
    assert dict(node.free) == {"gpu": 0, "cpu": 0}  # free never above total; absent free offers none


def test_a_gang_takes_distinct_nodes_with_room_for_one_task_each():
    pool = NodePool(groups((3, {"gpu": (8, 8)}, None), (2, {"gpu": (8, 2)}, None)))
    gang = Gang(4, units(cpu=0, gpu=4))
    assert pool.most_nodes(gang, by_totals=False) == 3 and not pool.fits(gang)
    assert pool.most_nodes(gang, by_totals=True) == 5 and pool.can_ever_hold(gang)
    three = Gang(3, units(cpu=0, gpu=4))
    choice = pool.choose(three)
    assert sum(n for _, n in choice) == 3
    pool.take(choice, three.units)
    # Each of the three now has 4 free: a second gang of three fits on the same nodes.
    assert pool.fits(three)
    pool.give(choice, three.units)
    assert pool.free_units() == {"gpu": 3 * 8000 // 1000 + 2 * 2}


def test_the_fullest_nodes_that_fit_go_first_so_empty_ones_stay_whole():
    pool = NodePool(groups((1, {"gpu": (8, 8)}, None), (1, {"gpu": (8, 3)}, None)))
    [(key, n)] = pool.choose(Gang(1, units(cpu=0, gpu=2)))
    assert dict(key[2]) == {"gpu": 3} and n == 1


def test_group_by_keeps_a_gang_on_one_slice_or_nowhere():
    pool = NodePool(slices(2, 4))  # s0, s1: 4 nodes each
    four = Gang(4, units(cpu=1, gpu=8), "slice")
    choice = pool.choose(four)
    assert {dict(k[0])["slice"] for k, _ in choice} == {("s0",)}  # the tightest, then by name
    assert not pool.can_ever_hold(Gang(5, units(cpu=1, gpu=8), "slice"))
    assert pool.can_ever_hold(Gang(5, units(cpu=1, gpu=8)))  # 8 nodes in all without group_by
    pool.take(choice, four.units)
    assert {dict(k[0])["slice"] for k, _ in pool.choose(four)} == {("s1",)}
    assert pool.choose(Gang(2, units(cpu=1, gpu=8), "rack")) is None  # no node has a rack


def test_a_held_gangs_nodes_are_avoided_by_later_single_tasks():
    pool = NodePool(groups((2, {"gpu": (8, 8)}, None), (2, {"gpu": (8, 1)}, None), (1, {"gpu": (2, 2)}, None)))
    gang_task = units(cpu=0, gpu=4)
    # A one-gpu task goes on the small node (too small for the gang's task) ...
    [(key, _)] = pool.choose(Gang(1, units(cpu=0, gpu=1)), avoid=gang_task)
    assert dict(key[1]) == {"gpu": 2}
    # ... or where the gang's task still fits after it; never on a big node it would
    # spoil, even a busy one (it drains for the gang).
    assert pool.choose(Gang(1, units(cpu=0, gpu=5)), avoid=gang_task) is None
    [(key, _)] = pool.choose(Gang(1, units(cpu=0, gpu=4)), avoid=gang_task)
    assert dict(key[2]) == {"gpu": 8}


def test_the_verdict_names_the_nodes_needed_and_the_most_there_are():
    pool = NodePool(groups((4, {"gpu": (8, 8)}, None), (12, {"gpu": (4, 4)}, None)))
    assert gang_verdict(Gang(8, units(cpu=0, gpu=8)), pool, "slurm") == \
        "gang: needs 8 nodes with gpu 8, at most 4 (backend slurm)"
    assert gang_verdict(Gang(5, units(gpu=8), "slice"), NodePool(slices(2, 4)), "main") == \
        "gang: needs 5 nodes with cpu 1, gpu 8 sharing one slice, at most 4 (backend main)"


def test_victims_of_unknown_nodes_go_back_to_the_fullest_node_that_could_hold_them():
    pool = NodePool(groups((1, {"gpu": (8, 8)}, None), (1, {"gpu": (8, 0)}, None)))
    pool.release_somewhere(units(cpu=0, gpu=8), 1)
    assert pool.most_nodes(Gang(2, units(cpu=0, gpu=8)), by_totals=False) == 2
    pool.release_somewhere(units(cpu=0, gpu=1), 1)  # no node could have held it: nothing changes
    assert pool.free_units() == {"gpu": 16}
