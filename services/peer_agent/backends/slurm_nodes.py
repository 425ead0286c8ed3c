"""What ``scontrol show node -o -d`` says of a Slurm partition's nodes, and whether a
job fits them. Pure: no I/O.

- each node's resources (total and free; GRES from ``Gres`` and ``GresUsed``:
  ``parse_gres``) and its features as attributes (``feature_attribute``) make the
  heartbeat's capacity (``capacity``) and node groups (``node_groups``);
- a hostlist (``gn[1-3,5]``) as node names (``expand_hostlist``): where a gang's
  tasks run;
- a job no single node of the partition could ever hold (``misfit``), or a gang no
  set of its nodes could (``gang_misfit``), is refused before ``sbatch``.

The formats are those of Slurm 22.05, measured in ``tooling/engines/slurm.py``'s
docstring; the ``KEY=VALUE`` lines themselves are read by ``slurm_text``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from irisfed.services.peer_agent.backends.slurm_text import _int, parse_scontrol_lines
from irisfed.shared.nodes import group_nodes, most_sharing
from irisfed.shared.resources import CPU, GPU, MEMORY_MB, RESOURCE_NAME_PATTERN, fmt_amount

# Node state words (`State=IDLE+DRAIN`, `DOWN*`) of a node that runs nothing new.
UNUSABLE_NODE_STATES = frozenset({
    "DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "INVAL", "NOT_RESPONDING",
    "FUTURE", "UNKNOWN",
})

_RESOURCE_NAME = re.compile(RESOURCE_NAME_PATTERN)
_COUNT = re.compile(r"(\d+)([KMG]?)")
_COUNT_SCALE = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


# ---------------------------------------------------------------- GRES


def parse_gres(text: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """``gpu:h100:4(S:0-1),fpga:2`` → ({"gpu": 4, "fpga": 2}, {"gpu": ["h100"]}).

    Reads ``Gres`` and ``GresUsed`` alike (``gpu:h100:2(IDX:0-1)``); ``(null)`` and
    ``N/A`` are none. A count may carry a K/M/G suffix; no count means 1.
    """
    counts: dict[str, int] = {}
    types: dict[str, list[str]] = {}
    for item in _split_outside_parens(text):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        name = parts[0]
        if not name or name in ("(null)", "N/A"):
            continue
        count_match = _COUNT.fullmatch(parts[-1]) if len(parts) > 1 else None
        count = int(count_match.group(1)) * _COUNT_SCALE[count_match.group(2)] if count_match else 1
        kind = parts[1] if len(parts) > 2 or (len(parts) == 2 and count_match is None) else ""
        counts[name] = counts.get(name, 0) + count
        if kind and kind not in types.setdefault(name, []):
            types[name].append(kind)
    return counts, {name: kinds for name, kinds in types.items() if kinds}


def _split_outside_parens(text: str) -> list[str]:
    return _split_outside(text, "(", ")")


def _split_outside(text: str, opening: str, closing: str) -> list[str]:
    """``text`` split at the commas outside ``opening``...``closing`` pairs."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {opening: 1, closing: -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


# ---------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Node:
    """One node as ``scontrol show node -o -d`` reports it, in irisfed resource names."""

    name: str
    partitions: tuple[str, ...]
    usable: bool  # not down, drained, failed, invalid or not responding
    total: dict[str, float]
    used: dict[str, float]
    gpu_types: tuple[str, ...] = ()
    features: tuple[str, ...] = ()  # AvailableFeatures, as Slurm spells them

    def free(self) -> dict[str, float]:
        """What is not allocated, per resource; nothing on a node that runs nothing new."""
        return {name: max(0, amount - self.used.get(name, 0)) if self.usable else 0
                for name, amount in self.total.items()}

    def attributes(self) -> dict[str, list[str]]:
        """Its features as attributes (``feature_attribute``): what a gang's ``group_by`` names."""
        attributes: dict[str, list[str]] = {}
        for feature in self.features:
            key, value = feature_attribute(feature)
            if value not in attributes.setdefault(key, []):
                attributes[key].append(value)
        return attributes


def node_usable(state: str) -> bool:
    """Whether a node in ``State=...`` (``IDLE+DRAIN``, ``DOWN*``) may run new jobs."""
    if not state or "*" in state:  # `*`: the node does not respond
        return False
    return not any(word in UNUSABLE_NODE_STATES for word in state.split("+"))


def parse_node(fields: Mapping[str, str]) -> Node:
    """A node of ``scontrol show node -o -d`` (one parsed line)."""
    gres, gpu_types = parse_gres(fields.get("Gres", ""))
    # GresUsed comes with `-d`; without it, AllocTRES names GRES only where the cluster
    # accounts for them (AccountingStorageTRES=gres/gpu).
    gres_used = (parse_gres(fields["GresUsed"])[0] if "GresUsed" in fields
                 else tres_gres(fields.get("AllocTRES", "")))
    total: dict[str, float] = {CPU: _int(fields.get("CPUTot", "0")),
                               MEMORY_MB: _int(fields.get("RealMemory", "0"))}
    used: dict[str, float] = {CPU: _int(fields.get("CPUAlloc", "0")),
                              MEMORY_MB: _int(fields.get("AllocMem", "0"))}
    for name, count in gres.items():
        if name == GPU or (_RESOURCE_NAME.fullmatch(name) and name not in total):
            total[name] = count
            used[name] = gres_used.get(name, 0)
    partitions = tuple(p for p in fields.get("Partitions", "").split(",") if p)
    return Node(fields.get("NodeName", ""), partitions, node_usable(fields.get("State", "")),
                total, used, tuple(gpu_types.get(GPU, ())), parse_features(fields.get("AvailableFeatures", "")))


def tres_gres(text: str) -> dict[str, int]:
    """GRES counts of a TRES list: ``cpu=1,mem=1G,gres/gpu=2,gres/gpu:h100=2`` →
    ``{"gpu": 2}`` (a typed count repeats its untyped one, so only untyped ones count)."""
    counts: dict[str, int] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.startswith("gres/") and ":" not in key and value.isdigit():
            counts[key[len("gres/"):]] = int(value)
    return counts


# Characters of Slurm's constraint syntax (``--constraint``): a feature holding one
# cannot be named in a constraint, so it is advertised as nothing.
_CONSTRAINT_SYNTAX = frozenset("&|[]()*,! ")


def parse_features(text: str) -> tuple[str, ...]:
    """``AvailableFeatures`` (``rack:a,ssd``; ``(null)`` when none) as a tuple of features,
    those a constraint could not name left out."""
    return tuple(f for f in text.split(",") if f and f != "(null)" and not set(f) & _CONSTRAINT_SYNTAX)


FEATURE_KEY = "feature"


def feature_attribute(feature: str) -> tuple[str, str]:
    """The attribute a node feature stands for: ``KEY:VALUE`` and ``KEY=VALUE`` (Slurm
    22.05 takes both in ``Features=``) are attribute KEY with VALUE, split at the first
    ``:`` or ``=``; any other feature is a value of the attribute ``feature``."""
    match = re.fullmatch(r"([^:=]+)[:=](.+)", feature)
    return (match.group(1), match.group(2)) if match else (FEATURE_KEY, feature)


def parse_nodes(text: str) -> list[Node]:
    """Every node of a ``scontrol show node -o -d`` answer."""
    return [parse_node(fields) for fields in parse_scontrol_lines(text) if "NodeName" in fields]


@dataclass(frozen=True)
class Capacity:
    """What a set of nodes has: each resource's (total, free), GPU types, node shapes."""

    resources: dict[str, tuple[float, float]] = field(default_factory=dict)
    gpu_types: list[str] = field(default_factory=list)
    shapes: list[dict[str, float]] = field(default_factory=list)  # each node's total

    def attributes(self) -> dict[str, list[str]]:
        """``device_type`` (gpu when any node has a GPU, else cpu) and ``device_variant``
        (the GPU types)."""
        has_gpu = self.resources.get(GPU, (0, 0))[0] > 0
        attributes = {"device_type": [GPU if has_gpu else CPU]}
        if self.gpu_types:
            attributes["device_variant"] = list(self.gpu_types)
        return attributes


def capacity(nodes: Iterable[Node]) -> Capacity:
    """Sum of the nodes' resources. Unusable nodes count in the total, never as free."""
    totals: dict[str, float] = {}
    free: dict[str, float] = {}
    gpu_types: list[str] = []
    shapes = []
    for node in nodes:
        shapes.append(dict(node.total))
        spare = node.free()
        for name, amount in node.total.items():
            totals[name] = totals.get(name, 0) + amount
            free[name] = free.get(name, 0) + spare[name]
        gpu_types += [kind for kind in node.gpu_types if kind not in gpu_types]
    return Capacity({name: (totals[name], free[name]) for name in totals}, sorted(gpu_types), shapes)


def node_groups(nodes: Iterable[Node]) -> list[dict]:
    """The heartbeat's node groups (shared.nodes.group_nodes): each node's features as
    attributes and each resource's (total, free) on it, identical nodes counted together."""
    return group_nodes((node.attributes(), {name: (amount, node.free()[name]) for name, amount in node.total.items()})
                       for node in nodes)


def expand_hostlist(text: str) -> list[str]:
    """The node names of a Slurm hostlist, in order: ``gn[1-3,5],vm`` → gn1 gn2 gn3 gn5
    vm; ``r[1-2]n[01-02]`` → r1n01 r1n02 r2n01 r2n02 (zero padding kept). Empty text,
    ``(null)`` and ``None``: no nodes. Malformed ranges are kept as written."""
    if not text or text in ("(null)", "None", "N/A"):
        return []
    names: list[str] = []
    for item in _split_outside(text, "[", "]"):
        parts: list[list[str]] = []
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if literal:
                parts.append([literal])
            if ranges:
                parts.append(_expand_ranges(ranges))
        expanded = [""]
        for options in parts:
            expanded = [head + option for head in expanded for option in options]
        names += [name for name in expanded if name]
    return names


def _expand_ranges(text: str) -> list[str]:
    values = []
    for piece in text.split(","):
        low, sep, high = piece.partition("-")
        if sep and low.isdigit() and high.isdigit() and int(low) <= int(high):
            values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
        else:
            values.append(piece)
    return values


# ---------------------------------------------------------------- whether a job fits


def misfit(request: Mapping[str, int], shapes: Sequence[Mapping[str, float]], partition: str) -> str | None:
    """Why no single node of ``partition`` (its ``shapes``) can ever hold ``request``;
    None when one can."""
    if any(all(shape.get(name, 0) >= amount for name, amount in request.items()) for shape in shapes):
        return None
    if not shapes:
        return f"Slurm partition {partition} has no nodes"
    over = [f"{name}: asked {fmt_amount(amount)}, the largest node has "
            f"{fmt_amount(max(shape.get(name, 0) for shape in shapes))}"
            for name, amount in request.items() if all(shape.get(name, 0) < amount for shape in shapes)]
    if over:
        return f"the job does not fit one node of Slurm partition {partition}: " + "; ".join(over)
    asked = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in request.items())
    return f"no single node of Slurm partition {partition} has {asked} together"


def gang_misfit(request: Mapping[str, int], replicas: int, group_by: str, nodes: Sequence[Node],
                partition: str) -> str | None:
    """Why ``nodes`` (a partition's) can never hold ``replicas`` tasks of ``request``, one a
    node, sharing one value of ``group_by`` when it names one; None when they can."""
    fitting = [node for node in nodes if all(node.total.get(name, 0) >= amount for name, amount in request.items())]
    most = most_sharing([node.attributes() for node in fitting], group_by)
    if most >= replicas:
        return None
    asked = ", ".join(f"{name}={fmt_amount(amount)}" for name, amount in request.items())
    sharing = f" sharing one {group_by} (its node features {group_by}:VALUE)" if group_by else ""
    return (f"the gang needs {replicas} nodes of Slurm partition {partition} with {asked}{sharing}: "
            f"it has at most {most}")
