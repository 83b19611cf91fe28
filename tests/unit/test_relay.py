"""The HTTP/2 relay's own edges: flow control shared between relayed and locally
answered streams, metadata and deadlines seen by handlers, streaming handlers,
runtime loss mid-call, and HPACK decoding."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hpack import Encoder

from shim.errors import RpcError
from shim.relay import http2
from shim.relay.hpack_decoder import Decoder
from shim.cri.routing import Router
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

BIG = "/runtime.v1.RuntimeService/ListContainers"
LOCAL = "/runtime.v1.ImageService/ListImages"
STREAM = "/runtime.v1.ImageService/StreamImages"
OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def test_big_local_and_relayed_responses_share_the_connection(runtime: FakeRuntime) -> None:
    relayed = bytes(range(256)) * (3 * 4096)  # 3 MiB from the runtime
    local = b"L" * (5 << 20)  # 5 MiB from the shim itself
    runtime.unary[BIG] = relayed

    async def big_local(request: bytes, call) -> bytes:
        await asyncio.sleep(0)
        return local + request
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({LOCAL: big_local})
        async with grpc.aio.insecure_channel(shim.endpoint, options=OPTS) as ch:
            calls = []
            for i in range(4):
                calls.append(ch.unary_unary(BIG)(b"", timeout=30))
                calls.append(ch.unary_unary(LOCAL)(bytes([i]), timeout=30))
            results = await asyncio.gather(*calls)
    for i in range(4):
        assert results[2 * i] == relayed
        assert results[2 * i + 1] == local + bytes([i])


async def test_handler_sees_metadata_and_deadline(runtime: FakeRuntime) -> None:
    seen = {}

    async def handler(request: bytes, call) -> bytes:
        seen["md"] = dict(call.metadata)
        seen["timeout"] = call.time_remaining()
        return b"ok"
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({LOCAL: handler})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            md = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("x-id-bin", b"\x00\xff"))
            assert await ch.unary_unary(LOCAL)(b"", metadata=md, timeout=4) == b"ok"
    assert seen["md"]["traceparent"] == md[0][1]
    assert seen["md"]["x-id-bin"] == b"\x00\xff"
    assert "user-agent" not in seen["md"] and "grpc-timeout" not in seen["md"]
    assert 3 < seen["timeout"] <= 4.05


async def test_local_error_carries_code_details_and_trailers(runtime: FakeRuntime) -> None:
    async def refuse(request: bytes, call) -> bytes:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "cri-shim: image is pinned (100% sure)",
                       (("grpc-status-details-bin", b"\x08\x09"), ("x-pin", "a")))
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({LOCAL: refuse})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(LOCAL)(b"", timeout=5)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details() == "cri-shim: image is pinned (100% sure)"
    md = dict(e.value.trailing_metadata())
    assert md["grpc-status-details-bin"] == b"\x08\x09" and md["x-pin"] == "a"


async def test_local_handler_deadline_and_cancel(runtime: FakeRuntime) -> None:
    cancelled, entered = asyncio.Event(), asyncio.Event()

    async def slow(request: bytes, call) -> bytes:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({LOCAL: slow})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(LOCAL)(b"", timeout=0.2)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(cancelled.wait(), 5)
            cancelled.clear()
            entered.clear()
            call = ch.unary_unary(LOCAL)(b"", timeout=30)
            await asyncio.wait_for(entered.wait(), 5)  # the handler is running
            call.cancel()
            await asyncio.wait_for(cancelled.wait(), 5)


async def test_streaming_handler(runtime: FakeRuntime) -> None:
    async def stream(request: bytes, call):
        for i in range(3):
            yield bytes([i]) * 70000  # larger than a default stream window over three messages
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({STREAM: stream})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            got = [m async for m in ch.unary_stream(STREAM)(b"", timeout=10)]
    assert got == [bytes([i]) * 70000 for i in range(3)]


async def test_runtime_dying_mid_call_fails_fast(tmp_path) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    started = asyncio.Event()

    async def hang(request: bytes, context) -> bytes:
        started.set()
        await asyncio.sleep(30)
        return b""
    rt.unary[BIG] = hang
    try:
        async with running_shim(rt.endpoint, engine="relay") as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                call = ch.unary_unary(BIG)(b"", timeout=20)
                await asyncio.wait_for(started.wait(), 5)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await rt.stop()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE
                assert loop.time() - t0 < 3
    finally:
        await rt.stop()  # a no-op once stopped; the runtime's server, also when the test failed


def test_hpack_decoder_mirrors_dynamic_table() -> None:
    enc = Encoder()
    dec = Decoder()
    for i in range(5):
        headers = [(":method", "POST"), (":path", "/runtime.v1.ImageService/PullImage"),
                   ("traceparent", f"00-{i:032x}-{i:016x}-01"), ("x-bin", "v" * i)]
        block = enc.encode(headers)
        path, full, inserted = dec.decode(block, full=True)
        assert path == b"/runtime.v1.ImageService/PullImage"
        assert dict(full)[b"traceparent"] == f"00-{i:032x}-{i:016x}-01".encode()
    enc.header_table_size = 0
    path, _, inserted = dec.decode(enc.encode([(":path", "/x/Y")]))
    assert path == b"/x/Y" and inserted  # a size update must still reach the runtime
    path, _, inserted = dec.decode(enc.encode([(":path", "/x/Z"), ("a", "b")]))
    assert path == b"/x/Z" and not inserted and dec.dynamic == []


def test_hpack_rejects_garbage() -> None:
    with pytest.raises(http2.H2Error):
        Decoder().decode(b"\xff\xff\xff\xff\xff\xff\xff")
    with pytest.raises(http2.H2Error):
        Decoder().decode(b"\xbf")  # index 63: not in the tables


async def test_runtime_connection_lost_fails_relayed_calls_but_finishes_local_ones(runtime: FakeRuntime) -> None:
    release = asyncio.Event()

    async def hang(request: bytes, context) -> bytes:
        await asyncio.sleep(30)
        return b""

    async def local(request: bytes, call) -> bytes:
        await release.wait()
        return b"answered by the shim"
    runtime.unary[BIG] = hang
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        shim.app.router.set_table({LOCAL: local})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            relayed = asyncio.ensure_future(ch.unary_unary(BIG)(b"", timeout=20))
            mine = asyncio.ensure_future(ch.unary_unary(LOCAL)(b"", timeout=20))
            for _ in range(100):
                if runtime.calls("ListContainers") and shim.server.relay.connections:
                    break
                await asyncio.sleep(0.02)
            conn = next(iter(shim.server.relay.connections))
            conn.upstream.close()  # e.g. the runtime's GOAWAY/max-age: this connection only
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(relayed, 5)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            release.set()
            assert await asyncio.wait_for(mine, 5) == b"answered by the shim"
        runtime.unary["/runtime.v1.RuntimeService/Version"] = b"v"
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert await ch.unary_unary("/runtime.v1.RuntimeService/Version")(b"", timeout=5) == b"v"


def test_client_gone_before_the_runtime_speaks(tmp_path) -> None:
    """A client that connects and leaves at once (a health probe, `crictl` killed) while
    the runtime sends its SETTINGS: nothing is written to the closed client, so no
    transport error closes the runtime side (uvloop, the shim's loop, raises there)."""
    uvloop = pytest.importorskip("uvloop")
    from shim.config import ServerConfig
    from shim.relay.listener import Relay

    async def scenario() -> list[str]:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx["message"]))

        async def runtime(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(http2.settings_frame({}))  # grpc-go's server preface, sent on accept
            await reader.read()
            writer.close()

        up, listen = str(tmp_path / "runtime.sock"), str(tmp_path / "shim.sock")
        server = await asyncio.start_unix_server(runtime, up)
        relay = Relay(up, None, Router(), ServerConfig(max_message_bytes=1 << 20))  # type: ignore[arg-type]
        await relay.start(listen)
        for _ in range(20):
            _, writer = await asyncio.open_unix_connection(listen)
            writer.close()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await relay.shutdown(0.1)
        server.close()
        return errors

    assert uvloop.run(scenario()) == []
