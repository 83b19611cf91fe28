"""The small part of HTTP/2 (RFC 9113) and HPACK (RFC 7541) the relay needs.

Wire vocabulary only: frame types, flags, settings and error codes, ``H2Error``, and
the builders of the frames the shim sends itself (``encode_headers`` writes literal
fields that never touch a dynamic table). Decoding HPACK is hpack_decoder.py's job;
this module imports nothing of the relay.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# settings
(SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE,
 SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE) = range(1, 7)
# error codes
(NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, FRAME_SIZE_ERROR,
 REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, ENHANCE_YOUR_CALM) = range(12)

DEFAULT_WINDOW = 65535
DEFAULT_TABLE_SIZE = 4096  # HPACK dynamic table size before any SETTINGS_HEADER_TABLE_SIZE
MAX_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME = 16384
MAX_FRAME_LIMIT = 2**24 - 1
_HDR = struct.Struct(">I")


class H2Error(Exception):
    """The peer broke the protocol; the connection is closed with GOAWAY(``code``)."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, ftype, flags)) + _HDR.pack(stream_id & 0x7FFFFFFF) + payload


# the 9-byte header of a PING ACK: the answer to a PING is this plus its 8-byte payload
PING_ACK_HEADER = frame(PING, ACK, 0, bytes(8))[:9]


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


def setting(key: int, value: int) -> bytes:
    """One SETTINGS parameter; appended to a payload, it wins over an earlier value of ``key``."""
    return struct.pack(">HI", key, value)


def with_table_size(payload: bytes, table_size: int, max_header_list: int | None = None) -> bytes:
    """A SETTINGS payload with HEADER_TABLE_SIZE ``table_size`` (the last value of a setting wins),
    and MAX_HEADER_LIST_SIZE lowered to ``max_header_list`` if given."""
    out = payload + struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, table_size)
    if max_header_list is not None:
        current = settings_payload(payload).get(SETTINGS_MAX_HEADER_LIST_SIZE)
        if current is None or current > max_header_list:
            out += struct.pack(">HI", SETTINGS_MAX_HEADER_LIST_SIZE, max_header_list)
    return out


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
