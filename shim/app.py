"""Wiring: builds every component from the config, owns the interception table,
and applies reloads.
"""

from __future__ import annotations

from functools import partial

from .config import Config, ConfigError
from .handlers import HandlerResolver, compile_rules
from .images import image_status, list_images, pull_image, remove_image
from .images.service import IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE, REMOVE_IMAGE, STREAM_IMAGES, ImageService
from .metrics import Metrics
from .proxy import Handler, Proxy
from .pulls.scheduler import PullScheduler
from .sandboxes import REMOVE_POD_SANDBOX, RUN_POD_SANDBOX, remove_pod_sandbox, run_pod_sandbox
from .upstream import Upstream


class App:
    """Every component of a running shim, created once per process."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.upstream = Upstream(cfg.upstream, cfg.server.max_message_bytes)
        self.scheduler = PullScheduler(cfg.pulls.max_parallel, cfg.image_sets.max_parallel,
                                       dedup=cfg.pulls.dedup, observer=self.metrics)
        self.images = ImageService(self.upstream, self.scheduler, self.metrics)
        self.handlers = self.images.handlers = HandlerResolver(self.upstream, cfg.runtime_handlers)
        self._configure(cfg)
        self.proxy = Proxy(self.upstream, self.table())
        self.images.on_pins_changed = lambda: self.proxy.set_table(self.table())

    def _configure(self, cfg: Config) -> None:
        """Apply the reloadable parts of ``cfg``. Raises ConfigError before changing anything."""
        handler_rules = compile_rules(cfg.runtime_handlers.rules)
        try:
            self.images.set_pins(cfg.pins.images, enforce=cfg.pins.mode == "enforce")
        except ValueError as e:
            raise ConfigError("pins.images", str(e)) from None
        self.handlers.configure(cfg.runtime_handlers, handler_rules)
        self.cfg = cfg
        self.scheduler.configure(cfg.pulls.max_parallel, cfg.image_sets.max_parallel, cfg.pulls.dedup)
        self.images.dedup_per_namespace = cfg.pulls.dedup_per_namespace

    def table(self) -> dict[str, Handler]:
        """Interception table: full method name -> handler. Everything else passes through."""
        svc = self.images
        table: dict[str, Handler] = {
            PULL_IMAGE: partial(pull_image.pull_image, svc),
        }
        if svc.pins:  # without pins these calls are relayed untouched
            table |= {
                LIST_IMAGES: partial(list_images.list_images, svc),
                STREAM_IMAGES: partial(list_images.stream_images, svc),
            }
        if svc.pins or self.handlers.applies_to_images:  # pins, or a rule may add a runtime handler
            table |= {
                REMOVE_IMAGE: partial(remove_image.remove_image, svc),
                IMAGE_STATUS: partial(image_status.image_status, svc),
            }
        if self.handlers.learn:
            table[RUN_POD_SANDBOX] = partial(run_pod_sandbox, self.handlers)
            table[REMOVE_POD_SANDBOX] = partial(remove_pod_sandbox, self.handlers)
        return table

    async def start(self) -> None:
        self.upstream.start_watch()
        if self.cfg.metrics.address:
            self.metrics.serve(self.cfg.metrics.address)

    async def reload(self, cfg: Config) -> None:
        self._configure(cfg)
        self.proxy.set_table(self.table())

    def begin_shutdown(self) -> None:
        """SIGTERM: queued pulls fail with UNAVAILABLE so kubelet retries; running ones may finish."""
        self.scheduler.close()

    async def close(self) -> None:
        self.metrics.close()
        await self.upstream.close()
