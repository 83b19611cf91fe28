"""A call the shim answers itself whose header block the runtime still had to see.

When a client's first header block inserts into the HPACK table, the relay forwards it to
the runtime and cancels it there (RST_STREAM CANCEL). grpc-go (CRI-O, containerd) may
answer such a stream before reading the cancel: trailers at once for a method it does
not know (StreamImages on CRI-O v1.34), then RST_STREAM(NO_ERROR). None of that may
reach the client: grpc clients fail the call with INTERNAL "Received RST_STREAM with
error code 0" instead of taking the shim's answer. Found by the crio suite
(StreamImages with pins), about one call in fifty on a fresh connection.

Client and runtime here speak raw HTTP/2, so the order of frames is fixed.
"""

from __future__ import annotations

import asyncio

from hpack import Encoder

from shim.relay import http2
from tests.support.inproc import running_shim

STREAM = "/runtime.v1.ImageService/StreamImages"


def frames(buf: bytearray) -> list[tuple[int, int, int, bytes]]:
    """Whole frames taken off the front of ``buf``: (type, flags, stream id, payload)."""
    out = []
    while len(buf) >= 9:
        length = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + length:
            break
        out.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, bytes(buf[9:9 + length])))
        del buf[:9 + length]
    return out


async def test_runtime_frames_on_a_stream_the_shim_answers_never_reach_the_client(tmp_path) -> None:
    marker = http2.window_update(0, 12345)  # a frame of the runtime's that reaches the client as it is
    runtime_done = asyncio.Event()

    async def runtime(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """grpc-go's way with an unknown method: trailers on HEADERS, then RST_STREAM(NO_ERROR)."""
        writer.write(http2.settings_frame({}))
        buf = bytearray()
        preface_seen = False
        trailers = Encoder().encode([(":status", "200"), ("content-type", "application/grpc"),
                                     ("grpc-status", "12"), ("grpc-message", "unknown method")])
        while data := await reader.read(65536):
            buf += data
            if not preface_seen:
                if len(buf) < len(http2.PREFACE):
                    continue
                del buf[:len(http2.PREFACE)]
                preface_seen = True
            for ftype, flags, sid, _ in frames(buf):
                if ftype == http2.SETTINGS and not flags & http2.ACK:
                    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
                elif ftype == http2.HEADERS:
                    writer.write(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, sid, trailers)
                                 + http2.rst_stream(sid, http2.NO_ERROR)
                                 + marker)  # everything before it has been relayed
        writer.close()
        runtime_done.set()

    server = await asyncio.start_unix_server(runtime, str(tmp_path / "runtime.sock"))
    relayed = asyncio.Event()

    async def answer(request: bytes, call):
        await relayed.wait()
        yield b"from the shim"

    async with running_shim(f"unix://{tmp_path / 'runtime.sock'}", engine="relay") as shim:
        shim.app.router.set_table({STREAM: answer})
        reader, writer = await asyncio.open_unix_connection(shim.path)
        # a first header block that inserts into the HPACK table (incremental indexing)
        block = Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", STREAM),
                                  (":authority", "localhost"), ("content-type", "application/grpc"),
                                  ("te", "trailers")])
        writer.write(http2.PREFACE + http2.settings_frame({}) + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block)
                     + http2.frame(http2.DATA, http2.END_STREAM, 1, b"\x00\x00\x00\x00\x00"))
        seen: list[tuple[int, int, int]] = []
        buf = bytearray()
        ended = False
        while not ended:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, f"connection closed; frames so far: {seen}"
            buf += data
            for ftype, flags, sid, payload in frames(buf):
                seen.append((ftype, flags, sid))
                if ftype == http2.WINDOW_UPDATE and sid == 0 and payload == marker[9:]:
                    relayed.set()
                elif ftype == http2.SETTINGS and not flags & http2.ACK:
                    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
                elif sid == 1 and (ftype == http2.RST_STREAM or (ftype == http2.HEADERS and flags & http2.END_STREAM)):
                    ended = True
        writer.close()
    await asyncio.wait_for(runtime_done.wait(), 10)  # the shim closed its runtime connection
    server.close()
    on_stream = [t for t, _, s in seen if s == 1 and t in (http2.HEADERS, http2.DATA, http2.RST_STREAM)]
    assert on_stream == [http2.HEADERS, http2.DATA, http2.HEADERS], on_stream  # the shim's answer: headers, message, trailers
