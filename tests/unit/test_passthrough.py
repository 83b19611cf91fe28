"""Passthrough through an in-process shim to a scripted runtime: bytes, errors,
metadata, deadlines, streams and unknown methods reach the other side unchanged."""

from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest

from tests.support.fake_runtime import FAKE_BIDI, FakeRuntime, socket_in
from tests.support.inproc import running_shim

VERSION = "/runtime.v1.RuntimeService/Version"
EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"


async def test_unary_bytes_and_metadata_pass_unchanged(runtime: FakeRuntime, engine: str) -> None:
    payload = b"\x0a\x05hello\xfa\x01\x03odd"  # includes a field nobody declares
    runtime.unary[VERSION] = b"\x12\x0acontainerd\x9a\x05\x02zz"
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = ch.unary_unary(VERSION)(payload, metadata=(("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
                                                                ("x-custom-bin", b"\x00\x01")), timeout=5)
            assert await call == b"\x12\x0acontainerd\x9a\x05\x02zz"
    got = runtime.calls("Version")[0]
    assert got.request == payload
    assert got.metadata["traceparent"].startswith("00-aaaa")
    assert got.metadata["x-custom-bin"] == b"\x00\x01"
    assert got.deadline is not None and 3 < got.deadline <= 5.05  # grpc-timeout rounds up


async def test_runtime_error_keeps_code_details_and_trailers(runtime: FakeRuntime, engine: str) -> None:
    details_bin = b"\x08\x05\x12\x03nope"
    runtime.unary["/runtime.v1.ImageService/ImageFsInfo"] = (
        grpc.StatusCode.NOT_FOUND, "no such thing", (("grpc-status-details-bin", details_bin), ("x-why", "because")))
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/runtime.v1.ImageService/ImageFsInfo")(b"", timeout=5)
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    assert e.value.details() == "no such thing"
    md = dict(e.value.trailing_metadata())
    assert md["grpc-status-details-bin"] == details_bin and md["x-why"] == "because"


async def test_server_stream_passes_through(runtime: FakeRuntime, engine: str) -> None:
    async def events(request: bytes, context):
        for i in range(5):
            yield b"\x0a\x01" + bytes([48 + i])
    runtime.streams[EVENTS] = events
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            got = [m async for m in ch.unary_stream(EVENTS)(b"", timeout=5)]
    assert got == [b"\x0a\x01" + bytes([48 + i]) for i in range(5)]


async def test_stream_cancel_reaches_runtime(runtime: FakeRuntime, engine: str) -> None:
    cancelled = asyncio.Event()

    async def forever(request: bytes, context):
        try:
            yield b"first"
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
    runtime.streams[EVENTS] = forever
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = ch.unary_stream(EVENTS)(b"")
            assert await call.read() == b"first"
            call.cancel()
            await asyncio.wait_for(cancelled.wait(), 5)


async def test_unknown_method_passes_through_as_stream(runtime: FakeRuntime, engine: str) -> None:
    """CRI methods from the future (unknown to the shim, any shape) pass, as do allowed services."""
    runtime.unary["/vendor.v9.Mystery/Ask"] = b"answer"
    runtime.unary["/runtime.v1.RuntimeService/FutureAsk"] = b"future"
    async with running_shim(runtime.endpoint, {"server": {"allowed_services": ["vendor.v9.Mystery"]}},
                            engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary("/vendor.v9.Mystery/Ask")(b"q", timeout=5) == b"answer"
            assert await ch.unary_unary("/runtime.v1.RuntimeService/FutureAsk")(b"q", timeout=5) == b"future"
            bidi = ch.stream_stream(FAKE_BIDI + "Chat")(timeout=5)
            await bidi.write(b"1")
            assert await bidi.read() == b"echo:1"
            await bidi.write(b"2")
            assert await bidi.read() == b"echo:2"
            await bidi.done_writing()
    assert runtime.calls("Ask")[0].request == b"q"


async def test_deadline_propagates_and_expires(runtime: FakeRuntime, engine: str) -> None:
    async def slow(request: bytes, context) -> bytes:
        await asyncio.sleep(10)
        return b""
    runtime.unary[VERSION] = slow
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(VERSION)(b"", timeout=0.3)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < runtime.calls("Version")[0].deadline <= 0.35  # grpc-timeout rounds up


async def test_upstream_missing_fails_fast_then_recovers(tmp_path, engine: str) -> None:
    path = socket_in(str(tmp_path))
    async with running_shim(f"unix://{path}", engine=engine) as shim:
        assert stat.S_IMODE(os.stat(shim.path).st_mode) == 0o660
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(VERSION)(b"", timeout=10)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert loop.time() - t0 < 2
            rt = await FakeRuntime(path).start()
            rt.unary[VERSION] = b"up"
            try:
                for _ in range(50):
                    try:
                        assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"up"
                        break
                    except grpc.aio.AioRpcError as err:
                        assert err.code() is grpc.StatusCode.UNAVAILABLE
                        await asyncio.sleep(0.1)
                else:
                    pytest.fail("shim did not reconnect to the runtime within 5 s")
            finally:
                await rt.stop()
    assert not os.path.exists(shim.path)


async def test_16mib_messages_pass(runtime: FakeRuntime, engine: str) -> None:
    big = b"\x0a" + b"x" * (15 * 1024 * 1024)
    runtime.unary["/runtime.v1.RuntimeService/ListContainers"] = big
    async with running_shim(runtime.endpoint, engine=engine) as shim:
        opts = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(shim.endpoint, options=opts) as ch:
            assert await ch.unary_unary("/runtime.v1.RuntimeService/ListContainers")(big, timeout=10) == big
