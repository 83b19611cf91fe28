"""A gRPC client with keepalive on (a PING every 50 ms) keeps its connection while the
shim answers its calls itself, with a pull in flight all along; a PING that is not
8 bytes closes that one connection with FRAME_SIZE_ERROR. (tests/unit/test_relay_pings.py
has the frame-level cases; tests/e2e/test_reliability.py the same client against containerd.)
"""

from __future__ import annotations

import asyncio

import grpc

from shim.cri import protowire as wire
from shim.relay import http2
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim

PULL = "/runtime.v1.ImageService/PullImage"
VERSION = "/runtime.v1.RuntimeService/Version"


async def test_locally_answered_calls_do_not_get_the_connection_closed(runtime: FakeRuntime) -> None:
    held = asyncio.Event()
    big = b"\x0a\x05quick" + wire.len_field(99, b"x" * 32768)

    async def pulls(request: bytes, context) -> bytes:
        if request.endswith(b"long"):
            await held.wait()
            return b"\x0a\x04long"
        return big

    runtime.unary[VERSION] = b"v"
    runtime.unary[PULL] = pulls
    # A client with keepalive on, as many CRI clients have: a PING every 50 ms.
    opts = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        async with grpc.aio.insecure_channel(shim.endpoint, options=opts) as ch:
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"v"  # the runtime connection is up
            long = ch.unary_unary(PULL)(b"\x0a\x06\x0a\x04long", timeout=30)  # a pull held in flight
            for _ in range(10):  # other pulls answered meanwhile (by the shim itself), for a second
                answers = await asyncio.gather(*(ch.unary_unary(PULL)(b"\x0a\x06\x0a\x04q%03d" % i, timeout=5)
                                                 for i in range(10)))
                assert answers == [big] * 10
                await asyncio.sleep(0.1)
            held.set()
            assert await long == b"\x0a\x04long"
            assert await ch.unary_unary(VERSION)(b"", timeout=5) == b"v"


def parse_frames(buf: bytes) -> tuple[list[tuple[int, int, bytes]], bytes]:
    frames = []
    while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
        n = int.from_bytes(buf[:3], "big")
        frames.append((buf[3], buf[4], buf[9:9 + n]))
        buf = buf[9 + n:]
    return frames, buf


async def test_ping_is_acknowledged_by_the_relay_and_a_bad_one_closes_the_connection(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        reader, writer = await asyncio.open_unix_connection(shim.path)
        writer.write(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.PING, 0, 0, b"12345678"))
        frames: list[tuple[int, int, bytes]] = []
        buf = b""
        while (http2.PING, http2.ACK, b"12345678") not in frames:
            buf += await asyncio.wait_for(reader.read(65536), 5)
            got, buf = parse_frames(buf)
            frames += got
        writer.write(http2.frame(http2.PING, 0, 0, b"short"))  # a PING carries exactly 8 bytes
        await writer.drain()
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                buf += chunk
        except ConnectionError:
            pass
        goaways = [payload for t, _, payload in parse_frames(buf)[0] if t == http2.GOAWAY]
        assert goaways and int.from_bytes(goaways[-1][4:8], "big") == http2.FRAME_SIZE_ERROR
        writer.close()
