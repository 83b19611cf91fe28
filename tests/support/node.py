"""A real node for the ``node`` suite: containerd 2.x running containers with runc, test
images made here (busybox from Debian's busybox-static, a static pause binary), and a
standalone kubelet (no API server) running static pods.

Install: ``scripts/setup.d/30-node-runtime.sh`` (runc, CNI plugins, busybox-static, gcc,
the 2.x containerd-shim-runc-v2 next to containerd 2.x) and ``scripts/setup.d/40-kubelet.sh``
(kubelet built from the Go module proxy, cached at /var/cache/cri-shim/kubelet-<version>/).

    images = build_node_images(registry, workdir)       # busybox + pause, pushed
    ctrd = NodeContainerd(binary, short_dir(), sandbox_image=images.pause.ref,
                          registries=[registry.host]).start()
    kubelet = Kubelet(kubelet_binary, tmp_path / "kubelet", runtime_endpoint=shim.endpoint).start()
    kubelet.add_static_pod(static_pod("web", images.busybox.ref, ["sleep", "3600"]))
    kubelet.wait_running(crictl, {"web"})

Everything a component writes lives in its own directory; :meth:`NodeContainerd.stop`
removes every pod it ran first, so no runc container, mount or netns outlives a test.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import binaries, cri
from tests.support.containerd2 import Containerd2
from tests.support.crictl import Crictl
from tests.support.oci import MEDIA_OCI_CONFIG, MEDIA_OCI_LAYER_GZIP, MEDIA_OCI_MANIFEST, Blob, Layer, OciImage, \
    PushedImage, sha256_digest
from tests.support.registry import free_port

KUBELET_VERSION = os.environ.get("CRI_SHIM_KUBELET_VERSION", "v1.35.0")
KUBELET_CACHE = Path(f"/var/cache/cri-shim/kubelet-{KUBELET_VERSION}/kubelet")
KUBELET_INSTALL = "bash scripts/setup.d/40-kubelet.sh"
RUNTIME_INSTALL = "bash scripts/setup.d/30-node-runtime.sh"
CONTAINERD2_DIR = Path("/opt/containerd2/bin")
CNI_BIN_DIR = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
#: Applets linked into the busybox image's /bin.
APPLETS = ("sh", "sleep", "echo", "cat", "ls", "hostname", "true", "date", "ps", "wget", "id")

PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGTERM, quit);
    signal(SIGINT, quit);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


def _fail_or_skip(message: str) -> None:
    import pytest

    if binaries.in_ci():
        pytest.fail(message + " (CI is set: node tests must not be skipped)", pytrace=False)
    pytest.skip(message)


def require_node() -> tuple[str, str]:
    """(containerd 2.x path, kubelet path) when this machine can run a node; else skip (fail in CI)."""
    from tests.support import containerd2

    binary, why = containerd2.find()
    if binary is None:
        _fail_or_skip(why)
    shim = CONTAINERD2_DIR / "containerd-shim-runc-v2"
    if not os.access(shim, os.X_OK):
        _fail_or_skip(f"no 2.x containerd-shim-runc-v2 at {shim} (install: {RUNTIME_INSTALL})")
    for what, path in (("runc", shutil.which("runc") or "/usr/sbin/runc"), ("CNI bridge plugin", str(CNI_BIN_DIR / "bridge")),
                       ("busybox-static", str(BUSYBOX)), ("gcc", shutil.which("gcc") or "/usr/bin/gcc")):
        if not os.access(path, os.X_OK):
            _fail_or_skip(f"{what} missing at {path} (install: {RUNTIME_INSTALL})")
    kubelet = os.environ.get("CRI_SHIM_KUBELET") or str(KUBELET_CACHE)
    if not os.access(kubelet, os.X_OK):
        _fail_or_skip(f"no kubelet at {kubelet} (install: {KUBELET_INSTALL})")
    if os.geteuid() != 0:
        _fail_or_skip("running containers needs root")
    assert binary is not None
    return binary, kubelet


def short_dir(prefix: str = "node-") -> Path:
    """A short directory (unix socket paths must stay below 108 bytes), under the session's
    temp dir in tests (tests/conftest.py checks nothing is left there)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


# --------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------


def build_pause(directory: Path) -> Path:
    """Compile the static pause binary (waits for SIGTERM/SIGINT, reaps children)."""
    directory.mkdir(parents=True, exist_ok=True)
    src, out = directory / "pause.c", directory / "pause"
    src.write_text(PAUSE_C)
    subprocess.run([shutil.which("gcc") or "gcc", "-static", "-Os", "-s", "-o", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    return out


def rootfs_layer(files: Mapping[str, tuple[bytes, int]], symlinks: Mapping[str, str] = {},
                 dirs: Iterable[str] = ("etc", "tmp", "proc", "sys", "dev", "var", "root")) -> Layer:
    """A gzip layer: ``files`` (path -> (content, mode)), ``symlinks`` (path -> target), empty ``dirs``."""
    import gzip

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()

        def add_dir(d: str, mode: int = 0o755) -> None:
            parts = d.strip("/").split("/")
            for i in range(len(parts)):
                p = "/".join(parts[: i + 1])
                if p and p not in made:
                    made.add(p)
                    info = tarfile.TarInfo(p)
                    info.type, info.mode = tarfile.DIRTYPE, (0o1777 if p == "tmp" else mode)
                    tar.addfile(info)

        for d in dirs:
            add_dir(d)
        for path in sorted(files):
            data, mode = files[path]
            add_dir(os.path.dirname(path.strip("/")))
            info = tarfile.TarInfo(path.strip("/"))
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        for path in sorted(symlinks):
            add_dir(os.path.dirname(path.strip("/")))
            info = tarfile.TarInfo(path.strip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, symlinks[path], 0o777
            tar.addfile(info)
    raw = buf.getvalue()
    return Layer(Blob(MEDIA_OCI_LAYER_GZIP, gzip.compress(raw, compresslevel=6, mtime=0)), sha256_digest(raw))


def rootfs_image(layers: Sequence[Layer], *, entrypoint: Sequence[str] = (), cmd: Sequence[str] = (),
                 unique: str = "") -> OciImage:
    """An image whose config runs ``entrypoint`` + ``cmd``; ``unique`` (a label) makes it distinct."""
    config_doc: dict[str, Any] = {
        "created": "2024-01-01T00:00:00Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                   "Labels": {"io.cri-shim.test.unique": unique or uuid.uuid4().hex}},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "cri-shim node suite"}],
    }
    if entrypoint:
        config_doc["config"]["Entrypoint"] = list(entrypoint)
    if cmd:
        config_doc["config"]["Cmd"] = list(cmd)
    config = Blob(MEDIA_OCI_CONFIG, json.dumps(config_doc, sort_keys=True, separators=(",", ":")).encode())
    manifest = Blob(MEDIA_OCI_MANIFEST, json.dumps({
        "schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST, "config": config.descriptor(),
        "layers": [layer.blob.descriptor() for layer in layers]}, sort_keys=True, separators=(",", ":")).encode())
    return OciImage(tuple(layers), config, manifest)


@dataclass(frozen=True)
class NodeImages:
    """What the node suite runs: ``pause`` (the sandbox image) and ``busybox`` (``sleep`` by default)."""

    pause: PushedImage
    busybox: PushedImage
    busybox_layer: Layer

    def variant(self, registry: Any, repository: str, tag: str = "v1") -> PushedImage:
        """Another busybox image (same layer, its own config and ID), pushed to ``registry``."""
        image = rootfs_image([self.busybox_layer], cmd=["sleep", "3600"], unique=f"{repository}:{tag}:{uuid.uuid4().hex}")
        return registry.push(image, repository, tag)

    def with_filler(self, registry: Any, repository: str, mib: int, tag: str = "v1") -> PushedImage:
        """A busybox image whose one layer also carries ``mib`` MiB of random bytes: a blob a
        registry can stop in the middle of."""
        layer = busybox_layer({"filler.bin": (os.urandom(mib << 20), 0o644)})
        return registry.push(rootfs_image([layer], cmd=["sleep", "3600"], unique=f"{repository}:{tag}"), repository, tag)


def busybox_layer(extra: Mapping[str, tuple[bytes, int]] = {}) -> Layer:
    """busybox and its applets (symlinks), and ``extra`` files (path -> (bytes, mode))."""
    return rootfs_layer({"bin/busybox": (BUSYBOX.read_bytes(), 0o755), **extra},
                        {f"bin/{a}": "busybox" for a in APPLETS})


def build_node_images(registry: Any, workdir: Path) -> NodeImages:
    """Build and push ``node/pause:1`` and ``node/busybox:1`` to ``registry`` (a RegistryWithProxy)."""
    pause_bin = build_pause(workdir)
    pause = rootfs_image([rootfs_layer({"pause": (pause_bin.read_bytes(), 0o755)})], entrypoint=["/pause"],
                         unique="cri-shim-node-pause")
    layer = busybox_layer()
    busybox = rootfs_image([layer], cmd=["sleep", "3600"], unique="cri-shim-node-busybox")
    return NodeImages(registry.push(pause, "node/pause", "1"), registry.push(busybox, "node/busybox", "1"), layer)


# --------------------------------------------------------------------------
# containerd 2.x that runs containers
# --------------------------------------------------------------------------


def _q(s: str | Path) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


class NodeContainerd(Containerd2):
    """containerd 2.x configured to run pods here: runc without systemd cgroups, the sandbox may
    not lower its oom_score_adj (this VM forbids it), the 2.x shim first on PATH, a CNI bridge
    of its own (unique name and subnet), plain-HTTP ``registries`` via certs.d, and
    ``sandbox_image`` as the pause image. ``pod_routes`` (CIDRs) are routed from each pod through
    the bridge's gateway (the host): a Service CIDR, tests/support/kube_controllers.py."""

    def __init__(self, binary: str, workdir: str | Path, *, sandbox_image: str, registries: Sequence[str] = (),
                 snapshotter: str = "native", pod_routes: Sequence[str] = ()) -> None:
        super().__init__(binary, workdir, {})
        self.sandbox_image = sandbox_image
        self.pod_routes = list(pod_routes)
        self.registries = list(registries)
        self.snapshotter = snapshotter
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"crishim{tag}"  # <= 15 characters
        self.subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24"

    def _config(self) -> str:
        d = self.dir
        images, rt = "[plugins.'io.containerd.cri.v1.images'", "[plugins.'io.containerd.cri.v1.runtime'"
        return f"""version = 3
root = {_q(d / "root")}
state = {_q(d / "state")}
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"]

[grpc]
  address = {_q(self.socket)}
[ttrpc]
  address = {_q(str(self.socket) + ".ttrpc")}
[debug]
  level = "info"

{images}]
  snapshotter = {_q(self.snapshotter)}
  use_local_image_pull = true
  {images}.pinned_images]
    sandbox = {_q(self.sandbox_image)}
  {images}.registry]
    config_path = {_q(d / "certs.d")}
{rt}]
  disable_apparmor = true
  restrict_oom_score_adj = true
  {rt}.containerd]
    default_runtime_name = "runc"
    {rt}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      {rt}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  {rt}.cni]
    bin_dirs = [{_q(CNI_BIN_DIR)}]
    conf_dir = {_q(d / "cni" / "conf")}
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _prepare(self) -> None:
        for sub in ("root", "state", "certs.d", "cni/conf", "cni/ipam"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "conf" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "crishim-node",
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                                  "routes": [{"dst": cidr} for cidr in self.pod_routes],
                                  "dataDir": str(self.dir / "cni" / "ipam")}},
                        {"type": "loopback"}]}))
        for host in self.registries:
            hd = self.dir / "certs.d" / host
            hd.mkdir(parents=True, exist_ok=True)
            (hd / "hosts.toml").write_text(
                f'server = "http://{host}"\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n')

    def start(self, timeout: float = 30.0) -> "NodeContainerd":
        self._prepare()
        config = self.dir / "config.toml"
        config.write_text(self._config())
        env = dict(os.environ)
        env["PATH"] = f"{CONTAINERD2_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen([self.binary, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            cri.wait_runtime_ready("containerd 2.x CRI", self.socket, self._proc, lambda: self.log()[-3000:], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def remove_all_pods(self, crictl: Crictl) -> None:
        """Stop and remove every pod (and so every runc container, mount and netns) it runs."""
        if self._proc is None or self._proc.poll() is not None:
            return
        crictl.run("rmp", "--all", "--force", timeout=60)

    def close(self, crictl: Crictl | None = None) -> None:
        """Remove all pods, stop containerd, delete the bridge and the directory."""
        if crictl is not None:
            try:
                self.remove_all_pods(crictl)
            except Exception:  # noqa: BLE001 - cleanup goes on
                pass
        self.stop()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        subprocess.run(["umount", "-R", "-l", str(self.dir)], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


# --------------------------------------------------------------------------
# kubelet, standalone
# --------------------------------------------------------------------------


def static_pod(name: str, image: str, command: Sequence[str] = ("sleep", "3600"), *, namespace: str = "default",
               image_pull_policy: str = "IfNotPresent", extra_containers: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """A static pod manifest: container ``main`` running ``command`` in ``image``
    (plus ``extra_containers`` as (name, image) running ``sleep 3600``)."""
    containers = [{"name": "main", "image": image, "command": list(command), "imagePullPolicy": image_pull_policy}]
    containers += [{"name": n, "image": i, "command": ["sleep", "3600"], "imagePullPolicy": image_pull_policy}
                   for n, i in extra_containers]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 1, "restartPolicy": "Always"}}


class Kubelet:
    """A kubelet without API server: static pods from ``manifests/``, root dir, logs and pod logs
    under ``workdir``, HTTP endpoints on loopback only. ``runtime_endpoint``/``image_endpoint``
    are what a node's kubelet config would say (``image_endpoint`` defaults to the runtime)."""

    def __init__(self, binary: str, workdir: Path, *, runtime_endpoint: str, image_endpoint: str | None = None,
                 node_name: str = "crishim-node", config: Mapping[str, Any] | None = None,
                 verbosity: int = 2, args: Sequence[str] = ()) -> None:
        self.binary = binary
        self.dir = Path(workdir)
        self.runtime_endpoint = runtime_endpoint
        self.image_endpoint = image_endpoint or runtime_endpoint
        self.node_name = node_name
        self.extra_config = dict(config or {})
        self.verbosity = verbosity
        self.args = list(args)  # more flags, e.g. --vmodule=image_gc_manager=5
        self.manifests = self.dir / "manifests"
        self.root = self.dir / "root"
        self.log_path = self.dir / "kubelet.log"
        self.config_path = self.dir / "kubelet.yaml"
        self.healthz_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._root_shared = False

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # No API server, no cgroup v2, no systemd here: what a standalone kubelet needs.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "staticPodPath": str(self.manifests),
            "fileCheckFrequency": "1s",
            "syncFrequency": "10s",
            "serializeImagePulls": False,
            "registryPullQPS": 0,
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "imageServiceEndpoint": self.image_endpoint,
            "runtimeRequestTimeout": "2m",
            "podLogsDir": str(self.dir / "pod-logs"),
            # loopback only
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # Other tests share this disk: never evict because of its state.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                             "nodefs.inodesFree": "0%", "imagefs.inodesFree": "0%"},
        }
        cfg.update(self.extra_config)
        return cfg

    def start(self) -> "Kubelet":
        for d in (self.manifests, self.root, self.dir / "pod-logs", self.dir / "pki"):
            d.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        if not self._root_shared:
            # kubelet makes its root dir a shared mount at start (a bind mount onto itself) while
            # another goroutine creates its pod-resources socket in it; a mount landing between the
            # socket's temporary file and its rename fails that rename (EXDEV, "invalid cross-device
            # link") and kubelet exits (seen once in CI). A root already on a shared mount is left
            # as it is; close() unmounts it.
            for cmd in (["mount", "--bind", str(self.root), str(self.root)], ["mount", "--make-rshared", str(self.root)]):
                subprocess.run(cmd, check=True, capture_output=True)
            self._root_shared = True
        argv = [self.binary, "--config", str(self.config_path), "--root-dir", str(self.root),
                "--cert-dir", str(self.dir / "pki"), "--hostname-override", self.node_name,
                f"--v={self.verbosity}", *self.args]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        import http.client

        deadline = time.monotonic() + timeout
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise AssertionError(f"kubelet exited ({self._proc and self._proc.returncode}):\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.healthz_port, timeout=1)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"kubelet /healthz not ok within {timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM kubelet (its pods keep running in the runtime, as on a real node)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def close(self) -> None:
        """Stop kubelet, unmount what it mounted and remove the /var/log/containers links it made
        (that directory is fixed in kubelet, shared by every kubelet on the machine)."""
        self.stop()
        subprocess.run(["umount", "-R", "-l", str(self.root)], capture_output=True, check=False)
        links = Path("/var/log/containers")
        for link in links.glob("*.log") if links.is_dir() else ():
            try:
                if os.readlink(link).startswith(str(self.dir) + "/"):
                    link.unlink()
            except OSError:
                pass

    def add_static_pod(self, manifest: Mapping[str, Any]) -> Path:
        """Write a static pod manifest (atomically: kubelet polls the directory)."""
        name = manifest["metadata"]["name"]
        path = self.manifests / f"{name}.yaml"
        tmp = self.dir / f".{name}.yaml.tmp"
        tmp.write_text(yaml.safe_dump(dict(manifest), sort_keys=False))
        os.replace(tmp, path)
        return path

    def pod_name(self, name: str) -> str:
        """The name kubelet gives a static pod: ``<name>-<node name>``."""
        return f"{name}-{self.node_name}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


# --------------------------------------------------------------------------
# reading the node's state through crictl
# --------------------------------------------------------------------------


def crictl_json(crictl: Crictl, *args: str) -> Any:
    res = crictl.run(args[0], "-o", "json", *args[1:])
    if res.returncode != 0:
        raise AssertionError(f"crictl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return json.loads(res.stdout)


def running_containers(crictl: Crictl) -> dict[str, dict[str, Any]]:
    """pod name -> its container ``main`` as crictl shows it (state CONTAINER_RUNNING only)."""
    out: dict[str, dict[str, Any]] = {}
    for c in crictl_json(crictl, "ps", "--state", "Running").get("containers", []):
        labels = c.get("labels", {})
        if labels.get("io.kubernetes.container.name") == "main":
            out[labels.get("io.kubernetes.pod.name", "")] = c
    return out


def ready_pods(crictl: Crictl) -> dict[str, dict[str, Any]]:
    """pod name -> sandbox as crictl shows it (state SANDBOX_READY only)."""
    return {p["metadata"]["name"]: p for p in crictl_json(crictl, "pods", "--state", "Ready").get("items", [])}


def wait_running(crictl: Crictl, pod_names: Iterable[str], *, timeout: float = 120.0,
                 why: Any = None) -> dict[str, dict[str, Any]]:
    """Wait until every pod in ``pod_names`` has its ``main`` container Running; returns them."""
    wanted = set(pod_names)
    deadline = time.monotonic() + timeout
    while True:
        running = running_containers(crictl)
        if wanted <= running.keys():
            return {n: running[n] for n in wanted}
        if time.monotonic() > deadline:
            extra = why() if callable(why) else ""
            raise AssertionError(f"not Running within {timeout}s: {sorted(wanted - running.keys())}\n{extra}")
        time.sleep(0.5)


def container_inspect(crictl: Crictl, container_id: str) -> dict[str, Any]:
    return crictl_json(crictl, "inspect", container_id)


def image_ids(crictl: Crictl) -> dict[str, dict[str, Any]]:
    """image ID -> image as crictl shows it (``pinned`` included)."""
    return {i["id"]: i for i in crictl_json(crictl, "images").get("images", [])}


# --------------------------------------------------------------------------
# pytest fixtures (re-export them from a conftest: ``from tests.support.node import ...``)
# --------------------------------------------------------------------------

import pytest  # noqa: E402

from tests.support.registry import RegistryWithProxy  # noqa: E402


@pytest.fixture(scope="session")
def node_binaries() -> tuple[str, str]:
    """(containerd 2.x, kubelet): skips (fails under CI) with the install command when missing."""
    return require_node()


@pytest.fixture(scope="session")
def node_images(node_binaries: tuple[str, str], registry: RegistryWithProxy,
                tmp_path_factory: pytest.TempPathFactory) -> NodeImages:
    """pause and busybox, built here and pushed to the session registry (refs via its counting proxy)."""
    return build_node_images(registry, tmp_path_factory.mktemp("node-images"))


@pytest.fixture
def node_containerd(node_binaries: tuple[str, str], node_images: NodeImages,
                    registry: RegistryWithProxy) -> Any:
    """A fresh containerd 2.x that runs pods (empty image store); all its pods are removed after."""
    c = NodeContainerd(node_binaries[0], short_dir("nodec-"), sandbox_image=node_images.pause.ref,
                       registries=[registry.host]).start()
    try:
        yield c
    finally:
        c.close(Crictl(c.endpoint, timeout=60))


@pytest.fixture
def kubelet_factory(node_binaries: tuple[str, str], tmp_path: Path) -> Any:
    """``kubelet_factory(runtime_endpoint=..., image_endpoint=..., config={...}) -> Kubelet`` (started);
    every kubelet made is stopped after the test (before the runtime fixtures are torn down)."""
    made: list[Kubelet] = []

    def make(**kwargs: Any) -> Kubelet:
        k = Kubelet(node_binaries[1], tmp_path / f"kubelet{len(made)}", **kwargs)
        made.append(k)
        return k.start()

    try:
        yield make
    finally:
        for k in made:
            k.close()
