"""`cri-shim node install` / `uninstall` on a fake kubeadm node (tests/unit/fake_node.py) whose
kubelet gets an endpoint flag from a flags file (kubeadm-flags.env, /etc/default/kubelet): the
flag's value is switched there and nothing else of the file changes; uninstall puts the file back
byte for byte; a flag install cannot edit in one place is refused, naming where it is."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from shim.node_install.install import EXIT_OK, EXIT_REFUSED, EXIT_ROLLED_BACK
from shim.node_install.kubelet import parse_flags
from tests.unit.fake_node import KUBEADM_CONFIG, FakeHost, kubeadm_node, snapshot, do_install, do_uninstall
from tests.unit.test_node_install import NodeInstallStates

SHIM_SOCKET = "unix:///run/cri-shim/cri-shim.sock"
RUNTIME = "unix:///run/containerd/containerd.sock"
KUBELET_CONFIG = "var/lib/kubelet/config.yaml"
KUBEADM_FLAGS = "var/lib/kubelet/kubeadm-flags.env"
DEFAULT_KUBELET = "etc/default/kubelet"
IMAGE_FLAG = "--image-service-endpoint"
RUNTIME_FLAG = "--container-runtime-endpoint"
PAUSE = "--pod-infra-container-image=registry.k8s.io/pause:3.10"



def node(tmp_path: Path, kubeadm_flags: str, default_kubelet: str | None = None) -> tuple[Path, FakeHost]:
    root = kubeadm_node(tmp_path / "root", flags=kubeadm_flags)
    if default_kubelet is not None:
        (root / DEFAULT_KUBELET).parent.mkdir(parents=True, exist_ok=True)
        (root / DEFAULT_KUBELET).write_text(default_kubelet)
    return root, FakeHost(root)


def kubelet_flags(host: FakeHost) -> dict[str, str]:
    argv = host.command_line(host.kubelet_pid())
    assert argv is not None
    return parse_flags(argv)


def test_the_runtime_flag_in_kubeadm_flags_env_is_switched_there_and_put_back_byte_for_byte(tmp_path: Path) -> None:
    flags = f'KUBELET_KUBEADM_ARGS="{RUNTIME_FLAG}={RUNTIME} {PAUSE}"\n'
    root, host = node(tmp_path, flags)
    before = snapshot(root)
    rc, out = do_install(root, host, mode="full")
    assert rc == EXIT_OK, "\n".join(out)
    assert (root / KUBEADM_FLAGS).read_text() == f'KUBELET_KUBEADM_ARGS="{RUNTIME_FLAG}={SHIM_SOCKET} {PAUSE}"\n'
    # the restarted kubelet runs with the flag at the shim; its config gets only the pull settings
    assert kubelet_flags(host)[RUNTIME_FLAG] == SHIM_SOCKET
    assert (root / KUBELET_CONFIG).read_text() == KUBEADM_CONFIG + "serializeImagePulls: false\nregistryPullQPS: 0\n"
    text = "\n".join(out)
    assert (f"write /var/lib/kubelet/kubeadm-flags.env: kubelet's flags: {RUNTIME_FLAG}={SHIM_SOCKET}") in text
    assert f'    +KUBELET_KUBEADM_ARGS="{RUNTIME_FLAG}={SHIM_SOCKET} {PAUSE}"' in out
    assert (root / "var/lib/cri-shim/install/backup/var__lib__kubelet__kubeadm-flags.env").read_text() == flags
    st = json.loads((root / "var/lib/cri-shim/install/state.json").read_text())
    assert st["kubelet"]["flag_files"][0]["flags"] == {RUNTIME_FLAG: [RUNTIME, SHIM_SOCKET]}
    assert yaml.safe_load((root / "etc/cri-shim/config.yaml").read_text())["upstream"] == RUNTIME
    assert out[-1].startswith("done: kubelet's CRI calls go through cri-shim"), out
    # a second run changes nothing
    again, pid, calls = snapshot(root), host.kubelet_pid(), len(host.mutations())
    rc, out = do_install(root, host, mode="full")
    assert rc == EXIT_OK and out[-1].startswith("nothing to change"), out
    assert snapshot(root) == again and host.kubelet_pid() == pid and len(host.mutations()) == calls
    # uninstall: every file as it was, kubelet back on the runtime
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before
    assert kubelet_flags(host)[RUNTIME_FLAG] == RUNTIME
    assert "kubelet's flags, as they were before install, byte for byte" in "\n".join(out)


def test_the_image_flag_in_etc_default_kubelet_in_image_only_mode(tmp_path: Path) -> None:
    extra = f"# set by the package\nKUBELET_EXTRA_ARGS={IMAGE_FLAG}={RUNTIME} --node-ip=192.0.2.7\n"
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n', extra)
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, "\n".join(out)
    assert (root / DEFAULT_KUBELET).read_text() == extra.replace(RUNTIME, SHIM_SOCKET)
    assert (root / KUBEADM_FLAGS).read_text() == f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n'
    assert kubelet_flags(host)[IMAGE_FLAG] == SHIM_SOCKET
    # the flag beats the config file: the config gets no imageServiceEndpoint, only the pull settings
    assert "imageServiceEndpoint" not in (root / KUBELET_CONFIG).read_text()
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert snapshot(root) == before


@pytest.mark.parametrize("line", [
    f'KUBELET_EXTRA_ARGS="{IMAGE_FLAG}={RUNTIME}"',
    f"KUBELET_EXTRA_ARGS='{IMAGE_FLAG}={RUNTIME}'",
    f"KUBELET_EXTRA_ARGS={IMAGE_FLAG}={RUNTIME}",
    f'KUBELET_EXTRA_ARGS="--v=2 {IMAGE_FLAG} {RUNTIME}  --max-pods=200"',
    f"KUBELET_EXTRA_ARGS='{IMAGE_FLAG}   {RUNTIME}' ",
    f"  KUBELET_EXTRA_ARGS = --node-ip=192.0.2.7 {IMAGE_FLAG} {RUNTIME}\t",
    f'KUBELET_EXTRA_ARGS="{IMAGE_FLAG}=unix:///var/run/containerd/containerd.sock"\r',
])
def test_quoting_and_flag_forms(tmp_path: Path, line: str) -> None:
    extra = (f"# {IMAGE_FLAG}={RUNTIME} was here before\n; another comment\n\nOTHER=x\n{line}\n"
             f"LAST='{IMAGE_FLAG}=not-passed-to-kubelet'\n")
    old_value = RUNTIME if RUNTIME in line else "unix:///var/run/containerd/containerd.sock"
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n', extra)
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_OK, "\n".join(out)
    # only the one value changed: the comment and the other variables as they were
    assert (root / DEFAULT_KUBELET).read_bytes() == extra.replace(line, line.replace(old_value, SHIM_SOCKET)).encode()
    assert kubelet_flags(host)[IMAGE_FLAG] == SHIM_SOCKET
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert snapshot(root) == before


@pytest.mark.parametrize("setup, mode, names", [
    # in two flags files: kubelet gets the flag twice
    (lambda root, host: (root / DEFAULT_KUBELET).write_text(f'KUBELET_EXTRA_ARGS="{IMAGE_FLAG}={RUNTIME}"\n'),
     "image-only", ["/var/lib/kubelet/kubeadm-flags.env (KUBELET_KUBEADM_ARGS)",
                    "/etc/default/kubelet (KUBELET_EXTRA_ARGS)", "set in 2 places"]),
    # twice in one assignment
    (lambda root, host: (root / KUBEADM_FLAGS).write_text(
        f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} {IMAGE_FLAG}={RUNTIME}"\n'),
     "image-only", ["set in 2 places", "kubelet's command line has it 2 time(s)"]),
])
def test_a_flag_in_several_places_is_refused_naming_them(tmp_path: Path, setup: Any, mode: str,
                                                         names: list[str]) -> None:
    root = kubeadm_node(tmp_path / "root", flags=f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    (root / "etc/default").mkdir(parents=True)
    setup(root, None)
    host = FakeHost(root)
    before = snapshot(root)
    rc, out = do_install(root, host, mode=mode)
    assert rc == EXIT_REFUSED, out
    for name in names:
        assert name in out[-1], out[-1]
    assert snapshot(root) == before and host.mutations() == []


def test_a_flag_on_the_units_exec_start_is_refused(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n')
    host.exec_start.append(f"{IMAGE_FLAG}={RUNTIME}")
    host.kubelet_argv = host.unit_argv()  # kubelet as started from that unit
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED, out
    assert f"kubelet runs with {IMAGE_FLAG}={RUNTIME}, set in kubelet.service's ExecStart=: install does not " \
           "edit that" in out[-1]
    assert snapshot(root) == before and host.mutations() == []


def test_a_flag_in_a_drop_ins_environment_is_refused(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n')
    host.environment["KUBELET_CONFIG_ARGS"] += f" {RUNTIME_FLAG}={RUNTIME}"
    host.kubelet_argv = host.unit_argv()
    rc, out = do_install(root, host, mode="full")
    assert rc == EXIT_REFUSED, out
    assert f"kubelet runs with {RUNTIME_FLAG}={RUNTIME}, and it is not in a flags file install can edit" in out[-1]
    assert "an Environment= of kubelet.service or a drop-in (`systemctl cat kubelet.service`)" in out[-1]


def test_a_value_with_shell_expansion_is_refused(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n',
                      f'KUBELET_EXTRA_ARGS="{IMAGE_FLAG}={RUNTIME} $MORE_ARGS"\n')
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED, out
    assert "/etc/default/kubelet (KUBELET_EXTRA_ARGS: escapes, $ or quotes install does not parse)" in out[-1]
    assert snapshot(root) == before and host.mutations() == []


def test_a_flags_file_changed_since_kubelet_started_is_refused(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    (root / KUBEADM_FLAGS).write_text(f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}=unix:///run/other.sock"\n')
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED, out
    assert "the file changed since kubelet started. Restart kubelet" in out[-1]


def test_a_kubelet_that_does_not_come_back_gets_its_flags_file_back(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    host.kubelet_ok = lambda config: f"{IMAGE_FLAG}={SHIM_SOCKET}" not in host.kubelet_argv  # fails on the shim
    before = snapshot(root)
    rc, out = do_install(root, host, ready_timeout=20)
    assert rc == EXIT_ROLLED_BACK, out
    assert snapshot(root) == before
    assert kubelet_flags(host)[IMAGE_FLAG] == RUNTIME
    assert "switched back: kubelet's flags file /var/lib/kubelet/kubeadm-flags.env is as it was, byte for byte" in out


class Crash(BaseException):
    """The install process killed (not an error install handles)."""


def test_a_run_cut_short_after_the_flags_file_is_undone_by_uninstall_or_finished_by_install(tmp_path: Path) -> None:
    flags = f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} {PAUSE}"\n'
    for finish in ("uninstall", "install"):
        root, host = node(tmp_path / finish, flags)
        before = snapshot(root)
        real = host.run

        def killed_at_kubelets_restart(argv: Any, timeout: float, real: Any = real) -> Any:
            if list(argv) == ["systemctl", "restart", "kubelet.service"]:
                raise Crash()
            return real(argv, timeout)

        host.run = killed_at_kubelets_restart  # type: ignore[method-assign]
        with pytest.raises(Crash):
            do_install(root, host)
        host.run = real  # type: ignore[method-assign]
        # the file was switched, kubelet still runs with the value before
        assert (root / KUBEADM_FLAGS).read_text() == flags.replace(RUNTIME, SHIM_SOCKET)
        assert kubelet_flags(host)[IMAGE_FLAG] == RUNTIME
        if finish == "uninstall":
            rc, out = do_uninstall(root, host)
            assert rc == EXIT_OK, out
            assert snapshot(root) == before
        else:
            rc, out = do_install(root, host)
            assert rc == EXIT_OK, out
            assert kubelet_flags(host)[IMAGE_FLAG] == SHIM_SOCKET
            assert do_uninstall(root, host)[0] == EXIT_OK
            assert snapshot(root) == before


def test_a_flags_file_rewritten_since_install_gets_only_the_flag_back(tmp_path: Path) -> None:
    """kubeadm upgrade rewrites kubeadm-flags.env with the flag install set and a flag of its own:
    uninstall puts back only the endpoint's value and keeps the upgrade's flag."""
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    assert do_install(root, host)[0] == EXIT_OK
    (root / KUBEADM_FLAGS).write_text(f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={SHIM_SOCKET} --node-ip=192.0.2.9"\n')
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert (root / KUBEADM_FLAGS).read_text() == f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} --node-ip=192.0.2.9"\n'
    assert "the flags install set, back as they were (not byte for byte)" in "\n".join(out)
    assert kubelet_flags(host)[IMAGE_FLAG] == RUNTIME


def test_a_flags_file_rewritten_without_the_shim_before_kubelet_restarted_gets_kubelet_restarted(
        tmp_path: Path) -> None:
    """`kubeadm upgrade node` rewrote kubeadm-flags.env (its endpoint flag back at the runtime) and
    kubelet was not restarted yet: it still runs on the shim. Uninstall has no value of its own left
    to put back in the file, and restarts kubelet all the same before it stops the shim, as it does
    for kubelet's config file: kubelet is never left on a socket that is going away. (Before the
    config and flags files shared edited.put_back, a flags file restarted kubelet only when written.)"""
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    config = (root / KUBELET_CONFIG).read_bytes()
    assert do_install(root, host, pull_settings=False)[0] == EXIT_OK
    assert (root / KUBELET_CONFIG).read_bytes() == config  # only the flags file was switched
    assert kubelet_flags(host)[IMAGE_FLAG] == SHIM_SOCKET
    upgraded = f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} --node-ip=192.0.2.9"\n'
    (root / KUBEADM_FLAGS).write_text(upgraded)
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert (root / KUBEADM_FLAGS).read_text() == upgraded
    assert f"left {IMAGE_FLAG} in /var/lib/kubelet/kubeadm-flags.env as it is: not what install wrote " \
           f"({SHIM_SOCKET})" in out
    assert kubelet_flags(host)[IMAGE_FLAG] == RUNTIME, "kubelet left running on the shim's socket"
    assert "--node-ip=192.0.2.9" in (host.command_line(host.kubelet_pid()) or [])  # the upgrade's file
    assert not host.units["cri-shim.service"].active


def test_a_flags_file_put_back_by_kubeadm_before_kubelet_restarted_gets_kubelet_restarted(tmp_path: Path) -> None:
    """`kubeadm upgrade node` wrote kubeadm-flags.env exactly as it was before install and kubelet was
    not restarted yet: the file needs nothing, but the running kubelet names the shim. Uninstall
    restarts kubelet (it reads the running command line) before it stops the shim."""
    flags = f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME}"\n'
    root, host = node(tmp_path, flags)
    assert do_install(root, host, pull_settings=False)[0] == EXIT_OK
    (root / KUBEADM_FLAGS).write_text(flags)
    assert kubelet_flags(host)[IMAGE_FLAG] == SHIM_SOCKET
    rc, out = do_uninstall(root, host)
    assert rc == EXIT_OK, out
    assert (root / KUBEADM_FLAGS).read_text() == flags
    assert "kubelet's flags file /var/lib/kubelet/kubeadm-flags.env is as it was before install" in out
    assert f"kubelet runs with an endpoint flag naming {SHIM_SOCKET}, from its flags file as it was when kubelet " \
           f"started: kubelet is restarted on its flags as they are now" in out
    order = [c for c in host.mutations() if c[1:] in (["restart", "kubelet.service"], ["stop", "cri-shim.service"])]
    assert order[-2:] == [["systemctl", "restart", "kubelet.service"], ["systemctl", "stop", "cri-shim.service"]]
    assert kubelet_flags(host)[IMAGE_FLAG] == RUNTIME


# ------------------------------------------------------------------------------ any flags file

_OTHER_FLAGS = ["--v=2", "--node-ip=192.0.2.7", PAUSE, "--max-pods", "110", f"{RUNTIME_FLAG}={RUNTIME}",
                "--cgroup-driver=systemd", "--feature-gates=A=true,B=false"]
_COMMENTS = ["# managed by hand", f"# {IMAGE_FLAG}={RUNTIME}", f"; {IMAGE_FLAG} old", "", "   ",
             f"#KUBELET_EXTRA_ARGS={IMAGE_FLAG}=x"]


@st.composite
def flags_files(draw: st.DrawFn) -> tuple[str, str]:
    """An /etc/default/kubelet with comments, other variables and one KUBELET_EXTRA_ARGS with the
    image flag among other flags, in any quoting and form; and its line with the flag."""
    words = draw(st.lists(st.sampled_from(_OTHER_FLAGS), max_size=4))
    at = draw(st.integers(0, len(words)))
    flag = draw(st.sampled_from([[f"{IMAGE_FLAG}={RUNTIME}"], [IMAGE_FLAG, RUNTIME]]))
    sep = draw(st.sampled_from([" ", "  ", "\t"]))
    value = sep.join(words[:at] + flag + words[at:])
    quote = draw(st.sampled_from(['"', "'", ""]))
    lead = draw(st.sampled_from(["", "  "]))
    tail = draw(st.sampled_from(["", " ", "\r"]))
    line = f"{lead}KUBELET_EXTRA_ARGS={quote}{value}{quote}{tail}"
    before = draw(st.lists(st.sampled_from(_COMMENTS + ['OTHER="--a=b c"', "X=1"]), max_size=3))
    after = draw(st.lists(st.sampled_from(_COMMENTS + ["Y='z'"]), max_size=3))
    end = draw(st.sampled_from(["\n", ""]))
    return "\n".join(before + [line] + after) + end, line


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=flags_files())
def test_any_flags_file_is_switched_in_its_one_value_and_put_back_byte_for_byte(case: tuple[str, str]) -> None:
    text, line = case
    with tempfile.TemporaryDirectory() as d:
        root, host = node(Path(d), f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n', text)
        data = (root / DEFAULT_KUBELET).read_bytes()
        flags_before = kubelet_flags(host)
        argv_before = host.command_line(host.kubelet_pid())
        rc, out = do_install(root, host)
        assert rc == EXIT_OK, "\n".join(out)
        edited = (root / DEFAULT_KUBELET).read_bytes().decode()
        # the file differs in the flag's line only, and there only in the flag's value
        assert edited == text.replace(line, _switch_image_value(line))
        # read as the shell reads it: the same words, but the image flag's value
        assert kubelet_flags(host) == {**flags_before, IMAGE_FLAG: SHIM_SOCKET}
        argv_after = host.command_line(host.kubelet_pid())
        assert argv_before is not None and argv_after is not None and len(argv_after) == len(argv_before)
        assert [a for a, b in zip(argv_before, argv_after) if a != b] in ([f"{IMAGE_FLAG}={RUNTIME}"], [RUNTIME])
        assert do_uninstall(root, host)[0] == EXIT_OK
        assert (root / DEFAULT_KUBELET).read_bytes() == data


def _switch_image_value(line: str) -> str:
    """``line`` with the image flag's value (the socket right after the flag; not the runtime
    flag's, which may name the same socket) at the shim."""
    k = line.index(RUNTIME, line.index(IMAGE_FLAG))
    return line[:k] + SHIM_SOCKET + line[k + len(RUNTIME):]


def test_full_mode_switches_both_flags_in_one_file(tmp_path: Path) -> None:
    flags = f'KUBELET_KUBEADM_ARGS="{RUNTIME_FLAG}={RUNTIME} {PAUSE} {IMAGE_FLAG} {RUNTIME}"\n'
    root, host = node(tmp_path, flags)
    before = snapshot(root)
    rc, out = do_install(root, host, mode="full")
    assert rc == EXIT_OK, "\n".join(out)
    assert (root / KUBEADM_FLAGS).read_text() == flags.replace(RUNTIME, SHIM_SOCKET)
    assert {f: kubelet_flags(host)[f] for f in (RUNTIME_FLAG, IMAGE_FLAG)} == {RUNTIME_FLAG: SHIM_SOCKET,
                                                                                IMAGE_FLAG: SHIM_SOCKET}
    assert do_uninstall(root, host)[0] == EXIT_OK
    assert snapshot(root) == before


def test_dry_run_shows_the_flags_files_diff_and_changes_nothing(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} {PAUSE}"\n')
    before = snapshot(root)
    rc, out = do_install(root, host, dry_run=True)
    assert rc == EXIT_OK, out
    assert snapshot(root) == before and host.mutations() == []
    assert [line for line in out if line.startswith(("    +", "    -")) and "KUBELET_" in line] == [
        f'    -KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={RUNTIME} {PAUSE}"',
        f'    +KUBELET_KUBEADM_ARGS="{IMAGE_FLAG}={SHIM_SOCKET} {PAUSE}"']
    assert f"would write /var/lib/kubelet/kubeadm-flags.env: kubelet's flags: {IMAGE_FLAG}={SHIM_SOCKET}" in out


def test_a_flag_in_another_environment_file_or_passed_as_one_argument_is_refused(tmp_path: Path) -> None:
    root, host = node(tmp_path, f'KUBELET_KUBEADM_ARGS="{PAUSE}"\n')
    (root / "etc/kubernetes/kubelet.env").write_text(f'KUBELET_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    host.env_files.append("/etc/kubernetes/kubelet.env")
    host.exec_start.append("$KUBELET_ARGS")
    host.kubelet_argv = host.unit_argv()
    before = snapshot(root)
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED, out
    assert ("set in /etc/kubernetes/kubelet.env (KUBELET_ARGS) (not one of the flags files install edits: "
            "/var/lib/kubelet/kubeadm-flags.env, /etc/default/kubelet, /etc/sysconfig/kubelet): install does not "
            "edit that") in out[-1]
    # ${VAR}: the whole value one argument (kubelet would not parse it as flags anyway): not install's to edit
    (root / DEFAULT_KUBELET).parent.mkdir(parents=True, exist_ok=True)
    (root / DEFAULT_KUBELET).write_text(f'KUBELET_EXTRA_ARGS="{IMAGE_FLAG}={RUNTIME}"\n')
    host.env_files.remove("/etc/kubernetes/kubelet.env")
    host.exec_start[-1] = "${KUBELET_EXTRA_ARGS}"
    host.exec_start.remove("$KUBELET_EXTRA_ARGS")
    rc, out = do_install(root, host)
    assert rc == EXIT_REFUSED, out
    assert "/etc/default/kubelet (KUBELET_EXTRA_ARGS) (passed as one argument, not split)" in out[-1]
    assert host.mutations() == []
    assert {k: v for k, v in snapshot(root).items() if "default" not in k} == before


# ------------------------------------------------------------------------------ any sequence of runs

class FlagsFileStates(NodeInstallStates):
    """The state machine of tests/unit/test_node_install.py on a node whose kubelet has both endpoint
    flags in kubeadm-flags.env among other flags, plus `kubeadm upgrade` rewriting that file (its
    endpoints as they were before install, another flag changed) and restarting kubelet, then
    install again. Always, besides the machine's own invariants: while not installed, the flags
    file is as the operator (or kubeadm) left it, byte for byte; while installed, the running
    kubelet's endpoint flags of the mode name the shim."""

    FLAGS = f'# kubeadm\nKUBELET_KUBEADM_ARGS="{RUNTIME_FLAG}={RUNTIME} --node-ip=192.0.2.7 {IMAGE_FLAG} {RUNTIME}"\n'

    def __init__(self) -> None:
        super().__init__()
        (self.root / KUBEADM_FLAGS).write_text(self.FLAGS)
        self.host = FakeHost(self.root)
        self.base = snapshot(self.root)

    @precondition(lambda self: self.mode is None)
    @rule()
    def install_on_a_kubelet_that_fails_on_the_shim(self) -> None:
        self.host.kubelet_ok = lambda config: SHIM_SOCKET not in " ".join(self.host.kubelet_argv)
        try:
            rc, out = do_install(self.root, self.host, ready_timeout=15)
        finally:
            self.host.kubelet_ok = lambda config: True
        assert rc == EXIT_ROLLED_BACK, out

    @precondition(lambda self: self.mode is not None)
    @rule(ip=st.sampled_from(["192.0.2.8", "192.0.2.7"]))
    def kubeadm_upgrade_rewrites_the_flags_file_then_install(self, ip: str) -> None:
        self.kubeadm_rewrites_the_flags_file(ip)
        self.host.run(["systemctl", "restart", "kubelet.service"], 10)  # as kubeadm's upgrade steps say
        rc, out = do_install(self.root, self.host, mode=self.mode)
        assert rc == EXIT_OK, out

    @precondition(lambda self: self.mode is not None)
    @rule(ip=st.sampled_from(["192.0.2.8", "192.0.2.7"]))
    def kubeadm_upgrade_rewrites_kubelets_files_then_uninstall_before_kubelet_restarts(self, ip: str) -> None:
        """`kubeadm upgrade node` writes kubelet's config and flags file anew (install's values gone),
        and uninstall runs before kubelet is restarted: the running kubelet is still on the shim."""
        base = self.base[KUBELET_CONFIG]
        assert isinstance(base, tuple)
        (self.root / KUBELET_CONFIG).write_bytes(base[0])
        self.kubeadm_rewrites_the_flags_file(ip)
        rc, out = do_uninstall(self.root, self.host)
        assert rc == EXIT_OK, out
        self.mode = None

    def kubeadm_rewrites_the_flags_file(self, ip: str) -> None:
        """The flags file as kubeadm writes it (its endpoints as before install), with this node IP."""
        rewritten = self.FLAGS.replace("192.0.2.7", ip).encode()
        (self.root / KUBEADM_FLAGS).write_bytes(rewritten)
        base = self.base[KUBEADM_FLAGS]
        assert isinstance(base, tuple)
        self.base[KUBEADM_FLAGS] = (rewritten, base[1])

    @invariant()
    def kubelet_off_the_shim_when_not_installed(self) -> None:
        """Not installed: the running kubelet names the shim in no flag (uninstall restarted it
        before it stopped the shim)."""
        if self.mode is None:
            assert SHIM_SOCKET not in kubelet_flags(self.host).values()

    def kubelet_switched(self) -> None:
        """Installed: the running kubelet's endpoint flags of the mode name the shim (the base
        machine's invariant checks the rest, and the flags file byte for byte while not installed)."""
        flags = kubelet_flags(self.host)
        switched = [IMAGE_FLAG] + ([RUNTIME_FLAG] if self.mode == "full" else [])
        assert {f: flags[f] for f in switched} == {f: SHIM_SOCKET for f in switched}
        assert self.mode == "full" or flags[RUNTIME_FLAG] == RUNTIME


TestFlagsFileStates = FlagsFileStates.TestCase
TestFlagsFileStates.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)
