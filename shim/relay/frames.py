"""The frame layer: a byte stream cut into frames, and the rules every client frame obeys.

- ``FrameBuffer`` keeps the bytes of a frame not complete yet. The loops that walk the
  frames (core.py, one per direction) read each 9-byte frame header with one
  ``HEADER`` call, without an object per frame: that is the relay's hot path.
- ``check`` is the frame layer of RFC 9113 for what a client sends, as containerd's
  grpc-go (on Go's x/net/http2 framer) judges it: wrong fixed lengths (PING 8,
  RST_STREAM and WINDOW_UPDATE 4, PRIORITY 5, SETTINGS a multiple of 6, its ACK empty,
  GOAWAY at least 8) -> FRAME_SIZE_ERROR; SETTINGS, PING or GOAWAY on a stream, DATA,
  PRIORITY or RST_STREAM on stream 0, bad DATA padding, PUSH_PROMISE from a client ->
  PROTOCOL_ERROR. (HEADERS and CONTINUATION: headers.py.) A frame above the advertised
  MAX_FRAME_SIZE is checked by the loop, before the frame is complete.
"""

from __future__ import annotations

import struct

from . import http2
from .http2 import H2Error

# A frame's 9-byte header at an offset: (length << 8 | type, flags, R bit | stream id).
HEADER = struct.Struct(">IBI").unpack_from

_FRAME_NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY",
                "WINDOW_UPDATE", "CONTINUATION")
_FIXED_LENGTH = {http2.PING: 8, http2.RST_STREAM: 4, http2.WINDOW_UPDATE: 4, http2.PRIORITY: 5}
_NOT_ON_STREAM_0 = frozenset((http2.DATA, http2.RST_STREAM, http2.PRIORITY))
_ONLY_ON_STREAM_0 = frozenset((http2.SETTINGS, http2.PING, http2.GOAWAY))


def frame_name(ftype: int) -> str:
    return _FRAME_NAMES[ftype] if ftype < len(_FRAME_NAMES) else f"frame type {ftype}"


class FrameBuffer:
    """The start of a frame that has not fully arrived."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def join(self, data: bytes) -> bytes:
        """What is pending, followed by ``data``."""
        return self.pending + data if self.pending else data

    def keep(self, buf: bytes, i: int) -> None:
        """Frames before ``i`` are consumed: keep the rest for the next call."""
        self.pending = buf[i:]


def check(ftype: int, flags: int, sid: int, length: int, raw: bytes) -> None:
    """Raise H2Error if a client frame (not HEADERS or CONTINUATION) breaks the frame layer."""
    if ftype in _ONLY_ON_STREAM_0:
        if ftype == http2.PING and length != 8:  # PING: its length is checked first
            raise H2Error(f"PING frame of {length} bytes", http2.FRAME_SIZE_ERROR)
        if sid:
            raise H2Error(f"{frame_name(ftype)} on stream {sid}")
        if ftype == http2.SETTINGS:
            if flags & http2.ACK:
                if length:
                    raise H2Error(f"SETTINGS ACK with {length} bytes", http2.FRAME_SIZE_ERROR)
            elif length % 6:
                raise H2Error(f"SETTINGS frame of {length} bytes", http2.FRAME_SIZE_ERROR)
        elif ftype == http2.GOAWAY and length < 8:
            raise H2Error(f"GOAWAY frame of {length} bytes", http2.FRAME_SIZE_ERROR)
        return
    fixed = _FIXED_LENGTH.get(ftype)
    if fixed is not None and length != fixed:
        raise H2Error(f"{frame_name(ftype)} frame of {length} bytes", http2.FRAME_SIZE_ERROR)
    if sid == 0 and ftype in _NOT_ON_STREAM_0:
        raise H2Error(f"{frame_name(ftype)} on stream 0")
    if ftype == http2.DATA and flags & http2.PADDED and (length == 0 or raw[9] >= length):
        raise H2Error("DATA frame padding exceeds its length")
    if ftype == http2.PUSH_PROMISE:
        raise H2Error("PUSH_PROMISE from a client")
