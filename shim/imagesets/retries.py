"""Failed images waiting for their retry: first their backoff, then a token of their registry's budget.

A failed image is retried after ``image_sets.retry_initial_seconds``, doubling up to
``retry_max_seconds`` (``backoff``); it never holds the others back. It waits in a due-time
queue, then for a token of its registry host's retry budget (``image_sets.retry_per_second``,
down to a tenth of it while that host's prefetches fail): due.py has both structures.
"""

from __future__ import annotations

from ..config import ImageSetsConfig
from .due import DueQueue, RetryBudget
from .snapshot import State
from .table import DeclaredImage, ImageTable


def backoff(cfg: ImageSetsConfig, attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones (at least one)."""
    return min(cfg.retry_initial_seconds * (2.0 ** max(attempts - 1, 0)), cfg.retry_max_seconds)


class RetryClock:
    """The failed images of a table, each waiting for its retry time and then for a token."""

    def __init__(self, table: ImageTable, per_second: float) -> None:
        self._table = table
        self._due: DueQueue[DeclaredImage] = DueQueue()
        self.budget: RetryBudget[DeclaredImage] = RetryBudget(per_second)

    def configure(self, per_second: float) -> None:
        self.budget.configure(per_second)

    def schedule(self, img: DeclaredImage) -> None:
        """``img`` failed (``retry_at`` set): it is retried from then on."""
        self._due.push(img.retry_at, img)

    def release(self, now: float) -> None:
        """Failed images whose backoff ran out take a token of their registry's retry budget,
        or wait in its FIFO; those that earned a token since are queued for a lane."""
        table = self._table
        for img in self._due.pop_due(now, self._waits):
            if self.budget.admit(img.host, img, now):
                table.queue_up(img, now)
        for img in self.budget.release(now):
            if img.state is State.FAILED and table.is_current(img):
                table.queue_up(img, now)

    def retry_all_now(self, now: float) -> None:
        """Credentials changed: every failed image is due now, not at its backoff time."""
        for at, img in self._due.items():
            if self._waits(at, img):
                img.retry_at = now
                self._due.push(now, img)

    def next_at(self) -> float | None:
        """When the next failed image falls due or earns its token."""
        times = [t for t in (self._due.next_at(self._waits), self.budget.next_at()) if t is not None]
        return min(times) if times else None

    def failing(self, limit: int) -> list[DeclaredImage]:
        """Up to ``limit`` failed images: those due and waiting for a token first, then the
        next ones to fall due."""
        table = self._table
        waiting = [img for img in self.budget.items()  # due, no token yet
                   if img.state is State.FAILED and table.is_current(img)]
        return waiting[:limit] + sorted((img for at, img in self._due.items() if self._waits(at, img)),
                                        key=lambda i: i.retry_at)[:limit - min(limit, len(waiting))]

    def _waits(self, at: float, img: DeclaredImage) -> bool:
        """Whether the due-queue entry (at, img) still stands: failed, not rescheduled, still declared."""
        return img.state is State.FAILED and img.retry_at == at and self._table.is_current(img)
