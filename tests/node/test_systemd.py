"""The shim under a real systemd: systemd 252 as PID 1 of a systemd-nspawn container booted
from a Debian 12 root (scripts/setup.d/45-nspawn-root.sh), with the package, the unit, the
config and the kubelet drop-in installed inside as docs/install.md "A node, by hand" says.

Upstream is Debian's containerd as containerd.service inside the same systemd, so the unit's
``After=``/``Wants=containerd.service`` are exercised for real (start pulls containerd in and
orders after it; stopping containerd leaves the shim running). Images come from the
session's registry on the host's loopback (the container shares the host's network).
runc cannot run inside the container (its cgroup hierarchies are read-only there), so the
restart-under-kubelet test uses tests/support/node.py's containerd 2.x and kubelet on the
host, with containerd's socket bound into the container.

One container per module (boot about 0.3 s, the checkout's reinstall about 2-3 s); every
test first brings the units to a known state. The container is powered off and its tmpfs
overlay dropped at the end, also when a test fails.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from shim.proto.runtime.v1 import api_pb2
from tests.support import binaries, cri, kube, nspawn
from tests.support.apiserver import ControlPlane, require_control_plane
from tests.support.containerd import hosts_toml
from tests.support.crictl import Crictl
from tests.support.fixtures import (  # noqa: F401  (fixtures used here)
    AUTH_PASSWORD,
    AUTH_USER,
    auth_registry,
    containerd,
    make_image,
    proxy,
)
from tests.support.node import (
    Kubelet,
    NodeContainerd,
    NodeImages,
    ready_pods,
    static_pod,
    wait_running,
)
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy, free_port


REPO = Path(__file__).resolve().parents[2]
SOCK = "/run/cri-shim/cri-shim.sock"
HOST_RUNTIME = "/run/host-containerd"
#: What the fake kubelet's first CRI call got (written by the unit below).
FIRST_CALL = "/run/fake-kubelet/first-call"

# A stand-in for kubelet.service: one CRI Version call on the shim's socket the moment
# systemd starts it (no retry), the outcome written down, then it idles like a daemon.
FAKE_KUBELET = f"""#!/opt/cri-shim/bin/python3
import os, time, grpc
os.makedirs("/run/fake-kubelet", exist_ok=True)
with grpc.insecure_channel("unix://{SOCK}") as ch:
    try:
        ch.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5)
        result = "OK"
    except grpc.RpcError as e:
        result = e.code().name + ": " + (e.details() or "")
with open("{FIRST_CALL}.tmp", "w") as f:
    f.write(result)
os.rename("{FIRST_CALL}.tmp", "{FIRST_CALL}")
while True:
    time.sleep(3600)
"""
KUBELET_UNIT = """[Unit]
Description=stand-in for kubelet (one CRI call at start, then idle)
[Service]
ExecStartPre=/bin/rm -f /run/fake-kubelet/first-call
ExecStart=/usr/local/bin/fake-kubelet
[Install]
WantedBy=multi-user.target
"""


class Node:
    """The booted container with cri-shim installed, plus helpers for the tests."""

    def __init__(self, machine: nspawn.Machine, registry: RegistryWithProxy, host_runtime: Path) -> None:
        self.m = machine
        self.registry = registry
        #: host directory seen inside at HOST_RUNTIME
        self.host_runtime = host_runtime
        self.timings = machine.timings  # printed at the end of the module

    @property
    def socket(self) -> Path:
        return self.m.path(SOCK)

    def log_tails(self) -> dict[str, str]:
        out = {"journal cri-shim": self.m.journal("cri-shim", 40),
               "journal containerd": self.m.journal("containerd", 15),
               "nspawn": self.m.log_tail(20), "failed units at boot": self.m.degraded}
        return out

    def write_config(self, **cfg: Any) -> None:
        """/etc/cri-shim/config.yaml: the defaults, plus ``cfg`` (nested dicts)."""
        self.m.write("/etc/cri-shim/config.yaml", yaml.safe_dump(cfg or {}, sort_keys=False))

    def reset(self, **cfg: Any) -> None:
        """Units stopped and failures forgotten; config = defaults + ``cfg``; containerd up."""
        self.m.systemctl("stop", "kubelet.service", "cri-shim.service", check=False)
        self.m.systemctl("reset-failed", check=False)
        self.write_config(**cfg)
        self.m.systemctl("start", "containerd.service")

    def main_pid(self, unit: str = "cri-shim") -> int:
        return int(self.m.show(unit, "MainPID")["MainPID"])

    def version(self, timeout: float = 5.0) -> cri.CallResult:
        return cri.call(self.socket, "Version", b"", timeout=timeout)

    def pull(self, image: str, timeout: float = 60.0) -> cri.CallResult:
        req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()
        return cri.call(self.socket, "PullImage", req, timeout=timeout)

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.m.status_json()
            if pred(last):
                return last
            time.sleep(0.05)
        raise AssertionError(f"cri-shim status never showed {what}; last: {last}")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    r = fn()
    return r, time.monotonic() - t0


@pytest.fixture(scope="module")
def node(registry: RegistryWithProxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    binaries.require("systemd-nspawn")
    binaries.require("nsenter")
    root, why = nspawn.find_root()
    if os.geteuid() != 0:
        root, why = None, "systemd-nspawn needs root"
    if root is None:
        if binaries.in_ci():
            pytest.fail(why + " (CI is set: node tests must not be skipped)", pytrace=False)
        pytest.skip(why)
    logdir = tmp_path_factory.mktemp("nspawn")
    # For a containerd on the host (one that can run pods): its socket shows up inside at
    # /run/host-containerd/state/containerd.sock. Short, for the socket path limit.
    host_runtime = Path(tempfile.mkdtemp(prefix="nsp-rt-", dir="/tmp"))
    machine = nspawn.Machine(root, src=REPO, log_path=logdir / "nspawn.log",
                             binds=[(host_runtime, HOST_RUNTIME, False)])
    t_module = time.monotonic()
    try:
        machine.boot()
        # docs/install.md "A node, by hand", step 1 (the venv and its dependencies are in the cached
        # root; this puts the checkout under test into it, as a user upgrading would).
        _, t_install = _timed(lambda: machine.run(
            "/opt/cri-shim/bin/pip", "install", "-q", "--disable-pip-version-check", "/src/cri-shim",
            timeout=300))
        machine.run("ln", "-sf", "/opt/cri-shim/bin/cri-shim", "/usr/local/bin/cri-shim")
        # Steps 2 and 3, from the checkout, as written there.
        machine.run("sh", "-ec", """cd /src/cri-shim
            install -d /etc/cri-shim
            install -m 0644 systemd/config.example.yaml /etc/cri-shim/config.yaml
            cri-shim check-config /etc/cri-shim/config.yaml
            install -m 0644 systemd/cri-shim.service /etc/systemd/system/
            install -d /etc/systemd/system/kubelet.service.d
            install -m 0644 systemd/kubelet.service.d/10-cri-shim.conf /etc/systemd/system/kubelet.service.d/
            systemctl daemon-reload
            systemctl enable cri-shim""")
        # containerd inside pulls from the host's registry proxy over plain HTTP.
        machine.write(f"/etc/containerd/certs.d/{registry.host}/hosts.toml", hosts_toml(registry.host))
        n = Node(machine, registry, host_runtime)
        n.timings["reinstall checkout"] = t_install
        yield n
    finally:
        t0 = time.monotonic()
        machine.terminate()
        shutil.rmtree(host_runtime, ignore_errors=True)
        timings = dict(machine.timings)
        timings["poweroff"] = time.monotonic() - t0
        timings["module"] = time.monotonic() - t_module
        print("\nnspawn node timings (s): " + ", ".join(f"{k}={v:.2f}" for k, v in timings.items()))


def test_start_returns_when_the_socket_serves(node: Node) -> None:
    """Type=notify: `systemctl start` returns once the shim answers CRI calls, and the unit's
    Wants=/After=containerd.service start containerd first."""
    node.reset()
    node.m.systemctl("stop", "containerd.service")
    _, took = _timed(lambda: node.m.systemctl("start", "cri-shim"))
    node.timings["systemctl start"] = took
    # The very first call after start returned: no retry, no wait_for_ready.
    r = node.version()
    assert r.ok, f"Version right after `systemctl start` returned: {r.code.name} {r.details}"
    v = api_pb2.VersionResponse.FromString(r.unwrap())
    assert v.runtime_name == "containerd"
    shim = node.m.show("cri-shim", "ActiveState", "SubState", "Type", "StatusText", "NRestarts",
                       "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    assert (shim["ActiveState"], shim["SubState"], shim["Type"]) == ("active", "running", "notify")
    assert shim["StatusText"].startswith(f"serving unix://{SOCK}"), shim["StatusText"]
    ctd = node.m.show("containerd", "ActiveState", "ActiveEnterTimestampMonotonic")
    assert ctd["ActiveState"] == "active", "Wants=containerd.service did not start containerd"
    assert int(ctd["ActiveEnterTimestampMonotonic"]) <= int(shim["ExecMainStartTimestampMonotonic"]), (
        f"After=containerd.service not honoured: {ctd} {shim}")
    # active from READY=1 on, not from the fork: later than the process start.
    assert int(shim["ActiveEnterTimestampMonotonic"]) > int(shim["ExecMainStartTimestampMonotonic"])


def test_containerd_restart_leaves_the_shim_alone(node: Node) -> None:
    """Wants=, not Requires=/BindsTo=: stopping containerd keeps the shim running (calls fail
    UNAVAILABLE), and it serves again by itself once containerd is back."""
    node.reset()
    node.m.systemctl("start", "cri-shim")
    pid = node.main_pid()
    node.m.systemctl("stop", "containerd.service")
    assert node.m.show("cri-shim", "ActiveState")["ActiveState"] == "active"
    down = node.version()
    assert down.code == grpc.StatusCode.UNAVAILABLE, (down.code, down.details)
    node.m.systemctl("start", "containerd.service")
    deadline = time.monotonic() + 10
    while not (r := node.version()).ok:
        assert time.monotonic() < deadline, f"no Version through the shim after containerd came back: {r.details}"
        time.sleep(0.1)
    after = node.m.show("cri-shim", "ActiveState", "MainPID", "NRestarts")
    assert after == {"ActiveState": "active", "MainPID": str(pid), "NRestarts": "0"}


def test_reload_applies_a_new_pull_cap(node: Node) -> None:
    """`systemctl reload` (SIGHUP) applies pulls.max_parallel without a restart; a bad file
    is refused with the key named and the running config stays."""
    node.reset(pulls={"max_parallel": 4})
    node.m.systemctl("start", "cri-shim")
    pid = node.main_pid()
    assert node.m.status_json()["pulls"]["max_parallel"] == 4
    node.write_config(pulls={"max_parallel": 2})
    # Right after the write: the file watcher waits for the file to stay unchanged for a
    # poll (>= 1 s), so the reload seen here is the SIGHUP's.
    node.m.systemctl("reload", "cri-shim")
    node.wait_status(lambda s: s["pulls"]["max_parallel"] == 2, "max_parallel 2 after reload")
    journal = node.m.journal("cri-shim", 20)
    assert re.search(r'msg="config reloaded" reason=SIGHUP max_parallel_pulls=2', journal), journal
    node.write_config(pulls={"max_parallel": -1})
    node.m.systemctl("reload", "cri-shim")
    deadline = time.monotonic() + 10
    while "pulls.max_parallel: must be >= 0, got -1" not in (journal := node.m.journal("cri-shim", 20)):
        assert time.monotonic() < deadline, journal
        time.sleep(0.05)
    assert node.m.status_json()["pulls"]["max_parallel"] == 2
    assert node.m.show("cri-shim", "ActiveState", "MainPID", "NRestarts") == {
        "ActiveState": "active", "MainPID": str(pid), "NRestarts": "0"}


def test_stop_drains(node: Node, make_image: Any, proxy: CountingProxy) -> None:
    """`systemctl stop`: queued pulls get UNAVAILABLE at once, the pull in progress finishes,
    then the shim exits 0 (the unit's result: success) and the socket is gone."""
    node.reset(pulls={"max_parallel": 1})
    node.m.systemctl("start", "cri-shim")
    first, *queued = [make_image(filler_bytes=4096).ref for _ in range(3)]
    results: dict[str, cri.CallResult] = {}

    def pull(ref: str) -> None:
        results[ref] = node.pull(ref)

    proxy.hold_blobs()
    threads = [threading.Thread(target=pull, args=(first,), daemon=True)]
    threads[0].start()
    node.wait_status(lambda s: len(s["pulls"]["in_flight"]) == 1, "the first pull in flight")
    for ref in queued:
        threads.append(threading.Thread(target=pull, args=(ref,), daemon=True))
        threads[-1].start()
    node.wait_status(lambda s: len(s["pulls"]["queued"]) == 2, "two pulls queued")
    proxy.wait_until(lambda st: st.blob_requests >= 1, timeout=15)  # the first is downloading

    stop = node.m.popen("systemctl", "stop", "cri-shim")
    for t in threads[1:]:
        t.join(10)
    for ref in queued:
        r = results.get(ref)
        assert r is not None and r.code == grpc.StatusCode.UNAVAILABLE, (ref, r)
        assert "shutting down" in (r.details or ""), r.details
    assert first not in results, "the pull in progress was cut off"
    assert stop.poll() is None, "systemctl stop returned while a pull was still in progress"
    draining = node.m.show("cri-shim", "ActiveState", "StatusText")  # STOPPING=1 and STATUS=
    assert draining == {"ActiveState": "deactivating", "StatusText": "draining (grace 10s)"}, draining
    refused = node.version(timeout=3)
    assert refused.code == grpc.StatusCode.UNAVAILABLE, "a new call was accepted while draining"

    t0 = time.monotonic()
    proxy.release_blobs()
    threads[0].join(30)
    assert results[first].ok, (results[first].code, results[first].details)
    out, err = stop.communicate(timeout=30)
    node.timings["systemctl stop returned after the last pull finished"] = time.monotonic() - t0
    assert stop.returncode == 0, out + err
    unit = node.m.show("cri-shim", "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    # ExecMainCode 1 = CLD_EXITED: it exited by itself, not killed by systemd's timeout.
    assert unit == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}
    assert not node.socket.exists()
    journal = node.m.journal("cri-shim", 20)
    assert 'msg="shutting down" grace_seconds=10' in journal and 'msg=stopped' in journal, journal


def test_features_work_inside_the_sandbox(node: Node, make_image: Any) -> None:
    """Under the unit's hardening (read-only system, syscall and address-family filters):
    an image set dropped into a watched directory is seen through inotify, prefetched and
    pinned; the metrics endpoint answers on TCP."""
    port = free_port()
    sets = "/etc/cri-shim/image-sets"
    node.m.remove([sets])
    node.m.path(sets).mkdir(parents=True)
    node.reset(metrics={"address": f"127.0.0.1:{port}"}, image_sets={"dir": sets, "debounce_seconds": 0.1})
    node.m.systemctl("start", "cri-shim")
    st = node.m.status_json()["image_sets"]
    assert st["watch"] == "inotify", st
    image = make_image(filler_bytes=1024)
    node.m.write(f"{sets}/warm.yaml", yaml.safe_dump({
        "apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": "warm"},
        "spec": {"pin": True, "images": [{"name": image.ref}]}}))
    node.wait_status(lambda s: s["image_sets"]["sets"].get("warm", {}).get("present") == 1,
                     "the image set's image present")
    req = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=image.ref)).SerializeToString()
    r = api_pb2.ImageStatusResponse.FromString(cri.call(node.socket, "ImageStatus", req).unwrap())
    assert r.image.id == image.image_id and r.image.pinned, r
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert 'cri_shim_image_set_images{set="warm",state="present"} 1.0' in metrics, metrics[-2000:]
    journal = node.m.journal("cri-shim", 100, current=True)
    assert "msg=serving" in journal, journal
    assert "level=warning" not in journal and "level=error" not in journal, journal


def test_credential_plugin_runs_inside_the_sandbox(node: Node, make_image: Any,
                                                   auth_registry: RegistryWithProxy) -> None:
    """A kubelet credential provider plugin is executed by the shim under the unit's hardening
    (syscall filter, read-only system, no capabilities): an image set on a registry that
    requires a login becomes present, and the password never reaches the journal."""
    image = make_image(registry=auth_registry)
    sets, plugins = "/etc/cri-shim/image-sets", "/etc/cri-shim/credential-plugins"
    runs = "/run/cri-shim/plugin-runs.log"  # the one place the shim (and so its plugins) may write
    node.m.remove([sets, plugins])
    node.m.path(sets).mkdir(parents=True)
    node.m.write(f"{plugins}/test-provider", "#!/bin/sh\nexec /opt/cri-shim/bin/python3 "
                 "/src/cri-shim/tests/support/credential_plugin.py \"$@\"\n", mode=0o755)
    node.m.write(f"{plugins}/providers.yaml", yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1", "kind": "CredentialProviderConfig", "providers": [{
            "name": "test-provider", "matchImages": [auth_registry.host], "defaultCacheDuration": "10m",
            "apiVersion": "credentialprovider.kubelet.k8s.io/v1", "args": ["--user", AUTH_USER],
            "env": [{"name": "PLUGIN_RUNS", "value": runs}, {"name": "PLUGIN_PASSWORD", "value": AUTH_PASSWORD}],
        }]}))
    node.m.write(f"/etc/containerd/certs.d/{auth_registry.host}/hosts.toml", hosts_toml(auth_registry.host))
    node.reset(image_sets={"dir": sets, "debounce_seconds": 0.1,
                           "credential_provider_config": f"{plugins}/providers.yaml",
                           "credential_provider_bin_dir": plugins})
    node.m.systemctl("start", "cri-shim")
    node.m.write(f"{sets}/private.yaml", yaml.safe_dump({
        "apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": "private"},
        "spec": {"images": [{"name": image.ref}]}}))
    node.wait_status(lambda s: s["image_sets"]["sets"].get("private", {}).get("present") == 1,
                     "the private image present", timeout=30)
    assert [json.loads(line)["image"] for line in node.m.path(runs).read_text().splitlines()] == [image.ref]
    journal = node.m.journal("cri-shim", 200, current=True)
    assert AUTH_PASSWORD not in journal and "level=error" not in journal, journal


def test_crash_and_bad_config_recover_by_themselves(node: Node) -> None:
    """Restart=always, no start limit: a killed shim is back within RestartSec (its stale
    socket replaced); a bad config at start exits 2 naming the key, and fixing the file is
    all it takes: systemd keeps trying every 2 s."""
    node.reset()
    node.m.systemctl("start", "cri-shim")
    pid = node.main_pid()
    node.m.systemctl("kill", "--signal=SIGKILL", "cri-shim")
    t0 = time.monotonic()
    deadline = t0 + 15
    while not (node.m.show("cri-shim", "ActiveState")["ActiveState"] == "active" and node.version().ok):
        assert time.monotonic() < deadline, node.m.show("cri-shim", "ActiveState", "SubState", "Result")
        time.sleep(0.1)
    node.timings["back after SIGKILL"] = time.monotonic() - t0
    unit = node.m.show("cri-shim", "MainPID", "NRestarts")
    assert unit["MainPID"] != str(pid) and unit["NRestarts"] == "1", unit

    node.reset(pulls={"max_parallel": -1})
    start = node.m.systemctl("start", "cri-shim", check=False)
    assert start.returncode != 0, "a bad config must fail `systemctl start`"
    unit = node.m.show("cri-shim", "ExecMainStatus", "ActiveState")
    assert unit["ExecMainStatus"] == "2", unit
    journal = node.m.journal("cri-shim", 10)
    assert "pulls.max_parallel: must be >= 0, got -1" in journal, journal
    node.write_config(pulls={"max_parallel": 3})
    t0 = time.monotonic()
    deadline = t0 + 15
    while not node.version().ok:
        assert time.monotonic() < deadline, (node.m.show("cri-shim", "ActiveState", "SubState", "NRestarts"),
                                             node.m.journal("cri-shim", 10))
        time.sleep(0.1)
    node.timings["serving after the config was fixed"] = time.monotonic() - t0
    assert node.m.status_json()["pulls"]["max_parallel"] == 3
    assert node.m.show("cri-shim", "ActiveState")["ActiveState"] == "active"


def _install_fake_kubelet(node: Node, dropin: str) -> None:
    node.m.write("/usr/local/bin/fake-kubelet", FAKE_KUBELET, mode=0o755)
    node.m.write("/etc/systemd/system/kubelet.service", KUBELET_UNIT)
    node.m.write("/etc/systemd/system/kubelet.service.d/10-cri-shim.conf", dropin)
    node.m.systemctl("daemon-reload")


def _first_call(node: Node, timeout: float = 10.0) -> str:
    p = node.m.path(FIRST_CALL)
    deadline = time.monotonic() + timeout
    while not p.exists():
        assert time.monotonic() < deadline, "the fake kubelet never made its first call"
        time.sleep(0.02)
    return p.read_text()


REPO_DROPIN = (REPO / "systemd/kubelet.service.d/10-cri-shim.conf").read_text()


@pytest.mark.parametrize("variant", ["repo drop-in (Wants=)", "Requires= instead"])
def test_kubelet_dropin_ordering(node: Node, variant: str) -> None:
    """kubelet starts only once the shim serves; with the repo's Wants= a shim restart or
    stop leaves kubelet running. The Requires= variant shows why: systemd then restarts
    (and stops) kubelet with the shim."""
    requires = variant.startswith("Requires")
    dropin = REPO_DROPIN
    if requires:
        dropin = re.sub(r"(?m)^Wants=cri-shim.service$", "Requires=cri-shim.service", dropin)
        assert "Requires=cri-shim.service" in dropin
    node.reset()
    _install_fake_kubelet(node, dropin)
    node.m.systemctl("start", "kubelet")  # cri-shim is not running: the drop-in pulls it in
    assert _first_call(node) == "OK"
    shim = node.m.show("cri-shim", "ActiveState", "ActiveEnterTimestampMonotonic")
    kubelet = node.m.show("kubelet", "ActiveState", "MainPID", "ExecMainStartTimestampMonotonic")
    assert shim["ActiveState"] == kubelet["ActiveState"] == "active"
    # After= a Type=notify unit: kubelet's process starts after the shim's READY=1.
    assert int(kubelet["ExecMainStartTimestampMonotonic"]) >= int(shim["ActiveEnterTimestampMonotonic"])

    node.m.systemctl("restart", "cri-shim")
    assert node.version().ok
    after = node.m.show("kubelet", "ActiveState", "MainPID")
    if requires:
        assert after["MainPID"] != kubelet["MainPID"], "Requires=: systemd restarts kubelet with the shim"
    else:
        assert after == {"ActiveState": "active", "MainPID": kubelet["MainPID"]}, (
            "restarting cri-shim restarted kubelet")

    node.m.systemctl("stop", "cri-shim")
    state = node.m.show("kubelet", "ActiveState")["ActiveState"]
    assert state == ("inactive" if requires else "active")


def test_sandbox_holds_under_real_systemd(node: Node) -> None:
    """The unit's hardening is applied (not just parsed): only CAP_CHOWN, no new privileges,
    a seccomp filter, no core dumps (its memory holds registry credentials), / read-only with
    /run/cri-shim writable, and systemd-analyze's rating."""
    node.reset()
    node.m.systemctl("start", "cri-shim")
    pid = node.main_pid()
    status = node.m.path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert int(fields["CapEff"], 16) == 1 << 0, fields["CapEff"]  # CAP_CHOWN is capability 0
    assert int(fields["CapBnd"], 16) == 1 << 0, fields["CapBnd"]
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"  # SECCOMP_MODE_FILTER
    limits = node.m.path(f"/proc/{pid}/limits").read_text()
    assert re.search(r"(?m)^Max core file size\s+0\s+0\s", limits), limits
    mounts = {}
    for line in node.m.path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        parts = line.split()
        mounts[parts[4]] = parts[5].split(",")
    assert "ro" in mounts["/"], mounts["/"]
    assert "rw" in mounts["/run/cri-shim"], mounts.get("/run/cri-shim")
    assert "rw" in mounts["/var/lib/cri-shim"], mounts.get("/var/lib/cri-shim")  # StateDirectory=
    # It can write nowhere else: a file under /var/lib is refused (EROFS) in its namespace.
    probe = node.m.run("nsenter", "-t", str(pid), "-m", "sh", "-c", "echo x > /var/lib/cri-shim-probe",
                       check=False)
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr, probe

    out = node.m.run("systemd-analyze", "security", "--no-pager", "cri-shim.service").stdout
    m = re.search(r"Overall exposure level for cri-shim\.service: (\d+\.\d+) (\w+)", out)
    assert m, out[-500:]
    score, rating = float(m.group(1)), m.group(2)
    print(f"\nsystemd-analyze security cri-shim.service (systemd 252, nspawn): {score} {rating}")
    assert rating in ("OK", "SAFE", "PERFECT") and score < 5.0, out[-2000:]
    # its memory is capped (README "Limits"), so an OOM kills the shim, not a pod
    props = node.m.run("systemctl", "show", "-p", "MemoryHigh", "-p", "MemoryMax", "cri-shim.service").stdout
    assert dict(line.split("=", 1) for line in props.split()) == {"MemoryHigh": str(384 << 20),
                                                                   "MemoryMax": str(512 << 20)}, props



def container_pid(crictl: Crictl, container_id: str) -> int:
    out = crictl.run("inspect", "-o", "json", container_id)
    assert out.returncode == 0, out.stderr
    return int(json.loads(out.stdout)["info"]["pid"])


def test_restart_under_a_running_kubelet(node: Node, node_binaries: tuple[str, str], node_images: NodeImages,
                                          kubelet_factory: Any) -> None:
    """`systemctl restart cri-shim` under a kubelet running a pod, all calls through the shim
    (full mode): the pod's container keeps running, same process, never restarted; kubelet
    reconnects by itself (its PLEG relists reach the new shim process) and starts a new pod
    through it. kubelet and containerd 2.x run on the host (runc cannot run inside the nspawn
    container: its cgroup hierarchies are read-only there); containerd's socket is bound into
    the container and kubelet reaches the shim's socket through /proc/<PID 1>/root."""
    ctd = NodeContainerd(node_binaries[0], node.host_runtime / "ctd", sandbox_image=node_images.pause.ref,
                         registries=[node.registry.host])
    direct = Crictl(ctd.endpoint, timeout=60)
    try:
        ctd.start()
        # debug: the shim names every call it relays (kubelet's PLEG relists among them)
        node.reset(upstream=f"unix://{HOST_RUNTIME}/ctd/state/containerd.sock", log={"level": "debug"})
        node.m.systemctl("start", "cri-shim")
        endpoint = f"unix://{node.socket}"
        kubelet: Kubelet = kubelet_factory(runtime_endpoint=endpoint, image_endpoint=endpoint)
        kubelet.add_static_pod(static_pod("steady", node_images.busybox.ref))
        steady = kubelet.pod_name("steady")
        why = lambda: f"kubelet:\n{kubelet.log_tail()}\ncontainerd:\n{ctd.log_tail()}"  # noqa: E731
        before = wait_running(direct, {steady}, timeout=120, why=why)[steady]
        pid_before = container_pid(direct, before["id"])
        shim_pid = node.main_pid()

        t0 = time.monotonic()
        node.m.systemctl("restart", "cri-shim")
        node.timings["systemctl restart (kubelet attached)"] = time.monotonic() - t0
        assert node.main_pid() != shim_pid
        relist = "msg=relayed method=/runtime.v1.RuntimeService/ListPodSandbox"
        deadline = time.monotonic() + 30
        while relist not in node.m.journal("cri-shim", 400, current=True):
            assert time.monotonic() < deadline, f"kubelet never came back to the shim\n{why()}"
            time.sleep(0.1)
        node.timings["kubelet's first relist through the new shim"] = time.monotonic() - t0

        kubelet.add_static_pod(static_pod("after", node_images.busybox.ref))
        after = kubelet.pod_name("after")
        now = wait_running(Crictl(endpoint, timeout=60), {steady, after}, timeout=120, why=why)
        assert (now[steady]["id"], now[steady]["podSandboxId"]) == (before["id"], before["podSandboxId"])
        assert now[steady]["metadata"].get("attempt", 0) == 0, "kubelet restarted the container"
        assert container_pid(direct, before["id"]) == pid_before
        assert [p["metadata"]["name"] for p in ready_pods(direct).values()].count(steady) == 1
        assert kubelet.running
        assert node.m.show("cri-shim", "NRestarts")["NRestarts"] == "0"
    finally:
        node.m.systemctl("stop", "cri-shim", check=False)
        ctd.close(direct)


# --------------------------------------------------------------------------- the cluster state file

KUBE_NODE = "nspawn-node"
STATE_FILE = "/var/lib/cri-shim/cluster-sets.json"  # cluster.state_file's default
NO_STATE_DIR = "/etc/systemd/system/cri-shim.service.d/50-no-state-dir.conf"


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[ControlPlane, kube.Admin]]:
    """etcd + kube-apiserver on the host's loopback (the container shares the host's network),
    ready for shims as in the cluster suite; this node's Node object exists."""
    apiserver, etcd = require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="kube-"))
    cp = ControlPlane(workdir, apiserver=apiserver, etcd=etcd, nodes=(KUBE_NODE,))
    try:
        cp.start()
        admin = kube.install(cp.kubeconfig(workdir / "admin.kubeconfig"), [KUBE_NODE])
        admin.create_node(KUBE_NODE, {"kubernetes.io/hostname": KUBE_NODE})
        yield cp, admin
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _node_kubeconfig(node: Node, cp: ControlPlane, host_dir: Path) -> str:
    """The node's ServiceAccount kubeconfig, written inside with its CA inline; its path there."""
    doc = yaml.safe_load(cp.node_kubeconfig(host_dir / "node.kubeconfig", KUBE_NODE).read_text())
    cluster = doc["clusters"][0]["cluster"]
    cluster["certificate-authority-data"] = base64.b64encode(Path(cluster.pop("certificate-authority"))
                                                             .read_bytes()).decode()
    node.m.write("/etc/cri-shim/kubeconfig", yaml.safe_dump(doc), mode=0o600)
    return "/etc/cri-shim/kubeconfig"


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(rf"(?m)^{re.escape(name)} (\S+)$", text)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


def _remove(node: Node, image: str) -> cri.CallResult:
    return cri.call(node.socket, "RemoveImage", cri.remove_image_request(image), timeout=30)


def _image_status(node: Node, image: str) -> cri.ImageInfo | None:
    return cri.decode_image_status_response(
        cri.call(node.socket, "ImageStatus", cri.image_status_request(image), timeout=30).unwrap())


@pytest.mark.parametrize("unit", ["as shipped", "without StateDirectory= (control)"])
def test_cluster_pins_hold_after_a_restart_without_the_api_server(
        node: Node, api: tuple[ControlPlane, kube.Admin], make_image: Any, tmp_path: Path, unit: str) -> None:
    """An ImageSet applied from a real API server pins two images; the shim saves it in the default
    cluster.state_file, inside the unit's StateDirectory=. The API server stops, the shim is
    SIGKILLed and systemd restarts it (Restart=always); a RemoveImage of a pinned image is sent
    over and over meanwhile: the first one a process answers, the new one's first call, is
    refused, and so is the next by ID; both images stay present and pinned.

    The control clears StateDirectory= in a drop-in, as the unit was before: the shim says at
    start that the file cannot be written, every failed save is an error (journal, `cri-shim
    status`, metrics), and after the same restart the first RemoveImage removes the image."""
    shipped = unit == "as shipped"
    cp, admin = api
    if cp.apiserver is None:
        cp.start_apiserver()
    node.m.systemctl("stop", "cri-shim.service", check=False)
    node.m.remove([STATE_FILE, "/var/lib/cri-shim", NO_STATE_DIR])
    if not shipped:
        node.m.write(NO_STATE_DIR, "[Service]\nStateDirectory=\n")
    node.m.systemctl("daemon-reload")
    images = [make_image(filler_bytes=1024) for _ in range(2)]
    label = f"state-{'shipped' if shipped else 'control'}"
    admin.set_node_labels(KUBE_NODE, {label: "yes"})
    admin.apply_custom("cri-shim.io", "v1", "imagesets", {
        "apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": label},
        "spec": {"nodeSelector": {"matchLabels": {label: "yes"}}, "pin": True,
                 "images": [{"name": i.ref} for i in images]}})
    port = free_port()
    try:
        # cluster.state_file left at its default: the unit's directory is what is tested
        node.reset(metrics={"address": f"127.0.0.1:{port}"},
                   cluster={"kubeconfig": _node_kubeconfig(node, cp, tmp_path), "node_name": KUBE_NODE,
                            "mco": False, "status_interval_seconds": 1, "backoff_initial_seconds": 0.2,
                            "backoff_max_seconds": 2})
        node.m.systemctl("start", "cri-shim")
        node.wait_status(lambda s: s["image_sets"]["sets"].get(label, {}).get("present") == 2,
                         "the set's two images present", timeout=60)
        assert all((st := _image_status(node, i.ref)) is not None and st.pinned for i in images)
        journal = node.m.journal("cri-shim", 200, current=True)
        cluster = node.m.status_json()["cluster"]
        assert isinstance(cluster, dict)
        if shipped:
            saved = json.loads(node.m.path(STATE_FILE).read_text())
            assert [o["metadata"]["name"] for o in saved["imageSets"]] == [label], saved
            assert node.m.path("/var/lib/cri-shim").stat().st_mode & 0o777 == 0o700
            assert "state_error" not in cluster, cluster
            assert "level=error" not in journal, journal
            assert (_metric(port, "cri_shim_cluster_state_file_error"),
                    _metric(port, "cri_shim_cluster_state_write_failures_total")) == (0.0, 0.0)
        else:
            assert not node.m.path(STATE_FILE).exists()
            assert journal.count('msg="cluster state file cannot be written') == 1, journal
            assert "StateDirectory=cri-shim" in journal, journal
            assert 'msg="cannot save the cluster state file' in journal, journal
            assert "Read-only file system" in str(cluster.get("state_error")), cluster
            assert cluster["state_write_failures"] >= 2, cluster  # the start check, then each save
            assert _metric(port, "cri_shim_cluster_state_file_error") == 1.0
            assert _metric(port, "cri_shim_cluster_state_write_failures_total") >= 2

        cp.stop_apiserver()
        pid = node.main_pid()
        node.m.systemctl("kill", "--signal=SIGKILL", "cri-shim")
        t0 = time.monotonic()
        deadline = t0 + 20
        tries = 0
        while True:  # RemoveImage sent until a process answers: the first answer is the new process's first call
            tries += 1
            first = _remove(node, images[0].ref)
            if not (first.code == grpc.StatusCode.UNAVAILABLE and "connect" in (first.details or "").lower()):
                break
            assert time.monotonic() < deadline, (first.code, first.details, node.m.show("cri-shim", "SubState"))
            time.sleep(0.02)
        node.timings[f"restarted by systemd ({unit})"] = time.monotonic() - t0
        unit_state = node.m.show("cri-shim", "MainPID", "ActiveState", "NRestarts")
        assert unit_state["MainPID"] != str(pid) and unit_state["NRestarts"] == "1", unit_state
        assert tries > 1, "the RemoveImage was not sent before the new process served"
        if not shipped:
            assert first.ok, (first.code, first.details)
            assert _image_status(node, images[0].ref) is None
            return
        assert first.code == grpc.StatusCode.FAILED_PRECONDITION, (first.code, first.details)
        by_id = _remove(node, images[1].image_id)
        assert by_id.code == grpc.StatusCode.FAILED_PRECONDITION, (by_id.code, by_id.details)
        for i in images:
            st = _image_status(node, i.ref)
            assert st is not None and st.pinned, (i.ref, st)
        st = node.wait_status(lambda s: bool(s["cluster"]["watches"]["imagesets"].get("error")),
                              "the API server down (a watch error)")
        assert st["cluster"]["loaded_from_state"] is True, st["cluster"]
        journal = node.m.journal("cri-shim", 200, current=True)
        assert 'msg="cluster image sets loaded from the state file"' in journal, journal
    finally:
        node.m.systemctl("stop", "cri-shim.service", check=False)
        node.m.remove([NO_STATE_DIR])
        node.m.systemctl("daemon-reload")
        if cp.apiserver is None:
            cp.start_apiserver()
        admin.custom("delete", "cri-shim.io", "v1", "imagesets", label)
        admin.set_node_labels(KUBE_NODE, {label: None})
