"""Minimal protobuf wire-format helpers for byte-exact request rewriting.

When the shim adds one field (e.g. ImageSpec.runtime_handler) it appends that field
to the sub-message's bytes instead of decoding and re-encoding the whole request:
every other byte reaches the runtime as the client sent it. Appending is valid
protobuf: fields may come in any order, and for a repeated occurrence of a message
field the parser merges them (scalars: last one wins).
"""

from __future__ import annotations

from typing import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5


class WireError(ValueError):
    pass


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def fields(buf: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield (field_number, wire_type, start, value_start, end) for each top-level field."""
    i = 0
    n = len(buf)
    while i < n:
        start = i
        tag, i = _read_varint(buf, i)
        number, wtype = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wtype == VARINT:
            _, j = _read_varint(buf, i)
            value_start = i
        elif wtype == I64:
            value_start, j = i, i + 8
        elif wtype == I32:
            value_start, j = i, i + 4
        elif wtype == LEN:
            length, value_start = _read_varint(buf, i)
            j = value_start + length
        else:
            raise WireError(f"unsupported wire type {wtype}" + (" (group)" if wtype in (3, 4) else ""))
        if j > n:
            raise WireError("truncated field")
        yield number, wtype, start, value_start, j
        i = j


def varint_field(number: int, value: int) -> bytes:
    return varint(number << 3 | VARINT) + varint(value)


def len_field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | LEN) + varint(len(payload)) + payload


def string_field(number: int, value: str) -> bytes:
    return len_field(number, value.encode())


def append_to_submessage(msg: bytes, number: int, extra: bytes) -> bytes:
    """Append ``extra`` (encoded fields) to the last occurrence of message field ``number``.

    If the field is absent, it is added at the end holding just ``extra``.
    """
    last: tuple[int, int, int] | None = None
    for num, wtype, start, value_start, end in fields(msg):
        if num == number and wtype == LEN:
            last = (start, value_start, end)
    if last is None:
        return msg + len_field(number, extra)
    start, value_start, end = last
    return msg[:start] + len_field(number, msg[value_start:end] + extra) + msg[end:]
