"""The node-wide pull scheduler: a cap, three classes, and collapsed pulls.

A *flight* is one upstream PullImage: the request of the caller that started it (its
*sender*) goes upstream, and callers asking for the same pull while it is queued or running
join it instead of starting another; it counts once against the cap. A flight's sender class
(``Flight.origin``: trusted, untrusted or prefetch, see below) never changes. Who may join
whom (the join rule):

* Flights are grouped by image (``PullKey.image``, the normalized reference:
  ``nginx`` = ``docker.io/library/nginx:latest``) and runtime handler.
* A CRI client joins only a flight whose request would be its own: the same ``PullKey``
  (credentials hash, namespace with ``pulls.dedup_per_namespace``, and the reference as
  spelled, ``PullKey.requested``: ``LOCALHOST:5000/app`` is not ``localhost:5000/app`` to
  containerd, nor ``nginx`` ``docker.io/library/nginx`` to CRI-O). A pod never gets an image
  through credentials that are not its own (kubelet's credential checks, KEP-2535, hold).
* A **trusted** caller never joins a flight an untrusted caller sent: it starts its own, so
  what goes upstream for it, and where it queues, is never an untrusted peer's. It joins a
  trusted caller's flight or a prefetch with its key.
* An **untrusted** caller joins a trusted caller's flight or an untrusted one's (any uid),
  never a prefetch: the shim's own pulls carry no waiter that could keep them running.
* A **background** caller (image-set prefetch) joins a flight of its group sent by a trusted
  caller or by prefetch and spelled as its own request (``PullKey.requested``: what the runtime
  pulls is then the image it declared), whatever its credentials or namespace: it only wants
  the image present and adds nothing to the other caller's pull. It prefers a flight with its
  own key. It never joins an untrusted caller's flight, so it never waits behind one.

Each caller waits with its own deadline; the flight goes on while anyone waits
and is cancelled (or dropped from the queue) when the last waiter leaves. Results and errors
fan out to every waiter still there. A finished flight is forgotten at once: a later pull
goes upstream again.

A running flight may be *released* (``release``, the slot lease of lease.py): it goes on
upstream and its callers keep waiting for it (identical pulls still join it), but it no
longer counts against the cap, and the next queued flight starts.

A flight has a class (``Priority``): **foreground** (a CRI client whose uid is in
``server.trusted_uids``: kubelet), **untrusted** (any other CRI client, charged to its uid) or
**background** (image-set prefetch). Who may start, and in which order, is the slot rule of
slots.py: trusted first, untrusted peers within their share (and one uid within its own
limit), prefetch within its sub-cap, the two together never the last slot, and never more
than twice the cap running in the runtime, released flights included (plus
``pulls.critical_slots`` for critical pods' pulls). The order within a class is queue.py's
ordering rule: trusted flights by effective priority (their pod priority, raised by age every
``pulls.priority_aging_seconds``), then age; untrusted flights FIFO within a uid, the uids
taking turns; prefetch FIFO.

The class of a collapsed flight (the priority rule): a **queued** flight is foreground while
a trusted caller waits for it, else background while a prefetch does, else untrusted, charged
to the uid of its oldest untrusted caller still waiting (an untrusted caller never moves a
flight a trusted caller or prefetch waits for into its lane); it moves to that lane (at its
end) when a caller joins or leaves. A **running** flight keeps the class it started with,
except that a trusted caller joining it makes it foreground: it then counts against no share.
A running flight is never lowered: what it counts against was checked when it started.

A trusted flight's pod priority (``Flight.rank``, the caller's ``pod_priority``:
pod_priority.py) is the highest among the trusted callers waiting for it now; it changes when
one joins or leaves, and a queued flight whose pod priority changes keeps its place and age
in the trusted class (queue.py). Untrusted and background callers bring no pod priority.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping

import grpc

from ..cri.deadline import NO_DEADLINE, Deadline, enforced
from ..errors import RpcError
from .key import PullKey
from .queue import Lanes
from .slots import Priority, Running, Slots

# The join rule: whose flights (by the class of their sender) a caller of each class may join.
JOINS: Mapping[Priority, frozenset[Priority]] = {
    Priority.FOREGROUND: frozenset({Priority.FOREGROUND, Priority.BACKGROUND}),
    Priority.UNTRUSTED: frozenset({Priority.FOREGROUND, Priority.UNTRUSTED}),
    Priority.BACKGROUND: frozenset({Priority.FOREGROUND, Priority.BACKGROUND}),
}
# The priority rule: a queued flight takes the first class of these that a caller waiting for it has.
CLASS_ORDER = (Priority.FOREGROUND, Priority.BACKGROUND, Priority.UNTRUSTED)


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

    def running_changed(self, running: Running) -> None:
        """What runs in the runtime now, by class, changed (or may have)."""


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
    uid: int | None = None  # an untrusted flight's: the uid it is charged to (the priority rule)
    callers: dict[Priority, int] = field(default_factory=dict)  # the callers waiting now, by class
    uids: dict[int, int] = field(default_factory=dict)  # the untrusted ones by uid, oldest first
    origin: Priority = Priority.FOREGROUND  # the class of the caller whose request goes upstream; never changes
    rank: int = 0  # a trusted flight's pod priority: its highest trusted caller's (the priority rule)
    ranks: dict[int, int] = field(default_factory=dict)  # the trusted callers waiting now, by pod priority
    order: int = 0  # set by the queue (queue.Lanes.push): its place in its class
    since: float = 0.0  # set by the queue: when it entered its class

    @property
    def queued(self) -> bool:
        return self.started_at is None and not self.future.done()


class PullScheduler:
    """At most ``max_parallel`` flights holding a slot (0 = no cap), by the slot rule of slots.py."""

    def __init__(self, max_parallel: int, background_max_parallel: int = 1, *, dedup: bool = True,
                 untrusted_share: float = 0.5, max_parallel_per_uid: int = 1, priority_order: bool = True,
                 aging_seconds: float = 60.0, critical_slots: int = 0,
                 observers: Iterable[PullEvents] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = Slots(max_parallel, background_max_parallel, untrusted_share, max_parallel_per_uid,
                           critical_slots)
        self.dedup = dedup
        self.priority_order = priority_order  # pulls.priority_order: False, every pod priority counts as 0
        self.observers: list[PullEvents] = list(observers)  # metrics, progress: told in this order
        self._clock = clock
        self._flights: dict[tuple[str, str], list[Flight]] = {}  # (image, handler) -> queued/running flights
        self._queue: Lanes[Flight] = Lanes(clock, aging_seconds)
        self._running: set[Flight] = set()  # upstream; each holds a slot unless released (released_at)
        self._seq = itertools.count()
        self._closed: RpcError | None = None

    # ------------------------------------------------------------------ public

    def subscribe(self, observer: PullEvents) -> None:
        """``observer`` is told every event from now on, after those given at construction.
        For an observer that acts on this scheduler (the progress poller, the slot lease):
        it subscribes itself when it is built."""
        self.observers.append(observer)

    @property
    def max_parallel(self) -> int:
        return self.slots.max_parallel

    @property
    def background_max_parallel(self) -> int:
        return self.slots.background_max_parallel

    @property
    def background_slots(self) -> int:
        return self.slots.background_slots

    def configure(self, max_parallel: int, background_max_parallel: int, dedup: bool, *,
                  untrusted_share: float = 0.5, max_parallel_per_uid: int = 1, priority_order: bool = True,
                  aging_seconds: float = 60.0, critical_slots: int = 0) -> None:
        """Change the caps and the ordering (reload). Raising a cap starts queued flights at once;
        with no slot left for untrusted peers (a cap of 1) their queued flights are refused.
        ``priority_order`` applies to pulls asked for from now on."""
        slots = Slots(max_parallel, background_max_parallel, untrusted_share, max_parallel_per_uid, critical_slots)
        self.slots, self.dedup = slots, dedup
        self.priority_order, self._queue.aging_seconds = priority_order, aging_seconds
        if slots.untrusted_slots == 0:
            for flight in self._queue.take(Priority.UNTRUSTED):
                self._forget(flight)
                if not flight.future.done():
                    flight.future.set_exception(self._no_untrusted_slot())
            self._changed()
        self._dispatch()

    async def pull(self, key: PullKey, run: Runner, *, priority: Priority = Priority.FOREGROUND,
                   uid: int | None = None, deadline: Deadline = NO_DEADLINE,
                   listener: Listener | None = None, pod_priority: int = 0) -> PullOutcome:
        """Wait for the pull ``key`` (joining an identical one) until ``deadline``, for a
        caller of class ``priority`` (``uid``: an untrusted caller's uid; ``pod_priority``: a
        trusted caller's pod priority, pod_priority.py, ignored for the others). The deadline ends
        this caller's wait, not the flight (unless nobody else waits for it).

        Raises RpcError: the runtime's error, DEADLINE_EXCEEDED when ``deadline`` passes
        (also while still queued: no slot is taken), UNAVAILABLE when shutting down,
        RESOURCE_EXHAUSTED for an untrusted caller when the cap leaves no slot to its class.
        """
        if self._closed is not None:
            raise self._closed
        if priority is Priority.UNTRUSTED and uid is None:
            uid = -1
        rank = pod_priority if priority is Priority.FOREGROUND and self.priority_order else 0
        flight = self._joinable(key, priority) if self.dedup else None
        joined = flight is not None
        if flight is None:
            if priority is Priority.UNTRUSTED and self.slots.untrusted_slots == 0:
                raise self._no_untrusted_slot()
            flight = self._new_flight(key, priority, run, uid, rank)
        else:
            for o in self.observers:
                o.joined(flight)
        self._arrive(flight, priority, uid, rank)
        if listener is not None:
            flight.listeners.append(listener)
        try:
            async with enforced(deadline, functools.partial(_deadline_passed, flight)):
                response = await asyncio.shield(flight.future)
        finally:
            if listener is not None:
                flight.listeners.remove(listener)
            self._leave(flight, priority, uid, rank)
        started = flight.started_at if flight.started_at is not None else self._clock()
        return PullOutcome(response, joined, max(0.0, started - flight.enqueued_at))

    def close(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
              message: str = "cri-shim is shutting down; retry the pull") -> None:
        """Refuse new pulls and fail every queued one (running ones may finish)."""
        self._closed = RpcError(code, f"cri-shim: {message}")
        for flight in self._queue.drain():
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
        return len(self._queue)

    @property
    def running(self) -> Running:
        """The flights running in the runtime, counted by class (the slot rule's view)."""
        counts = Running()
        for f in self._running:
            counts.add(f.priority, f.uid, f.released_at is not None)
        return counts

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
            if f.uid is not None:
                d["uid"] = f.uid
            if f.priority is Priority.FOREGROUND:
                d["pod_priority"] = f.rank
            if f.started_at is not None:
                d["running_seconds"] = round(now - f.started_at, 3)
            if f.released_at is not None:
                d["slot_released_seconds"] = round(now - f.released_at, 3)
            return d

        queue = [row(f) for f in self._queue]
        return {"queued": queue, "in_flight": [row(f) for f in sorted(self._running, key=lambda f: f.seq)]}

    def flights(self) -> dict[tuple[str, str], list[Flight]]:
        """(image, handler) -> its queued and running flights, oldest first: those a new pull may join."""
        return {k: list(v) for k, v in self._flights.items()}

    # ------------------------------------------------------------------ internals

    def _joinable(self, key: PullKey, priority: Priority) -> Flight | None:
        """The flight a caller joins under the join rule (module docstring), or None."""
        group = self._flights.get((key.image, key.handler))
        if not group:
            return None
        senders = JOINS[priority]
        mine = [f for f in group if f.origin in senders and f.key.requested == key.requested]
        for f in mine:
            if f.key == key:
                return f
        if priority is Priority.BACKGROUND and mine:
            return mine[0]
        return None

    def _new_flight(self, key: PullKey, priority: Priority, run: Runner, uid: int | None, rank: int) -> Flight:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume)
        flight = Flight(key, priority, run, next(self._seq), self._clock(), fut,
                        uid=uid if priority is Priority.UNTRUSTED else None, origin=priority,
                        rank=rank if priority is Priority.FOREGROUND else 0)
        if self.dedup:
            self._flights.setdefault((key.image, key.handler), []).append(flight)
        self._queue.push(flight)
        self._dispatch()
        self._changed()
        return flight

    def _arrive(self, flight: Flight, priority: Priority, uid: int | None, rank: int) -> None:
        """A caller of ``priority`` (and ``uid``, or pod priority ``rank``) waits for ``flight`` now."""
        flight.waiters += 1
        flight.callers[priority] = flight.callers.get(priority, 0) + 1
        if uid is not None and priority is Priority.UNTRUSTED:
            flight.uids[uid] = flight.uids.get(uid, 0) + 1
        if priority is Priority.FOREGROUND:
            flight.ranks[rank] = flight.ranks.get(rank, 0) + 1
        self._reclass(flight)

    def _leave(self, flight: Flight, priority: Priority, uid: int | None, rank: int) -> None:
        """A caller stopped waiting for ``flight`` (answered, deadline, cancelled)."""
        flight.waiters -= 1
        flight.callers[priority] -= 1
        if uid is not None and priority is Priority.UNTRUSTED:
            flight.uids[uid] -= 1
            if not flight.uids[uid]:
                del flight.uids[uid]
        if priority is Priority.FOREGROUND:
            flight.ranks[rank] -= 1
            if not flight.ranks[rank]:
                del flight.ranks[rank]
        if flight.future.done():
            return
        if flight.waiters == 0:
            self._abandon(flight)
        else:
            self._reclass(flight)

    def _reclass(self, flight: Flight) -> None:
        """Apply the priority rule (module docstring) to ``flight`` after a caller came or went."""
        top = next((p for p in CLASS_ORDER if flight.callers.get(p)), None)
        if top is None or flight.future.done():
            return
        uid = next(iter(flight.uids), -1) if top is Priority.UNTRUSTED else None
        rank = max(flight.ranks) if top is Priority.FOREGROUND else 0
        if flight.queued:
            if top is Priority.UNTRUSTED and self.slots.untrusted_slots == 0:
                # left to untrusted callers (root stopped waiting) with no slot for them: it could
                # never start, so it is refused as their own pull would be (as configure does)
                self._abandon(flight, self._no_untrusted_slot())
            elif (top, uid, rank) != (flight.priority, flight.uid, flight.rank):
                same_class = top is flight.priority
                self._queue.remove(flight)
                flight.priority, flight.uid, flight.rank = top, uid, rank
                # a trusted flight whose pod priority changed keeps its place and age; an untrusted one
                # charged to another uid goes to the end of that uid's lane (the priority rule)
                self._queue.push(flight, keep_place=same_class and top is Priority.FOREGROUND)
                self._dispatch()
        else:
            flight.rank = rank if top is Priority.FOREGROUND else flight.rank  # for status: no slot depends on it
            if top is Priority.FOREGROUND and flight.priority is not Priority.FOREGROUND:
                flight.priority, flight.uid = top, None  # its share gets its slot back
                self._dispatch()
                self._changed()

    def _no_untrusted_slot(self) -> RpcError:
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"cri-shim: no pull slot for clients outside server.trusted_uids: pulls.max_parallel "
                        f"{self.slots.max_parallel} keeps its only slot for trusted clients (kubelet)")

    def _dispatch(self) -> None:
        started = False
        while True:
            flight = self._queue.pop_next(functools.partial(self.slots.may_start, running=self.running))
            if flight is None:
                break
            self._start(flight)
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
            self._queue.remove(flight)
            flight.future.set_exception(error or RpcError(grpc.StatusCode.CANCELLED, "cri-shim: pull abandoned"))
            self._changed()
        elif flight.task is not None and not flight.task.done():
            if error is not None and not flight.future.done():
                flight.future.set_exception(error)
            flight.task.cancel()

    def _changed(self) -> None:
        running = self.running
        for o in self.observers:
            o.queue_changed(self.queued, self.in_flight)
            o.running_changed(running)


def _deadline_passed(flight: Flight) -> str:
    """What a caller whose deadline passed while it waited for ``flight`` is told."""
    where = "waiting for a pull slot" if flight.queued else "while the runtime was pulling"
    return f"cri-shim: deadline exceeded {where} {flight.key.image}"


def _consume(fut: asyncio.Future[bytes]) -> None:
    """Mark an exception as seen: a flight nobody waits for must not warn at GC."""
    if not fut.cancelled():
        fut.exception()
