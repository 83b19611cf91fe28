"""The slot lease: a pull nobody can judge holds its pull slot for a bounded time.

The no-progress guard (poller.py) ends a pull that makes no progress, but it judges only
the pulls whose progress it sees: containerd's content API, polled every
``pulls.progress_interval_seconds``. On CRI-O (no such API), with progress off, or when a
pull's records in the runtime cannot be told apart, nothing tells a registry that hangs
from one that is slow. kubelet sets no deadline on PullImage, so a few such hung pulls
would hold every slot of the cap and every later pod on the node would wait behind them.

So a pull whose progress is not judged, still unanswered ``pulls.no_progress_timeout_seconds``
after it started, stops holding its slot (``PullScheduler.release``): it goes on upstream (a
slow pull is never ended), its callers keep waiting for its answer, identical pulls still
join it, and the next queued pull starts. A pull the guard judges (or any pull while
``pulls.max_parallel`` is 0: there is no slot to give back) is looked at again one timeout
later: its progress may have become unknown, or a reload set a cap, meanwhile.

What this costs: on such a node the cap counts only the pulls that started less than the
timeout ago, so more than ``pulls.max_parallel`` slow pulls can run at once, but never more
than twice it (the slot rule's hard bound, slots.py: at the bound nothing new starts), and a
released pull of an untrusted peer or of prefetch still counts against its share. A released
pull ends as any pull: the last caller to leave cancels it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from ..observability import logs
from .scheduler import Flight, PullEvents, PullScheduler

_log = logs.get("pull")

# Why the no-progress guard cannot judge a flight's progress; None when it does.
Unjudged = Callable[[Flight], "str | None"]


@dataclass
class SlotLease(PullEvents):
    scheduler: PullScheduler
    unjudged: Unjudged
    timeout: float  # pulls.no_progress_timeout_seconds; 0: off
    _timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)  # flight seq -> its lease's end

    def __post_init__(self) -> None:
        self.scheduler.subscribe(self)

    def configure(self, timeout: float) -> None:
        """A new timeout applies to leases from now on; 0 ends every lease timer."""
        was, self.timeout = self.timeout, timeout
        if timeout <= 0:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
        elif was <= 0:
            for flight in self.scheduler.holding:
                self._arm(flight)

    def leased(self) -> list[int]:
        """The flights (by seq, in the order their lease began) whose lease runs now."""
        return list(self._timers)

    def flight_started(self, flight: Flight, waited: float) -> None:
        self._arm(flight)

    def flight_finished(self, flight: Flight, seconds: float) -> None:
        timer = self._timers.pop(flight.seq, None)
        if timer is not None:
            timer.cancel()

    def _arm(self, flight: Flight) -> None:
        if self.timeout > 0 and flight.seq not in self._timers:
            self._timers[flight.seq] = asyncio.get_running_loop().call_later(self.timeout, self.expire, flight)

    def expire(self, flight: Flight) -> None:
        """The lease of ``flight`` is over: release its slot unless the no-progress guard judges it."""
        timer = self._timers.pop(flight.seq, None)
        if timer is not None:  # called early (tests): its timer must not fire as well
            timer.cancel()
        if self.timeout <= 0 or flight.released_at is not None or flight.future.done():
            return
        why = self.unjudged(flight)
        if why is None or not self.scheduler.max_parallel:  # judged, or no cap: look again one timeout later
            self._arm(flight)
            return
        if self.scheduler.release(flight, why):
            logs.log(_log, logging.WARNING, "pull unanswered and its progress not judged; it goes on without "
                     "a pull slot and the next pull may start", image=flight.key.image,
                     timeout_seconds=self.timeout, why=why, waiters=flight.waiters,
                     key="pulls.no_progress_timeout_seconds")
            for listener in list(flight.listeners):
                try:
                    listener("pull slot released", {})
                except Exception:  # noqa: BLE001  (a span's event must not stop the release)
                    _log.debug("pull listener failed", exc_info=True)


__all__ = ["SlotLease", "Unjudged"]
