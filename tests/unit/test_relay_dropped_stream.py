"""A call the shim answers itself whose header block the runtime still had to see.

When a client's first header block inserts into the HPACK table, the relay forwards it to
the runtime and cancels it there (RST_STREAM CANCEL). grpc-go (CRI-O, containerd) may
answer such a stream before reading the cancel: trailers at once for a method it does
not know (StreamImages on CRI-O v1.34), then RST_STREAM(NO_ERROR). That answer is not the
client's: grpc clients fail the call with INTERNAL "Received RST_STREAM with error code 0"
instead of taking the shim's answer. Found by the crio suite (StreamImages with pins),
about one call in fifty on a fresh connection.

But the runtime's trailers changed its HPACK encoder's table (grpc-go indexes every field),
and the client's decoder mirrors that table: dropped, every later runtime header block on the
connection decodes wrongly at the client. They reach the client after the shim's answer, on
the stream it closed (shim/relay/carried.py).

Client and runtime here speak raw HTTP/2, so the order of frames is fixed; the last test
uses a real gRPC client.
"""

from __future__ import annotations

import asyncio

import grpc
from hpack import Decoder, Encoder

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


VERSION = "/runtime.v1.RuntimeService/Version"
EARLY = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12"),
         ("grpc-message", "unknown method StreamImages for service runtime.v1.ImageService")]


class Runtime:
    """grpc-go's way, over raw HTTP/2 with one HPACK encoder (its table is what the client's
    decoder must mirror): StreamImages (unknown to it) answered at once with trailers, then
    RST_STREAM(NO_ERROR), then ``marker``; Version answered with a response whose trailers repeat
    the early answer's status (an indexed reference to the entries that answer inserted)."""

    def __init__(self, marker: bytes) -> None:
        self.encoder = Encoder()
        self.marker = marker
        self.answered_early = asyncio.Event()
        self.done = asyncio.Event()
        self.sent: dict[int, list[list[tuple[str, str]]]] = {}  # stream id -> the header lists sent on it

    def block(self, sid: int, headers: list[tuple[str, str]]) -> bytes:
        self.sent.setdefault(sid, []).append(headers)
        return self.encoder.encode(headers)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = Decoder()
        writer.write(http2.settings_frame({}))
        buf = bytearray()
        preface_seen = False
        while data := await reader.read(65536):
            buf += data
            if not preface_seen:
                if len(buf) < len(http2.PREFACE):
                    continue
                del buf[:len(http2.PREFACE)]
                preface_seen = True
            for ftype, flags, sid, payload in frames(buf):
                if ftype == http2.SETTINGS and not flags & http2.ACK:
                    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
                elif ftype == http2.HEADERS:
                    path = dict(decoder.decode(http2.header_block_fragment(ftype, flags, payload)))[":path"]
                    if path == STREAM:
                        writer.write(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, sid,
                                                 self.block(sid, EARLY))
                                     + http2.rst_stream(sid, http2.NO_ERROR) + self.marker)
                        await writer.drain()
                        self.answered_early.set()
                    elif path == VERSION:
                        reply = b"\n\x050.1.0"  # VersionResponse.version = "0.1.0"
                        writer.write(
                            http2.frame(http2.HEADERS, http2.END_HEADERS, sid,
                                        self.block(sid, [(":status", "200"), ("content-type", "application/grpc")]))
                            + http2.frame(http2.DATA, 0, sid, b"\x00" + len(reply).to_bytes(4, "big") + reply)
                            + http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, sid,
                                          self.block(sid, EARLY[2:])))
        writer.close()
        self.done.set()


def request(encoder: Encoder, path: str) -> bytes:
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
                           ("content-type", "application/grpc"), ("te", "trailers")])


async def test_runtime_answer_on_a_stream_the_shim_answers_reaches_the_client_only_to_keep_hpack_in_step(
        tmp_path) -> None:
    marker = http2.window_update(0, 12345)  # a frame of the runtime's that reaches the client as it is
    rt = Runtime(marker)
    server = await asyncio.start_unix_server(rt.serve, str(tmp_path / "runtime.sock"))

    async def answer(request: bytes, call):
        await rt.answered_early.wait()
        await asyncio.sleep(0.2)  # the shim has read the runtime's early answer: it waits for this one
        yield b"from the shim"

    async with running_shim(f"unix://{tmp_path / 'runtime.sock'}", engine="relay") as shim:
        shim.app.router.set_table({STREAM: answer})
        reader, writer = await asyncio.open_unix_connection(shim.path)
        client_encoder, client_decoder = Encoder(), Decoder()
        # a first header block that inserts into the HPACK table (incremental indexing)
        writer.write(http2.PREFACE + http2.settings_frame({})
                     + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, request(client_encoder, STREAM))
                     + http2.frame(http2.DATA, http2.END_STREAM, 1, b"\x00\x00\x00\x00\x00"))
        seen: list[tuple[int, int, int]] = []
        got: dict[int, list[list[tuple[str, str]]]] = {}  # every header block, decoded in order as a client does
        buf = bytearray()
        asked_version = False
        while not (3 in got and len(got[3]) == 2):
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, f"connection closed; frames so far: {seen}"
            buf += data
            for ftype, flags, sid, payload in frames(buf):
                seen.append((ftype, flags, sid))
                if ftype == http2.HEADERS:  # (no CONTINUATION here: every block fits one frame)
                    block = http2.header_block_fragment(ftype, flags, payload)
                    got.setdefault(sid, []).append([(k.decode() if isinstance(k, bytes) else k,
                                                     v.decode() if isinstance(v, bytes) else v)
                                                    for k, v in client_decoder.decode(block, raw=True)])
                elif ftype == http2.SETTINGS and not flags & http2.ACK:
                    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
                elif ftype == http2.WINDOW_UPDATE and sid == 0 and payload == marker[9:] and not asked_version:
                    asked_version = True  # a relayed call on the same connection, after the marker
                    marker_at = len(seen) - 1
                    writer.write(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 3,
                                             request(client_encoder, VERSION)))
        writer.close()
    await asyncio.wait_for(rt.done.wait(), 10)  # the shim closed its runtime connection
    server.close()
    on_stream = [(t, f & http2.END_STREAM) for t, f, s in seen if s == 1 and t in (http2.HEADERS, http2.DATA,
                                                                                    http2.RST_STREAM)]
    # the shim's answer (headers, message, trailers), then the runtime's trailers, on the stream already
    # closed (a gRPC client decodes and ignores them); never its RST_STREAM(NO_ERROR)
    assert on_stream == [(http2.HEADERS, 0), (http2.DATA, 0), (http2.HEADERS, http2.END_STREAM),
                         (http2.HEADERS, http2.END_STREAM)], on_stream
    assert dict(got[1][1])["grpc-status"] == "0"  # the shim's answer
    assert got[1][2] == EARLY  # the runtime's block, decoded as the runtime encoded it
    assert marker_at > max(i for i, (_, _, s) in enumerate(seen) if s == 1)  # in the runtime's order
    assert got[3] == rt.sent[3]  # the relayed call's headers decode as the runtime sent them


async def test_a_grpc_client_takes_the_shims_answer_and_its_next_calls_decode_right(tmp_path) -> None:
    rt = Runtime(b"")
    server = await asyncio.start_unix_server(rt.serve, str(tmp_path / "runtime.sock"))

    async def answer(request: bytes, call):
        await rt.answered_early.wait()
        await asyncio.sleep(0.2)
        yield b"from the shim"

    async with running_shim(f"unix://{tmp_path / 'runtime.sock'}", engine="relay") as shim:
        shim.app.router.set_table({STREAM: answer})
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert [m async for m in ch.unary_stream(STREAM)(b"", timeout=10)] == [b"from the shim"]
            for _ in range(3):  # trailers indexed by the runtime after its early answer inserted them
                try:
                    await ch.unary_unary(VERSION)(b"", timeout=10)
                    raise AssertionError("the runtime answered UNIMPLEMENTED")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.UNIMPLEMENTED, e
                    assert e.details() == EARLY[3][1]
    server.close()
