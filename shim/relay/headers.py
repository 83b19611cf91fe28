"""Client header blocks: HEADERS + CONTINUATION assembled, and request header sections checked.

- ``HeaderBlock`` gathers one block: a HEADERS frame and the CONTINUATION frames of the
  same stream up to END_HEADERS. Any other frame inside an open block is a connection
  error (RFC 9113 6.10), checked by the caller for every frame (``HeaderBlock.sid``);
  at most ``max_header_list_bytes`` of fragments are buffered (PROTOCOL_ERROR beyond, as
  x/net does). The frames are kept as they came: a relayed block goes on unchanged.
- ``malformed`` says why a decoded request header (or trailer) section is malformed
  (RFC 9113 8.2, 8.3), or "".
"""

from __future__ import annotations

from . import http2
from .frames import frame_name
from .http2 import H2Error

_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))
_REQUIRED_PSEUDO = (b":method", b":scheme", b":path")
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                  b"upgrade"))
_UPPER = bytes(range(ord("A"), ord("Z") + 1))

# a complete block: stream id, the HEADERS frame's flags, the frames as received, the block
Block = tuple[int, int, list[bytes], bytes]


class HeaderBlock:
    """The client's open header block, if any (``sid`` 0: none)."""

    __slots__ = ("flags", "fragments", "frames", "limit", "sid", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # server.max_header_list_bytes
        self.sid = 0
        self.flags = 0
        self.frames: list[bytes] = []
        self.fragments: list[bytes] = []
        self.size = 0

    def add(self, ftype: int, flags: int, sid: int, raw: bytes) -> Block | None:
        """A HEADERS or CONTINUATION frame (``raw``, header included); the block once it is complete."""
        if sid == 0:
            raise H2Error(f"{frame_name(ftype)} on stream 0")
        if ftype == http2.HEADERS:
            self.sid, self.flags = sid, flags
            fragment = http2.header_block_fragment(ftype, flags, raw[9:])
        elif not self.sid:
            raise H2Error(f"CONTINUATION on stream {sid} without an open header block")
        else:
            fragment = raw[9:]
        self.size += len(fragment)
        if self.size > self.limit:
            raise H2Error(f"header block of stream {sid} larger than server.max_header_list_bytes "
                          f"({self.limit} bytes)")
        self.frames.append(raw)
        self.fragments.append(fragment)
        if not flags & http2.END_HEADERS:
            return None
        frames, fragments, first_flags = self.frames, self.fragments, self.flags
        self.frames, self.fragments, self.sid, self.size = [], [], 0, 0
        return sid, first_flags, frames, fragments[0] if len(fragments) == 1 else b"".join(fragments)


def malformed(fields: list[tuple[bytes, bytes]], trailers: bool = False) -> str:
    """Why a request header (or trailer) section is malformed (RFC 9113 8.2, 8.3), or ""."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if not name or name.translate(None, _UPPER) != name:
            return f"header name {name!r} is not lowercase"
        if name[:1] == b":":
            if trailers:
                return f"pseudo-header {name!r} in trailers"
            if regular:
                return f"pseudo-header {name!r} after a regular header"
            if name not in _REQUEST_PSEUDO:
                return f"pseudo-header {name!r} is not a request pseudo-header"
            if name in seen:
                return f"pseudo-header {name!r} twice"
            if name == b":path" and not value:
                return "empty :path"
            seen.add(name)
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                return f"connection-specific header {name!r}"
    if not trailers:
        for name in _REQUIRED_PSEUDO:
            if name not in seen:
                return f"no {name.decode()} pseudo-header"
    return ""
