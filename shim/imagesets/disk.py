"""The disk guards: no prefetch starts while the runtime's image filesystem is short of space,
and none that would take it past kubelet's image GC threshold (threshold.py).

Before each pull starts, the free space of the runtime's image filesystems (their mountpoints
from ImageFsInfo, read with each full pass; then ``statvfs``) is checked against
``image_sets.min_free_bytes``. When short, nothing new starts, status says why, and the
guard looks again every ``DISK_RECHECK_SECONDS`` while a prefetch lane is free (with every lane
busy, a lane ending is the next look). Off (0) by default.

``usage`` gives the threshold rule (``image_sets.gc_threshold_guard``) the fullest of those
filesystems as kubelet counts it: capacity ``f_blocks``, used ``f_blocks - f_bavail``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..config import ImageSetsConfig
from ..cri.deadline import Deadline
from ..cri.methods import IMAGE_FS_INFO
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..proto.runtime.v1 import api_pb2
from ..pulls.progress import human_bytes
from .threshold import Pressure, Usage

DISK_RECHECK_SECONDS = 30.0  # while short of space


class DiskGuard:
    def __init__(self, upstream: Upstream, clock: Callable[[], float],
                 statvfs: Callable[[str], Any] = os.statvfs) -> None:
        self._upstream = upstream
        self._clock = clock
        self._statvfs = statvfs
        self.blocked = ""  # why no prefetch starts now ("" when they may)
        self.checked_at = 0.0  # clock of the last check
        self.mounts: list[str] = []  # the runtime's image filesystems, as the last ImageFsInfo said
        self._fs_error = ""
        self.free_bytes: int | None = None  # on the fullest of them, at the last check
        self.pressure: Pressure | None = None  # why prefetches wait below kubelet's GC threshold (threshold.py)
        self.usage_error = ""  # why the threshold rule cannot read the usage now

    @staticmethod
    def wanted(cfg: ImageSetsConfig) -> bool:
        """Whether a guard is on (the runtime's image filesystems are read then)."""
        return cfg.min_free_bytes > 0 or cfg.gc_threshold_guard

    def usage(self) -> Usage | None:
        """The fullest image filesystem (by the share used), or None (``usage_error`` says why)."""
        self.checked_at = self._clock()
        if self._fs_error or not self.mounts:
            self.usage_error = self._fs_error or "no image filesystem known yet"
            return None
        fullest: tuple[float, Usage] | None = None
        for m in self.mounts:
            try:
                st = self._statvfs(m)
            except OSError as e:
                self.usage_error = f"cannot read {m}: {e.strerror}"
                return None
            total = st.f_blocks * st.f_frsize
            u = Usage(m, total - st.f_bavail * st.f_frsize, total)
            share = u.used / total if total else 1.0
            if fullest is None or share > fullest[0]:
                fullest = (share, u)
        self.usage_error = ""
        return fullest[1] if fullest is not None else None

    @property
    def knows_filesystems(self) -> bool:
        return bool(self.mounts)

    async def read_filesystems(self, timeout: float) -> None:
        """Ask the runtime where its images are (ImageFsInfo); a failure is remembered as the
        reason the guard cannot tell."""
        try:
            resp = api_pb2.ImageFsInfoResponse.FromString(
                await self._upstream.unary(IMAGE_FS_INFO, b"", deadline=Deadline.after(timeout)))
        except RpcError as e:
            self.mounts, self._fs_error = [], f"ImageFsInfo failed: {e.code.name}: {e.details}"
            return
        self.mounts = sorted({fs.fs_id.mountpoint for fs in resp.image_filesystems if fs.fs_id.mountpoint})
        self._fs_error = "" if self.mounts else "the runtime reported no image filesystem mountpoint"

    def why_short(self, need: int) -> str:
        """Why no pull may start now ('' when it may), ``need`` being image_sets.min_free_bytes."""
        self.checked_at = self._clock()
        if need <= 0:
            self.free_bytes = None
            return ""
        if self._fs_error:
            return f"cannot check free space ({self._fs_error}); image_sets.min_free_bytes is set"
        lowest: tuple[int, str] | None = None
        for m in self.mounts:
            try:
                st = self._statvfs(m)
            except OSError as e:
                return f"cannot check free space on {m}: {e.strerror}; image_sets.min_free_bytes is set"
            free = st.f_bavail * st.f_frsize
            if lowest is None or free < lowest[0]:
                lowest = (free, m)
        if lowest is None:
            return "cannot check free space: no image filesystem known yet"
        self.free_bytes = lowest[0]
        if lowest[0] < need:
            return (f"free space on {lowest[1]} is {human_bytes(lowest[0])}, below image_sets.min_free_bytes "
                    f"{human_bytes(need)}; not pulling until space is freed")
        return ""

    def block(self, reason: str) -> bool:
        """Say why prefetch waits ('' when it no longer does). True when that changed."""
        changed = reason != self.blocked
        self.blocked = reason
        return changed

    def status(self, cfg: ImageSetsConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"min_free_bytes": cfg.min_free_bytes, "free_bytes": self.free_bytes,
                               "mountpoints": list(self.mounts), "blocked": self.blocked}
        if cfg.gc_threshold_guard:
            p = self.pressure
            out["gc_threshold"] = {"pressure": bool(p), **({"reason": p.message(), **p.numbers()} if p else {}),
                                   **({"error": self.usage_error} if self.usage_error else {})}
        return out
