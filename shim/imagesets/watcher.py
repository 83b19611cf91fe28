"""Watching a directory for changes: inotify (through ctypes) when it can, polling otherwise.

``DirWatcher.wait()`` returns when the directory may have changed. With inotify an
event wakes it at once, and a slow safety poll catches what inotify cannot see (the
directory itself created or replaced). Without inotify (not Linux, out of watches)
it compares cheap file stamps every ``poll_seconds``. ``wait_settled()`` adds the
debounce: it returns once no change has been seen for ``debounce`` seconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from typing import Callable

from ..observability import logs

_log = logs.get("imagesets")

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
              | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
_LOST = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
_EVENT = struct.Struct("iIII")

POLL_SECONDS = 1.0
SAFETY_POLL_SECONDS = 10.0


class _Inotify:
    """One inotify instance watching one directory; ``None`` from ``open`` when unavailable."""

    def __init__(self, libc: ctypes.CDLL, fd: int) -> None:
        self._libc = libc
        self.fd = fd
        self.wd = -1

    @classmethod
    def open(cls) -> _Inotify | None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            init = libc.inotify_init1
        except (OSError, AttributeError):
            return None
        fd = init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            return None
        return cls(libc, fd)

    def watch(self, path: str) -> bool:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err not in (errno.ENOENT, errno.ENOTDIR):
                logs.log(_log, logging.WARNING, "inotify unavailable for image sets; polling",
                         path=path, error=os.strerror(err))
            return False
        self.wd = wd
        return True

    def drain(self) -> None:
        """Read every pending event; forget the watch if the directory went away."""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            off = 0
            while off + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
                off += _EVENT.size + length
                if wd == self.wd and mask & _LOST:
                    self.wd = -1

    def close(self) -> None:
        os.close(self.fd)


class DirWatcher:
    def __init__(self, path: str, stamps: Callable[[], object], *, poll_seconds: float = POLL_SECONDS,
                 safety_poll_seconds: float = SAFETY_POLL_SECONDS, use_inotify: bool = True) -> None:
        self.path = path
        self._stamps = stamps
        self._last = stamps()
        self.poll_seconds = poll_seconds
        self.safety_poll_seconds = safety_poll_seconds
        self._ino = _Inotify.open() if use_inotify else None
        self._event = asyncio.Event()
        self._reading = False

    @property
    def mode(self) -> str:
        return "inotify" if self._ino is not None and self._ino.wd >= 0 else "poll"

    def _ensure_watch(self) -> bool:
        ino = self._ino
        if ino is None:
            return False
        if ino.wd < 0 and ino.watch(self.path):
            asyncio.get_running_loop().add_reader(ino.fd, self._readable)
            self._reading = True
        return ino.wd >= 0

    def _readable(self) -> None:
        assert self._ino is not None
        self._ino.drain()
        self._event.set()
        if self._ino.wd < 0 and self._reading:
            asyncio.get_running_loop().remove_reader(self._ino.fd)
            self._reading = False

    async def wait(self) -> None:
        """Return when the directory may have changed."""
        while True:
            watching = self._ensure_watch()
            timeout = self.safety_poll_seconds if watching else self.poll_seconds
            try:
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel on 3.11
                    await self._event.wait()
            except TimeoutError:
                stamps = self._stamps()
                if stamps != self._last:
                    self._last = stamps
                    return
                continue
            self._event.clear()
            self._last = self._stamps()
            return

    async def wait_settled(self, debounce: float, max_delay: float | None = None) -> None:
        """Wait for a change, then until ``debounce`` seconds pass without another one
        (at most ``max_delay``, default 10x the debounce or 2 s, so a busy writer can't starve us)."""
        await self.wait()
        if debounce <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (max_delay if max_delay is not None else max(10 * debounce, 2.0))
        while (left := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(min(debounce, left)):
                    await self.wait()
            except TimeoutError:
                return

    def close(self) -> None:
        if self._ino is not None:
            if self._reading:
                asyncio.get_running_loop().remove_reader(self._ino.fd)
                self._reading = False
            self._ino.close()
            self._ino = None
