"""`cri-shim node install` / `uninstall` on a fake kubeadm node (tests/unit/fake_node.py): what
they write, what systemctl calls they make, how they switch back, and what a second run does.
The same commands against real systemd and kubelet: tests/node/test_node_install.py."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim.node_install.host import NodeView, Runtime
from shim.node_install.install import EXIT_OK, EXIT_REFUSED, EXIT_ROLLED_BACK, shipped
from tests.unit.fake_node import KUBEADM_CONFIG, RUNTIME_SOCKET, FakeHost, kubeadm_node, snapshot, do_install, do_uninstall

SHIM_SOCKET = "unix:///run/cri-shim/cri-shim.sock"
KUBELET_CONFIG = "var/lib/kubelet/config.yaml"



@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, FakeHost]:
    root = kubeadm_node(tmp_path / "root")
    return root, FakeHost(root)


def test_install_switches_kubelet_and_changes_only_the_endpoint_lines(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, "\n".join(out)
    text = (root / KUBELET_CONFIG).read_text()
    # the kubeadm file as it was, three lines appended, nothing else touched
    assert text == KUBEADM_CONFIG + (f"imageServiceEndpoint: {SHIM_SOCKET}\nserializeImagePulls: false\n"
                                     "registryPullQPS: 0\n")
    cfg = yaml.safe_load((root / "etc/cri-shim/config.yaml").read_text())
    assert cfg["upstream"] == RUNTIME_SOCKET and cfg["listen"] == SHIM_SOCKET
    assert (root / "etc/systemd/system/cri-shim.service").read_bytes() == shipped("cri-shim.service")
    assert (root / "etc/systemd/system/kubelet.service.d/10-cri-shim.conf").read_bytes() == \
        shipped("kubelet.service.d/10-cri-shim.conf")
    # the shim is up and checked before kubelet is touched; kubelet restarted once
    assert host.mutations() == [["systemctl", "daemon-reload"], ["systemctl", "enable", "cri-shim.service"],
                                ["systemctl", "start", "cri-shim.service"], ["systemctl", "restart", "kubelet.service"]]
    assert host.units["cri-shim.service"].active and host.units["cri-shim.service"].enabled
    assert any(line.startswith("checked: Version through unix:///run/cri-shim/cri-shim.sock answers containerd v2.4.2")
               for line in out), out
    assert any(line.startswith("checked: kubelet back after") for line in out), out
    assert out[-1].startswith("done: kubelet's image calls go through cri-shim"), out
    # the copy of kubelet's config kept for uninstall, and what install did
    assert (root / "var/lib/cri-shim/install/backup/var__lib__kubelet__config.yaml").read_text() == KUBEADM_CONFIG
    st = json.loads((root / "var/lib/cri-shim/install/state.json").read_text())
    assert st["kubelet"]["keys"]["imageServiceEndpoint"] == [None, SHIM_SOCKET]
    assert st["kubelet"]["confirmed"] is True
    assert (root / "var/lib/cri-shim").stat().st_mode & 0o777 == 0o700


def test_install_twice_changes_nothing_the_second_time(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    assert do_install(root, host)[0] == EXIT_OK
    before, pid, calls = snapshot(root), host.kubelet_pid(), len(host.calls)
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before
    assert host.kubelet_pid() == pid
    assert [c for c in host.calls[calls:] if c in host.mutations()] == []
    assert out[-1] == f"nothing to change: cri-shim is installed (image-only mode) and kubelet uses {SHIM_SOCKET}"


def test_dry_run_prints_every_change_and_makes_none(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    before = snapshot(root)
    rc, out = do_install(root, host, dry_run=True)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before
    assert host.mutations() == []
    text = "\n".join(out)
    for expected in ("would write /etc/cri-shim/config.yaml", "would write /etc/systemd/system/cri-shim.service",
                     "would write /etc/systemd/system/kubelet.service.d/10-cri-shim.conf",
                     "would write /var/lib/cri-shim/install/backup/var__lib__kubelet__config.yaml",
                     "would write /var/lib/kubelet/config.yaml: kubelet's config: imageServiceEndpoint: "
                     f"{SHIM_SOCKET}, serializeImagePulls: false, registryPullQPS: 0",
                     f"    +imageServiceEndpoint: {SHIM_SOCKET}", "    +serializeImagePulls: false",
                     "would run systemctl daemon-reload", "would run systemctl enable cri-shim.service",
                     "would run systemctl start cri-shim.service", "would run systemctl restart kubelet.service",
                     "would check: Version through unix:///run/cri-shim/cri-shim.sock answers containerd v2.4.2",
                     "dry run: nothing was changed"):
        assert expected in text, text
    # the diff names no line of kubelet's config but the three added
    assert [line for line in out if line.startswith(("    +", "    -")) and not line.startswith(("    +++", "    ---"))
            and "kubelet" not in line] == [f"    +imageServiceEndpoint: {SHIM_SOCKET}",
                                           "    +serializeImagePulls: false", "    +registryPullQPS: 0"]


def test_a_shim_that_does_not_answer_is_undone_before_kubelet_is_touched(node: tuple[Path, FakeHost],
                                                                           tmp_path: Path) -> None:
    root, host = node
    broken = tmp_path / "broken.yaml"
    broken.write_text("upstream: unix:///run/containerd/containerd.sock.typo\n")
    before, pid = snapshot(root), host.kubelet_pid()
    rc, out = do_install(root, host, config=str(broken), shim_timeout=3)
    assert rc == EXIT_ROLLED_BACK, out
    assert snapshot(root) == before, "a file is left changed"
    assert host.kubelet_pid() == pid and ["systemctl", "restart", "kubelet.service"] not in host.calls
    shim = host.units["cri-shim.service"]
    assert not shim.active and not shim.enabled
    text = "\n".join(out)
    assert "failed: the shim does not answer Version on unix:///run/cri-shim/cri-shim.sock within 3 s" in text
    assert "cri-shim.service's last journal lines:" in text
    assert out[-1] == "switched back: kubelet's config /var/lib/kubelet/config.yaml is as it was, byte for byte"


def test_a_kubelet_that_does_not_come_back_is_switched_back(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    host.kubelet_ok = lambda config: "cri-shim" not in config  # kubelet fails on the new settings
    before = snapshot(root)
    rc, out = do_install(root, host, ready_timeout=20)
    assert rc == EXIT_ROLLED_BACK, out
    assert snapshot(root) == before
    assert host.calls.count(["systemctl", "restart", "kubelet.service"]) == 2
    assert host.healthz("127.0.0.1", 10248, 1) == "" and "cri-shim" not in host.kubelet_config_at_start
    assert not host.units["cri-shim.service"].active
    text = "\n".join(out)
    assert "failed: kubelet not back within 20 s of the switch: kubelet not healthy: connection refused" in text
    assert "kubelet back on its own config after" in text


def test_a_ready_condition_the_restarted_kubelet_did_not_confirm_does_not_count(node: tuple[Path, FakeHost]) -> None:
    """/healthz answers and the Node shows Ready (what the kubelet before wrote), but the restarted
    kubelet never renews its Lease: it is not back."""
    root, host = node
    host.healthz = lambda *a, **k: ""  # type: ignore[method-assign]
    host.node = lambda kc, name, t: NodeView("node-a", True, "KubeletReady", host.last_renewal)  # type: ignore
    rc, out = do_install(root, host, ready_timeout=10)
    assert rc == EXIT_ROLLED_BACK, out
    assert "Node node-a: the restarted kubelet has not renewed its Lease yet" in "\n".join(out)


def test_back_means_ready_one_status_update_after_the_restart(node: tuple[Path, FakeHost]) -> None:
    """A kubelet that renews its Lease at once but writes NotReady at its first status update
    (10 s) is not back, although it looked fine for its first seconds."""
    root, host = node
    real = host.node
    host.node = lambda kc, name, t: (  # type: ignore[method-assign]
        NodeView("node-a", False, "KubeletNotReady: PLEG is not healthy", host.kubelet_started_at + 1)
        if "cri-shim" in host.kubelet_config_at_start and host.wall() >= host.kubelet_started_at + 10
        else real(kc, name, t) if "cri-shim" not in host.kubelet_config_at_start
        else NodeView("node-a", True, "KubeletReady", host.kubelet_started_at + 1))
    rc, out = do_install(root, host, ready_timeout=30)
    assert rc == EXIT_ROLLED_BACK, out
    text = "\n".join(out)
    assert "failed: kubelet not back within 30 s of the switch: Node node-a not Ready (KubeletNotReady: PLEG is " \
           "not healthy)" in text
    assert (root / KUBELET_CONFIG).read_text() == KUBEADM_CONFIG


def test_uninstall_restores_kubelet_byte_for_byte_and_removes_what_install_added(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    before = snapshot(root)
    assert do_install(root, host)[0] == EXIT_OK
    host.shim_pins = {"sha256:web": ["registry.example/web:1"]}
    restarts = host.calls.count(["systemctl", "restart", "kubelet.service"])
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before
    assert host.calls.count(["systemctl", "restart", "kubelet.service"]) == restarts + 1
    assert not host.units["cri-shim.service"].active and not host.units["cri-shim.service"].enabled
    # kubelet was off the shim before the shim stopped: its restart comes first
    order = [c for c in host.mutations() if c[2:3] in (["kubelet.service"], ["cri-shim.service"])][-3:]
    assert order == [["systemctl", "restart", "kubelet.service"], ["systemctl", "stop", "cri-shim.service"],
                     ["systemctl", "disable", "cri-shim.service"]]
    text = "\n".join(out)
    assert "kubelet's config, as it was before install, byte for byte" in text
    assert ("the shim is stopped: its pins are given up; kubelet's image GC may now remove the 1 image(s) it kept: "
            "registry.example/web:1") in text
    # again: nothing to undo, nothing run
    calls = len(host.calls)
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK and out[0].startswith("nothing to undo") and host.calls[calls:] == []


def test_on_cri_o_the_shim_is_ordered_after_crio_and_uninstall_removes_the_drop_in(
        node: tuple[Path, FakeHost]) -> None:
    root, host = node
    host.runtime = Runtime("cri-o", "1.34.0")
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, "\n".join(out)
    drop_in = root / "etc/systemd/system/cri-shim.service.d/20-runtime.conf"
    lines = drop_in.read_text().splitlines()
    assert "[Unit]" in lines and "After=crio.service" in lines and "Wants=crio.service" in lines
    assert ["systemctl", "daemon-reload"] in host.mutations()
    assert do_install(root, host)[0] == EXIT_OK  # a second run changes nothing
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert snapshot(root) == before  # the drop-in and its directory are gone


def test_on_containerd_no_runtime_drop_in_is_written(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    assert do_install(root, host)[0] == EXIT_OK
    assert not (root / "etc/systemd/system/cri-shim.service.d").exists()


def test_uninstall_after_the_operator_edited_kubelets_config_puts_back_only_installs_keys(
        node: tuple[Path, FakeHost]) -> None:
    root, host = node
    assert do_install(root, host)[0] == EXIT_OK
    p = root / KUBELET_CONFIG
    p.write_text(p.read_text().replace("clusterDomain: cluster.local", "clusterDomain: example.internal"))
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert p.read_text() == KUBEADM_CONFIG.replace("clusterDomain: cluster.local", "clusterDomain: example.internal")
    assert "the keys install set, back as they were (not byte for byte)" in "\n".join(out)


def test_uninstall_dry_run_changes_nothing(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    assert do_install(root, host)[0] == EXIT_OK
    before, calls = snapshot(root), len(host.mutations())
    rc, out = do_uninstall(root, host, dry_run=True)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before and len(host.mutations()) == calls
    text = "\n".join(out)
    assert "would write /var/lib/kubelet/config.yaml" in text and "would run systemctl stop cri-shim.service" in text
    assert "would remove /etc/systemd/system/cri-shim.service" in text


def test_full_mode_points_the_runtime_endpoint_at_the_shim(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    rc, out = do_install(root, host, mode="full")
    assert rc == EXIT_OK, out
    text = (root / KUBELET_CONFIG).read_text()
    assert text == KUBEADM_CONFIG.replace('containerRuntimeEndpoint: ""', f"containerRuntimeEndpoint: {SHIM_SOCKET}") \
        + "serializeImagePulls: false\nregistryPullQPS: 0\n"
    assert yaml.safe_load((root / "etc/cri-shim/config.yaml").read_text())["upstream"] == RUNTIME_SOCKET
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED and "installed in full mode" in out[-1]
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert (root / KUBELET_CONFIG).read_text() == KUBEADM_CONFIG


def test_the_runtime_flag_of_older_kubeadm_in_image_only_mode_leaves_the_flags_file_alone(tmp_path: Path) -> None:
    """Image-only mode sets imageServiceEndpoint in the config file: no image flag beats it. (Endpoint
    flags install switches in their flags file: tests/unit/test_node_install_flags.py.)"""
    flags = 'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/containerd.sock"\n'
    root = kubeadm_node(tmp_path / "root", flags=flags)
    host = FakeHost(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, out
    assert (root / "var/lib/kubelet/kubeadm-flags.env").read_text() == flags
    assert yaml.safe_load((root / KUBELET_CONFIG).read_text())["imageServiceEndpoint"] == SHIM_SOCKET


def test_refusals_change_nothing(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    before = snapshot(root)
    host.units["kubelet.service"].active = False
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED and "kubelet.service is not running" in out[-1]
    host.units["kubelet.service"].active = True
    (root / KUBELET_CONFIG).write_text(KUBEADM_CONFIG + f"imageServiceEndpoint: {SHIM_SOCKET}\n")
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED and f"kubelet already uses {SHIM_SOCKET} (set by hand?)" in out[-1]
    (root / KUBELET_CONFIG).write_text('{"kind": "KubeletConfiguration", "apiVersion": "v1beta1"}\n')
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED and "a flow-style (JSON) mapping; edit it by hand" in out[-1]
    (root / KUBELET_CONFIG).write_text(KUBEADM_CONFIG)
    host.runtime_pins.clear()
    monkey_down = FakeHost(root)
    monkey_down.cri_version = lambda e, t: (_ for _ in ()).throw(  # type: ignore[method-assign]
        __import__("shim.node_install.host", fromlist=["HostError"]).HostError("UNAVAILABLE: connection refused"))
    rc, out = do_install(root, monkey_down)
    assert rc == EXIT_REFUSED and "does not answer Version (UNAVAILABLE: connection refused)" in out[-1]
    assert snapshot(root) == before and host.mutations() == [] and monkey_down.mutations() == []


def test_a_config_in_place_is_kept_and_one_given_is_installed_and_put_back(node: tuple[Path, FakeHost],
                                                                           tmp_path: Path) -> None:
    root, host = node
    mine = root / "etc/cri-shim/config.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("# mine\npulls:\n  max_parallel: 2\n")
    before = snapshot(root)
    assert do_install(root, host)[0] == EXIT_OK
    assert mine.read_text() == "# mine\npulls:\n  max_parallel: 2\n"
    given = tmp_path / "given.yaml"
    given.write_text("pulls:\n  max_parallel: 3\n")
    restarts = host.calls.count(["systemctl", "restart", "cri-shim.service"])
    rc, out = do_install(root, host, config=str(given))
    assert rc == EXIT_OK, out
    assert mine.read_text() == given.read_text()
    assert host.calls.count(["systemctl", "restart", "cri-shim.service"]) == restarts + 1
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert snapshot(root) == before  # the operator's file as it was before the first install


def test_packaged_units_are_used_as_they_are(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    for rel in ("lib/systemd/system/cri-shim.service", "lib/systemd/system/kubelet.service.d/10-cri-shim.conf"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("[Unit]\n")
    host.loaded_units.add("cri-shim.service")
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, out
    assert not (root / "etc/systemd/system/cri-shim.service").exists()
    assert "/lib/systemd/system/cri-shim.service: shipped by the package, used as it is" in out
    assert ["systemctl", "daemon-reload"] not in host.calls


def test_the_unit_runs_the_program_of_this_node(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    (root / "usr/local/bin/cri-shim").unlink()
    rc, out = do_install(root, host, running="/opt/cri-shim/bin/cri-shim")
    assert rc == EXIT_OK, out
    unit = (root / "etc/systemd/system/cri-shim.service").read_text()
    assert "ExecStart=/opt/cri-shim/bin/cri-shim serve --config /etc/cri-shim/config.yaml\n" in unit
    assert unit.replace("/opt/cri-shim/bin/cri-shim serve", "/usr/local/bin/cri-shim serve").encode() == \
        shipped("cri-shim.service")


# ------------------------------------------------------------------------------ any sequence of runs

class NodeInstallStates(RuleBasedStateMachine):
    """Installs (either mode, a broken config, a kubelet that does not come back on the shim),
    installs again, dry runs, uninstalls, the operator's own edits of kubelet's config and
    kubeadm's rewrites of it, in any order. Always: kubelet runs and is healthy; a dry run changes nothing; a second install
    changes nothing; while not installed, the node's files are as the operator left them (kubelet's
    config byte for byte) and the shim is off; while installed, kubelet uses the shim."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="node-install-"))
        self.root = kubeadm_node(self.dir / "root")
        self.host = FakeHost(self.root)
        self.base = snapshot(self.root)  # the node without cri-shim, the operator's edits included
        self.mode: str | None = None

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def expected(self) -> dict[str, object]:
        return self.base

    @rule(mode=st.sampled_from(["image-only", "full"]))
    def install(self, mode: str) -> None:
        rc, out = do_install(self.root, self.host, mode=mode)
        if self.mode is not None and self.mode != mode:
            assert rc == EXIT_REFUSED, out
            return
        assert rc == EXIT_OK, out
        self.mode = mode

    @precondition(lambda self: self.mode is not None)
    @rule()
    def install_again(self) -> None:
        before, calls = snapshot(self.root), len(self.host.mutations())
        rc, out = do_install(self.root, self.host, mode=self.mode)
        assert rc == EXIT_OK and out[-1].startswith("nothing to change"), out
        assert snapshot(self.root) == before and len(self.host.mutations()) == calls

    @rule(which=st.sampled_from(["install", "uninstall"]))
    def dry_run(self, which: str) -> None:
        before, calls = snapshot(self.root), len(self.host.mutations())
        rc, out = (do_install(self.root, self.host, mode=self.mode or "image-only", dry_run=True) if which == "install"
                   else do_uninstall(self.root, self.host, dry_run=True))
        assert rc == EXIT_OK, out
        assert snapshot(self.root) == before and len(self.host.mutations()) == calls

    @rule()
    def install_with_a_broken_config(self) -> None:
        before = snapshot(self.root)
        broken = self.dir / "broken.yaml"
        broken.write_text("upstream: unix:///run/containerd/containerd.sock.typo\n")
        rc, out = do_install(self.root, self.host, mode=self.mode or "image-only", config=str(broken), shim_timeout=2)
        assert rc == EXIT_ROLLED_BACK, out
        assert snapshot(self.root) == before

    @precondition(lambda self: self.mode is None)
    @rule()
    def install_on_a_kubelet_that_fails_on_the_shim(self) -> None:
        self.host.kubelet_ok = lambda config: "cri-shim" not in config
        try:
            rc, out = do_install(self.root, self.host, ready_timeout=15)
        finally:
            self.host.kubelet_ok = lambda config: True
        assert rc == EXIT_ROLLED_BACK, out

    @rule()
    def uninstall(self) -> None:
        rc, out = do_uninstall(self.root, self.host)
        assert rc == EXIT_OK, out
        self.mode = None

    @rule(domain=st.sampled_from(["example.internal", "cluster.local", "corp.example"]))
    def operator_edits_kubelets_config(self, domain: str) -> None:
        p = self.root / KUBELET_CONFIG
        text = re.sub(r"(?m)^clusterDomain: .*$", f"clusterDomain: {domain}", p.read_text())
        p.write_text(text)
        base = self.base[KUBELET_CONFIG]
        assert isinstance(base, tuple)
        self.base[KUBELET_CONFIG] = (re.sub(rb"(?m)^clusterDomain: .*$", f"clusterDomain: {domain}".encode(),
                                            base[0]), base[1])

    @precondition(lambda self: self.mode is not None)
    @rule(domain=st.sampled_from(["upgraded.local", "cluster.local"]))
    def kubeadm_upgrade_rewrites_kubelets_config_then_install(self, domain: str) -> None:
        """The file replaced by one without install's lines (kubeadm upgrade node), then install again."""
        base = self.base[KUBELET_CONFIG]
        assert isinstance(base, tuple)
        rewritten = re.sub(rb"(?m)^clusterDomain: .*$", f"clusterDomain: {domain}".encode(), base[0])
        (self.root / KUBELET_CONFIG).write_bytes(rewritten)
        self.base[KUBELET_CONFIG] = (rewritten, base[1])
        rc, out = do_install(self.root, self.host, mode=self.mode)
        assert rc == EXIT_OK, out

    @invariant()
    def kubelet_is_healthy(self) -> None:
        assert self.host.units["kubelet.service"].active and self.host.healthz("127.0.0.1", 10248, 1) == ""

    @invariant()
    def installed_or_not(self) -> None:
        shim = self.host.units.get("cri-shim.service")
        if self.mode is None:
            assert snapshot(self.root) == self.base
            assert shim is None or not (shim.active or shim.enabled)
            return
        self.kubelet_switched()
        assert shim is not None and shim.active and shim.enabled

    def kubelet_switched(self) -> None:
        """Installed: kubelet runs with the mode's endpoint at the shim (here: its config file's key)."""
        doc = yaml.safe_load((self.root / KUBELET_CONFIG).read_text())
        key = "imageServiceEndpoint" if self.mode == "image-only" else "containerRuntimeEndpoint"
        assert doc[key] == SHIM_SOCKET and "cri-shim" in self.host.kubelet_config_at_start


TestNodeInstallStates = NodeInstallStates.TestCase
TestNodeInstallStates.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)


def test_one_run_at_a_time(node: tuple[Path, FakeHost]) -> None:
    root, host = node
    from shim.node_install.changes import Changes

    held = Changes(root, host, print, dry_run=False)
    held.lock()
    try:
        rc, out = do_install(root, host)
        assert rc == EXIT_REFUSED and "another `cri-shim node install` or `uninstall` is running" in out[-1]
        rc, out = do_uninstall(root, host)
        assert rc == EXIT_REFUSED
    finally:
        held.unlock()
    assert do_install(root, host)[0] == EXIT_OK


def test_a_config_rewritten_under_install_is_switched_again_and_uninstall_keeps_the_rewrite(
        node: tuple[Path, FakeHost]) -> None:
    """`kubeadm upgrade node` rewrites kubelet's config from its ConfigMap: install's lines are gone
    and another key changed. install switches it again (kubelet restarted); uninstall then takes out
    install's lines and keeps the upgrade's file, not the copy from before the first install."""
    root, host = node
    assert do_install(root, host)[0] == EXIT_OK
    upgraded = KUBEADM_CONFIG.replace("clusterDomain: cluster.local", "clusterDomain: upgraded.local")
    (root / KUBELET_CONFIG).write_text(upgraded)
    restarts = host.calls.count(["systemctl", "restart", "kubelet.service"])
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, out
    assert host.calls.count(["systemctl", "restart", "kubelet.service"]) == restarts + 1
    assert (root / KUBELET_CONFIG).read_text() == upgraded + (f"imageServiceEndpoint: {SHIM_SOCKET}\n"
                                                           "serializeImagePulls: false\nregistryPullQPS: 0\n")
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert (root / KUBELET_CONFIG).read_text() == upgraded
