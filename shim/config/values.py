"""How a config value is read: the parsers each key's declaration names, and their errors.

``knob(default, parse)`` declares a key (sections.py); ``parse(key, value)`` checks a value
read from YAML and returns it, or raises ConfigError naming the dotted key and a short,
escaped prefix of the value.
"""

from __future__ import annotations

import grp
import math
import re
from dataclasses import field
from typing import Any, Callable, Mapping

from ..cri.routing import check_allowed_services
from ..image_patterns import validate_pattern
from ..observability.logs import QUOTE_MAX_CHARS, cut, shown

MIN_MESSAGE_BYTES = 1024
UNIX_PATH_MAX = 107  # bytes of a unix socket path (sun_path holds 108 with the NUL)


class ConfigError(ValueError):
    """A configuration value is wrong. ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


Parse = Callable[[str, Any], Any]  # (dotted key, value from YAML) -> checked value; raises ConfigError


def knob(default: Any, parse: Parse) -> Any:
    """A config key: its default and how a value from the file is checked (``parse(key, value)``).

    The one place a key's default and its bounds are declared: ``from_dict`` walks these."""
    return field(default=default, metadata={"parse": parse})


def required(parse: Parse) -> Any:
    """A key without a default (list items only, e.g. a rule's ``handler``)."""
    return field(metadata={"parse": parse})


def section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"section": cls})


def integer(minimum: int | None = 0) -> Parse:
    return lambda key, v: _int(key, v, minimum)


def _int_in(key: str, v: Any, low: int, high: int) -> int:
    n: int = _int(key, v, low)
    if n > high:
        raise ConfigError(key, f"must be <= {high}, got {shown(v)}")
    return n


def boolean() -> Parse:
    return lambda key, v: _bool(key, v)


def text(*choices: str) -> Parse:
    return lambda key, v: _str(key, v, choices or None)


def duration(*, above: float | None = None, at_least: float | None = None) -> Parse:
    """Seconds (``_duration``), and > ``above`` / >= ``at_least`` when given."""
    def parse(key: str, v: Any) -> float:
        seconds = _duration(key, v)
        if above is not None and seconds <= above:
            raise ConfigError(key, f"must be > {above:g}, got {shown(v)}")
        if at_least is not None and seconds < at_least:
            raise ConfigError(key, f"must be >= {at_least:g}, got {shown(v)}")
        return seconds
    return parse


def size(minimum: int = 0) -> Parse:
    return lambda key, v: _size(key, v, minimum)


def fraction() -> Parse:
    """A number in (0, 1]: a share of something."""
    def parse(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ConfigError(key, f"expected a number above 0 and at most 1 (a share), got {shown(v)}")
        return float(v)
    return parse


def number_in(low: float, high: float) -> Parse:
    """A finite number in [low, high]."""
    def parse(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
            raise ConfigError(key, f"expected a number from {low:g} to {high:g}, got {shown(v)}")
        return float(v)
    return parse


def rate() -> Parse:
    """Requests a second: a finite number >= 0 (0 = no limit)."""
    def parse(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(key, f"expected a number of requests per second >= 0, got {shown(v)}")
        return float(v)
    return parse


def strings(*, none_is_empty: bool = False) -> Parse:
    def parse(key: str, v: Any) -> tuple[str, ...]:
        return () if v is None and none_is_empty else _str_list(key, v)
    return parse


def image_patterns(*, none_is_empty: bool = False) -> Parse:
    """Image patterns (shim/image_patterns.py), each checked to have a normal form."""
    def parse(key: str, v: Any) -> tuple[str, ...]:
        patterns = () if v is None and none_is_empty else _str_list(key, v)
        for i, pattern in enumerate(patterns):
            try:
                validate_pattern(pattern)
            except ValueError as e:
                raise ConfigError(f"{key}[{i}]", f"{e} (got {shown(pattern)})") from None
        return patterns
    return parse


# --------------------------------------------------------------------------- parsing helpers

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _int(key: str, v: Any, minimum: int | None = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(key, f"expected an integer, got {shown(v)}")
    if minimum is not None and v < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {shown(v)}")
    return v


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(key, f"expected true or false, got {shown(v)}")
    return v


def _str(key: str, v: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(v, str):
        raise ConfigError(key, f"expected a string, got {shown(v)}")
    if "\x00" in v:
        raise ConfigError(key, f"must not contain a NUL byte, got {shown(v)}")
    if choices is not None and v not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}, got {shown(v)}")
    return v


def _duration(key: str, v: Any) -> float:
    """Seconds as a number, or a string like ``500ms``, ``2s``, ``1m``."""
    if isinstance(v, bool):
        raise ConfigError(key, f"expected a duration (seconds, or e.g. '500ms', '2s'), got {shown(v)}")
    if isinstance(v, (int, float)):
        seconds = float(v)
    elif isinstance(v, str) and (m := _DURATION.match(v)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(key, f"expected a duration (seconds, or e.g. '500ms', '2s'), got {shown(v)}")
    if not math.isfinite(seconds):
        raise ConfigError(key, f"must be a finite number of seconds, got {shown(v)}")
    if seconds < 0:
        raise ConfigError(key, f"must be >= 0, got {shown(v)}")
    return seconds


def _size(key: str, v: Any, minimum: int = 0) -> int:
    """Bytes as an integer, or a string like ``10GiB``, ``500M``."""
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, str) and (m := _SIZE.match(v)):
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
    else:
        raise ConfigError(key, f"expected a size in bytes (e.g. 1073741824 or '10GiB'), got {shown(v)}")
    if n < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {shown(v)}")
    return n


def _list_of(key: str, v: Any, item: Parse, what: str) -> tuple[Any, ...]:
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of {what}, got {shown(v)}")
    return tuple(item(f"{key}[{i}]", x) for i, x in enumerate(v))


def _str_list(key: str, v: Any) -> tuple[str, ...]:
    return _list_of(key, v, _str, "strings")


def _str_map(key: str, v: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(v, dict):
        raise ConfigError(key, f"expected a map of strings, got {shown(v)}")
    out = []
    for k, val in v.items():
        _str(f"{key}", k)
        out.append((k, _str(f"{key}.{cut(k, QUOTE_MAX_CHARS)}", val)))
    return tuple(sorted(out))


def _mapping(key: str, v: Any) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(key, f"expected a map, got {shown(v)}")
    return v


def _check_keys(prefix: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    for k in data:
        if k not in allowed:
            k = cut(k, QUOTE_MAX_CHARS)
            path = f"{prefix}.{k}" if prefix else k
            raise ConfigError(path, f"unknown key (known: {', '.join(sorted(allowed))})")


def _endpoint(key: str, v: Any) -> str:
    s = _str(key, v)
    if not s.startswith("unix://") or len(s) <= len("unix://"):
        raise ConfigError(key, f"expected a unix socket endpoint like unix:///run/x.sock, got {shown(v)}")
    if len(socket_path(s).encode()) > UNIX_PATH_MAX:
        raise ConfigError(key, f"a unix socket path has at most {UNIX_PATH_MAX} bytes, got {shown(v)}")
    return s


def _socket_mode(key: str, v: Any) -> int:
    if isinstance(v, str) and re.fullmatch(r"0?[0-7]{3}", v):
        return int(v, 8)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0o777:
        return v
    raise ConfigError(key, f"expected an octal mode string like '0660', got {shown(v)}")


def _host_port(key: str, v: Any) -> str:
    s = _str(key, v)
    if s == "":
        return s
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, f"expected host:port like 127.0.0.1:9464, got {shown(v)}")
    return s


MAX_UID = 2**32 - 2  # (uid_t) -1 is no uid


def _uids(key: str, v: Any) -> tuple[int, ...]:
    def uid(k: str, x: Any) -> int:
        n = _int(k, x)
        if n > MAX_UID:
            raise ConfigError(k, f"must be a uid (0 to {MAX_UID}), got {shown(x)}")
        return n
    return _list_of(key, v, uid, "numeric uids")


def _allowed_services(key: str, v: Any) -> tuple[str, ...]:
    try:
        return check_allowed_services(_str_list(key, v))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(key, str(e)) from None


def _group(key: str, v: Any) -> str:
    """A numeric gid, or the name of a group that exists here; empty: the process's group."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return str(v)
    s = _str(key, v)
    if s and not s.isdigit():
        try:
            grp.getgrnam(s)
        except KeyError:
            raise ConfigError(key, f"no such group {shown(s)}") from None
    return s


def _nonempty(key: str, v: Any) -> str:
    s = _str(key, v)
    if not s:
        raise ConfigError(key, "must not be empty")
    return s


def _request_bytes(key: str, v: Any) -> tuple[tuple[str, int], ...]:
    """server.max_request_bytes as written: CRI method name -> size (merged over the defaults in _check_server)."""
    from ..cri.methods import (
        KNOWN_METHODS,  # local import: the proto module is only needed here
    )

    names = {p.rsplit("/", 1)[1] for p in KNOWN_METHODS}
    out = {}
    for name, size_ in _mapping(key, v).items():
        k = f"{key}.{cut(str(name), QUOTE_MAX_CHARS)}"
        if name not in names:
            raise ConfigError(k, "not a CRI method name (e.g. PullImage)")
        out[name] = _size(k, size_, minimum=MIN_MESSAGE_BYTES)
    return tuple(sorted(out.items()))


def socket_path(endpoint: str) -> str:
    """``unix:///run/x.sock`` -> ``/run/x.sock``."""
    return endpoint[len("unix://"):]
