"""Whether the API server answers, one fact shared by every request of one cluster source.

Each reader (an informer, the MCO discovery, a Secret) backs off on its own after an error
(``backoff``: full jitter, ``cluster.backoff_initial_seconds`` doubling to ``backoff_max_seconds``),
but waits through ``Reachability.wait``, which ends early when the API server is seen answering
again:

* a reader's first successful request after a failure wakes every waiting reader at once (the
  first watch that resumes resumes them all, instead of each sleeping out up to 60 s);
* while a reader cannot reach the API server at all (connection refused or reset, a timeout,
  or a 502/503/504 from a proxy in front of it), one probe asks ``GET /readyz`` every
  ``cluster.probe_interval_seconds`` (jittered, one request at a time per node); its first
  200 wakes every reader. An API server that answers with an error (500, 403, 404) is not
  probed: those readers keep their exponential backoff. So does a reader the probe woke whose
  next request fails as unreachable again (a 504 of a LIST longer than the server's request
  timeout, the client's own timeout): the server answers, only not that request, and retrying
  it every probe interval would hammer a loaded server; it is probed again once it succeeds.

A 429 with ``Retry-After`` (APF throttling; custom resources answer ``429 storage is
(re)initializing`` for a while after an API server restart) is not a failure: the reader waits
what the server asks, at most ``backoff_max_seconds``, and asks again (``retry_after``).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from typing import Any, Awaitable, Callable

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from ..observability import logs

_log = logs.get("cluster")

UNREACHABLE_STATUSES = frozenset({502, 503, 504})  # a proxy or load balancer answering for a missing server
RETRY_AFTER_FLOOR = 0.1  # a Retry-After of 0 (or in the past) still waits this long


def backoff(failures: int, initial: float, maximum: float, rng: Callable[[], float] = random.random) -> float:
    """Full jitter: uniform in [0, min(max, initial * 2^(failures-1))], at least initial/10."""
    cap = min(maximum, initial * (2.0 ** max(failures - 1, 0)))
    return max(initial / 10, cap * rng())


def describe(e: BaseException) -> str:
    """One line for a log, a status or ``cri-shim status``: for an API error its code, reason and
    the message of its Status (what an admission policy or RBAC said; never an object's content)."""
    if isinstance(e, ApiException):
        msg = _status_message(e.body)
        return f"HTTP {e.status}: {e.reason}" + (f": {msg}" if msg else "")
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _status_message(body: object, limit: int = 512) -> str:
    try:
        doc = json.loads(body) if isinstance(body, (str, bytes)) and body else None
    except ValueError:
        return ""
    msg = doc.get("message") if isinstance(doc, dict) and doc.get("kind") == "Status" else None
    return msg[:limit] if isinstance(msg, str) else ""


def unreachable(e: BaseException) -> bool:
    """No answer from the API server itself: a connection error, a timeout, or a gateway's 502/503/504."""
    if isinstance(e, ApiException):
        return e.status in UNREACHABLE_STATUSES or not e.status  # status 0: the client gave up before an answer
    return isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError, OSError, ConnectionError))


def retry_after(e: BaseException, maximum: float, *, now: Callable[[], float] = time.time) -> float | None:
    """Seconds a 429 asks to wait (``Retry-After``: seconds or an HTTP date), between
    ``RETRY_AFTER_FLOOR`` and ``maximum``; None when ``e`` is not a 429 with a usable Retry-After."""
    if not isinstance(e, ApiException) or e.status != 429 or not e.headers:
        return None
    raw = str(e.headers.get("Retry-After") or "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(raw).timestamp() - now()
        except (TypeError, ValueError, IndexError):
            return None
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, RETRY_AFTER_FLOOR), maximum)


Probe = Callable[[], Awaitable[bool]]


class Reachability:
    def __init__(self, probe: Probe | None, *, probe_interval: float, request_timeout: float,
                 rng: Callable[[], float] = random.random) -> None:
        self._probe_fn = probe
        self.probe_interval = probe_interval
        self.request_timeout = request_timeout
        self._rng = rng
        self._wake = asyncio.Event()
        self._failing: set[str] = set()  # readers whose last request failed
        self._unreachable: set[str] = set()  # ... because nothing answered
        # readers the probe woke whose next request failed as unreachable again: the API server
        # answers, only not them; they keep their own backoff (no probe) until they succeed
        self._contradicted: set[str] = set()
        self._probe_woke: set[str] = set()  # readers the last successful probe woke
        self._probe_task: asyncio.Task[None] | None = None
        self.probes = 0
        self.recoveries = 0

    # ------------------------------------------------------------------ what the readers report

    def succeeded(self, reader: str) -> None:
        """A request of ``reader`` was answered with success: when it had failed before, every
        waiting reader retries now (only the transition wakes them: a healthy reader's routine
        successes do not shorten the backoff of one that the server keeps refusing)."""
        self._probe_woke.discard(reader)
        self._contradicted.discard(reader)
        if reader not in self._failing:
            return
        self._failing.discard(reader)
        self._unreachable.discard(reader)
        self._recovered()

    def failed(self, reader: str, e: BaseException) -> None:
        self._failing.add(reader)
        if reader in self._probe_woke:  # the probe said the server answers; this reader's request did not
            self._probe_woke.discard(reader)
            if unreachable(e):
                self._contradicted.add(reader)
        if unreachable(e) and reader not in self._contradicted:
            self._unreachable.add(reader)
            self._start_probe()
        else:
            self._unreachable.discard(reader)

    def forget(self, reader: str) -> None:
        """``reader`` stopped (an MCO informer whose group went away, a Secret no set names)."""
        self._failing.discard(reader)
        self._unreachable.discard(reader)
        self._probe_woke.discard(reader)
        self._contradicted.discard(reader)

    def _recovered(self) -> None:
        """Wake every waiting reader: their backoff ends now."""
        self.recoveries += 1
        self._wake.set()
        self._wake = asyncio.Event()

    async def wait(self, delay: float) -> bool:
        """Sleep ``delay`` seconds or until the API server is seen answering; True when woken early."""
        wake = self._wake
        try:
            await asyncio.wait_for(wake.wait(), delay)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ the probe

    def _start_probe(self) -> None:
        if self._probe_fn is None or (self._probe_task is not None and not self._probe_task.done()):
            return
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(), name="cluster-probe")

    async def _probe_loop(self) -> None:
        assert self._probe_fn is not None
        while self._unreachable:
            await asyncio.sleep(self.probe_interval * (0.5 + self._rng()))
            if not self._unreachable:
                return
            self.probes += 1
            try:
                ok = await asyncio.wait_for(self._probe_fn(), self.request_timeout)
            except asyncio.CancelledError:
                raise
            except Exception:  # refused, reset, timed out: still unreachable
                ok = False
            if ok and self._unreachable:
                logs.log(_log, logging.INFO, "API server answers again; resuming every watch",
                         waiting=sorted(self._unreachable))
                self._probe_woke = set(self._unreachable)
                self._unreachable.clear()
                self._recovered()

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None

    def status(self) -> dict[str, Any]:
        return {"failing": sorted(self._failing), "unreachable": sorted(self._unreachable),
                "probes": self.probes, "recoveries": self.recoveries,
                **({"backing_off_despite_probe": sorted(self._contradicted)} if self._contradicted else {})}


async def readyz(api: Any, request_timeout: float) -> bool:
    """``GET /readyz`` with the client's credentials: True on 200 (system:public-info-viewer allows it)."""
    resp = await api.call_api("/readyz", "GET", auth_settings=["BearerToken"], _preload_content=False,
                              _request_timeout=request_timeout)
    try:
        return bool(resp.status == 200)
    finally:
        resp.release()
