"""Job placement constraints and how they match a backend's advertised attributes.

A backend advertises ``attributes: {key: [values...]}``. A constraint holds for a
backend when *some* advertised value of its key satisfies it:

- EQ / NE: trimmed, case-insensitive string comparison; when both sides read as
  numbers they compare numerically (``"8" == 8.0``).
- GT / GE / LT / LE: numeric only; the constraint's value must be a number (or a
  numeric string) and advertised values that are not numbers never satisfy it.
- IN: the value is a non-empty list; holds when an advertised value equals any item.
- EXISTS: the key is advertised. NOT_EXISTS: it is not.
- A missing key fails every op except NOT_EXISTS.

Malformed constraints raise :class:`ConstraintError` at construction, so a bad
constraint is a submit-time error and never silently false.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple

Scalar = str | int | float
Attributes = Mapping[str, Sequence[Scalar]]

MAX_KEY_LENGTH = 128


class ConstraintError(ValueError):
    """A constraint that cannot be evaluated; the message says what to fix."""


class Mismatch(NamedTuple):
    """Why a backend fails a constraint: ``code`` is machine-readable, ``detail`` human."""

    code: str  # "missing_attribute" | "unwanted_attribute" | "value_mismatch"
    detail: str


class ConstraintOp(StrEnum):
    """Comparison operators. Persisted and on the wire as these values: append only."""

    EQ = "eq"
    NE = "ne"
    EXISTS = "exists"
    NOT_EXISTS = "not_exists"
    GT = "gt"
    GE = "ge"
    LT = "lt"
    LE = "le"
    IN = "in"


_NUMERIC_OPS = frozenset({ConstraintOp.GT, ConstraintOp.GE, ConstraintOp.LT, ConstraintOp.LE})
_PRESENCE_OPS = frozenset({ConstraintOp.EXISTS, ConstraintOp.NOT_EXISTS})


@lru_cache(maxsize=8192)
def _normalize_str(text: str) -> str:
    return text.strip().casefold()


def normalize_text(value: Scalar) -> str:
    """The comparable form of a string attribute: trimmed and case-folded."""
    return _normalize_str(value if isinstance(value, str) else str(value))


@lru_cache(maxsize=8192)
def _parse_number(text: str) -> float | None:
    try:
        number = float(text.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def as_number(value: Scalar) -> float | None:
    """A finite float for numbers and numeric strings; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
        return number if math.isfinite(number) else None
    # Attribute values repeat endlessly across submits: parse each string once.
    return _parse_number(str(value))


def _is_scalar(value: object) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _values_equal(advertised: Scalar, wanted: Scalar) -> bool:
    a_num, w_num = as_number(advertised), as_number(wanted)
    if a_num is not None and w_num is not None:
        return a_num == w_num
    return normalize_text(advertised) == normalize_text(wanted)


@dataclass(frozen=True, slots=True)
class Constraint:
    """One requirement on a backend's attributes, e.g. ``device_type eq gpu``."""

    key: str
    op: ConstraintOp
    value: Scalar | list[Scalar] | tuple[Scalar, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key.strip():
            raise ConstraintError("constraint key must be a non-empty string")
        if len(self.key) > MAX_KEY_LENGTH:
            raise ConstraintError(f"constraint key longer than {MAX_KEY_LENGTH} characters")
        try:
            op = ConstraintOp(self.op)
        except ValueError:
            known = ", ".join(o.value for o in ConstraintOp)
            raise ConstraintError(f"unknown constraint op {self.op!r} (known: {known})") from None
        object.__setattr__(self, "op", op)
        value = self.value
        where = f"constraint {self.key!r} {op.value}"
        if op in _PRESENCE_OPS:
            if value is not None:
                raise ConstraintError(f"{where} takes no value")
        elif op is ConstraintOp.IN:
            if not isinstance(value, list | tuple) or not value:
                raise ConstraintError(f"{where} needs a non-empty list of values")
            if not all(_is_scalar(item) for item in value):
                raise ConstraintError(f"{where}: every item must be a string or a number")
            object.__setattr__(self, "value", tuple(value))
        elif op in _NUMERIC_OPS:
            if not _is_scalar(value) or as_number(value) is None:
                raise ConstraintError(f"{where} needs a numeric value, got {value!r}")
        else:  # EQ, NE
            if not _is_scalar(value):
                raise ConstraintError(f"{where} needs a string or number value, got {value!r}")

    def holds_for(self, attributes: Attributes) -> bool:
        """Whether a backend advertising ``attributes`` satisfies this constraint."""
        return self.mismatch(attributes) is None

    def mismatch(self, attributes: Attributes) -> Mismatch | None:
        """Why ``attributes`` fail this constraint, or None when they satisfy it."""
        values = _lookup(attributes, self.key)
        op = self.op
        if op is ConstraintOp.NOT_EXISTS:
            if values is None:
                return None
            return Mismatch("unwanted_attribute", f"advertises {self.key!r} (must not)")
        if values is None:
            return Mismatch("missing_attribute", f"missing attribute {self.key!r}")
        if op is ConstraintOp.EXISTS:
            return None
        if any(self._value_holds(v) for v in values):
            return None
        shown = ", ".join(str(v) for v in values) or "no values"
        return Mismatch("value_mismatch", f"{self.key}=[{shown}] does not satisfy {self.describe()}")

    def _value_holds(self, advertised: Scalar) -> bool:
        op, wanted = self.op, self.value
        if op is ConstraintOp.EQ:
            return _values_equal(advertised, wanted)
        if op is ConstraintOp.NE:
            return not _values_equal(advertised, wanted)
        if op is ConstraintOp.IN:
            return any(_values_equal(advertised, item) for item in wanted)
        number = as_number(advertised)
        if number is None:
            return False
        limit = as_number(wanted)
        if op is ConstraintOp.GT:
            return number > limit
        if op is ConstraintOp.GE:
            return number >= limit
        if op is ConstraintOp.LT:
            return number < limit
        return number <= limit

    def describe(self) -> str:
        """A short human form, e.g. ``device_type == gpu`` or ``zone in [a, b]``."""
        symbol = {
            ConstraintOp.EQ: "==",
            ConstraintOp.NE: "!=",
            ConstraintOp.GT: ">",
            ConstraintOp.GE: ">=",
            ConstraintOp.LT: "<",
            ConstraintOp.LE: "<=",
        }.get(self.op)
        if symbol:
            return f"{self.key} {symbol} {self.value}"
        if self.op is ConstraintOp.IN:
            return f"{self.key} in [{', '.join(str(v) for v in self.value)}]"
        return f"{self.op.value}({self.key})"

    def to_wire(self) -> dict:
        """The wire form ``{"key", "op", "value"}`` (value omitted for presence ops)."""
        body: dict = {"key": self.key, "op": self.op.value}
        if self.value is not None:
            body["value"] = list(self.value) if isinstance(self.value, tuple) else self.value
        return body


def _lookup(attributes: Attributes, key: str) -> Sequence[Scalar] | None:
    """Advertised values for ``key``, matching keys trimmed and case-insensitively."""
    if key in attributes:
        return attributes[key]
    wanted = normalize_text(key)
    for name, values in attributes.items():
        if normalize_text(name) == wanted:
            return values
    return None


def first_mismatch(constraints: Sequence[Constraint], attributes: Attributes) -> Mismatch | None:
    """The first reason ``attributes`` fail ``constraints``, or None when all hold."""
    for constraint in constraints:
        reason = constraint.mismatch(attributes)
        if reason is not None:
            return reason
    return None


def matches_all(constraints: Sequence[Constraint], attributes: Attributes) -> bool:
    """Whether every constraint holds for a backend advertising ``attributes``."""
    return first_mismatch(constraints, attributes) is None
