"""The files a node operator installs: the systemd unit and kubelet drop-in pass
`systemd-analyze verify` with no warning, the example config documents every key at
its default and passes `cri-shim check-config`, and the kubelet snippets point at the
shim's default socket."""

from __future__ import annotations

import configparser
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shim import config as config_mod
from tests.support.shim import REPO_ROOT, shim_env

SYSTEMD = REPO_ROOT / "systemd"
UNIT = SYSTEMD / "cri-shim.service"
KUBELET_DROPIN = SYSTEMD / "kubelet.service.d" / "10-cri-shim.conf"
EXAMPLE = SYSTEMD / "config.example.yaml"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or ("/usr/bin/systemd-analyze"
                                                      if os.path.exists("/usr/bin/systemd-analyze") else None)
UNIT_DIRS = ("/usr/lib/systemd/system", "/lib/systemd/system")


def _unit(path: Path) -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    p.optionxform = str  # keys are case-sensitive
    p.read(path)
    return p


def _executables(*units: Path) -> set[str]:
    """Absolute paths of the commands Exec*= lines run (what verify checks for)."""
    out = set()
    for u in units:
        for section in _unit(u).values():
            for key, value in section.items():
                if key.startswith("Exec") and value.strip():
                    out.add(value.strip().lstrip("-@:+!").split()[0])
    return out


def _fake_root(tmp_path: Path) -> Path:
    """A filesystem root for `systemd-analyze verify --root`: the host's unit files
    (targets our units hang off), our units installed where an operator puts them, a
    stub kubelet.service, and an executable stub at every Exec*= path."""
    root = tmp_path / "root"
    lib = root / "usr/lib/systemd/system"
    host = next((d for d in UNIT_DIRS if os.path.isdir(d)), None)
    if host:
        shutil.copytree(host, lib, symlinks=True)
    else:
        lib.mkdir(parents=True)
    etc = root / "etc/systemd/system"
    (etc / "kubelet.service.d").mkdir(parents=True)
    shutil.copy(UNIT, etc / "cri-shim.service")
    shutil.copy(KUBELET_DROPIN, etc / "kubelet.service.d" / KUBELET_DROPIN.name)
    (etc / "kubelet.service").write_text("[Unit]\nDescription=stub kubelet\n[Service]\nExecStart=/usr/bin/kubelet\n")
    if not (lib / "containerd.service").exists():
        (lib / "containerd.service").write_text(
            "[Unit]\nDescription=stub containerd\n[Service]\nExecStart=/usr/bin/containerd\n")
    for unit in (etc / "cri-shim.service", etc / "kubelet.service", lib / "containerd.service"):
        for exe in _executables(unit):
            target = root / exe.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.write_text("#!/bin/sh\n")
                target.chmod(0o755)
    return root


@pytest.mark.skipif(SYSTEMD_ANALYZE is None and not os.environ.get("CI"),
                    reason="systemd-analyze not installed (CI requires it)")
def test_units_pass_systemd_analyze_verify(tmp_path) -> None:
    assert SYSTEMD_ANALYZE, "systemd-analyze is required in CI (Debian: apt-get install systemd)"
    root = _fake_root(tmp_path)
    r = subprocess.run([SYSTEMD_ANALYZE, "verify", f"--root={root}", "--man=no",
                        "cri-shim.service", "kubelet.service"],
                       capture_output=True, text=True, timeout=120)
    # verify exits 0 on unknown keys and bad values; clean means it printed nothing.
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None and not os.environ.get("CI"),
                    reason="systemd-analyze not installed (CI requires it)")
def test_verify_catches_a_broken_unit(tmp_path) -> None:
    """The check above is not vacuous: a typo in the unit is reported."""
    root = _fake_root(tmp_path)
    unit = root / "etc/systemd/system/cri-shim.service"
    unit.write_text(unit.read_text().replace("Restart=always", "Restart=allways"))
    r = subprocess.run([SYSTEMD_ANALYZE, "verify", f"--root={root}", "--man=no", "cri-shim.service"],
                       capture_output=True, text=True, timeout=120)
    assert "allways" in r.stdout + r.stderr


def test_unit_runs_serve_with_the_config_and_is_safe_to_restart() -> None:
    u = _unit(UNIT)
    unit, service = u["Unit"], u["Service"]
    assert service["ExecStart"].split()[1:] == ["serve", "--config", "/etc/cri-shim/config.yaml"]
    assert service["ExecStart"].split()[0] == "/usr/local/bin/cri-shim"
    assert "-HUP" in service["ExecReload"] and "$MAINPID" in service["ExecReload"]
    assert service["Restart"] == "always" and service["Type"] == "notify"
    assert "containerd.service" in unit["After"] and "containerd.service" in unit["Wants"]
    assert "kubelet.service" in unit["Before"]
    assert service["RuntimeDirectory"] == "cri-shim"
    # the socket the unit's directory holds is the shim's default listen path
    assert config_mod.socket_path(config_mod.DEFAULT_LISTEN).startswith("/run/cri-shim/")
    # systemd must wait longer than the shim's own grace period before SIGKILL
    stop = float(service["TimeoutStopSec"].rstrip("s"))
    assert stop > config_mod.ServerConfig().shutdown_grace_seconds + 5
    dropin = _unit(KUBELET_DROPIN)["Unit"]
    assert dropin["After"] == "cri-shim.service" and dropin["Wants"] == "cri-shim.service"


def test_example_config_passes_check_config() -> None:
    r = subprocess.run([sys.executable, "-m", "shim", "check-config", str(EXAMPLE)],
                       cwd=REPO_ROOT, env=shim_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{EXAMPLE}: ok"


def _keys(cls: Any, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        inner = f.type if not isinstance(f.type, str) else getattr(config_mod, f.type, None)
        if dataclasses.is_dataclass(inner):
            out |= _keys(inner, key + ".")
        else:
            out.add(key)
    return out


def _yaml_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in _keys(config_mod.Config):  # a map-valued key is one key
            out |= _yaml_keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_example_config_has_every_key_at_its_default() -> None:
    assert config_mod.load(EXAMPLE) == config_mod.Config()
    documented = _yaml_keys(yaml.safe_load(EXAMPLE.read_text()))
    assert documented == _keys(config_mod.Config), "systemd/config.example.yaml is out of date with shim/config.py"


@pytest.mark.parametrize("name, runtime, images", [
    ("kubelet-image-only.yaml", config_mod.DEFAULT_UPSTREAM, config_mod.DEFAULT_LISTEN),
    ("kubelet-full.yaml", config_mod.DEFAULT_LISTEN, ""),
])
def test_kubelet_snippets(name: str, runtime: str, images: str) -> None:
    doc = yaml.safe_load((SYSTEMD / name).read_text())
    assert doc["apiVersion"] == "kubelet.config.k8s.io/v1beta1" and doc["kind"] == "KubeletConfiguration"
    assert doc["containerRuntimeEndpoint"] == runtime
    assert doc["imageServiceEndpoint"] == images
    # kubelet must not serialize or rate-limit pulls ahead of the shim's own queue
    assert doc["serializeImagePulls"] is False and doc["registryPullQPS"] == 0
    assert "maxParallelImagePulls" not in doc

