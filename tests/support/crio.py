"""Running a throw-away CRI-O whose CRI services the tests can use.

The counterpart of :mod:`tests.support.containerd`: the same interface (``socket``,
``endpoint``, ``start``/``stop``/``kill``/``restart``, ``add_registry_host``,
``log_tail``), so a test can run against either runtime.

Everything lives under one directory: storage root and runroot (``vfs`` driver: no
overlay mounts needed), the socket, its own ``registries.conf`` (plain-HTTP loopback
registries) and ``policy.json`` (accept anything), exits/attach/namespace dirs, a
CNI config dir, and a ``crio.conf`` passed with ``--config`` and an empty
``--config-dir``, so nothing under ``/etc/crio`` or ``/etc/containers`` is read.

The binaries come from ``scripts/setup.d/50-crio.sh``: ``crio`` and ``pinns`` under
``/var/cache/cri-shim/crio-<version>/``, Debian's ``conmon``.

Containers (``runtime=True``, the default): the OCI runtime is Debian's runc behind
a small wrapper (``runtime_path``) that clamps ``process.oomScoreAdj`` to what this
process may set and drops ``linux.resources.hugepageLimits`` (no hugetlb controller
here): CRI-O, unlike containerd, has no ``restrict_oom_score_adj``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tests.support import cri

VERSION = "v1.34.0"
CACHE_DIR = Path(f"/var/cache/cri-shim/crio-{VERSION}")


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_toml_str(i) for i in items) + "]"


# The runc wrapper: on `create`, rewrite the bundle's config.json so that runc can run
# the container as an unprivileged-enough tenant of this machine would, then exec runc.
_RUNTIME_WRAPPER = """#!/usr/bin/env python3
# Written by tests/support/crio.py: clamp oomScoreAdj, drop hugepageLimits, exec runc.
import json, os, sys

RUNC = {runc!r}
args = sys.argv[1:]
if "create" in args:
    bundle = "."
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            bundle = args[i + 1]
        elif a.startswith("--bundle="):
            bundle = a.split("=", 1)[1]
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    with open("/proc/self/oom_score_adj") as f:
        floor = int(f.read())
    proc = spec.get("process") or {{}}
    if "oomScoreAdj" in proc and proc["oomScoreAdj"] < floor:
        proc["oomScoreAdj"] = floor
    res = (spec.get("linux") or {{}}).get("resources") or {{}}
    res.pop("hugepageLimits", None)
    with open(path + ".tmp", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".tmp", path)
os.execv(RUNC, [RUNC] + args)
"""


def binary_paths() -> dict[str, str | None]:
    """Where crio, pinns, conmon and runc are (None when missing)."""
    from tests.support import binaries

    def cached(name: str) -> str | None:
        env = os.environ.get("CRI_SHIM_" + name.upper())
        if env and os.access(env, os.X_OK):
            return env
        p = CACHE_DIR / name
        return str(p) if os.access(p, os.X_OK) else binaries.find(name)

    return {"crio": cached("crio"), "pinns": cached("pinns"),
            "conmon": binaries.find("conmon"), "runc": binaries.find("runc")}


def require() -> dict[str, str]:
    """The binaries, or skip the test (fail under CI) naming what is missing and how to get it."""
    import pytest

    from tests.support import binaries

    paths = binary_paths()
    missing = sorted(name for name, path in paths.items() if path is None)
    if missing:
        msg = (f"CRI-O test binaries missing: {', '.join(missing)} "
               f"(run `bash scripts/setup.d/50-crio.sh`: crio and pinns {VERSION} into {CACHE_DIR}, "
               "conmon and runc from Debian)")
        if binaries.in_ci():
            pytest.fail(msg + " (CI is set: the crio suite must not be skipped)", pytrace=False)
        pytest.skip(msg)
    return {name: path for name, path in paths.items() if path is not None}


class Crio:
    """A CRI-O subprocess rooted in ``workdir``.

    ``socket`` is the CRI unix socket. ``start`` waits until a CRI ``Version`` call
    succeeds. ``restart`` keeps the same storage, so pulled images survive it.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        binary: str,
        pinns: str,
        conmon: str,
        runc: str | None = None,
        registries: Iterable[str] = (),
        log_level: str = "info",
        pinned_images: Sequence[str] = (),
        pause_image: str = "127.0.0.1:1/cri-shim-test/pause:never-pulled",
        extra_config: str = "",
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.binary = binary
        self.pinns = pinns
        self.conmon = conmon
        self.runc = runc
        self.log_level = log_level
        self.pinned_images = list(pinned_images)
        self.pause_image = pause_image
        self.extra_config = extra_config
        self.root = self.workdir / "root"
        self.runroot = self.workdir / "run"
        self.state = self.workdir / "state"
        self.cni_conf = self.workdir / "cni" / "conf"
        self.cni_bin = self.workdir / "cni" / "bin"
        self.config_path = self.workdir / "crio.conf"
        self.config_dir = self.workdir / "crio.conf.d"
        self.registries_conf = self.workdir / "registries.conf"
        self.registries_conf_dir = self.workdir / "registries.conf.d"
        self.policy_path = self.workdir / "policy.json"
        self.wrapper_path = self.workdir / "runc-wrapper"
        self.log_path = Path(log_path) if log_path else self.workdir / "crio.log"
        self.socket = self.state / "crio.sock"
        self._registries: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        for d in (self.root, self.runroot, self.state, self.cni_conf, self.cni_bin, self.config_dir,
                  self.registries_conf_dir, self.state / "exits", self.state / "attach", self.state / "ns",
                  self.state / "pods-logs", self.state / "runc"):
            d.mkdir(parents=True, exist_ok=True)
        for host in registries:
            self.add_registry_host(host)

    @property
    def endpoint(self) -> str:
        """``unix:///…/crio.sock`` — the CRI endpoint."""
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def add_registry_host(self, host: str, timeout: float = 10.0) -> None:
        """Let CRI-O pull from plain-HTTP ``host`` (``127.0.0.1:PORT``).

        containers/image caches ``registries.conf``; a running CRI-O gets SIGHUP and this
        returns once it has logged the new registry configuration.
        """
        if host not in self._registries:
            self._registries.append(host)
        self._write_registries()
        if self._proc is not None and self._proc.poll() is None:
            applied = "Applied new registry configuration"
            before = self.log_text().count(applied)
            self._proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + timeout
            while self.log_text().count(applied) <= before:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRI-O did not reload {self.registries_conf}:\n{self.log_tail()}")
                time.sleep(0.05)

    def _write_registries(self) -> None:
        entries = "".join(
            f"\n[[registry]]\nlocation = {_toml_str(h)}\ninsecure = true\n" for h in self._registries
        )
        tmp = self.registries_conf.with_suffix(".tmp")
        # docker.io as the one search registry: short names mean what they mean to containerd
        # (and to the shim's normalization); none is pulled in these tests.
        tmp.write_text('unqualified-search-registries = ["docker.io"]\nshort-name-mode = "disabled"\n' + entries)
        os.replace(tmp, self.registries_conf)

    def write_config(self) -> None:
        self._write_registries()
        self.policy_path.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}) + "\n")
        # A CNI config that is only parsed: Status reports NetworkReady. Pods use the host network.
        (self.cni_conf / "10-cri-shim-test.conflist").write_text(
            '{"cniVersion": "0.4.0", "name": "cri-shim-test", "plugins": [{"type": "loopback"}]}\n'
        )
        runtime = ""
        if self.runc is not None:
            self.wrapper_path.write_text(_RUNTIME_WRAPPER.format(runc=self.runc))
            self.wrapper_path.chmod(0o755)
            runtime = f"""
[crio.runtime.runtimes.runc]
runtime_path = {_toml_str(str(self.wrapper_path))}
runtime_type = "oci"
runtime_root = {_toml_str(str(self.state / "runc"))}
monitor_path = {_toml_str(self.conmon)}
monitor_cgroup = "pod"
"""
        s = self.state
        config = f"""[crio]
root = {_toml_str(str(self.root))}
runroot = {_toml_str(str(self.runroot))}
storage_driver = "vfs"
log_dir = {_toml_str(str(s / "pods-logs"))}
version_file = {_toml_str(str(s / "version"))}
version_file_persist = {_toml_str(str(s / "version-persist"))}
clean_shutdown_file = {_toml_str(str(s / "clean.shutdown"))}
internal_wipe = true

[crio.api]
listen = {_toml_str(str(self.socket))}
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
conmon_cgroup = "pod"
pinns_path = {_toml_str(self.pinns)}
namespaces_dir = {_toml_str(str(s / "ns"))}
container_exits_dir = {_toml_str(str(s / "exits"))}
container_attach_socket_dir = {_toml_str(str(s / "attach"))}
drop_infra_ctr = true
{runtime}
[crio.image]
signature_policy = {_toml_str(str(self.policy_path))}
pause_image = {_toml_str(self.pause_image)}
pinned_images = {_toml_list(self.pinned_images)}

[crio.network]
network_dir = {_toml_str(str(self.cni_conf))}
plugin_dirs = [{_toml_str(str(self.cni_bin))}]

[crio.nri]
enable_nri = false

[crio.metrics]
enable_metrics = false
{self.extra_config}
"""
        self.config_path.write_text(config)

    def start(self, timeout: float = 60.0) -> Crio:
        if self.running:
            raise RuntimeError("crio already running")
        self.write_config()
        if self.socket.exists():
            self.socket.unlink()
        self.starts += 1
        log = open(self.log_path, "ab")
        try:
            log.write(f"\n===== cri-shim harness: start #{self.starts} =====\n".encode())
            log.flush()
            env = {k: v for k, v in os.environ.items() if not k.startswith("CONTAINER_")}
            env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
            self._proc = subprocess.Popen(
                [self.binary, "--config", str(self.config_path), "--config-dir", str(self.config_dir),
                 "--registries-conf", str(self.registries_conf),
                 "--registries-conf-dir", str(self.registries_conf_dir),
                 "--log-level", self.log_level],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        finally:
            log.close()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        cri.wait_runtime_ready("CRI-O", self.socket, self._proc, self.log_tail, timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``. Returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def restart(self, timeout: float = 60.0) -> Crio:
        self.stop()
        return self.start(timeout)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Crio:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
