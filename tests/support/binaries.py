"""Locating the external programs the end-to-end tests need.

``require(name)`` returns the absolute path of a binary.  When it is missing
the test is skipped locally, but **fails** when ``CI`` is set: end-to-end
tests must never be skipped silently in CI.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# How to install each binary on Debian 12 (shown in the skip/fail message).
INSTALL_HINTS: dict[str, str] = {
    "containerd": "apt-get install -y containerd",
    "docker-registry": "apt-get install -y docker-registry",
    "skopeo": "apt-get install -y skopeo",
    "crictl": "go install sigs.k8s.io/cri-tools/cmd/crictl@v1.37.0",
    "h2spec-grpc": "bash scripts/setup.d/60-h2spec.sh",
    "socat": "apt-get install -y socat",
    "systemd-nspawn": "bash scripts/setup.d/45-nspawn-root.sh (apt-get install -y systemd-container)",
    "nsenter": "apt-get install -y util-linux",
}


def in_ci() -> bool:
    """True when running under CI (``CI`` set to anything but empty/0/false)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def _go_bin_dirs() -> tuple[Path, ...]:
    dirs: list[Path] = []
    gobin = os.environ.get("GOBIN")
    if gobin:
        dirs.append(Path(gobin))
    gopath = os.environ.get("GOPATH")
    if not gopath:
        go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
        if go:
            try:
                gopath = subprocess.run(
                    [go, "env", "GOPATH"], capture_output=True, text=True, timeout=20, check=False
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                gopath = None
    for p in (gopath or "").split(os.pathsep):
        if p:
            dirs.append(Path(p) / "bin")
    dirs.append(Path.home() / "go" / "bin")
    dirs.append(Path("/root/go/bin"))
    return tuple(dict.fromkeys(dirs))


def find(name: str) -> str | None:
    """Return the absolute path of ``name`` or ``None``.

    Looks at ``$CRI_SHIM_<NAME>`` (e.g. ``CRI_SHIM_CRICTL``) first, then the
    Go bin directories (for crictl), then ``PATH`` and ``/usr/sbin``.
    """
    env = os.environ.get("CRI_SHIM_" + name.upper().replace("-", "_"))
    if env and os.access(env, os.X_OK):
        return env
    candidates: list[Path] = []
    if name == "crictl":
        candidates += [d / name for d in _go_bin_dirs()]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


def missing_message(name: str) -> str:
    hint = INSTALL_HINTS.get(name, f"install {name}")
    return f"{name} not found: install with `{hint}`"


def require(name: str) -> str:
    """Return the path to ``name``; skip the test if missing (fail under CI)."""
    path = find(name)
    if path is None:
        msg = missing_message(name)
        if in_ci():
            pytest.fail(msg + " (CI is set: e2e tests must not be skipped)", pytrace=False)
        pytest.skip(msg)
    return path


def require_module(module: str, install: str) -> None:
    """Like :func:`require` for an importable Python module."""
    try:
        __import__(module)
    except ImportError:
        msg = f"python module {module} not found: install with `{install}`"
        if in_ci():
            pytest.fail(msg + " (CI is set: e2e tests must not be skipped)", pytrace=False)
        pytest.skip(msg)
