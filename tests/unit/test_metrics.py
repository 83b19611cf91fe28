"""/metrics after a pull storm: the figures match what the runtime and the callers saw."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.support.prom import free_port, scrape
from tests.support.wait import wait_for

PULL = "/runtime.v1.ImageService/PullImage"
HOLD = 0.3  # seconds the runtime keeps the first pulls busy


def pull_request(image: str) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


class GatedPulls:
    """Runtime PullImage that answers an image only when its gate opens."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, image: str) -> asyncio.Event:
        return self.gates.setdefault(image, asyncio.Event())

    async def __call__(self, request: bytes, context) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        await self.gate(image).wait()
        if image.startswith("missing"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{image}: not found")
        return api_pb2.PullImageResponse(image_ref="sha256:" + "2" * 64).SerializeToString()


async def test_metrics_after_a_storm(engine: str, runtime: FakeRuntime) -> None:
    pulls = GatedPulls()
    runtime.unary[PULL] = pulls
    address = f"127.0.0.1:{free_port()}"
    settings = {"pulls": {"max_parallel": 2}, "metrics": {"address": address}}
    async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            # 12 pods want the same image; then 3 other images arrive.
            storm = [asyncio.ensure_future(pull(pull_request("storm:1"), timeout=20)) for _ in range(12)]

            async def arrived(n: int) -> bool:
                return (await scrape(address)).value("cri_shim_pull_requests_total", priority="foreground") == n
            await wait_for(lambda: arrived(12))
            others = [asyncio.ensure_future(pull(pull_request(f"other:{i}"), timeout=20)) for i in range(3)]
            await wait_for(lambda: arrived(15))

            during = await scrape(address)
            assert during.value("cri_shim_pulls_in_flight") == 2  # storm:1 and one other
            assert during.value("cri_shim_pull_queue_length") == 2  # the two remaining others
            assert during.value("cri_shim_pull_dedup_joins_total") == 11

            await asyncio.sleep(HOLD)
            pulls.gate("storm:1").set()
            pulls.gate("other:0").set()
            await asyncio.gather(*storm)
            pulls.gate("other:1").set()
            pulls.gate("other:2").set()
            await asyncio.gather(*others)

        after = await scrape(address)
    assert len(runtime.calls("PullImage")) == 4
    assert after.value("cri_shim_pulls_total", result="success") == 4
    assert after.value("cri_shim_pulls_total", result="error") == 0
    assert after.value("cri_shim_pull_requests_total", priority="foreground") == 15
    assert after.value("cri_shim_pull_dedup_joins_total") == 11
    assert after.value("cri_shim_pulls_in_flight") == 0
    assert after.value("cri_shim_pull_queue_length") == 0
    # Four upstream pulls: two went at once, two waited for a slot at least HOLD seconds.
    wait = "cri_shim_pull_queue_wait_seconds"
    assert after.value(f"{wait}_count", priority="foreground") == 4
    assert after.bucket(wait, "0.05", priority="foreground") == 2
    assert after.bucket(wait, "0.25", priority="foreground") == 2
    assert after.value(f"{wait}_sum", priority="foreground") >= 2 * HOLD
    # Every call through the shim was timed, the storm's ones at least as long as the hold.
    rpc = "cri_shim_rpc_duration_seconds"
    assert after.value(f"{rpc}_count", method="PullImage", code="OK") == 15
    assert after.bucket(rpc, "0.25", method="PullImage", code="OK") == 0
    assert after.value("cri_shim_upstream_errors_total", method="PullImage", code="NOT_FOUND") == 0


async def test_upstream_error_counts_once_per_runtime_call(engine: str, runtime: FakeRuntime) -> None:
    pulls = GatedPulls()
    runtime.unary[PULL] = pulls
    address = f"127.0.0.1:{free_port()}"
    async with running_shim(runtime.endpoint, {"metrics": {"address": address}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            calls = [asyncio.ensure_future(ch.unary_unary(PULL)(pull_request("missing:1"), timeout=10))
                     for _ in range(5)]

            async def all_waiting() -> bool:
                flights = shim.app.scheduler.snapshot()["in_flight"]
                return bool(flights) and flights[0]["waiters"] == 5
            await wait_for(all_waiting)
            pulls.gate("missing:1").set()
            results = await asyncio.gather(*calls, return_exceptions=True)
        after = await scrape(address)
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() is grpc.StatusCode.NOT_FOUND for r in results)
    assert len(runtime.calls("PullImage")) == 1
    assert after.value("cri_shim_upstream_errors_total", method="PullImage", code="NOT_FOUND") == 1
    assert after.value("cri_shim_pulls_total", result="error") == 1
    assert after.value("cri_shim_rpc_duration_seconds_count", method="PullImage", code="NOT_FOUND") == 5


async def test_refused_and_malformed_calls_are_timed_with_their_code(engine: str, runtime: FakeRuntime) -> None:
    address = f"127.0.0.1:{free_port()}"
    async with running_shim(runtime.endpoint, {"metrics": {"address": address}}, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(PULL)(b"\xff\xff", timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            await ch.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5)
        after = await scrape(address)
    assert after.value("cri_shim_rpc_duration_seconds_count", method="PullImage", code="INVALID_ARGUMENT") == 1
    assert not runtime.calls("PullImage")
    # Passthrough calls are not timed (their cost stays one upstream call).
    assert "Version" not in after.text


async def test_deadline_spent_waiting_for_a_slot_is_timed_as_deadline_exceeded(engine: str,
                                                                                runtime: FakeRuntime) -> None:
    pulls = GatedPulls()
    runtime.unary[PULL] = pulls
    address = f"127.0.0.1:{free_port()}"
    settings = {"pulls": {"max_parallel": 1}, "metrics": {"address": address}}
    async with running_shim(runtime.endpoint, settings, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            busy = asyncio.ensure_future(ch.unary_unary(PULL)(pull_request("busy:1"), timeout=10))
            while not runtime.calls("PullImage"):
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(PULL)(pull_request("late:1"), timeout=0.3)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            pulls.gate("busy:1").set()
            await busy
        after = await scrape(address)
    assert [api_pb2.PullImageRequest.FromString(r.request).image.image for r in runtime.calls("PullImage")] \
        == ["busy:1"]
    assert after.value("cri_shim_rpc_duration_seconds_count", method="PullImage", code="DEADLINE_EXCEEDED") == 1
    assert after.bucket("cri_shim_rpc_duration_seconds", "0.25", method="PullImage", code="DEADLINE_EXCEEDED") == 0
    assert after.value("cri_shim_pulls_total", result="success") == 1

