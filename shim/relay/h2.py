"""The small part of HTTP/2 (RFC 9113) and HPACK (RFC 7541) the relay needs.

The relay forwards frames between kubelet and the runtime unchanged. It only has to
find frame boundaries, read a request's ``:path``, and answer the streams it
intercepts. Both peers are told, through the SETTINGS frames the relay forwards,
that the other side's HPACK dynamic table is 0 bytes, so after the first header
blocks every block is self-contained; until then this decoder mirrors the dynamic
table exactly as the runtime's decoder does.
"""

from __future__ import annotations

import struct
from typing import Iterable

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# settings
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x1, 0x4, 0x5
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, CANCEL, COMPRESSION_ERROR = (
    0x0, 0x1, 0x2, 0x3, 0x6, 0x8, 0x9)

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
_HDR = struct.Struct(">I")


class H2Error(Exception):
    """The peer broke the protocol; the connection is closed with GOAWAY(``code``)."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, ftype, flags)) + _HDR.pack(stream_id & 0x7FFFFFFF) + payload


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _HDR.pack(increment))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _HDR.pack(code))


def goaway(last_stream_id: int, code: int = NO_ERROR, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _HDR.pack(last_stream_id) + _HDR.pack(code) + debug)


def settings_payload(payload: bytes) -> dict[int, int]:
    return {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
            for i in range(0, len(payload) - 5, 6)}


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values.items()))


def with_table_size_zero(payload: bytes) -> bytes:
    """A SETTINGS payload with HEADER_TABLE_SIZE forced to 0 (the last value of a setting wins)."""
    return payload + struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0)


def header_block_fragment(ftype: int, flags: int, payload: bytes) -> bytes:
    """Strip padding and priority fields from a HEADERS frame's payload."""
    start, end = 0, len(payload)
    if ftype == HEADERS:
        if flags & PADDED:
            if not payload:
                raise H2Error("HEADERS frame with PADDED flag and no pad length")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
    if start > end:
        raise H2Error("HEADERS frame padding exceeds its length")
    return payload[start:end]


def data_payload(flags: int, payload: bytes) -> bytes:
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise H2Error("DATA frame padding exceeds its length")
        return payload[1:len(payload) - payload[0]]
    return payload


# --------------------------------------------------------------------------- HPACK

_STATIC = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(_STATIC)
_PATH = b":path"


def _integer(data: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = data[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        if i >= len(data):
            raise H2Error("truncated HPACK integer")
        b = data[i]
        i += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 28:
            raise H2Error("HPACK integer too large")


class Decoder:
    """HPACK decoder that mirrors the peer's dynamic table.

    ``decode(block, full=False)`` returns ``(path, headers, inserted)``: the ``:path``
    value, all headers when ``full`` (for intercepted calls), and whether the block
    changed the dynamic table (then it must still reach the runtime's decoder).
    String values are only Huffman-decoded when needed; ``:path`` values are cached.
    """

    def __init__(self, max_size: int = 4096) -> None:
        self.max_size = max_size
        self.size = 0
        self.dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self._path_cache: dict[bytes, bytes] = {}

    def snapshot(self) -> tuple[int, int, list[tuple[bytes, bytes]]]:
        return self.max_size, self.size, list(self.dynamic)

    def restore(self, snap: tuple[int, int, list[tuple[bytes, bytes]]]) -> None:
        self.max_size, self.size, self.dynamic = snap[0], snap[1], list(snap[2])

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        j = index - _STATIC_LEN - 1
        if 0 <= j < len(self.dynamic):
            return self.dynamic[j]
        raise H2Error(f"HPACK index {index} out of range")

    def _string(self, data: bytes, i: int, decode: bool) -> tuple[bytes, int]:
        if i >= len(data):
            raise H2Error("truncated HPACK string")
        huffman = data[i] & 0x80
        length, i = _integer(data, i, 7)
        end = i + length
        if end > len(data):
            raise H2Error("truncated HPACK string")
        raw = data[i:end]
        if huffman and decode:
            try:
                raw = decode_huffman(raw)
            except Exception as e:
                raise H2Error(f"bad Huffman string: {e}") from None
        return raw, end

    def _path(self, data: bytes, i: int) -> tuple[bytes, int]:
        if i >= len(data):
            raise H2Error("truncated HPACK string")
        length, j = _integer(data, i, 7)
        key = data[i:j + length]
        cached = self._path_cache.get(key)
        if cached is not None:
            return cached, j + length
        value, end = self._string(data, i, True)
        if len(self._path_cache) < 4096:
            self._path_cache[key] = value
        return value, end

    def _insert(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 32
        self.dynamic.insert(0, (name, value))
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.dynamic:
            n, v = self.dynamic.pop()
            self.size -= len(n) + len(v) + 32

    def decode(self, data: bytes, full: bool = False) -> tuple[bytes | None, list[tuple[bytes, bytes]], bool]:
        i, n = 0, len(data)
        path: bytes | None = None
        headers: list[tuple[bytes, bytes]] = []
        inserted = False
        while i < n:
            b = data[i]
            if b & 0x80:  # indexed
                index, i = _integer(data, i, 7)
                name, value = self._entry(index)
                if name == _PATH:
                    path = value
                if full:
                    headers.append((name, value))
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, i = _integer(data, i, 5)
                self.max_size = size
                self._evict()
                inserted = True
                continue
            indexing = bool(b & 0x40)
            index, i = _integer(data, i, 6 if indexing else 4)
            if index:
                name = self._entry(index)[0]
            else:
                name, i = self._string(data, i, True)
            if name == _PATH:
                value, i = self._path(data, i)
                path = value
            else:
                value, i = self._string(data, i, full or indexing)
            if full:
                headers.append((name, value))
            if indexing:
                had_entries = bool(self.dynamic)
                self._insert(name, value)
                inserted = inserted or had_entries or bool(self.dynamic)  # a 0-size table stays empty
        return path, headers, inserted


def _encode_int(value: int, prefix_bits: int, first: int) -> bytes:
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


def encode_headers(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Encode without touching any dynamic table (literal, not indexed, no Huffman).

    Safe to inject into a connection whose HPACK state belongs to the two peers.
    """
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(0x88)  # static index 8
            continue
        out += b"\x00" + _encode_int(len(name), 7, 0) + name + _encode_int(len(value), 7, 0) + value
    return bytes(out)


def headers_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION) frames carrying ``block``."""
    first, rest = block[:max_frame], block[max_frame:]
    flags = END_STREAM if end_stream else 0
    if not rest:
        return frame(HEADERS, flags | END_HEADERS, stream_id, first)
    out = [frame(HEADERS, flags, stream_id, first)]
    while rest:
        chunk, rest = rest[:max_frame], rest[max_frame:]
        out.append(frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, chunk))
    return b"".join(out)
