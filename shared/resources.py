"""Resources: what a job asks for and what a backend offers, per dimension. Pure, no I/O.

Names and units (see docs/scheduling.md):

- ``cpu``: cores, fractional to a thousandth (a millicore);
- ``memory_mb``: MiB, an integer;
- ``gpu``: a count, an integer;
- any other name matching :data:`RESOURCE_NAME_PATTERN` is an *extended* resource
  (``tpu``, ``fpga.xilinx``), an integer count.

A job's request names the amounts it needs; ``cpu`` defaults to 1 when the request
does not name it (``"cpu": 0`` asks for none), so an absent request, ``{}`` and
``{"cpu": 1}`` are the same request. Besides its resources every job takes one
*slot* of its backend (``slots`` is reserved: it is the concurrency dimension).

A backend that advertises resources lists everything it has: a resource it does not
list counts as none of it. A backend that advertises no resources (an agent from
before resources existed) is checked in slots only; see docs/scheduling.md.

Inside placement every amount is an integer number of *units* (cpu: millicores, the
rest their own unit), so sums are exact: ten 0.1-core jobs fill exactly one core.

Nothing here imports another irisfed module but the errors: wire, router and
placement all build on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any, NamedTuple

import msgspec

CPU = "cpu"
MEMORY_MB = "memory_mb"
GPU = "gpu"
SLOTS = "slots"  # reserved: every job takes exactly one slot of its backend

# Lower case so `GPU` and `gpu` can never be two resources; dots and dashes for vendor
# names (`fpga.xilinx`, `nvidia-a100`); 63 characters like a DNS label.
RESOURCE_NAME_PATTERN = r"^[a-z][a-z0-9_.-]{0,62}$"
_NAME_RE = re.compile(RESOURCE_NAME_PATTERN)

# name → unit (cpu may be fractional, to 0.001; every other resource is whole).
WELL_KNOWN: dict[str, str] = {CPU: "cores", MEMORY_MB: "MiB", GPU: "devices"}
EXTENDED_UNIT = "units"

# A billion of anything (1 PiB in MiB, a billion cores) is no real request, and it
# keeps every sum of units (≤ 1e12 millicores per job) far inside exact float range.
MAX_AMOUNT = 1_000_000_000
# A request naming more kinds of resources than this is a mistake, not a machine.
MAX_RESOURCES = 32
# cpu in millicores: the finest fraction of a core a request may name.
CPU_SCALE = 1000
DEFAULT_REQUEST: dict[str, int | float] = {CPU: 1}


class ResourceError(ValueError):
    """A resource request or advertisement that cannot be used; the message says why."""


def unit_of(name: str) -> str:
    """The unit a resource is counted in, for messages and docs."""
    return WELL_KNOWN.get(name, EXTENDED_UNIT)


def _scale(name: str) -> int:
    return CPU_SCALE if name == CPU else 1


def check_name(name: object, where: str = "resources") -> str:
    """``name`` when it is a valid resource name; ResourceError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ResourceError(
            f"{where}: {name!r} is not a valid resource name (a lower-case letter, then up to 62 "
            "lower-case letters, digits, '_', '.' or '-'; e.g. cpu, memory_mb, gpu, tpu)")
    if name == SLOTS:
        raise ResourceError(f"{where}: 'slots' is reserved (every job takes one slot); not a resource")
    return name


def check_amount(name: str, value: object, where: str = "resources") -> int | float:
    """A requested amount of ``name``, normalised (an int when integral); ResourceError otherwise."""
    field = f"{where}.{name}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ResourceError(f"{field} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ResourceError(f"{field} must be a finite number, got {value!r}")
    if value < 0:
        raise ResourceError(f"{field} must not be negative, got {value!r}")
    if value > MAX_AMOUNT:
        raise ResourceError(f"{field} is {value!r}; the most a job may ask is {MAX_AMOUNT}")
    if name == CPU:
        millis = value * CPU_SCALE
        if abs(millis - round(millis)) > 1e-6:
            raise ResourceError(f"{field} is {value!r}: cpu is counted to 0.001 of a core, no finer")
        units = round(millis)
        return units // CPU_SCALE if units % CPU_SCALE == 0 else units / CPU_SCALE
    if value != int(value):
        raise ResourceError(f"{field} must be a whole number of {unit_of(name)}, got {value!r}")
    return int(value)


def parse_amount_flags(items: Iterable[str], flag: str) -> dict[str, int | float]:
    """Repeatable ``NAME=AMOUNT`` command-line flags → ``{name: amount}`` (whole amounts as
    ints); checked only for their form here: the caller validates them as a request
    or an offer. Raises ResourceError naming the flag."""
    result: dict[str, int | float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            amount = float(value)
        except ValueError:
            amount = None
        if not sep or amount is None or not name.strip():
            raise ResourceError(f"{flag} {item!r} must look like NAME=AMOUNT (e.g. gpu=2)")
        result[name.strip()] = int(amount) if amount.is_integer() else amount
    return result


def normalize_request(raw: Mapping[str, object] | None, where: str = "resources") -> dict[str, int | float]:
    """A validated request with ``cpu`` filled in and other zero amounts dropped, sorted by name.

    Raises ResourceError naming the first problem (bad name, wrong type, negative,
    not finite, over :data:`MAX_AMOUNT`, a fraction of an integer resource).
    """
    if raw is None:
        return dict(DEFAULT_REQUEST)
    if not isinstance(raw, Mapping):
        raise ResourceError(f"{where} must be an object of resource name → amount")
    if len(raw) > MAX_RESOURCES:
        raise ResourceError(f"{where} names {len(raw)} resources; at most {MAX_RESOURCES}")
    result: dict[str, int | float] = {}
    for name, value in raw.items():
        check_name(name, where)
        amount = check_amount(name, value, where)
        if amount or name == CPU:
            result[name] = amount
    result.setdefault(CPU, DEFAULT_REQUEST[CPU])
    return dict(sorted(result.items()))


def to_units(name: str, amount: float) -> int:
    """A validated requested amount → integer units (cpu: millicores)."""
    return round(amount * _scale(name))


def offered_units(name: str, amount: object) -> int:
    """An *advertised* amount → integer units, rounded down; nonsense counts as none.

    Advertisements come from our own agents but are not trusted to be sane: negative,
    non-numeric or non-finite amounts offer nothing, huge ones are capped.
    """
    if isinstance(amount, bool) or not isinstance(amount, int | float) or amount != amount:
        return 0
    if amount <= 0:
        return 0
    capped = min(float(amount), float(MAX_AMOUNT) * 1000)
    return math.floor(capped * _scale(name) + 1e-6)


def from_units(name: str, units: int) -> int | float:
    """Integer units → the resource's own unit (an int when whole)."""
    scale = _scale(name)
    return units // scale if units % scale == 0 else units / scale


def fmt_amount(amount: int | float) -> str:
    """``8``, ``0.5``, ``262144``: an amount as people write it (never ``1e+09``)."""
    if isinstance(amount, float) and not amount.is_integer():
        return f"{amount:.3f}".rstrip("0")
    return str(int(amount))


class Resources:
    """What one job asks for: an immutable, hashable, validated request.

    ``Resources()`` is the default request (one cpu). Build from the wire's mapping
    with ``Resources({"cpu": 0.5, "gpu": 1})``; invalid input raises ResourceError.
    ``units`` holds ``(name, integer units)`` pairs, sorted, zero amounts left out.
    """

    __slots__ = ("_amounts", "_hash", "units")

    def __init__(self, amounts: Mapping[str, object] | None = None) -> None:
        normalized = normalize_request(amounts)
        self._amounts = normalized
        self.units: tuple[tuple[str, int], ...] = tuple(
            (name, to_units(name, value)) for name, value in normalized.items() if value)
        self._hash = hash(self.units)

    def as_dict(self) -> dict[str, int | float]:
        """The normalised request (``cpu`` always named), e.g. ``{"cpu": 0.5, "gpu": 1}``."""
        return dict(self._amounts)

    def get(self, name: str) -> int | float:
        """The amount asked of ``name`` (0 when not asked)."""
        return self._amounts.get(name, 0)

    def describe(self) -> str:
        """``cpu=0.5, gpu=1``."""
        return ", ".join(f"{name}={fmt_amount(value)}" for name, value in self._amounts.items())

    def is_default(self) -> bool:
        return self._amounts == DEFAULT_REQUEST

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Resources) and self.units == other.units

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Resources({self._amounts!r})"

    def __reduce__(self):  # immutable, but picklable (multiprocessing, caches)
        return (Resources, (self._amounts,))


DEFAULT_RESOURCES = Resources()


@lru_cache(maxsize=4096)
def _cached(items: tuple[tuple[str, Any], ...]) -> Resources:
    return Resources(dict(items))


def as_resources(value: Resources | Mapping[str, object] | None) -> Resources:
    """A Resources from a Resources, a mapping (validated; cached: jobs repeat a few shapes) or None."""
    if value is None:
        return DEFAULT_RESOURCES
    if isinstance(value, Resources):
        return value
    if not isinstance(value, Mapping):
        raise ResourceError("resources must be an object of resource name → amount")
    try:
        return _cached(tuple(sorted(value.items())))
    except TypeError:  # unhashable or unsortable values: validate uncached for the message
        return Resources(value)


@lru_cache(maxsize=4096)
def resources_from_json(text: str | None) -> Resources:
    """Stored resources (validated at submit; ``null``/absent = the default) → Resources."""
    return as_resources(msgspec.json.decode(text) if text else None)


# ---------------------------------------------------------------- what backends offer


class Amount(NamedTuple):
    """One advertised resource of a backend: its total and how much is free."""

    total: float
    free: float


def parse_offer(raw: Mapping[str, object], where: str) -> dict[str, Amount]:
    """Configured resources of a backend: ``{name: total}`` or ``{name: {total, free}}``.

    For configuration, which a person writes: mistakes raise ResourceError.
    """
    if not isinstance(raw, Mapping):
        raise ResourceError(f"{where}: resources must map a resource name to an amount or {{total, free}}")
    result: dict[str, Amount] = {}
    for name, value in raw.items():
        check_name(name, where)
        if isinstance(value, Mapping):
            total, free = value.get("total"), value.get("free", value.get("total"))
        else:
            total = free = value
        for label, amount in (("total", total), ("free", free)):
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount) \
                    or amount < 0:
                raise ResourceError(f"{where}: resource {name} {label} must be a non-negative number, got {amount!r}")
        result[name] = Amount(float(total), float(min(free, total)))
    return result


def offer_units(resources: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Advertised resources (values with ``total`` and ``free``: Amount, the wire's
    ResourceAmount, or a ``(total, free)`` pair) → ``{name: (total units, free units)}``.

    Invalid names are left out; amounts are sanitised (see :func:`offered_units`); free
    never exceeds total.
    """
    result: dict[str, tuple[int, int]] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not _NAME_RE.match(name) or name == SLOTS:
            continue
        if isinstance(amount, tuple) and not hasattr(amount, "total"):
            total_raw, free_raw = amount
        else:
            total_raw, free_raw = getattr(amount, "total", 0), getattr(amount, "free", 0)
        total = offered_units(name, total_raw)
        result[name] = (total, min(total, offered_units(name, free_raw)))
    return result


class Shortfall(NamedTuple):
    """A resource a backend lacks for a job: ``asked`` versus ``available``.

    ``available`` is the backend's total (the most it could ever give) for the verdict
    ``insufficient_resources``, its free amount for ``no_free_capacity``. Amounts are in
    the resource's own unit.
    """

    resource: str
    asked: int | float
    available: int | float
    backend: str = ""


def shortfalls(units: Iterable[tuple[str, int]], available: Mapping[str, int], backend: str = "") -> list[Shortfall]:
    """Every resource of a request (units) that ``available`` (units) cannot cover."""
    return [Shortfall(name, from_units(name, need), from_units(name, available.get(name, 0)), backend)
            for name, need in units if available.get(name, 0) < need]


def describe_shortfalls(short: Iterable[Shortfall], limit_word: str) -> str:
    """``gpu: asked 8, at most 4; memory: asked 8.0 GiB, …`` (``limit_word``: "at most" or "free")."""
    def said(s: Shortfall) -> tuple[str, str, str]:
        return resource_label(s.resource), amount_text(s.resource, s.asked), amount_text(s.resource, s.available)
    if limit_word == "free":
        return "; ".join(f"{name}: asked {asked}, {left} free" for name, asked, left in map(said, short))
    return "; ".join(f"{name}: asked {asked}, {limit_word} {left}" for name, asked, left in map(said, short))


def amount_text(name: str, amount: int | float) -> str:
    """An amount of resource ``name`` as people read it: memory in MiB/GiB, the rest
    as numbers (``fmt_amount``); raw numbers stay in JSON and the API."""
    return size_text(round(amount * 2**20)) if name == MEMORY_MB and amount else fmt_amount(amount)


def resource_label(name: str) -> str:
    """What a resource is called where people read it (``memory_mb`` → ``memory``)."""
    return "memory" if name == MEMORY_MB else name


def size_text(size: int) -> str:
    """A byte count as people read it: B under 1 KiB, else KiB, MiB or GiB."""
    if size < 1024:
        return f"{size} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"
