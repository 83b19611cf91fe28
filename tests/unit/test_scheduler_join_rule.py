"""The join rule of collapsed pulls, one test per combination (see shim/pulls/scheduler.py).

fg = a trusted CRI client's pull (kubelet), u = an untrusted CRI client's (another uid), bg =
image-set prefetch. Flights are scripted
(tests.unit.test_scheduler.Upstream): each upstream call waits for the test to release
it, so every assertion is about a state the test put the scheduler in, not about timing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.errors import RpcError
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.key import pull_key
from shim.pulls.scheduler import Priority, PullKey, PullScheduler
from tests.unit.test_scheduler import Upstream, settle

FG, BG, U = Priority.FOREGROUND, Priority.BACKGROUND, Priority.UNTRUSTED
IMAGE = "docker.io/library/nginx:latest"


def key(auth: str = "", *, handler: str = "", namespace: str = "") -> PullKey:
    return PullKey(image=IMAGE, handler=handler, auth=auth, namespace=namespace)


def spelled(image: str) -> PullKey:
    """The key of a PullImage of ``image`` as a client spelled it (no credentials, no handler)."""
    return pull_key(api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)), "")


def start(s: PullScheduler, up: Upstream, k: PullKey, priority: Priority, name: str,
          uid: int | None = None) -> asyncio.Task:
    return asyncio.create_task(s.pull(k, up.runner(name), priority=priority, uid=uid))


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


@pytest.mark.parametrize(("first", "second"), [
    ("LOCALHOST:5000/app:v1", "localhost:5000/app:v1"),  # containerd: certs.d and localhost are case-sensitive
    ("Docker.io/library/nginx", "nginx"),
    ("docker.io/library/nginx:latest", "nginx:latest"),  # CRI-O resolves a short name through its registries
    ("reg.example/app:v1", "reg.example/app:v1@sha256:" + "a" * 64),
])
async def test_fg_never_joins_a_pull_spelled_otherwise(first: str, second: str) -> None:
    """One image (the same normal form), two requests: each goes upstream as its client spelled it."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    assert spelled(first).image == spelled(second).image or "@" in second
    a, b = start(s, up, spelled(first), FG, first), start(s, up, spelled(second), FG, second)
    await settle()
    assert up.calls == [first, second]
    up.release(first, first.encode())
    up.release(second, second.encode())
    oa, ob = await asyncio.gather(a, b)
    assert (oa.response, ob.response) == (first.encode(), second.encode()) and not ob.joined


async def test_fg_joins_a_pull_that_differs_only_by_the_implied_latest_tag() -> None:
    """kubelet, containerd and CRI-O all read ``app`` as ``app:latest``: one request."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    a, b = start(s, up, spelled("reg.example/app"), FG, "a"), start(s, up, spelled("reg.example/app:latest"), FG, "b")
    await settle()
    up.release("a", b"id")
    assert up.calls == ["a"] and (await b).joined and (await a).response == b"id"


@pytest.mark.parametrize("running", [True, False])
async def test_fg_never_joins_an_untrusted_pull(running: bool) -> None:
    """Same key, sent by another uid: root starts its own, which starts at once and is answered
    with its own request's result, however the untrusted one goes."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    blocker = None if running else start(s, up, PullKey(image="busy"), U, "busy", uid=1000)
    await settle()
    theirs = start(s, up, key(), U, "theirs", uid=1000)  # queued behind its own busy pull, or running
    await settle()
    assert ("theirs" in up.calls) is running
    root = start(s, up, key(), FG, "root")
    await settle()
    assert up.calls[-1] == "root"
    up.release("root", b"root's")
    out = await root
    assert out.response == b"root's" and not out.joined
    assert not theirs.done()
    theirs.cancel()
    if blocker is not None:
        blocker.cancel()
    await asyncio.gather(theirs, *([blocker] if blocker else []), return_exceptions=True)


async def test_u_joins_fg_with_the_same_key_but_not_spelled_otherwise() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    root = start(s, up, spelled("localhost:5000/app:v1"), FG, "root")
    await settle()
    same = start(s, up, spelled("localhost:5000/app:v1"), U, "same", uid=1000)
    other = start(s, up, spelled("LOCALHOST:5000/app:v1"), U, "other", uid=1001)
    await settle()
    assert up.calls == ["root", "other"]
    up.release("root", b"r")
    up.release("other", b"o")
    assert (await same).joined and (await same).response == b"r" and (await other).response == b"o"
    await root


async def test_u_joins_u_of_another_uid() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    a, b = start(s, up, key(), U, "a", uid=1000), start(s, up, key(), U, "b", uid=1001)
    await settle()
    up.release("a", b"id")
    assert up.calls == ["a"] and (await b).joined
    await a


async def test_u_never_joins_bg() -> None:
    """A prefetch's flight carries no untrusted waiter: none could keep it running (or queued
    in its lane) once prefetch leaves."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    prefetch = start(s, up, key(), BG, "prefetch")
    await settle()
    theirs = start(s, up, key(), U, "theirs", uid=1000)
    await settle()
    assert up.calls == ["prefetch", "theirs"]
    up.release("prefetch")
    up.release("theirs")
    assert not (await theirs).joined
    await prefetch


@pytest.mark.parametrize("running", [True, False])
async def test_bg_never_joins_an_untrusted_pull(running: bool) -> None:
    """Whatever its key: prefetch starts its own pull, in its own lane, at once."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    blocker = None if running else start(s, up, PullKey(image="busy"), U, "busy", uid=1000)
    await settle()
    theirs = start(s, up, key(), U, "theirs", uid=1000)
    await settle()
    prefetch = start(s, up, key(), BG, "prefetch")
    await settle()
    assert up.calls[-1] == "prefetch"
    up.release("prefetch", b"p")
    assert not (await prefetch).joined
    theirs.cancel()
    if blocker is not None:
        blocker.cancel()
    await asyncio.gather(theirs, *([blocker] if blocker else []), return_exceptions=True)


@pytest.mark.parametrize(("pods", "declared", "joins"), [
    ("reg.example/app", "reg.example/app:latest", True),  # one request
    ("nginx:latest", "docker.io/library/nginx:latest", False),  # CRI-O: nginx is whatever its search registries give
    ("LOCALHOST:5000/app:v1", "localhost:5000/app:v1", False),
])
async def test_bg_joins_a_fg_pull_only_spelled_as_its_own(pods: str, declared: str, joins: bool) -> None:
    """What the runtime pulls for a joined prefetch is the pod's request: it joins only when
    that is the image it declared."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    kubelet = start(s, up, spelled(pods), FG, "kubelet")
    await settle()
    prefetch = start(s, up, spelled(declared), BG, "prefetch")
    await settle()
    assert up.calls == (["kubelet"] if joins else ["kubelet", "prefetch"])
    up.release("kubelet", b"id")
    if not joins:
        up.release("prefetch", b"own")
    assert (await prefetch).joined is joins
    await kubelet
