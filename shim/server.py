"""Process lifecycle: the listening socket, signals, reload and graceful shutdown.

- The socket is created with the configured mode (0660 by default) and group; a stale
  socket left by a crash is replaced, but a live one (another shim running) is not.
- SIGHUP, or a change of the config file, reloads; a bad new config is logged and the
  old one stays in force.
- SIGTERM/SIGINT: stop accepting, cancel queued pulls with UNAVAILABLE (kubelet
  retries), give in-flight calls the grace period, remove the socket, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Iterator

import grpc

from . import config as config_mod
from . import logs
from .app import App
from .config import Config, ConfigError
from .relay.listener import Relay

_log = logs.get("server")

CONFIG_POLL_SECONDS = 1.0


class StartupError(Exception):
    """The shim cannot start; the message says why, for the operator."""


def prepare_socket(path: str) -> None:
    """Make the directory; replace a stale socket; refuse to take over a live one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; remove it or choose another listen path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
        os.unlink(path)  # stale: nobody is listening
        logs.log(_log, logging.INFO, "replaced stale socket", path=path)
        return
    finally:
        probe.close()
    raise StartupError(f"another process is already serving on {path}")


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartupError(f"server.socket_group: no such group {group!r}") from None


def server_options(cfg: Config) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.server.max_message_bytes),
        ("grpc.max_send_message_length", cfg.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


class ShimServer:
    """Runs the shim until SIGTERM/SIGINT."""

    def __init__(self, cfg: Config, config_path: str | None, overrides: dict[str, str | None]) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.path = config_mod.socket_path(cfg.listen)
        self._stop = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._config_stamp = self._stamp()

    def _stamp(self) -> tuple[float, int] | None:
        if not self.config_path:
            return None
        try:
            st = os.stat(self.config_path)
            return (st.st_mtime, st.st_size)
        except OSError:
            return None

    async def start(self) -> App:
        """Bind the socket and start serving (no signal handlers: see run())."""
        self.app = app = App(self.cfg)
        prepare_socket(self.path)
        self.server: grpc.aio.Server | None = None
        self.relay: Relay | None = None
        await app.start()  # metrics and status are up before the socket accepts
        try:
            with _umask(0o777 & ~self.cfg.server.socket_mode):
                if self.cfg.server.engine == "relay":
                    self.relay = Relay(config_mod.socket_path(self.cfg.upstream), app.upstream,
                                       lambda: app.proxy.table, self.cfg.server.max_message_bytes,
                                       observe=app.proxy.observe)
                    await self.relay.start(self.path)
                else:
                    self.server = grpc.aio.server(options=server_options(self.cfg))
                    self.server.add_generic_rpc_handlers((app.proxy,))
                    self.server.add_insecure_port(f"unix:{self.path}")
                    await self.server.start()
            os.chmod(self.path, self.cfg.server.socket_mode)
            if self.cfg.server.socket_group:
                os.chown(self.path, -1, _gid(self.cfg.server.socket_group))
        except BaseException:
            await app.close()
            raise
        self._watcher = asyncio.get_running_loop().create_task(self._watch_config(app), name="config-watch")
        logs.log(_log, logging.INFO, "serving", listen=self.cfg.listen, upstream=self.cfg.upstream,
                 engine=self.cfg.server.engine,
                 max_parallel_pulls=self.cfg.pulls.max_parallel, pins=len(self.cfg.pins.images))
        return app

    async def shutdown(self) -> None:
        """Stop accepting, fail queued pulls, let in-flight calls finish within the grace period."""
        self._watcher.cancel()
        grace = self.cfg.server.shutdown_grace_seconds
        logs.log(_log, logging.INFO, "shutting down", grace_seconds=grace)
        self.app.begin_shutdown()
        if self.relay is not None:
            await self.relay.shutdown(grace)
        if self.server is not None:
            await self.server.stop(grace)
        await self.app.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        logs.log(_log, logging.INFO, "stopped")

    async def run(self) -> int:
        app = await self.start()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload(app, "SIGHUP")))
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()
        return 0

    async def _watch_config(self, app: App) -> None:
        while True:
            await asyncio.sleep(CONFIG_POLL_SECONDS)
            stamp = self._stamp()
            if stamp != self._config_stamp:
                self._config_stamp = stamp
                await self.reload(app, "config file changed")

    async def reload(self, app: App, why: str) -> None:
        async with self._reload_lock:
            try:
                new = config_mod.with_overrides(config_mod.load(self.config_path), **self.overrides)
            except ConfigError as e:
                logs.log(_log, logging.ERROR, "config reload rejected; keeping the running config",
                         reason=why, error=str(e))
                return
            for key in ("listen", "upstream"):
                if getattr(new, key) != getattr(self.cfg, key):
                    logs.log(_log, logging.WARNING, "config key needs a restart; keeping the running value",
                             key=key, running=getattr(self.cfg, key), configured=getattr(new, key))
            new = dataclasses.replace(new, listen=self.cfg.listen, upstream=self.cfg.upstream,
                                      server=self.cfg.server)
            try:
                await app.reload(new)
            except ConfigError as e:
                logs.log(_log, logging.ERROR, "config reload rejected; keeping the running config",
                         reason=why, error=str(e))
                return
            self.cfg = new
            logs.setup(new.log.level, new.log.format)
            logs.log(_log, logging.INFO, "config reloaded", reason=why)
