"""Structured logs: one line per event, JSON when stderr is not a terminal.

``log.info("job_assigned", job_id=..., peer_id=..., epoch=...)`` — the first
argument names the event; fields carry the ids an operator greps for.
Every line, tracebacks included, passes through :func:`redact` on its way out,
so no URL password or token reaches a log.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec

from irisfed.shared.redact import redact

_json = msgspec.json.Encoder()


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        if self.as_json:
            body = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "service": record.name,
                "event": record.getMessage(),
                **fields,
            }
            if record.exc_info:
                body["error"] = self.formatException(record.exc_info)
            return redact(_json.encode(body).decode())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()} {extras}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class EventLogger:
    """A logger whose calls name an event and attach key=value fields."""

    def __init__(self, service: str) -> None:
        self._logger = logging.getLogger(service)

    def _log(self, level: int, event: str, exc_info: bool = False, **fields: Any) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={"fields": fields}, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, **fields)

    def error(self, event: str, exc_info: bool = False, **fields: Any) -> None:
        self._log(logging.ERROR, event, exc_info=exc_info, **fields)


def setup_logging(level: str = "info", as_json: bool | None = None) -> None:
    """Route every log line to stderr in our format."""
    if as_json is None:
        as_json = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The NATS client logs reconnect noise at INFO; our own events say what matters.
    logging.getLogger("nats").setLevel(logging.WARNING)
