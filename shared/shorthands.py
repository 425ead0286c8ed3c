"""Command-line shorthands for constraints and KEY=VALUE pairs, into wire values. Pure."""

from __future__ import annotations

import re

from irisfed.shared.constraints import Constraint, ConstraintError, ConstraintOp, as_number
from irisfed.shared.errors import ConfigError, InvalidRequest
from irisfed.shared.messages import MAX_ARRAY

_OPERATOR = re.compile(r"^\s*([^=!<>\s]+)\s*(==|=|!=|>=|<=|>|<)\s*(.*?)\s*$")
_SYMBOLS = {
    "=": ConstraintOp.EQ, "==": ConstraintOp.EQ, "!=": ConstraintOp.NE,
    ">=": ConstraintOp.GE, "<=": ConstraintOp.LE, ">": ConstraintOp.GT, "<": ConstraintOp.LT,
}
CONSTRAINT_HELP = (
    "KEY=VALUE, KEY!=VALUE, KEY>=N, KEY<=N, KEY>N, KEY<N, KEY=in:A,B, exists:KEY, not_exists:KEY"
)


def parse_constraint(text: str) -> Constraint:
    """``device_type=gpu``, ``memory_gb>=80``, ``zone=in:a,b``, ``exists:spot`` → Constraint."""
    try:
        for prefix, op in (("not_exists:", ConstraintOp.NOT_EXISTS), ("exists:", ConstraintOp.EXISTS)):
            if text.startswith(prefix):
                return Constraint(text[len(prefix):].strip(), op)
        match = _OPERATOR.match(text)
        if not match:
            raise InvalidRequest(f"cannot read constraint {text!r}; use {CONSTRAINT_HELP}")
        key, symbol, value = match.groups()
        op = _SYMBOLS[symbol]
        if op is ConstraintOp.EQ and value.startswith("in:"):
            items = [item.strip() for item in value[3:].split(",") if item.strip()]
            return Constraint(key, ConstraintOp.IN, items)
        if op in (ConstraintOp.GT, ConstraintOp.GE, ConstraintOp.LT, ConstraintOp.LE):
            number = as_number(value)
            if number is None:
                raise InvalidRequest(f"constraint {text!r}: {symbol} needs a number, got {value!r}")
            return Constraint(key, op, int(number) if number.is_integer() else number)
        return Constraint(key, op, value)
    except ConstraintError as exc:
        raise InvalidRequest(f"constraint {text!r}: {exc}") from None


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``["A=1", "B=2"]`` → ``{"A": "1", "B": "2"}``."""
    result: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what} {item!r} must look like KEY=VALUE")
        result[key.strip()] = value
    return result


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_PARTS = re.compile(r"^(?:\d+(?:\.\d+)?[smhd])+$")  # 1h30m, 1m30s
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str, zero: bool = False) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` → seconds (more than 0; ``zero``:
    0 too); ConfigError naming ``flag`` otherwise."""
    match = _DURATION.match(text or "")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else -1.0
    if not match and _PARTS.match((text or "").strip()):
        seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _PART.findall(text))
    if seconds < 0 or seconds == 0 and not zero:
        raise ConfigError(f"{flag} must be a duration like 90s, 30m, 2h or 1d, got {text!r}")
    return seconds


def duration_words(seconds: float) -> str:
    """A duration as ``parse_duration`` reads it back: ``90s``, ``30m``, ``1h30m``, ``2h``,
    ``1d``; fractions of a second kept (``0.5s``)."""
    if seconds == 0:
        return "0s"  # -0.0 too
    if seconds != int(seconds) or seconds < 60:
        return f"{round(seconds, 3):g}s"
    whole, parts = int(seconds), []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)


_ARRAY = re.compile(r"^\s*(\d{1,6})\s*(?:%\s*(\d{1,6})\s*)?$")


def parse_array(text: str, flag: str = "--array") -> tuple[int, int | None]:
    """``6`` → (6, None); ``6%2`` → (6, 2): an array's size and how many may be live at
    once (docs/design.md §3.8); ConfigError naming ``flag`` otherwise."""
    match = _ARRAY.match(text or "")
    size = int(match.group(1)) if match else 0
    parallel = int(match.group(2)) if match and match.group(2) else None
    if not 1 <= size <= MAX_ARRAY or (parallel is not None and not 1 <= parallel <= MAX_ARRAY):
        raise ConfigError(f"{flag} must be N or N%K with N and K from 1 to {MAX_ARRAY:,} (6, or 6%2: six "
                          f"jobs, two at a time), got {text!r}")
    return size, parallel
