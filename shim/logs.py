"""Logging: one line per notable event, key=value (default) or JSON.

Call sites pass structured fields with ``log(logger, level, event, **fields)``; the
formatter renders them. Field values are never credentials: callers pass only
references, handlers, counts and codes (see tests for the no-credential check).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, "fields", {}) or {}


def _quote(v: Any) -> str:
    s = str(v)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return json.dumps(s)
    return s


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"time={ts}", f"level={record.levelname.lower()}", f"msg={_quote(record.getMessage())}"]
        parts += [f"{k}={_quote(v)}" for k, v in _fields(record).items()]
        if record.exc_info:
            parts.append(f"error={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        out.update({k: v if isinstance(v, (int, float, bool)) or v is None else str(v)
                    for k, v in _fields(record).items()})
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root 'cri_shim' logger; safe to call again on reload."""
    root = logging.getLogger("cri_shim")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # The OpenTelemetry SDK reports export trouble (collector down, ...) on its own loggers:
    # same format, warnings and worse only.
    otel = logging.getLogger("opentelemetry")
    otel.handlers[:] = [handler]
    otel.setLevel(max(logging.WARNING, root.level))
    otel.propagate = False


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"cri_shim.{name}")


def log(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields}, stacklevel=2)
