"""Command-line shorthands for constraints and KEY=VALUE pairs, into wire values. Pure."""

from __future__ import annotations

import re

from irisfed.shared.constraints import Constraint, ConstraintError, ConstraintOp, as_number
from irisfed.shared.errors import ConfigError, InvalidRequest

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
_UNIT_S = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` → seconds (more than 0); ConfigError naming
    ``flag`` otherwise."""
    match = _DURATION.match(text or "")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise ConfigError(f"{flag} must be a duration like 90s, 30m, 2h or 1d, got {text!r}")
    return seconds
