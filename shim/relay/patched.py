"""Patched streams: relayed calls whose response messages the shim rewrites (``Patch``).

A patched stream is relayed like any other: its request frames go to the runtime as
they are, and the runtime's HEADERS, CONTINUATION, trailers and RST_STREAM reach the
client byte for byte and in order with every other runtime frame (the client's HPACK
table mirrors the runtime's: no header block is dropped, reordered or re-encoded). Only
its DATA differs:

- the shim consumes it: the runtime gets its window back at once, connection and stream
  level (the client never sees those bytes, so it would never refund them; a message
  larger than the client's windows would otherwise never complete). The client's
  WINDOW_UPDATEs on the stream are the shim's (absorbed), so the runtime's stream window
  stays what the client's SETTINGS give it, raised to at least ``RUNTIME_WINDOW_FLOOR``
  (a client whose initial window is 0 opens its streams by WINDOW_UPDATE: the runtime
  never sees those, and would wait forever). A top-up cannot be taken back: a client that
  raises its initial window later gives the runtime that much on top (at most 64 KiB more
  than the client's SETTINGS say; a client going from below 64 KiB to within 64 KiB of
  2^31-1 would overflow the runtime's window, FLOW_CONTROL_ERROR from the runtime);
- the gRPC messages (5-byte prefix) are collected from the DATA, whatever the frame
  split; each whole message is rewritten (``Patch.rewrite``; a compressed one passes as
  it is) and sent as the shim's own DATA on that stream (``Out``): within the client's
  connection window (``ClientWindow.spend_own``: the client's refund of it is the
  shim's, not the runtime's), the client's window for the stream (tracked here: the
  client's initial window and its WINDOW_UPDATEs on the stream, absorbed) and its
  largest frame. What cannot go at once waits in ``ClientWindow.held``, and every
  runtime frame after it waits too, so the trailers follow the rewritten messages;
- a message over ``server.max_message_bytes`` (the bound of every response the shim
  reads) ends the call: RST_STREAM CANCEL to the runtime, RESOURCE_EXHAUSTED to the
  client naming the key.

A stream the shim or the client ended is kept as ``discard`` (the newest
``DISCARDED_MEMORY``): the runtime's DATA and RST_STREAM on it are consumed (DATA
refunded); its header blocks still pass (HPACK), and the client ignores them on a
stream it closed. Its count in ``server.max_intercepted_calls`` is free once nothing of
its answer is held (a runtime sends nothing more after a RST_STREAM: waiting for its end
would keep the count for the connection's life).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from ..observability import logs
from . import grpcwire, http2
from .flow import ClientWindow
from .http2 import DATA, END_STREAM, PADDED, H2Error
from .memory import Pool

RUNTIME_WINDOW_FLOOR = http2.DEFAULT_WINDOW  # the least stream window the runtime has on a patched stream
_log = logs.get("relay")
DISCARDED_MEMORY = 1024  # ended patched streams remembered, to consume the runtime's late DATA
LIMIT_KEY = "server.max_message_bytes"
_PREFIX = 5


class PatchedStream:
    __slots__ = ("buf", "counted", "discard", "ended", "method", "pending", "received", "rewrite",
                 "runtime_window", "send_window", "sid")

    def __init__(self, sid: int, method: str, rewrite: Callable[[bytes], bytes], send_window: int) -> None:
        self.sid = sid
        self.method = method
        self.rewrite = rewrite
        self.buf = bytearray()  # the runtime's DATA not yet a whole message
        self.received = 0  # bytes of the runtime's messages on this stream (bounded: a unary answer)
        self.send_window = send_window  # what the shim may still send the client on this stream
        self.runtime_window = send_window  # what the runtime may still send on it, as it knows it
        self.pending = 0  # ``Out`` items of this stream not yet sent
        self.ended = False  # the runtime ended the stream (END_STREAM or RST_STREAM)
        self.discard = False  # ended by the shim or the client: the runtime's DATA is consumed
        self.counted = True  # counted in server.max_intercepted_calls (until its answer is sent or dropped)


class Out:
    """Rewritten DATA of one stream, sent as the windows allow (flow.OwnData)."""

    __slots__ = ("blocked_since", "data", "end_stream", "owner", "pos", "size", "stream")

    def __init__(self, owner: Patching, stream: PatchedStream, data: bytes, end_stream: bool) -> None:
        self.owner = owner
        self.stream = stream
        self.data = data
        self.pos = 0
        self.size = len(data)
        self.end_stream = end_stream
        self.blocked_since: float | None = None  # waiting for the client's windows since (the core's clock)
        stream.pending += 1

    def send(self, window: ClientWindow, max_frame: int, out: list[bytes]) -> bool:
        s = self.stream
        if s.discard:  # reset since: nothing more of it goes out
            self._done()
            return True
        data, pos, n, sid = self.data, self.pos, self.size, s.sid
        while pos < n:
            room = min(window.window, s.send_window, max_frame, n - pos)
            if room <= 0:
                if pos != self.pos:
                    self.blocked_since = None  # it moved: the stall counts from now on
                self.pos = pos
                return False
            chunk = data[pos:pos + room]
            pos += room
            out.append(http2.frame(DATA, END_STREAM if pos == n and self.end_stream else 0, sid, chunk))
            window.spend_own(room)
            s.send_window -= room
        if not n and self.end_stream:
            out.append(http2.frame(DATA, END_STREAM, sid))
        self.pos = pos
        self._done()
        return True

    def _done(self) -> None:
        s = self.stream
        s.pending -= 1
        if not s.pending:
            if s.discard:
                self.owner.uncount(s)  # the last of it the shim held is gone
            elif s.ended:
                self.owner.forget(s.sid)


class Patching:
    """The patched streams of one connection (see the module docstring)."""

    __slots__ = ("_discarded", "calls", "limit", "streams", "to_runtime", "trusted", "window")

    def __init__(self, window: ClientWindow, to_runtime: list[bytes], limit: int, calls: Pool,
                 trusted: bool) -> None:
        self.window = window
        self.to_runtime = to_runtime  # the core's list: frames for the runtime, in order
        self.limit = limit  # server.max_message_bytes
        self.calls = calls  # server.max_intercepted_calls: a patched stream counts as one until forgotten
        self.trusted = trusted  # the connection's client is in server.trusted_uids (memory.py's shares)
        self.streams: dict[int, PatchedStream] = {}
        self._discarded: dict[int, None] = {}  # oldest first

    def open(self, sid: int, method: str, rewrite: Callable[[bytes], bytes], send_window: int) -> None:
        """A new patched stream (its request HEADERS already queued for the runtime), admitted
        in ``calls`` by the caller (memory.Budget.admit_call)."""
        s = self.streams[sid] = PatchedStream(sid, method, rewrite, send_window)
        self._floor(s)

    def _floor(self, s: PatchedStream) -> None:
        if s.runtime_window < RUNTIME_WINDOW_FLOOR:
            self.to_runtime.append(http2.window_update(s.sid, RUNTIME_WINDOW_FLOOR - s.runtime_window))
            s.runtime_window = RUNTIME_WINDOW_FLOOR

    def forget(self, sid: int) -> None:
        self._drop(sid)
        self._discarded.pop(sid, None)

    def _drop(self, sid: int) -> None:
        """``sid`` is no longer kept: its count in ``calls`` is free."""
        s = self.streams.pop(sid, None)
        if s is not None:
            self.uncount(s)

    def uncount(self, s: PatchedStream) -> None:
        """Nothing of ``s``'s answer is held any more: its count in ``calls`` is free (a
        discarded stream stays only as an id, bounded by ``DISCARDED_MEMORY``)."""
        if s.counted:
            s.counted = False
            self.calls.give(1, self.trusted)

    # ------------------------------------------------------------------ runtime -> client

    def data(self, sid: int, flags: int, raw: bytes, length: int, out: list[bytes], max_frame: int,
             responding: bool) -> bytes | None:
        """The runtime's DATA on a patched stream. Returns trailers for the client if the
        message is over the bound (the caller sends them in order and ends the stream)."""
        s = self.streams[sid]
        end = flags & END_STREAM
        if length:
            self.to_runtime.append(http2.window_update(0, length))
            if not end and not s.discard:
                self.to_runtime.append(http2.window_update(sid, length))
        if s.discard:
            if end:
                self.forget(sid)
            return None
        payload = raw[9:]
        if flags & PADDED and payload:
            payload = payload[1:len(payload) - payload[0]]
        s.received += len(payload)
        if s.received > self.limit + _PREFIX:  # one message and its prefix at most: a unary answer
            return self._over(s, s.received - _PREFIX, responding)
        buf = s.buf
        buf += payload
        chunks: list[bytes] = []
        pos, n = 0, len(buf)
        while n - pos >= _PREFIX:
            size = int.from_bytes(buf[pos + 1:pos + 5], "big")
            if size > self.limit:
                return self._over(s, size, responding)
            if n - pos - _PREFIX < size:
                break
            body = bytes(buf[pos + _PREFIX:pos + _PREFIX + size])
            if not buf[pos]:  # not compressed
                body = self._rewrite(s, body)
            chunks.append(bytes(buf[pos:pos + 1]) + len(body).to_bytes(4, "big") + body)
            pos += _PREFIX + size
        del buf[:pos]
        if end:
            if buf:  # an incomplete message at the end: the runtime's bytes, as they are
                chunks.append(bytes(buf))
                buf.clear()
            s.ended = True
        if chunks or end:
            self._send(Out(self, s, b"".join(chunks), bool(end)), out, max_frame)
        if end and not s.pending:
            self.forget(sid)
        return None

    @staticmethod
    def _rewrite(s: PatchedStream, body: bytes) -> bytes:
        try:
            return s.rewrite(body)
        except Exception:  # noqa: BLE001  (a bug in a rewrite: this answer passes as the runtime sent it)
            _log.error("rewriting a response failed; passed on as it is", extra={"fields": {"method": s.method}},
                       exc_info=True)
            return body

    def _send(self, item: Out, out: list[bytes], max_frame: int) -> None:
        window = self.window
        if window.held or not item.send(window, max_frame, out):
            window.hold_own(item)

    def _over(self, s: PatchedStream, size: int, responding: bool) -> bytes:
        self.to_runtime.append(http2.rst_stream(s.sid, http2.CANCEL))
        self.discard(s)
        message = (f"cri-shim: the runtime's response message of {size} bytes is over {self.limit} "
                   f"({LIMIT_KEY})")
        return http2.encode_headers(grpcwire.trailers(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                                                      trailers_only=not responding))

    def runtime_trailers(self, sid: int, out: list[bytes], max_frame: int) -> None:
        """The runtime's trailers (HEADERS with END_STREAM) on a patched stream, before they pass."""
        s = self.streams[sid]
        if s.discard:  # the runtime's last frame on it: nothing more to consume
            self.forget(sid)
            return
        s.ended = True
        if s.buf:  # an incomplete message: the runtime's bytes, as they are
            self._send(Out(self, s, bytes(s.buf), False), out, max_frame)
            s.buf.clear()
        if not s.pending:
            self.forget(sid)

    def runtime_reset(self, sid: int) -> bool:
        """The runtime's RST_STREAM: what the shim still holds for the stream is dropped.
        True if the client must not get it (the stream was ended already)."""
        s = self.streams[sid]
        dropped = s.discard
        s.discard = True
        s.buf.clear()
        self.forget(sid)
        return dropped

    # ------------------------------------------------------------------ client -> runtime

    def client_reset(self, sid: int) -> None:
        s = self.streams.get(sid)
        if s is not None and not s.discard:
            self.discard(s)

    def window_update(self, sid: int, inc: int) -> bool:
        """The client's WINDOW_UPDATE on a patched stream (absorbed: the shim refunded the
        runtime). False if it is a stream error (increment 0, window above 2^31-1)."""
        s = self.streams[sid]
        if s.discard:
            return True
        s.send_window += inc
        return inc != 0 and s.send_window <= http2.MAX_WINDOW

    def initial_window_changed(self, delta: int) -> None:
        """The client's SETTINGS_INITIAL_WINDOW_SIZE changed by ``delta`` (the runtime has it too)."""
        for s in self.streams.values():
            s.send_window += delta
            if s.send_window > http2.MAX_WINDOW:
                raise H2Error("a stream window above 2^31-1", http2.FLOW_CONTROL_ERROR)
            if not s.discard and not s.ended:
                s.runtime_window += delta
                self._floor(s)

    def stalled(self, now: float, stall: float) -> tuple[PatchedStream | None, float | None]:
        """The stream whose rewritten answer has waited for the client's windows for ``stall``
        seconds at the head of the held frames (``server.stream_stall_seconds``), and when to
        look again (None: nothing of the shim's is waiting)."""
        held = self.window.held
        if not held or isinstance(held[0], bytes):
            return None, None
        head = held[0]
        if not isinstance(head, Out):
            return None, None
        if head.blocked_since is None:
            head.blocked_since = now
        if now - head.blocked_since < stall:
            return None, head.blocked_since + stall
        return head.stream, None

    def discard(self, s: PatchedStream) -> None:
        """The shim or the client ended ``s``: consume what the runtime still sends on it."""
        s.discard = True
        s.buf = bytearray()
        if not s.pending:  # else when the last of what is held for it goes (Out._done)
            self.uncount(s)
        discarded = self._discarded
        discarded[s.sid] = None
        if len(discarded) > DISCARDED_MEMORY:
            old = next(iter(discarded))
            del discarded[old]
            self._drop(old)

    def lost(self) -> None:
        """The runtime connection (or the client's) is gone: nothing is kept."""
        for sid in list(self.streams):
            self._drop(sid)
        self._discarded.clear()
