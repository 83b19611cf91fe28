"""Keeping declared image sets present: the loop that reads the runtime and starts the missing pulls.

Each turn of the loop (``run``) collects a full pass that landed, learns what the runtime
holds (runtime_view.py), queues failed images whose retry fell due (retries.py), starts pulls
while a lane is free and the disk guard allows (disk.py), and publishes the counts that
changed (report.py); then it sleeps until the next thing falls due, never scanning every
image. ``_start_pulls`` is the one place a prefetch starts: at most ``image_sets.max_parallel``
at a time, each lane pausing ``cooldown_seconds`` after its pull. The declared images, their
states and the counts per set are the table's (table.py); one pull is prefetch.py's.

An image dropped from every set is forgotten: its queued or running prefetch is cancelled (the
scheduler drops the flight unless a CRI client joined it, whose pull goes on), and the image
itself is left to kubelet's garbage collection. Pins are not decided here: the pin ledger
(pins/ledger.py) keeps them, from the versions this reconciler accepts. Nothing here is on the
path of a CRI call: kubelet never waits for a reconcile. docs/image-sets.md has the costs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Container

import grpc

from ..config import ImageSetsConfig
from ..cri.upstream import Upstream
from ..observability import logs
from ..pulls.failure import PullFailure
from .disk import DISK_RECHECK_SECONDS, DiskGuard
from .events import ImageSetEvents
from .gate import Gate, Held
from .loader import ImageSet
from .prefetch import Prefetch, Pulled
from .report import PinsView, Reporter, status
from .retries import RetryClock, backoff
from .runtime_view import RESYNC_SECONDS, RuntimeView
from .sizes import ImageSizes, SizeUnknown
from .snapshot import Snapshot, State
from .table import DeclaredImage, ImageTable
from .threshold import KubeletThreshold, Limit, Pressure, Usage, fits

_log = logs.get("imagesets")


@dataclass(frozen=True)
class Environment:
    """What the reconciler reads of the machine besides the runtime, and how often it looks
    again; tests give their own."""
    clock: Callable[[], float] = time.monotonic
    statvfs: Callable[[str], Any] = os.statvfs
    resync_seconds: float = RESYNC_SECONDS  # a full pass over the runtime's images this often
    disk_recheck_seconds: float = DISK_RECHECK_SECONDS  # while short of space


MIN_TURN_SECONDS = 0.005  # the shortest wait between two turns of the loop when nothing woke it


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Wait for ``event`` at most ``timeout`` seconds. (Not asyncio.wait_for: on 3.11 it can
    swallow a cancellation that arrives as the event is set, and the task would never stop.)"""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


class Reconciler:
    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, prefetch: Prefetch, events: ImageSetEvents,
                 pins: PinsView | None = None, env: Environment = Environment()) -> None:
        self.cfg = cfg
        self.prefetch = prefetch
        self._events = events
        self._clock = env.clock
        self._disk_recheck_seconds = env.disk_recheck_seconds
        self._wake = asyncio.Event()
        self.table = ImageTable()
        self.retries = RetryClock(self.table, cfg.retry_per_second)
        self.disk = DiskGuard(upstream, env.clock, env.statvfs)
        self.runtime = RuntimeView(cfg, upstream, self.table, self.disk, clock=env.clock, wake=self._wake,
                                   on_pass=self._runtime_read)
        self.runtime.resync_seconds = env.resync_seconds
        self.reporter = Reporter(self.table, events, pins)
        self._lanes: dict[asyncio.Task[None], DeclaredImage] = {}
        # prefetches that were running when a reload turned the threshold rule on, being sized
        self._sizing: set[asyncio.Task[None]] = set()
        self._size_lanes = False  # a reload turned the rule on: size the running prefetches first
        self.sizes = ImageSizes()  # manifest sizes, cached per digest (image_sets.gc_threshold_guard)
        self.kubelet = KubeletThreshold()
        self.gate: Gate[DeclaredImage] = Gate()  # prefetches held below kubelet's GC threshold

    @property
    def sets(self) -> dict[str, ImageSet]:
        """The versions in force (a refused edit keeps the previous one)."""
        return self.table.sets

    @property
    def passes(self) -> int:
        """Reads of the runtime finished (full passes and lookups); grows by one per read."""
        return self.runtime.passes

    # ------------------------------------------------------------------ inputs

    def configure(self, cfg: ImageSetsConfig) -> None:
        turned_on = cfg.gc_threshold_guard and not self.cfg.gc_threshold_guard
        self.cfg = self.runtime.cfg = self.prefetch.cfg = cfg
        if turned_on:
            self._size_lanes = True  # on the loop, before the next start (run)
        if DiskGuard.wanted(cfg) and not self.disk.knows_filesystems:
            self.runtime.need_list = True  # a guard turned on by a reload: its filesystems read with a full pass
        self.retries.configure(cfg.retry_per_second)
        self._wake.set()

    def set_sets(self, sets: dict[str, ImageSet], first: Container[str] = ()) -> None:
        """The declared sets changed (table.py ``apply``: costs the change). Newly declared images
        are looked up (ImageStatus or one ListImages); what is no longer declared is cancelled.
        ``first``: sets that keep their room under ``max_images`` before any other (the pin
        ledger's): a newcomer is refused before one of them, at a restart too."""
        self.table.apply(sets, first, self.cfg.max_images, self._clock())
        if self.table.unknown:
            self.runtime.need_list = True
        self._wake.set()

    def retry_failed(self) -> None:
        """Credentials changed: failed images are retried now, not at their backoff time."""
        self.retries.retry_all_now(self._clock())
        self._wake.set()

    def resync(self) -> None:
        """Read the runtime's images again now (not at the next resync)."""
        self.runtime.need_list = True
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Reconcile until cancelled."""
        try:
            while True:
                self._wake.clear()
                self.runtime.collect()
                if self.table.sets:
                    await self.runtime.observe()
                self.retries.release(self._clock())
                if self._size_lanes:
                    self._size_lanes = False
                    self._size_running_lanes()
                self._start_pulls()
                self.reporter.publish()
                timeout = self._next_wake() - self._clock()
                if self._wake.is_set():  # woken meanwhile: go round again, after every other ready task
                    await asyncio.sleep(0)
                else:  # at least MIN_TURN_SECONDS: a wake time stuck in the past costs a turn, not a core
                    await _wait(self._wake, max(timeout, MIN_TURN_SECONDS))
        finally:
            self.halt()

    async def drain(self) -> None:
        """Wait for cancelled prefetches to finish unwinding."""
        tasks = [*self._lanes, *self._sizing, *self.runtime.tasks()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.runtime.forget_pass()

    def halt(self) -> None:
        """Stop every prefetch of ours (shutdown, or image sets turned off)."""
        now = self._clock()
        self.runtime.halt()
        for sizing in list(self._sizing):
            sizing.cancel()
        for task, img in list(self._lanes.items()):
            task.cancel()
            if img.state is State.PULLING and self.table.is_current(img):
                self.table.set_state(img, State.UNKNOWN, now)
        for img in self.gate.clear():
            if img.state is State.QUEUED and self.table.is_current(img):
                self.table.set_state(img, State.UNKNOWN, now)
        self.table.unqueue(now)
        self._set_pressure(None)

    def _next_wake(self) -> float:
        now = self._clock()
        t = now + 3600.0
        if self.table.sets and not self.runtime.listing:
            t = min(t, self.runtime.next_list)
        retry = self.retries.next_at()
        if retry is not None:
            t = min(t, retry)
        # the disk is looked at again only when a lane is free to act on it: with every lane busy,
        # ``_start_pulls`` does not look (``checked_at`` stays put) and a lane ending wakes the loop
        if ((self.disk.blocked and (self.table.waiting or len(self.gate))) or self.disk.pressure is not None) \
                and self._lane_free() and not self._sizing:
            t = min(t, self.disk.checked_at + self._disk_recheck_seconds)
        return t

    def _runtime_read(self) -> None:
        """A full pass landed: counted, and the gauges say what status says from now on."""
        self._events.runtime_listed()
        self.reporter.publish()

    # ------------------------------------------------------------------ pulls

    def _start_pulls(self) -> None:
        """Start pulls while a lane is free and the disk guards allow: held images first (the
        smallest that fits below kubelet's GC threshold), then the oldest queued one."""
        table, disk, gate = self.table, self.disk, self.gate
        guard = self.cfg.gc_threshold_guard
        if not guard:  # the rule off (a reload): the held images queue again, and none waits for it
            for held in gate.clear():
                if self._still_queued(held):
                    table.queue_up(held, self._clock())
            if disk.pressure is not None:  # also while min_free_bytes holds prefetch (no start below)
                self._set_pressure(None)
        # while a prefetch that ran before the rule was turned on is being sized, none starts: it is
        # not reserved yet (its sizing ending wakes the loop)
        while self._lane_free() and not (guard and self._sizing):
            has_held = guard and len(gate) > 0
            if not has_held and not table.waiting:
                break
            # both guards before any start, held images included: min_free_bytes, then the usage
            # the threshold rule needs (unreadable: nothing starts, as for min_free_bytes)
            reason = disk.why_short(self.cfg.min_free_bytes)
            usage: Usage | None = None
            limit: Limit | None = None
            if not reason and guard:
                usage, limit = disk.usage(), self.kubelet.limit(self.cfg)
                if usage is None:
                    reason = (f"cannot read the image filesystem's usage ({disk.usage_error}); "
                              f"image_sets.gc_threshold_guard is on")
            if reason:
                if reason != disk.blocked and not disk.blocked:
                    logs.log(_log, logging.WARNING, "image set prefetch paused", reason=reason,
                             waiting=table.totals[State.QUEUED])
                self._block(reason)
                return
            if disk.blocked:
                logs.log(_log, logging.INFO, "image set prefetch resumed", free_bytes=disk.free_bytes)
                self._block("")
            if has_held and usage is not None and limit is not None:
                top = gate.smallest(self._still_queued)
                if top is not None:
                    if fits(usage, limit, gate.reserved_bytes, top.estimate):
                        gate.take(top.item)
                        self._launch(top.item, top.size, top.estimate)
                        continue
                    self._set_pressure(top, usage, limit)
            img = table.next_waiting()
            if img is None:
                break
            if usage is not None and limit is not None and not fits(usage, limit, gate.reserved_bytes, 0):
                self._set_pressure(Held(img, 0, 0), usage, limit)  # nothing fits: none is even sized
                return
            table.take_waiting()
            self._launch(img, None, 0)
        if not table.waiting and not (guard and len(gate)) and disk.blocked:
            self._block("")
        if not len(gate) and disk.pressure is not None:
            self._set_pressure(None)

    def _lane_free(self) -> bool:
        """Whether another prefetch may start (``image_sets.max_parallel``): the one test of it."""
        return len(self._lanes) < self.cfg.max_parallel

    def _still_queued(self, img: DeclaredImage) -> bool:
        return img.state is State.QUEUED and self.table.is_current(img)

    def _launch(self, img: DeclaredImage, size: int | None, estimate: int) -> None:
        self.table.set_state(img, State.PULLING, self._clock())
        if size is not None:
            self.gate.reserve(img, estimate)
        # whether this prefetch is sized before it pulls is decided now: one launched with the rule off
        # and reloaded on before its task ran is sized beside its pull (``_size_running_lanes``)
        guarded = self.cfg.gc_threshold_guard and size is None
        task = asyncio.get_running_loop().create_task(self._run_lane(img, guarded), name=f"prefetch {img.ref}")
        img.task = task
        self._lanes[task] = img
        task.add_done_callback(self._lane_done)

    def _set_pressure(self, top: Held[DeclaredImage] | None, usage: Usage | None = None,
                      limit: Limit | None = None) -> None:
        """Prefetches wait below kubelet's GC threshold (``top``: the smallest waiting, with the
        numbers), or no longer do (None)."""
        disk = self.disk
        if top is None or usage is None or limit is None:
            if disk.pressure is not None:
                logs.log(_log, logging.INFO, "image set prefetch below kubelet's image GC threshold resumed")
                disk.pressure = None
                self.table.mark_all_changed()
                self._events.disk_pressure(None)
            return
        p = Pressure(top.item.spelled if top.size else "", top.size, top.estimate, usage, self.gate.reserved_bytes,
                     limit, self.table.totals[State.QUEUED])  # held (sized) and not yet sized alike
        if disk.pressure is None:
            logs.log(_log, logging.WARNING, "image set prefetch waits: it would cross kubelet's image GC threshold",
                     reason=p.message())
            self.table.mark_all_changed()
        disk.pressure = p
        self._events.disk_pressure(p.numbers())

    def _block(self, reason: str) -> None:
        if self.disk.block(reason):
            self.table.mark_all_changed()

    def _lane_done(self, task: asyncio.Task[None]) -> None:
        self._lanes.pop(task, None)
        self._wake.set()

    async def _run_lane(self, img: DeclaredImage, guarded: bool) -> None:
        if guarded and self.cfg.gc_threshold_guard and not await self._admit(img):
            return  # held until it fits
        try:
            self._settle(img, await self.prefetch.pull(img))
        finally:
            self.gate.release(img)
        if self.cfg.cooldown_seconds > 0:
            await asyncio.sleep(self.cfg.cooldown_seconds)

    def _size_running_lanes(self) -> None:
        """A reload turned the threshold rule on: the prefetches already running were never sized,
        so each is sized now and its estimate reserved while it still runs. No prefetch starts until
        they are (``_start_pulls``); one whose size cannot be read counts by the usage alone, as an
        image of unknown size does."""
        for lane, img in self._lanes.items():
            if img.task is lane and not self.gate.is_reserved(img):  # still pulling, not sized
                task = asyncio.get_running_loop().create_task(self._size_running(lane, img),
                                                              name=f"size running prefetch {img.ref}")
                self._sizing.add(task)
                task.add_done_callback(self._sized)

    def _sized(self, task: asyncio.Task[None]) -> None:
        self._sizing.discard(task)
        self._wake.set()

    async def _manifest_size(self, img: DeclaredImage) -> int | None:
        """``img``'s size from its manifest, read with its credentials; None (logged) when it cannot
        be read: the prefetch is then judged by the filesystem's usage alone."""
        try:
            creds = await self.prefetch.credentials.for_image(img.spelled, frozenset(img.sets))
            return await self.sizes.size_of(img.spelled, creds)
        except Exception as e:  # SizeUnknown, or a bug: never leave the image stuck in a lane
            why = str(e) if isinstance(e, SizeUnknown) else f"unexpected {type(e).__name__}"
            logs.log(_log, logging.INFO, "image size unknown; prefetch judged by the filesystem's usage alone",
                     image=img.ref, error=why)
            return None

    async def _size_running(self, lane: asyncio.Task[None], img: DeclaredImage) -> None:
        size = await self._manifest_size(img)
        if size is None:
            return
        # still pulling (``_settle`` has not run: the lane's ``finally`` releases what is reserved here)
        if img.task is lane and not lane.done() and self.cfg.gc_threshold_guard and not self.gate.is_reserved(img):
            self.gate.reserve(img, int(size * self.cfg.size_factor))

    async def _admit(self, img: DeclaredImage) -> bool:
        """Size ``img`` from its manifest; True when it fits below kubelet's GC threshold now (its
        estimate is then reserved), False when it is held. A size that cannot be read: judged
        by the filesystem's usage alone (checked before the lane started)."""
        size = await self._manifest_size(img)
        if size is None:
            return True
        if not self.table.is_current(img) or img.state is not State.PULLING:
            return False  # dropped (or halted) meanwhile
        estimate = int(size * self.cfg.size_factor)
        usage, limit = self.disk.usage(), self.kubelet.limit(self.cfg)
        if usage is None or fits(usage, limit, self.gate.reserved_bytes, estimate):
            self.gate.reserve(img, estimate)
            return True
        img.task = None
        self.gate.hold(img, size, estimate)
        self.table.set_state(img, State.QUEUED, self._clock())
        top = self.gate.smallest(self._still_queued)
        self._set_pressure(top or Held(img, size, estimate), usage, limit)
        return False

    def _settle(self, img: DeclaredImage, pulled: Pulled) -> None:
        """A prefetch ended: the image is present, or failed and waits for its retry."""
        img.task = None
        table, error = self.table, pulled.error
        if error is not None:
            if error.code is not grpc.StatusCode.CANCELLED:
                self.retries.budget.failed(img.host, self._clock())
            if not table.is_current(img) or img.state is not State.PULLING:
                return  # dropped (or halted) meanwhile
            now = self._clock()
            delay = backoff(self.cfg, img.attempts + 1)
            table.record_failure(img, PullFailure.of(error), now, now + delay)
            self.retries.schedule(img)
            logs.log(_log, logging.WARNING, "image set pull failed; will retry", image=img.ref, handler=pulled.handler,
                     sets=",".join(sorted(img.sets)), code=error.code.name, error=error.details, attempts=img.attempts,
                     retry_in=round(delay, 3))
            return
        self.retries.budget.succeeded(img.host, self._clock())
        self.runtime.pulled(img.ref)
        if table.is_current(img):
            table.mark_present(img, self._clock())
        logs.log(_log, logging.DEBUG, "image set pull done", image=img.ref, handler=pulled.handler,
                 handler_source=pulled.handler_source, credentials=pulled.credentials,
                 joined=pulled.joined, seconds=round(pulled.seconds, 3))

    # ------------------------------------------------------------------ reporting

    def snapshot(self) -> Snapshot:
        """What every set stands at now: costs the number of sets (and of running pulls)."""
        return self.reporter.snapshot(self._lanes.values(), self.disk.blocked, self.runtime.error,
                                      self.runtime.passes, self.disk.pressure)

    def status(self) -> dict[str, Any]:
        snap = self.snapshot()
        out = status(snap, cfg=self.cfg, table=self.table, retries=self.retries, disk=self.disk,
                     runtime=self.runtime, prefetch=self.prefetch, now=self._clock())
        if self.cfg.gc_threshold_guard:
            limit = self.kubelet.limit(self.cfg)
            out["disk"]["gc_threshold"].update(
                threshold_percent=limit.percent, threshold_source=limit.source, margin_percent=limit.margin_percent,
                size_factor=self.cfg.size_factor, reserved_bytes=self.gate.reserved_bytes, held=len(self.gate),
                sizes=self.sizes.status(),
                **({"kubelet_config_error": self.kubelet.error} if self.kubelet.error else {}))
        return out
