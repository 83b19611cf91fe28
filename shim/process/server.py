"""Process lifecycle: the listening socket, signals, reload and graceful shutdown.

- The socket is created with the configured mode (0660 by default) and group; a stale
  socket left by a crash is replaced, but a live one (another shim running) is not.
- SIGHUP, or a change of the config file, reloads; a bad new config is logged and the
  old one stays in force. Keys that need a restart (listen, upstream, server.*,
  metrics.*) keep their running value, and the log says so.
- SIGTERM/SIGINT: stop accepting, cancel queued pulls with UNAVAILABLE (kubelet
  retries), give in-flight calls the grace period, remove the socket, exit 0.
- Under systemd (Type=notify) READY=1 is sent once the socket accepts calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import signal
from typing import Any, Iterator

import grpc

from .. import config as config_mod
from ..config import Config, ConfigError
from ..observability import logs
from ..relay.listener import Relay
from . import sdnotify
from .app import App
from .unixsock import StartupError, claim, publish, staging_path

_log = logs.get("server")

CONFIG_POLL_SECONDS = 1.0


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
        raise StartupError(f"server.socket_group: no such group {logs.shown(group)}") from None


def server_options(cfg: Config) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.server.max_message_bytes),
        ("grpc.max_send_message_length", cfg.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def restart_only_changes(running: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, running value, configured value) for every changed key a reload cannot apply."""
    changes: list[tuple[str, Any, Any]] = []
    for key in ("listen", "upstream"):
        if getattr(new, key) != getattr(running, key):
            changes.append((key, getattr(running, key), getattr(new, key)))
    for section in ("server", "metrics"):
        for f in dataclasses.fields(getattr(running, section)):
            old, cur = getattr(getattr(running, section), f.name), getattr(getattr(new, section), f.name)
            if old != cur and not (section == "server" and f.name in config_mod.RELOADABLE_SERVER_KEYS):
                changes.append((f"{section}.{f.name}", old, cur))
    return changes


def keep_restart_only(running: Config, new: Config) -> Config:
    """``new`` with every restart-only key set back to its running value."""
    server = dataclasses.replace(running.server,
                                 **{k: getattr(new.server, k) for k in config_mod.RELOADABLE_SERVER_KEYS})
    return dataclasses.replace(new, listen=running.listen, upstream=running.upstream, server=server,
                               metrics=running.metrics)


class ShimServer:
    """Runs the shim until SIGTERM/SIGINT."""

    def __init__(self, cfg: Config, config_path: str | None, overrides: dict[str, str | None]) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.path = config_mod.socket_path(cfg.listen)
        self._stop = asyncio.Event()
        self._stopping = False
        self._reload_lock = asyncio.Lock()
        self._config_stamp = self._stamp()
        self._socket_id: tuple[int, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._reload_pending = False

    def _stamp(self) -> tuple[int, int, int] | None:
        """What tells us the file changed: inode (atomic rename), mtime and size."""
        if not self.config_path:
            return None
        try:
            st = os.stat(self.config_path)
            return (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            return None

    async def start(self) -> App:
        """Bind the socket and start serving (no signal handlers: see run())."""
        gid = _gid(self.cfg.server.socket_group) if self.cfg.server.socket_group else None
        claim(self.path)
        self.app = app = App(self.cfg)
        try:
            await app.start()  # metrics and status are up before the first CRI call can arrive
        except OSError as e:  # e.g. metrics.address already in use
            await app.close()
            where = f"metrics.address {self.cfg.metrics.address}" if self.cfg.metrics.address else "start"
            raise StartupError(f"{where}: {e.strerror or e}") from None
        self.server: grpc.aio.Server | None = None
        self.relay: Relay | None = None
        # Bound under a hidden name first: the socket has its mode and group before any client can
        # reach it under self.path (no window in which the process's own group may connect).
        bound = staging_path(self.path)
        try:
            with _umask(0o777 & ~self.cfg.server.socket_mode):
                if app.relay is not None:
                    self.relay = app.relay
                    await self.relay.start(bound)
                else:
                    self.server = grpc.aio.server(options=server_options(self.cfg))
                    from ..grpc_engine.proxy import (
                        Proxy,  # the fallback engine, only when chosen
                    )

                    self.server.add_generic_rpc_handlers((Proxy(app.upstream, app.router, app.observation),))
                    self.server.add_insecure_port(f"unix:{bound}")
                    await self.server.start()
        except (RuntimeError, OSError) as e:  # grpc raises RuntimeError, asyncio OSError
            await app.close()
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "is the directory writable?"
            raise StartupError(f"cannot listen on {self.path} ({reason})") from None
        try:
            os.chmod(bound, self.cfg.server.socket_mode)
            if gid is not None:
                os.chown(bound, -1, gid)
            st = os.stat(bound)
            self._socket_id = (st.st_dev, st.st_ino)
        except OSError as e:
            await self._abort_start(bound)
            raise StartupError(f"cannot set owner/mode of {self.path}: {e.strerror}") from None
        try:
            publish(bound, self.path)
        except StartupError:
            self._socket_id = None  # self.path is another process's socket: leave it alone
            await self._abort_start(bound)
            raise
        self._watcher = asyncio.get_running_loop().create_task(self._watch_config(app), name="config-watch")
        logs.log(_log, logging.INFO, "serving", listen=self.cfg.listen, upstream=self.cfg.upstream,
                 engine=self.cfg.server.engine,
                 max_parallel_pulls=self.cfg.pulls.max_parallel, pins=len(self.cfg.pins.images))
        return app

    async def _stop_serving(self, grace: float) -> None:
        """Stop accepting; give calls in progress up to ``grace`` seconds, then cut them."""
        if self.relay is not None:
            await self.relay.shutdown(grace)
        if self.server is not None:
            await self.server.stop(grace)

    async def _abort_start(self, bound: str) -> None:
        await self._stop_serving(0)
        await self.app.close()
        if bound != self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(bound)
        if bound == self.path or self._socket_id is not None:
            self._unlink_socket()

    def _unlink_socket(self) -> None:
        """Remove our socket file; not one that another process has put there since."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if self._socket_id is None or (st.st_dev, st.st_ino) == self._socket_id:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def shutdown(self) -> None:
        """Stop accepting, fail queued pulls, let in-flight calls finish within the grace period."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
        grace = self.cfg.server.shutdown_grace_seconds
        logs.log(_log, logging.INFO, "shutting down", grace_seconds=grace)
        sdnotify.stopping(f"draining (grace {grace:g}s)")
        self.app.begin_shutdown()
        await self._stop_serving(grace)
        await self.app.close()
        self._unlink_socket()
        logs.log(_log, logging.INFO, "stopped")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Handlers go in before start: a SIGTERM while starting stops us cleanly right
        # after, and a SIGHUP while starting reloads right after (never kills us).
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        try:
            await self.start()
            sdnotify.ready(f"serving {self.cfg.listen} -> {self.cfg.upstream}")
            if self._reload_pending:
                self._on_sighup()
            await self._stop.wait()
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
        await self.shutdown()
        return 0

    def _on_sighup(self) -> None:
        if self._stopping:
            return
        app = getattr(self, "app", None)
        if app is None or self._watcher is None:  # still starting
            self._reload_pending = True
            return
        self._reload_pending = False
        task = asyncio.get_running_loop().create_task(self.reload(app, "SIGHUP"), name="reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_config(self, app: App) -> None:
        """Reload when the file changed and has stayed the same for one poll (not mid-write)."""
        previous = self._config_stamp
        while True:
            await asyncio.sleep(CONFIG_POLL_SECONDS)
            stamp = self._stamp()
            if stamp != self._config_stamp and stamp == previous:
                await self.reload(app, "config file changed", only_if_changed=True)
            previous = stamp

    async def reload(self, app: App, why: str, only_if_changed: bool = False) -> None:
        async with self._reload_lock:
            if self._stopping:
                return
            stamp = self._stamp()
            if only_if_changed and stamp == self._config_stamp:
                return  # a SIGHUP reload already read this version of the file
            self._config_stamp = stamp
            if not self.config_path:
                logs.log(_log, logging.WARNING, "no config file to reload", reason=why)
                return
            if self._config_stamp is None:
                logs.log(_log, logging.WARNING, "config file missing; keeping the running config",
                         reason=why, config=self.config_path)
                return
            sdnotify.reloading()
            try:
                await self._apply(app, why)
            finally:
                sdnotify.ready(f"serving {self.cfg.listen} -> {self.cfg.upstream}")

    async def _apply(self, app: App, why: str) -> None:
        try:
            new = config_mod.with_overrides(config_mod.load(self.config_path), **self.overrides)
        except ConfigError as e:
            logs.log(_log, logging.ERROR, "config reload rejected; keeping the running config",
                     reason=why, error=str(e))
            return
        for key, running, configured in restart_only_changes(self.cfg, new):
            logs.log(_log, logging.WARNING, "config key needs a restart; keeping the running value",
                     key=key, running=running, configured=configured)
        new = keep_restart_only(self.cfg, new)
        try:
            await app.reload(new)
        except ConfigError as e:
            logs.log(_log, logging.ERROR, "config reload rejected; keeping the running config",
                     reason=why, error=str(e))
            return
        except Exception:  # a bug of ours: keep serving with what is in force
            _log.error("config reload failed; keeping the running config",
                       extra={"fields": {"reason": why}}, exc_info=True)
            return
        self.cfg = new
        logs.setup(new.log.level, new.log.format, new.log.max_repeats, new.log.repeat_window_seconds)
        logs.log(_log, logging.INFO, "config reloaded", reason=why, max_parallel_pulls=new.pulls.max_parallel,
                 pins=len(new.pins.images), handler_rules=len(new.runtime_handlers.rules))
