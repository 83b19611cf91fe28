"""Wiring: builds every component from the config, owns the interception table,
and applies reloads.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from .config import Config
from .images import pull_image
from .images.service import PULL_IMAGE, ImageService
from .metrics import Metrics
from .pins import PinSet
from .proxy import Handler, Proxy
from .pulls.scheduler import PullScheduler
from .status import AdminServer, StatusSource, collect
from .tracing import Tracing
from .upstream import Upstream


class App:
    """Every component of a running shim, created once per process."""

    def __init__(self, cfg: Config, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.started_at = time.monotonic()
        self.tracing = tracing if tracing is not None else Tracing.from_env()
        # `cri-shim status` sections beyond the built-in ones: name -> () -> JSON-able dict, no credentials.
        self.status_sources: dict[str, StatusSource] = {}
        self.admin: AdminServer | None = None
        self.metrics = Metrics()
        self.upstream = Upstream(cfg.upstream, cfg.server.max_message_bytes)
        self.scheduler = PullScheduler(cfg.pulls.max_parallel, cfg.image_sets.max_parallel,
                                       dedup=cfg.pulls.dedup, observer=self.metrics)
        self.images = ImageService(self.upstream, self.scheduler, self.metrics, tracing=self.tracing)
        self._configure(cfg)
        self.proxy = Proxy(self.upstream, self.table(), on_call=self.metrics.observe_call, tracing=self.tracing)

    def _configure(self, cfg: Config) -> None:
        """Apply the reloadable parts of ``cfg``. Raises ConfigError before changing anything."""
        pins = PinSet.build(cfg.pins.images)
        self.cfg = cfg
        self.scheduler.configure(cfg.pulls.max_parallel, cfg.image_sets.max_parallel, cfg.pulls.dedup)
        self.images.pins = pins
        self.images.pins_enforce = cfg.pins.mode == "enforce"
        self.images.dedup_per_namespace = cfg.pulls.dedup_per_namespace

    def table(self) -> dict[str, Handler]:
        """Interception table: full method name -> handler. Everything else passes through."""
        svc = self.images
        return {
            PULL_IMAGE: partial(pull_image.pull_image, svc),
        }

    async def start(self) -> None:
        self.upstream.start_watch()
        if self.cfg.metrics.address:
            self.metrics.serve(self.cfg.metrics.address)
        if self.cfg.server.admin_socket:
            self.admin = AdminServer(self.cfg.server.admin_socket, self.status)
            await self.admin.start()

    def status(self) -> dict[str, Any]:
        """The `cri-shim status` document."""
        return collect(self, self.started_at)

    async def reload(self, cfg: Config) -> None:
        self._configure(cfg)
        self.proxy.set_table(self.table())

    def begin_shutdown(self) -> None:
        """SIGTERM: queued pulls fail with UNAVAILABLE so kubelet retries; running ones may finish."""
        self.scheduler.close()

    async def close(self) -> None:
        if self.admin is not None:
            await self.admin.close()
        self.metrics.close()
        await self.upstream.close()
        if self.tracing.enabled:  # export the last spans; blocks up to the exporter's timeout
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)
