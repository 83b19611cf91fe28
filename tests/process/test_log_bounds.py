"""Log volume a client can cause in a shim process is bounded: an image name longer than any
image reference is refused with INVALID_ARGUMENT before it reaches a log (or the runtime), and
lines of one kind are rate-limited with a count of those dropped. (The formatter and the rate
limit themselves: tests/unit/test_log_bounds.py.)"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import pytest

from shim import reference
from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import shim_process
from tests.support.slow_pulls import PULL, VERSION, pull_request

REMOVE = "/runtime.v1.ImageService/RemoveImage"
STATUS = "/runtime.v1.ImageService/ImageStatus"


@pytest.mark.parametrize("length", [reference.MAX_LENGTH + 1, 1 << 20])
async def test_overlong_image_names_are_refused_and_leave_the_log_small(runtime: FakeRuntime, tmp_path,
                                                                       length: int) -> None:
    """200 PullImage calls with a long name (and RemoveImage, intercepted because of a pin):
    INVALID_ARGUMENT, nothing reaches the runtime, the log stays small (before: 110 MB of
    log in 11 s for 1 MiB names), and an honest client is served. ImageStatus is relayed
    with a pin (only its answer is rewritten): the runtime judges the name, the shim logs
    nothing of it."""
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    name = "registry.example.com/" + "a" * (length - len("registry.example.com/"))
    settings = {"server": {"admin_socket": ""}, "pins": {"images": ["nginx"]}}
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        before = len(shim.logs().encode())
        async with grpc.aio.insecure_channel(shim.endpoint, options=[
                ("grpc.max_send_message_length", 8 << 20)]) as ch:
            pull = ch.unary_unary(PULL)
            codes = []
            for _ in range(20):
                results = await asyncio.gather(*(pull(pull_request(name), timeout=30) for _ in range(10)),
                                               return_exceptions=True)
                codes += [r.code() if isinstance(r, grpc.aio.AioRpcError) else r for r in results]
            spec = api_pb2.ImageSpec(image=name)
            try:  # relayed: the runtime's own answer (the fake runtime has no such image)
                await ch.unary_unary(STATUS)(api_pb2.ImageStatusRequest(image=spec).SerializeToString(), timeout=30)
            except grpc.aio.AioRpcError as err:
                assert "cri-shim" not in (err.details() or "")
            assert len(runtime.calls("ImageStatus")) == 1
            for method, req in ((REMOVE, api_pb2.RemoveImageRequest(image=spec)),):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(method)(req.SerializeToString(), timeout=30)
                if req.ByteSize() > 1 << 20:  # over the method's request limit: refused before it is read
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"server.max_request_bytes.{method.rsplit('/', 1)[1]}" in e.value.details()
                else:
                    codes.append(e.value.code())
                    assert f"has {length} characters" in e.value.details()
            await ch.unary_unary(VERSION)(b"", timeout=10)
        assert len(codes) >= 200 and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
        assert runtime.calls("PullImage") == [] and runtime.calls("RemoveImage") == []
        grown = len(shim.logs().encode()) - before
        print(f"\nlog bytes after 202 refused calls with {length}-character names: {grown}", file=sys.stderr)
        assert grown < 64 * 1024, shim.logs()[-3000:]
        assert shim.proc.poll() is None


async def test_repeated_lines_are_rate_limited_with_a_count(runtime: FakeRuntime, tmp_path) -> None:
    """90 RemoveImage calls for a pinned image, each refused with an info line: 20 lines per
    window are written; the first line of the next window says how many were dropped."""
    FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"], [])]).install(runtime)
    window = 3.0
    settings = {"server": {"admin_socket": ""}, "pins": {"images": ["nginx"]},
                "log": {"max_repeats": 20, "repeat_window_seconds": window}}
    remove = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = ch.unary_unary(REMOVE)
            t = time.monotonic()
            for _ in range(90):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(remove, timeout=10)
                assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            took = time.monotonic() - t
            end = await shim.await_log("remove refused")
            await asyncio.sleep(window)
            with pytest.raises(grpc.aio.AioRpcError):
                await call(remove, timeout=10)
            await shim.await_log("suppressed=", after=end)
        lines = [ln for ln in shim.logs().splitlines() if "remove refused" in ln]
        windows = int(took // window) + 1  # windows the 90 calls took
        assert 21 <= len(lines) <= 20 * windows + 1, (len(lines), took)
        dropped = int(lines[-1].split("suppressed=")[1].split()[0])
        counted = sum(int(ln.split("suppressed=")[1].split()[0]) for ln in lines if "suppressed=" in ln)
        assert len(lines) + counted == 91, (len(lines), counted)  # every refusal written or counted
        print(f"\n90 refusals in {took:.1f} s: {len(lines) - 1} lines written, then suppressed={dropped}",
              file=sys.stderr)


