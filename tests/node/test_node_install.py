"""`cri-shim node install` and `uninstall` on a kubeadm-style node: systemd 252 as PID 1 of a
systemd-nspawn container (scripts/setup.d/45-nspawn-root.sh) running kubelet v1.35 as
kubelet.service, laid out as kubeadm and the Kubernetes packages lay it out (the package's unit
and its 10-kubeadm.conf drop-in, /var/lib/kubelet/config.yaml in kubeadm's own format with
``containerRuntimeEndpoint: ""``, kubeadm-flags.env, /etc/kubernetes/kubelet.conf), registered
with a real kube-apiserver (tests/support/apiserver.py) under its own certificate
(system:node:<name>). cri-shim is the node package: the .deb of scripts/build-deb.sh, built once
per test run from the commit under test (``git archive HEAD``: uncommitted changes are not in it;
tests/support/packaging.py, shared with tests/package), installed with ``dpkg -i`` in a network
namespace with no interface (no pip, no network), after the root's own venv is removed; every
command runs /usr/bin/cri-shim. Its unit is the package's in /lib/systemd/system, used as it is;
kubelet's drop-in and the shim's config come from the package's data.

kubelet runs pods directly on containerd 2.x: runc cannot run inside the container (its cgroup
hierarchies are read-only there), so containerd runs on the host, its socket bound into the
container at /run/containerd (kubelet's default endpoint, and the shim's default upstream), and
kubelet's root and pod-log directories are bound at the same path on both sides, as containerd
reads pod files by kubelet's paths. What kubelet needs that a container does not give by itself:
/dev/kmsg (its OOM watcher) with CAP_SYSLOG, and the three sysctls it would set at start shown
with the values it wants (overcommit_memory, panic, panic_on_oops: host-wide, never changed here).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import binaries, cri, nspawn
from tests.support.apiserver import ControlPlane, require_control_plane
from tests.support.crictl import Crictl
from tests.support.fixtures import proxy  # noqa: F401  (fixture)
from tests.support.kube import Admin
from tests.support.node import NodeContainerd, NodeImages, running_containers, static_pod, wait_running
from tests.support.packaging import BUILD_TIMEOUT, DEB_NAME, built_once
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy, free_port

REPO = Path(__file__).resolve().parents[2]
NODE = "nspawn-kubelet"
#: the first test to use ``kube_node`` builds the .deb (unless tests/package did) and boots the node
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 600)
CRI_SHIM = "/usr/bin/cri-shim"
#: the package's unit and its drop-in (scripts/build-deb.sh); install uses them as they are
PACKAGED_UNIT = "/lib/systemd/system/cri-shim.service"
PACKAGED_DROP_IN = "/lib/systemd/system/cri-shim.service.d/10-deb.conf"
KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
SHIM_SOCKET = "unix:///run/cri-shim/cri-shim.sock"
#: what install adds to a node (and uninstall removes)
SHIM_PATHS = ("/etc/cri-shim", "/etc/systemd/system/cri-shim.service",
              "/etc/systemd/system/kubelet.service.d/10-cri-shim.conf", "/var/lib/cri-shim")

# The Kubernetes deb's unit and kubeadm's drop-in, as they are shipped.
KUBELET_UNIT = """[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""
KUBEADM_DROP_IN = """# Note: This dropin only works with kubeadm and kubelet v1.11+
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
# This is a file that "kubeadm init" and "kubeadm join" generates at runtime, populating the KUBELET_KUBEADM_ARGS variable dynamically
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
# This is a file that the user can use for overrides of the kubelet args as a last resort. Preferably, the user should use
# the .NodeRegistration.KubeletExtraArgs object in the configuration files instead. KUBELET_EXTRA_ARGS should be sourced from this file.
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
"""


def kubeadm_config(shared: Path, healthz_port: int, port: int) -> str:
    """/var/lib/kubelet/config.yaml as kubeadm v1.35 writes it (keys sorted, zero durations, an empty
    containerRuntimeEndpoint), plus what kubelet needs in this container (marked)."""
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
address: 127.0.0.1  # this test: the host's network is shared
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
cgroupDriver: cgroupfs  # this test: no systemd on the host
cgroupsPerQOS: false  # this test: the container's cgroups are read-only
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
containerRuntimeEndpoint: ""
cpuManagerReconcilePeriod: 0s
enforceNodeAllocatable: []  # this test
evictionHard:  # this test: other tests share this disk
  imagefs.available: "0%"
  imagefs.inodesFree: "0%"
  memory.available: 1Mi
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
evictionPressureTransitionPeriod: 0s
failCgroupV1: false  # this test: the host has cgroup v1
failSwapOn: false
fileCheckFrequency: 0s
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
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
memorySwap: {{}}
nodeStatusReportFrequency: 0s
nodeStatusUpdateFrequency: 0s
podLogsDir: {shared}/pod-logs  # this test: containerd on the host writes the logs
port: {port}  # this test
readOnlyPort: 0
rotateCertificates: false
runtimeRequestTimeout: 0s
shutdownGracePeriod: 0s
shutdownGracePeriodCriticalPods: 0s
staticPodPath: /etc/kubernetes/manifests
streamingConnectionIdleTimeout: 0s
syncFrequency: 0s
volumeStatsAggPeriod: 0s
"""


class KubeNode:
    """The booted container with kubelet running pods, the API server, containerd on the host."""

    def __init__(self, m: nspawn.Machine, cp: ControlPlane, admin: Admin, ctd: NodeContainerd,
                 images: NodeImages, registry: RegistryWithProxy) -> None:
        self.m, self.cp, self.admin, self.ctd, self.images, self.registry = m, cp, admin, ctd, images, registry
        self.direct = Crictl(ctd.endpoint, timeout=60)
        self.original = b""  # kubelet's config as the node came

    def log_tails(self) -> dict[str, str]:
        return {"journal kubelet": self.m.journal("kubelet", 30), "journal cri-shim": self.m.journal("cri-shim", 30),
                "containerd": self.ctd.log_tail(20), **self.cp.log_tails()}

    def cri_shim(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``cri-shim <args>`` on the node, as root: the package's /usr/bin/cri-shim."""
        return self.m.run(CRI_SHIM, *args, check=False, timeout=timeout)

    def kubelet_config(self) -> bytes:
        return self.m.path(KUBELET_CONFIG).read_bytes()

    def pid(self, unit: str) -> str:
        return self.m.show(unit, "MainPID")["MainPID"]

    def node_ready(self) -> tuple[bool, float]:
        """(Ready, when kubelet last renewed its Lease, seconds since the epoch), as the admin reads them."""
        from kubernetes_asyncio.client import CoordinationV1Api, CoreV1Api

        async def read(api: Any) -> tuple[bool, float]:
            node = await CoreV1Api(api).read_node(NODE)
            lease = await CoordinationV1Api(api).read_namespaced_lease(NODE, "kube-node-lease")
            ready = next(c for c in node.status.conditions if c.type == "Ready")
            return ready.status == "True", lease.spec.renew_time.timestamp()

        return self.admin.run(read)

    def wait_ready(self, after: float = 0.0, timeout: float = 120) -> None:
        """The Node Ready, its Lease renewed after ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ready, renewed = self.node_ready()
                if ready and renewed > after:
                    return
            except Exception:  # noqa: BLE001 - not registered yet
                pass
            assert time.monotonic() < deadline, f"Node {NODE} not Ready\n{self.m.journal('kubelet', 40)}"
            time.sleep(0.5)

    def add_pod(self, name: str, image: str) -> str:
        """A static pod, its manifest written whole under a name kubelet skips (a dot first), then renamed."""
        hidden = self.m.path(f"/etc/kubernetes/manifests/.{name}.yaml")
        hidden.write_text(yaml.safe_dump(static_pod(name, image)))
        hidden.replace(hidden.with_name(f"{name}.yaml"))
        return f"{name}-{NODE}"

    def running(self) -> dict[str, dict[str, Any]]:
        return running_containers(self.direct)

    def present(self, path: str) -> bool:
        p = self.m.path(path)
        return p.exists() or p.is_symlink()


@pytest.fixture(scope="module")
def kube_node(registry: RegistryWithProxy, node_binaries: tuple[str, str], node_images: NodeImages,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeNode]:
    binaries.require("systemd-nspawn")
    binaries.require("nsenter")
    root, why = nspawn.find_root()
    if root is None:
        if binaries.in_ci():
            pytest.fail(why + " (CI is set: node tests must not be skipped)", pytrace=False)
        pytest.skip(why)
    apiserver, etcd = require_control_plane()
    deb = built_once("build-deb.sh", tmp_path_factory, "node").out / DEB_NAME
    work = tmp_path_factory.mktemp("node-install")
    # the same path on both sides: kubelet's root dir and pod logs, containerd's root
    shared = Path(tempfile.mkdtemp(prefix="nsp-ni-", dir="/tmp"))
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="kube-")), apiserver=apiserver, etcd=etcd, nodes=(NODE,))
    ctd = NodeContainerd(node_binaries[0], shared / "ctd", sandbox_image=node_images.pause.ref,
                         registries=[registry.host])
    m = nspawn.Machine(root, src=REPO, log_path=work / "nspawn.log", extra_args=["--capability=CAP_SYSLOG"],
                       binds=[(shared, str(shared), False), (shared / "ctd" / "state", "/run/containerd", False),
                              (node_binaries[1], "/usr/bin/kubelet", True), ("/dev/kmsg", "/dev/kmsg", True),
                              (deb.parent, "/srv/pkg", True)])
    node: KubeNode | None = None
    try:
        cp.start()
        admin = Admin(cp.kubeconfig(work / "admin.kubeconfig"))
        ctd.start()
        m.boot()
        # The node's containerd is the host's. Debian's containerd.service in the root would be
        # started by the shim unit's Wants=containerd.service and take over its socket path.
        m.systemctl("mask", "containerd.service")
        for f, v in (("vm/overcommit_memory", "1"), ("kernel/panic", "10"), ("kernel/panic_on_oops", "1")):
            m.write(f"/run/kubelet-sysctl/{f.replace('/', '.')}", v + "\n")
            m.run("mount", "--bind", f"/run/kubelet-sysctl/{f.replace('/', '.')}", f"/proc/sys/{f}")
        # the node package, offline: not the cached root's own venv (the manual install of the systemd tests)
        m.remove(["/opt/cri-shim", "/usr/local/bin/cri-shim"])
        m.run("unshare", "--net", "dpkg", "-i", f"/srv/pkg/{DEB_NAME}", timeout=300)
        # kubeadm's layout
        m.write("/usr/lib/systemd/system/kubelet.service", KUBELET_UNIT)
        m.write("/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf", KUBEADM_DROP_IN)
        m.write("/var/lib/kubelet/kubeadm-flags.env",
                f'KUBELET_KUBEADM_ARGS="--hostname-override={NODE} --root-dir={shared}/kubelet"\n')
        m.write(KUBELET_CONFIG, kubeadm_config(shared, free_port(), free_port()))
        m.write("/etc/kubernetes/pki/ca.crt", cp.ca.read_text())
        m.write("/var/lib/kubelet/pki/kubelet-client-current.pem", cp.kubelet_cert(NODE).read_text(), mode=0o600)
        m.write("/etc/kubernetes/kubelet.conf", yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "default-auth@kubernetes",
            "clusters": [{"name": "kubernetes", "cluster": {
                "server": cp.url, "certificate-authority-data": base64.b64encode(cp.ca.read_bytes()).decode()}}],
            "contexts": [{"name": "default-auth@kubernetes", "context": {"cluster": "kubernetes",
                                                                        "user": "default-auth"}}],
            "users": [{"name": "default-auth", "user": {
                "client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem",
                "client-key": "/var/lib/kubelet/pki/kubelet-client-current.pem"}}]}), mode=0o600)
        m.run("mkdir", "-p", "/etc/kubernetes/manifests", f"{shared}/kubelet")
        m.systemctl("daemon-reload")
        m.systemctl("enable", "--now", "kubelet.service")
        node = KubeNode(m, cp, admin, ctd, node_images, registry)
        node.wait_ready()
        steady = node.add_pod("steady", node_images.busybox.ref)
        wait_running(node.direct, {steady}, timeout=120, why=lambda: m.journal("kubelet", 40))
        node.original = node.kubelet_config()
        yield node
    finally:
        if m.pid1 is not None:
            m.systemctl("stop", "kubelet.service", "cri-shim.service", check=False)
        ctd.close(Crictl(ctd.endpoint, timeout=60))
        m.terminate()
        cp.stop()
        subprocess.run(["umount", "-R", "-l", str(shared / "kubelet")], capture_output=True, check=False)
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(cp.dir, ignore_errors=True)


def _image_status(node: KubeNode, image: str) -> cri.ImageInfo | None:
    return cri.decode_image_status_response(cri.call(node.m.path(SHIM_SOCKET[len("unix://"):]), "ImageStatus",
                                                     cri.image_status_request(image), timeout=30).unwrap())


def _files(node: KubeNode) -> dict[str, bytes]:
    """What install writes and kubelet and systemd read, by path."""
    paths = [KUBELET_CONFIG, "/etc/cri-shim/config.yaml", PACKAGED_UNIT, PACKAGED_DROP_IN,
             "/etc/systemd/system/kubelet.service.d/10-cri-shim.conf", "/var/lib/cri-shim/install/state.json"]
    return {p: node.m.path(p).read_bytes() for p in paths}


def _package_intact(node: KubeNode) -> str:
    """``dpkg --verify cri-shim``: "" when every file of the package is as it installed it."""
    r = node.m.run("dpkg", "--verify", "cri-shim", check=False)
    return r.stdout + r.stderr + ("" if r.returncode == 0 else f"(exit {r.returncode})")


@pytest.mark.timeout(BUILD_TIMEOUT + 900)
@pytest.mark.parametrize("mode", ["image-only", "full"])
def test_install_switches_a_running_node_and_uninstall_puts_it_back(kube_node: KubeNode, proxy: CountingProxy,  # noqa: F811
                                                                     mode: str) -> None:
    """A node whose kubelet runs a pod directly on containerd: `--dry-run` changes nothing;
    `node install` switches kubelet's image endpoint (full mode: its runtime endpoint) to the shim,
    changing only those lines of kubelet's config; the running pod keeps running (same container,
    never restarted), and a new pod's image is pulled through the shim (its pull sits in the
    shim's queue while the registry holds the blob). The shim runs from the package's unit in
    /lib/systemd/system, used as it is (no unit of install's own), on /usr/bin/cri-shim. A second
    install changes nothing (no file, no restart). `node uninstall` puts kubelet's config back
    byte for byte, names the pin it gives up, and removes what install added; both pods still run;
    the package is as dpkg installed it, its unit stopped and disabled. A second uninstall has
    nothing to do."""
    node = kube_node
    steady = f"steady-{NODE}"
    before = node.running()[steady]
    if mode == "image-only":
        switched = node.original + f"imageServiceEndpoint: {SHIM_SOCKET}\n".encode()
        line = f"    +imageServiceEndpoint: {SHIM_SOCKET}"
    else:
        switched = node.original.replace(b'containerRuntimeEndpoint: ""', f"containerRuntimeEndpoint: {SHIM_SOCKET}".encode())
        line = f"    +containerRuntimeEndpoint: {SHIM_SOCKET}"
    switched += b"serializeImagePulls: false\nregistryPullQPS: 0\n"

    # --dry-run: every change printed, none made
    r = node.cri_shim("node", "install", "--mode", mode, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert line in r.stdout and "would run systemctl restart kubelet.service" in r.stdout, r.stdout
    assert node.kubelet_config() == node.original
    assert not any(node.present(p) for p in SHIM_PATHS)

    kubelet_pid = node.pid("kubelet")
    t0 = time.time()
    r = node.cri_shim("node", "install", "--mode", mode)
    took = time.time() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\nnode install --mode {mode} took {took:.1f} s:\n{r.stdout}")
    assert "checked: Version through unix:///run/cri-shim/cri-shim.sock answers containerd" in r.stdout
    assert f"{PACKAGED_UNIT}: shipped by the package, used as it is" in r.stdout, r.stdout
    assert node.kubelet_config() == switched
    assert node.pid("kubelet") != kubelet_pid
    assert node.m.show("cri-shim", "ActiveState", "UnitFileState") == {"ActiveState": "active",
                                                                        "UnitFileState": "enabled"}
    assert not node.present("/etc/systemd/system/cri-shim.service")
    shown = node.m.show("cri-shim", "FragmentPath", "ExecStart")
    assert shown["FragmentPath"] == PACKAGED_UNIT and f"path={CRI_SHIM}" in shown["ExecStart"], shown
    node.wait_ready(after=t0)
    # the running pod was not touched
    now = node.running()[steady]
    assert (now["id"], now["podSandboxId"]) == (before["id"], before["podSandboxId"])
    assert now["metadata"].get("attempt", 0) == 0
    # a new pod's image goes through the shim: its pull waits in the shim while the blob is held
    after_image = node.images.variant(node.registry, f"node/install-{mode}").ref
    proxy.hold_blobs()
    try:
        after = node.add_pod(f"after-{mode}", after_image)
        deadline = time.monotonic() + 60
        while True:
            st = node.m.status_json()
            pulls = st["pulls"]["in_flight"] + st["pulls"]["queued"]  # type: ignore[index]
            if any(str(p["image"]).endswith(f"node/install-{mode}:v1") for p in pulls):
                break
            assert time.monotonic() < deadline, f"kubelet's pull never reached the shim: {st['pulls']}"
            time.sleep(0.2)
    finally:
        proxy.release_blobs()
    wait_running(node.direct, {steady, after}, timeout=120, why=lambda: node.m.journal("kubelet", 40))

    # install again: nothing changes
    files, pids = _files(node), (node.pid("kubelet"), node.pid("cri-shim"))
    r = node.cri_shim("node", "install", "--mode", mode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to change" in r.stdout, r.stdout
    assert _files(node) == files and (node.pid("kubelet"), node.pid("cri-shim")) == pids

    # the operator pins the new pod's image (a reload); uninstall gives the pin up, and says so
    cfg = yaml.safe_load(node.m.path("/etc/cri-shim/config.yaml").read_text())
    cfg["pins"]["images"] = [after_image]
    node.m.write("/etc/cri-shim/config.yaml", yaml.safe_dump(cfg))
    node.m.systemctl("reload", "cri-shim")
    deadline = time.monotonic() + 30
    while not ((st_ := _image_status(node, after_image)) is not None and st_.pinned):
        assert time.monotonic() < deadline, "the pin never took effect"
        time.sleep(0.2)

    kubelet_pid = node.pid("kubelet")
    t0 = time.time()
    r = node.cri_shim("node", "uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"node uninstall took {time.time() - t0:.1f} s:\n{r.stdout}")
    assert node.kubelet_config() == node.original
    assert node.pid("kubelet") != kubelet_pid
    assert f"kubelet's image GC may now remove the 1 image(s) it kept: {after_image}" in r.stdout, r.stdout
    assert r.stdout.index("run systemctl restart kubelet.service") < r.stdout.index("run systemctl stop cri-shim")
    assert not any(node.present(p) for p in SHIM_PATHS), [p for p in SHIM_PATHS if node.present(p)]
    # the package's files stay, as dpkg installed them; its unit stopped and disabled
    assert node.present(PACKAGED_UNIT) and node.present(PACKAGED_DROP_IN)
    assert _package_intact(node) == ""
    assert node.m.show("cri-shim", "ActiveState", "UnitFileState") == {"ActiveState": "inactive",
                                                                        "UnitFileState": "disabled"}
    node.wait_ready(after=t0)
    now = node.running()
    assert {steady, after} <= now.keys() and now[steady]["id"] == before["id"]

    r = node.cri_shim("node", "uninstall")
    assert r.returncode == 0 and r.stdout.startswith("nothing to undo"), r.stdout + r.stderr
    assert node.kubelet_config() == node.original


def test_a_broken_shim_config_is_rolled_back(kube_node: KubeNode, tmp_path: Path) -> None:
    """A shim config whose upstream has a typo: the shim starts but cannot answer Version for the
    runtime, so install undoes everything before kubelet is touched: kubelet not restarted, its
    config unchanged, the Node Ready, nothing of cri-shim left on the node."""
    node = kube_node
    node.m.write("/root/broken.yaml", "upstream: unix:///run/containerd/containerd.sock.typo\n")
    kubelet_pid = node.pid("kubelet")
    r = node.cri_shim("node", "install", "--config", "/root/broken.yaml", "--shim-timeout", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    print(f"\n{r.stdout}")
    assert "failed: the shim does not answer Version on unix:///run/cri-shim/cri-shim.sock within 5 s" in r.stdout
    assert "switched back: kubelet's config /var/lib/kubelet/config.yaml is as it was, byte for byte" in r.stdout
    assert node.kubelet_config() == node.original
    assert node.pid("kubelet") == kubelet_pid
    assert node.node_ready()[0]
    assert not any(node.present(p) for p in SHIM_PATHS), [p for p in SHIM_PATHS if node.present(p)]
    shown = node.m.show("cri-shim", "ActiveState", "UnitFileState")
    assert shown["ActiveState"] in ("inactive", "failed") and shown["UnitFileState"] == "disabled", shown
    assert _package_intact(node) == ""


def test_a_kubelet_not_back_in_time_is_switched_back(kube_node: KubeNode) -> None:
    """kubelet not healthy with its Node Ready within --ready-timeout (0 s: no kubelet is back the
    moment its restart returns): install puts kubelet's config back byte for byte, restarts kubelet
    on it and waits for it, then undoes the rest. The running pod is not touched."""
    node = kube_node
    steady = node.running()[f"steady-{NODE}"]
    t0 = time.time()
    r = node.cri_shim("node", "install", "--ready-timeout", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    print(f"\n{r.stdout}")
    assert "failed: kubelet not back within 0 s of the switch" in r.stdout
    assert "kubelet back on its own config after" in r.stdout
    assert node.kubelet_config() == node.original
    assert not any(node.present(p) for p in SHIM_PATHS), [p for p in SHIM_PATHS if node.present(p)]
    node.wait_ready(after=t0)
    assert node.running()[f"steady-{NODE}"]["id"] == steady["id"]


def test_a_runtime_flag_in_kubeadm_flags_env_is_switched_there_and_put_back(kube_node: KubeNode) -> None:
    """kubelet as kubeadm before 1.27 set it up: `--container-runtime-endpoint` in kubeadm-flags.env,
    which kubeadm's drop-in reads (EnvironmentFile=) and passes on ($KUBELET_KUBEADM_ARGS). Full mode
    sets the flag's value to the shim's socket in that file, changing nothing else of it, and the
    restarted kubelet runs with it; a second install changes nothing; uninstall puts the file back
    byte for byte and kubelet runs with the runtime's socket again. The running pod is not touched."""
    node = kube_node
    flags_file = "/var/lib/kubelet/kubeadm-flags.env"
    kubeadm = node.m.path(flags_file).read_bytes()
    runtime = "unix:///run/containerd/containerd.sock"
    with_flag = kubeadm.replace(b'KUBELET_KUBEADM_ARGS="', f'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint='
                                                          f'{runtime} '.encode())
    steady = node.running()[f"steady-{NODE}"]

    def cmdline() -> list[str]:
        return node.m.run("cat", f"/proc/{node.pid('kubelet')}/cmdline").stdout.split("\0")

    try:
        node.m.path(flags_file).write_bytes(with_flag)
        t0 = time.time()
        node.m.systemctl("restart", "kubelet.service")
        node.wait_ready(after=t0)
        assert f"--container-runtime-endpoint={runtime}" in cmdline()
        r = node.cri_shim("node", "install", "--mode", "full")
        print(f"\n{r.stdout}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert node.m.path(flags_file).read_bytes() == with_flag.replace(runtime.encode(), SHIM_SOCKET.encode())
        assert f"--container-runtime-endpoint={SHIM_SOCKET}" in cmdline()
        assert b"containerRuntimeEndpoint: \"\"" in node.kubelet_config()  # the flag, not the config key
        pid = node.pid("kubelet")
        r = node.cri_shim("node", "install", "--mode", "full")
        assert r.returncode == 0 and "nothing to change" in r.stdout, r.stdout + r.stderr
        assert node.pid("kubelet") == pid
        r = node.cri_shim("node", "uninstall")
        print(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr
        assert node.m.path(flags_file).read_bytes() == with_flag
        assert node.kubelet_config() == node.original
        assert f"--container-runtime-endpoint={runtime}" in cmdline()
        assert not any(node.present(p) for p in SHIM_PATHS), [p for p in SHIM_PATHS if node.present(p)]
        assert node.running()[f"steady-{NODE}"]["id"] == steady["id"]
    finally:
        node.m.path(flags_file).write_bytes(kubeadm)
        t0 = time.time()
        node.m.systemctl("restart", "kubelet.service")
        node.wait_ready(after=t0)
