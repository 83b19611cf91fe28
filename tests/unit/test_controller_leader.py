"""shim/controller/leader.py against an in-memory Lease (tests/support/fake_lease.py's FakeLock): one winner, a standby waits for the
lease duration of unchanged record, a leader that cannot renew stops acting by the deadline; with
the Lease watched, a standby tries at the instant the record it saw expires (a fake clock), so a
killed leader is replaced within the lease duration of its last renewal."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shim.controller.leader import LeaderElector
from tests.support.fake_lease import FakeLock


def elector(leases: FakeLock, identity: str, *, watch: bool = False, **timings: float) -> LeaderElector:
    t = {"lease_duration": 0.6, "renew_deadline": 0.4, "retry_period": 0.1, **timings}
    e = LeaderElector(leases, identity=identity, **t)
    if watch:
        leases.watchers.append(e)
    return e


async def _scenario() -> dict[str, float]:
    leases = FakeLock()
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
    leases = FakeLock()
    a, b = elector(leases, "a"), elector(leases, "b")
    assert await a.try_acquire_or_renew()
    t0 = time.monotonic()
    while not await b.try_acquire_or_renew():  # a never renews: b waits the lease duration, from when it saw it
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_standby_takes_over_after_the_lease_duration_of_its_own_clock() -> None:
    took = asyncio.run(_takeover())
    assert 0.6 <= took < 0.9, took


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watched(holder: str, rv: str, duration: float = 15.0) -> dict[str, Any]:
    return {"metadata": {"name": "l", "resourceVersion": rv},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration}}


async def test_standby_schedules_its_try_at_the_instant_the_observed_record_expires() -> None:
    clock = Clock()
    e = LeaderElector(FakeLock(), identity="b", clock=clock)
    assert e.next_try(next_poll=102.0) == 102.0  # nothing observed yet: the poll
    e.lease_event("MODIFIED", None, _watched("a", "7"))  # a renewal, seen on the watch at 100
    assert e.holder == "a"
    assert e.next_try(next_poll=102.0) == 102.0  # the poll comes first
    clock.t = 114.0
    assert e.next_try(next_poll=116.0) == 115.0  # expiry before the next poll: tried at 115, not 116
    clock.t = 114.5
    e.lease_event("MODIFIED", None, _watched("a", "7"))  # the same record again (a re-delivery): no change
    assert e.next_try(next_poll=116.0) == 115.0
    e.lease_event("MODIFIED", None, _watched("a", "8"))  # renewed at 114.5: the lease runs from there
    assert e.next_try(next_poll=116.0) == 116.0
    clock.t = 129.0
    assert e.next_try(next_poll=130.9) == 129.5
    clock.t = 129.6

    async def lost() -> bool:
        return False
    e.try_acquire_or_renew = lost  # type: ignore[method-assign]
    assert not await e.try_once()  # tried after that expiry and lost (a write raced it): wait for the poll, no spin
    assert e.next_try(next_poll=131.0) == 131.0
    clock.t = 129.8
    e.lease_event("MODIFIED", None, _watched("", "9", 1))  # released: at once, whatever the poll
    assert e.next_try(next_poll=131.0) == 129.8
    e.lease_event("DELETED", _watched("", "9", 1), None)  # gone: the poll creates it
    assert e.next_try(next_poll=131.0) == 131.0


async def _killed_leader(watch: bool) -> dict[str, float]:
    """a leads, b stands by (lease 1 s, retry 0.4 s); a is killed (its task cancelled: no release)."""
    leases = FakeLock()
    timings = {"lease_duration": 1.0, "renew_deadline": 0.8, "retry_period": 0.4}
    a = elector(leases, "a", watch=watch, **timings)
    b = elector(leases, "b", watch=watch, **timings)
    took: list[float] = []

    async def idle() -> None:
        await asyncio.Event().wait()

    async def b_lead() -> None:
        took.append(time.monotonic())
        await idle()
    ta = asyncio.create_task(a.run(idle))
    await asyncio.sleep(0.05)
    tb = asyncio.create_task(b.run(b_lead))
    await asyncio.sleep(1.3)
    assert a.leading and not took
    # kill a right after a renewal: the worst case for polling, the standby's last look is the oldest
    n = len(leases.writes)
    while len(leases.writes) == n:
        await asyncio.sleep(0.005)
    ta.cancel()
    killed = time.monotonic()
    last_renewal = leases.writes[-1][1]
    while not took:
        await asyncio.sleep(0.01)
    tb.cancel()
    await asyncio.gather(ta, tb, return_exceptions=True)
    acquired = next(t for h, t in leases.writes if h == "b")
    return {"after_kill": took[0] - killed, "after_last_renewal": acquired - last_renewal}


def test_watching_standby_takes_over_within_the_lease_duration_of_a_kill() -> None:
    out = asyncio.run(_killed_leader(watch=True))
    # never before the lease duration since the last renewal it saw (on its own clock) ...
    assert out["after_last_renewal"] >= 1.0, out
    # ... and at that instant, not at its next poll (up to 0.48 s later): a margin for the loop's wake-ups
    assert out["after_kill"] < 1.0 + 0.15, out


async def _released() -> dict[str, Any]:
    """a leads, b stands by watching; a is stopped cleanly (its work cancelled, then release())."""
    leases = FakeLock()
    timings = {"lease_duration": 1.0, "renew_deadline": 0.8, "retry_period": 0.4}
    a = elector(leases, "a", watch=True, **timings)
    b = elector(leases, "b", watch=True, **timings)
    took: list[float] = []

    async def idle() -> None:
        await asyncio.Event().wait()

    async def b_lead() -> None:
        took.append(time.monotonic())
        await idle()
    ta = asyncio.create_task(a.run(idle))
    await asyncio.sleep(0.05)
    tb = asyncio.create_task(b.run(b_lead))
    await asyncio.sleep(0.6)
    assert a.leading and not took
    ta.cancel()
    await asyncio.gather(ta, return_exceptions=True)
    stopped = time.monotonic()
    await a.release()
    released = leases.writes[-1]
    while not took:
        await asyncio.sleep(0.01)
    tb.cancel()
    await asyncio.gather(tb, return_exceptions=True)
    await a.release()  # not its Lease any more: nothing written
    assert leases.record is not None and leases.record.holder == "b"
    return {"released_holder": released[0], "after_stop": took[0] - stopped}


def test_a_released_lease_is_taken_at_once_by_a_watching_standby() -> None:
    out = asyncio.run(_released())
    assert out["released_holder"] == ""  # the release writes an empty holder
    assert out["after_stop"] < 0.3, out  # at once, not after the lease duration (1 s) or a poll (0.4 s)
