"""A node for ``cri-shim node install``/``uninstall`` without systemd or kubelet: its files in a
directory (a kubeadm node's kubelet config, kubeconfig and flags file), and a ``FakeHost`` that
plays systemd, kubelet, the runtime, the shim and the API server's view of the Node.

The fake follows what the real ones do where install depends on it:

* ``systemctl restart kubelet.service`` starts a new kubelet process (a new MainPID) that reads
  its config file as it is at that moment; it is healthy and its Node Ready (a heartbeat two
  seconds after its start) when ``kubelet_ok(config)`` says so, else ``/healthz`` fails. The
  Node keeps its last heartbeat and Ready condition until then, as on a real cluster.
* kubelet's command line is its unit's ``ExecStart=`` (kubeadm's: ``/usr/bin/kubelet
  $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS``)
  with each ``$VAR`` split at whitespace, the variables from its drop-in's ``Environment=``
  and then its ``EnvironmentFile=`` files (kubeadm-flags.env, /etc/default/kubelet) as they are
  when kubelet starts (read with ``shlex``, as a shell would); ``systemctl show -p ExecStart`` /
  ``-p EnvironmentFiles`` answer as systemd does.
* ``systemctl start cri-shim.service`` needs the unit file and a daemon-reload; the shim reads
  /etc/cri-shim/config.yaml when it starts and answers on its ``listen`` for the runtime at
  its ``upstream`` (UNAVAILABLE when nothing listens there, as the real shim).
* Time passes only in ``sleep``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from shim.node_install import install, uninstall
from shim.node_install.host import Done, HostError, NodeView, Runtime
from shim.node_install.kubelet import same_endpoint

RUNTIME_SOCKET = "unix:///run/containerd/containerd.sock"
NODE = "node-a"
EPOCH = 1_800_000_000.0

#: /var/lib/kubelet/config.yaml as kubeadm v1.31 writes it (an empty containerRuntimeEndpoint, no image endpoint)
KUBEADM_CONFIG = """\
apiVersion: kubelet.config.k8s.io/v1beta1
authentication:
  anonymous:
    enabled: false
  webhook:
    cacheTTL: 0s
    enabled: true
  x509:
    clientCAFile: /etc/kubernetes/pki/ca.crt
authorization:
  mode: Webhook
  webhook:
    cacheAuthorizedTTL: 0s
    cacheUnauthorizedTTL: 0s
cgroupDriver: systemd
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
containerRuntimeEndpoint: ""
cpuManagerReconcilePeriod: 0s
evictionPressureTransitionPeriod: 0s
fileCheckFrequency: 0s
healthzBindAddress: 127.0.0.1
healthzPort: 10248
httpCheckFrequency: 0s
imageMaximumGCAge: 0s
imageMinimumGCAge: 0s
kind: KubeletConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
memorySwap: {}
nodeStatusReportFrequency: 0s
nodeStatusUpdateFrequency: 0s
rotateCertificates: true
runtimeRequestTimeout: 0s
shutdownGracePeriod: 0s
shutdownGracePeriodCriticalPods: 0s
staticPodPath: /etc/kubernetes/manifests
streamingConnectionIdleTimeout: 0s
syncFrequency: 0s
volumeStatsAggPeriod: 0s
"""

KUBEADM_FLAGS = 'KUBELET_KUBEADM_ARGS="--pod-infra-container-image=registry.k8s.io/pause:3.10"\n'

#: kubeadm's kubelet.service with its 10-kubeadm.conf drop-in
KUBEADM_EXEC_START = ["/usr/bin/kubelet", "$KUBELET_KUBECONFIG_ARGS", "$KUBELET_CONFIG_ARGS", "$KUBELET_KUBEADM_ARGS",
                      "$KUBELET_EXTRA_ARGS"]
KUBEADM_ENVIRONMENT = {"KUBELET_KUBECONFIG_ARGS": "--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf "
                                                  "--kubeconfig=/etc/kubernetes/kubelet.conf",
                       "KUBELET_CONFIG_ARGS": "--config=/var/lib/kubelet/config.yaml"}
KUBEADM_ENV_FILES = ["/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet"]


def kubeadm_node(root: Path, config: str = KUBEADM_CONFIG, flags: str = KUBEADM_FLAGS) -> Path:
    """A kubeadm node's files under ``root``, and the cri-shim program where the unit expects it."""
    files = {"var/lib/kubelet/config.yaml": config, "var/lib/kubelet/kubeadm-flags.env": flags,
             "etc/kubernetes/kubelet.conf": "apiVersion: v1\nkind: Config\n", "usr/local/bin/cri-shim": "#!/bin/sh\n"}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "usr/local/bin/cri-shim").chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    return root


def snapshot(root: Path) -> dict[str, object]:
    """Every file (bytes, mode), directory (mode) and symlink under ``root``."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777)
            else:
                out[rel] = (p.read_bytes(), st.st_mode & 0o7777)
    return out


MUTATING = ("start", "stop", "restart", "enable", "disable", "daemon-reload")


@dataclass
class Unit:
    active: bool = False
    enabled: bool = False
    pid: int = 0


@dataclass
class FakeHost:
    root: Path
    runtime: Runtime = Runtime("containerd", "v2.4.2")
    #: whether a kubelet started on this config text comes back healthy and Ready
    kubelet_ok: Callable[[str], bool] = lambda text: True
    #: image ID -> tags, pinned by the runtime itself (the sandbox image) and through the shim
    runtime_pins: dict[str, list[str]] = field(default_factory=lambda: {"sha256:pause": ["registry.k8s.io/pause:3.10"]})
    shim_pins: dict[str, list[str]] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)
    now: float = 0.0
    units: dict[str, Unit] = field(default_factory=lambda: {"kubelet.service": Unit(True, True, 100)})
    loaded_units: set[str] = field(default_factory=set)  #: unit files systemd knows (at the last daemon-reload)
    kubelet_started_at: float = EPOCH - 100
    last_renewal: float = EPOCH - 5  #: the Lease as the kubelet before the first restart renewed it
    kubelet_config_at_start: str = ""
    shim_config: dict[str, object] = field(default_factory=dict)  #: what the running shim read at start
    next_pid: int = 200
    exec_start: list[str] = field(default_factory=lambda: list(KUBEADM_EXEC_START))
    environment: dict[str, str] = field(default_factory=lambda: dict(KUBEADM_ENVIRONMENT))
    env_files: list[str] = field(default_factory=lambda: list(KUBEADM_ENV_FILES))
    kubelet_argv: list[str] = field(default_factory=list)  #: the running kubelet's command line

    def __post_init__(self) -> None:
        self.kubelet_config_at_start = self._kubelet_config()
        self.kubelet_argv = self.unit_argv()

    def unit_argv(self) -> list[str]:
        """kubelet's command line were it started now."""
        env = dict(self.environment)
        for f in self.env_files:
            p = self.root / f.lstrip("/")
            for line in p.read_text().splitlines() if p.exists() else []:
                if line.strip() and not line.strip().startswith(("#", ";")) and "=" in line:
                    name, _, value = line.partition("=")
                    env[name.strip()] = " ".join(shlex.split(value))
        argv: list[str] = []
        for word in self.exec_start:
            argv += env.get(word[1:], "").split() if word.startswith("$") else [word]
        return argv

    # -- what tests look at -----------------------------------------------------------

    def mutations(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "systemctl" and c[1] in MUTATING]

    def kubelet_pid(self) -> int:
        return self.units["kubelet.service"].pid

    def _kubelet_config(self) -> str:
        p = self.root / "var/lib/kubelet/config.yaml"
        return p.read_text() if p.exists() else ""

    def _kubelet_running_ok(self) -> bool:
        return self.units["kubelet.service"].active and self.kubelet_ok(self.kubelet_config_at_start)

    # -- Host ---------------------------------------------------------------------------

    def run(self, argv: Sequence[str], timeout: float) -> Done:
        self.calls.append(list(argv))
        if argv[0] == "journalctl":
            return Done(0, "msg=serving\nmsg=\"upstream unavailable\"\n", "")
        assert argv[0] == "systemctl", argv
        verb, rest = argv[1], [a for a in argv[2:] if not a.startswith("-")]
        if verb == "daemon-reload":
            self.loaded_units = {name for name in ("cri-shim.service",)
                                 if any((self.root / d.lstrip("/") / name).exists()
                                        for d in ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system"))}
            return Done(0, "", "")
        unit = self.units.setdefault(rest[0], Unit())
        if verb == "show" and "ExecStart" in argv:
            return Done(0, f"{{ path={self.exec_start[0]} ; argv[]={' '.join(self.exec_start)} ; ignore_errors=no ; "
                           f"start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }}\n", "")
        if verb == "show" and "EnvironmentFiles" in argv:
            return Done(0, "".join(f"{f} (ignore_errors=yes)\n" for f in self.env_files), "")
        if verb == "show" and "InvocationID" in argv:
            return Done(0, f"{unit.pid:032x}\n", "")
        if verb == "show":
            return Done(0, f"{unit.pid if unit.active else 0}\n", "")
        if verb == "is-active":
            return Done(0 if unit.active else 3, "", "")
        if verb == "is-enabled":
            return Done(0 if unit.enabled else 1, "", "")
        if verb in ("enable", "disable"):
            if rest[0] == "cri-shim.service" and rest[0] not in self.loaded_units:
                return Done(1, "", f"Failed to {verb} unit: Unit file {rest[0]} does not exist.")
            unit.enabled = verb == "enable"
            return Done(0, "", "")
        if verb == "stop":
            unit.active, unit.pid = False, 0
            return Done(0, "", "")
        if verb in ("start", "restart"):
            if verb == "start" and unit.active:
                return Done(0, "", "")
            if rest[0] == "cri-shim.service" and rest[0] not in self.loaded_units:
                return Done(5, "", f"Failed to {verb} {rest[0]}: Unit {rest[0]} not found.")
            unit.active, unit.pid, self.next_pid = True, self.next_pid, self.next_pid + 1
            if rest[0] == "kubelet.service":
                self.kubelet_started_at = self.wall()
                self.kubelet_config_at_start = self._kubelet_config()
                self.kubelet_argv = self.unit_argv()
            if rest[0] == "cri-shim.service":
                p = self.root / "etc/cri-shim/config.yaml"
                self.shim_config = (yaml.load(p.read_text(), Loader=yaml.CSafeLoader) or {}) if p.exists() else {}
            return Done(0, "", "")
        raise AssertionError(f"unexpected systemctl call {argv}")

    def command_line(self, pid: int) -> list[str] | None:
        kubelet = self.units["kubelet.service"]
        return list(self.kubelet_argv) if kubelet.active and pid == kubelet.pid else None

    def _shim_listen(self) -> str:
        return str(self.shim_config.get("listen", "unix:///run/cri-shim/cri-shim.sock"))

    def cri_version(self, endpoint: str, timeout: float) -> Runtime:
        if same_endpoint(endpoint, RUNTIME_SOCKET):
            return self.runtime
        shim = self.units.get("cri-shim.service")
        if shim is not None and shim.active and same_endpoint(endpoint, self._shim_listen()):
            upstream = str(self.shim_config.get("upstream", RUNTIME_SOCKET))
            if same_endpoint(upstream, RUNTIME_SOCKET):
                return self.runtime
            raise HostError(f"UNAVAILABLE: runtime {upstream} unreachable")
        raise HostError(f"UNAVAILABLE: failed to connect to all addresses; last error: {endpoint}: No such file")

    def pinned_images(self, endpoint: str, timeout: float) -> dict[str, list[str]]:
        self.cri_version(endpoint, timeout)  # the same reachability
        if same_endpoint(endpoint, RUNTIME_SOCKET):
            return dict(self.runtime_pins)
        return {**self.runtime_pins, **self.shim_pins}

    def healthz(self, host: str, port: int, timeout: float) -> str:
        assert (host, port) == ("127.0.0.1", 10248)
        if not self._kubelet_running_ok():
            return "connection refused"
        return ""

    def node(self, kubeconfig: str, name: str | None, timeout: float) -> NodeView:
        """A kubelet that comes back renews its Lease a second after its start and leaves the Node's
        status as it was (Ready); one that does not renews nothing, and once its first status update
        is due (10 s) writes NotReady if it runs at all."""
        assert kubeconfig == "/etc/kubernetes/kubelet.conf"
        ready = "KubeletReady: kubelet is posting ready status"
        started = self.kubelet_started_at
        if self._kubelet_running_ok():
            renewed = started + 1 if self.wall() >= started + 1 else self.last_renewal
            return NodeView(name or NODE, True, ready, renewed)
        if self.units["kubelet.service"].active and self.wall() >= started + 10:
            return NodeView(name or NODE, False, "KubeletNotReady: container runtime is down", self.last_renewal)
        return NodeView(name or NODE, True, ready, self.last_renewal)

    def wall(self) -> float:
        return EPOCH + self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def do_install(root: Path, host: FakeHost, **kw: Any) -> tuple[int, list[str]]:
    out: list[str] = []
    rc = install.install(install.Options(**kw), root, host, out.append)
    return rc, out


def do_uninstall(root: Path, host: FakeHost, **kw: Any) -> tuple[int, list[str]]:
    out: list[str] = []
    rc = uninstall.uninstall(uninstall.Options(**kw), root, host, out.append)
    return rc, out
