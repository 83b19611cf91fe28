"""What one local client can make the relay hold, over real sockets.

- A PING flood gets GOAWAY ENHANCE_YOUR_CALM after a burst; a client that reads
  nothing stops being read, and after server.write_stall_seconds it is disconnected;
  others are served all along.
- server.max_connections, all clients trusted (root, as here): a connection that sent no
  preface, else one with no call in flight, makes room for a new one (silent or idle
  sockets cannot lock clients out); only when all have calls in flight is the new one
  refused, and logged. (Other uids: test_relay_admission.py, and tests/e2e/test_relay_abuse.py as processes.)
- server.stream_stall_seconds: an intercepted request whose body stops, or whose answer
  waits on a zero window, is ended, and what it held is given back.
- A connection that sends no preface opens no runtime connection and is closed after
  server.preface_timeout_seconds.
(Out of file descriptors, a shim process with a low RLIMIT_NOFILE:
tests/process/test_relay_fd_limit.py.)
(The sans-IO rules are in test_relay_core.py; bench/relay_abuse.py has RSS figures.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from shim.relay import http2
from shim.relay.hpack_decoder import Decoder
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim

VERSION = "/runtime.v1.RuntimeService/Version"
LIST = "/runtime.v1.RuntimeService/ListContainers"


async def version(endpoint: str, timeout: float = 5) -> bytes:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await ch.unary_unary(VERSION)(b"", timeout=timeout)


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> int:
    """Read until EOF or reset; returns the bytes read (the peer must close within ``within``)."""
    got = 0
    async with asyncio.timeout(within):
        while True:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                return got
            if not data:
                return got
            got += len(data)


async def test_ping_flood_is_answered_with_enhance_your_calm(runtime: FakeRuntime) -> None:
    runtime.unary[VERSION] = b"v"
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        reader, writer = await asyncio.open_unix_connection(shim.path)
        writer.write(http2.PREFACE + http2.settings_frame({}) + http2.frame(http2.PING, 0, 0, b"12345678") * 100_000)
        got = b""
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(5):
                while chunk := await reader.read(1 << 16):
                    got += chunk
        writer.transport.abort()
        frames = []
        while len(got) >= 9 and len(got) >= 9 + int.from_bytes(got[:3], "big"):
            n = int.from_bytes(got[:3], "big")
            frames.append((got[3], got[9:9 + n]))
            got = got[9 + n:]
        acks = [p for t, p in frames if t == http2.PING]
        goaway = [p for t, p in frames if t == http2.GOAWAY]
        assert 100 <= len(acks) < 200  # the burst, not 100,000 answers
        assert goaway and int.from_bytes(goaway[-1][4:8], "big") == http2.ENHANCE_YOUR_CALM
        assert b"too many PINGs" in goaway[-1][8:]
        assert await version(shim.endpoint) == b"v"


async def test_client_that_reads_nothing_stops_being_read_then_is_disconnected(runtime: FakeRuntime) -> None:
    """A 4 MiB answer to a client that never reads: the shim stops reading the runtime
    for it (the rest waits in the runtime, under flow control), and after
    server.write_stall_seconds it closes the connection. Others are served meanwhile."""
    runtime.unary[VERSION] = b"v"
    runtime.unary[LIST] = b"x" * (4 << 20)
    settings = {"server": {"write_buffer_high_bytes": "64KiB", "write_buffer_low_bytes": "16KiB",
                           "write_stall_seconds": 0.5}}
    async with running_shim(runtime.endpoint, settings, engine="relay") as shim:
        reader, writer = await asyncio.open_unix_connection(shim.path)
        block = http2.encode_headers([(b":method", b"POST"), (b":scheme", b"http"), (b":path", LIST.encode()),
                                   (b":authority", b"x"), (b"content-type", b"application/grpc"),
                                   (b"te", b"trailers")])
        big = 1 << 30  # windows wide open: only the socket and the shim's buffer hold it back
        writer.write(http2.PREFACE + http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: big - 1})
                     + http2.window_update(0, big) + http2.headers_frames(1, block, False, http2.DEFAULT_MAX_FRAME)
                     + http2.frame(http2.DATA, http2.END_STREAM, 1, b"\0\0\0\0\0"))
        conn = None
        for _ in range(100):
            conn = next(iter(shim.server.relay.connections), None)
            if conn is not None and "client-slow" in conn.paused("upstream"):
                break
            await asyncio.sleep(0.02)
        assert conn is not None and "client-slow" in conn.paused("upstream")  # the runtime is not read for it
        assert conn.client.get_write_buffer_size() < 1 << 20
        assert await version(shim.endpoint) == b"v"
        await asyncio.sleep(1.0)  # past write_stall_seconds
        got = await closed_by_peer(reader, 5)
        writer.transport.abort()
        assert got < 4 << 20  # closed before the whole answer went out


async def test_connections_over_the_cap_are_closed_when_all_are_busy_and_idle_ones_make_room(
        runtime: FakeRuntime, caplog) -> None:
    release = asyncio.Event()

    async def hang(request: bytes, context) -> bytes:
        await release.wait()
        return b"late"
    runtime.unary[VERSION] = b"v"
    runtime.unary[LIST] = hang
    async with running_shim(runtime.endpoint, {"server": {"max_connections": 3}}, engine="relay") as shim:
        busy = [grpc.aio.insecure_channel(shim.endpoint, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(3)]  # three connections, not one shared
        try:
            calls = [ch.unary_unary(LIST)(b"", timeout=20) for ch in busy]  # a call in flight on each
            for _ in range(200):
                if len(runtime.calls("ListContainers")) == 3:
                    break
                await asyncio.sleep(0.02)
            reader, writer = await asyncio.open_unix_connection(shim.path)
            writer.write(http2.PREFACE)
            assert await closed_by_peer(reader, 5) == 0  # refused: every connection is busy
            assert "connection refused: server.max_connections reached" in caplog.text
            release.set()
            assert await asyncio.gather(*calls) == [b"late"] * 3
            # now idle: a new client gets a connection, one idle connection is sent away (GOAWAY)
            assert await version(shim.endpoint) == b"v"
            assert "closed a connection to make room" in caplog.text
            assert len(shim.server.relay.connections) <= 3
        finally:  # also when the test failed
            release.set()
            for ch in busy:
                await ch.close()


async def test_silent_sockets_at_the_cap_make_room_for_a_new_client(runtime: FakeRuntime, caplog) -> None:
    runtime.unary[VERSION] = b"v"
    async with running_shim(runtime.endpoint, {"server": {"max_connections": 4}}, engine="relay") as shim:
        silent = [await asyncio.open_unix_connection(shim.path) for _ in range(10)]  # never send a preface
        for _ in range(3):  # each call on a new connection: the oldest silent socket makes room
            assert await version(shim.endpoint) == b"v"
        assert "closed a connection to make room" in caplog.text
        assert len(shim.server.relay.connections) <= 4
        for _, w in silent:
            w.close()


async def test_silent_connections_open_no_runtime_connection_and_are_closed(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, {"server": {"preface_timeout_seconds": 0.5}}, engine="relay") as shim:
        relay = shim.server.relay
        silent = [await asyncio.open_unix_connection(shim.path) for _ in range(20)]
        await asyncio.sleep(0.1)
        assert len(relay.connections) == 20
        assert all(c.upstream is None for c in relay.connections)  # no runtime connection for them
        t0 = time.monotonic()
        for reader, _ in silent:
            assert await closed_by_peer(reader, 5) == 0
        assert time.monotonic() - t0 < 3
        reader, writer = await asyncio.open_unix_connection(shim.path)
        writer.write(http2.PREFACE)  # a valid preface: now the runtime is connected
        for _ in range(100):
            if any(c.upstream is not None for c in relay.connections):
                break
            await asyncio.sleep(0.02)
        assert [c.upstream is not None for c in relay.connections] == [True]
        writer.close()


async def _frames_until(reader: asyncio.StreamReader, sid: int, within: float,
                        reset: bool = False) -> list[tuple[int, int, bytes]]:
    """Frames (type, flags, payload) of stream ``sid`` until it ends (END_STREAM or RST_STREAM;
    ``reset``: until RST_STREAM)."""
    buf, out = b"", []
    async with asyncio.timeout(within):
        while True:
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n, ftype, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                fsid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                if fsid == sid:
                    out.append((ftype, flags, buf[9:9 + n]))
                    if ftype == http2.RST_STREAM or (ftype == http2.HEADERS and flags & http2.END_STREAM
                                                     and not reset):
                        return out
                buf = buf[9 + n:]
            data = await reader.read(1 << 16)
            assert data, f"connection closed before stream {sid} ended"
            buf += data


async def test_stalled_intercepted_calls_end_and_give_back_what_they_held(runtime: FakeRuntime) -> None:
    """server.stream_stall_seconds: a PullImage whose body never completes gets DEADLINE_EXCEEDED;
    a StreamImages answer held by the client's zero window is reset (CANCEL). The connection goes
    on, and the process-wide counts of calls and request bytes are back at zero. A patched
    ListImages answer (relayed with pins, its message rewritten) held that way ends too."""

    async def images(request: bytes, context: object) -> AsyncIterator[bytes]:
        yield b"\x0a\x05\x0a\x03img"

    runtime.streams["/runtime.v1.ImageService/StreamImages"] = images
    runtime.unary["/runtime.v1.ImageService/ListImages"] = b"\x0a\x05\x0a\x03img"
    settings = {"server": {"stream_stall_seconds": 0.5}, "pins": {"images": ["example.invalid/p:1"]}}
    async with running_shim(runtime.endpoint, settings, engine="relay") as shim:
        limits = shim.server.relay.limits
        reader, writer = await asyncio.open_unix_connection(shim.path)

        def request(sid: int, path: str) -> bytes:
            block = http2.encode_headers([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                                       (b":authority", b"x"), (b"content-type", b"application/grpc"),
                                       (b"te", b"trailers")])
            return http2.headers_frames(sid, block, False, http2.DEFAULT_MAX_FRAME)

        writer.write(http2.PREFACE + http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
                     + request(1, "/runtime.v1.ImageService/PullImage")
                     + http2.frame(http2.DATA, 0, 1, b"\0\0\0\0\x64" + b"x" * 10))  # 100 bytes declared, 10 sent
        t0 = time.monotonic()
        frames = await _frames_until(reader, 1, 10)
        assert time.monotonic() - t0 >= 0.4
        status = dict(Decoder().decode(frames[-1][2], full=True)[1])
        assert status[b"grpc-status"] == b"4" and b"server.stream_stall_seconds" in status[b"grpc-message"]
        writer.write(request(3, "/runtime.v1.ImageService/StreamImages") + http2.frame(http2.DATA, http2.END_STREAM, 3,
                                                                                   b"\0\0\0\0\0"))
        frames = await _frames_until(reader, 3, 10)
        assert frames[-1][0] == http2.RST_STREAM and int.from_bytes(frames[-1][2], "big") == http2.CANCEL
        assert not any(t == http2.DATA for t, _, _ in frames)  # nothing was sent past the zero window
        assert (limits.calls.used, limits.request_buffer.used) == (0, 0)
        # a patched ListImages answer held by the zero window ends the same way (after the runtime's
        # trailers, which must pass for the client's HPACK table)
        t0 = time.monotonic()
        writer.write(request(5, "/runtime.v1.ImageService/ListImages") + http2.frame(http2.DATA, http2.END_STREAM, 5,
                                                                                  b"\0\0\0\0\0"))
        frames = await _frames_until(reader, 5, 10, reset=True)  # the runtime's trailers pass, then the reset
        assert time.monotonic() - t0 >= 0.4
        assert frames[-1][0] == http2.RST_STREAM and int.from_bytes(frames[-1][2], "big") == http2.CANCEL
        assert not any(t == http2.DATA for t, _, _ in frames)
        writer.close()
