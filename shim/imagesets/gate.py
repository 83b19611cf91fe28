"""The prefetches held below kubelet's image GC threshold, smallest first, and the bytes the
running ones are expected to take (threshold.py has the rule).

A held image keeps its place in no queue: when the room below the threshold grows (a pull
ends, kubelet collects images, the guard looks again every ``DISK_RECHECK_SECONDS`` with a lane free), the
smallest held image is the one tried, so a large image never keeps a smaller one that fits
waiting. Costs log(held) per hold and take; the number held is bounded by the declared images.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

_T = TypeVar("_T", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Held(Generic[_T]):
    item: _T
    size: int  # bytes its manifest lists
    estimate: int  # bytes it is expected to take on disk


class Gate(Generic[_T]):
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _T]] = []
        self._held: dict[_T, tuple[int, int, int]] = {}  # item -> (size, estimate, seq) of its live entry
        self._seq = itertools.count()
        self._reserved: dict[_T, int] = {}  # running prefetches -> their estimates
        self.reserved_bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, item: object) -> bool:
        return item in self._held

    def hold(self, item: _T, size: int, estimate: int) -> None:
        seq = next(self._seq)
        self._held[item] = (size, estimate, seq)
        heapq.heappush(self._heap, (estimate, seq, item))

    def smallest(self, valid: Callable[[_T], bool]) -> Held[_T] | None:
        """The held item with the smallest estimate that is still ``valid`` (others are forgotten)."""
        while self._heap:
            estimate, seq, item = self._heap[0]
            live = self._held.get(item)
            if live is None or live[2] != seq:
                heapq.heappop(self._heap)  # replaced or taken
                continue
            if not valid(item):
                heapq.heappop(self._heap)
                del self._held[item]
                continue
            return Held(item, live[0], estimate)
        return None

    def take(self, item: _T) -> None:
        """``item`` (the one ``smallest`` returned) leaves the held ones."""
        self._held.pop(item, None)

    def clear(self) -> list[_T]:
        """Every held item, forgotten (shutdown)."""
        items = list(self._held)
        self._held.clear()
        self._heap.clear()
        return items

    def reserve(self, item: _T, estimate: int) -> None:
        self.release(item)
        self._reserved[item] = estimate
        self.reserved_bytes += estimate

    def is_reserved(self, item: _T) -> bool:
        return item in self._reserved

    def release(self, item: _T) -> None:
        self.reserved_bytes -= self._reserved.pop(item, 0)
