"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

* A Lease held by another identity is taken only when its record has not changed for
  ``lease_duration`` (15 s) of this candidate's own clock since it observed the change
  (client-go's observedTime: no clock is compared across machines). Writes carry the
  resourceVersion read, so two candidates never both win.
* A standby watches the Lease (``lease_informer``: a watch on the one object, field selector
  ``metadata.name``), so it observes each renewal as it happens, and tries to acquire at the
  instant the observed record expires (``next_try``), not at its next poll: a killed leader's
  Lease is taken within ``lease_duration`` of its last renewal plus one read and one write.
  It also polls every ``retry_period`` (2 s, jittered up to 1.2x), as client-go does: with the
  watch broken or late it still observes within a retry period (the takeover then within the
  lease duration plus a retry period). A release seen on the watch is taken at once.
* The leader renews every ``retry_period``. When no renewal succeeded for ``renew_deadline``
  (10 s), it stops acting (``leading`` goes false at once, its work is cancelled) and becomes a
  candidate again: it stops 5 s before any standby may take over.
* Stopped cleanly (SIGTERM), the leader releases the Lease (empty holder, 1 s duration), so a
  standby takes over as soon as it sees that (the watch) instead of after the lease duration.

The elector reads and writes the Lease through a ``LeaseLock`` (client-go's
``resourcelock.Interface``): ``get``, ``create`` and ``update`` of one ``LeaseRecord``, an update
carrying the resourceVersion read. ``KubeLeaseLock`` is the Lease on the Kubernetes API; the unit
tests use an in-memory one (tests/support/fake_lease.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Coroutine, Protocol

from kubernetes_asyncio.client import ApiClient, CoordinationV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ..cluster.informer import Informer, Obj, describe
from ..cluster.reachability import Reachability
from ..observability import logs

_log = logs.get("controller")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


Record = tuple[str, str, float]  # (resourceVersion, holder, lease duration): any write changes the first


@dataclass(frozen=True)
class LeaseRecord:
    """A Lease's spec as the elector reads and writes it; ``resource_version`` is the one read
    (empty when writing a new Lease)."""
    holder: str
    duration: float
    acquire_time: str | None = None  # RFC 3339 with microseconds, as the API serves MicroTime
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str = ""


class LeaseLock(Protocol):
    """One Lease: ``get`` (None: it does not exist), ``create`` (False: another candidate
    created it first), ``update`` with the resourceVersion of the record read (False: written
    by someone else since). Any other failure raises."""

    def describe(self) -> str: ...

    async def get(self, timeout: float) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord, timeout: float) -> bool: ...

    async def update(self, record: LeaseRecord, timeout: float) -> bool: ...


def _spec(record: LeaseRecord) -> dict[str, Any]:
    return {"holderIdentity": record.holder, "leaseDurationSeconds": int(record.duration),
            "acquireTime": record.acquire_time, "renewTime": record.renew_time,
            "leaseTransitions": record.transitions}


class KubeLeaseLock:
    """A ``coordination.k8s.io/v1`` Lease on the Kubernetes API."""

    def __init__(self, api: ApiClient, *, namespace: str, name: str) -> None:
        self.api = api
        self.coord = CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name

    def describe(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            meta["resourceVersion"] = record.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": _spec(record)}

    async def get(self, timeout: float) -> LeaseRecord | None:
        try:
            lease = await self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        spec = lease.spec
        return LeaseRecord(
            holder=spec.holder_identity or "", duration=float(spec.lease_duration_seconds or 0),
            acquire_time=spec.acquire_time.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if spec.acquire_time else None,
            renew_time=spec.renew_time.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if spec.renew_time else None,
            transitions=spec.lease_transitions or 0, resource_version=str(lease.metadata.resource_version))

    async def create(self, record: LeaseRecord, timeout: float) -> bool:
        try:
            await self.coord.create_namespaced_lease(self.namespace, self._body(record),  # type: ignore[arg-type]
                                                     _request_timeout=timeout)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    async def update(self, record: LeaseRecord, timeout: float) -> bool:
        try:
            await self.coord.replace_namespaced_lease(self.name, self.namespace, self._body(record),  # type: ignore[arg-type]
                                                      _request_timeout=timeout)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def informer(self, on_event: Callable[[str, Obj, Obj], None], reach: Reachability, **kwargs: Any) -> Informer:
        """A watch of this one Lease (list and watch with the field selector ``metadata.name``,
        which a Role limited to its resourceNames allows)."""
        lister = partial(self.coord.list_namespaced_lease, self.namespace)
        return Informer(self.api, "leader-lease", lister, kind=("coordination.k8s.io/v1", "Lease"),
                        on_change=lambda: None, on_event=on_event, reach=reach,
                        field_selector=f"metadata.name={self.name}", **kwargs)


class LeaderElector:
    def __init__(self, lock: LeaseLock, *, identity: str, lease_duration: float = 15.0,
                 renew_deadline: float = 10.0, retry_period: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease duration > renew deadline > retry period > 0")
        self.lock = lock
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._clock = clock
        self._observed: Record | None = None  # the Lease's record as last read or watched
        self._observed_at = 0.0  # when it last changed, on our clock
        self._last_try = -1e18  # when our last acquire attempt ended, on our clock
        self._changed = asyncio.Event()  # the watch saw the Lease change
        self._renewed_at = -1e18  # our last successful acquire or renew
        self._leading = False
        self.transitions = 0  # times this process became leader
        self.holder = ""  # the holder as last seen

    @property
    def leading(self) -> bool:
        """True only while a renewal succeeded within the renew deadline."""
        return self._leading and self._clock() - self._renewed_at < self.renew_deadline

    def _record(self, now_wall: float, acquired: str | None, transitions: int, resource_version: str) -> LeaseRecord:
        return LeaseRecord(holder=self.identity, duration=self.lease_duration,
                           acquire_time=acquired or _micro(now_wall), renew_time=_micro(now_wall),
                           transitions=transitions, resource_version=resource_version)

    def observe(self, record: Record | None) -> None:
        """The Lease as read or watched now (None: it does not exist). Only a change of its record
        restarts the lease duration, on our clock, from now: after the write it saw."""
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
            self.holder = record[1] if record is not None else ""
            self._changed.set()

    def lease_event(self, kind: str, old: Obj, new: Obj) -> None:
        """The watch's events (``lease_informer``)."""
        if kind == "LIST":
            return  # the informer's items hold the object: read by the next try
        if new is None:
            self.observe(None)
            return
        spec = new.get("spec") or {}
        self.observe((str(new["metadata"].get("resourceVersion")), str(spec.get("holderIdentity") or ""),
                      float(spec.get("leaseDurationSeconds") or self.lease_duration)))

    def next_try(self, next_poll: float) -> float:
        """When a standby tries to acquire next (our clock): at its poll, or at the instant the
        record it observed expires if that comes first and after its last try (a try after the
        expiry that lost waits for the poll or a change, never spins)."""
        if self._observed is None:
            return next_poll
        _, holder, duration = self._observed
        expires = self._observed_at + duration if holder and holder != self.identity else self._observed_at
        return expires if self._last_try < expires < next_poll else next_poll

    async def try_acquire_or_renew(self) -> bool:
        timeout = self.retry_period * 2
        lease = await self.lock.get(timeout)
        if lease is None:
            if not await self.lock.create(self._record(time.time(), None, 0, ""), timeout):
                return False  # another candidate created it first
            self.holder = self.identity
            return True
        now_wall = time.time()
        holder = lease.holder
        duration = lease.duration or self.lease_duration
        self.observe((lease.resource_version, holder, duration))
        if holder and holder != self.identity and self._clock() < self._observed_at + duration:
            return False
        mine = holder == self.identity
        acquired = lease.acquire_time if mine else None
        transitions = lease.transitions + (0 if mine else 1)
        if not await self.lock.update(self._record(now_wall, acquired, transitions, lease.resource_version), timeout):
            return False  # someone else wrote it since our read
        self.holder = self.identity
        return True

    async def try_once(self) -> bool:
        """One acquire or renew attempt; a failure to read or write the Lease is logged and counts
        as lost. Its end is the last try ``next_try`` weighs."""
        started = self._clock()  # a renewal counts from before its request: the server may apply it at once
        try:
            ok = await self.try_acquire_or_renew()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logs.log(_log, logging.WARNING, "cannot read or write the leader Lease", lease=self.lock.describe(),
                     error=describe(e))
            ok = False
        finally:
            self._last_try = self._clock()
        if ok:
            self._renewed_at = started
        return ok

    async def _acquire(self) -> None:
        """Until we hold the Lease: try at each poll, or when the observed record expires, or
        when the watch shows it changed (a release; a renewal only moves the expiry)."""
        while not await self.try_once():
            next_poll = self._clock() + self.retry_period * (1 + 0.2 * random.random())
            while (wait := self.next_try(next_poll) - self._clock()) > 0:
                self._changed.clear()
                try:
                    async with asyncio.timeout(wait):
                        await self._changed.wait()
                except TimeoutError:
                    break

    async def run(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Forever: acquire, then run ``lead()`` while renewing; cancel it when leadership is lost."""
        while True:
            await self._acquire()
            self._leading = True
            self.transitions += 1
            logs.log(_log, logging.INFO, "became leader", lease=self.lock.describe(), identity=self.identity)
            work = asyncio.get_running_loop().create_task(lead(), name="controller-lead")
            try:
                await self._renew_until_lost(work)
            finally:
                self._leading = False
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            logs.log(_log, logging.WARNING, "lost leadership: stopped acting", lease=self.lock.describe(),
                     identity=self.identity, holder=self.holder)

    async def _renew_until_lost(self, work: asyncio.Task[None]) -> None:
        while True:
            await asyncio.sleep(self.retry_period)
            if work.done():  # the work ended by itself (a bug): fail loudly, do not hold the Lease idle
                work.result()
                raise RuntimeError("the leader's work ended")
            left = self._renewed_at + self.renew_deadline - self._clock()
            if left > 0:
                try:
                    async with asyncio.timeout(left):
                        if await self.try_once():
                            continue
                except TimeoutError:
                    pass
            if not self.leading:
                return

    async def release(self) -> None:
        """Give the Lease up (when stopping, after the work was cancelled) if we still hold it: a
        standby takes it at its next try."""
        if self.transitions == 0:
            return
        self._leading = False
        try:
            lease = await self.lock.get(5.0)
            if lease is None or lease.holder != self.identity:
                return
            now = _micro(time.time())
            if not await self.lock.update(LeaseRecord(holder="", duration=1, acquire_time=now, renew_time=now,
                                                      transitions=lease.transitions,
                                                      resource_version=lease.resource_version), 5.0):
                return  # written by another candidate since: not ours to release
            logs.log(_log, logging.INFO, "released the leader Lease", lease=self.lock.describe())
        except Exception as e:
            logs.log(_log, logging.WARNING, "cannot release the leader Lease", error=describe(e))
