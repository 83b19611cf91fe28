"""Starting the shim as a real process (``python -m shim serve ...``).

Contract with the shim::

    python -m shim serve --listen unix://SOCK --upstream unix://UPSTREAM \\
        --config CONFIG.yaml --log-level debug

run with cwd = repo root and ``PYTHONPATH`` = repo root.  The shim is ready
when ``SOCK`` exists and accepts a connection.  It is stopped with SIGTERM
(SIGKILL if still alive after the grace period).
"""

from __future__ import annotations

import os
import socket as pysocket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from tests.support import procs

REPO_ROOT = Path(__file__).resolve().parents[2]


def unix_endpoint(path: str | os.PathLike[str]) -> str:
    s = str(path)
    return s if s.startswith("unix:") else f"unix://{s}"


def socket_accepts(path: str | os.PathLike[str], timeout: float = 0.5) -> bool:
    """True if a unix stream connection to ``path`` succeeds."""
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class ShimProcess:
    """One shim process; see module docstring for the command line."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        upstream: str | os.PathLike[str],
        config: Mapping[str, object] | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        log_level: str = "debug",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        module: str = "shim",
    ) -> None:
        self.workdir = Path(workdir)
        self.module = module
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = Path(socket_path) if socket_path else self.workdir / "shim.sock"
        self.upstream = unix_endpoint(upstream)
        self.config = dict(config or {})
        self.config_path = self.workdir / "config.yaml"
        self.log_path = self.workdir / "shim.log"
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.killed = False  # set by stop() when SIGTERM was not enough
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return unix_endpoint(self.socket)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            self.module,
            "serve",
            "--listen",
            self.endpoint,
            "--upstream",
            self.upstream,
            "--config",
            str(self.config_path),
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]

    def write_config(self, config: Mapping[str, object] | None = None) -> None:
        if config is not None:
            self.config = dict(config)
        # each test shim gets its own admin socket (the default is one per machine)
        server = dict(self.config.get("server") or {})  # type: ignore[call-overload]
        server.setdefault("admin_socket", str(self.workdir / "admin.sock"))
        self.config["server"] = server
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def start(self, timeout: float = 10.0, wait: bool = True) -> ShimProcess:
        if self.running:
            raise RuntimeError("shim already running")
        self.write_config()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        self.starts += 1
        self.returncode = None
        log = open(self.log_path, "ab")
        try:
            log.write(f"\n===== harness: start #{self.starts}: {' '.join(self.argv())} =====\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv(),
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc else None
                raise RuntimeError(f"shim exited with {code} before listening:\n{self.log_tail()}")
            if self.socket.exists() and socket_accepts(self.socket):
                return
            time.sleep(0.05)
        raise TimeoutError(f"shim not accepting on {self.socket} after {timeout}s:\n{self.log_tail()}")

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self._proc is not None
        return self._proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if still alive after ``timeout``; returns the exit code.

        ``killed`` is set when the SIGKILL was needed.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return self.returncode
        self.killed = procs.terminate(proc, timeout)
        self.returncode = proc.returncode
        return self.returncode

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            procs.kill(proc)
            self.returncode = proc.returncode

    def restart(self, timeout: float = 10.0) -> ShimProcess:
        self.stop()
        return self.start(timeout)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
