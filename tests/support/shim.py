"""The shim as a real process (``python -m shim serve ...``), for sync and async tests.

Contract with the shim::

    python -m shim serve --listen unix://SOCK --upstream unix://UPSTREAM \\
        --config CONFIG.yaml [--log-level LEVEL] [EXTRA ARGS]

run with cwd = repo root and ``PYTHONPATH`` = repo root (``NOTIFY_SOCKET`` removed unless
the test passes one). The shim is ready when ``SOCK`` accepts a connection. It is stopped
with SIGTERM (SIGKILL if still alive after the grace period). Its stdout+stderr go to
``shim.log`` in the work directory.

One class, :class:`ShimProcess`. Every wait comes in two forms: a blocking one for sync
tests (``wait_ready``, ``wait_exit``, ``wait_log``, ``stop``, ``restart``) and a coroutine
for tests whose event loop must keep running meanwhile, e.g. to let a FakeRuntime answer
(the same name with an ``a`` in front: ``await_ready``, ``await_exit``, ``await_log``,
``astop``, plus ``astart``)::

    shim = ShimProcess(workdir, upstream=containerd.socket, config={...}).start()   # sync
    ...
    shim.stop()

    async with shim_process(runtime.endpoint, tmp_path, {"pulls": {"max_parallel": 2}}) as shim:
        shim.write_config({"pulls": {"max_parallel": 5}})
        shim.reload()                      # SIGHUP
        await shim.await_log('msg="config reloaded"')

Defaults differ by entry point, as they did when there were two helpers:
``ShimProcess(...)`` (and ``shim_factory``) passes ``--log-level debug``, writes
``config.yaml`` and gives each shim its own admin socket in the work directory;
:func:`start_shim` / :func:`shim_process` pass no ``--log-level``, write
``cri-shim.yaml`` and turn the admin socket off unless the settings name one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket as pysocket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.support import procs

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Longest unix socket path (``sun_path`` is 108 bytes with its NUL).
SUN_PATH_MAX = 107

Config = Mapping[str, Any] | str


class ShimExited(RuntimeError, AssertionError):
    """The shim exited while a test waited for it to listen or log something."""


class ShimTimeout(TimeoutError, AssertionError):
    """The shim did not get ready (or log what was awaited) in time."""


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


def with_state_file(settings: Mapping[str, Any], directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``settings`` with ``image_sets.state_file`` in ``directory`` when it has an image-set
    directory and no state file, and ``pins.ledger_file`` there when it has none: a test shim
    never reads or writes the node's /var/lib/cri-shim."""
    data = dict(settings)
    sets = data.get("image_sets")
    if isinstance(sets, Mapping) and sets.get("dir") and "state_file" not in sets:
        data["image_sets"] = {**sets, "state_file": str(Path(directory) / "file-sets.json")}
    pins = data.get("pins")
    if pins is None or (isinstance(pins, Mapping) and "ledger_file" not in pins):
        data["pins"] = {**(pins or {}), "ledger_file": str(Path(directory) / "pins.json")}
    return data


def shim_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a test shim (or any child that imports ``shim``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)  # never talk to a real systemd by accident
    env.update(extra or {})
    return env


def write_config(path: Path, config: Config) -> None:
    """Replace the config file atomically (as config management tools do). A mapping with
    ``image_sets.dir`` and no ``image_sets.state_file`` gets one beside the config file."""
    if not isinstance(config, str):
        config = with_state_file(config, path.parent)
    text = config if isinstance(config, str) else yaml.safe_dump(dict(config), sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ShimProcess:
    """One shim process; see the module docstring."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        upstream: str | os.PathLike[str],
        config: Config | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        log_level: str | None = "debug",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        module: str = "shim",
        config_name: str = "config.yaml",
        admin_socket: str | None = None,
        nofile: tuple[int, int | None] | None = None,
    ) -> None:
        """``config``: a mapping (written as YAML) or raw YAML text (written as it is).
        ``admin_socket``: what a mapping config's ``server.admin_socket`` defaults to
        (None: ``WORKDIR/admin.sock``; ``""``: off). ``nofile``: the process's RLIMIT_NOFILE,
        ``(soft, hard)`` (hard None: unchanged), set as systemd's LimitNOFILE= would, by
        util-linux's ``prlimit`` exec'ing the shim (no Python runs between fork and exec: this
        process runs gRPC threads)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.module = module
        self.socket = Path(socket_path) if socket_path else self.workdir / "shim.sock"
        if len(str(self.socket)) > SUN_PATH_MAX:
            raise ValueError(f"socket path longer than {SUN_PATH_MAX} bytes: {self.socket} "
                             "(pass a shorter workdir or socket path)")
        self.upstream = unix_endpoint(upstream)
        self.config: Config = config if isinstance(config, str) else dict(config or {})
        self.config_path = self.workdir / config_name
        self.log_path = self.workdir / "shim.log"
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.admin_socket = str(self.workdir / "admin.sock") if admin_socket is None else admin_socket
        self.nofile = nofile
        self._proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.killed = False  # set by stop() when SIGTERM was not enough
        self.starts = 0

    # ------------------------------------------------------------------ facts

    @property
    def path(self) -> str:
        """The listen socket path, as a string."""
        return str(self.socket)

    @property
    def endpoint(self) -> str:
        return unix_endpoint(self.socket)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The current (or last) process; it stays here after it exited."""
        assert self._proc is not None, "shim never started"
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        level = ["--log-level", self.log_level] if self.log_level else []
        return [sys.executable, "-m", self.module, "serve", "--listen", self.endpoint,
                "--upstream", self.upstream, "--config", str(self.config_path), *level, *self.extra_args]

    def command(self) -> list[str]:
        """What is spawned: :meth:`argv`, behind ``prlimit`` (which execs it, same pid) with ``nofile``."""
        if self.nofile is None:
            return self.argv()
        soft, hard = self.nofile
        return ["prlimit", f"--nofile={soft}:{'' if hard is None else hard}", "--", *self.argv()]

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    logs = log_text

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ------------------------------------------------------------------ config and signals

    def write_config(self, config: Config | None = None) -> None:
        """Write ``config`` (default: the current one) to the config file, atomically.
        A mapping gets ``server.admin_socket`` (see ``admin_socket``) unless it names one."""
        if config is not None:
            self.config = config if isinstance(config, str) else dict(config)
        if not isinstance(self.config, str):
            server = dict(self.config.get("server") or {})
            server.setdefault("admin_socket", self.admin_socket)
            self.config["server"] = server
        write_config(self.config_path, self.config)

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    send = send_signal

    def reload(self) -> None:
        self.send_signal(signal.SIGHUP)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------------ start

    def start(self, timeout: float = 10.0, wait: bool = True) -> ShimProcess:
        """Write the config, spawn the shim; with ``wait``, return once it accepts connections."""
        self._spawn()
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    async def astart(self, timeout: float = 20.0, wait: bool = True) -> ShimProcess:
        self._spawn()
        if wait:
            try:
                await self.await_ready(timeout)
            except BaseException:
                await self.astop()
                raise
        return self

    def _spawn(self) -> None:
        if self.running:
            raise RuntimeError("shim already running")
        self.write_config()
        self.starts += 1
        self.returncode = None
        self.killed = False
        with open(self.log_path, "ab") as log:
            if self.starts > 1:  # a restart: mark where this run's log begins
                log.write(f"\n===== harness: start #{self.starts}: {' '.join(self.argv())} =====\n".encode())
                log.flush()
            self._proc = subprocess.Popen(self.command(), cwd=REPO_ROOT, env=shim_env(self.extra_env), stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)

    # ------------------------------------------------------------------ waits (one check, two loops)

    def _ready(self, timeout: float) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            code = self._proc.returncode if self._proc else None
            raise ShimExited(f"shim exited with {code} before listening on {self.socket}:\n{self.log_tail()}")
        return self.socket.exists() and socket_accepts(self.socket)

    def _not_ready(self, timeout: float) -> ShimTimeout:
        return ShimTimeout(f"shim not accepting on {self.socket} after {timeout}s:\n{self.log_tail()}")

    def _logged(self, text: str, after: int) -> int | None:
        log = self.log_text()
        i = log.find(text, after)
        if i >= 0:
            return i + len(text)
        if self._proc is None or self._proc.poll() is not None:
            code = self._proc.returncode if self._proc else None
            raise ShimExited(f"shim exited ({code}) before logging {text!r}:\n{log}")
        return None

    def _not_logged(self, text: str, timeout: float) -> ShimTimeout:
        return ShimTimeout(f"shim did not log {text!r} within {timeout}s:\n{self.log_text()}")

    def _still_running(self, timeout: float) -> ShimTimeout:
        return ShimTimeout(f"shim still running {timeout}s later:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready(timeout):
            if time.monotonic() > deadline:
                raise self._not_ready(timeout)
            time.sleep(0.05)

    async def await_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready(timeout):
            if time.monotonic() > deadline:
                raise self._not_ready(timeout)
            await asyncio.sleep(0.05)

    def wait_log(self, text: str, timeout: float = 10.0, *, after: int = 0) -> int:
        """Wait until ``text`` appears in the log past offset ``after``; returns the offset after it."""
        deadline = time.monotonic() + timeout
        while (end := self._logged(text, after)) is None:
            if time.monotonic() > deadline:
                raise self._not_logged(text, timeout)
            time.sleep(0.05)
        return end

    async def await_log(self, text: str, timeout: float = 10.0, *, after: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while (end := self._logged(text, after)) is None:
            if time.monotonic() > deadline:
                raise self._not_logged(text, timeout)
            await asyncio.sleep(0.05)
        return end

    def wait_exit(self, timeout: float | None = None) -> int:
        """Wait for the process to exit on its own; returns its code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self._still_running(timeout or 0) from None

    wait = wait_exit

    async def await_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise self._still_running(timeout)
            await asyncio.sleep(0.02)
        return self.proc.returncode

    # ------------------------------------------------------------------ stop

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if still alive after ``timeout``; returns the exit code.
        ``killed`` is set when the SIGKILL was needed."""
        if self._proc is None:
            return self.returncode
        if self._proc.poll() is None:
            self.killed = procs.terminate(self._proc, timeout)
        self.returncode = self._proc.returncode
        return self.returncode

    async def astop(self, timeout: float = 20.0) -> int | None:
        """``stop`` without blocking the event loop while the shim drains."""
        if self._proc is None:
            return self.returncode
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                await self.await_exit(timeout)
            except ShimTimeout:
                procs.kill(self._proc)
                self.killed = True
        self.returncode = self._proc.returncode
        return self.returncode

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests) and reap it."""
        if self._proc is not None:
            procs.kill(self._proc)
            self.returncode = self._proc.returncode

    def restart(self, timeout: float = 10.0) -> ShimProcess:
        self.stop()
        return self.start(timeout)


def default_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The test's settings plus what keeps a test shim off the node's real paths."""
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (settings or {}).items()}
    data.setdefault("server", {}).setdefault("admin_socket", "")
    return data


def new_shim(upstream: str | os.PathLike[str], workdir: str | os.PathLike[str], settings: Config | None = None,
             *, listen_path: str | os.PathLike[str] | None = None, extra_args: Sequence[str] = (),
             env: Mapping[str, str] | None = None,
             nofile: tuple[int, int | None] | None = None) -> ShimProcess:
    """A ShimProcess with the :func:`start_shim` defaults, not started."""
    return ShimProcess(workdir, upstream=upstream,
                       config=settings if isinstance(settings, str) else default_settings(settings),
                       socket_path=listen_path, log_level=None, extra_args=extra_args, env=env,
                       config_name="cri-shim.yaml", admin_socket="", nofile=nofile)


async def start_shim(upstream: str | os.PathLike[str], workdir: str | os.PathLike[str],
                     settings: Config | None = None, *, wait: bool = True, **kwargs: Any) -> ShimProcess:
    """Start ``python -m shim serve`` (see :func:`new_shim`); with ``wait``, return once its
    socket accepts connections (stopped again if it does not).

    ``settings`` is a dict (written as YAML, test defaults added) or raw YAML text.
    """
    return await new_shim(upstream, workdir, settings, **kwargs).astart(wait=wait)


@contextlib.asynccontextmanager
async def shim_process(upstream: str | os.PathLike[str], workdir: str | os.PathLike[str],
                       settings: Config | None = None, **kwargs: Any) -> AsyncIterator[ShimProcess]:
    """``start_shim`` for the length of an ``async with``; stopped (``astop``) at its end."""
    shim = await start_shim(upstream, workdir, settings, **kwargs)
    try:
        yield shim
    finally:
        await shim.astop()
