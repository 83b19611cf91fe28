"""A runtime that answers before it has read the request (grpc-go does this for a method
it doesn't know: trailers-only UNIMPLEMENTED on the HEADERS frame, then RST_STREAM).

The shim forwards the request after the runtime has already answered; the runtime's
status must still reach the client unchanged, whatever the engine.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from shim.relay import grpcwire, http2
from tests.support.fake_runtime import socket_in
from tests.support.inproc import running_shim

UNKNOWN = "/runtime.v1.RuntimeService/FutureAsk"
STATUS = grpc.StatusCode.UNIMPLEMENTED
DETAILS = "unknown method FutureAsk for service runtime.v1.RuntimeService"


class EarlyAnswerRuntime:
    """A bare HTTP/2 server: every stream gets a trailers-only status on its HEADERS
    frame, then RST_STREAM(NO_ERROR); request DATA is never waited for."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.streams = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        answer = http2.encode_headers(grpcwire.trailers(STATUS, DETAILS, trailers_only=True))
        buf = b""
        try:
            conn.sendall(http2.settings_frame({}))
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                if buf.startswith(http2.PREFACE):
                    buf = buf[len(http2.PREFACE):]
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    ftype, flags = buf[3], buf[4]
                    sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    buf = buf[9 + length:]
                    if ftype == http2.SETTINGS and not flags & http2.ACK:
                        conn.sendall(http2.frame(http2.SETTINGS, http2.ACK, 0))
                    elif ftype == http2.PING and not flags & http2.ACK:
                        conn.sendall(http2.frame(http2.PING, http2.ACK, 0, b"\0" * 8))
                    elif ftype == http2.HEADERS and sid % 2 == 1:
                        self.streams += 1
                        conn.sendall(http2.headers_frames(sid, answer, True, http2.DEFAULT_MAX_FRAME)
                                     + http2.rst_stream(sid, http2.NO_ERROR))
        except OSError:
            return

    def close(self) -> None:
        # closing a listening socket does not wake a thread blocked in accept() on Linux; shutdown does
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._accepting.join(5)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        for t in self._threads:
            t.join(5)
        assert not self._accepting.is_alive() and not any(t.is_alive() for t in self._threads), "a thread outlived it"


@pytest.fixture
def early_runtime(tmp_path) -> Iterator[EarlyAnswerRuntime]:
    rt = EarlyAnswerRuntime(socket_in(str(tmp_path)))
    yield rt
    rt.close()


async def test_status_sent_before_the_request_reaches_the_client(early_runtime: EarlyAnswerRuntime,
                                                                 engine: str) -> None:
    async with running_shim(f"unix://{early_runtime.path}", engine=engine) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            seen = []
            for body in (b"", b"q", b"\x0a\x03abc" * 100) * 7:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(UNKNOWN)(body, timeout=5)
                seen.append((e.value.code(), e.value.details()))
    assert seen == [(STATUS, DETAILS)] * len(seen)
    assert early_runtime.streams == len(seen)
