"""After the shim's GOAWAY (shutdown), a new stream is refused and never reaches the
runtime: a RemoveImage of a pinned image sent on a connection that was told to go
away must not remove it behind the pin check (issue 13: it used to be relayed as is).
Streams opened before the GOAWAY finish normally."""

from __future__ import annotations

import asyncio

from shim.proto.runtime.v1 import api_pb2
from shim.relay import grpcwire, http2
from tests.support.fake_images import SVC, FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.inproc import running_shim

REMOVE = SVC + "RemoveImage"
VERSION = "/runtime.v1.RuntimeService/Version"


def request(sid: int, path: str, body: bytes) -> bytes:
    block = http2.encode_headers([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                               (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    return (http2.headers_frames(sid, block, False, http2.DEFAULT_MAX_FRAME)
            + http2.frame(http2.DATA, http2.END_STREAM, sid, grpcwire.frame_message(body)))


async def read_frames(reader: asyncio.StreamReader, until, seconds: float = 5) -> list[tuple[int, int, bytes]]:
    buf, frames = b"", []
    async with asyncio.timeout(seconds):
        while not until(frames):
            data = await reader.read(65536)
            assert data, f"connection closed; frames so far: {frames}"
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                frames.append((buf[3], int.from_bytes(buf[5:9], "big"), buf[9:9 + n]))
                buf = buf[9 + n:]
    return frames


async def test_remove_of_a_pinned_image_after_goaway_never_reaches_the_runtime(runtime: FakeRuntime) -> None:
    FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"])]).install(runtime)
    held = asyncio.Event()

    async def slow_version(request: bytes, context) -> bytes:
        await held.wait()
        return b"v"
    runtime.unary[VERSION] = slow_version
    async with running_shim(runtime.endpoint, {"pins": {"images": ["nginx"]}}, engine="relay") as shim:
        reader, writer = await asyncio.open_unix_connection(shim.path)
        writer.write(http2.PREFACE + http2.settings_frame({}) + request(1, VERSION, b""))  # in flight at the GOAWAY
        await read_frames(reader, lambda fs: any(t == http2.SETTINGS for t, _, _ in fs))
        writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
        for _ in range(100):
            if runtime.calls("Version"):
                break
            await asyncio.sleep(0.02)
        for conn in shim.server.relay.connections:
            conn.begin_shutdown()
        await read_frames(reader, lambda fs: any(t == http2.GOAWAY for t, _, _ in fs))
        remove = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()
        writer.write(request(3, REMOVE, remove))
        frames = await read_frames(reader, lambda fs: any(t == http2.RST_STREAM and s == 3 for t, s, _ in fs))
        [code] = [int.from_bytes(p, "big") for t, s, p in frames if t == http2.RST_STREAM and s == 3]
        assert code == http2.REFUSED_STREAM
        held.set()  # the call from before the GOAWAY still gets its answer
        frames = await read_frames(reader, lambda fs: any(t == http2.DATA and s == 1 for t, s, _ in fs))
        writer.close()
    assert runtime.calls("RemoveImage") == []
