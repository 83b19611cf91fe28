"""gRPC over HTTP/2, the parts needed to answer an intercepted call ourselves."""

from __future__ import annotations

import base64
import gzip
import zlib
from typing import Iterable
from urllib.parse import quote

import grpc

_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# Request headers that describe the hop, not the call: not passed to handlers as metadata.
_NOT_METADATA = frozenset({b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                           b"user-agent", b"host"})
RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


class MessageError(ValueError):
    pass


def parse_timeout(value: bytes) -> float | None:
    try:
        return int(value[:-1]) * _UNITS[value[-1:]]
    except (ValueError, KeyError):
        return None


def metadata(headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """Call metadata as grpc-python wants it (``-bin`` values decoded to bytes)."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name[:1] == b":" or name in _NOT_METADATA:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            if value[:1] == b"\x00":  # grpc-core's true-binary form (when the runtime allows it)
                out.append((key, value[1:]))
            else:
                out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def frame_message(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def unframe_messages(data: bytes, encoding: bytes | None) -> list[bytes]:
    """Split a gRPC request body into messages, decompressing if the client compressed."""
    out, i = [], 0
    while i < len(data):
        if len(data) - i < 5:
            raise MessageError("truncated gRPC message prefix")
        compressed, length = data[i], int.from_bytes(data[i + 1:i + 5], "big")
        body = data[i + 5:i + 5 + length]
        if len(body) != length:
            raise MessageError("truncated gRPC message")
        if compressed:
            if encoding == b"gzip":
                body = gzip.decompress(body)
            elif encoding == b"deflate":
                body = zlib.decompress(body)
            else:
                raise MessageError(f"unsupported grpc-encoding {encoding!r}")
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
