"""What the runtime holds of the declared images, learnt at the least cost.

A full pass reads the runtime's images (one ListImages, and ImageFsInfo when the disk guard
is on) and compares the names it holds with the names of the last pass: only images whose
name appeared or went, and images declared since, change state. A few newly declared images
(up to ``PROBE_MAX``) are looked up one by one with ImageStatus instead. A full pass still
runs every ``RESYNC_SECONDS`` (GC, crictl rmi), as a task of its own; what it says never
overrides a state decided after it was asked for. Every call has a deadline
(``image_sets.runtime_timeout_seconds``): a runtime that hangs is a failed read, retried with
backoff. docs/image-sets.md explains the costs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..config import ImageSetsConfig
from ..cri.deadline import Deadline
from ..cri.methods import IMAGE_STATUS, LIST_IMAGES
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from ..reference import pull_name
from .disk import DiskGuard
from .retries import backoff
from .snapshot import State
from .table import DeclaredImage, ImageTable

_log = logs.get("imagesets")

RESYNC_SECONDS = 60.0  # re-read the runtime's images this often (GC, crictl rmi)
PROBE_MAX = 64  # up to this many newly declared images: ImageStatus each, not a full ListImages


class RuntimeNames:
    """The normal forms of every name a ListImages answer holds. The names of the last answer
    keep theirs: when the runtime's names did not change, nothing is normalized again."""

    def __init__(self) -> None:
        self._normal: dict[str, str] = {}  # as the runtime spells a name -> its normal form

    def read(self, raw: bytes) -> tuple[set[str], int]:
        """(every normalized tag and digest of the answer ``raw``, its number of images).
        Runs in a thread: no loop work."""
        resp = api_pb2.ListImagesResponse.FromString(raw)
        spelled: set[str] = set()
        for image in resp.images:
            spelled.update(image.repo_tags)
            spelled.update(image.repo_digests)
        normal = self._normal
        if normal.keys() != spelled:
            normal = self._normal = {n: normal.get(n) or pull_name(n) for n in spelled}
        return set(normal.values()), len(resp.images)

    def kept(self) -> list[str]:
        """The names (as the runtime spells them) whose normal form is kept: the last answer's."""
        return list(self._normal)


class RuntimeView:
    """Decides the state of unknown images (and of images the runtime gained or lost) from what
    the runtime says. ``wake`` is set whenever a full pass ends; ``on_pass`` runs as one lands."""

    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, table: ImageTable, disk: DiskGuard, *,
                 clock: Callable[[], float], wake: asyncio.Event, on_pass: Callable[[], None]) -> None:
        self.cfg = cfg
        self._upstream = upstream
        self._table = table
        self._disk = disk
        self._clock = clock
        self._wake = wake
        self._on_pass = on_pass
        self.resync_seconds = RESYNC_SECONDS
        self.names = RuntimeNames()
        self._present: set[str] = set()  # every normalized name the runtime had at the last pass
        self.need_list = True
        self._listing: asyncio.Task[None] | None = None  # the full pass on its way
        self._list_started = 0.0
        self._probe_failed_at = 0.0  # a lookup while the full pass is on its way failed: not again until it lands
        self._list_failures = 0
        self.next_list = 0.0
        self.error = ""  # why the runtime's images cannot be read now
        self.passes = 0  # full passes and lookups finished
        self.last_pass: dict[str, Any] = {}

    @property
    def listing(self) -> bool:
        """Whether a full pass is on its way."""
        return self._listing is not None

    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._listing] if self._listing is not None else []

    def halt(self) -> None:
        """Cancel the full pass on its way; the next run starts with one."""
        if self._listing is not None:
            self._listing.cancel()
        self.need_list = True

    def forget_pass(self) -> None:
        """After ``halt`` and its drain: no pass on its way."""
        self._listing = None

    async def observe(self) -> None:
        """Learn which images the runtime has: ImageStatus for a few newly declared ones, else
        a full pass (one ListImages, and ImageFsInfo when the disk guard is on) in a task of its
        own. While that pass is on its way, images declared since it was asked for are looked
        up at once when they are few; when many, another pass follows it."""
        now = self._clock()
        table = self._table
        if self._listing is None:
            if not (self.need_list or now >= self.next_list):
                return
            if (self.need_list and now < self.next_list and 0 < len(table.unknown) <= PROBE_MAX
                    and self._can_probe()):
                self.need_list = False
                await self._probe(list(table.unknown))
                return
            self.need_list = False
            self._list_started = now
            self._listing = asyncio.get_running_loop().create_task(self._list(now), name="image sets: ListImages")
            self._listing.add_done_callback(lambda _: self._wake.set())
        elif self.need_list and self._can_probe():
            since = table.unknown_since(max(self._list_started, self._probe_failed_at), PROBE_MAX)
            if 0 < len(since) <= PROBE_MAX:
                self.need_list = False
                if not await self._probe(since):
                    self._probe_failed_at = now  # not again while this list is on its way ...
                    self.need_list = True  # ... but once it has landed (it skips them)

    def collect(self) -> None:
        """Forget the full pass once it has landed; a bug in it ends the loop, as it did inline."""
        if self._listing is not None and self._listing.done():
            done, self._listing = self._listing, None
            if not done.cancelled():
                done.result()

    def _can_probe(self) -> bool:
        return not (self._disk.wanted(self.cfg) and not self._disk.knows_filesystems)  # the guards need a full pass

    async def _list(self, started: float) -> None:
        """One full pass: what the runtime holds, against the last pass. An image whose state
        was decided after the list was asked for (pulled, probed, declared) keeps it."""
        wall = time.time()
        try:
            raw = await self._upstream.unary(LIST_IMAGES, b"",
                                             deadline=Deadline.after(self.cfg.runtime_timeout_seconds))
            if self._disk.wanted(self.cfg):
                await self._disk.read_filesystems(self.cfg.runtime_timeout_seconds)
        except RpcError as e:
            self._read_failed(e)
            return
        self._readable()
        present, count = await asyncio.to_thread(self.names.read, raw)
        now = self._clock()
        table = self._table
        appeared, went = present - self._present, self._present - present
        unseen: set[str] = set()  # appeared, but an image of that name was not decided by this list
        for name in appeared:
            for img in table.images_named(name):
                if img.state in (State.UNKNOWN, State.QUEUED, State.FAILED) and img.since <= started:
                    table.mark_present(img, now)
                elif img.state is not State.PRESENT:
                    unseen.add(name)  # pulling, or decided after the list was asked for
        for name in went:
            for img in table.images_named(name):
                if img.state is State.PRESENT and img.since >= started:
                    present.add(name)  # pulled or probed while the list was on its way: newer than it
                elif img.state in (State.UNKNOWN, State.PRESENT):
                    table.queue_up(img, now)
        for img in list(table.unknown):
            if img.since > started:
                continue  # declared while the list was on its way: probed, or the next pass's
            if img.ref in present:
                table.mark_present(img, now)
            else:
                table.queue_up(img, now)
        self._present = present - unseen  # the next pass sees those names appear again
        self.next_list = now + self.resync_seconds
        self.passes += 1
        missing = table.totals[State.QUEUED]
        self.last_pass = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)),
                          "seconds": round(now - started, 3), "runtime_images": count, "missing": missing}
        logs.log(_log, logging.DEBUG if not missing else logging.INFO, "image sets reconciled",
                 runtime_images=count, declared=len(table), missing=missing, seconds=round(now - started, 3))
        self._on_pass()  # the gauges say what status says from the moment the pass lands

    async def _probe(self, images: list[DeclaredImage]) -> bool:
        """ImageStatus for each of a few newly declared images. False: the runtime failed it
        (recorded as the runtime error; the images stay unknown)."""
        async def one(img: DeclaredImage) -> bool:
            req = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=img.spelled)).SerializeToString()
            raw = await self._upstream.unary(IMAGE_STATUS, req,
                                             deadline=Deadline.after(self.cfg.runtime_timeout_seconds))
            return bool(api_pb2.ImageStatusResponse.FromString(raw).image.id)

        try:
            found = await asyncio.gather(*(one(img) for img in images))
        except RpcError as e:
            self._read_failed(e, "ImageStatus")
            return False
        self._readable()
        now = self._clock()
        table = self._table
        for img, here in zip(images, found):
            if img.state is not State.UNKNOWN or not table.is_current(img):
                continue  # dropped or decided meanwhile
            if here:
                self._present.add(img.ref)
                table.mark_present(img, now)
            else:
                table.queue_up(img, now)
        self.passes += 1
        return True

    def pulled(self, ref: str) -> None:
        """A prefetch of ``ref`` succeeded: the runtime holds that name now."""
        self._present.add(ref)

    def _read_failed(self, e: RpcError, method: str = "ListImages") -> None:
        self._list_failures += 1
        delay = backoff(self.cfg, self._list_failures)
        self.next_list = self._clock() + delay
        err = f"{method} failed: {e.code.name}: {e.details}"
        if err != self.error:
            logs.log(_log, logging.WARNING, "cannot read the runtime's images; will retry", error=err,
                     retry_in=round(delay, 3))
        self.error = err
        self._table.mark_all_changed()

    def _readable(self) -> None:
        if self.error:
            logs.log(_log, logging.INFO, "runtime images readable again")
            self._table.mark_all_changed()
        self.error = ""
        self._list_failures = 0
