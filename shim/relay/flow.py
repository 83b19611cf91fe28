"""Flow control (RFC 9113 6.9): the client's window toward it, and what the shim refunds.

- ``ClientWindow``: the connection-level window of what goes to the client, shared
  between the runtime's DATA and the shim's own. The core keeps the client's real
  window, holds the runtime's DATA (and every runtime frame after it, in order) while
  the window is short, and keeps the part of a client WINDOW_UPDATE that repays the
  shim's own DATA (``owed``); the rest goes to the runtime.
- Stream windows of intercepted streams are fields of ``LocalStream`` (streams.py):
  ``send_window`` (what the shim may send; the client's WINDOW_UPDATEs and SETTINGS move
  it) and ``recv_window`` (what the client may send; enforced, FLOW_CONTROL_ERROR).
- Held items may also be the shim's rewritten DATA of a patched stream (``OwnData``,
  patched.py), gated by the client's window for that stream as well; everything after
  it waits, in order.
- ``Refunds``: DATA the shim consumes (intercepted requests, late frames, streams
  without a runtime) is refunded in one batch of WINDOW_UPDATEs per read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from . import http2
from .http2 import H2Error
from .streams import LocalStream


class OwnData(Protocol):
    """The shim's own DATA held in order with the runtime's frames (patched.py's ``Out``)."""

    size: int  # bytes counted in ``held_bytes`` while it is held

    def send(self, window: ClientWindow, max_frame: int, out: list[bytes]) -> bool:
        """Append the DATA frames the windows allow now to ``out``; True when all went (or it was dropped)."""


class ClientWindow:
    __slots__ = ("held", "held_bytes", "owed", "window")

    def __init__(self) -> None:
        self.window = http2.DEFAULT_WINDOW  # what may still be sent to the client (connection level)
        self.owed = 0  # bytes of the shim's own DATA the client has not yet refunded
        self.held: deque[bytes | OwnData] = deque()  # runtime frames (and OwnData) waiting for the client's window
        self.held_bytes = 0

    def hold(self, raw: bytes) -> None:
        self.held.append(raw)
        self.held_bytes += len(raw)

    def hold_own(self, item: OwnData) -> None:
        self.held.append(item)
        self.held_bytes += item.size

    def update(self, inc: int) -> int:
        """The client's connection WINDOW_UPDATE; returns the part that is the runtime's."""
        self.window += inc
        if self.window > http2.MAX_WINDOW:
            raise H2Error("connection window above 2^31-1", http2.FLOW_CONTROL_ERROR)
        repay = min(inc, self.owed)
        self.owed -= repay
        return inc - repay

    def spend_own(self, n: int) -> None:
        """The shim sends ``n`` bytes of its own DATA."""
        self.window -= n
        self.owed += n

    def release(self, max_frame: int) -> list[bytes]:
        """The held frames the windows let through now, in order (``max_frame``: the client's
        largest frame, for the shim's own DATA)."""
        out: list[bytes] = []
        held = self.held
        while held:
            raw = held[0]
            if not isinstance(raw, bytes):
                if not raw.send(self, max_frame, out):
                    break
                held.popleft()
                self.held_bytes -= raw.size
                continue
            if raw[3] == http2.DATA:
                length = len(raw) - 9
                if length > self.window:
                    break
                self.window -= length
            held.popleft()
            self.held_bytes -= len(raw)
            out.append(raw)
        return out


class Refunds:
    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn = 0  # consumed DATA bytes not yet refunded on the connection

    def frames(self, local: Iterable[LocalStream]) -> bytes:
        """WINDOW_UPDATEs for the DATA the shim consumed since the last call."""
        out = []
        if self.conn:
            out.append(http2.window_update(0, self.conn))
            self.conn = 0
        for s in local:
            if s.unrefunded:
                if not s.client_ended:
                    out.append(http2.window_update(s.sid, s.unrefunded))
                    s.recv_window += s.unrefunded
                s.unrefunded = 0
        return b"".join(out)
