"""Run the shim as its own process, the way systemd runs it, for lifecycle tests.

The runtime it forwards to is usually a FakeRuntime in the test's event loop, so
every wait here is async: the fake runtime keeps answering while a test waits.

    async with shim_process(runtime.endpoint, tmp_path, {"pulls": {"max_parallel": 2}}) as shim:
        shim.write_config({"pulls": {"max_parallel": 5}})
        shim.reload()                      # SIGHUP
        await shim.wait_log('msg="config reloaded"')

Listen and upstream are passed as flags; the config file holds the other settings.
stderr (the shim's log) goes to a file: ``shim.logs()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import yaml

REPO = Path(__file__).resolve().parents[2]


def default_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The test's settings plus what keeps a test shim off the node's real paths."""
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (settings or {}).items()}
    data.setdefault("server", {}).setdefault("admin_socket", "")
    return data


def shim_command(listen: str, upstream: str, config: str | os.PathLike[str],
                 extra_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "shim", "serve", "--listen", listen, "--upstream", upstream,
            "--config", str(config), *extra_args]


def shim_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NOTIFY_SOCKET", None)  # never talk to a real systemd by accident
    env.update(extra or {})
    return env


def connectable(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


@dataclass
class ShimProcess:
    proc: subprocess.Popen[bytes]
    path: str  # listen socket path
    config_path: Path
    log_path: Path
    _log_file: Any = field(repr=False, default=None)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.path}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def write_config(self, settings: Mapping[str, Any] | str) -> None:
        """Replace the config file atomically (as config management tools do)."""
        write_config(self.config_path, settings)

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def reload(self) -> None:
        self.send(signal.SIGHUP)

    def terminate(self) -> None:
        self.send(signal.SIGTERM)

    async def wait_log(self, text: str, timeout: float = 10.0, *, after: int = 0) -> int:
        """Wait until ``text`` appears in the log past offset ``after``; returns the offset after it."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.logs()
            i = log.find(text, after)
            if i >= 0:
                return i + len(text)
            if self.proc.poll() is not None:
                raise AssertionError(f"shim exited ({self.proc.returncode}) before logging {text!r}:\n{log}")
            if time.monotonic() > deadline:
                raise AssertionError(f"shim did not log {text!r} within {timeout}s:\n{log}")
            await asyncio.sleep(0.05)

    async def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"shim still running {timeout}s later:\n{self.logs()}")
            await asyncio.sleep(0.02)
        return self.proc.returncode

    async def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not connectable(self.path):
            if self.proc.poll() is not None:
                raise AssertionError(f"shim exited ({self.proc.returncode}) at start:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"shim not serving on {self.path} within {timeout}s:\n{self.logs()}")
            await asyncio.sleep(0.05)

    async def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time (the test then fails on its own)."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                await self.wait_exit(timeout)
            except AssertionError:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode


def write_config(path: Path, settings: Mapping[str, Any] | str) -> None:
    text = settings if isinstance(settings, str) else yaml.safe_dump(dict(settings), sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def start_shim(upstream: str, workdir: str | os.PathLike[str], settings: Mapping[str, Any] | str | None = None,
                     *, listen_path: str | None = None, extra_args: Sequence[str] = (),
                     env: Mapping[str, str] | None = None, wait: bool = True,
                     preexec_fn: Callable[[], None] | None = None) -> ShimProcess:
    """Start ``python -m shim serve``; with ``wait``, return once its socket accepts connections.

    ``settings`` is a dict (written as YAML, test defaults added) or raw YAML text.
    ``preexec_fn`` runs in the child before exec (e.g. to set an rlimit, as systemd does).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = listen_path or str(workdir / "shim.sock")
    if len(path) > 107:  # sun_path is 108 bytes with its NUL
        raise ValueError(f"socket path longer than 107 bytes: {path} (pass a shorter workdir or listen_path)")
    config_path = workdir / "cri-shim.yaml"
    write_config(config_path, settings if isinstance(settings, str) else default_settings(settings))
    log_path = workdir / "shim.log"
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(shim_command(f"unix://{path}", upstream, config_path, extra_args),
                            cwd=REPO, env=shim_env(env), stdin=subprocess.DEVNULL,
                            stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
    shim = ShimProcess(proc, path, config_path, log_path, log_file)
    if wait:
        try:
            await shim.wait_ready()
        except BaseException:
            await shim.stop()
            raise
    return shim


@contextlib.asynccontextmanager
async def shim_process(upstream: str, workdir: str | os.PathLike[str],
                       settings: Mapping[str, Any] | str | None = None, **kwargs: Any) -> AsyncIterator[ShimProcess]:
    shim = await start_shim(upstream, workdir, settings, **kwargs)
    try:
        yield shim
    finally:
        await shim.stop()
