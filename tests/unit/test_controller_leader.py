"""shim/controller/leader.py against an in-memory Lease: one winner, a standby waits for the
lease duration of unchanged record, a leader that cannot renew stops acting by the deadline."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from shim.controller.leader import LeaderElector


class FakeLeases:
    """read/create/replace of one Lease with resourceVersion checks; ``down`` fails every call."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")

    async def read_namespaced_lease(self, name: str, ns: str, **_: Any) -> Any:
        self._check()
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        s = self.lease["spec"]
        spec = SimpleNamespace(holder_identity=s.get("holderIdentity"), renew_time=s.get("renewTime"),
                               lease_duration_seconds=s.get("leaseDurationSeconds"),
                               lease_transitions=s.get("leaseTransitions"), acquire_time=None)
        return SimpleNamespace(spec=spec, metadata=SimpleNamespace(resource_version=str(self.rv)))

    async def create_namespaced_lease(self, ns: str, body: dict[str, Any], **_: Any) -> None:
        self._check()
        if self.lease is not None:
            raise ApiException(status=409, reason="Conflict")
        self.lease, self.rv = body, self.rv + 1

    async def replace_namespaced_lease(self, name: str, ns: str, body: dict[str, Any], **_: Any) -> None:
        self._check()
        if body["metadata"]["resourceVersion"] != str(self.rv):
            raise ApiException(status=409, reason="Conflict")
        self.lease, self.rv = body, self.rv + 1


def elector(leases: FakeLeases, identity: str) -> LeaderElector:
    e = LeaderElector(SimpleNamespace(), namespace="ns", name="l", identity=identity,  # type: ignore[arg-type]
                      lease_duration=0.6, renew_deadline=0.4, retry_period=0.1)
    e.coord = leases  # type: ignore[assignment]
    return e


async def _scenario() -> dict[str, float]:
    leases = FakeLeases()
    a, b = elector(leases, "a"), elector(leases, "b")
    acting: dict[str, list[float]] = {"a": [], "b": []}

    def work(name: str) -> Any:
        async def lead() -> None:
            while True:
                acting[name].append(time.monotonic())
                await asyncio.sleep(0.02)
        return lead
    ta = asyncio.create_task(a.run(work("a")))
    await asyncio.sleep(0.05)
    tb = asyncio.create_task(b.run(work("b")))
    await asyncio.sleep(1.0)
    assert a.leading and not b.leading and not acting["b"]  # the standby never acts while the Lease is renewed
    leases.down = True  # nobody can renew or acquire
    down = time.monotonic()
    await asyncio.sleep(0.7)
    assert not a.leading and not b.leading
    stopped = max(acting["a"]) - down
    leases.down = False
    await asyncio.sleep(1.0)
    assert a.leading != b.leading  # one leader again
    for t in (ta, tb):
        t.cancel()
    await asyncio.gather(ta, tb, return_exceptions=True)
    return {"stopped_after": stopped}


def test_leader_stops_acting_by_the_renew_deadline() -> None:
    out = asyncio.run(_scenario())
    # it stops acting before any standby may take the Lease (lease duration 0.6 s after its last renewal)
    assert out["stopped_after"] < 0.6, out


async def _takeover() -> float:
    leases = FakeLeases()
    a, b = elector(leases, "a"), elector(leases, "b")
    assert await a.try_acquire_or_renew()
    t0 = time.monotonic()
    while not await b.try_acquire_or_renew():  # a never renews: b waits the lease duration, from when it saw it
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_standby_takes_over_after_the_lease_duration_of_its_own_clock() -> None:
    took = asyncio.run(_takeover())
    assert 0.6 <= took < 0.9, took
