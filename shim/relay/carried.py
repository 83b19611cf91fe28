"""The runtime's header blocks on a stream the shim answers: carried to the client, after the answer.

When a client's first header block on a stream changes the HPACK table and the shim
answers (or refuses) the stream itself, the block still goes to the runtime, whose decoder
mirrors the client's encoder, and the stream is cancelled there (core ``_cancel_upstream``,
``StreamTable.drop_runtime``). grpc-go may answer such a stream before it reads the cancel:
CRI-O answers a method it does not have (StreamImages) with trailers at once. That answer
is not the client's: its DATA never reaches the client (its window goes back to the
runtime), nor does a header block that leaves the runtime's encoder table as it was.

A header block that changed the runtime's encoder table (grpc-go indexes every field: a
literal with incremental indexing, or a table size update) cannot be dropped: the client's
decoder mirrors that table, and without the block every later runtime header block would
decode wrongly there (wrong headers, or the connection failing with COMPRESSION_ERROR).
It goes to the client as the runtime sent it, on its own stream, once the shim's answer
has ended that stream: a header block on a closed stream, which gRPC clients decode (their
HPACK table stays in step) and otherwise ignore (RFC 9113 5.1: at most a stream error).

Until the shim's answer ends, the block waits at its place among the runtime's frames
(the held queue, flow.py), and every runtime frame after it waits too; the stream it
waits for may still send its own DATA. An answer that does not end within
``server.stream_stall_seconds`` is reset (RST_STREAM CANCEL, its handler cancelled), and
the block goes.
"""

from __future__ import annotations

from collections.abc import Container

from .flow import ClientWindow
from .hpack_decoder import changes_table
from .http2 import END_HEADERS, H2Error, header_block_fragment


class Carried:
    """A runtime header block (its frames as sent) held until the shim's answer on ``sid`` ends."""

    __slots__ = ("blocked_since", "frames", "open", "sid", "size")

    def __init__(self, sid: int, frames: list[bytes], open_streams: Container[int]) -> None:
        self.sid = sid
        self.frames = frames
        self.open = open_streams  # the streams the shim is answering (StreamTable.local)
        self.size = sum(map(len, frames))
        self.blocked_since: float | None = None  # when it first waited at the head of the held frames

    def send(self, window: ClientWindow, max_frame: int, out: list[bytes]) -> bool:
        if self.sid in self.open:
            return False
        out.extend(self.frames)
        return True

    def due(self, now: float, stall: float) -> float | None:
        """None when it has waited at the head for ``stall`` seconds; else when it will have."""
        if self.blocked_since is None:
            self.blocked_since = now
        if now - self.blocked_since >= stall:
            return None
        return self.blocked_since + stall


class BlockReader:
    """Collects the runtime's header block on a cancelled stream, frame by frame (a header
    block is never interleaved with other frames, so one at a time)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def frame(self, flags: int, raw: bytes) -> list[bytes] | None:
        """A HEADERS or CONTINUATION frame (``raw``, header included); at the block's end, its
        frames if it changed the HPACK table (they must reach the client), else None."""
        self.parts.append(raw)
        if not flags & END_HEADERS:
            return None
        frames, self.parts = self.parts, []
        try:
            block = b"".join(header_block_fragment(f[3], f[4], f[9:]) for f in frames)
        except H2Error:
            return frames  # unreadable: the client's decoder judges it, as it would have without the shim
        return frames if changes_table(block) else None
