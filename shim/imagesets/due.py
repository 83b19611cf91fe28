"""When failed images are retried: a due-time queue and a retry budget per registry host.

``DueQueue`` is a heap of (due time, item): the reconciler asks for what fell due and when
the next item falls due, never scanning every image. Entries are removed lazily: the
caller says with ``alive`` whether a popped entry still stands (the image may have been
dropped, pulled by kubelet, or rescheduled since it was pushed).

``RetryBudget`` is a token bucket per registry host (``image_sets.retry_per_second``
tokens a second, a burst of as many): a retry takes a token before it is queued for a
pull; with none left, the image waits in its host's FIFO until one is earned. So 5,000
failed images of one registry cost that registry at most ``retry_per_second`` retries a
second, whatever their own backoff says, and a second registry is not held back by the
first.

The rate of a host adapts to how its prefetches end (``failed`` / ``succeeded``): each failed
one halves it, down to a tenth of ``retry_per_second`` (``SLOWEST_SHARE``); each one that
succeeds doubles it, up to ``retry_per_second``. A registry that answers every retry with an
error (down, or every image missing) is therefore retried 10 times less often than a healthy
one, and it is back at full rate after four of its prefetches succeed (a few seconds once it
heals: each success also earns the next retry sooner). A slowed host is forgotten once it
has had nothing to retry for ``FORGET_SECONDS``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

SLOWEST_SHARE = 0.1  # the slowest a host's retries go, as a share of retry_per_second
FORGET_SECONDS = 900.0  # a slowed host with nothing to retry for this long starts again at full rate


class DueQueue(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, at: float, item: T) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), item))

    def pop_due(self, now: float, alive: Callable[[float, T], bool]) -> Iterator[T]:
        """Items due at ``now``, earliest first; entries ``alive`` rejects are dropped."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, item = heapq.heappop(heap)
            if alive(at, item):
                yield item

    def next_at(self, alive: Callable[[float, T], bool]) -> float | None:
        """When the earliest live entry falls due (dead entries on top are dropped)."""
        heap = self._heap
        while heap and not alive(heap[0][0], heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def items(self) -> list[tuple[float, T]]:
        """Every entry, dead ones included (the caller filters)."""
        return [(at, item) for at, _, item in self._heap]

    def clear(self) -> None:
        self._heap.clear()


class _Bucket(Generic[T]):
    __slots__ = ("tokens", "at", "rate", "waiting", "outcome_at")

    def __init__(self, rate: float, at: float) -> None:
        self.rate = rate  # tokens a second now: retry_per_second, or less while retries fail
        self.tokens = max(rate, 1.0)
        self.at = at
        self.outcome_at = at  # when a prefetch of this host last ended
        self.waiting: deque[T] = deque()


class RetryBudget(Generic[T]):
    """Token buckets per registry host; items without a token wait in their host's FIFO."""

    def __init__(self, per_second: float) -> None:
        self.per_second = per_second
        self._buckets: dict[str, _Bucket[T]] = {}

    def configure(self, per_second: float) -> None:
        """A reload (image_sets.retry_per_second): buckets refill at the new rate from now on
        (a slowed host keeps its share of it)."""
        old, self.per_second = self.per_second, per_second
        for b in self._buckets.values():
            b.rate = per_second if old <= 0 else min(per_second, max(self._slowest, b.rate / old * per_second))

    @property
    def _slowest(self) -> float:
        return self.per_second * SLOWEST_SHARE

    def _bucket(self, host: str, now: float) -> _Bucket[T]:
        b = self._buckets.get(host)
        if b is None:
            b = self._buckets[host] = _Bucket(self.per_second, now)
        return b

    def _refill(self, b: _Bucket[T], now: float) -> None:
        b.tokens = min(max(b.rate, 1.0), b.tokens + (now - b.at) * b.rate)
        b.at = now

    def failed(self, host: str, now: float) -> None:
        """A prefetch from ``host`` failed: its retries slow down (halved, to the slowest)."""
        if self.per_second <= 0:
            return
        b = self._bucket(host, now)
        self._refill(b, now)
        b.rate = max(self._slowest, b.rate / 2.0)
        b.tokens = min(b.tokens, max(b.rate, 1.0))
        b.outcome_at = now

    def succeeded(self, host: str, now: float) -> None:
        """A prefetch from ``host`` succeeded: its retries speed up again (doubled, to the full rate)."""
        b = self._buckets.get(host)
        if b is None:
            return
        self._refill(b, now)
        b.rate = min(self.per_second, b.rate * 2.0)
        b.outcome_at = now

    def admit(self, host: str, item: T, now: float) -> bool:
        """True: go now (a token taken). False: ``item`` waits for ``release``."""
        if self.per_second <= 0:
            return True
        b = self._bucket(host, now)
        self._refill(b, now)
        if not b.waiting and b.tokens >= 1.0:
            b.tokens -= 1.0
            return True
        b.waiting.append(item)
        return False

    def release(self, now: float) -> list[T]:
        """Waiting items that have earned a token by ``now``, oldest first per host."""
        out: list[T] = []
        if self.per_second <= 0:  # reloaded to no limit: everything waiting goes now
            out = self.items()
            self._buckets.clear()
            return out
        for host in list(self._buckets):
            b = self._buckets[host]
            self._refill(b, now)
            while b.waiting and b.tokens >= 1.0:
                b.tokens -= 1.0
                out.append(b.waiting.popleft())
            if (not b.waiting and b.tokens >= max(b.rate, 1.0)
                    and (b.rate >= self.per_second or now - b.outcome_at >= FORGET_SECONDS)):
                del self._buckets[host]  # full and idle (and not slowed, or slowed long ago): forget it
        return out

    def next_at(self) -> float | None:
        """When the next waiting item earns its token."""
        if self.per_second <= 0:
            return 0.0 if any(b.waiting for b in self._buckets.values()) else None
        times = [b.at + (1.0 - b.tokens) / b.rate for b in self._buckets.values() if b.waiting]
        return min(times) if times else None

    def waiting(self) -> dict[str, int]:
        return {host: len(b.waiting) for host, b in sorted(self._buckets.items()) if b.waiting}

    def slowed(self) -> dict[str, float]:
        """Hosts whose retries run below ``per_second`` because they failed: their rate now."""
        return {host: round(b.rate, 3) for host, b in sorted(self._buckets.items()) if b.rate < self.per_second}

    def items(self) -> list[T]:
        """Every waiting item, oldest first per host."""
        return [item for b in self._buckets.values() for item in b.waiting]
