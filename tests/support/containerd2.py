"""A throw-away containerd 2.x (built from Go modules) for tests that need what 1.6
lacks: ImageSpec.runtime_handler on PullImage (KEP-4216), which 2.x uses to pick the
snapshotter of the runtime named by the handler.

Install (about 3-4 minutes on 2 cores; no cgo snapshotters needed):

    GOBIN=/opt/containerd2/bin go install -tags "no_btrfs no_devmapper no_zfs" \\
        github.com/containerd/containerd/v2/cmd/containerd@v2.4.2

It is looked for at ``$CRI_SHIM_CONTAINERD2``, then /opt/containerd2/bin/containerd
(a dedicated directory, so it never shadows the distribution's containerd 1.6).
Everything it writes lives under one temp directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support import binaries, cri

INSTALL = ('GOBIN=/opt/containerd2/bin go install -tags "no_btrfs no_devmapper no_zfs" '
           "github.com/containerd/containerd/v2/cmd/containerd@v2.4.2")
DEFAULT_PATH = "/opt/containerd2/bin/containerd"


def find() -> tuple[str | None, str]:
    """(path, "") when a containerd 2.x binary is there, else (None, why not)."""
    explicit = os.environ.get("CRI_SHIM_CONTAINERD2")
    path = explicit or DEFAULT_PATH
    if not os.access(path, os.X_OK):
        return None, f"no containerd 2.x at {path} (install: {INSTALL})"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path} --version failed: {e}"
    if "containerd/v2 2." not in out:
        return None, f"{path} is not containerd 2.x: {out.strip()!r}"
    return path, ""


def require() -> str:
    """The containerd 2.x binary; skip the test without one (fail under CI)."""
    binary, why = find()
    if binary is None:
        if binaries.in_ci():
            pytest.fail(f"{why}; end-to-end tests are required in CI")
        pytest.skip(why)
    return binary


def _q(s: str | Path) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


class Containerd2:
    """containerd 2.x with the CRI plugin; default snapshotter ``native``, plus one runc
    runtime per entry of ``runtimes`` (handler name -> snapshotter)."""

    def __init__(self, binary: str, workdir: str | Path, runtimes: dict[str, str]) -> None:
        self.binary = binary
        self.dir = Path(workdir)
        self.runtimes = runtimes
        self.socket = self.dir / "state" / "containerd.sock"
        self.log_path = self.dir / "containerd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def _config(self) -> str:
        d = self.dir
        images, rt = '[plugins."io.containerd.cri.v1.images"', '[plugins."io.containerd.cri.v1.runtime"'
        runtimes = "".join(f"""
    {rt}.containerd.runtimes.{name}]
      runtime_type = "io.containerd.runc.v2"
      snapshotter = {_q(snapshotter)}
""" for name, snapshotter in self.runtimes.items())
        return f"""version = 3
root = {_q(d / "root")}
state = {_q(d / "state")}
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.opt"]

[grpc]
  address = {_q(self.socket)}
[ttrpc]
  address = {_q(str(self.socket) + ".ttrpc")}
[debug]
  level = "info"

{images}]
  snapshotter = "native"
  # the transfer service only unpacks into snapshotters listed in its unpack_config
  # (by default overlayfs alone); the local pull path unpacks into any
  use_local_image_pull = true
  {images}.registry]
    config_path = {_q(d / "certs.d")}
{rt}]
  disable_apparmor = true
  restrict_oom_score_adj = true
  {rt}.containerd]
    default_runtime_name = "runc"
    {rt}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
{runtimes}
  {rt}.cni]
    bin_dirs = [{_q(d / "cni" / "bin")}]
    conf_dir = {_q(d / "cni" / "conf")}
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def start(self, timeout: float = 30.0) -> "Containerd2":
        for sub in ("root", "state", "certs.d", "cni/bin", "cni/conf"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "conf" / "10-test.conflist").write_text(
            '{"cniVersion": "0.4.0", "name": "test", "plugins": [{"type": "loopback"}]}\n')
        config = self.dir / "config.toml"
        config.write_text(self._config())
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen([self.binary, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            cri.wait_runtime_ready("containerd 2.x CRI", self.socket, self._proc, lambda: self.log()[-3000:], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
