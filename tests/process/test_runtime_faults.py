"""Runtime faults, as CRI clients of the shim see them (both engines): the runtime
killed in the middle of a pull storm, restarted, slow, or not there yet when the
shim starts. The runtime is a scripted one in a process of its own, so it can be
SIGKILLed; the slow one is in-process, so the test sees what reached it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.cri import Timed, timed, until_ok
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim
from tests.support.runtime_process import RuntimeProcess
from tests.support.wait import wait_for

PULL = "/runtime.v1.ImageService/PullImage"
LIST = "/runtime.v1.ImageService/ListImages"
STREAM = "/runtime.v1.ImageService/StreamImages"
VERSION = "/runtime.v1.RuntimeService/Version"
STATUS = "/runtime.v1.RuntimeService/Status"
PROMPT = 2.0  # seconds: "promptly", for an answer that needs no waiting at all


def pull_request(image: str) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


async def test_runtime_killed_mid_storm_then_restarted(tmp_path, engine: str) -> None:
    rt = RuntimeProcess(socket_in(str(tmp_path)), pull_seconds=3600).start()
    try:
        async with running_shim(rt.endpoint, {"pulls": {"max_parallel": 2}}, engine=engine) as shim:
            sched = shim.app.scheduler
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                pull = ch.unary_unary(PULL)
                # a and b in flight (a with two callers joined), c and d queued (c with one joined),
                # and a passthrough call hanging in the runtime.
                images = ["reg/a:1"] * 3 + ["reg/b:1"] * 2
                calls = [asyncio.ensure_future(timed(lambda: pull(pull_request(i), timeout=60))) for i in images]
                await wait_for(lambda: rt.pulls_started() == 2)
                calls += [asyncio.ensure_future(timed(lambda: pull(pull_request(i), timeout=60)))
                          for i in ("reg/c:1", "reg/c:1", "reg/d:1")]
                calls.append(asyncio.ensure_future(timed(lambda: ch.unary_unary(STATUS)(b"", timeout=60))))
                await wait_for(lambda: sched.queued == 2 and sched.in_flight == 2)
                await asyncio.sleep(0.2)
                assert not any(c.done() for c in calls)

                rt.kill()
                results = await asyncio.wait_for(asyncio.gather(*calls), 10)
                codes = [r.code for r in results]
                slowest = max(r.seconds for r in results) - 0.2  # minus the wait before the kill
                print(f"\n[{engine}] runtime killed: {len(results)} waiting callers -> "
                      f"{sorted({c.name for c in codes})}, slowest answer {slowest:.3f}s after the kill")
                assert codes == [grpc.StatusCode.UNAVAILABLE] * len(calls)
                assert rt.pulls_started() == 2  # the queued pulls never reached a runtime
                await wait_for(lambda: sched.queued == 0 and sched.in_flight == 0, 5)

                # While it is down: every call fails at once, nothing waits for it.
                code, seconds, _, _ = await timed(lambda: pull(pull_request("reg/e:1"), timeout=30))
                assert code is grpc.StatusCode.UNAVAILABLE and seconds < PROMPT

                # Restarted: the same client channel is served again within seconds.
                rt = RuntimeProcess(rt.socket, pull_seconds=0.05).start()
                t_version = await until_ok(ch, VERSION, b"")
                t_pull = await until_ok(ch, PULL, pull_request("reg/a:1"))
                print(f"[{engine}] runtime restarted: Version through the shim after {t_version:.3f}s, "
                      f"PullImage after {t_version + t_pull:.3f}s")
                assert t_version + t_pull < 5.0
    finally:
        rt.kill()


async def test_shim_started_before_the_runtime(tmp_path, engine: str) -> None:
    rt = RuntimeProcess(socket_in(str(tmp_path)), pull_seconds=0.3)
    try:
        async with running_shim(rt.endpoint, {"pulls": {"max_parallel": 2}}, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                pull = ch.unary_unary(PULL)
                storm = [timed(lambda i=i: pull(pull_request(f"reg/img{i % 3}:1"), timeout=30)) for i in range(9)]
                storm.append(timed(lambda: ch.unary_unary(VERSION)(b"", timeout=30)))
                results = await asyncio.wait_for(asyncio.gather(*storm), 10)
                assert [r.code for r in results] == [grpc.StatusCode.UNAVAILABLE] * len(storm)
                assert max(r.seconds for r in results) < PROMPT
                assert shim.app.scheduler.queued == 0 and shim.app.scheduler.in_flight == 0

                rt.start()
                versions = asyncio.ensure_future(until_ok(ch, VERSION, b""))
                t_pull = await until_ok(ch, PULL, pull_request("reg/first:1"))
                t_version = await versions
                storm = [timed(lambda i=i: pull(pull_request(f"reg/img{i % 3}:1"), timeout=30)) for i in range(9)]
                results = await asyncio.gather(*storm)
                print(f"\n[{engine}] runtime started after the shim: Version through the shim after "
                      f"{t_version:.3f}s, PullImage after {t_pull:.3f}s (a 0.3s pull); storm of 9 pulls -> "
                      f"{rt.pulls_started() - 1} runtime pulls")
                assert t_version < 2.0 and t_pull < 2.0
                assert [r.code for r in results] == [grpc.StatusCode.OK] * 9
                for i, r in enumerate(results):
                    assert r.response is not None
                    assert api_pb2.PullImageResponse.FromString(r.response).image_ref == f"reg/img{i % 3}:1@pulled"
                assert rt.pulls_started() == 1 + 3  # collapsed: one runtime pull per image
    finally:
        rt.kill()


class Slow:
    """A runtime method that takes far too long; records what got cancelled."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def unary(self, request: bytes, context) -> bytes:
        self.started += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b""

    async def stream(self, request: bytes, context):
        self.started += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield b""


async def test_slow_runtime_calls_respect_their_deadlines(tmp_path, engine: str) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    slow = Slow()
    FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"])]).install(rt)
    for method in (VERSION, PULL, LIST):
        rt.unary[method] = slow.unary
    rt.streams[STREAM] = slow.stream
    settings = {"pulls": {"max_parallel": 1}, "pins": {"images": ["nginx"]}}  # pins: image calls intercepted
    try:
        async with running_shim(rt.endpoint, settings, engine=engine) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                pull = ch.unary_unary(PULL)
                survivor = asyncio.ensure_future(timed(lambda: pull(pull_request("reg/a:1"), timeout=1.5)))
                await wait_for(lambda: slow.started == 1)
                results = await asyncio.gather(
                    timed(lambda: ch.unary_unary(VERSION)(b"", timeout=0.3)),  # passthrough
                    timed(lambda: ch.unary_unary(LIST)(b"", timeout=0.3)),  # intercepted, forwarded
                    timed(lambda: pull(pull_request("reg/a:1"), timeout=0.3)),  # joined to the flight in progress
                    timed(lambda: pull(pull_request("reg/b:1"), timeout=0.3)),  # queued behind it (max_parallel 1)
                )
                t0 = time.monotonic()
                stream = ch.unary_stream(STREAM)(b"", timeout=0.3)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stream:
                        pass
                results.append(Timed(e.value.code(), time.monotonic() - t0, e.value.details() or "", None))
                print(f"\n[{engine}] slow runtime, 0.3s deadlines: "
                      + ", ".join(f"{r.code.name} in {r.seconds:.3f}s" for r in results))
                for code, seconds, _, _ in results:
                    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
                    assert 0.29 < seconds < 1.0
                # The flight the joined caller left is still going for the first caller ...
                assert not survivor.done()
                code, seconds, _, _ = await survivor
                assert code is grpc.StatusCode.DEADLINE_EXCEEDED and seconds < 2.0
                # ... and every call the runtime was given was cancelled there, nothing left running.
                await wait_for(lambda: slow.cancelled == slow.started, 5)
                assert slow.started == 4  # Version, ListImages, StreamImages, one pull; reg/b never started
                await wait_for(lambda: shim.app.scheduler.queued == 0 and shim.app.scheduler.in_flight == 0)
    finally:
        await rt.stop()
