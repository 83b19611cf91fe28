"""gRPC over HTTP/2, the parts needed to answer an intercepted call ourselves."""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Iterable
from urllib.parse import quote

import grpc

from ..cri.call import HOP_HEADERS

_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# Request headers that describe the hop, not the call: not passed to handlers as metadata.
_NOT_METADATA = frozenset(h.encode() for h in HOP_HEADERS if not h.startswith(":"))  # pseudo-headers: skipped
RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


class MessageError(ValueError):
    pass


class MessageTooLarge(MessageError):
    pass


class HeaderError(ValueError):
    """A request header grpc-go refuses (it answers INTERNAL, before the handler runs)."""


def _quoted(value: bytes) -> str:
    return repr(value[:40]) + ("..." if len(value) > 40 else "")


_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}


def decompress(body: bytes, encoding: bytes | None, max_bytes: int) -> bytes:
    """``body`` decompressed, never more than ``max_bytes`` of output (MessageTooLarge)."""
    wbits = _WBITS.get(encoding or b"")
    if wbits is None:
        raise MessageError(f"unsupported grpc-encoding {encoding!r}")
    out: list[bytes] = []
    size = 0
    data = body
    try:
        while data:
            d = zlib.decompressobj(wbits)
            chunk = d.decompress(data, max_bytes - size + 1)
            size += len(chunk)
            if size > max_bytes:
                raise MessageTooLarge(f"decompressed request larger than {max_bytes} bytes")
            out.append(chunk)
            if d.unconsumed_tail:
                raise MessageTooLarge(f"decompressed request larger than {max_bytes} bytes")
            if not d.eof:
                raise MessageError("truncated compressed message")
            data = d.unused_data  # gzip allows several members
    except zlib.error as e:
        raise MessageError(f"bad compressed message: {e}") from None
    return b"".join(out)


def parse_timeout(value: bytes) -> float:
    """A ``grpc-timeout`` value in seconds, read as grpc-go reads it: 1 to 8 digits and a unit."""
    digits, unit = value[:-1], _UNITS.get(value[-1:])
    if unit is None or not 1 <= len(digits) <= 8 or not digits.isdigit():
        raise HeaderError(f"malformed grpc-timeout: {_quoted(value)}")
    return int(digits) * unit


def _bin_value(name: bytes, value: bytes) -> bytes:
    """A ``-bin`` metadata value decoded as grpc-go does: padded base64, or unpadded if not a multiple of 4."""
    try:
        if len(value) % 4 == 0:
            return base64.b64decode(value, validate=True)
        if b"=" not in value:
            return base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
    except binascii.Error:
        pass
    raise HeaderError(f"malformed binary metadata {_quoted(value)} in header {_quoted(name)}")


def metadata(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """Call metadata as grpc-python wants it (``-bin`` values decoded to bytes). HeaderError if one is not base64."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name[:1] == b":" or name in _NOT_METADATA:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            if value[:1] == b"\x00":  # grpc-core's true-binary form (when the runtime allows it)
                out.append((key, value[1:]))
            else:
                out.append((key, _bin_value(name, value)))
        else:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def frame_message(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def unframe_messages(data: bytes, encoding: bytes | None, max_bytes: int = 1 << 62) -> list[bytes]:
    """Split a gRPC request body into messages, decompressing if the client compressed.

    A message is at most ``max_bytes`` after decompression (MessageTooLarge)."""
    out, i = [], 0
    while i < len(data):
        if len(data) - i < 5:
            raise MessageError("truncated gRPC message prefix")
        compressed, length = data[i], int.from_bytes(data[i + 1:i + 5], "big")
        body = data[i + 5:i + 5 + length]
        if len(body) != length:
            raise MessageError("truncated gRPC message")
        if compressed:
            body = decompress(body, encoding, max_bytes)
        elif length > max_bytes:
            raise MessageTooLarge(f"request larger than {max_bytes} bytes")
        out.append(body)
        i += 5 + length
    return out


def _metadata_headers(md: Iterable[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in md:
        if isinstance(v, bytes) and k.endswith("-bin"):
            out.append((k.encode(), base64.b64encode(v).rstrip(b"=")))
        else:
            out.append((k.encode(), v.encode() if isinstance(v, str) else v))
    return out


def trailers(code: grpc.StatusCode, message: str = "", md: Iterable[tuple[str, str | bytes]] = (),
             trailers_only: bool = False) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = list(RESPONSE_HEADERS) if trailers_only else []
    out.append((b"grpc-status", str(code.value[0]).encode()))
    if message:
        out.append((b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
    out += _metadata_headers(md)
    return out
