"""Configuration: validated, frozen dataclasses, all in one place.

The file is YAML. Each key is declared once, as a dataclass field whose metadata holds
its check (``knob(default, parse)``): ``from_dict`` walks the fields, so a key's default,
type and bounds live on one line. Cross-key rules (``_CHECKS``) run after a section's
keys. An unknown key or a bad value raises ConfigError naming the key path
(``pulls.max_parallel``) and a short, escaped prefix of the value. A missing or empty
file means the defaults.

Why one module of ~600 lines: every key of the file lives here and nowhere else (the
project rule "config as validated dataclasses in one place"); the parsers are the
vocabulary the field declarations use.
"""

from __future__ import annotations

import dataclasses
import grp
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import yaml

from . import safeyaml
from .cri.routing import check_allowed_services
from .image_patterns import validate_pattern
from .observability.logs import (
    DEFAULT_MAX_REPEATS,
    DEFAULT_REPEAT_WINDOW_SECONDS,
    QUOTE_MAX_CHARS,
    cut,
    shown,
)
from .safeyaml import CONFIG_MAX_BYTES, TooBig, UnsafeYaml, read_capped

DEFAULT_LISTEN = "unix:///run/cri-shim/cri-shim.sock"
DEFAULT_UPSTREAM = "unix:///run/containerd/containerd.sock"
DEFAULT_ADMIN_SOCKET = "/run/cri-shim/admin.sock"
KUBELET_MAX_MESSAGE = 16 * 1024 * 1024
MIN_MESSAGE_BYTES = 1024
UNIX_PATH_MAX = 107  # bytes of a unix socket path (sun_path holds 108 with the NUL)
# Request message bytes per intercepted method (server.max_request_bytes); others: server.max_message_bytes.
# kubelet builds these from a pod (an API object: 1.5 MiB at most, etcd's default request
# limit; its annotations 256 KiB): a PodSandboxConfig is below 2 MiB, an ImageSpec (image,
# the pod's annotations, runtime handler) below 512 KiB. Twice that, for headroom.
DEFAULT_MAX_REQUEST_BYTES: dict[str, int] = {
    "PullImage": 4 << 20,  # ImageSpec + AuthConfig + PodSandboxConfig
    "RunPodSandbox": 4 << 20,  # PodSandboxConfig + runtime handler
    "ImageStatus": 1 << 20,  # ImageSpec
    "RemoveImage": 1 << 20,  # ImageSpec
    "ListImages": 1 << 20,  # a filter: ImageSpec
    "StreamImages": 1 << 20,
    "RemovePodSandbox": 64 << 10,  # a sandbox ID
}


class ConfigError(ValueError):
    """A configuration value is wrong. ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


MAX_STATUS_ROWS = 120  # cluster.status_max_rows: 120 worst-case rows (1.7 KiB each) keep the object under 256 KiB
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


@dataclass(frozen=True)
class ServerConfig:
    socket_mode: int = knob(0o660, lambda k, v: _socket_mode(k, v))
    socket_group: str = knob("", lambda k, v: _group(k, v))  # group name or numeric gid; empty: the process's own
    max_message_bytes: int = knob(KUBELET_MAX_MESSAGE, size(MIN_MESSAGE_BYTES))
    shutdown_grace_seconds: float = knob(10.0, duration())
    admin_socket: str = knob(DEFAULT_ADMIN_SOCKET, text())  # for `cri-shim status`; empty: off
    uvloop: bool = knob(True, boolean())
    engine: str = knob("relay", text("relay", "grpc"))  # relay: HTTP/2 frame relay (fast); grpc: grpc.aio proxy
    # relay bounds (README "Limits")
    max_connections: int = knob(256, integer(1))
    listen_backlog: int = knob(1024, integer(1))
    max_header_list_bytes: int = knob(64 * 1024, size(4096))
    max_intercepted_streams: int = knob(100, integer(1))
    max_concurrent_streams: int = knob(100, integer(1))
    path_cache_bytes: int = knob(16 * 1024, size())
    max_request_buffer_bytes: int = knob(64 * 1024 * 1024, size(MIN_MESSAGE_BYTES))
    write_buffer_high_bytes: int = knob(64 * 1024, size(16384))
    write_buffer_low_bytes: int = knob(16 * 1024, size())  # below write_buffer_high_bytes
    write_stall_seconds: float = knob(30.0, duration(above=0))
    preface_timeout_seconds: float = knob(10.0, duration(above=0))
    max_intercepted_calls: int = knob(1024, integer(2))  # all connections together
    # method name -> bytes, over DEFAULT_MAX_REQUEST_BYTES, each capped by max_message_bytes (_check_server)
    max_request_bytes: tuple[tuple[str, int], ...] = knob(tuple(sorted(DEFAULT_MAX_REQUEST_BYTES.items())),
                                                          lambda k, v: _request_bytes(k, v))
    stream_stall_seconds: float = knob(30.0, duration(above=0))  # incomplete request / answer held by the window
    trusted_uids: tuple[int, ...] = knob((0,), lambda k, v: _uids(k, v))  # never evicted; the full request pools
    max_connections_per_uid: int = knob(64, integer(1))  # for a uid outside trusted_uids
    # non-CRI services let through (reloadable); anything else but runtime.v1 and health is refused
    allowed_services: tuple[str, ...] = knob((), lambda k, v: _allowed_services(k, v))


# server.* keys a reload applies (every other server.* key needs a restart)
RELOADABLE_SERVER_KEYS = frozenset({"allowed_services"})


@dataclass(frozen=True)
class LogConfig:
    level: str = knob("info", text("debug", "info", "warning", "error"))
    format: str = knob("text", text("text", "json"))  # text (key=value) or json
    max_repeats: int = knob(DEFAULT_MAX_REPEATS, integer())  # lines of one kind per window (info+); 0 = no limit
    repeat_window_seconds: float = knob(DEFAULT_REPEAT_WINDOW_SECONDS, duration())


@dataclass(frozen=True)
class PullsConfig:
    max_parallel: int = knob(4, integer())  # 0 = unlimited
    dedup: bool = knob(True, boolean())
    dedup_per_namespace: bool = knob(False, boolean())
    progress_interval_seconds: float = knob(1.0, duration())  # one runtime poll for all running pulls; 0 = off
    progress_log_after_seconds: float = knob(10.0, duration())  # 25/50/75/100 % of pulls this long: info
    stall_timeout_seconds: float = knob(0.0, duration())  # 0 = stall guard off
    stall_min_bytes_per_second: int = knob(65536, size())
    # no manifest and no byte this long: ended; progress not judged (CRI-O, progress off): the slot is
    # given back and the pull goes on (pulls/lease.py); 0 = both off
    no_progress_timeout_seconds: float = knob(60.0, duration())
    # clients outside server.trusted_uids (pulls/slots.py): their share of max_parallel (at least 1, at
    # most max_parallel - 1 slots), and the most one uid may run of it
    untrusted_share: float = knob(0.5, fraction())
    max_parallel_per_uid: int = knob(1, integer(1))


MIN_PROGRESS_INTERVAL = 0.1


@dataclass(frozen=True)
class PinsConfig:
    images: tuple[str, ...] = knob((), image_patterns(none_is_empty=True))
    mode: str = knob("enforce", text("enforce", "mark-only"))
    # the pin ledger (which sets pin which images), loaded before serving; "" = kept in memory only
    ledger_file: str = knob("/var/lib/cri-shim/pins.json", text())


@dataclass(frozen=True)
class ImageSetsConfig:
    dir: str = knob("", text())  # empty: image sets off
    max_parallel: int = knob(2, integer(1))  # below pulls.max_parallel (from_dict)
    max_file_bytes: int = knob(1 << 20, size(1))  # a bigger set file is rejected (not read)
    cooldown_seconds: float = knob(0.0, duration())
    min_free_bytes: int = knob(0, size())
    debounce_seconds: float = knob(0.2, duration())
    retry_initial_seconds: float = knob(5.0, duration())
    retry_max_seconds: float = knob(300.0, duration())  # >= retry_initial_seconds
    retry_per_second: float = knob(5.0, rate())  # retries of failed images per registry host per second; 0 = no limit
    max_images: int = knob(250_000, integer(1))  # images declared over all sets; a set beyond it is refused
    runtime_timeout_seconds: float = knob(30.0, duration(above=0))  # the reconciler's ListImages / ImageFsInfo
    pull_timeout_seconds: float = knob(3600.0, duration(above=0))  # one prefetch waits for its pull (queued + running)
    pins_wait_seconds: float = knob(10.0, duration(above=0))  # RemoveImage waits for the first read of dir
    # the last valid content of each file of dir, loaded before serving; "" = off
    state_file: str = knob("/var/lib/cri-shim/file-sets.json", text())
    docker_config: tuple[str, ...] = knob(("/var/lib/kubelet/config.json",),  # registry credentials for prefetch
                                          strings(none_is_empty=True))
    credential_provider_config: str = knob("", text())  # kubelet CredentialProviderConfig file; empty: no plugins
    credential_provider_bin_dir: str = knob("", text())  # where its plugins are


@dataclass(frozen=True)
class HandlerRule:
    handler: str = required(lambda k, v: _nonempty(k, v))
    namespaces: tuple[str, ...] = knob((), strings())
    images: tuple[str, ...] = knob((), image_patterns())
    pod_labels: tuple[tuple[str, str], ...] = knob((), lambda k, v: _str_map(k, v))
    pod_annotations: tuple[tuple[str, str], ...] = knob((), lambda k, v: _str_map(k, v))


@dataclass(frozen=True)
class RuntimeHandlersConfig:
    rules: tuple[HandlerRule, ...] = knob((), lambda k, v: _rules(k, v))
    learn_from_sandboxes: bool = knob(True, boolean())
    pod_cache_size: int = knob(10000, integer(1))


@dataclass(frozen=True)
class ClusterConfig:
    """Image sets from the Kubernetes API (README "Image sets for a fleet")."""
    kubeconfig: str = knob("", text())  # empty: the cluster source is off
    node_name: str = knob("", text())  # empty: this host's name, lowercased (kubelet's default)
    # the sets applied last, loaded before the API answers; its directory is the unit's StateDirectory=
    state_file: str = knob("/var/lib/cri-shim/cluster-sets.json", text())
    mco: bool = knob(True, boolean())  # also PinnedImageSet + MachineConfigPool (machineconfiguration.openshift.io)
    status_interval_seconds: float = knob(5.0, duration(at_least=1.0))  # at most one status write per node this often
    # rows in NodeImageSetStatus; the other sets are aggregated (counts by state, the worst 20)
    status_max_rows: int = knob(100, lambda k, v: _int_in(k, v, 0, MAX_STATUS_ROWS))
    event_interval_seconds: float = knob(300.0, duration())  # at most one Event per set and reason this often
    event_burst: int = knob(25, integer(1))  # Events per node at once; then one per event_interval_seconds
    event_namespace: str = knob("default", text())  # where the Events go (the status object is cluster-scoped)
    watch_timeout_seconds: float = knob(300.0, duration(at_least=1.0))  # server-side timeout of one watch
    backoff_initial_seconds: float = knob(1.0, duration(at_least=0.1))  # after an API error, doubling with jitter
    backoff_max_seconds: float = knob(60.0, duration())  # ... up to this
    request_timeout_seconds: float = knob(30.0, duration(at_least=1.0))  # one list, get or apply request
    secret_refresh_seconds: float = knob(300.0, duration(at_least=1.0))  # re-read a pull Secret we may get, not watch
    probe_interval_seconds: float = knob(1.0, duration(at_least=0.1))  # while unreachable, GET /readyz this often
    mco_discovery_seconds: float = knob(600.0, duration(at_least=1.0))  # ask again whether MCO's group is served


@dataclass(frozen=True)
class MetricsConfig:
    address: str = knob("", lambda k, v: _host_port(k, v))  # host:port; empty: no metrics endpoint
    max_connections: int = knob(16, integer(1))  # open at once; one more is closed unanswered
    timeout_seconds: float = knob(10.0, duration(above=0))  # to send the request and read the answer


@dataclass(frozen=True)
class Config:
    listen: str = knob(DEFAULT_LISTEN, lambda k, v: _endpoint(k, v))
    upstream: str = knob(DEFAULT_UPSTREAM, lambda k, v: _endpoint(k, v))
    server: ServerConfig = section(ServerConfig)
    log: LogConfig = section(LogConfig)
    pulls: PullsConfig = section(PullsConfig)
    pins: PinsConfig = section(PinsConfig)
    image_sets: ImageSetsConfig = section(ImageSetsConfig)
    runtime_handlers: RuntimeHandlersConfig = section(RuntimeHandlersConfig)
    metrics: MetricsConfig = section(MetricsConfig)
    cluster: ClusterConfig = section(ClusterConfig)


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


# --------------------------------------------------------------------------- sections

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # what dataclasses.fields() takes

T = TypeVar("T", bound="DataclassInstance")


def _section(cls: type[T], prefix: str, d: Mapping[str, Any]) -> T:
    """One dataclass from its mapping: unknown keys refused, each key given checked by its
    field's ``parse`` (an absent key keeps its default), then the section's cross-key checks."""
    fields = dataclasses.fields(cls)
    _check_keys(prefix, d, {f.name for f in fields})
    values: dict[str, Any] = {}
    for f in fields:
        key = f"{prefix}.{f.name}" if prefix else f.name
        if "section" in f.metadata:
            values[f.name] = _section(f.metadata["section"], key, _mapping(key, d.get(f.name)))
        elif f.name in d:
            values[f.name] = f.metadata["parse"](key, d[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "required")
    cfg = cls(**values)
    check = _CHECKS.get(cls)
    return check(cfg, d) if check is not None else cfg


def _nonempty(key: str, v: Any) -> str:
    s = _str(key, v)
    if not s:
        raise ConfigError(key, "must not be empty")
    return s


def _rules(key: str, v: Any) -> tuple[HandlerRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of rules, got {shown(v)}")
    return tuple(_section(HandlerRule, f"{key}[{i}]", _mapping(f"{key}[{i}]", r)) for i, r in enumerate(v))


def _request_bytes(key: str, v: Any) -> tuple[tuple[str, int], ...]:
    """server.max_request_bytes as written: CRI method name -> size (merged over the defaults in _check_server)."""
    from .cri.methods import (
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


def _check_server(cfg: ServerConfig, d: Mapping[str, Any]) -> ServerConfig:
    if cfg.write_buffer_low_bytes >= cfg.write_buffer_high_bytes:
        raise ConfigError("server.write_buffer_low_bytes",
                          f"must be below server.write_buffer_high_bytes ({cfg.write_buffer_high_bytes}), "
                          f"got {cfg.write_buffer_low_bytes}")
    cap = cfg.max_message_bytes
    given = dict(cfg.max_request_bytes) if "max_request_bytes" in d else {}
    for name, size_ in given.items():
        if size_ > cap:
            raise ConfigError(f"server.max_request_bytes.{name}",
                              f"must be <= server.max_message_bytes ({cap}), got {size_!r}")
    merged = {name: min(size_, cap) for name, size_ in DEFAULT_MAX_REQUEST_BYTES.items()} | given
    return dataclasses.replace(cfg, max_request_bytes=tuple(sorted(merged.items())))


def _check_log(cfg: LogConfig, d: Mapping[str, Any]) -> LogConfig:
    if cfg.max_repeats and cfg.repeat_window_seconds <= 0:
        raise ConfigError("log.repeat_window_seconds", f"must be > 0, got {shown(cfg.repeat_window_seconds)}")
    return cfg


def _check_pulls(cfg: PullsConfig, d: Mapping[str, Any]) -> PullsConfig:
    if 0 < cfg.progress_interval_seconds < MIN_PROGRESS_INTERVAL:
        raise ConfigError("pulls.progress_interval_seconds",
                          f"must be 0 (off) or >= {MIN_PROGRESS_INTERVAL}, got {shown(cfg.progress_interval_seconds)}")
    if cfg.stall_timeout_seconds > 0 and cfg.progress_interval_seconds == 0:
        raise ConfigError("pulls.stall_timeout_seconds",
                          "needs pull progress: pulls.progress_interval_seconds must not be 0")
    for key in ("stall_timeout_seconds", "no_progress_timeout_seconds"):
        value = getattr(cfg, key)
        if 0 < value < 2 * cfg.progress_interval_seconds:
            raise ConfigError(f"pulls.{key}", f"must be 0 (off) or at least twice pulls.progress_interval_seconds "
                                              f"({cfg.progress_interval_seconds:g}), got {shown(value)}")
    return cfg


def _check_image_sets(cfg: ImageSetsConfig, d: Mapping[str, Any]) -> ImageSetsConfig:
    if bool(cfg.credential_provider_config) != bool(cfg.credential_provider_bin_dir):
        missing = "credential_provider_bin_dir" if cfg.credential_provider_config else "credential_provider_config"
        raise ConfigError(f"image_sets.{missing}", "required when the other credential_provider_* key is set")
    if cfg.credential_provider_config:
        from .credentials.plugins import (  # local import: only when used
            ProviderConfigError,
            load_config,
        )

        try:
            load_config(cfg.credential_provider_config)
        except ProviderConfigError as e:
            raise ConfigError("image_sets.credential_provider_config", str(e)) from None
    if cfg.retry_max_seconds < cfg.retry_initial_seconds:
        raise ConfigError("image_sets.retry_max_seconds",
                          f"must be >= image_sets.retry_initial_seconds, got {shown(cfg.retry_max_seconds)}")
    return cfg


def _check_cluster(cfg: ClusterConfig, d: Mapping[str, Any]) -> ClusterConfig:
    if cfg.backoff_max_seconds < cfg.backoff_initial_seconds:
        raise ConfigError("cluster.backoff_max_seconds",
                          f"must be >= cluster.backoff_initial_seconds, got {cfg.backoff_max_seconds!r}")
    if cfg.kubeconfig:
        if not cfg.state_file:
            raise ConfigError("cluster.state_file", "required when cluster.kubeconfig is set")
        if not Path(cfg.kubeconfig).is_file():
            raise ConfigError("cluster.kubeconfig", f"no such file {shown(cfg.kubeconfig)}")
    return cfg


def _check_config(cfg: Config, d: Mapping[str, Any]) -> Config:
    pulls, image_sets = cfg.pulls, cfg.image_sets
    prefetching = bool(image_sets.dir or cfg.cluster.kubeconfig)
    if prefetching and pulls.max_parallel and image_sets.max_parallel >= pulls.max_parallel:
        raise ConfigError("image_sets.max_parallel",
                          f"must be below pulls.max_parallel ({pulls.max_parallel}), so that kubelet's pulls "
                          f"always have a slot prefetch cannot take; got {image_sets.max_parallel}")
    if (image_sets.dir and cfg.cluster.kubeconfig and image_sets.state_file
            and os.path.abspath(image_sets.state_file) == os.path.abspath(cfg.cluster.state_file)):
        raise ConfigError("image_sets.state_file", f"must differ from cluster.state_file, got "
                          f"{shown(image_sets.state_file)} for both")
    return cfg


# Cross-key checks of a section, run after each of its keys was checked on its own.
_CHECKS: dict[type, Callable[[Any, Mapping[str, Any]], Any]] = {
    ServerConfig: _check_server,
    LogConfig: _check_log,
    PullsConfig: _check_pulls,
    ImageSetsConfig: _check_image_sets,
    ClusterConfig: _check_cluster,
    Config: _check_config,
}


def from_dict(data: Mapping[str, Any] | None) -> Config:
    """Build a validated Config from parsed YAML. Raises ConfigError naming the key."""
    return _section(Config, "", _mapping("", data))


def load(path: str | Path | None) -> Config:
    """Read and validate the config file. Missing or empty file: defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        text = read_capped(p, CONFIG_MAX_BYTES)
    except FileNotFoundError:
        return Config()
    except OSError as e:
        raise ConfigError("", f"cannot read config file {p}: {e.strerror}") from None
    except (TooBig, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read config file {p}: {e}") from None
    try:
        data = safeyaml.load(text)
    except UnsafeYaml as e:
        raise ConfigError("", f"config file {p}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"config file {p} is not valid YAML{_yaml_error(e)}") from None
    return from_dict(data)


def _yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: where, and what."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = "; ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
    return f"{where}: {what or ' '.join(str(e).split())}"


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """Apply command-line flags (None means: not given) over the file's values."""
    top = {k: v for k, v in overrides.items() if v is not None and k in ("listen", "upstream")}
    for k, v in top.items():
        _endpoint(f"--{k}", v)
    cfg = dataclasses.replace(cfg, **top)
    log_over = {k: overrides[k] for k in ("level", "format") if overrides.get(k) is not None}
    if log_over:
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, **log_over))
    return cfg


def socket_path(endpoint: str) -> str:
    """``unix:///run/x.sock`` -> ``/run/x.sock``."""
    return endpoint[len("unix://"):]
