"""Running a throw-away containerd whose CRI image service the tests can use.

Everything (root, state, sockets, CNI dirs, ``certs.d``) lives under one temp
directory, so several instances never collide with a system containerd.
Only the image service is usable here (no cgroups, so no containers), but
Version/Status/List* answer too.  A CNI config (never executed) is written so
that ``Status`` reports NetworkReady.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from tests.support import cri, procs

_DISABLED_PLUGINS = [
    "io.containerd.internal.v1.opt",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.overlayfs",
    "io.containerd.tracing.processor.v1.otlp",
]


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def hosts_toml(host: str) -> str:
    """``certs.d/<host>/hosts.toml`` content for a plain-HTTP loopback registry."""
    url = f"http://{host}"
    return (
        f"server = {_toml_str(url)}\n\n"
        f"[host.{_toml_str(url)}]\n"
        '  capabilities = ["pull", "resolve"]\n'
        "  skip_verify = true\n"
    )


class Containerd:
    """A containerd subprocess rooted in ``workdir``.

    ``socket`` is the CRI (and containerd API) unix socket path.  ``start``
    waits until a CRI ``Version`` call succeeds.  ``restart`` keeps the
    same root, so pulled images survive it.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        binary: str = "containerd",
        registries: Iterable[str] = (),
        log_level: str = "info",
        max_concurrent_downloads: int = 3,
        extra_cri_config: str = "",
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.binary = binary
        self.log_level = log_level
        self.max_concurrent_downloads = max_concurrent_downloads
        self.extra_cri_config = extra_cri_config
        self.root = self.workdir / "root"
        self.state = self.workdir / "state"
        self.certs_dir = self.workdir / "certs.d"
        self.cni_bin = self.workdir / "cni" / "bin"
        self.cni_conf = self.workdir / "cni" / "conf"
        self.config_path = self.workdir / "config.toml"
        self.log_path = Path(log_path) if log_path else self.workdir / "containerd.log"
        self.socket = self.state / "containerd.sock"
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        for d in (self.root, self.state, self.certs_dir, self.cni_bin, self.cni_conf):
            d.mkdir(parents=True, exist_ok=True)
        for host in registries:
            self.add_registry_host(host)

    @property
    def endpoint(self) -> str:
        """``unix:///…/containerd.sock`` — the CRI endpoint."""
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def add_registry_host(self, host: str) -> None:
        """Let containerd pull from plain-HTTP ``host`` (``127.0.0.1:PORT``).

        Takes effect on the next pull (containerd reads ``certs.d`` per pull);
        no restart needed.
        """
        d = self.certs_dir / host
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts.toml").write_text(hosts_toml(host))

    def write_config(self) -> None:
        disabled = ", ".join(_toml_str(p) for p in _DISABLED_PLUGINS)
        cri_key = '[plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = {_toml_str(str(self.root))}
state = {_toml_str(str(self.state))}
disabled_plugins = [{disabled}]

[grpc]
  address = {_toml_str(str(self.socket))}

[ttrpc]
  address = {_toml_str(str(self.socket) + ".ttrpc")}

[debug]
  level = {_toml_str(self.log_level)}

[plugins]
  {cri_key}]
    disable_cgroup = true
    disable_apparmor = true
    restrict_oom_score_adj = true
    max_concurrent_downloads = {self.max_concurrent_downloads}
    sandbox_image = "127.0.0.1:1/cri-shim-test/pause:never-pulled"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
{self.extra_cri_config}
  {cri_key}.containerd]
      snapshotter = "native"
  {cri_key}.cni]
      bin_dir = {_toml_str(str(self.cni_bin))}
      conf_dir = {_toml_str(str(self.cni_conf))}
  {cri_key}.registry]
      config_path = {_toml_str(str(self.certs_dir))}
"""
        self.config_path.write_text(config)
        # A CNI config that is only parsed (no pod is ever run): makes
        # Status report NetworkReady=true.
        (self.cni_conf / "10-cri-shim-test.conflist").write_text(
            '{"cniVersion": "0.4.0", "name": "cri-shim-test", "plugins": [{"type": "loopback"}]}\n'
        )

    def start(self, timeout: float = 30.0) -> Containerd:
        if self.running:
            raise RuntimeError("containerd already running")
        self.write_config()
        if self.socket.exists():
            self.socket.unlink()
        self.starts += 1
        log = open(self.log_path, "ab")
        try:
            log.write(f"\n===== cri-shim harness: start #{self.starts} =====\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [self.binary, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        cri.wait_runtime_ready("containerd CRI", self.socket, self._proc, self.log_tail, timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``.  Returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        procs.terminate(proc, timeout)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            procs.kill(proc)

    def restart(self, timeout: float = 30.0) -> Containerd:
        self.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
