"""Log volume a client can cause is bounded: client strings are cut in every line, lines of one
kind are rate-limited with a count of those dropped, and an image name longer than any image
reference is refused with INVALID_ARGUMENT before it reaches a log (or the runtime).
(The same through a shim process: tests/process/test_log_bounds.py.)"""

from __future__ import annotations

import json
import logging

import pytest

from shim.observability import logs



def record(msg: str = "pull refused", level: int = logging.INFO, name: str = "cri_shim.pull",
           exc: BaseException | None = None, **fields: object) -> logging.LogRecord:
    r = logging.LogRecord(name, level, __file__, 1, msg, (), (type(exc), exc, None) if exc else None)
    r.fields = fields  # type: ignore[attr-defined]
    return r


@pytest.mark.parametrize("formatter", [logs.KeyValueFormatter(), logs.JsonFormatter()], ids=["text", "json"])
def test_every_field_and_error_line_is_cut(formatter: logging.Formatter) -> None:
    huge = "a" * (1 << 20)
    try:
        raise ValueError(f"bad name {huge}")
    except ValueError as e:
        err = e
    line = formatter.format(record(image=huge, method="/" + huge, exc=err, count=3))
    assert len(line) < 5 * logs.FIELD_MAX_CHARS
    assert line.count(f"[{(1 << 20) - logs.FIELD_MAX_CHARS} more chars]") == 1  # image
    if isinstance(formatter, logs.JsonFormatter):
        assert json.loads(line)["count"] == 3
    short = formatter.format(record(image="docker.io/library/nginx:1"))
    assert "docker.io/library/nginx:1" in short and "more chars" not in short


def test_shown_quotes_a_short_escaped_part() -> None:
    assert logs.shown("ab\ncd") == "'ab\\ncd'"
    assert len(logs.shown("x" * 10**6)) <= logs.QUOTE_MAX_CHARS + 2
    nested = [[["deep"] * 10**4] * 10**4]  # formatting it whole would take minutes
    assert len(logs.shown(nested)) < 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_of_one_kind_are_rate_limited_with_a_count() -> None:
    clock = Clock()
    limit = logs.RateLimit(max_repeats=20, window=10.0, clock=clock)
    passed = [r for r in (record(image=f"i{i}") for i in range(50)) if limit.filter(r)]
    assert len(passed) == 20 and all("suppressed" not in r.fields for r in passed)  # type: ignore[attr-defined]
    assert limit.filter(record("another kind"))  # kinds are counted apart
    assert all(limit.filter(record(level=logging.DEBUG)) for _ in range(100))  # debug is not limited
    clock.now += 9.9
    assert not limit.filter(record())
    clock.now += 0.1  # a new window: the first line says how many were dropped
    first = record()
    assert limit.filter(first) and first.fields["suppressed"] == 31  # type: ignore[attr-defined]
    second = record()
    assert limit.filter(second) and "suppressed" not in second.fields  # type: ignore[attr-defined]
    off = logs.RateLimit(max_repeats=0, window=10.0, clock=clock)
    assert all(off.filter(record()) for _ in range(100))




