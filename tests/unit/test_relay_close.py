"""A connection error is answered with GOAWAY and a clean close, as Go's HTTP/2 server does:
the shim stops writing (EOF after the GOAWAY) and drops what the client still sends for
CLOSE_LINGER_SECONDS (or CLOSE_LINGER_BYTES), then closes. A client whose frames were in flight
reads the GOAWAY and an EOF: closing at once, its writes failed with EPIPE (and a unix socket
closed with unread bytes gives its peer ECONNRESET)."""

from __future__ import annotations

import asyncio
import time

from shim.relay import http2
from shim.relay.connection import CLOSE_LINGER_BYTES, CLOSE_LINGER_SECONDS
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim


async def _handshake(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(http2.PREFACE + http2.settings_frame({}))
    buf = b""
    async with asyncio.timeout(5):
        while len(buf) < 9:  # the shim's (the runtime's) SETTINGS come first
            buf += await reader.read(65536)
    assert buf[3] == http2.SETTINGS
    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
    return reader, writer


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    out = b""
    async with asyncio.timeout(CLOSE_LINGER_SECONDS + 5):
        while data := await reader.read(65536):
            out += data
    return out


def _goaway_codes(data: bytes) -> list[int]:
    codes, i = [], 0
    while i + 9 <= len(data):
        n = int.from_bytes(data[i:i + 3], "big")
        if data[i + 3] == http2.GOAWAY:
            codes.append(int.from_bytes(data[i + 13:i + 17], "big"))
        i += 9 + n
    return codes


async def test_frames_sent_after_a_connection_error_do_not_reset_the_client(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, {}, engine="relay") as shim:
        reader, writer = await _handshake(shim.path)
        # DATA on stream 0 is a connection error; the PINGs behind it are in flight when it is read
        writer.write(http2.frame(http2.DATA, http2.END_STREAM, 0, b"protospec"))
        for _ in range(50):
            writer.write(http2.frame(http2.PING, 0, 0, b"12345678"))
            await asyncio.sleep(0.001)
        data = await _read_to_eof(reader)  # raises ConnectionResetError if the shim reset us
        assert _goaway_codes(data)[-1:] == [http2.PROTOCOL_ERROR], data[-64:]
        writer.close()


async def test_a_client_that_keeps_its_end_open_is_closed_after_the_linger(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, {}, engine="relay") as shim:
        reader, writer = await _handshake(shim.path)
        writer.write(http2.frame(http2.DATA, http2.END_STREAM, 0, b"x"))
        await _read_to_eof(reader)  # the GOAWAY, then EOF: the shim stopped writing
        start = time.monotonic()
        async with asyncio.timeout(CLOSE_LINGER_SECONDS + 5):
            while shim.server.relay.connections:
                await asyncio.sleep(0.02)
        assert time.monotonic() - start <= CLOSE_LINGER_SECONDS + 1
        writer.close()


async def test_a_client_that_floods_after_the_goaway_is_closed_at_the_byte_bound(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, {}, engine="relay") as shim:
        reader, writer = await _handshake(shim.path)
        writer.write(http2.frame(http2.DATA, http2.END_STREAM, 0, b"x"))
        await _read_to_eof(reader)
        start = time.monotonic()
        chunk = http2.frame(http2.PING, 0, 0, b"12345678") * 1024
        try:
            for _ in range(2 * CLOSE_LINGER_BYTES // len(chunk) + 2):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass
        async with asyncio.timeout(CLOSE_LINGER_SECONDS + 5):
            while shim.server.relay.connections:
                await asyncio.sleep(0.01)
        assert time.monotonic() - start < CLOSE_LINGER_SECONDS, "closed by the linger timer, not the byte bound"
        writer.close()
