"""Configuration: validated, frozen dataclasses, all in one place.

The file is YAML. Every key is checked: an unknown key or a value of the wrong type
raises ConfigError naming the key path (``pulls.max_parallel``) and the value.
A missing or empty file means the defaults.
"""

from __future__ import annotations

import dataclasses
import grp
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from . import safeyaml
from .cri.routing import check_allowed_services
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


@dataclass(frozen=True)
class ServerConfig:
    socket_mode: int = 0o660
    socket_group: str = ""  # group name or numeric gid; empty: the process's group
    max_message_bytes: int = KUBELET_MAX_MESSAGE
    shutdown_grace_seconds: float = 10.0
    admin_socket: str = DEFAULT_ADMIN_SOCKET  # for `cri-shim status`; empty: off
    uvloop: bool = True
    engine: str = "relay"  # relay: HTTP/2 frame relay (fast); grpc: grpc.aio generic proxy
    # relay bounds (README "Limits")
    max_connections: int = 256
    listen_backlog: int = 1024
    max_header_list_bytes: int = 64 * 1024
    max_intercepted_streams: int = 100
    max_concurrent_streams: int = 100
    path_cache_bytes: int = 16 * 1024
    max_request_buffer_bytes: int = 64 * 1024 * 1024
    write_buffer_high_bytes: int = 64 * 1024
    write_buffer_low_bytes: int = 16 * 1024
    write_stall_seconds: float = 30.0
    preface_timeout_seconds: float = 10.0
    max_intercepted_calls: int = 1024  # all connections together
    max_request_bytes: tuple[tuple[str, int], ...] = tuple(sorted(DEFAULT_MAX_REQUEST_BYTES.items()))
    stream_stall_seconds: float = 30.0  # incomplete request / answer waiting for the client's window
    trusted_uids: tuple[int, ...] = (0,)  # never closed to make room; the full request pools
    max_connections_per_uid: int = 64  # for a uid outside trusted_uids
    # non-CRI services let through (reloadable); anything else but runtime.v1 and health is refused
    allowed_services: tuple[str, ...] = ()


# server.* keys a reload applies (every other server.* key needs a restart)
RELOADABLE_SERVER_KEYS = frozenset({"allowed_services"})


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "text"  # text (key=value) or json
    max_repeats: int = DEFAULT_MAX_REPEATS  # lines of one kind per repeat window (info and above); 0 = no limit
    repeat_window_seconds: float = DEFAULT_REPEAT_WINDOW_SECONDS


@dataclass(frozen=True)
class PullsConfig:
    max_parallel: int = 4  # 0 = unlimited
    dedup: bool = True
    dedup_per_namespace: bool = False
    progress_interval_seconds: float = 1.0  # one runtime poll for every running pull; 0 = progress off
    progress_log_after_seconds: float = 10.0  # 25/50/75/100 % steps of pulls running this long are logged at info
    stall_timeout_seconds: float = 0.0  # 0 = stall guard off
    stall_min_bytes_per_second: int = 65536
    no_progress_timeout_seconds: float = 60.0  # a pull with no manifest and no byte this long is ended; 0 = off


MIN_PROGRESS_INTERVAL = 0.1


@dataclass(frozen=True)
class PinsConfig:
    images: tuple[str, ...] = ()
    mode: str = "enforce"  # enforce | mark-only


@dataclass(frozen=True)
class ImageSetsConfig:
    dir: str = ""  # empty: image sets off
    max_parallel: int = 2
    max_file_bytes: int = 1 << 20  # a bigger set file is rejected (not read)
    cooldown_seconds: float = 0.0
    min_free_bytes: int = 0
    debounce_seconds: float = 0.2
    retry_initial_seconds: float = 5.0
    retry_max_seconds: float = 300.0
    runtime_timeout_seconds: float = 30.0  # deadline of the reconciler's own ListImages / ImageFsInfo
    pins_wait_seconds: float = 10.0  # RemoveImage waits this long for the first read of dir, then UNAVAILABLE
    docker_config: tuple[str, ...] = ("/var/lib/kubelet/config.json",)  # registry credentials for prefetch
    credential_provider_config: str = ""  # kubelet CredentialProviderConfig file; empty: no plugins
    credential_provider_bin_dir: str = ""  # where its plugins are


@dataclass(frozen=True)
class HandlerRule:
    handler: str
    namespaces: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    pod_labels: tuple[tuple[str, str], ...] = ()
    pod_annotations: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RuntimeHandlersConfig:
    rules: tuple[HandlerRule, ...] = ()
    learn_from_sandboxes: bool = True
    pod_cache_size: int = 10000


@dataclass(frozen=True)
class ClusterConfig:
    """Image sets from the Kubernetes API (README "Image sets for a fleet")."""
    kubeconfig: str = ""  # empty: the cluster source is off
    node_name: str = ""  # empty: this host's name, lowercased (kubelet's default)
    state_file: str = "/var/lib/cri-shim/cluster-sets.json"  # last applied sets, enforced before the API answers
    mco: bool = True  # also read PinnedImageSet + MachineConfigPool (machineconfiguration.openshift.io)
    status_interval_seconds: float = 5.0  # at most one status write per node this often
    event_interval_seconds: float = 300.0  # at most one Event per set and failure reason this often
    event_namespace: str = "default"  # where the Events go (the status object is cluster-scoped)
    watch_timeout_seconds: float = 300.0  # server-side timeout of one watch request; it is then resumed
    backoff_initial_seconds: float = 1.0  # after an API error, doubling with jitter ...
    backoff_max_seconds: float = 60.0  # ... up to this
    request_timeout_seconds: float = 30.0  # one list, get or apply request
    secret_refresh_seconds: float = 300.0  # re-read the pull Secrets that sets name


@dataclass(frozen=True)
class MetricsConfig:
    address: str = ""  # host:port; empty: no metrics endpoint
    max_connections: int = 16  # open at once; one more is closed unanswered
    timeout_seconds: float = 10.0  # to send the request and read the answer


@dataclass(frozen=True)
class Config:
    listen: str = DEFAULT_LISTEN
    upstream: str = DEFAULT_UPSTREAM
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    pulls: PullsConfig = field(default_factory=PullsConfig)
    pins: PinsConfig = field(default_factory=PinsConfig)
    image_sets: ImageSetsConfig = field(default_factory=ImageSetsConfig)
    runtime_handlers: RuntimeHandlersConfig = field(default_factory=RuntimeHandlersConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


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


def _str_list(key: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of strings, got {shown(v)}")
    return tuple(_str(f"{key}[{i}]", item) for i, item in enumerate(v))


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


# --------------------------------------------------------------------------- sections


def _server(d: Mapping[str, Any]) -> ServerConfig:
    _check_keys("server", d, {f.name for f in dataclasses.fields(ServerConfig)})
    c = ServerConfig()
    cfg = ServerConfig(
        socket_mode=_socket_mode("server.socket_mode", d.get("socket_mode", c.socket_mode)),
        socket_group=str(_group("server.socket_group", d.get("socket_group", c.socket_group))),
        max_message_bytes=_size("server.max_message_bytes", d.get("max_message_bytes", c.max_message_bytes),
                                minimum=MIN_MESSAGE_BYTES),
        shutdown_grace_seconds=_duration(
            "server.shutdown_grace_seconds", d.get("shutdown_grace_seconds", c.shutdown_grace_seconds)),
        admin_socket=_str("server.admin_socket", d.get("admin_socket", c.admin_socket)),
        uvloop=_bool("server.uvloop", d.get("uvloop", c.uvloop)),
        engine=_str("server.engine", d.get("engine", c.engine), ("relay", "grpc")),
        max_connections=_int("server.max_connections", d.get("max_connections", c.max_connections), minimum=1),
        listen_backlog=_int("server.listen_backlog", d.get("listen_backlog", c.listen_backlog), minimum=1),
        max_header_list_bytes=_size("server.max_header_list_bytes",
                                    d.get("max_header_list_bytes", c.max_header_list_bytes), minimum=4096),
        max_intercepted_streams=_int("server.max_intercepted_streams",
                                     d.get("max_intercepted_streams", c.max_intercepted_streams), minimum=1),
        max_concurrent_streams=_int("server.max_concurrent_streams",
                                    d.get("max_concurrent_streams", c.max_concurrent_streams), minimum=1),
        path_cache_bytes=_size("server.path_cache_bytes", d.get("path_cache_bytes", c.path_cache_bytes)),
        max_request_buffer_bytes=_size("server.max_request_buffer_bytes",
                                       d.get("max_request_buffer_bytes", c.max_request_buffer_bytes),
                                       minimum=MIN_MESSAGE_BYTES),
        write_buffer_high_bytes=_size("server.write_buffer_high_bytes",
                                      d.get("write_buffer_high_bytes", c.write_buffer_high_bytes), minimum=16384),
        write_buffer_low_bytes=_size("server.write_buffer_low_bytes",
                                     d.get("write_buffer_low_bytes", c.write_buffer_low_bytes)),
        write_stall_seconds=_duration("server.write_stall_seconds",
                                      d.get("write_stall_seconds", c.write_stall_seconds)),
        preface_timeout_seconds=_duration("server.preface_timeout_seconds",
                                          d.get("preface_timeout_seconds", c.preface_timeout_seconds)),
        max_intercepted_calls=_int("server.max_intercepted_calls",
                                   d.get("max_intercepted_calls", c.max_intercepted_calls), minimum=2),
        max_request_bytes=_request_bytes(d.get("max_request_bytes"), d.get("max_message_bytes", c.max_message_bytes)),
        stream_stall_seconds=_duration("server.stream_stall_seconds",
                                       d.get("stream_stall_seconds", c.stream_stall_seconds)),
        trusted_uids=_uids("server.trusted_uids", d.get("trusted_uids", list(c.trusted_uids))),
        max_connections_per_uid=_int("server.max_connections_per_uid",
                                     d.get("max_connections_per_uid", c.max_connections_per_uid), minimum=1),
        allowed_services=_allowed_services(d.get("allowed_services", list(c.allowed_services))),
    )
    if cfg.write_buffer_low_bytes >= cfg.write_buffer_high_bytes:
        raise ConfigError("server.write_buffer_low_bytes",
                          f"must be below server.write_buffer_high_bytes ({cfg.write_buffer_high_bytes}), "
                          f"got {cfg.write_buffer_low_bytes}")
    for key in ("write_stall_seconds", "preface_timeout_seconds", "stream_stall_seconds"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"server.{key}", f"must be > 0, got {shown(getattr(cfg, key))}")
    return cfg


def _request_bytes(v: Any, max_message: Any) -> tuple[tuple[str, int], ...]:
    """server.max_request_bytes: method name -> size, over the defaults; each within server.max_message_bytes."""
    from .cri.methods import (
        KNOWN_METHODS,  # local import: the proto module is only needed here
    )

    names = {p.rsplit("/", 1)[1] for p in KNOWN_METHODS}
    cap = _size("server.max_message_bytes", max_message, minimum=MIN_MESSAGE_BYTES)
    out = {name: min(size, cap) for name, size in DEFAULT_MAX_REQUEST_BYTES.items()}
    for name, size in _mapping("server.max_request_bytes", v).items():
        key = f"server.max_request_bytes.{name}"
        if name not in names:
            raise ConfigError(key, "not a CRI method name (e.g. PullImage)")
        out[name] = _size(key, size, minimum=MIN_MESSAGE_BYTES)
        if out[name] > cap:
            raise ConfigError(key, f"must be <= server.max_message_bytes ({cap}), got {size!r}")
    return tuple(sorted(out.items()))


def _uids(key: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of numeric uids, got {v!r}")
    return tuple(_int(f"{key}[{i}]", uid) for i, uid in enumerate(v))


def _allowed_services(v: Any) -> tuple[str, ...]:
    key = "server.allowed_services"
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


def _log(d: Mapping[str, Any]) -> LogConfig:
    _check_keys("log", d, {f.name for f in dataclasses.fields(LogConfig)})
    c = LogConfig()
    cfg = LogConfig(
        level=_str("log.level", d.get("level", c.level), ("debug", "info", "warning", "error")),
        format=_str("log.format", d.get("format", c.format), ("text", "json")),
        max_repeats=_int("log.max_repeats", d.get("max_repeats", c.max_repeats)),
        repeat_window_seconds=_duration("log.repeat_window_seconds",
                                        d.get("repeat_window_seconds", c.repeat_window_seconds)),
    )
    if cfg.max_repeats and cfg.repeat_window_seconds <= 0:
        raise ConfigError("log.repeat_window_seconds", f"must be > 0, got {shown(cfg.repeat_window_seconds)}")
    return cfg


def _pulls(d: Mapping[str, Any]) -> PullsConfig:
    _check_keys("pulls", d, {f.name for f in dataclasses.fields(PullsConfig)})
    c = PullsConfig()
    cfg = PullsConfig(
        max_parallel=_int("pulls.max_parallel", d.get("max_parallel", c.max_parallel)),
        dedup=_bool("pulls.dedup", d.get("dedup", c.dedup)),
        dedup_per_namespace=_bool("pulls.dedup_per_namespace", d.get("dedup_per_namespace", c.dedup_per_namespace)),
        progress_interval_seconds=_duration(
            "pulls.progress_interval_seconds", d.get("progress_interval_seconds", c.progress_interval_seconds)),
        progress_log_after_seconds=_duration(
            "pulls.progress_log_after_seconds", d.get("progress_log_after_seconds", c.progress_log_after_seconds)),
        stall_timeout_seconds=_duration(
            "pulls.stall_timeout_seconds", d.get("stall_timeout_seconds", c.stall_timeout_seconds)),
        stall_min_bytes_per_second=_size(
            "pulls.stall_min_bytes_per_second", d.get("stall_min_bytes_per_second", c.stall_min_bytes_per_second)),
        no_progress_timeout_seconds=_duration(
            "pulls.no_progress_timeout_seconds", d.get("no_progress_timeout_seconds", c.no_progress_timeout_seconds)),
    )
    if 0 < cfg.progress_interval_seconds < MIN_PROGRESS_INTERVAL:
        raise ConfigError("pulls.progress_interval_seconds",
                          f"must be 0 (off) or >= {MIN_PROGRESS_INTERVAL}, got {shown(cfg.progress_interval_seconds)}")
    if cfg.stall_timeout_seconds > 0 and cfg.progress_interval_seconds == 0:
        raise ConfigError("pulls.stall_timeout_seconds",
                          "needs pull progress: pulls.progress_interval_seconds must not be 0")
    if 0 < cfg.stall_timeout_seconds < 2 * cfg.progress_interval_seconds:
        raise ConfigError("pulls.stall_timeout_seconds",
                          f"must be 0 (off) or at least twice pulls.progress_interval_seconds "
                          f"({cfg.progress_interval_seconds:g}), got {shown(cfg.stall_timeout_seconds)}")
    if 0 < cfg.no_progress_timeout_seconds < 2 * cfg.progress_interval_seconds:
        raise ConfigError("pulls.no_progress_timeout_seconds",
                          f"must be 0 (off) or at least twice pulls.progress_interval_seconds "
                          f"({cfg.progress_interval_seconds:g}), got {shown(cfg.no_progress_timeout_seconds)}")
    return cfg


def _pins(d: Mapping[str, Any]) -> PinsConfig:
    _check_keys("pins", d, {"images", "mode"})
    c = PinsConfig()
    images = _str_list("pins.images", d.get("images", list(c.images)) or [])
    from .images.pins import (
        validate_pattern,  # local import: pins depends on reference parsing only
    )

    for i, pattern in enumerate(images):
        try:
            validate_pattern(pattern)
        except ValueError as e:
            raise ConfigError(f"pins.images[{i}]", f"{e} (got {shown(pattern)})") from None
    return PinsConfig(images=images, mode=_str("pins.mode", d.get("mode", c.mode), ("enforce", "mark-only")))


def _image_sets(d: Mapping[str, Any]) -> ImageSetsConfig:
    _check_keys("image_sets", d, {f.name for f in dataclasses.fields(ImageSetsConfig)})
    c = ImageSetsConfig()
    cfg = ImageSetsConfig(
        dir=_str("image_sets.dir", d.get("dir", c.dir)),
        max_parallel=_int("image_sets.max_parallel", d.get("max_parallel", c.max_parallel), minimum=1),
        max_file_bytes=_size("image_sets.max_file_bytes", d.get("max_file_bytes", c.max_file_bytes), minimum=1),
        cooldown_seconds=_duration("image_sets.cooldown_seconds", d.get("cooldown_seconds", c.cooldown_seconds)),
        min_free_bytes=_size("image_sets.min_free_bytes", d.get("min_free_bytes", c.min_free_bytes)),
        debounce_seconds=_duration("image_sets.debounce_seconds", d.get("debounce_seconds", c.debounce_seconds)),
        retry_initial_seconds=_duration(
            "image_sets.retry_initial_seconds", d.get("retry_initial_seconds", c.retry_initial_seconds)),
        retry_max_seconds=_duration("image_sets.retry_max_seconds", d.get("retry_max_seconds", c.retry_max_seconds)),
        runtime_timeout_seconds=_duration(
            "image_sets.runtime_timeout_seconds", d.get("runtime_timeout_seconds", c.runtime_timeout_seconds)),
        pins_wait_seconds=_duration("image_sets.pins_wait_seconds", d.get("pins_wait_seconds", c.pins_wait_seconds)),
        docker_config=_str_list("image_sets.docker_config", d.get("docker_config", list(c.docker_config)) or []),
        credential_provider_config=_str("image_sets.credential_provider_config",
                                        d.get("credential_provider_config", c.credential_provider_config)),
        credential_provider_bin_dir=_str("image_sets.credential_provider_bin_dir",
                                         d.get("credential_provider_bin_dir", c.credential_provider_bin_dir)),
    )
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
    for key in ("runtime_timeout_seconds", "pins_wait_seconds"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"image_sets.{key}", f"must be > 0, got {shown(getattr(cfg, key))}")
    if cfg.retry_max_seconds < cfg.retry_initial_seconds:
        raise ConfigError("image_sets.retry_max_seconds",
                          f"must be >= image_sets.retry_initial_seconds, got {shown(cfg.retry_max_seconds)}")
    return cfg


def _rule(i: int, d: Any) -> HandlerRule:
    key = f"runtime_handlers.rules[{i}]"
    d = _mapping(key, d)
    _check_keys(key, d, {f.name for f in dataclasses.fields(HandlerRule)})
    if "handler" not in d:
        raise ConfigError(f"{key}.handler", "required")
    handler = _str(f"{key}.handler", d["handler"])
    if not handler:
        raise ConfigError(f"{key}.handler", "must not be empty")
    images = _str_list(f"{key}.images", d.get("images", []))
    from .images.pins import validate_pattern  # image patterns are normalized like pins

    for j, pattern in enumerate(images):
        try:
            validate_pattern(pattern)
        except ValueError as e:
            raise ConfigError(f"{key}.images[{j}]", f"{e} (got {shown(pattern)})") from None
    return HandlerRule(
        handler=handler,
        namespaces=_str_list(f"{key}.namespaces", d.get("namespaces", [])),
        images=images,
        pod_labels=_str_map(f"{key}.pod_labels", d.get("pod_labels", {})),
        pod_annotations=_str_map(f"{key}.pod_annotations", d.get("pod_annotations", {})),
    )


def _runtime_handlers(d: Mapping[str, Any]) -> RuntimeHandlersConfig:
    _check_keys("runtime_handlers", d, {f.name for f in dataclasses.fields(RuntimeHandlersConfig)})
    c = RuntimeHandlersConfig()
    rules = d.get("rules", [])
    if rules is None:
        rules = []
    if not isinstance(rules, list):
        raise ConfigError("runtime_handlers.rules", f"expected a list of rules, got {shown(rules)}")
    return RuntimeHandlersConfig(
        rules=tuple(_rule(i, r) for i, r in enumerate(rules)),
        learn_from_sandboxes=_bool(
            "runtime_handlers.learn_from_sandboxes", d.get("learn_from_sandboxes", c.learn_from_sandboxes)),
        pod_cache_size=_int("runtime_handlers.pod_cache_size", d.get("pod_cache_size", c.pod_cache_size), minimum=1),
    )


def _metrics(d: Mapping[str, Any]) -> MetricsConfig:
    _check_keys("metrics", d, {f.name for f in dataclasses.fields(MetricsConfig)})
    c = MetricsConfig()
    cfg = MetricsConfig(
        address=_host_port("metrics.address", d.get("address", c.address)),
        max_connections=_int("metrics.max_connections", d.get("max_connections", c.max_connections), minimum=1),
        timeout_seconds=_duration("metrics.timeout_seconds", d.get("timeout_seconds", c.timeout_seconds)),
    )
    if cfg.timeout_seconds <= 0:
        raise ConfigError("metrics.timeout_seconds", f"must be > 0, got {shown(cfg.timeout_seconds)}")
    return cfg


def _cluster(d: Mapping[str, Any]) -> ClusterConfig:
    _check_keys("cluster", d, {f.name for f in dataclasses.fields(ClusterConfig)})
    c = ClusterConfig()
    durations = {f.name: _duration(f"cluster.{f.name}", d.get(f.name, getattr(c, f.name)))
                 for f in dataclasses.fields(ClusterConfig) if f.name.endswith("_seconds")}
    cfg = ClusterConfig(
        kubeconfig=_str("cluster.kubeconfig", d.get("kubeconfig", c.kubeconfig)),
        node_name=_str("cluster.node_name", d.get("node_name", c.node_name)),
        state_file=_str("cluster.state_file", d.get("state_file", c.state_file)),
        mco=_bool("cluster.mco", d.get("mco", c.mco)),
        event_namespace=_str("cluster.event_namespace", d.get("event_namespace", c.event_namespace)),
        **durations,
    )
    for key, minimum in (("status_interval_seconds", 1.0), ("watch_timeout_seconds", 1.0),
                         ("backoff_initial_seconds", 0.1), ("request_timeout_seconds", 1.0),
                         ("secret_refresh_seconds", 1.0)):
        if getattr(cfg, key) < minimum:
            raise ConfigError(f"cluster.{key}", f"must be >= {minimum:g}, got {getattr(cfg, key)!r}")
    if cfg.backoff_max_seconds < cfg.backoff_initial_seconds:
        raise ConfigError("cluster.backoff_max_seconds",
                          f"must be >= cluster.backoff_initial_seconds, got {cfg.backoff_max_seconds!r}")
    if cfg.kubeconfig:
        if not cfg.state_file:
            raise ConfigError("cluster.state_file", "required when cluster.kubeconfig is set")
        if not Path(cfg.kubeconfig).is_file():
            raise ConfigError("cluster.kubeconfig", f"no such file {cfg.kubeconfig!r}")
    return cfg


_SECTIONS = {
    "server": _server,
    "log": _log,
    "pulls": _pulls,
    "pins": _pins,
    "image_sets": _image_sets,
    "runtime_handlers": _runtime_handlers,
    "metrics": _metrics,
    "cluster": _cluster,
}


def from_dict(data: Mapping[str, Any] | None) -> Config:
    """Build a validated Config from parsed YAML. Raises ConfigError naming the key."""
    data = _mapping("", data)
    _check_keys("", data, {"listen", "upstream", *_SECTIONS})
    c = Config()
    sections = {name: parse(_mapping(name, data.get(name))) for name, parse in _SECTIONS.items()}
    pulls, image_sets = sections["pulls"], sections["image_sets"]
    prefetching = bool(image_sets.dir or sections["cluster"].kubeconfig)
    if prefetching and pulls.max_parallel and image_sets.max_parallel >= pulls.max_parallel:
        raise ConfigError("image_sets.max_parallel",
                          f"must be below pulls.max_parallel ({pulls.max_parallel}), so that kubelet's pulls "
                          f"always have a slot prefetch cannot take; got {image_sets.max_parallel}")
    return Config(
        listen=_endpoint("listen", data.get("listen", c.listen)),
        upstream=_endpoint("upstream", data.get("upstream", c.upstream)),
        **sections,
    )


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
