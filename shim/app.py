"""Wiring: builds every component from the config, owns the interception table,
and applies reloads.
"""

from __future__ import annotations

from functools import partial

from .config import Config
from .images import pull_image
from .images.service import PULL_IMAGE, ImageService
from .imagesets import ImageSets
from .metrics import Metrics
from .pins import PinSet
from .proxy import Handler, Proxy
from .pulls.scheduler import PullScheduler
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
        self.image_sets: ImageSets | None = None
        self._declared_pins: tuple[tuple[str, str], ...] = ()
        self._configure(cfg)
        self.proxy = Proxy(self.upstream, self.table())

    def _configure(self, cfg: Config) -> None:
        """Apply the reloadable parts of ``cfg``. Raises ConfigError before changing anything."""
        pins = PinSet.build(cfg.pins.images, self._declared_pins)
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

    def set_declared_pins(self, declared: list[tuple[str, str]]) -> None:
        """Pins of image sets, (image ref, set name); kept alongside pins.images across reloads."""
        self._declared_pins = tuple(declared)
        self.images.pins = PinSet.build(self.cfg.pins.images, self._declared_pins)

    async def _apply_image_sets(self, cfg: Config) -> None:
        """Start, stop or reconfigure image sets; a new image_sets.dir means starting over."""
        current = self.image_sets
        if current is not None and current.cfg.dir == cfg.image_sets.dir:
            current.configure(cfg.image_sets)
            return
        if current is not None:
            self.image_sets = None
            await current.stop()
            self.set_declared_pins([])
        if cfg.image_sets.dir:
            self.image_sets = ImageSets(cfg.image_sets, self.upstream, self.scheduler, self.metrics,
                                        on_pins=self.set_declared_pins, pins=lambda: self.images.pins)
            await self.image_sets.start()

    def image_sets_status(self) -> dict[str, object]:
        """Status source for `cri-shim status`."""
        if self.image_sets is None:
            return {"enabled": False}
        return {"enabled": True, **self.image_sets.status()}

    async def start(self) -> None:
        self.upstream.start_watch()
        if self.cfg.metrics.address:
            self.metrics.serve(self.cfg.metrics.address)
        await self._apply_image_sets(self.cfg)

    async def reload(self, cfg: Config) -> None:
        self._configure(cfg)
        self.proxy.set_table(self.table())
        await self._apply_image_sets(cfg)

    def begin_shutdown(self) -> None:
        """SIGTERM: queued pulls fail with UNAVAILABLE so kubelet retries; running ones may finish."""
        if self.image_sets is not None:
            self.image_sets.halt()
        self.scheduler.close()

    async def close(self) -> None:
        if self.image_sets is not None:
            await self.image_sets.stop()
        self.metrics.close()
        await self.upstream.close()
