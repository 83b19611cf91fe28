"""A raw HTTP/2 client over a unix socket, for tests that must break the protocol on purpose.

Written independently of ``shim/relay`` (the code under test): frames are built here, header
blocks are plain literals (never indexed, so no HPACK table state), Huffman only when asked.
Blocking sockets; every read has a timeout.

    c = RawH2(path)            # connects, sends the preface and an empty SETTINGS
    c.send(headers(1, request_block("/runtime.v1.RuntimeService/Version"), end_stream=False))
    f = c.read_frame(timeout=2)   # Frame(type, flags, stream_id, payload) or None (closed / timeout)
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

import hpack
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x3, 0x4
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x0, 0x1, 0x3, 0x7, 0xB
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags, stream_id & 0x7FFFFFFF) + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``first``'s high bits set in the prefix octet."""
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_string(value: bytes, huffman: bool = False) -> bytes:
    """An HPACK string literal (RFC 7541 5.2), Huffman-coded or raw."""
    if huffman:
        coded = _HUFFMAN.encode(value)
        return hpack_int(len(coded), 7, 0x80) + coded
    return hpack_int(len(value), 7) + value


def literal(name: bytes, value: bytes, huffman: bool = False) -> bytes:
    """Literal header field without indexing, new name (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_string(name) + hpack_string(value, huffman)


def request_block(path: str | bytes, extra: Iterable[tuple[bytes, bytes]] = (), *, huffman_path: bool = False) -> bytes:
    p = path.encode() if isinstance(path, str) else path
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", p), (b":authority", b"localhost"),
              (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra]
    return b"".join(literal(n, v, huffman=huffman_path and n == b":path") for n, v in fields)


def headers(stream_id: int, block: bytes, *, end_stream: bool, max_frame: int = 16384) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying a whole block."""
    chunks = [block[i:i + max_frame] for i in range(0, len(block), max_frame)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        flags = (END_HEADERS if last else 0) | (END_STREAM if end_stream and i == 0 else 0)
        out.append(frame(HEADERS if i == 0 else CONTINUATION, flags, stream_id, chunk))
    return b"".join(out)


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    return bytes((1 if compressed else 0,)) + struct.pack(">I", len(body)) + body


def unary_calls(path: str, body: bytes, first_sid: int, n: int) -> bytes:
    """``n`` whole unary calls (HEADERS, then DATA with END_STREAM) on streams ``first_sid``, +2, ..."""
    block = request_block(path)
    message = grpc_message(body)
    return b"".join(headers(sid, block, end_stream=False) + frame(DATA, END_STREAM, sid, message)
                    for sid in range(first_sid, first_sid + 2 * n, 2))


@dataclass(frozen=True)
class Frame:
    type: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def settings(self) -> dict[int, int]:
        """A SETTINGS frame's parameters (the last value of each wins)."""
        p = self.payload
        return {int.from_bytes(p[i:i + 2], "big"): int.from_bytes(p[i + 2:i + 6], "big") for i in range(0, len(p), 6)}

    @property
    def error_code(self) -> int | None:
        if self.type == RST_STREAM:
            return struct.unpack(">I", self.payload[:4])[0]
        if self.type == GOAWAY:
            return struct.unpack(">I", self.payload[4:8])[0]
        return None


class RawH2:
    def __init__(self, path: str, *, handshake: bool = True, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._buf = b""
        self.closed = False
        self.decoder = hpack.Decoder()
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes, timeout: float | None = None) -> bool:
        """``sendall``; False when the peer closed the connection or stopped reading until ``timeout``."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
            return False

    def read_frame(self, timeout: float = 5.0) -> Frame | None:
        """The next frame, or None when the connection is closed or nothing came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buf) >= 9:
                n = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) >= 9 + n:
                    ftype, flags = self._buf[3], self._buf[4]
                    sid = int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF
                    payload, self._buf = self._buf[9:9 + n], self._buf[9 + n:]
                    return Frame(ftype, flags, sid, payload)
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                return None
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk

    def read_until(self, want, timeout: float = 5.0) -> tuple[Frame | None, list[Frame]]:
        """Read frames until ``want(frame)``; returns (that frame or None, every frame read)."""
        deadline = time.monotonic() + timeout
        seen: list[Frame] = []
        while (left := deadline - time.monotonic()) > 0:
            f = self.read_frame(left)
            if f is None:
                return None, seen
            seen.append(f)
            if f.type == SETTINGS and not f.flags & ACK:
                self.send(frame(SETTINGS, ACK, 0))
            if want(f):
                return f, seen
        return None, seen

    def open_windows(self, size: int = 1 << 30) -> None:
        """Stream and connection flow-control windows of ``size``: only reading holds answers back."""
        self.send(frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, size - 1))
                  + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", size)))

    def read_answers(self, n: int, timeout: float = 20.0) -> dict[int, tuple[int, bytes]]:
        """Read until ``n`` streams ended: stream id -> (bytes of DATA, grpc-status). A stream the
        server reset counts as ended, with status ``RST_STREAM <code>``. Fails if a read waits
        ``timeout`` seconds for nothing."""
        data: dict[int, int] = {}
        ended: dict[int, tuple[int, bytes]] = {}
        while len(ended) < n:
            f = self.read_frame(timeout)
            if f is None:
                raise AssertionError(f"{len(ended)} of {n} answers, then nothing for {timeout} s")
            if f.type == SETTINGS and not f.flags & ACK:
                self.send(frame(SETTINGS, ACK, 0))
            elif f.type == DATA:
                data[f.stream_id] = data.get(f.stream_id, 0) + len(f.payload)
            elif f.type == HEADERS:
                fields = self.decode_headers(f)
                if f.flags & END_STREAM:
                    ended[f.stream_id] = (data.get(f.stream_id, 0), fields.get(b"grpc-status", b"?"))
            elif f.type == RST_STREAM and f.stream_id not in ended:
                ended[f.stream_id] = (data.get(f.stream_id, 0), f"RST_STREAM {f.error_code}".encode())
        return ended

    def decode_headers(self, f: Frame) -> dict[bytes, bytes]:
        return {bytes(n): bytes(v) for n, v in self.decoder.decode(f.payload, raw=True)}

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
