"""The join rule of collapsed pulls, one test per combination (see shim/pulls/scheduler.py).

fg = a CRI client's pull (kubelet), bg = image-set prefetch. Flights are scripted
(tests.unit.test_scheduler.Upstream): each upstream call waits for the test to release
it, so every assertion is about a state the test put the scheduler in, not about timing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.errors import RpcError
from shim.pulls.scheduler import Priority, PullKey, PullScheduler
from tests.unit.test_scheduler import Upstream, settle

FG, BG = Priority.FOREGROUND, Priority.BACKGROUND
IMAGE = "docker.io/library/nginx:latest"


def key(auth: str = "", *, handler: str = "", namespace: str = "") -> PullKey:
    return PullKey(image=IMAGE, handler=handler, auth=auth, namespace=namespace)


def start(s: PullScheduler, up: Upstream, k: PullKey, priority: Priority, name: str) -> asyncio.Task:
    return asyncio.create_task(s.pull(k, up.runner(name), priority=priority))


async def test_fg_joins_fg_with_the_same_credentials() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    a, b = start(s, up, key("h1"), FG, "first"), start(s, up, key("h1"), FG, "second")
    await settle()
    up.release("first", b"id")
    oa, ob = await asyncio.gather(a, b)
    assert up.calls == ["first"] and (oa.joined, ob.joined) == (False, True) and ob.response == b"id"


async def test_fg_never_joins_fg_with_other_credentials() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    a, b = start(s, up, key("h1"), FG, "first"), start(s, up, key("h2"), FG, "second")
    await settle()
    assert up.calls == ["first", "second"]
    up.release("first", b"1")
    up.release("second", b"2")
    assert [o.response for o in await asyncio.gather(a, b)] == [b"1", b"2"]


async def test_bg_joins_a_running_fg_pull_whatever_its_credentials() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    kubelet = start(s, up, key("pull-secret-hash"), FG, "kubelet")
    await settle()
    prefetch = start(s, up, key(""), BG, "prefetch")
    await settle()
    assert up.calls == ["kubelet"]
    up.release("kubelet", b"id")
    ok, ob = await asyncio.gather(kubelet, prefetch)
    assert ob.joined and ob.response == b"id" and not ok.joined


async def test_fg_joins_a_running_bg_pull_only_with_the_same_credentials() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    prefetch = start(s, up, key("node-creds"), BG, "prefetch")
    await settle()
    same = start(s, up, key("node-creds"), FG, "same")
    other = start(s, up, key("pod-secret"), FG, "other")
    anonymous = start(s, up, key(""), FG, "anonymous")
    await settle()
    assert up.calls == ["prefetch", "other", "anonymous"]  # only `same` shared the prefetch
    up.release("prefetch", b"p")
    up.release("other", b"o")
    up.release("anonymous", b"a")
    op, osame, oo, oa = await asyncio.gather(prefetch, same, other, anonymous)
    assert osame.joined and osame.response == b"p"
    assert not oo.joined and oo.response == b"o" and not oa.joined and oa.response == b"a"


async def test_bg_joins_bg() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4, background_max_parallel=2)
    a, b = start(s, up, key("x"), BG, "first"), start(s, up, key("y"), BG, "second")
    await settle()
    assert up.calls == ["first"]
    up.release("first", b"id")
    assert [o.joined for o in await asyncio.gather(a, b)] == [False, True]


async def test_bg_prefers_the_flight_with_its_own_credentials() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4, background_max_parallel=2)
    pod = start(s, up, key("pod"), FG, "pod")
    _node = start(s, up, key("node"), FG, "node")
    await settle()
    prefetch = start(s, up, key("node"), BG, "prefetch")
    await settle()
    up.release("pod", b"pod")
    await pod
    await settle()
    assert not prefetch.done()  # it waits for the flight with its own key
    up.release("node", b"node")
    assert (await prefetch).response == b"node" and up.calls == ["pod", "node"]


async def test_other_handler_or_image_is_never_joined() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4, background_max_parallel=2)
    a = start(s, up, key(handler="kata"), FG, "kata")
    b = start(s, up, key(), BG, "default")
    c = start(s, up, PullKey(image="docker.io/library/nginx:1.27"), BG, "other-tag")
    await settle()
    assert up.calls == ["kata", "default", "other-tag"]
    for n in ("kata", "default", "other-tag"):
        up.release(n)
    assert not any(o.joined for o in await asyncio.gather(a, b, c))


async def test_namespace_splits_fg_pulls_but_not_bg() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    a = start(s, up, key(namespace="team-a"), FG, "a")
    b = start(s, up, key(namespace="team-b"), FG, "b")
    await settle()
    bg = start(s, up, key(), BG, "bg")
    await settle()
    assert up.calls == ["a", "b"]
    up.release("a")
    up.release("b")
    assert (await bg).joined
    await asyncio.gather(a, b)


async def test_fg_leaving_a_mixed_flight_does_not_cancel_it_for_the_bg_waiter() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    kubelet = start(s, up, key("secret"), FG, "kubelet")
    await settle()
    prefetch = start(s, up, key(), BG, "prefetch")
    await settle()
    kubelet.cancel()
    await settle()
    assert up.cancelled == [] and s.in_flight == 1
    up.release("kubelet", b"id")
    assert (await prefetch).response == b"id"
    with pytest.raises(asyncio.CancelledError):
        await kubelet


async def test_bg_leaving_a_mixed_flight_does_not_cancel_it_for_the_fg_waiter() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    prefetch = start(s, up, key("node"), BG, "prefetch")
    await settle()
    kubelet = start(s, up, key("node"), FG, "kubelet")
    await settle()
    prefetch.cancel()  # the image was dropped from its set
    await settle()
    assert up.cancelled == []
    up.release("prefetch", b"id")
    assert (await kubelet).joined


async def test_last_waiter_leaving_a_mixed_flight_cancels_it() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    kubelet = start(s, up, key("secret"), FG, "kubelet")
    await settle()
    prefetch = start(s, up, key(), BG, "prefetch")
    await settle()
    kubelet.cancel()
    prefetch.cancel()
    await settle()
    assert up.cancelled == ["kubelet"] and s.in_flight == 0
    await asyncio.gather(kubelet, prefetch, return_exceptions=True)


async def test_runtime_error_fans_out_to_fg_and_bg_waiters() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    kubelet = start(s, up, key("secret"), FG, "kubelet")
    await settle()
    prefetch = start(s, up, key(), BG, "prefetch")
    await settle()
    up.release("kubelet", RpcError(grpc.StatusCode.NOT_FOUND, "manifest unknown", from_upstream=True))
    for t in (kubelet, prefetch):
        with pytest.raises(RpcError) as e:
            await t
        assert e.value.code is grpc.StatusCode.NOT_FOUND and e.value.details == "manifest unknown"
    assert up.calls == ["kubelet"]


async def test_fg_joining_a_queued_bg_flight_lifts_it_ahead_of_other_bg() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=2, background_max_parallel=1)
    busy = [start(s, up, PullKey(image=i), FG, i) for i in ("busy1", "busy2")]
    other = start(s, up, PullKey(image="other"), BG, "other")
    prefetch = start(s, up, key("node"), BG, "prefetch")
    await settle()
    kubelet = start(s, up, key("node"), FG, "kubelet")
    await settle()
    up.release("busy1")
    await settle()
    assert up.calls == ["busy1", "busy2", "prefetch"]  # lifted ahead of `other`
    up.release("prefetch", b"id")
    await settle()
    up.release("busy2")
    up.release("other")
    assert (await kubelet).joined
    await asyncio.gather(*busy, other, prefetch)
