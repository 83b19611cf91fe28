"""What goes to the client, in order: the runtime's frames and the shim's own.

Both share one connection, so the shim's own frames (answers, RST_STREAM, WINDOW_UPDATE,
PING ACK, GOAWAY) never go inside a runtime header block left open (HEADERS without
END_HEADERS, then CONTINUATION): they wait for its END_HEADERS (``deferred``;
``deferred_bytes`` counts like a write buffer in connection.py).
"""

from __future__ import annotations

from . import http2


class ClientOutput:
    __slots__ = ("deferred", "deferred_bytes", "frames", "runtime_block_open")

    def __init__(self) -> None:
        self.frames: list[bytes] = []  # for the client, in order (RelayCore.take_client)
        self.runtime_block_open = False  # a runtime header block is open on the client connection
        self.deferred: list[bytes] = []  # the shim's frames waiting for that block to end
        self.deferred_bytes = 0

    def emit(self, data: bytes) -> None:
        """Frames of the shim's own."""
        if self.runtime_block_open:
            self.deferred.append(data)
            self.deferred_bytes += len(data)
        else:
            self.frames.append(data)

    def runtime_block(self, flags: int, raw: bytes) -> bool:
        """A runtime HEADERS or CONTINUATION frame; True if it ended the block."""
        self.frames.append(raw)
        if not flags & http2.END_HEADERS:
            self.runtime_block_open = True
            return False
        self.runtime_block_open = False
        if self.deferred:
            self.frames.extend(self.deferred)
            self.deferred = []
            self.deferred_bytes = 0
        return True

    def take(self) -> bytes:
        out = self.frames
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data
