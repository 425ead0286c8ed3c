"""Device binding on subprocess and simulated backends (docs/design.md §3.7): which
indices of a node each live run holds, handed out lowest free first, never twice, and
given back when the run ends; those of processes an earlier agent left count as held
until they are seen gone. Pure bookkeeping (nodes.py, devices.py), no processes."""

from __future__ import annotations

import asyncio
import json

import pytest

from irisfed.services.peer_agent.backends import RunSpec, SimulatedBackend
from irisfed.services.peer_agent.backends.devices import parse_devices, resources_json
from irisfed.services.peer_agent.backends.nodes import LocalNodes, device_env, lowest_free
from irisfed.shared.config import NodeSpec


def gpu_nodes(count: int = 1, gpus: int = 4, host: str = "h") -> LocalNodes:
    return LocalNodes([NodeSpec(count, {"cpu": 16, "gpu": gpus})], {}, host=host)


def held(nodes: LocalNodes, node: int = 0, name: str = "gpu") -> list[int]:
    return sorted(nodes.nodes[node].held.get(name, set()))


# ------------------------------------------------------------------ pure helpers


def test_lowest_free_skips_held_indices_and_gives_fewer_when_fewer_are_free():
    assert lowest_free(4, set(), 2) == [0, 1]
    assert lowest_free(4, {0, 2}, 2) == [1, 3]
    assert lowest_free(4, {0, 1, 2}, 2) == [3]
    assert lowest_free(4, {0, 1}, 0) == []
    assert lowest_free(0, set(), 1) == []


def test_device_env_names_the_indices_or_hides_the_nodes_devices():
    assert device_env({"gpu": 4}, {"gpu": [0, 1]}) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    # Asking none on a node that has some: empty, so it cannot use another run's.
    assert device_env({"gpu": 4, "cpu": 8000}, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert device_env({"tpu": 4}, {"tpu": [2]}) == {"TPU_VISIBLE_CHIPS": "2"}
    assert device_env({"gpu": 2, "tpu": 4}, {"tpu": [0, 1, 2, 3]}) == {
        "CUDA_VISIBLE_DEVICES": "", "TPU_VISIBLE_CHIPS": "0,1,2,3"}
    # A node without devices: nothing is overridden.
    assert device_env({"cpu": 8000}, {}) == {}


def test_resources_json_is_the_normalised_request_compact():
    assert resources_json({"gpu": 2.0, "cpu": 1}) == '{"cpu":1,"gpu":2}'
    assert resources_json({"cpu": 0.5, "memory_mb": 512}) == '{"cpu":0.5,"memory_mb":512}'
    assert resources_json({}) == '{"cpu":1}'
    assert json.loads(resources_json({"tpu": 4, "cpu": 2})) == {"cpu": 2, "tpu": 4}


def test_record_devices_parse_absent_as_none_and_refuse_garbage():
    assert parse_devices(None) == {}
    assert parse_devices({"gpu": [0, 1]}) == {"gpu": [0, 1]}
    for bad in ([0, 1], {"gpu": "0,1"}, {"gpu": [True]}, {"gpu": ["0"]}):
        with pytest.raises((TypeError, ValueError)):
            parse_devices(bad)


# ------------------------------------------------------------------ single tasks


def test_runs_on_one_node_get_distinct_lowest_free_indices_and_give_them_back():
    nodes = gpu_nodes()
    nodes.place_one(("a", 1), {"cpu": 1, "gpu": 2})
    nodes.place_one(("b", 1), {"cpu": 1, "gpu": 1})
    assert nodes.binding(("a", 1)) == ({"gpu": [0, 1]}, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert nodes.binding(("b", 1)) == ({"gpu": [2]}, {"CUDA_VISIBLE_DEVICES": "2"})
    nodes.release(("a", 1))
    assert held(nodes) == [2]
    nodes.place_one(("c", 1), {"cpu": 1, "gpu": 3})  # the lowest free: 0, 1 and 3
    assert nodes.devices_of(("c", 1)) == [{"gpu": [0, 1, 3]}]
    assert not nodes.missing_devices(("c", 1))
    nodes.release(("b", 1))
    nodes.release(("c", 1))
    nodes.release(("c", 1))  # twice: nothing more
    assert held(nodes) == [] and nodes.nodes[0].used["gpu"] == 0 and nodes.devices == {}


def test_a_run_asking_no_device_holds_none_and_is_hidden_from_them():
    nodes = gpu_nodes()
    nodes.place_one(("cpu-only", 1), {"cpu": 1})
    assert nodes.binding(("cpu-only", 1)) == ({}, {"CUDA_VISIBLE_DEVICES": ""})
    assert held(nodes) == []


def test_a_single_task_placed_over_what_its_node_has_is_told_what_it_lacks():
    nodes = gpu_nodes()
    nodes.place_one(("a", 1), {"cpu": 1, "gpu": 3})
    nodes.place_one(("b", 1), {"cpu": 1, "gpu": 2})  # no room: placed anyway (a stale view)
    assert nodes.devices_of(("b", 1)) == [{"gpu": [3]}]
    assert nodes.missing_devices(("b", 1)) == {"gpu": 1}
    nodes.release(("b", 1))
    assert held(nodes) == [0, 1, 2]


def test_single_tasks_spread_over_nodes_hold_indices_of_their_own_node():
    nodes = gpu_nodes(count=2, gpus=2)
    first = nodes.place_one(("a", 1), {"cpu": 1, "gpu": 2})
    second = nodes.place_one(("b", 1), {"cpu": 1, "gpu": 2})
    assert first != second
    assert nodes.devices_of(("a", 1)) == nodes.devices_of(("b", 1)) == [{"gpu": [0, 1]}]
    assert held(nodes, 0) == held(nodes, 1) == [0, 1]


# ------------------------------------------------------------------ gangs


def test_each_gang_task_holds_indices_on_its_own_node():
    nodes = gpu_nodes(count=3, gpus=4)
    nodes.place_one(("single", 1), {"cpu": 1, "gpu": 1})
    found = nodes.place_gang(("gang", 1), {"cpu": 1, "gpu": 2}, 3, "")
    assert found is not None and len(set(found)) == 3
    devices = nodes.devices_of(("gang", 1))
    assert len(devices) == 3
    # On the node the single task shares, the gang's task starts past its index.
    by_name = {name: task for name, task in zip(found, devices, strict=True)}
    single_node = next(i for i, node in enumerate(nodes.nodes) if node.held.get("gpu") == {0, 1, 2})
    shared = nodes.nodes[single_node].name
    assert by_name[shared] == {"gpu": [1, 2]}
    assert [task for name, task in by_name.items() if name != shared] == [{"gpu": [0, 1]}] * 2
    for position in range(3):
        _, env = nodes.binding(("gang", 1), position)
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, devices[position]["gpu"]))
    nodes.release(("gang", 1))
    assert [held(nodes, i) for i in range(3)] == [[0] if i == single_node else [] for i in range(3)]


def test_a_gang_never_takes_a_node_whose_devices_are_held():
    nodes = gpu_nodes(count=2, gpus=2)
    nodes.place_one(("single", 1), {"cpu": 1, "gpu": 1})
    assert nodes.place_gang(("gang", 1), {"cpu": 1, "gpu": 2}, 2, "") is None
    nodes.release(("single", 1))
    assert nodes.place_gang(("gang", 1), {"cpu": 1, "gpu": 2}, 2, "") is not None
    assert nodes.devices_of(("gang", 1)) == [{"gpu": [0, 1]}, {"gpu": [0, 1]}]


async def test_simulated_runs_keep_the_same_books():
    nodes = gpu_nodes(count=2, gpus=2)
    backend = SimulatedBackend(0.0, nodes)
    single = await backend.launch(RunSpec("one", 1, ["true"], resources={"cpu": 1, "gpu": 1},
                                          labels={"sim.duration_s": "30"}))
    assert nodes.devices_of(("one", 1)) == [{"gpu": [0]}]
    await single.kill(0)
    await single.wait()
    assert nodes.devices == {} and all(not node.held.get("gpu") for node in nodes.nodes)
    gang = await backend.launch(RunSpec("gang", 1, ["true"], resources={"cpu": 1, "gpu": 2}, replicas=2))
    assert await gang.wait() == 0
    assert nodes.devices == {} and all(not node.held.get("gpu") for node in nodes.nodes)


# ------------------------------------------------------------------ left by an earlier agent


def test_a_leftover_holds_its_recorded_indices_until_it_is_seen_gone():
    nodes = gpu_nodes(host="h")
    nodes.leftovers_alive([(("old", 3, -1), "h-0", {"gpu": [0, 1]})])
    assert held(nodes) == [0, 1] and nodes.nodes[0].free("gpu") == 2
    nodes.place_one(("new", 1), {"cpu": 1, "gpu": 2})
    assert nodes.devices_of(("new", 1)) == [{"gpu": [2, 3]}]
    nodes.leftovers_alive([(("old", 3, -1), "h-0", {"gpu": [0, 1]})])  # seen again: no change
    assert held(nodes) == [0, 1, 2, 3]
    nodes.leftovers_alive([])  # no longer seen: free
    assert held(nodes) == [2, 3] and nodes.nodes[0].used["gpu"] == 2


def test_leftovers_of_a_killed_run_are_released_every_task():
    nodes = gpu_nodes(count=2, gpus=2, host="h")
    nodes.leftovers_alive([(("gang", 2, 0), "h-0", {"gpu": [1]}), (("gang", 2, 1), "h-1", {"gpu": [0]}),
                           (("other", 1, -1), "h-1", {"gpu": [1]})])
    assert held(nodes, 0) == [1] and held(nodes, 1) == [0, 1]
    nodes.release_leftovers("gang", 2)
    assert held(nodes, 0) == [] and held(nodes, 1) == [1]
    assert list(nodes.leftovers) == [("other", 1, -1)]


def test_a_leftover_on_an_unknown_node_or_past_its_devices_holds_only_what_exists():
    nodes = gpu_nodes(gpus=2, host="h")
    nodes.leftovers_alive([(("gone-node", 1, -1), "elsewhere-0", {"gpu": [0]}),
                           (("shrunk", 1, -1), "h-0", {"gpu": [1, 5]}),
                           (("no-devices", 1, -1), "h-0", {})])
    assert held(nodes) == [1] and nodes.nodes[0].used["gpu"] == 1
    assert list(nodes.leftovers) == [("shrunk", 1, -1)]


async def test_a_gang_waiting_for_devices_a_leftover_holds_starts_once_it_is_gone():
    nodes = gpu_nodes(count=2, gpus=2, host="h")
    nodes.leftovers_alive([(("old", 1, -1), "h-1", {"gpu": [0]})])
    stop = asyncio.Event()
    waiting = asyncio.ensure_future(nodes.wait_for_gang(("gang", 1), {"cpu": 1, "gpu": 2}, 2, "", 30.0, stop))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    nodes.release_leftovers("old", 1)
    assert len(await asyncio.wait_for(waiting, 10)) == 2
    assert nodes.devices_of(("gang", 1)) == [{"gpu": [0, 1]}, {"gpu": [0, 1]}]


def test_indices_given_back_after_a_leftover_held_them_are_never_handed_out_twice():
    from irisfed.services.peer_agent.backends.nodes import LocalNode

    node = LocalNode("n", {"gpu": 4}, {})
    assert node.take_devices({"gpu": 1}) == {"gpu": [0]}  # the free heap exists from here
    assert node.hold({"gpu": [1, 2]}) == {"gpu": [1, 2]}  # a leftover's, still in the heap
    node.give_back({"gpu": [1, 2]})  # now in the heap twice
    node.give_back({"gpu": [0]})
    taken = node.take_devices({"gpu": 4})["gpu"]
    assert sorted(taken) == [0, 1, 2, 3] and len(set(taken)) == 4
    assert node.take_devices({"gpu": 1}) == {"gpu": []}
