"""Deterministic tests of the pull scheduler's concurrency edges.

Upstream pulls are scripted: each runner waits on an event the test controls, so
nothing depends on timing except the explicit deadlines (which are short and only
ever expected to fire while the upstream is held back).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.cri.deadline import Deadline
from shim.errors import RpcError
from shim.pulls.scheduler import Priority, PullKey, PullScheduler


class Upstream:
    """A scripted runtime: records every pull it was asked for; each waits for release."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.active = 0
        self.max_active = 0
        self.cancelled: list[str] = []
        self._gates: dict[str, asyncio.Future[bytes]] = {}

    def runner(self, image: str):
        async def run() -> bytes:
            self.calls.append(image)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            gate = self._gates.setdefault(image, asyncio.get_running_loop().create_future())
            try:
                return await gate
            except asyncio.CancelledError:
                self.cancelled.append(image)
                raise
            finally:
                self.active -= 1
        return run

    def release(self, image: str, result: bytes | Exception = b"ok") -> None:
        gate = self._gates.setdefault(image, asyncio.get_running_loop().create_future())
        if isinstance(result, Exception):
            gate.set_exception(result)
        else:
            gate.set_result(result)
        del self._gates[image]


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def key(image: str, auth: str = "") -> PullKey:
    return PullKey(image=image, auth=auth)


async def test_identical_pulls_share_one_upstream_call() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=2)
    callers = [asyncio.create_task(s.pull(key("a"), up.runner("a"))) for _ in range(12)]
    await settle()
    up.release("a", b"sha256:aaa")
    outcomes = await asyncio.gather(*callers)
    assert up.calls == ["a"]
    assert all(o.response == b"sha256:aaa" for o in outcomes)
    assert sum(not o.joined for o in outcomes) == 1


async def test_different_credentials_never_share() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=0)
    t1 = asyncio.create_task(s.pull(key("a", auth="h1"), up.runner("a")))
    t2 = asyncio.create_task(s.pull(key("a", auth="h2"), up.runner("a2")))
    await settle()
    assert up.calls == ["a", "a2"]
    up.release("a")
    up.release("a2")
    await asyncio.gather(t1, t2)


async def test_finished_pull_is_not_cached() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    t = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    up.release("a")
    await t
    t = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    up.release("a")
    await t
    assert up.calls == ["a", "a"]


async def test_cap_holds_and_queue_is_fifo() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=2)
    tasks = [asyncio.create_task(s.pull(key(i), up.runner(i))) for i in "abcde"]
    await settle()
    assert up.calls == ["a", "b"] and s.queued == 3
    up.release("b")
    await settle()
    assert up.calls == ["a", "b", "c"]
    for i in "acde":
        up.release(i)
        await settle()
    await asyncio.gather(*tasks)
    assert up.calls == list("abcde") and up.max_active == 2
    assert s.queued == 0 and s.in_flight == 0


async def test_age_alone_orders_a_class_however_many_wait() -> None:
    """docs/pulls.md, which queued pull starts next: the oldest, not the one most pods wait for."""
    up, s = Upstream(), PullScheduler(max_parallel=1)
    tasks = [asyncio.create_task(s.pull(key(i), up.runner(i))) for i in ("running", "big", "small")]
    await settle()
    tasks += [asyncio.create_task(s.pull(key("small"), up.runner("small"))) for _ in range(5)]
    await settle()
    assert [row["waiters"] for row in s.snapshot()["queued"]] == [1, 6]
    for image in ("running", "big", "small"):
        up.release(image)
        await settle()
    await asyncio.gather(*tasks)
    assert up.calls == ["running", "big", "small"]


async def test_cancel_of_first_waiter_leaves_others_unaffected() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    first = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    second = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    first.cancel()
    await settle()
    assert up.cancelled == []  # the shared pull goes on for the second caller
    up.release("a", b"done")
    assert (await second).response == b"done"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert up.calls == ["a"]


async def test_all_waiters_cancelled_cancels_upstream_and_frees_slot() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    waiters = [asyncio.create_task(s.pull(key("a"), up.runner("a"))) for _ in range(3)]
    queued = asyncio.create_task(s.pull(key("b"), up.runner("b")))
    await settle()
    assert up.calls == ["a"]
    for w in waiters:
        w.cancel()
    await settle()
    assert up.cancelled == ["a"]
    assert up.calls == ["a", "b"]  # the slot went to the next in line
    up.release("b")
    await queued
    assert s.in_flight == 0


async def test_upstream_error_fans_out_to_every_waiter() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    waiters = [asyncio.create_task(s.pull(key("a"), up.runner("a"))) for _ in range(4)]
    await settle()
    err = RpcError(grpc.StatusCode.NOT_FOUND, "manifest unknown", (("k", "v"),), from_upstream=True)
    up.release("a", err)
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(r is err for r in results)
    assert s.in_flight == 0 and s.queued == 0


async def test_deadline_shorter_than_queue_wait_takes_no_slot() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    blocker = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    with pytest.raises(RpcError) as e:
        await s.pull(key("b"), up.runner("b"), deadline=Deadline.after(0.01))
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "waiting for a pull slot" in e.value.details
    assert s.queued == 0
    up.release("a")
    await blocker
    await settle()
    assert up.calls == ["a"]  # b never reached the runtime


async def test_each_waiter_keeps_its_own_deadline() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    patient = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await settle()
    with pytest.raises(RpcError) as e:
        await s.pull(key("a"), up.runner("a"), deadline=Deadline.after(0.01))
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert up.cancelled == []
    up.release("a", b"x")
    assert (await patient).response == b"x"


async def test_foreground_goes_before_background_and_lifts_a_queued_one() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=2, background_max_parallel=1)
    busy = [asyncio.create_task(s.pull(key(i), up.runner(i))) for i in ("busy1", "busy2")]
    bg = [asyncio.create_task(s.pull(key(i), up.runner(i), priority=Priority.BACKGROUND)) for i in ("b1", "b2", "b3")]
    await settle()
    fg = asyncio.create_task(s.pull(key("f"), up.runner("f")))
    lifted = asyncio.create_task(s.pull(key("b3"), up.runner("b3")))  # kubelet wants b3 now
    await settle()
    for image in ("busy1", "busy2", "f", "b3", "b1", "b2"):
        up.release(image)
        await settle()
    await asyncio.gather(*busy, fg, lifted, *bg)
    assert up.calls == ["busy1", "busy2", "f", "b3", "b1", "b2"]


async def test_background_never_takes_the_last_slot() -> None:
    """However many prefetches queue and whatever image_sets.max_parallel says, one slot under
    the cap stays foreground's: a kubelet pull starts at once while no other foreground pull runs."""
    for cap, bg_cap in ((1, 1), (2, 2), (2, 5), (4, 3)):
        up, s = Upstream(), PullScheduler(max_parallel=cap, background_max_parallel=bg_cap)
        bg = [asyncio.create_task(s.pull(key(f"b{i}"), up.runner(f"b{i}"), priority=Priority.BACKGROUND))
              for i in range(6)]
        await settle()
        assert len(up.calls) == min(bg_cap, cap - 1) == s.background_slots, (cap, bg_cap)
        kubelet = asyncio.create_task(s.pull(key("kubelet"), up.runner("kubelet")))
        await settle()
        assert up.calls[-1] == "kubelet", (cap, bg_cap)  # started at once, not behind prefetch
        up.release("kubelet")
        assert not (await kubelet).joined
        s.close()
        for i in range(6):
            up.release(f"b{i}")
        await asyncio.gather(*bg, return_exceptions=True)


async def test_background_sub_cap() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=3, background_max_parallel=1)
    bg = [asyncio.create_task(s.pull(key(i), up.runner(i), priority=Priority.BACKGROUND)) for i in ("b1", "b2")]
    fg = asyncio.create_task(s.pull(key("f"), up.runner("f")))
    await settle()
    assert sorted(up.calls) == ["b1", "f"]
    for i in ("b1", "f", "b2"):
        up.release(i)
        await settle()
    await asyncio.gather(fg, *bg)


async def test_close_fails_queued_with_unavailable_and_refuses_new() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    running = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    queued = asyncio.create_task(s.pull(key("b"), up.runner("b")))
    await settle()
    s.close()
    with pytest.raises(RpcError) as e:
        await queued
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(RpcError):
        await s.pull(key("c"), up.runner("c"))
    up.release("a")
    await running  # in-flight pulls may still finish


async def test_raising_the_cap_on_reload_starts_queued_pulls() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    tasks = [asyncio.create_task(s.pull(key(i), up.runner(i))) for i in "abc"]
    await settle()
    assert up.calls == ["a"]
    s.configure(max_parallel=3, background_max_parallel=1, dedup=True)
    await settle()
    assert up.calls == ["a", "b", "c"]
    for i in "abc":
        up.release(i)
    await asyncio.gather(*tasks)


async def test_waiter_gone_before_the_pull_task_ever_ran_frees_the_slot() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    t = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    await asyncio.sleep(0)  # the flight is dispatched; its task has not taken a step yet
    t.cancel()
    await settle()
    assert s.in_flight == 0 and up.cancelled == up.calls  # nothing left running upstream
    up.calls.clear()
    t2 = asyncio.create_task(s.pull(key("b"), up.runner("b")))
    await settle()
    assert up.calls == ["b"]
    up.release("b")
    await t2


def test_config_refuses_prefetch_lanes_at_the_pull_cap() -> None:
    """With image sets on, image_sets.max_parallel must leave kubelet a slot: refused naming the key."""
    from shim.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"pulls": {"max_parallel": 2}, "image_sets": {"dir": "/etc/cri-shim/sets", "max_parallel": 2}})
    assert e.value.key == "image_sets.max_parallel" and "below pulls.max_parallel (2)" in str(e.value)
    from_dict({"pulls": {"max_parallel": 3}, "image_sets": {"dir": "/etc/cri-shim/sets", "max_parallel": 2}})
    from_dict({"pulls": {"max_parallel": 0}, "image_sets": {"dir": "/etc/cri-shim/sets", "max_parallel": 8}})
    from_dict({"pulls": {"max_parallel": 1}})  # image sets off: no prefetch to make room for
