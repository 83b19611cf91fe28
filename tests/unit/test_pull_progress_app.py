"""Pull progress through a running shim (in process) in front of a scripted runtime:
span events on every waiting caller's pull span, the status document, and the stall
guard's answer to CRI clients. The runtime's content store is scripted
(tests/support/fake_content.py); its PullImage is held open until the test says."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_content import MiB, Store
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan
from tests.support.wait import wait_for

PULL = "/runtime.v1.ImageService/PullImage"
IMAGE = "reg.test/team/app:v1"


def pull_request(image: str = IMAGE) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


@pytest.fixture
async def collector(monkeypatch):
    col = await OtlpCollector().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield col
    await col.stop()


class HeldPull:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, request: bytes, context) -> bytes:
        self.started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return api_pb2.PullImageResponse(image_ref="sha256:" + "1" * 64).SerializeToString()


async def test_collapsed_callers_get_progress_events_on_their_spans_and_status_shows_the_bar(
        runtime: FakeRuntime, collector: OtlpCollector) -> None:
    store = Store()
    store.serve(runtime)
    m, (l0, l1) = store.add_image("team/app", "a", [2 * MiB, 2 * MiB], touched=9e9)
    held = HeldPull()
    runtime.unary[PULL] = held
    settings = {"pulls": {"progress_interval_seconds": 0.1}}
    async with running_shim(runtime.endpoint, settings) as shim:
        app = shim.app
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            md = [(("traceparent", f"00-{c * 32}-{'b' * 16}-01"),) for c in "12"]
            calls = [asyncio.ensure_future(ch.unary_unary(PULL)(pull_request(), metadata=m_, timeout=20)) for m_ in md]
            await held.started.wait()
            await wait_for(lambda: app.scheduler.snapshot()["in_flight"] and
                        app.scheduler.snapshot()["in_flight"][0]["waiters"] == 2)
            store.write(l0, 0, 2 * MiB)
            await wait_for(lambda: app.status()["pulls"]["in_flight"][0].get("progress", {}).get("phase") == "downloading")
            store.write(l0, 2 * MiB, 2 * MiB)
            store.write(l1, MiB, 2 * MiB)
            await wait_for(lambda: app.status()["pulls"]["in_flight"][0]["progress"]["bytes_done"] == 100 + 3 * MiB)
            row = app.status()["pulls"]["in_flight"][0]
            assert row["waiters"] == 2 and row["progress"]["layers_total"] == 2
            store.commit(l0, 2 * MiB)
            store.commit(l1, 2 * MiB)
            await wait_for(lambda: app.status()["pulls"]["in_flight"][0]["progress"]["phase"] == "unpacking")
            held.gate.set()
            await asyncio.gather(*calls)
    await wait_for(lambda: len([s for s in collector.named("runtime.v1.ImageService/PullImage")
                             if s.kind == ReceivedSpan.KIND_SERVER]) == 2)
    spans = [s for s in collector.named("runtime.v1.ImageService/PullImage") if s.kind == ReceivedSpan.KIND_SERVER]
    for s in spans:
        steps = [e for e in s.events if e.startswith("pull ") and e.endswith("%")]
        assert steps == ["pull 25%", "pull 50%", "pull 75%", "pull 100%"], s.events


async def test_a_stalled_pull_answers_every_caller_unavailable_and_cancels_the_runtime_call(
        runtime: FakeRuntime) -> None:
    store = Store()
    store.serve(runtime)
    m, (l0,) = store.add_image("team/app", "b", [8 * MiB], touched=9e9)
    held = HeldPull()
    runtime.unary[PULL] = held
    settings = {"pulls": {"progress_interval_seconds": 0.1, "stall_timeout_seconds": 0.5,
                          "stall_min_bytes_per_second": "4MiB"}}
    async with running_shim(runtime.endpoint, settings) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            store.write(l0, MiB, 8 * MiB)  # and nothing more arrives
            results = await asyncio.gather(*(ch.unary_unary(PULL)(pull_request(), timeout=20) for _ in range(2)),
                                           return_exceptions=True)
        await asyncio.wait_for(held.cancelled.wait(), 5)
        assert shim.app.metrics.registry.get_sample_value("cri_shim_pull_stalls_total") == 1
    for r in results:
        assert isinstance(r, grpc.aio.AioRpcError) and r.code() is grpc.StatusCode.UNAVAILABLE
        assert r.details().startswith(f"cri-shim: pull of {IMAGE} stalled: 0 B in the last 0.5 s (< 4 MiB/s)")


async def test_status_watch_redraws_with_the_progress_bar(runtime: FakeRuntime, tmp_path) -> None:
    import io

    from shim.process.status_render import watch_status

    store = Store()
    store.serve(runtime)
    m, (l0,) = store.add_image("team/app", "c", [4 * MiB], touched=9e9)
    held = HeldPull()
    runtime.unary[PULL] = held
    admin = str(tmp_path / "admin.sock")
    async with running_shim(runtime.endpoint, {"server": {"admin_socket": admin},
                                               "pulls": {"progress_interval_seconds": 0.1}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = asyncio.ensure_future(ch.unary_unary(PULL)(pull_request(), timeout=20))
            store.write(l0, 3 * MiB, 4 * MiB)
            await wait_for(lambda: shim.app.status()["pulls"]["in_flight"]
                        and shim.app.status()["pulls"]["in_flight"][0].get("progress", {}).get("bytes_done"))
            out = io.StringIO()
            await asyncio.to_thread(watch_status, admin, 0.05, False, out, 2)
            held.gate.set()
            await call
    views = out.getvalue()
    print(views)
    assert views.count("pulls      1 running") == 2
    assert "[##################......]  75%  3 MiB / 4 MiB  0/1 layers" in views
