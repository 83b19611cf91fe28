"""The runtime comes back: intercepted calls (made on the shim's own gRPC channel to
the runtime) work as soon as relayed ones do, not only when that channel's reconnect
backoff runs out; while the runtime is away they still fail fast."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

VERSION = "/runtime.v1.RuntimeService/Version"
LOCAL = "/runtime.v1.ImageService/ImageFsInfo"


async def test_intercepted_call_right_after_the_runtime_returns(tmp_path) -> None:
    """(The relay engine: with the grpc engine every call uses that channel, so the
    first call that works is proof the channel is up.)"""
    path = socket_in(str(tmp_path))

    async def forward(request: bytes, call) -> bytes:  # an intercepted method that asks the runtime
        return b"via shim:" + await call.forward(request)

    async with running_shim(f"unix://{path}", engine="relay") as shim:
        shim.app.router.set_table({LOCAL: forward})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(LOCAL)(b"", timeout=10)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert loop.time() - t0 < 1.0, "runtime away: UNAVAILABLE at once"
            await asyncio.sleep(1.6)  # the channel's reconnect backoff grows to its maximum (1 s)
            rt = await FakeRuntime(path).start()
            rt.unary[LOCAL] = b"fs"
            rt.unary[VERSION] = b"v"
            try:
                # a new client connection (a private subchannel pool: not the one in local mode)
                async with grpc.aio.insecure_channel(shim.endpoint, options=[("grpc.use_local_subchannel_pool", 1)]) as fresh:
                    t0 = loop.time()
                    assert await fresh.unary_unary(VERSION)(b"", timeout=5) == b"v"  # relayed
                    assert await fresh.unary_unary(LOCAL)(b"", timeout=5) == b"via shim:fs"  # intercepted
                    assert loop.time() - t0 < 1.5
            finally:
                await rt.stop()
