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
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from irisfed.shared.config import NodeSpec
from irisfed.shared.nodes import group_nodes
from irisfed.shared.resources import from_units, to_units


@dataclass
class LocalNode:
    name: str
    total: dict[str, int]  # units
    attributes: dict[str, tuple[str, ...]]
    used: dict[str, int] = field(default_factory=dict)

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

    def release(self, key: tuple[str, int]) -> None:
        """The run of ``key`` ended: its nodes' room is free again (waiting gangs are told)."""
        found = self.placed.pop(key, None)
        if found is None:
            return
        chosen, asked = found
        for i in chosen:
            used = self.nodes[i].used
            for name, amount in asked.items():
                used[name] = used.get(name, 0) - amount
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
