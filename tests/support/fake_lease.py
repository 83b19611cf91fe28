"""An in-memory ``LeaseLock`` (shim/controller/leader.py) for unit tests: one Lease with
resourceVersion checks, ``down`` fails every call, and each write is sent at once to the
``watchers`` as a watch event (``LeaderElector.lease_event``), as the Lease's informer would."""

from __future__ import annotations

import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from shim.controller.leader import LeaderElector, LeaseRecord


class FakeLock:
    def __init__(self, name: str = "l") -> None:
        self.name = name
        self.record: LeaseRecord | None = None
        self.rv = 0
        self.down = False
        self.watchers: list[LeaderElector] = []
        self.writes: list[tuple[str, float]] = []  # (holder, when), time.monotonic

    def describe(self) -> str:
        return f"fake/{self.name}"

    def _check(self) -> None:
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")

    def _written(self, record: LeaseRecord) -> None:
        self.rv += 1
        self.record = LeaseRecord(record.holder, record.duration, record.acquire_time, record.renew_time,
                                  record.transitions, str(self.rv))
        self.writes.append((record.holder, time.monotonic()))
        event: dict[str, Any] = {"metadata": {"name": self.name, "resourceVersion": str(self.rv)},
                                 "spec": {"holderIdentity": record.holder, "leaseDurationSeconds": record.duration}}
        for w in self.watchers:
            w.lease_event("MODIFIED", None, event)

    async def get(self, timeout: float) -> LeaseRecord | None:
        self._check()
        return self.record

    async def create(self, record: LeaseRecord, timeout: float) -> bool:
        self._check()
        if self.record is not None:
            return False
        self._written(record)
        return True

    async def update(self, record: LeaseRecord, timeout: float) -> bool:
        self._check()
        if self.record is None or record.resource_version != self.record.resource_version:
            return False
        self._written(record)
        return True
