"""kube-scheduler and kube-controller-manager next to the test API server (tests/support/apiserver.py),
so a Deployment applied to it runs as pods on a registered kubelet; and the one Service route a pod
needs to reach the API server without kube-proxy.

Install: ``scripts/setup.d/55-apiserver.sh`` builds both, and kubectl, with kube-apiserver (one
wrapper module, one ``go build``), cached at
/var/cache/cri-shim/{kube-scheduler,kube-controller-manager,kubectl}-<v>/.

* The scheduler and the controller manager run with the admin's kubeconfig, no leader election,
  serving their health endpoints on loopback ports. The controller manager runs only the
  controllers a Deployment's pods need: deployment, replicaset, the ServiceAccount and
  ``kube-root-ca.crt`` publishers, the garbage collector, and the node lifecycle controller (a
  kubelet registers its Node tainted ``node.kubernetes.io/not-ready``; that controller lifts the
  taint once the Node is Ready). Not the taint eviction controller: the session's API server has
  Node objects with no kubelet behind them (tainted unreachable by the lifecycle controller), and
  nothing here should evict.
* :class:`ServiceRoute` is what kube-proxy's iptables mode writes for the ``kubernetes`` Service:
  a DNAT from its ClusterIP:443 to the API server's address, 127.0.0.1:<port> (it listens on
  loopback only; the API refuses a loopback address in Endpoints, so the API server publishes
  none and kube-proxy itself would have nothing to route to), for packets arriving from the pod bridge;
  ``route_localnet`` on that bridge lets the kernel route them to (and answer them from)
  127.0.0.1. Pods reach the ClusterIP through the bridge's gateway (NodeContainerd's
  ``pod_routes``). No address outside the machine is involved.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from tests.support import binaries
from tests.support.apiserver import INSTALL, K8S_VERSION, ControlPlane
from tests.support.procs import terminate
from tests.support.registry import free_port

SCHEDULER = Path(f"/var/cache/cri-shim/kube-scheduler-{K8S_VERSION}/kube-scheduler")
CONTROLLER_MANAGER = Path(f"/var/cache/cri-shim/kube-controller-manager-{K8S_VERSION}/kube-controller-manager")
KUBECTL = Path(f"/var/cache/cri-shim/kubectl-{K8S_VERSION}/kubectl")
#: What a Deployment's pods need, and nothing that acts on Nodes (see the module's docstring).
CONTROLLERS = ("deployment-controller", "replicaset-controller", "serviceaccount-controller",
               "serviceaccount-token-controller", "root-ca-certificate-publisher-controller",
               "garbage-collector-controller", "node-lifecycle-controller")


def _require(env: str, path: Path) -> str:
    import pytest

    p = os.environ.get(env) or str(path)
    if not os.access(p, os.X_OK):
        msg = f"no {Path(p).name} at {p} (install: {INSTALL})"
        if binaries.in_ci():
            pytest.fail(msg + " (CI is set: cluster tests must not be skipped)", pytrace=False)
        pytest.skip(msg)
    return p


def require_kube_controllers() -> tuple[str, str]:
    """(kube-scheduler, kube-controller-manager): skips (fails under CI) with the install command."""
    return (_require("CRI_SHIM_KUBE_SCHEDULER", SCHEDULER),
            _require("CRI_SHIM_KUBE_CONTROLLER_MANAGER", CONTROLLER_MANAGER))


def require_kubectl() -> str:
    """kubectl of the API server's version (not whichever is on PATH: kubectl supports one minor
    version of skew)."""
    return _require("CRI_SHIM_KUBECTL", KUBECTL)


class KubeComponent:
    """One of kube-scheduler / kube-controller-manager as a process, logging to ``workdir/<name>.log``."""

    def __init__(self, name: str, binary: str, cp: ControlPlane, workdir: Path, *flags: str) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        kubeconfig = cp.kubeconfig(workdir / f"{name}.kubeconfig")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "--kubeconfig", str(kubeconfig), "--leader-elect=false", "--bind-address", "127.0.0.1",
             "--secure-port", str(self.port), "-v", "2", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its self-signed serving cert
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/healthz", context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.3)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        terminate(self.proc, timeout=10)
        self._log.close()


def start_scheduler(binary: str, cp: ControlPlane, workdir: Path) -> KubeComponent:
    return KubeComponent("kube-scheduler", binary, cp, workdir)


def start_controller_manager(binary: str, cp: ControlPlane, workdir: Path) -> KubeComponent:
    return KubeComponent(
        "kube-controller-manager", binary, cp, workdir,
        "--controllers", ",".join(CONTROLLERS), "--use-service-account-credentials=false",
        "--root-ca-file", str(cp.ca), "--service-account-private-key-file", str(cp.dir / "sa.key"))


class ServiceRoute:
    """kube-proxy's rule for one Service port (see the module's docstring): packets from ``bridge``
    to ``cluster_ip:port`` go to ``endpoint`` (host:port). ``install()`` creates the bridge if the
    CNI plugin has not yet (it adopts an existing one); ``remove()`` deletes the rule."""

    def __init__(self, bridge: str, cluster_ip: str, port: int, endpoint: tuple[str, int]) -> None:
        self.bridge = bridge
        self.rule = ["PREROUTING", "-i", bridge, "-d", cluster_ip, "-p", "tcp", "--dport", str(port),
                     "-m", "comment", "--comment", f"cri-shim-test-{uuid.uuid4().hex[:8]}",
                     "-j", "DNAT", "--to-destination", f"{endpoint[0]}:{endpoint[1]}"]
        self.installed = False

    def install(self) -> "ServiceRoute":
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode != 0:
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True, capture_output=True)
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1\n")
        subprocess.run(["iptables", "-t", "nat", "-I", *self.rule], check=True, capture_output=True, text=True)
        self.installed = True
        return self

    def remove(self) -> None:
        if self.installed:
            subprocess.run(["iptables", "-t", "nat", "-D", *self.rule], check=False, capture_output=True)
            self.installed = False
