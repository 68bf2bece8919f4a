"""Structured logs: one JSON object (or one ``key=value`` text line) per record.

Code logs with ``logger.info("round decided", extra={"group": ..., ...})``;
the formatters print every such extra field, so a decision line carries its
group, round, ranks and layer as separate, searchable fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

__all__ = [
    "LOGGER_NAME",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "extra_fields",
    "resolve_log_format",
]

LOGGER_NAME = "moe_sidecar"
"""Every sidecar module logs under this logger (``moe_sidecar.<module>``)."""

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields passed to a log call through ``extra``."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        document.update(extra_fields(record))
        if record.exc_info:
            document["traceback"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` for people at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v!r}" for k, v in extra_fields(record).items())
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if fields:
            line += " " + fields
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def resolve_log_format(log_format: str, stream: TextIO | None = None) -> str:
    """``json`` or ``text``: ``auto`` is text when ``stream`` (stderr) is a
    terminal, where a person reads it, and JSON otherwise (a container's log,
    a file, a pipe), where a machine does.

    Raises:
        ValueError: ``log_format`` is not ``auto``, ``json`` or ``text``.
    """
    if log_format == "auto":
        target = stream if stream is not None else sys.stderr
        return "text" if target.isatty() else "json"
    if log_format not in ("json", "text"):
        raise ValueError(f"log_format={log_format!r}: must be 'auto', 'json' or 'text'")
    return log_format


def configure_logging(log_format: str, level: str, stream: TextIO | None = None) -> None:
    """Sends the sidecar's logs to ``stream`` (stderr) in ``log_format``
    (``auto``: see :func:`resolve_log_format`).

    Replaces handlers installed by an earlier call, so calling it twice
    does not print every line twice.

    Raises:
        ValueError: ``log_format`` is not ``auto``, ``json`` or ``text``.
    """
    resolved = resolve_log_format(log_format, stream)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if resolved == "json" else TextFormatter())
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
