"""Client PINGs on a relayed connection.

gRPC servers (grpc-go in containerd and CRI-O, grpc-core) count a strike for each PING
that arrives while they have sent no HEADERS or DATA since the previous one, and after
two strikes send GOAWAY ENHANCE_YOUR_CALM "too_many_pings" and close the connection.
Clients PING when response data arrives, including data the shim wrote for calls it
answered itself (PullImage), which the runtime never saw: a pull storm got kubelet's
connection closed under it (tests/e2e/test_pull_storm.py has the end-to-end case).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


from shim.relay import http2
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

Frame = tuple[int, int, int, bytes]  # type, flags, stream id, payload


class RawPeer:
    """One end of an HTTP/2 connection, frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = b""
        self.closed = False

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frames(self, seconds: float) -> list[Frame]:
        """Frames that arrive within ``seconds``."""
        out: list[Frame] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not self.closed and (left := end - loop.time()) > 0:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except (asyncio.TimeoutError, ConnectionError):
                break
            if not data:
                self.closed = True
                break
            self.buf += data
            if self.buf.startswith(http2.PREFACE):  # a client's preface is not a frame
                self.buf = self.buf[len(http2.PREFACE):]
            while len(self.buf) >= 9 and len(self.buf) >= 9 + int.from_bytes(self.buf[:3], "big"):
                n = int.from_bytes(self.buf[:3], "big")
                sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
                out.append((self.buf[3], self.buf[4], sid, self.buf[9:9 + n]))
                self.buf = self.buf[9 + n:]
        return out


def pings(frames: list[Frame], ack: bool) -> list[bytes]:
    return [p for t, f, _, p in frames if t == http2.PING and bool(f & http2.ACK) == ack]


@contextlib.asynccontextmanager
async def client(path: str) -> AsyncIterator[RawPeer]:
    reader, writer = await asyncio.open_unix_connection(path)
    peer = RawPeer(reader, writer)
    peer.send(http2.PREFACE + http2.settings_frame({}))
    await peer.frames(0.2)
    peer.send(http2.frame(http2.SETTINGS, http2.ACK, 0))
    try:
        yield peer
    finally:
        writer.close()


async def test_many_pings_do_not_get_the_connection_closed(runtime: FakeRuntime) -> None:
    async with running_shim(runtime.endpoint, engine="relay") as shim:
        async with client(shim.path) as c:
            got: list[Frame] = []
            for i in range(8):
                c.send(http2.frame(http2.PING, 0, 0, bytes([i]) * 8))
                got += await c.frames(0.05)
            got += await c.frames(0.3)
            assert not c.closed
    assert [t for t, *_ in got if t == http2.GOAWAY] == []
    assert pings(got, ack=True) == [bytes([i]) * 8 for i in range(8)]


async def test_pings_reach_the_runtime_when_it_would_take_them(tmp_path) -> None:
    """The runtime sees a client's PING whenever it has spoken since the last one."""
    seen: list[RawPeer] = []  # connections to the runtime
    accepted = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(RawPeer(reader, writer))
        accepted.set()
    path = socket_in(str(tmp_path), "raw-runtime.sock")
    server = await asyncio.start_unix_server(on_connect, path)
    try:
        async with running_shim(f"unix://{path}", engine="relay") as shim:
            async with client(shim.path) as c:
                await asyncio.wait_for(accepted.wait(), 5)
                await asyncio.sleep(0.2)
                # The relay's connection is the one that gets the first PING (the shim's
                # own gRPC channel to the runtime connects here too).
                c.send(http2.frame(http2.PING, 0, 0, b"\x01" * 8))
                got = await asyncio.gather(*(peer.frames(0.2) for peer in seen))
                [rt] = [peer for peer, frames in zip(seen, got) if pings(frames, ack=False)]
                assert [pings(frames, ack=False) for frames in got if pings(frames, ack=False)] == [[b"\x01" * 8]]
                rt.send(http2.frame(http2.PING, http2.ACK, 0, b"\x01" * 8))
                assert pings(await c.frames(0.1), ack=True) == [b"\x01" * 8]

                async def ping(n: int) -> tuple[list[bytes], list[bytes]]:
                    """PING n; (PINGs the runtime got, PING ACKs the client got)."""
                    c.send(http2.frame(http2.PING, 0, 0, bytes([n]) * 8))
                    to_runtime = pings(await rt.frames(0.1), ack=False)
                    for p in to_runtime:  # the runtime answers what it gets
                        rt.send(http2.frame(http2.PING, http2.ACK, 0, p))
                    return to_runtime, pings(await c.frames(0.1), ack=True)

                assert await ping(2) == ([], [b"\x02" * 8])  # runtime silent since: answered here
                assert await ping(3) == ([], [b"\x03" * 8])
                rt.send(http2.frame(http2.DATA, 0, 1, b"x"))  # the runtime speaks on a stream
                await c.frames(0.1)
                assert await ping(4) == ([b"\x04" * 8], [b"\x04" * 8])
                assert await ping(5) == ([], [b"\x05" * 8])
                # The runtime's own PINGs are answered by the shim, and never reach the client.
                rt.send(http2.frame(http2.PING, 0, 0, b"R" * 8))
                assert pings(await rt.frames(0.1), ack=True) == [b"R" * 8]
                assert pings(await c.frames(0.1), ack=False) == []
                # A client's ACK goes through all the same (the runtime judges it).
                c.send(http2.frame(http2.PING, http2.ACK, 0, b"S" * 8))
                assert pings(await rt.frames(0.1), ack=True) == [b"S" * 8]
    finally:
        server.close()
