"""The pull queue: queued flights in lanes, and which one starts next.

One lane per class (slots.Priority); within the untrusted class one lane per uid, so that a
uid at its own limit (``pulls.max_parallel_per_uid``) does not hold back the flights of
another uid queued behind its own; within the trusted class one lane per pod priority
(``Queued.rank``). The next flight to start is the head of a lane the slot rule lets start,
of the highest class, and within it:

* **trusted** (the ordering rule, docs/pulls.md "Ordering"): the highest *effective
  priority*, then the oldest. A flight's effective priority is (its age band, its pod
  priority), compared in that order, where the age band is ``floor(seconds queued in the
  trusted class / pulls.priority_aging_seconds)``: age raises a flight one band every
  ``pulls.priority_aging_seconds`` (the aging rate), and a flight of a higher band goes first
  whatever the pod priorities. So a trusted flight is never overtaken by one that entered
  the trusted class ``pulls.priority_aging_seconds`` or more after it (that one is always in a
  lower band): nothing waits forever behind a stream of higher priorities. Two flights that
  entered at the same time start in the order of their pod priority. With
  ``pulls.priority_order: false`` every rank is 0: oldest first.
* **untrusted**: the lane that had a flight start least recently (a uid queuing 40 pulls and
  one queuing 1 take turns), then the oldest.
* **background**: the oldest.

Within a lane, oldest first (``Queued.order``: when it entered its lane's class). Work per
start: one look at each lane's head (lanes: one per distinct pod priority queued, one per
untrusted uid with flights queued, and background).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from .slots import Priority


class Queued(Protocol):
    seq: int  # the order flights were created in
    priority: Priority
    uid: int | None  # the uid an untrusted flight is charged to; None for the other classes
    rank: int  # a trusted flight's pod priority (its highest trusted caller's); 0 for the other classes
    order: int  # set by Lanes.push: its place in its class, oldest first
    since: float  # set by Lanes.push: when it entered its class (the clock of Lanes)


Q = TypeVar("Q", bound=Queued)
Lane = tuple[Priority, "int | None", int]
MAX_REMEMBERED = 1024  # lanes whose last start is remembered; one forgotten counts as never served


class Lanes(Generic[Q]):
    """The queued flights of one scheduler, by lane (module docstring)."""

    def __init__(self, clock: Callable[[], float], aging_seconds: float = 60.0) -> None:
        self.aging_seconds = aging_seconds  # pulls.priority_aging_seconds, > 0
        self._clock = clock
        self._lanes: dict[Lane, deque[Q]] = {}
        self._served: dict[Lane, int] = {}  # when a lane last had a flight start, least recent first
        self._ticks = itertools.count()
        self._orders = itertools.count()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Q]:
        """Every queued flight, by class, oldest first."""
        return iter(sorted((f for lane in self._lanes.values() for f in lane), key=lambda f: (f.priority, f.order)))

    def push(self, flight: Q, *, keep_place: bool = False) -> None:
        """Queue ``flight`` in the lane of its class (and uid, or pod priority). A flight new to
        its class goes behind the flights already there (they were asked for first); with
        ``keep_place`` (a trusted flight whose pod priority changed) it keeps its place and age."""
        if not keep_place:
            flight.order, flight.since = next(self._orders), self._clock()
        lane = self._lanes.setdefault(_lane(flight), deque())
        if lane and lane[-1].order > flight.order:
            lane.insert(bisect.bisect([f.order for f in lane], flight.order), flight)
        else:
            lane.append(flight)
        self._n += 1

    def remove(self, flight: Q) -> None:
        where = _lane(flight)
        lane = self._lanes[where]
        lane.remove(flight)
        if not lane:
            del self._lanes[where]
        self._n -= 1

    def band(self, flight: Q, now: float) -> int:
        """``flight``'s age band: one per ``aging_seconds`` queued in its class."""
        return math.floor(max(0.0, now - flight.since) / self.aging_seconds)

    def pop_next(self, may_start: Callable[[Priority, int | None, int], bool]) -> Q | None:
        """Take the flight that starts next, or None if no queued flight may start now."""
        now = self._clock()
        best: tuple[int, int, int, int] | None = None
        chosen: Lane | None = None
        for lane, flights in self._lanes.items():
            head = flights[0]
            rank: tuple[int, int, int, int]
            if lane[0] is Priority.FOREGROUND:
                rank = (int(lane[0]), -self.band(head, now), -lane[2], head.order)
            else:
                rank = (int(lane[0]), self._served.get(lane, -1), 0, head.order)
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


def _lane(flight: Queued) -> Lane:
    return (flight.priority, flight.uid, flight.rank if flight.priority is Priority.FOREGROUND else 0)
