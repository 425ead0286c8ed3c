"""The nodes of a subprocess or simulated backend, and which task runs on which.

An engine (Slurm, Ray) places tasks on its own nodes and says what they have; a
subprocess or simulated backend has no engine, so its configured nodes (``--node``,
``nodes = [...]`` in its ``[[peers]]`` entry; default: the host alone, one node with the
backend's resources) are kept here: what each has, what its tasks took, and the
heartbeat's node groups (shared.nodes).

A gang waits here for distinct nodes with room for one task each (sharing its
``group_by`` value) — as an engine would queue it — and its backend gives up after
the start timeout. A single task never waits: it runs where it fits best, or, when no
node has room (the tick placed it on a view a heartbeat old), on the node with the
most room, over what that node has: the agent starts single tasks by slots, as it
always has.

Devices (docs/design.md §3.7): a run asking ``gpu`` or ``tpu`` holds that many distinct
indices of each of its nodes (0 .. the node's count - 1), the lowest free ones, until
its release; a process an earlier agent left running holds the indices its record names
(``hold_leftover``) until it is seen to end (``release_leftover``). Each held index
also counts as used room, so a gang never waits for indices a fitting node lacks.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from irisfed.shared.config import NodeSpec
from irisfed.shared.nodes import group_nodes
from irisfed.shared.resources import from_units, to_units

# The resources counted in devices a run is bound to by index, and the variable that
# names a run's own indices to it (docs/engines.md "Devices").
DEVICE_ENV = {"gpu": "CUDA_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}


def lowest_free(total: int, held: Collection[int], count: int) -> list[int]:
    """Up to ``count`` of the indices 0 .. ``total`` - 1 not in ``held``, lowest first
    (fewer when fewer are free)."""
    found: list[int] = []
    for index in range(total):
        if len(found) >= count:
            break
        if index not in held:
            found.append(index)
    return found


def device_env(totals: Mapping[str, int], devices: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The variables binding a run to its ``devices`` on a node with ``totals``: each
    device resource the run holds, its indices (``0,1``); one it holds none of but the
    node has, empty, so it can use none another run holds; one the node lacks, unset."""
    env = {}
    for name, variable in DEVICE_ENV.items():
        if devices.get(name) or totals.get(name, 0) > 0:
            env[variable] = ",".join(str(index) for index in devices.get(name, ()))
    return env


@dataclass
class LocalNode:
    name: str
    total: dict[str, int]  # units
    attributes: dict[str, tuple[str, ...]]
    used: dict[str, int] = field(default_factory=dict)
    held: dict[str, set[int]] = field(default_factory=dict)  # device resource → indices live runs hold
    # device resource → a heap of the indices given back or never taken (some may be held
    # meanwhile, by ``hold``: skipped when popped); made on the first take.
    unheld: dict[str, list[int]] = field(default_factory=dict)

    def take_devices(self, units: Mapping[str, int]) -> dict[str, list[int]]:
        """The lowest free indices of each device resource in ``units`` (as many as
        asked, or as are free), now held. Each index costs a heap pop, however many the
        node has or its runs hold."""
        taken = {}
        for name in DEVICE_ENV:
            if units.get(name, 0) > 0:
                held = self.held.setdefault(name, set())
                heap = self.unheld.get(name)
                if heap is None:
                    heap = self.unheld[name] = lowest_free(self.total.get(name, 0), held, self.total.get(name, 0))
                found: list[int] = []
                while heap and len(found) < units[name]:
                    index = heapq.heappop(heap)
                    if index not in held:  # (an index may be in the heap twice: held at once)
                        found.append(index)
                        held.add(index)
                taken[name] = found
        return taken

    def hold(self, devices: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Hold the given indices, those of them this node has and no one holds; those taken."""
        taken = {}
        for name, indices in devices.items():
            held = self.held.setdefault(name, set())
            taken[name] = sorted({i for i in indices if 0 <= i < self.total.get(name, 0)} - held)
            held.update(taken[name])
        return taken

    def give_back(self, devices: Mapping[str, Sequence[int]]) -> None:
        """Indices held no more."""
        for name, indices in devices.items():
            held, heap = self.held.get(name, set()), self.unheld.get(name)
            for index in indices:
                if index in held:
                    held.discard(index)
                    if heap is not None:
                        heapq.heappush(heap, index)

    def free(self, name: str) -> int:
        return self.total.get(name, 0) - self.used.get(name, 0)

    def fits(self, units: Mapping[str, int]) -> bool:
        return all(self.free(name) >= amount for name, amount in units.items())

    def fullness(self) -> float:
        return math.fsum(1 - self.free(name) / total for name, total in self.total.items() if total > 0)


class LocalNodes:
    """A backend's configured nodes and the tasks placed on them (one event loop)."""

    def __init__(self, specs: Sequence[NodeSpec], default_resources: Mapping[str, float],
                 host: str | None = None) -> None:
        host = host or socket.gethostname()
        self.nodes: list[LocalNode] = []
        # A backend advertising no resources (slots only) advertises no nodes either, unless
        # configured: its shape is unknown, and it runs single tasks only.
        self.advertised = bool(specs) or bool(default_resources)
        if not specs:
            self.nodes.append(LocalNode(host, _units(default_resources), {}))
        for spec in specs:
            for _ in range(spec.count):
                self.nodes.append(LocalNode(f"{host}-{len(self.nodes)}", _units(spec.resources),
                                            {k: tuple(v) for k, v in spec.attributes.items()}))
        self.placed: dict[tuple[str, int], tuple[list[int], dict[str, int]]] = {}  # run → its nodes, its units
        self.devices: dict[tuple[str, int], list[dict[str, list[int]]]] = {}  # run → its indices, per node
        # A process an earlier agent left (job, epoch, task) → its node, the indices it holds.
        self.leftovers: dict[tuple[str, int, int], tuple[int, dict[str, list[int]]]] = {}
        self.generation = 0  # counts releases: a waiter that saw one generation waits for the next
        self._freed = asyncio.Event()

    # ------------------------------------------------------------ placing

    def place_gang(self, key: tuple[str, int], units: Mapping[str, float], replicas: int,
                   group_by: str) -> list[str] | None:
        """Distinct nodes for ``replicas`` tasks of ``units`` (sharing a ``group_by`` value),
        the fullest that fit first; taken for ``key`` (job, epoch). None: not now."""
        asked = _units(units)
        fitting = [i for i, node in enumerate(self.nodes) if node.fits(asked) or not node.total]
        if group_by:
            by_value: dict[str, list[int]] = {}
            for i in fitting:
                for value in self.nodes[i].attributes.get(group_by, ()):
                    by_value.setdefault(value, []).append(i)
            options = sorted((len(listed), value) for value, listed in by_value.items() if len(listed) >= replicas)
            if not options:
                return None
            fitting = by_value[options[0][1]]
        if len(fitting) < replicas:
            return None
        chosen = sorted(fitting, key=lambda i: (-self.nodes[i].fullness(), i))[:replicas]
        self._take(key, chosen, asked)
        return [self.nodes[i].name for i in chosen]

    def place_one(self, key: tuple[str, int], units: Mapping[str, float]) -> str:
        """The node a single task runs on: the fullest with room, else the one with the most."""
        asked = _units(units)
        fitting = [i for i, node in enumerate(self.nodes) if node.fits(asked)]
        if fitting:
            chosen = min(fitting, key=lambda i: (-self.nodes[i].fullness(), i))
        else:
            chosen = min(range(len(self.nodes)), key=lambda i: (self.nodes[i].fullness(), i))
        self._take(key, [chosen], asked)
        return self.nodes[chosen].name

    def _take(self, key: tuple[str, int], chosen: list[int], asked: dict[str, int]) -> None:
        for i in chosen:
            used = self.nodes[i].used
            for name, amount in asked.items():
                used[name] = used.get(name, 0) + amount
        self.placed[key] = (chosen, asked)
        self.devices[key] = [self.nodes[i].take_devices(asked) for i in chosen]

    # ------------------------------------------------------------ devices

    def devices_of(self, key: tuple[str, int]) -> list[dict[str, list[int]]]:
        """The device indices run ``key`` holds on each of its nodes, in its nodes' order."""
        return self.devices.get(key, [])

    def binding(self, key: tuple[str, int], position: int = 0) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Run ``key``'s indices on its ``position``-th node, and the variables naming them
        (``device_env``)."""
        chosen, _ = self.placed[key]
        devices = self.devices[key][position]
        return devices, device_env(self.nodes[chosen[position]].total, devices)

    def missing_devices(self, key: tuple[str, int]) -> dict[str, int]:
        """How many indices of each device resource run ``key`` asked and did not get, on
        the node where it got fewest (a single task placed over what its node has)."""
        _, asked = self.placed.get(key, ([], {}))
        missing: dict[str, int] = {}
        for devices in self.devices_of(key):
            for name in DEVICE_ENV:
                short = asked.get(name, 0) - len(devices.get(name, ()))
                if short > 0:
                    missing[name] = max(missing.get(name, 0), short)
        return missing

    def hold_leftover(self, key: tuple[str, int, int], node: str, devices: Mapping[str, Sequence[int]]) -> None:
        """A live process an earlier agent started (``key``: job, epoch, task) holds
        ``devices`` of ``node``: held, and counted as used room, until ``release_leftover``.
        Indices its node no longer has, or already held, are skipped; an unknown node
        holds nothing."""
        if key in self.leftovers or not any(devices.values()):
            return
        found = next((i for i, n in enumerate(self.nodes) if n.name == node), None)
        if found is None:
            return
        taken = self.nodes[found].hold(devices)
        used = self.nodes[found].used
        for name, indices in taken.items():
            used[name] = used.get(name, 0) + len(indices)
        self.leftovers[key] = (found, taken)

    def release_leftover(self, key: tuple[str, int, int]) -> None:
        """The earlier agent's process ``key`` is seen ended (or killed): its indices are free."""
        found = self.leftovers.pop(key, None)
        if found is None:
            return
        index, taken = found
        node = self.nodes[index]
        node.give_back(taken)
        for name, indices in taken.items():
            node.used[name] = node.used.get(name, 0) - len(indices)
        self._freed_now()

    def leftovers_alive(self, alive: Sequence[tuple[tuple[str, int, int], str, Mapping[str, Sequence[int]]]]) -> None:
        """What a scan of the earlier agents' processes found alive — (key, node, devices)
        each — holds its devices; every other leftover is gone and holds none."""
        keys = {key for key, _, _ in alive}
        for key in [key for key in self.leftovers if key not in keys]:
            self.release_leftover(key)
        for key, node, devices in alive:
            self.hold_leftover(key, node, devices)

    def release_leftovers(self, job_id: str, epoch: int) -> None:
        """Every process of (job, epoch) an earlier agent left was killed or seen gone."""
        for key in [key for key in self.leftovers if key[:2] == (job_id, epoch)]:
            self.release_leftover(key)

    def release(self, key: tuple[str, int]) -> None:
        """The run of ``key`` ended: its nodes' room is free again (waiting gangs are told)."""
        found = self.placed.pop(key, None)
        if found is None:
            return
        chosen, asked = found
        for i, devices in zip(chosen, self.devices.pop(key, []), strict=False):
            self.nodes[i].give_back(devices)
        for i in chosen:
            used = self.nodes[i].used
            for name, amount in asked.items():
                used[name] = used.get(name, 0) - amount
        self._freed_now()

    def _freed_now(self) -> None:
        self.generation += 1
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    async def wait_freed(self, seen: int) -> None:
        """Until room is freed after generation ``seen`` (at once if it already was)."""
        if self.generation == seen:
            await self._freed.wait()

    async def wait_for_gang(self, key: tuple[str, int], units: Mapping[str, float], replicas: int, group_by: str,
                            timeout_s: float, stop: asyncio.Event) -> list[str] | None:
        """Nodes for a gang (``place_gang``), waiting for room to free up to ``timeout_s``
        or until ``stop`` is set. None: none in time (or stopped)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not stop.is_set():
            seen = self.generation
            found = self.place_gang(key, units, replicas, group_by)
            if found is not None:
                return found
            left = deadline - loop.time()
            if left <= 0:
                return None
            waiters = {asyncio.ensure_future(self.wait_freed(seen)), asyncio.ensure_future(stop.wait())}
            try:
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        return None

    # ------------------------------------------------------------ advertising

    def totals(self) -> dict[str, float]:
        """Every node's resources summed: the backend's, when only nodes are configured."""
        summed: dict[str, int] = {}
        for node in self.nodes:
            for name, amount in node.total.items():
                summed[name] = summed.get(name, 0) + amount
        return {name: from_units(name, amount) for name, amount in summed.items()}

    def groups(self) -> list[dict]:
        """The heartbeat's node groups: identical nodes counted together (none for a
        backend that advertises neither resources nor nodes)."""
        if not self.advertised:
            return []
        return group_nodes(
            (node.attributes, {name: (from_units(name, total), from_units(name, max(0, node.free(name))))
                               for name, total in node.total.items()})
            for node in self.nodes)


def _units(amounts: Mapping[str, float]) -> dict[str, int]:
    return {name: to_units(name, amount) for name, amount in amounts.items() if amount}
