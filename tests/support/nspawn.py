"""A real systemd (252, Debian 12) as PID 1 of a ``systemd-nspawn`` container, for tests of
the shim's unit and the kubelet drop-in.

The root is built once by ``scripts/setup.d/45-nspawn-root.sh`` under
/var/cache/cri-shim/nspawn-bookworm-<v>/root and booted with ``--volatile=overlay``: every
write of a test run lands in a tmpfs that goes with the container, so the cache is never
changed. The checkout under test is overlaid at /src/cri-shim (writes, e.g. pip's build
files, go to a temp upper dir that nspawn removes). The container shares the host's network,
so the host's loopback registry is reachable from inside.

The host has no systemd of its own here, so nspawn runs with ``--register=no
--keep-unit`` (no machined, no scope unit) and the container is driven with
``nsenter -t <its PID 1> -a``. Its files are reachable from the host at
``/proc/<PID 1>/root/...``: that is how tests write unit files and how host clients reach
the shim's socket inside.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT_VERSION = "v1"
DEFAULT_ROOT = f"/var/cache/cri-shim/nspawn-bookworm-{ROOT_VERSION}/root"
SETUP = "bash scripts/setup.d/45-nspawn-root.sh"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

_names = itertools.count(1)


def find_root() -> tuple[str | None, str]:
    """(path of the cached root, "") or (None, why not)."""
    root = os.environ.get("CRI_SHIM_NSPAWN_ROOT", DEFAULT_ROOT)
    marker = Path(root).parent / "complete"
    if not Path(root, "usr/lib/systemd/systemd").exists() or (
            "CRI_SHIM_NSPAWN_ROOT" not in os.environ and not marker.exists()):
        return None, f"no nspawn root at {root} (build it with `{SETUP}`, about 1 min)"
    return root, ""


class MachineError(RuntimeError):
    pass


class Machine:
    """One booted container. ``binds``: (host path, container path, read_only)."""

    def __init__(self, root: str, *, src: Path, log_path: Path,
                 binds: Sequence[tuple[str | Path, str, bool]] = (), extra_args: Sequence[str] = ()) -> None:
        self.root = root
        self.src = src
        self.log_path = log_path
        self.binds = list(binds)
        self.extra_args = list(extra_args)  # more systemd-nspawn options, e.g. --capability=CAP_SYSLOG
        self.name = f"cri-shim-test-{os.getpid()}-{next(_names)}"
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid1: int | None = None
        #: seconds: "boot" (nspawn started -> systemd reports running)
        self.timings: dict[str, float] = {}
        #: ``systemctl --failed`` when the boot ended "degraded"
        self.degraded = ""

    # -- lifecycle ---------------------------------------------------------------

    def boot(self, timeout: float = 60.0) -> "Machine":
        cmd = ["systemd-nspawn", "--quiet", "--directory", self.root, "--volatile=overlay",
               "--register=no", "--keep-unit", "--machine", self.name, "--boot",
               "--console=read-only", "--resolv-conf=copy-host",
               f"--overlay={self.src}::/src/cri-shim"]
        if os.path.exists(CA_BUNDLE):  # pip inside trusts what the host trusts
            cmd.append(f"--bind-ro={CA_BUNDLE}")
        for host, inside, ro in self.binds:
            cmd.append(f"--bind{'-ro' if ro else ''}={host}:{inside}")
        cmd += self.extra_args
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = t0 + timeout
        self.pid1 = self._wait_pid1(deadline)
        while True:
            r = self.run("systemctl", "is-system-running", "--wait", check=False,
                         timeout=max(1.0, deadline - time.monotonic()))
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise MachineError(f"systemd in {self.name} not up ({state!r}, {r.stderr.strip()!r}):\n"
                                   + self.log_tail())
            time.sleep(0.05)
        self.timings["boot"] = time.monotonic() - t0
        if state == "degraded":  # not fatal for the tests; shown with a failing test's logs
            self.degraded = self.run("systemctl", "--failed", "--no-legend", check=False).stdout
        return self

    def _wait_pid1(self, deadline: float) -> int:
        assert self._proc is not None
        children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children")
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise MachineError(f"systemd-nspawn exited with {self._proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                for pid in children.read_text().split():
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        return int(pid)
            time.sleep(0.01)
        raise MachineError(f"no systemd under systemd-nspawn {self._proc.pid}:\n{self.log_tail()}")

    def terminate(self, timeout: float = 15.0) -> None:
        """Shut the container down (SIGTERM to nspawn = an orderly poweroff), else kill it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # PID 1 dying takes the whole PID namespace with it; then nspawn exits.
                if self.pid1 is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid1, signal.SIGKILL)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def __enter__(self) -> "Machine":
        return self.boot()

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    # -- driving it --------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 60.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside (all of the container's namespaces)."""
        assert self.pid1 is not None, "not booted"
        r = subprocess.run(["nsenter", "-t", str(self.pid1), "-a", *argv], capture_output=True, text=True,
                           timeout=timeout, input=input, check=False)
        if check and r.returncode != 0:
            raise MachineError(f"{' '.join(argv)} in {self.name}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def popen(self, *argv: str) -> subprocess.Popen[str]:
        assert self.pid1 is not None, "not booted"
        return subprocess.Popen(["nsenter", "-t", str(self.pid1), "-a", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "--property=" + ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 50, *, current: bool = False) -> str:
        """The unit's last journal lines; ``current``: only what its running process logged."""
        where = ["-u", unit]
        if current:
            where = ["_SYSTEMD_INVOCATION_ID=" + self.show(unit, "InvocationID")["InvocationID"]]
        return self.run("journalctl", "--no-pager", "-o", "cat", *where, "-n", str(lines), check=False).stdout

    def path(self, inside: str) -> Path:
        """The host's view of a path inside the container (through /proc/<PID 1>/root)."""
        return Path(f"/proc/{self.pid1}/root") / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        p = self.path(inside)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.replace(p)

    def remove(self, paths: Iterable[str]) -> None:
        for inside in paths:
            with contextlib.suppress(FileNotFoundError):
                p = self.path(inside)
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    def status_json(self) -> dict[str, object]:
        return json.loads(self.run("cri-shim", "status", "--json").stdout)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
