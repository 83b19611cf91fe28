"""The node package (scripts/build-deb.sh): the same commit gives the same .deb twice; its
version is the project's; it carries the repository's unit, drop-in and examples, and the same
Python environment as the image; on a Debian 12 root booted with systemd it installs with dpkg
and runs with no network, its unit starts the packaged binary, installing enables or starts
nothing, an upgrade restarts a running shim, and removal is refused while the shim runs."""

from __future__ import annotations

import configparser
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import binaries, nspawn
from tests.support.packaging import ARCH, BUILD_TIMEOUT, DEB_NAME, REPO, VERSION, Build, Image, tree_digest

pytestmark = pytest.mark.timeout(2 * BUILD_TIMEOUT + 300)

SYSTEMD = REPO / "systemd"
#: where the package puts the repository's files (docs/install.md)
SHIPPED = {
    "lib/systemd/system/cri-shim.service": SYSTEMD / "cri-shim.service",
    "usr/share/cri-shim/config.example.yaml": SYSTEMD / "config.example.yaml",
    "usr/share/cri-shim/kubelet-image-only.yaml": SYSTEMD / "kubelet-image-only.yaml",
    "usr/share/cri-shim/kubelet-full.yaml": SYSTEMD / "kubelet-full.yaml",
    "usr/share/cri-shim/kubelet.service.d/10-cri-shim.conf": SYSTEMD / "kubelet.service.d" / "10-cri-shim.conf",
}
DROPIN = "lib/systemd/system/cri-shim.service.d/10-deb.conf"


@pytest.fixture(scope="module")
def deb(deb_builds: tuple[Build, Build]) -> Path:
    return deb_builds[0].out / DEB_NAME


@pytest.fixture(scope="module")
def unpacked(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deb-x")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
    return root


def _fields(deb: Path) -> dict[str, str]:
    out = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    fields: dict[str, str] = {}
    for line in out.splitlines():
        if line[:1] not in (" ", "\t") and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def _exec_start(path: Path) -> list[str]:
    """The command line of a unit's (or drop-in's) last ``ExecStart=``."""
    p = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    p.optionxform = str  # keys are case-sensitive
    p.read(path)
    return p["Service"]["ExecStart"].split()


def test_the_same_commit_gives_the_same_deb_twice(deb_builds: tuple[Build, Build]) -> None:
    first, second = deb_builds
    a, b = (first.out / DEB_NAME).read_bytes(), (second.out / DEB_NAME).read_bytes()
    assert a == b
    print(f"{DEB_NAME}: {len(a) / 2**20:.1f} MiB, builds {first.seconds:.0f} s and {second.seconds:.0f} s")


def test_control_fields(deb: Path) -> None:
    f = _fields(deb)
    assert (f["Package"], f["Version"], f["Architecture"]) == ("cri-shim", VERSION, ARCH)
    depends = [d.strip() for d in f["Depends"].split(",")]
    # the venv is Python 3.11's (Debian 12's /usr/bin/python3), its compiled modules need these
    assert {"python3 (>= 3.11)", "python3 (<< 3.12)"} <= set(depends)
    assert any(d.startswith("libc6 ") for d in depends) and any(d.startswith("libstdc++6") for d in depends)
    assert "pip" not in f["Depends"]


def test_carries_the_repositorys_files(unpacked: Path) -> None:
    for inside, source in SHIPPED.items():
        assert (unpacked / inside).read_bytes() == source.read_bytes(), inside
    assert os.readlink(unpacked / "usr/bin/cri-shim") == "/opt/cri-shim/bin/cri-shim"
    assert not (unpacked / "usr/local").exists()  # Debian packages leave /usr/local to the admin
    # the drop-in runs the packaged binary with the unit's own arguments
    unit, dropin = _exec_start(SYSTEMD / "cri-shim.service"), _exec_start(unpacked / DROPIN)
    assert unit[0] == "/usr/local/bin/cri-shim" and dropin[0] == "/usr/bin/cri-shim"
    assert dropin[1:] == unit[1:]
    # nothing that would enable the shim or change kubelet by being installed
    assert not (unpacked / "etc").exists()
    assert not (unpacked / "lib/systemd/system/kubelet.service.d").exists()


def test_same_python_environment_as_the_image(unpacked: Path, image_builds: tuple[Build, Build],
                                              tmp_path: Path) -> None:
    image = Image(image_builds[0].out / "image")
    subprocess.run(["tar", "-xzf", str(image.blob(image.layer["digest"])), "-C", str(tmp_path), "./opt/cri-shim"],
                   check=True, timeout=300)
    assert tree_digest(unpacked / "opt/cri-shim") == tree_digest(tmp_path / "opt/cri-shim")


@pytest.fixture(scope="module")
def machine(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[nspawn.Machine]:
    """Debian 12 booted with systemd (scripts/setup.d/45-nspawn-root.sh), without the README's
    manual install that root carries, the .deb's directory bound in at /srv/pkg."""
    binaries.require("systemd-nspawn")
    binaries.require("nsenter")
    root, why = nspawn.find_root()
    if root is None:
        if binaries.in_ci():
            pytest.fail(why + " (CI is set: package tests must not be skipped)", pytrace=False)
        pytest.skip(why)
    logdir = tmp_path_factory.mktemp("nspawn-deb")
    m = nspawn.Machine(root, src=REPO, log_path=logdir / "nspawn.log", binds=[(deb.parent, "/srv/pkg", True)])
    try:
        m.boot()
        m.remove(["/opt/cri-shim", "/usr/local/bin/cri-shim"])
        yield m
    finally:
        m.terminate()


def offline(*argv: str) -> tuple[str, ...]:
    """``argv`` in a network namespace of its own: no interface up, nothing reachable."""
    return ("unshare", "--net", *argv)


def install(machine: nspawn.Machine) -> None:
    machine.run(*offline("dpkg", "-i", f"/srv/pkg/{DEB_NAME}"), timeout=300)


def installed(machine: nspawn.Machine) -> bool:
    r = machine.run("dpkg-query", "-W", "-f=${Status}", "cri-shim", check=False)
    return r.stdout == "install ok installed"


def test_installs_and_runs_offline_enables_nothing(machine: nspawn.Machine) -> None:
    install(machine)
    r = machine.run(*offline("cri-shim", "--help"))
    assert r.stdout.startswith("usage: cri-shim")
    assert machine.run("dpkg-query", "-W", "-f=${Version} ${Status}", "cri-shim").stdout == \
        f"{VERSION} install ok installed"
    # installed, known to systemd, but neither enabled nor started: `cri-shim node install` does that
    assert machine.systemctl("is-enabled", "cri-shim", check=False).stdout.strip() == "disabled"
    assert machine.systemctl("is-active", "cri-shim", check=False).stdout.strip() == "inactive"
    exec_start = machine.show("cri-shim", "ExecStart")["ExecStart"]
    assert "path=/usr/bin/cri-shim" in exec_start and "/usr/local/bin" not in exec_start
    verify = machine.run("systemd-analyze", "verify", "cri-shim.service", check=False)
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stdout + verify.stderr


def test_unit_runs_the_packaged_shim_and_upgrade_restarts_it(machine: nspawn.Machine) -> None:
    if not installed(machine):
        install(machine)
    machine.run("sh", "-ec", "install -d /etc/cri-shim && "
                "install -m 0644 /usr/share/cri-shim/config.example.yaml /etc/cri-shim/config.yaml")
    machine.systemctl("start", "cri-shim", timeout=120)
    pid = machine.show("cri-shim", "MainPID")["MainPID"]
    assert machine.run("readlink", f"/proc/{pid}/exe").stdout.strip().startswith("/usr/bin/python3")
    argv = machine.run("cat", f"/proc/{pid}/cmdline").stdout.split("\0")
    assert argv[:3] == ["/opt/cri-shim/bin/python", "/usr/bin/cri-shim", "serve"]  # the venv's interpreter
    assert machine.status_json()  # it answers on its admin socket
    # dpkg -i again (the upgrade path): the running shim is restarted into the installed files
    install(machine)
    assert machine.systemctl("is-active", "cri-shim", check=False).stdout.strip() == "active"
    assert machine.show("cri-shim", "MainPID")["MainPID"] != pid


def test_removal_is_refused_while_the_shim_runs_then_clean(machine: nspawn.Machine) -> None:
    if not installed(machine):
        install(machine)
    if machine.systemctl("is-active", "cri-shim", check=False).stdout.strip() != "active":
        machine.systemctl("start", "cri-shim", timeout=120)
    r = machine.run("dpkg", "-r", "cri-shim", check=False, timeout=300)
    assert r.returncode != 0
    assert "cri-shim node uninstall" in r.stderr
    assert machine.systemctl("is-active", "cri-shim", check=False).stdout.strip() == "active"
    assert machine.run("test", "-x", "/usr/bin/cri-shim", check=False).returncode == 0
    machine.systemctl("stop", "cri-shim", timeout=120)
    machine.run("dpkg", "-r", "cri-shim", timeout=300)
    for gone in ("/opt/cri-shim", "/usr/bin/cri-shim", "/lib/systemd/system/cri-shim.service",
                 "/usr/share/cri-shim"):
        assert machine.run("test", "-e", gone, check=False).returncode != 0, gone
    assert machine.show("cri-shim", "LoadState")["LoadState"] == "not-found"
