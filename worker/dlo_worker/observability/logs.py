"""Structured, quiet-by-default logging for the worker.

Every record is one line of ``key=value`` pairs so log collectors can parse it
without a schema; extra fields passed as ``logger.info("msg", extra={"fields": {...}})``
are appended. The default level is WARNING: a healthy run prints only its result
and its progress bars.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "DLO_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


def _quote(value: object) -> str:
    text = str(value)
    if not text or any(ch in text for ch in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        pairs.update(getattr(record, "fields", {}))
        line = " ".join(f"{key}={_quote(value)}" for key, value in pairs.items())
        if record.exc_info:
            line += " exc=" + _quote(self.formatException(record.exc_info))
        return line


def default_level() -> str:
    """The level from ``$DLO_LOG_LEVEL`` when it names one, else ``warning``."""
    level = os.environ.get(LOG_LEVEL_ENV, "warning").lower()
    return level if level in LEVELS else "warning"


def configure(level: str) -> None:
    """Route the worker's (and diffusers') logs to stderr in key=value form."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
