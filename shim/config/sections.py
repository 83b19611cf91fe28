"""The config file's sections: every key as a field of a frozen dataclass, checked when read.

Each key is declared once, as a dataclass field whose metadata holds its check
(``knob(default, parse)``, values.py): ``from_dict`` walks the fields, so a key's default,
type and bounds live on one line. Cross-key rules (``_CHECKS``) run after a section's keys.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from ..observability.logs import DEFAULT_MAX_REPEATS, DEFAULT_REPEAT_WINDOW_SECONDS, shown
from .values import (
    MIN_MESSAGE_BYTES,
    ConfigError,
    _allowed_services,
    _check_keys,
    _endpoint,
    _group,
    _host_port,
    _int_in,
    _mapping,
    _nonempty,
    _request_bytes,
    _socket_mode,
    _str_map,
    _uids,
    boolean,
    duration,
    fraction,
    image_patterns,
    integer,
    knob,
    number_in,
    rate,
    required,
    section,
    size,
    strings,
    text,
)

DEFAULT_LISTEN = "unix:///run/cri-shim/cri-shim.sock"
DEFAULT_UPSTREAM = "unix:///run/containerd/containerd.sock"
DEFAULT_ADMIN_SOCKET = "/run/cri-shim/admin.sock"
KUBELET_MAX_MESSAGE = 16 * 1024 * 1024
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
MAX_STATUS_ROWS = 120  # cluster.status_max_rows: 120 worst-case rows (1.7 KiB each) keep the object under 256 KiB


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


SYSTEM_CLUSTER_CRITICAL = 2000000000  # the PriorityClass values Kubernetes ships
SYSTEM_NODE_CRITICAL = 2000001000
PRIORITY_NAMES = {"system-cluster-critical": SYSTEM_CLUSTER_CRITICAL, "system-node-critical": SYSTEM_NODE_CRITICAL}


def _priority_value(key: str, v: Any) -> int:
    if isinstance(v, str) and v in PRIORITY_NAMES:
        return PRIORITY_NAMES[v]
    if isinstance(v, bool) or not isinstance(v, int) or not -2147483648 <= v <= SYSTEM_NODE_CRITICAL:
        raise ConfigError(key, f"expected an integer priority (at most {SYSTEM_NODE_CRITICAL}) or one of "
                               f"{', '.join(sorted(PRIORITY_NAMES))}, got {shown(v)}")
    return v


@dataclass(frozen=True)
class PriorityRule:
    """A pod matching every given field has ``priority`` (an empty rule matches no pod)."""
    priority: int = required(lambda k, v: _priority_value(k, v))
    namespaces: tuple[str, ...] = knob((), strings())
    pod_labels: tuple[tuple[str, str], ...] = knob((), lambda k, v: _str_map(k, v))
    # true: a static pod (its kubernetes.io/config.source annotation set and not "api")
    static_pods: bool = knob(False, boolean())


DEFAULT_PRIORITY_RULES = (PriorityRule(SYSTEM_NODE_CRITICAL, static_pods=True),)


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
    # trusted pulls by their pod's priority, then age (pulls/queue.py, docs/pulls.md "Ordering"); false: by age only
    priority_order: bool = knob(True, boolean())
    # a queued trusted pull rises above every pull that has waited at least this much less (the aging rate)
    priority_aging_seconds: float = knob(60.0, duration(above=0))
    # pod priority without the API server (pulls/pod_priority.py): the highest priority of the rules a pod matches
    priority_rules: tuple[PriorityRule, ...] = knob(DEFAULT_PRIORITY_RULES, lambda k, v: _priority_rules(k, v))
    # slots above max_parallel only pulls of pods at system-cluster-critical or above may take; 0 = none
    critical_slots: int = knob(0, integer())


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
    # kubelet's image GC threshold rule (imagesets/threshold.py): a prefetch that would take the image
    # filesystem past imageGCHighThresholdPercent minus the margin waits
    gc_threshold_guard: bool = knob(False, boolean())
    kubelet_config_file: str = knob("/var/lib/kubelet/config.yaml", text())  # where imageGCHighThresholdPercent is read
    gc_high_threshold_percent: int = knob(0, lambda k, v: _int_in(k, v, 0, 100))  # 0: kubelet's (its file, else 85)
    gc_threshold_margin_percent: float = knob(5.0, number_in(0, 100))  # percent of the filesystem kept below it
    size_factor: float = knob(2.0, number_in(1, 100))  # bytes on disk per byte a manifest lists (stored + unpacked)
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
    # watch the pods bound to this node for their priority (spec.priority; shim/cluster/pods.py)
    pod_priority: bool = knob(True, boolean())
    max_pods: int = knob(1000, integer(1))  # pods kept (uid, namespace, name, priority: ~0.3 KiB each)


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


def _rules(key: str, v: Any) -> tuple[HandlerRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of rules, got {shown(v)}")
    return tuple(_section(HandlerRule, f"{key}[{i}]", _mapping(f"{key}[{i}]", r)) for i, r in enumerate(v))


def _priority_rules(key: str, v: Any) -> tuple[PriorityRule, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list of rules, got {shown(v)}")
    return tuple(_section(PriorityRule, f"{key}[{i}]", _mapping(f"{key}[{i}]", r)) for i, r in enumerate(v))


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
        from ..credentials.plugins import (  # local import: only when used
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
