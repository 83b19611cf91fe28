"""How this node's kubelet is set up: found from the running kubelet, as it runs.

The running kubelet's command line (``systemctl show kubelet.service -p MainPID``, then
``/proc/<pid>/cmdline``) names its config file (``--config``), its kubeconfig, a drop-in
directory (``--config-dir``) and any endpoint flag. A flag beats the config file, and a
drop-in beats the file too, so an endpoint set there is refused: editing the file would not
switch kubelet. An endpoint flag is switched where it is set, when that is one of the files
kubeadm and the distributions' packages keep kubelet's flags in (``flagfile.py``).
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import yamledit
from .yamledit import EditError

UNIT = "kubelet.service"
DEFAULT_CONFIG = "/var/lib/kubelet/config.yaml"  # kubeadm's
#: kubelet's kubeconfig where its command line names none: kubeadm's, then kubelet's own default
KUBECONFIGS = ("/etc/kubernetes/kubelet.conf", "/var/lib/kubelet/kubeconfig")
#: where kubeadm (kubeadm-flags.env) and the deb/rpm packages (KUBELET_EXTRA_ARGS) keep flags
FLAG_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet", "/etc/sysconfig/kubelet")
#: kubelet's default containerRuntimeEndpoint (since 1.27); imageServiceEndpoint defaults to it
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
RUNTIME_KEY = "containerRuntimeEndpoint"
IMAGE_KEY = "imageServiceEndpoint"
RUNTIME_FLAG = "--container-runtime-endpoint"
IMAGE_FLAG = "--image-service-endpoint"
#: the flags read here; each takes a value (``--flag=value`` or ``--flag value``)
VALUE_FLAGS = ("--config", "--config-dir", "--kubeconfig", RUNTIME_FLAG, IMAGE_FLAG, "--hostname-override",
               "--healthz-port", "--healthz-bind-address")


class Refused(Exception):
    """Install cannot go on; the message says why and what to do."""


def parse_flags(argv: Sequence[str]) -> dict[str, str]:
    """The ``VALUE_FLAGS`` on a command line (the last one wins, as kubelet's flag parser does)."""
    out: dict[str, str] = {}
    i = 1
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    break
                i += 1
                value = argv[i]
            out[name] = value
        i += 1
    return out


def same_endpoint(a: str, b: str) -> bool:
    """Whether two CRI endpoints name the same socket (``/var/run`` is ``/run``; no scheme: unix)."""
    return _socket(a) == _socket(b)


def _socket(endpoint: str) -> str:
    path = endpoint[len("unix://"):] if endpoint.startswith("unix://") else endpoint
    path = posixpath.normpath(path)
    return "/run" + path[len("/var/run"):] if path == "/var/run" or path.startswith("/var/run/") else path


_GO_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def go_duration(value: Any) -> float | None:
    """A Go duration as kubelet's config writes them (``10s``, ``1m0s``, ``500ms``), in seconds;
    None when it is not one."""
    if not isinstance(value, str) or not value or _GO_DURATION.sub("", value) not in ("", "0"):
        return None
    return sum(float(n) * _GO_UNIT[u] for n, u in _GO_DURATION.findall(value))


@dataclass(frozen=True)
class Kubelet:
    """kubelet as it runs now."""

    pid: int
    flags: dict[str, str]
    config_path: str  #: kubelet's config file, as a path on the node
    config_data: bytes  #: its bytes now
    settings: dict[str, Any]  #: the file as kubelet reads it
    drop_ins: dict[str, dict[str, Any]]  #: --config-dir's *.conf files, as read
    kubeconfig: str | None  #: kubelet's kubeconfig, None when it has none here (standalone)
    argv: tuple[str, ...]  #: its command line

    @property
    def runtime_endpoint(self) -> str:
        """containerRuntimeEndpoint in effect: the flag, else the file, else kubelet's default."""
        return self.flags.get(RUNTIME_FLAG) or str(self.settings.get(RUNTIME_KEY) or "") or DEFAULT_RUNTIME

    @property
    def image_endpoint(self) -> str:
        """imageServiceEndpoint in effect: the flag, else the file, else the runtime endpoint."""
        return self.flags.get(IMAGE_FLAG) or str(self.settings.get(IMAGE_KEY) or "") or self.runtime_endpoint

    @property
    def healthz(self) -> tuple[str, int] | None:
        """Where kubelet's /healthz answers (healthzBindAddress:healthzPort); None when it is off."""
        port = self.flags.get("--healthz-port") or self.settings.get("healthzPort", 10248)
        try:
            number = int(port)
        except (TypeError, ValueError):
            return None
        if number <= 0:
            return None
        host = str(self.flags.get("--healthz-bind-address") or self.settings.get("healthzBindAddress") or "127.0.0.1")
        try:
            ip = ipaddress.ip_address(host)
            if ip.is_unspecified:
                host = "::1" if ip.version == 6 else "127.0.0.1"
        except ValueError:
            pass
        return host, number

    @property
    def status_update_seconds(self) -> float:
        """nodeStatusUpdateFrequency (kubelet's default, 10 s, when unset or 0)."""
        return go_duration(self.settings.get("nodeStatusUpdateFrequency")) or 10.0

    def endpoint_overrides(self, key: str) -> list[str]:
        """The --config-dir drop-ins that set ``key`` (they beat the config file)."""
        return [name for name, doc in self.drop_ins.items() if key in doc]


def find(root: Path, main_pid: int, argv: list[str] | None, config_path: str | None,
         kubeconfig: str | None) -> Kubelet:
    """kubelet as it runs: ``argv`` is its command line (None when it does not run).
    ``config_path``, ``kubeconfig``: the operator's choice over what the command line says
    (``kubeconfig`` "": none)."""
    if argv is None or main_pid <= 0:
        raise Refused(f"{UNIT} is not running: start it first (install checks that it comes back Ready "
                      f"once switched to the shim)")
    flags = parse_flags(argv)
    path = config_path or flags.get("--config") or ""
    if not path:
        raise Refused(f"kubelet runs without --config (pid {main_pid}: {' '.join(argv)[:300]}): "
                      f"nothing to switch; set the endpoint flags by hand (docs/install.md, 'A node, by hand')")
    path = _absolute(path)
    try:
        data = (root / path.lstrip("/")).read_bytes()
    except OSError as e:
        raise Refused(f"kubelet's config {path}: {e.strerror}") from None
    try:
        settings = yamledit.parse(yamledit.decode(data, path), path)
    except EditError as e:
        raise Refused(str(e)) from None
    drop_ins: dict[str, dict[str, Any]] = {}
    config_dir = flags.get("--config-dir")
    if config_dir:
        d = root / _absolute(config_dir).lstrip("/")
        for f in sorted(d.glob("*.conf")) if d.is_dir() else []:
            name = posixpath.join(_absolute(config_dir), f.name)
            try:
                drop_ins[name] = yamledit.parse(yamledit.decode(f.read_bytes(), name), name)
            except (OSError, EditError) as e:
                raise Refused(f"kubelet's drop-in {name}: {e}") from None
    if kubeconfig is None:
        kubeconfig = flags.get("--kubeconfig") or next(
            (k for k in KUBECONFIGS if (root / k.lstrip("/")).is_file()), None)
    return Kubelet(main_pid, flags, path, data, settings, drop_ins, kubeconfig or None, tuple(argv))


def _absolute(path: str) -> str:
    # kubelet runs with / as its working directory under systemd
    return posixpath.normpath(os.path.join("/", path))
