"""Which sets the controller recomputes next: marked by an event, or by one timer per set at its
due time (a node that turns stale if nothing changes). Shared by the ImageSets (controller.py)
and MCO's PinnedImageSets (pinned.py); one wake-up for both."""

from __future__ import annotations

import asyncio
import time


class WorkQueue:
    """Set names to recompute: added now (``mark``) or at a time (``schedule``), taken in batches (``take``)."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        self.dirty: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def mark(self, *names: str) -> None:
        if names:
            self.dirty.update(names)
            self.wake.set()

    def schedule(self, name: str, due: float | None) -> None:
        """Mark ``name`` again at ``due`` (wall clock); None: no timer."""
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        if due is not None:
            delay = max(0.0, due - time.time()) + 0.05
            self._timers[name] = asyncio.get_running_loop().call_later(delay, self.mark, name)

    def forget(self, name: str) -> None:
        self.schedule(name, None)
        self.dirty.discard(name)

    def take(self) -> list[str]:
        """The marked names, sorted; none marked afterwards."""
        batch, self.dirty = sorted(self.dirty), set()
        return batch

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
