"""The pull queue: queued flights in lanes, FIFO within each, and which one starts next.

One lane per class (slots.Priority), and within the untrusted class one lane per uid, so
that a uid at its own limit (``pulls.max_parallel_per_uid``) does not hold back the flights
of another uid queued behind its own. The next flight to start is the head of a lane the slot
rule lets start: of the highest class, then of the lane that had a flight start least
recently (a uid queuing 40 pulls and one queuing 1 take turns), then the oldest. Within a
lane, first in first out. Work per start: one look at each lane's head (lanes: three, plus
one per untrusted uid with flights queued).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from .slots import Priority


class Queued(Protocol):
    seq: int  # the order flights were created in
    priority: Priority
    uid: int | None  # the uid an untrusted flight is charged to; None for the other classes


Q = TypeVar("Q", bound=Queued)
Lane = tuple[Priority, "int | None"]
MAX_REMEMBERED = 1024  # lanes whose last start is remembered; one forgotten counts as never served


class Lanes(Generic[Q]):
    """The queued flights of one scheduler, by lane (module docstring)."""

    def __init__(self) -> None:
        self._lanes: dict[Lane, deque[Q]] = {}
        self._served: dict[Lane, int] = {}  # when a lane last had a flight start, least recent first
        self._ticks = itertools.count()
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
        best: tuple[Priority, int, int] | None = None
        chosen: Lane | None = None
        for lane, flights in self._lanes.items():
            rank = (lane[0], self._served.get(lane, -1), flights[0].seq)
            if (best is None or rank < best) and may_start(*lane):
                best, chosen = rank, lane
        if chosen is None:
            return None
        flight = self._lanes[chosen][0]
        self.remove(flight)
        self._served.pop(chosen, None)
        self._served[chosen] = next(self._ticks)
        if len(self._served) > MAX_REMEMBERED:
            del self._served[next(iter(self._served))]  # the least recently served
        return flight

    def drain(self) -> list[Q]:
        """Take every queued flight."""
        flights = list(self)
        self._lanes.clear()
        self._served.clear()
        self._n = 0
        return flights

    def take(self, priority: Priority) -> list[Q]:
        """Take every queued flight of ``priority``."""
        taken = [f for f in self if f.priority is priority]
        for f in taken:
            self.remove(f)
        return taken
