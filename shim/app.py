"""Wiring: builds every component from the config, owns the interception table,
and applies reloads.
"""

from __future__ import annotations

from .config import Config
from .proxy import Handler, Proxy
from .upstream import Upstream


class App:
    """Every component of a running shim, created once per process."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.upstream = Upstream(cfg.upstream, cfg.server.max_message_bytes)
        self.proxy = Proxy(self.upstream, self.table())

    def table(self) -> dict[str, Handler]:
        """Interception table: full method name -> handler. Everything else passes through."""
        return {}

    async def start(self) -> None:
        self.upstream.start_watch()

    async def reload(self, cfg: Config) -> None:
        self.cfg = cfg
        self.proxy.set_table(self.table())

    def begin_shutdown(self) -> None:
        """Called when SIGTERM arrives, before in-flight calls get their grace period."""

    async def close(self) -> None:
        await self.upstream.close()
