"""The pull queue: queued flights in lanes, FIFO within each, and which one starts next.

One lane per class (slots.Priority), and within the untrusted class one lane per uid, so
that a uid at its own limit (``pulls.max_parallel_per_uid``) does not hold back the flights
of another uid queued behind its own. The next flight to start is the oldest head of a
lane of the highest class among the lanes whose flight the slot rule lets start. Work per
start: one look at each lane's head (lanes: three plus one per untrusted uid queuing).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from .slots import Priority


class Queued(Protocol):
    seq: int  # the order flights were created in
    priority: Priority
    uid: int | None  # the uid an untrusted flight is charged to; None for the other classes


Q = TypeVar("Q", bound=Queued)
Lane = tuple[Priority, "int | None"]


class Lanes(Generic[Q]):
    def __init__(self) -> None:
        self._lanes: dict[Lane, deque[Q]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Q]:
        """Every queued flight, by class, oldest first."""
        return iter(sorted((f for lane in self._lanes.values() for f in lane), key=lambda f: (f.priority, f.seq)))

    def push(self, flight: Q) -> None:
        """Queue ``flight`` at the end of the lane of its class (and uid): a flight that changes
        class goes behind the flights already in its new lane (they were asked for first)."""
        self._lanes.setdefault((flight.priority, flight.uid), deque()).append(flight)
        self._n += 1

    def remove(self, flight: Q) -> None:
        where = (flight.priority, flight.uid)
        lane = self._lanes[where]
        lane.remove(flight)
        if not lane:
            del self._lanes[where]
        self._n -= 1

    def pop_next(self, may_start: Callable[[Priority, int | None], bool]) -> Q | None:
        """Take the flight that starts next, or None if no queued flight may start now."""
        best: Q | None = None
        for (priority, uid), lane in self._lanes.items():
            head = lane[0]
            if best is not None and (priority, head.seq) >= (best.priority, best.seq):
                continue
            if may_start(priority, uid):
                best = head
        if best is not None:
            self.remove(best)
        return best

    def drain(self) -> list[Q]:
        """Take every queued flight."""
        flights = list(self)
        self._lanes.clear()
        self._n = 0
        return flights

    def take(self, priority: Priority) -> list[Q]:
        """Take every queued flight of ``priority``."""
        taken = [f for f in self if f.priority is priority]
        for f in taken:
            self.remove(f)
        return taken
