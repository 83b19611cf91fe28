"""The controller's work queue, in the shape of client-go's ``workqueue`` (a rate-limiting,
delaying queue) for one asyncio loop.

* ``add``: the item is queued once however often it is added while queued; an item added while
  it is being processed (between ``get`` and ``done``) is not handed out again before ``done``,
  and is queued again at ``done``: no item is processed by two workers at once, and a change
  seen during its processing is never lost.
* ``add_after(item, delay)``: added once ``delay`` seconds have passed (the queue's clock); an
  item already waiting keeps the earlier of its two times.
* ``add_rate_limited``: ``add_after`` with the item's own backoff (``ItemBackoff``: ``base``
  doubling per failure, at most ``cap``); ``forget`` resets it (the item succeeded);
  ``num_requeues`` says how many failures it counts.
* ``get`` waits for a ready item (``get_nowait``: one if any is ready now), ``done`` ends its
  processing; ``shutdown`` drops every waiting item and ends the waits of ``get``
  (``ShutDown``).

Bounded by the items added: each item is held at most once queued, once waiting and once in
processing (the controller's items are its sets' names)."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T", bound=Hashable)


class ShutDown(Exception):
    """``get`` on a queue that was shut down."""


class ItemBackoff(Generic[T]):
    """Per-item exponential backoff, as client-go's ``ItemExponentialFailureRateLimiter``:
    the n-th failure in a row of an item waits ``base * 2**(n-1)``, at most ``cap``."""

    def __init__(self, base: float = 0.005, cap: float = 30.0) -> None:
        if not 0 < base <= cap:
            raise ValueError("need 0 < base <= cap")
        self.base = base
        self.cap = cap
        self._failures: dict[T, int] = {}

    def when(self, item: T) -> float:
        n = self._failures.get(item, 0)
        self._failures[item] = n + 1
        return min(self.cap, self.base * 2.0 ** min(n, 64))

    def forget(self, item: T) -> None:
        self._failures.pop(item, None)

    def num_requeues(self, item: T) -> int:
        return self._failures.get(item, 0)


class WorkQueue(Generic[T]):
    def __init__(self, backoff: ItemBackoff[T] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff: ItemBackoff[T] = backoff if backoff is not None else ItemBackoff()
        self._clock = clock
        self._queue: deque[T] = deque()  # ready, in order; each also in _dirty
        self._dirty: set[T] = set()  # to be processed (queued, or re-added while processing)
        self._processing: set[T] = set()
        self._waiting: dict[T, float] = {}  # item -> when it is added (the earliest asked)
        self._heap: list[tuple[float, int, T]] = []  # (when, seq, item); stale entries skipped
        self._seq = 0
        self._changed = asyncio.Event()
        self._shut = False

    # ------------------------------------------------------------------ adding

    def add(self, item: T) -> None:
        if self._shut or item in self._dirty:
            return
        self._dirty.add(item)
        if item in self._processing:
            return  # queued again at done()
        self._queue.append(item)
        self._changed.set()

    def add_after(self, item: T, delay: float) -> None:
        if self._shut:
            return
        if delay <= 0:
            self.add(item)
            return
        self._promote()  # an entry already due is added now, as client-go's waiting loop would have
        when = self._clock() + delay
        if item in self._waiting and self._waiting[item] <= when:
            return
        self._waiting[item] = when
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, item))
        self._changed.set()  # a get() waiting may have to wake earlier

    def add_rate_limited(self, item: T) -> None:
        self.add_after(item, self.backoff.when(item))

    def forget(self, item: T) -> None:
        self.backoff.forget(item)

    def num_requeues(self, item: T) -> int:
        return self.backoff.num_requeues(item)

    # ------------------------------------------------------------------ taking

    def _promote(self) -> float | None:
        """Add the waiting items now due; when the next one is (None: none waits)."""
        now = self._clock()
        while self._heap:
            when, _, item = self._heap[0]
            if self._waiting.get(item) != when:
                heapq.heappop(self._heap)  # replaced by an earlier time, or added already
                continue
            if when > now:
                return when
            heapq.heappop(self._heap)
            del self._waiting[item]
            self.add(item)
        return None

    def get_nowait(self) -> T | None:
        """A ready item, now in processing until ``done``; None: none ready (or shut down)."""
        if self._shut:
            return None
        self._promote()
        if not self._queue:
            return None
        item = self._queue.popleft()
        self._dirty.discard(item)
        self._processing.add(item)
        return item

    async def get(self) -> T:
        """The next ready item, waiting for one; raises ``ShutDown`` once shut down."""
        while True:
            if self._shut:
                raise ShutDown()
            item = self.get_nowait()
            if item is not None:
                return item
            self._changed.clear()
            due = self._promote()
            if self._queue:
                continue
            if due is None:
                await self._changed.wait()
                continue
            try:
                async with asyncio.timeout(max(0.0, due - self._clock())):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def done(self, item: T) -> None:
        self._processing.discard(item)
        if item in self._dirty and not self._shut:
            self._queue.append(item)
            self._changed.set()

    def shutdown(self) -> None:
        self._shut = True
        self._queue.clear()
        self._dirty.clear()
        self._waiting.clear()
        self._heap.clear()
        self._changed.set()

    # ------------------------------------------------------------------ looking

    def __len__(self) -> int:
        """Items ready now (not those waiting or in processing)."""
        return len(self._queue)

    @property
    def shutting_down(self) -> bool:
        return self._shut

    def queued(self) -> set[T]:
        """Items to be processed: ready, or added again while in processing."""
        return set(self._dirty)

    def waiting(self) -> dict[T, float]:
        """Items waiting for their time (``add_after``), by the time (the queue's clock)."""
        return dict(self._waiting)

    def processing(self) -> set[T]:
        return set(self._processing)
