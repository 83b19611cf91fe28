"""The slot lease (shim/pulls/lease.py) and PullScheduler.release, deterministically.

A pull whose progress the no-progress guard cannot judge (CRI-O, progress off) and that is
still unanswered after pulls.no_progress_timeout_seconds gives back its slot: the next
queued pull starts, the released one goes on and still answers every caller (also callers
that join it afterwards), and it is never cancelled for it. Lease ends are driven by
calling ``expire`` where the order matters; one test lets the real timer fire.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.errors import RpcError
from shim.observability.metrics import Metrics
from shim.pulls.lease import SlotLease
from shim.pulls.scheduler import Flight, PullScheduler
from tests.unit.test_scheduler import Upstream, key, settle

CRIO = "the runtime has no containerd content API (e.g. CRI-O)"


def leased(timeout: float) -> tuple[Upstream, PullScheduler, SlotLease]:
    """A scheduler with a cap of 1 and a lease whose pulls are never judged (as on CRI-O)."""
    up, s = Upstream(), PullScheduler(max_parallel=1)
    lease = SlotLease(s, lambda f: CRIO, timeout=timeout)
    return up, s, lease


def flight_of(s: PullScheduler, image: str) -> Flight:
    (f,) = [f for f in s.holding if f.key.image == image]
    return f


async def test_a_released_pull_gives_its_slot_to_the_next_and_still_answers_its_callers() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    healthy = asyncio.create_task(s.pull(key("healthy"), up.runner("healthy")))
    await settle()
    assert up.calls == ["hung"] and s.queued == 1
    f = flight_of(s, "hung")
    assert s.release(f, CRIO)
    await settle()
    assert up.calls == ["hung", "healthy"]  # the slot went to the next pull
    assert up.cancelled == []  # the released pull goes on
    assert s.in_flight == 2 and [g.key.image for g in s.holding] == ["healthy"]
    rows = {r["image"]: r for r in s.snapshot()["in_flight"]}
    assert "slot_released_seconds" in rows["hung"] and "slot_released_seconds" not in rows["healthy"]
    joiner = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))  # joins the released flight
    await settle()
    assert up.calls == ["hung", "healthy"]
    assert not s.release(f, CRIO)  # released once
    up.release("healthy", b"h")
    up.release("hung", b"late")
    assert (await healthy).response == b"h"
    assert (await hung).response == b"late"
    assert (await joiner).response == b"late" and (await joiner).joined
    assert s.in_flight == 0 and s.snapshot()["in_flight"] == []


async def test_a_released_pull_whose_callers_all_leave_is_cancelled() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    await settle()
    assert s.release(flight_of(s, "hung"), CRIO)
    hung.cancel()
    await settle()
    assert up.cancelled == ["hung"] and s.in_flight == 0


async def test_the_guard_can_still_end_a_released_pull() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    await settle()
    f = flight_of(s, "hung")
    s.release(f, CRIO)
    assert s.fail_running(f, RpcError(grpc.StatusCode.UNAVAILABLE, "made no progress"))
    with pytest.raises(RpcError) as e:
        await hung
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    await settle()
    assert up.cancelled == ["hung"]


async def test_release_refuses_a_queued_or_finished_flight() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    a = asyncio.create_task(s.pull(key("a"), up.runner("a")))
    b = asyncio.create_task(s.pull(key("b"), up.runner("b")))
    await settle()
    f = flight_of(s, "a")
    queued = next(iter(s.flights()[("b", "")]))
    assert not s.release(queued, CRIO)
    up.release("a")
    await a
    assert not s.release(f, CRIO)
    await settle()
    up.release("b")
    await b


async def test_the_lease_releases_only_what_the_guard_cannot_judge() -> None:
    metrics = Metrics()
    up, s = Upstream(), PullScheduler(max_parallel=2, observers=[metrics])
    judged = {"watched": None, "crio": CRIO}
    lease = SlotLease(s, lambda f: judged[f.key.image], timeout=3600)
    events: list[str] = []
    tasks = [asyncio.create_task(s.pull(key(i), up.runner(i), listener=lambda e, a: events.append(e)))
             for i in ("watched", "crio")]
    queued = asyncio.create_task(s.pull(key("next"), up.runner("next")))
    await settle()
    assert sorted(lease.leased()) == sorted(f.seq for f in s.holding)
    watched, crio = flight_of(s, "watched"), flight_of(s, "crio")
    lease.expire(watched)  # the guard judges it: it keeps its slot, looked at again a timeout later
    assert watched.released_at is None and watched.seq in lease.leased()
    lease.expire(crio)
    await settle()
    assert crio.released_at is not None and up.calls == ["watched", "crio", "next"]
    assert events == ["pull slot released"]  # the released pull's caller hears of it (its span)
    assert metrics.registry.get_sample_value("cri_shim_pull_slot_released_total") == 1
    judged["watched"] = "progress became unknown"
    lease.expire(watched)
    assert watched.released_at is not None
    for i in ("watched", "crio", "next"):
        up.release(i)
    await asyncio.gather(*tasks, queued)
    assert lease.leased() == [] and up.cancelled == []


async def test_the_lease_timer_fires_and_finished_pulls_leave_no_timer() -> None:
    up, s, lease = leased(timeout=0.05)
    quick = asyncio.create_task(s.pull(key("quick"), up.runner("quick")))
    await settle()
    up.release("quick")
    await quick
    assert lease.leased() == []
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    healthy = asyncio.create_task(s.pull(key("healthy"), up.runner("healthy")))
    for _ in range(100):
        if "healthy" in up.calls:
            break
        await asyncio.sleep(0.01)
    assert up.calls == ["quick", "hung", "healthy"]
    up.release("healthy")
    up.release("hung")
    await asyncio.gather(hung, healthy)


async def test_without_a_cap_nothing_is_released() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=0)
    lease = SlotLease(s, lambda f: CRIO, timeout=3600)
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    await settle()
    f = flight_of(s, "hung")
    lease.expire(f)  # no slot to give back: no release, no log; looked at again (a reload may set a cap)
    assert f.released_at is None and f.seq in lease.leased()
    s.configure(max_parallel=1, background_max_parallel=1, dedup=True)
    lease.expire(f)
    assert f.released_at is not None
    up.release("hung")
    await hung


async def test_timeout_zero_turns_the_lease_off_and_back_on() -> None:
    up, s, lease = leased(timeout=0)
    hung = asyncio.create_task(s.pull(key("hung"), up.runner("hung")))
    await settle()
    assert lease.leased() == []
    f = flight_of(s, "hung")
    lease.expire(f)  # off: nothing is released
    assert f.released_at is None
    lease.configure(3600)  # on at reload: running pulls get their lease from now
    assert lease.leased() == [f.seq]
    lease.configure(0)
    assert lease.leased() == []
    up.release("hung")
    await hung


async def test_on_a_runtime_without_the_content_api_a_hung_pull_gives_its_slot_to_the_next(
        runtime, short_tmp) -> None:
    """The whole shim in front of a runtime with no content API (as CRI-O): the hung pull's slot
    goes to the queued one after the timeout, `cri-shim status` says so, both callers get answers."""
    from shim.proto.runtime.v1 import api_pb2
    from tests.support.inproc import running_shim
    from tests.unit.test_status import PULL, pull_request, status

    gate = asyncio.Event()

    async def pull(request: bytes, context) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        if "hung" in image:
            await gate.wait()
        return api_pb2.PullImageResponse(image_ref="sha256:" + "3" * 64).SerializeToString()

    async def unimplemented(request: bytes, context) -> bytes:  # as CRI-O answers containerd's API
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown service containerd.services.content.v1.Content")
        return b""

    runtime.unary[PULL] = pull
    for method in ("ListStatuses", "List", "Read", "Abort"):
        runtime.unary[f"/containerd.services.content.v1.Content/{method}"] = unimplemented
    admin = str(short_tmp / "admin.sock")
    settings = {"pulls": {"max_parallel": 1, "progress_interval_seconds": 0.1, "no_progress_timeout_seconds": 0.3},
                "server": {"admin_socket": admin}}
    async with running_shim(runtime.endpoint, settings) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            hung = asyncio.ensure_future(ch.unary_unary(PULL)(pull_request("hung:1"), timeout=30))
            while not runtime.calls("PullImage"):
                await asyncio.sleep(0.01)
            healthy = await asyncio.wait_for(ch.unary_unary(PULL)(pull_request("web:1"), timeout=30), 10)
            assert api_pb2.PullImageResponse.FromString(healthy).image_ref
            assert not hung.done()  # released, not ended
            code, text = await status(admin, as_json=False)
            assert code == 0
            assert "1 running (1 without a slot), 0 queued" in text, text
            assert "hung:1" in text and "(progress not judged)" in text, text
            gate.set()
            assert api_pb2.PullImageResponse.FromString(await hung).image_ref
    value = shim.app.metrics.registry.get_sample_value("cri_shim_pull_slot_released_total")
    assert value == 1
