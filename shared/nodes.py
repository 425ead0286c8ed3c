"""Nodes: a backend's hosts, advertised as groups of identical nodes, and where a job's
tasks land on them. Pure, no I/O (docs/design.md §3.4; docs/scheduling.md, "Gangs").

A heartbeat backend may advertise ``nodes``: ``[{"count", "attributes", "resources":
{name: {"total", "free"}}}]``, each entry ``count`` nodes alike in attributes and in
each resource's total and free amount *per node*. Identical nodes are counted
together, so a 1,000-node cluster in a few shapes is a few entries (``group_nodes``
builds them for agents, and merges further past ``MAX_NODE_GROUPS``).

Where a backend advertises nodes, every task of a job must fit on one node: a job of
``replicas`` tasks, each asking ``units``, needs that many *distinct* nodes with room
for one task each, all sharing one value of the ``group_by`` attribute when it names
one (all hosts of one TPU slice, one rack). A backend that advertises no nodes runs
single-task jobs only (its hosts are unknown: an agent from before gangs).

``NodePool`` is one backend's nodes during a tick's run: it answers whether the tasks
fit (now, or ever: by totals), takes and gives back their room, and names why not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import msgspec

from irisfed.shared.resources import fmt_amount, from_units, offer_units

# Entries a backend advertises at most: past it, nodes of one shape (attributes and
# totals) are merged, each resource's free taken as the least of theirs (a merged
# group never offers more than its every node has). 64 shapes × a few resources stay
# well under the 8 KiB a heartbeat of 1,000 nodes may take.
MAX_NODE_GROUPS = 64
# A node count no real backend reaches: a larger one offers nothing (sanitised).
MAX_NODE_COUNT = 1_000_000

Units = tuple[tuple[str, int], ...]
AttrKey = tuple[tuple[str, tuple[str, ...]], ...]


class NodeClass(NamedTuple):
    """``count`` identical nodes: their attributes and, per resource, total and free units."""

    count: int
    attributes: AttrKey
    total: tuple[tuple[str, int], ...]
    free: tuple[tuple[str, int], ...]


def _attr_key(raw: object) -> AttrKey:
    if not isinstance(raw, Mapping):
        return ()
    items = []
    for key, values in raw.items():
        listed = values if isinstance(values, list | tuple) else [values]
        items.append((str(key), tuple(sorted(str(v) for v in listed))))
    return tuple(sorted(items))


def parse_node_groups(raw: object) -> tuple[NodeClass, ...]:
    """Advertised node groups (decoded JSON or the wire's structs) → NodeClasses,
    sanitised like a backend's resources: a malformed entry, a count that is not a
    positive integer (or past MAX_NODE_COUNT) and a bad resource offer nothing.

    Cached by content: a peer heartbeats the same groups every interval, and a router
    or tick hears every peer's (1,000 peers at 1 Hz: parsing each anew cost ~60 µs)."""
    if not raw or not isinstance(raw, list | tuple):
        return ()
    try:
        key = _encode(raw)
    except (TypeError, msgspec.EncodeError, OverflowError):
        return _parse_node_groups(raw)
    return _parsed(key)


_encode = msgspec.json.Encoder().encode


@lru_cache(maxsize=4096)
def _parsed(key: bytes) -> tuple[NodeClass, ...]:
    return _parse_node_groups(msgspec.json.decode(key))


def _parse_node_groups(raw: list | tuple) -> tuple[NodeClass, ...]:
    classes: dict[tuple[AttrKey, tuple, tuple], int] = {}
    for entry in raw:
        get = entry.get if isinstance(entry, Mapping) else (lambda key, default=None, e=entry: getattr(e, key, default))
        count = get("count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_NODE_COUNT:
            continue
        resources = get("resources", {}) or {}
        if not isinstance(resources, Mapping):
            continue
        offered = offer_units({name: (value.get("total", 0), value.get("free", 0)) if isinstance(value, Mapping)
                               else value for name, value in resources.items()})
        key = (_attr_key(get("attributes", {})), tuple(sorted((n, t) for n, (t, _f) in offered.items())),
               tuple(sorted((n, f) for n, (_t, f) in offered.items())))
        classes[key] = classes.get(key, 0) + count
    return tuple(NodeClass(count, attrs, total, free) for (attrs, total, free), count in sorted(classes.items()))


def group_nodes(nodes: Iterable[tuple[Mapping[str, Sequence[str]], Mapping[str, tuple[float, float]]]],
                limit: int = MAX_NODE_GROUPS) -> list[dict[str, Any]]:
    """Single nodes — (attributes, {resource: (total, free)}) each, as an engine lists
    them — as heartbeat node groups: identical nodes counted together. Past ``limit``
    entries, nodes of one shape (attributes and totals) are merged, each resource's free
    the least among them (so no merged group claims room its nodes lack)."""
    exact: dict[tuple, int] = {}
    for attributes, resources in nodes:
        attrs = _attr_key(attributes)
        totals = tuple(sorted((name, float(total)) for name, (total, _free) in resources.items()))
        frees = tuple(sorted((name, float(min(free, total))) for name, (total, free) in resources.items()))
        exact[(attrs, totals, frees)] = exact.get((attrs, totals, frees), 0) + 1
    if len(exact) > limit:
        merged: dict[tuple, tuple[int, dict[str, float]]] = {}
        for (attrs, totals, frees), count in exact.items():
            had, least = merged.get((attrs, totals), (0, dict(frees)))
            merged[(attrs, totals)] = (had + count, {name: min(least.get(name, amount), amount)
                                                      for name, amount in frees})
        exact = {(attrs, totals, tuple(sorted(least.items()))): count
                 for (attrs, totals), (count, least) in merged.items()}
    groups = []
    for (attrs, totals, frees), count in sorted(exact.items()):
        free = dict(frees)
        groups.append({"count": count, "attributes": {key: list(values) for key, values in attrs},
                       "resources": {name: {"total": _plain(total), "free": _plain(free.get(name, 0.0))}
                                     for name, total in totals}})
    return groups


def _plain(amount: float) -> int | float:
    return int(amount) if float(amount).is_integer() else amount


def fits_on(free: Mapping[str, int], units: Units) -> bool:
    for name, amount in units:
        if free.get(name, 0) < amount:
            return False
    return True


def most_sharing(attributes: Sequence[Mapping[str, Sequence[str]]], group_by: str) -> int:
    """How many of these nodes (each one's ``attributes``) share one value of ``group_by``,
    at the most; all of them when ``group_by`` is empty."""
    if not group_by:
        return len(attributes)
    per_value: dict[str, int] = {}
    for node in attributes:
        for value in node.get(group_by, []):
            per_value[value] = per_value.get(value, 0) + 1
    return max(per_value.values(), default=0)


def describe_task(units: Units) -> str:
    """``gpu 8`` / ``cpu 2, memory_mb 4096``: what one task asks, as a verdict says it."""
    asked = [f"{name} {fmt_amount(from_units(name, amount))}" for name, amount in units]
    return ", ".join(asked) if asked else "a slot"


class Gang(NamedTuple):
    """What a job's tasks need of nodes: how many tasks, each asking ``units``, and the
    attribute they must share (``""``: none)."""

    replicas: int
    units: Units
    group_by: str = ""


SINGLE = 1


class NodePool:
    """One backend's nodes during a run: classes of identical nodes and how many of each.

    Room only shrinks as tasks are taken, and grows back by exactly what ``give``
    returns, so a run never over-commits a node. Node identity is not tracked: a
    task taken from a class moves one node of it to the class with that much less free.
    """

    __slots__ = ("_free", "counts", "total_of", "version")

    def __init__(self, classes: Iterable[NodeClass]) -> None:
        # (attributes, totals, free) → how many such nodes.
        self.counts: dict[tuple[AttrKey, tuple, tuple], int] = {}
        self.total_of: dict[tuple[AttrKey, tuple], int] = {}  # nodes per shape, for "at most"
        for c in classes:
            key = (c.attributes, c.total, c.free)
            self.counts[key] = self.counts.get(key, 0) + c.count
            shape = (c.attributes, c.total)
            self.total_of[shape] = self.total_of.get(shape, 0) + c.count
        self._free: dict[tuple, dict[str, int]] = {}  # a class key's free, as a dict (cached)
        self.version = 0

    def copy(self) -> NodePool:
        other = NodePool(())
        other.counts = dict(self.counts)
        other.total_of = self.total_of
        other._free = self._free
        return other

    def free_of(self, key: tuple) -> dict[str, int]:
        free = self._free.get(key)
        if free is None:
            free = self._free[key] = dict(key[2])
        return free

    # ------------------------------------------------------------ choosing nodes

    def _values(self, key: str, attrs: AttrKey) -> tuple[str, ...]:
        for name, values in attrs:
            if name == key:
                return values
        return ()

    def fits_one(self, units: Units) -> bool:
        """Has some node room for one task of ``units`` now?"""
        free_of = self.free_of
        for key, n in self.counts.items():
            if n > 0 and fits_on(free_of(key), units):
                return True
        return False

    def choose(self, gang: Gang, avoid: Units | None = None) -> list[tuple[tuple, int]] | None:
        """Distinct nodes with room for one task each, ``gang.replicas`` of them (sharing
        one ``group_by`` value), as (class, how many): the fullest nodes that fit first
        (pack: emptier nodes stay whole for bigger tasks). None: not now. ``avoid``: a
        held gang's task: never take a node big enough for one (by its totals) unless
        one still fits there after: those nodes drain for the gang."""
        units, need = gang.units, gang.replicas
        free_of = self.free_of
        fitting = [(key, n) for key, n in self.counts.items() if n > 0 and fits_on(free_of(key), units)]
        if avoid is not None:  # nodes big enough for it drain for it; the rest take other work
            fitting = [(key, n) for key, n in fitting
                       if not fits_on(dict(key[1]), avoid) or _fits_after(free_of(key), units, avoid)]
        if not gang.group_by:
            return _take_fullest(fitting, need)
        by_value: dict[str, list[tuple[tuple, int]]] = {}
        for key, n in fitting:
            for value in self._values(gang.group_by, key[0]):
                by_value.setdefault(value, []).append((key, n))
        # The value with the fewest fitting nodes that still hold the gang: big groups
        # stay whole for big gangs; ties by value, so the choice is stable.
        options = sorted((sum(n for _, n in listed), value) for value, listed in by_value.items())
        for available, value in options:
            if available >= need:
                return _take_fullest(by_value[value], need)
        return None

    def fits(self, gang: Gang) -> bool:
        return self.choose(gang) is not None

    def choose_by_totals(self, units: Units) -> list[tuple[tuple, int]] | None:
        """A node whose totals hold one task of ``units`` though none has it free now (a
        single task waits in the engine's queue there): the one with the most free."""
        free_of = self.free_of
        shaped = [key for key, n in self.counts.items() if n > 0 and fits_on(dict(key[1]), units)]
        if not shaped:
            return None
        return [(max(shaped, key=lambda key: (sum(free_of(key).values()), key)), 1)]

    def most_nodes(self, gang: Gang, by_totals: bool) -> int:
        """The most nodes that could take one task each (sharing a ``group_by`` value):
        now, or (``by_totals``) when the backend is empty."""
        counts: dict[tuple, int] = {}
        if by_totals:
            for (attrs, totals), n in self.total_of.items():
                if fits_on(dict(totals), gang.units):
                    counts[(attrs, totals, ())] = n
        else:
            for key, n in self.counts.items():
                if n > 0 and fits_on(self.free_of(key), gang.units):
                    counts[key] = n
        if not gang.group_by:
            return sum(counts.values())
        by_value: dict[str, int] = {}
        for key, n in counts.items():
            for value in self._values(gang.group_by, key[0]):
                by_value[value] = by_value.get(value, 0) + n
        return max(by_value.values(), default=0)

    def can_ever_hold(self, gang: Gang) -> bool:
        return self.most_nodes(gang, by_totals=True) >= gang.replicas

    def free_units(self) -> dict[str, int]:
        """What every node has free, summed per resource (the backend's free, node by node)."""
        free: dict[str, int] = {}
        for (_attrs, _totals, frees), n in self.counts.items():
            for name, amount in frees:
                free[name] = free.get(name, 0) + amount * n
        return free

    # ------------------------------------------------------------ taking and giving back

    def take(self, choice: Sequence[tuple[tuple, int]], units: Units) -> None:
        """One task of ``units`` on each chosen node."""
        for key, n in choice:
            self._move(key, n, units, -1)
        self.version += 1

    def give(self, choice: Sequence[tuple[tuple, int]], units: Units) -> None:
        """Undo ``take(choice, units)``."""
        for key, n in choice:
            after = _shifted(key, units, -1)
            self._move(after, n, units, +1)
        self.version += 1

    def _move(self, key: tuple, n: int, units: Units, sign: int) -> None:
        left = self.counts.get(key, 0) - n
        if left:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)
        moved = _shifted(key, units, sign)
        self.counts[moved] = self.counts.get(moved, 0) + n

    def release_somewhere(self, units: Units, times: int) -> None:
        """Give back ``times`` tasks of ``units`` whose nodes are not known (a preempted
        job's): each to the fullest node that could have held it (free + units within
        its totals) — where running work most likely is. An estimate: the engine has
        the last word, and a gang whose nodes are not really free waits for its start
        timeout (docs/scheduling.md)."""
        for _ in range(times):
            best = None
            for key, n in self.counts.items():
                if n <= 0:
                    continue
                attrs, totals, frees = key
                total, free = dict(totals), dict(frees)
                if all(free.get(name, 0) + amount <= total.get(name, 0) for name, amount in units):
                    fullness = sum(free.values())
                    if best is None or (fullness, key) < best[0]:
                        best = ((fullness, key), key)
            if best is None:
                return
            self._move(best[1], 1, units, +1)
        self.version += 1


def _fits_after(free: Mapping[str, int], units: Units, then: Units) -> bool:
    """Would ``then`` still fit on a node of ``free`` once ``units`` took their room?"""
    taken = dict(units)
    for name, amount in then:
        if free.get(name, 0) - taken.get(name, 0) < amount:
            return False
    return True


def _shifted(key: tuple, units: Units, sign: int) -> tuple:
    attrs, totals, frees = key
    free = dict(frees)
    for name, amount in units:
        if name in free:
            free[name] += sign * amount
    return (attrs, totals, tuple(sorted(free.items())))


def _take_fullest(fitting: list[tuple[tuple, int]], need: int) -> list[tuple[tuple, int]] | None:
    if sum(n for _, n in fitting) < need:
        return None
    # The least free (as a sum of fractions of each node's totals) first.
    fitting = sorted(fitting, key=lambda entry: (_fullness(entry[0]), entry[0]))
    chosen = []
    for key, n in fitting:
        take = min(n, need)
        chosen.append((key, take))
        need -= take
        if not need:
            break
    return chosen


def _fullness(key: tuple) -> float:
    _attrs, totals, frees = key
    free = dict(frees)
    return math.fsum(free.get(name, 0) / total for name, total in totals if total > 0)


def gang_verdict(gang: Gang, pool: NodePool, backend: str) -> str:
    """``gang: needs 8 nodes with gpu 8, at most 4 (backend slurm)``: why a backend could
    never hold the tasks (by its nodes' totals)."""
    most = pool.most_nodes(gang, by_totals=True)
    task = describe_task(gang.units)
    shared = f" sharing one {gang.group_by}" if gang.group_by else ""
    noun = "nodes" if gang.replicas != 1 else "node"
    return f"gang: needs {gang.replicas} {noun} with {task}{shared}, at most {most} (backend {backend})"
