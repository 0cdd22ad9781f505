"""Logs for operators: readable text by default, JSON lines when asked. Either way a line
carries the context it was logged with (request id, session id, weight version, ...), and
the replica it came from (`ROLLOUT_REPLICA`, set by the pool that started it).

Children started afterwards (replicas) log the same way: the settings travel in the
environment.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
FORMAT_VARIABLE, LEVEL_VARIABLE = "ROLLOUT_LOG_FORMAT", "ROLLOUT_LOG_LEVEL"
REPLICA_VARIABLE = "ROLLOUT_REPLICA"
# what every LogRecord has; anything else on a record is context passed with `extra=`
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def context(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and v is not None}


class _Replica(logging.Filter):
    def __init__(self, replica: str | None):
        super().__init__()
        self.replica = replica

    def filter(self, record: logging.LogRecord) -> bool:
        if self.replica and not hasattr(record, "replica"):
            record.replica = self.replica
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                .isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage(), **context(record)}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = " ".join(f"{k}={v}" for k, v in context(record).items())
        if not fields:
            return text
        head, newline, tail = text.partition("\n")  # after the message, before a traceback
        return f"{head} [{fields}]{newline}{tail}"


def log_settings() -> dict[str, str]:
    """The log settings of this process, for a child started where its environment does
    not reach (a Ray actor)."""
    return {v: os.environ[v] for v in (FORMAT_VARIABLE, LEVEL_VARIABLE) if v in os.environ}


def configure(format: str | None = None, level: str | None = None) -> None:
    """Send rollout's logs to stderr in `format` at `level` (defaults: the environment's,
    else text at info), and hand both to child processes."""
    format = (format or os.environ.get(FORMAT_VARIABLE) or "text").lower()
    level = (level or os.environ.get(LEVEL_VARIABLE) or "info").lower()
    if format not in FORMATS:
        raise ValueError(f"log format {format!r} (allowed: {', '.join(FORMATS)})")
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} (allowed: {', '.join(LEVELS)})")
    os.environ[FORMAT_VARIABLE], os.environ[LEVEL_VARIABLE] = format, level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    handler.addFilter(_Replica(os.environ.get(REPLICA_VARIABLE)))
    logger = logging.getLogger("rollout")
    for old in [h for h in logger.handlers if getattr(h, "_rollout", False)]:
        logger.removeHandler(old)
    handler._rollout = True
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
