"""Logging: one line per notable event, key=value (default) or JSON.

Call sites pass structured fields with ``log(logger, level, event, **fields)``; the
formatter renders them. Field values are never credentials: callers pass only
references, handlers, counts and codes (see tests for the no-credential check).

Bounds (README "Limits"): every field value, and every line of an exception's text, is cut
to FIELD_MAX_CHARS, so a client string (an image name, a method path) cannot make a long
line; lines at info and above are rate-limited per kind (logger and message) by
:class:`RateLimit`. Error messages quote an offending value through :func:`shown`.
"""

from __future__ import annotations

import json
import logging
import reprlib
import sys
import time
from typing import Any, Callable

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


FIELD_MAX_CHARS = 1024  # a log field's value (the longest valid image reference has 526)
QUOTE_MAX_CHARS = 100  # what an error message quotes of an offending value
DEFAULT_MAX_REPEATS = 20  # log.max_repeats
DEFAULT_REPEAT_WINDOW_SECONDS = 10.0  # log.repeat_window_seconds
_MAX_KINDS = 1024  # kinds of line the rate limit remembers


def cut(v: Any, limit: int = FIELD_MAX_CHARS) -> str:
    """``v`` as text, at most ``limit`` characters of it plus a note of how much was cut."""
    s = v if isinstance(v, str) else str(v)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}...[{len(s) - limit} more chars]"


def _cut_lines(text: str) -> str:
    return "\n".join(cut(line) for line in text.split("\n"))


def _shown_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = QUOTE_MAX_CHARS
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 2, 4, 4, 4, 4
    return r


_SHOWN = _shown_repr()  # a formatter with fixed settings, not state


def shown(v: Any) -> str:
    """An offending value as an error message quotes it: escaped, and at most a short part of
    it (a long string keeps its start and end around ``...``; big maps and lists are elided)
    without formatting the whole value first."""
    return _SHOWN.repr(v)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, "fields", {}) or {}


def _quote(v: Any) -> str:
    s = cut(v)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return json.dumps(s)
    return s


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"time={ts}", f"level={record.levelname.lower()}", f"msg={_quote(record.getMessage())}"]
        parts += [f"{k}={_quote(v)}" for k, v in _fields(record).items()]
        if record.exc_info:
            parts.append(f"error={json.dumps(_cut_lines(self.formatException(record.exc_info)))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "msg": cut(record.getMessage()),
        }
        out.update({k: v if isinstance(v, (int, float, bool)) or v is None else cut(v)
                    for k, v in _fields(record).items()})
        if record.exc_info:
            out["error"] = _cut_lines(self.formatException(record.exc_info))
        return json.dumps(out)


class RateLimit(logging.Filter):
    """Lines at info and above: at most ``max_repeats`` of one kind (same logger and message)
    per ``window`` seconds; the rest are dropped and counted, and the next line of that kind
    that is written carries ``suppressed=<count>``. Debug lines are not limited.
    ``max_repeats`` 0: no limit. (The relay's listener also keeps its own one-line-per-10-s
    warnings, ``_RateLimited`` in shim/relay/listener.py, which this filter then sees rarely.)"""

    def __init__(self, max_repeats: int = DEFAULT_MAX_REPEATS, window: float = DEFAULT_REPEAT_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.max_repeats = max_repeats
        self.window = window
        self._clock = clock
        self._kinds: dict[tuple[str, str], list[float]] = {}  # kind -> [window start, lines, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.max_repeats <= 0 or record.levelno < logging.INFO:
            return True
        kind = (record.name, str(record.msg))
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] >= self.window:
            dropped = state[2] if state is not None else 0
            if state is None and len(self._kinds) >= _MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]  # the oldest kind seen
            state = self._kinds[kind] = [now, 0, dropped]
        if state[1] >= self.max_repeats:
            state[2] += 1
            return False
        state[1] += 1
        if state[2]:
            record.fields = {**_fields(record), "suppressed": int(state[2])}
            state[2] = 0
        return True


def setup(level: str = "info", fmt: str = "text", max_repeats: int = DEFAULT_MAX_REPEATS,
          repeat_window_seconds: float = DEFAULT_REPEAT_WINDOW_SECONDS) -> None:
    """Configure the root 'cri_shim' logger; safe to call again on reload."""
    root = logging.getLogger("cri_shim")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(RateLimit(max_repeats, repeat_window_seconds))
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
