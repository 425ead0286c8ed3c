"""Checks for service settings: a value that cannot work is a ``ConfigError`` at start.

Each message names the setting, the command-line flag that sets it (when there is
one) and the value given, e.g. ``router setting writers (--writers) must be a whole
number >= 1, got 0`` — rather than a service that starts and never answers.
"""

from __future__ import annotations

import math

from irisfed.shared.errors import ConfigError


def _named(owner: str, name: str, flag: str) -> str:
    return f"{owner} setting {name}" + (f" ({flag})" if flag else "")


def require_count(owner: str, name: str, value: object, least: int = 1, flag: str = "",
                  most: int | None = None) -> None:
    """``value`` must be a whole number >= ``least`` (and <= ``most``, when given)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < least
            or (most is not None and value > most)):
        bound = f">= {least}" if most is None else f"{least}..{most}"
        raise ConfigError(f"{_named(owner, name, flag)} must be a whole number {bound}, got {value!r}")


def require_seconds(owner: str, name: str, value: object, positive: bool = True, flag: str = "") -> None:
    """``value`` must be a finite number of seconds above 0 (``positive``) or at least 0."""
    ok = (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        bound = "above 0" if positive else ">= 0"
        raise ConfigError(f"{_named(owner, name, flag)} must be a number of seconds {bound}, got {value!r}")


def require_port(owner: str, name: str, value: object, least: int = 1, flag: str = "") -> None:
    """``value`` must be a TCP port number from ``least`` (0: the system picks one) to 65535."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 65535:
        raise ConfigError(f"{_named(owner, name, flag)} must be a port {least}..65535, got {value!r}")
