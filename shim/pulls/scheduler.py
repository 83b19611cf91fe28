"""The node-wide pull scheduler: a cap, two priority classes, and collapsed pulls.

A *flight* is one upstream PullImage. Callers asking for the same pull while a
flight is queued or running join it instead of starting another; it counts once
against the cap. Who may join whom (the join rule):

* Flights are grouped by image (``PullKey.image``, the normalized reference:
  ``nginx`` = ``docker.io/library/nginx:latest``) and runtime handler.
* A **foreground** caller (kubelet, any CRI client) joins a flight of its group only
  when the credentials (``PullKey.auth``, a hash) and ``PullKey.namespace`` are the
  same, whether that flight was started by a foreground or a background caller. A
  pod never gets an image through credentials that are not its own (kubelet's
  credential checks, KEP-2535, hold), and with different credentials it starts its
  own flight next to the other one.
* A **background** caller (image-set prefetch) joins any flight of its group,
  whatever its credentials or namespace: it only wants the image present and adds
  nothing to the other caller's pull. It prefers a flight with its own key.

Each caller waits with its own deadline; the flight goes on while anyone waits
(foreground or background) and is cancelled (or dropped from the queue) when the
last waiter leaves. Results and errors fan out to every waiter still there. A
finished flight is forgotten at once: a later pull goes upstream again.

A running flight may be *released* (``release``, the slot lease of lease.py): it goes on
upstream and its callers keep waiting for it (identical pulls still join it), but it no
longer counts against the cap, and the next queued flight starts.

Queues are FIFO within a class; foreground (kubelet, any CRI client) goes before
background (image-set prefetch), which also has its own sub-cap. A foreground
caller joining a queued background flight lifts it into the foreground queue.

Background flights never hold the last slot under the cap: at most
``min(background_max_parallel, max_parallel - 1)`` of them run, so a foreground pull
waits only while at least one other foreground flight runs (config refuses
``image_sets.max_parallel >= pulls.max_parallel``, so the sub-cap is the smaller one).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Awaitable, Callable, Iterable, Mapping

import grpc

from ..errors import RpcError
from .key import PullKey


class Priority(IntEnum):
    FOREGROUND = 0
    BACKGROUND = 1


@dataclass(slots=True)
class PullOutcome:
    response: bytes
    joined: bool  # True: this caller shared another caller's upstream pull
    queued_seconds: float  # how long the flight waited for a slot before this caller got its answer


class PullEvents:
    """What the scheduler tells its observers (metrics, pull progress), at the same points for all.

    Every method is a no-op here: an observer overrides what it follows. ``flight_started``
    and ``flight_finished`` are called with the flight itself (its task is set when started).
    An observer must not raise into the scheduler: the slot must come back whatever happens.
    """

    def queue_changed(self, queued: int, in_flight: int) -> None:
        """The number of queued or running flights changed."""

    def joined(self, flight: Flight) -> None:
        """A caller joined ``flight`` instead of starting its own."""

    def flight_started(self, flight: Flight, waited: float) -> None:
        """``flight`` went upstream after ``waited`` seconds in the queue."""

    def flight_finished(self, flight: Flight, seconds: float) -> None:
        """``flight`` ended (``flight.result``: success | error | cancelled) after ``seconds`` upstream."""

    def flight_released(self, flight: Flight, why: str) -> None:
        """``flight`` goes on upstream without a slot (``PullScheduler.release``), because ``why``."""


Runner = Callable[[], Awaitable[bytes]]
# A waiting caller's progress listener: (event name, attributes), e.g. a span's add_event.
Listener = Callable[[str, Mapping[str, int]], None]


@dataclass(eq=False)
class Flight:
    key: PullKey
    priority: Priority
    run: Runner
    seq: int
    enqueued_at: float
    future: asyncio.Future[bytes]
    waiters: int = 0
    started_at: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    result: str | None = None  # success | error | cancelled, once finished
    released_at: float | None = None  # when it stopped holding a slot (release); it still runs
    listeners: list[Listener] = field(default_factory=list)  # of the callers waiting now

    @property
    def queued(self) -> bool:
        return self.started_at is None and not self.future.done()


class PullScheduler:
    """At most ``max_parallel`` flights upstream (0 = no cap); background ones at most
    ``background_max_parallel`` of those, and never all of them (one slot is foreground's)."""

    def __init__(self, max_parallel: int, background_max_parallel: int = 1, *, dedup: bool = True,
                 observers: Iterable[PullEvents] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.max_parallel = max_parallel
        self.background_max_parallel = background_max_parallel
        self.dedup = dedup
        self.observers: list[PullEvents] = list(observers)  # metrics, progress: told in this order
        self._clock = clock
        self._flights: dict[tuple[str, str], list[Flight]] = {}  # (image, handler) -> queued/running flights
        self._queues: dict[Priority, deque[Flight]] = {p: deque() for p in Priority}
        self._running: set[Flight] = set()  # upstream; each holds a slot unless released (released_at)
        self._seq = itertools.count()
        self._closed: RpcError | None = None

    # ------------------------------------------------------------------ public

    def configure(self, max_parallel: int, background_max_parallel: int, dedup: bool) -> None:
        """Change the caps (reload). Raising a cap starts queued flights at once."""
        self.max_parallel, self.background_max_parallel, self.dedup = max_parallel, background_max_parallel, dedup
        self._dispatch()

    async def pull(self, key: PullKey, run: Runner, *, priority: Priority = Priority.FOREGROUND,
                   timeout: float | None = None, listener: Listener | None = None) -> PullOutcome:
        """Wait for the pull ``key`` (joining an identical one) within ``timeout`` seconds.

        Raises RpcError: the runtime's error, DEADLINE_EXCEEDED when ``timeout`` runs out
        (also while still queued: no slot is taken), UNAVAILABLE when shutting down.
        """
        if self._closed is not None:
            raise self._closed
        flight = self._joinable(key, priority) if self.dedup else None
        joined = flight is not None
        if flight is None:
            flight = self._new_flight(key, priority, run)
        else:
            for o in self.observers:
                o.joined(flight)
            if priority < flight.priority:
                self._lift(flight, priority)
        flight.waiters += 1
        if listener is not None:
            flight.listeners.append(listener)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
            # arrives just as the result does, and this caller must see its own cancel.
            async with asyncio.timeout(None if timeout is None else max(timeout, 0.0)):
                response = await asyncio.shield(flight.future)
        except TimeoutError:
            where = "waiting for a pull slot" if flight.queued else "while the runtime was pulling"
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"cri-shim: deadline exceeded {where} {key.image}") from None
        finally:
            flight.waiters -= 1
            if listener is not None:
                flight.listeners.remove(listener)
            if flight.waiters == 0 and not flight.future.done():
                self._abandon(flight)
        started = flight.started_at if flight.started_at is not None else self._clock()
        return PullOutcome(response, joined, max(0.0, started - flight.enqueued_at))

    def close(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
              message: str = "cri-shim is shutting down; retry the pull") -> None:
        """Refuse new pulls and fail every queued one (running ones may finish)."""
        self._closed = RpcError(code, f"cri-shim: {message}")
        for q in self._queues.values():
            while q:
                flight = q.popleft()
                self._forget(flight)
                if not flight.future.done():
                    flight.future.set_exception(self._closed)
        self._changed()

    def fail_running(self, flight: Flight, error: RpcError) -> bool:
        """End a running flight with ``error`` for every waiter and cancel its upstream call
        (the stall guard). False if it is not running any more."""
        if flight not in self._running or flight.future.done():
            return False
        self._abandon(flight, error)
        return True

    def release(self, flight: Flight, why: str) -> bool:
        """``flight`` goes on upstream and its callers keep waiting, but it stops holding its
        slot: the next queued flight starts. False if it holds none (finished, or released)."""
        if flight not in self._running or flight.released_at is not None or flight.future.done():
            return False
        flight.released_at = self._clock()
        for o in self.observers:
            o.flight_released(flight, why)
        self._dispatch()
        self._changed()
        return True

    @property
    def holding(self) -> list[Flight]:
        """The running flights that hold a slot."""
        return sorted((f for f in self._running if f.released_at is None), key=lambda f: f.seq)

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def in_flight(self) -> int:
        """Upstream pulls running, with a slot or released."""
        return len(self._running)

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        """Queue and in-flight pulls for `cri-shim status` (no credentials: keys hold hashes)."""
        now = self._clock()

        def row(f: Flight) -> dict[str, object]:
            d: dict[str, object] = {"id": f.seq, "image": f.key.image, "handler": f.key.handler,
                                    "priority": f.priority.name.lower(), "waiters": f.waiters,
                                    "queued_seconds": round((f.started_at or now) - f.enqueued_at, 3)}
            if f.started_at is not None:
                d["running_seconds"] = round(now - f.started_at, 3)
            if f.released_at is not None:
                d["slot_released_seconds"] = round(now - f.released_at, 3)
            return d

        queue = [row(f) for p in Priority for f in self._queues[p]]
        return {"queued": queue, "in_flight": [row(f) for f in sorted(self._running, key=lambda f: f.seq)]}

    # ------------------------------------------------------------------ internals

    def _joinable(self, key: PullKey, priority: Priority) -> Flight | None:
        """The flight a caller joins under the join rule (module docstring), or None."""
        group = self._flights.get((key.image, key.handler))
        if not group:
            return None
        for f in group:
            if f.key == key:
                return f
        if priority is Priority.BACKGROUND:
            return group[0]
        return None

    def _new_flight(self, key: PullKey, priority: Priority, run: Runner) -> Flight:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume)
        flight = Flight(key, priority, run, next(self._seq), self._clock(), fut)
        if self.dedup:
            self._flights.setdefault((key.image, key.handler), []).append(flight)
        self._queues[priority].append(flight)
        self._dispatch()
        self._changed()
        return flight

    def _lift(self, flight: Flight, priority: Priority) -> None:
        if flight.queued:
            self._queues[flight.priority].remove(flight)
            self._queues[priority].append(flight)
        flight.priority = priority
        self._dispatch()

    def _has_slot(self, priority: Priority) -> bool:
        held = [f for f in self._running if f.released_at is None]
        if self.max_parallel and len(held) >= self.max_parallel:
            return False
        if priority is Priority.BACKGROUND:
            bg = sum(1 for f in held if f.priority is Priority.BACKGROUND)
            return bg < self.background_slots
        return True

    @property
    def background_slots(self) -> int:
        """How many background flights may run: one slot under the cap is always foreground's."""
        if self.max_parallel:
            return min(self.background_max_parallel, self.max_parallel - 1)
        return self.background_max_parallel

    def _dispatch(self) -> None:
        started = False
        for priority in Priority:
            q = self._queues[priority]
            while q and self._has_slot(priority):
                self._start(q.popleft())
                started = True
        if started:
            self._changed()

    def _start(self, flight: Flight) -> None:
        flight.started_at = self._clock()
        self._running.add(flight)
        flight.task = asyncio.get_running_loop().create_task(self._run(flight), name=f"pull {flight.key.image}")
        # Cleanup in a done callback, not a finally: a task cancelled before its first
        # step never runs its body, and its slot must still come back.
        flight.task.add_done_callback(lambda task: self._finished(flight, task))
        waited = flight.started_at - flight.enqueued_at
        for o in self.observers:
            o.flight_started(flight, waited)

    async def _run(self, flight: Flight) -> None:
        try:
            response = await flight.run()
        except RpcError as e:
            self._settle(flight, e)
            flight.result = "error"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug of ours: still answer every waiter
            self._settle(flight, RpcError(grpc.StatusCode.INTERNAL, f"cri-shim: pull failed: {e}"))
            flight.result = "error"
        else:
            self._settle(flight, response)
            flight.result = "success"

    def _finished(self, flight: Flight, task: asyncio.Task[None]) -> None:
        if flight.result is None:
            flight.result = "cancelled"
            self._settle(flight, RpcError(grpc.StatusCode.CANCELLED, f"cri-shim: pull of {flight.key.image} cancelled"))
        self._running.discard(flight)
        seconds = self._clock() - (flight.started_at or self._clock())
        for o in self.observers:
            o.flight_finished(flight, seconds)
        self._dispatch()
        self._changed()

    def _settle(self, flight: Flight, outcome: bytes | RpcError) -> None:
        self._forget(flight)
        if flight.future.done():
            return
        if isinstance(outcome, RpcError):
            flight.future.set_exception(outcome)
        else:
            flight.future.set_result(outcome)

    def _forget(self, flight: Flight) -> None:
        group_key = (flight.key.image, flight.key.handler)
        group = self._flights.get(group_key)
        if group is not None and flight in group:
            group.remove(flight)
            if not group:
                del self._flights[group_key]

    def _abandon(self, flight: Flight, error: RpcError | None = None) -> None:
        """Nobody waits any more (or the stall guard ended it with ``error``): drop it from
        the queue, or cancel the upstream call."""
        self._forget(flight)
        if flight.queued:
            self._queues[flight.priority].remove(flight)
            flight.future.set_exception(error or RpcError(grpc.StatusCode.CANCELLED, "cri-shim: pull abandoned"))
            self._changed()
        elif flight.task is not None and not flight.task.done():
            if error is not None and not flight.future.done():
                flight.future.set_exception(error)
            flight.task.cancel()

    def _changed(self) -> None:
        for o in self.observers:
            o.queue_changed(self.queued, self.in_flight)


def _consume(fut: asyncio.Future[bytes]) -> None:
    """Mark an exception as seen: a flight nobody waits for must not warn at GC."""
    if not fut.cancelled():
        fut.exception()
