"""Configuration: validated, frozen dataclasses, all in one place (this package).

The file is YAML. ``sections.py`` declares every key once, as a dataclass field with its
default and its check; ``values.py`` holds the checks (the parsers); this module reads the
file. An unknown key or a bad value raises ConfigError naming the key path
(``pulls.max_parallel``) and a short, escaped prefix of the value. A missing or empty file
means the defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .. import safeyaml
from ..safeyaml import CONFIG_MAX_BYTES, TooBig, UnsafeYaml, read_capped
from .sections import (
    DEFAULT_ADMIN_SOCKET,
    DEFAULT_LISTEN,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_UPSTREAM,
    KUBELET_MAX_MESSAGE,
    MAX_STATUS_ROWS,
    MIN_PROGRESS_INTERVAL,
    RELOADABLE_SERVER_KEYS,
    SYSTEM_CLUSTER_CRITICAL,
    SYSTEM_NODE_CRITICAL,
    ClusterConfig,
    Config,
    HandlerRule,
    ImageSetsConfig,
    LogConfig,
    MetricsConfig,
    PinsConfig,
    PriorityRule,
    PullsConfig,
    RuntimeHandlersConfig,
    ServerConfig,
    from_dict,
)
from .values import MIN_MESSAGE_BYTES, UNIX_PATH_MAX, ConfigError, _endpoint, socket_path

__all__ = [
    "DEFAULT_ADMIN_SOCKET", "DEFAULT_LISTEN", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_UPSTREAM", "KUBELET_MAX_MESSAGE",
    "MAX_STATUS_ROWS", "MIN_MESSAGE_BYTES", "MIN_PROGRESS_INTERVAL", "RELOADABLE_SERVER_KEYS", "UNIX_PATH_MAX",
    "ClusterConfig", "Config", "ConfigError", "HandlerRule", "ImageSetsConfig", "LogConfig", "MetricsConfig",
    "PinsConfig", "PriorityRule", "PullsConfig", "RuntimeHandlersConfig", "SYSTEM_CLUSTER_CRITICAL",
    "SYSTEM_NODE_CRITICAL", "ServerConfig", "from_dict", "load", "socket_path", "with_overrides",
]


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
