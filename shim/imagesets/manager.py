"""Image sets: the directory, its watcher and the reconciler, started and stopped together."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from .. import logs
from ..config import ImageSetsConfig
from ..metrics import Metrics
from ..pins import PinSet
from ..pulls.scheduler import PullScheduler
from ..upstream import Upstream
from .loader import SetDirectory
from .reconciler import PinSink, Reconciler
from .watcher import POLL_SECONDS, DirWatcher

_log = logs.get("imagesets")


class ImageSets:
    """Watches ``cfg.dir``; every settled change re-reads the changed files and re-diffs."""

    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, scheduler: PullScheduler, metrics: Metrics, *,
                 on_pins: PinSink, pins: Callable[[], PinSet] | None = None, use_inotify: bool = True,
                 poll_seconds: float = POLL_SECONDS, **reconciler_options: Any) -> None:
        self.cfg = cfg
        self.directory = SetDirectory(cfg.dir, cfg.max_file_bytes)
        self.reconciler = Reconciler(cfg, upstream, scheduler, metrics, on_pins=on_pins, pins=pins,
                                     **reconciler_options)
        self._use_inotify = use_inotify
        self._poll_seconds = poll_seconds
        self.watcher: DirWatcher | None = None
        self.file_errors: dict[str, str] = {}
        self.scans = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._scanned = asyncio.Event()

    async def start(self) -> None:
        """Returns at once: the first scan and reconcile run in the background."""
        loop = asyncio.get_running_loop()
        self.watcher = DirWatcher(self.cfg.dir, self.directory.stamps, poll_seconds=self._poll_seconds,
                                  use_inotify=self._use_inotify)
        self._tasks = [loop.create_task(self._watch(), name="image-sets-watch"),
                       loop.create_task(self.reconciler.run(), name="image-sets-reconcile")]

    def configure(self, cfg: ImageSetsConfig) -> None:
        """Reload with the same directory (a new directory means a new ImageSets)."""
        self.cfg = cfg
        self.directory.max_file_bytes = cfg.max_file_bytes
        self.reconciler.configure(cfg)

    async def _watch(self) -> None:
        assert self.watcher is not None
        await self.rescan()
        if self.directory.dir_error:
            logs.log(_log, logging.WARNING, "image set directory unreadable; watching for it",
                     error=self.directory.dir_error)
        while True:
            await self.watcher.wait_settled(self.cfg.debounce_seconds)
            await self.rescan()

    async def rescan(self) -> None:
        result = await asyncio.to_thread(self.directory.scan)
        for err in result.new_errors:
            logs.log(_log, logging.ERROR, "image set file rejected; its previous content stays in force",
                     error=err)
        for path in self.file_errors.keys() - result.errors.keys():
            if path in self.directory.files:
                logs.log(_log, logging.INFO, "image set file accepted again", file=path)
        self.file_errors = result.errors
        first = self.scans == 0
        self.scans += 1
        if result.changed or first:
            self.reconciler.set_sets(result.sets)
        self._scanned.set()

    def halt(self) -> None:
        """Shutdown begins: no new prefetch, running ones cancelled."""
        for t in self._tasks:
            t.cancel()

    async def stop(self) -> None:
        self.halt()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.reconciler.halt()
        await self.reconciler.drain()
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dir": self.cfg.dir,
            "watch": self.watcher.mode if self.watcher is not None else "stopped",
            "files": len(self.directory.files),
            "file_errors": dict(self.file_errors),
        }
        if self.directory.dir_error:
            out["dir_error"] = self.directory.dir_error
        out.update(self.reconciler.status())
        return out
